"""The roofline arithmetic `benchmarks/gpu_throughput.py` reports against, checked by hand
on the shape issue 14 quotes (qwen2.5-0.5b, 256 rows of 256 + 256 tokens: "about 2.2 GB"
a step, "about 390k tokens/s" at 3.35 TB/s) and on an untied model with learned positions,
whose lookup tables a step gathers from rather than reads."""

from __future__ import annotations

import dataclasses
import re

import pytest
from support import REPO_ROOT

from tba_jax import roofline
from tba_jax.models import ModelConfig, preset


def test_qwen_half_billion_decode_roofline_by_hand():
    cfg = preset("qwen2.5-0.5b")
    assert cfg.tie_embeddings  # the head reads the embedding table: every param is read
    weights = cfg.num_params() * 2  # bfloat16
    per_token = 24 * 2 * 2 * 64 * 2  # layers × (k, v) × kv heads × head_dim × bfloat16
    cache = 256 * (256 + 255 / 2) * per_token  # each row's mean cached tokens over 256 steps
    step = roofline.decode_step_bytes(cfg, 256, 256, 256, param_bytes=2, cache_bytes=2)
    assert step == pytest.approx(weights + cache)
    assert step == pytest.approx(2.19e9, rel=0.01)
    tokens_per_s = roofline.decode_roofline_tokens_per_s(cfg, 256, 256, 256, 2, 2)
    assert tokens_per_s == pytest.approx(256 / (step / 3.35e12))
    assert tokens_per_s == pytest.approx(391e3, rel=0.01)


def test_gathered_tables_are_not_read_whole():
    tied = ModelConfig(
        vocab_size=100,
        d_model=8,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        d_ff=16,
        max_seq_len=50,
        family="gpt2",
    )
    untied = dataclasses.replace(tied, tie_embeddings=False)
    # gpt2: learned positions (gathered); the tied token table is the head's matmul
    assert roofline.matmul_params(tied) == tied.num_params() - 50 * 8
    # untied: the token table is a gather too, the separate head a matmul
    assert roofline.matmul_params(untied) == untied.num_params() - 50 * 8 - 100 * 8
    assert untied.num_params() - tied.num_params() == 100 * 8


def test_learner_flops_per_token_by_hand():
    cfg = preset("qwen2.5-0.5b")
    # 6 per multiplying param (forward 2, backward 4), causal attention 6·L·H·hd·S
    expected = 6 * cfg.num_params() + 6 * 24 * 14 * 64 * 1024
    assert roofline.train_flops_per_token(cfg, 1024) == pytest.approx(expected)


def test_scoring_flops_per_token_by_hand():
    cfg = preset("qwen2.5-0.5b")
    # 2 per multiplying param, causal attention 2·L·H·hd·S (one forward pass)
    expected = 2 * cfg.num_params() + 2 * 24 * 14 * 64 * 512
    assert roofline.forward_flops_per_token(cfg, 512) == pytest.approx(expected)


@pytest.mark.parametrize(
    "device_kind, name, tb_s, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 3.35, 989),
        ("NVIDIA H100 PCIe", "H100 PCIe", 2.0, 756),
        ("NVIDIA H200", "H200 SXM", 4.8, 989),
        ("NVIDIA H200 NVL", "H200 NVL", 4.8, 835),
        ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB", 2.039, 312),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB", 1.555, 312),
        ("TPU v5 lite", "TPU v5e", 0.819, 197),
        ("TPU v5", "TPU v5p", 2.765, 459),
        ("TPU v4", "TPU v4", 1.2, 275),
    ],
)
def test_a_device_kind_names_its_datasheet_peaks(device_kind, name, tb_s, tflops):
    peaks = roofline.device_peaks(device_kind)
    assert (peaks.name, peaks.hbm_bytes_per_s, peaks.dense_bf16_flops) == (
        name,
        pytest.approx(tb_s * 1e12),
        pytest.approx(tflops * 1e12),
    )


def test_an_unknown_device_has_no_peaks():
    assert roofline.device_peaks("cpu") is None


@pytest.mark.parametrize("target", ["h100_sxm", "h200_sxm"])
def test_the_static_profiles_gpu_targets_match_the_peaks_table(target):
    """benchmarks/targets/<target>.txtpb (XLA's description of the GPU compiled for without
    it) names a device whose table bandwidth is the description's own."""
    text = (REPO_ROOT / "benchmarks" / "targets" / f"{target}.txtpb").read_text()
    kind = re.search(r'device_description_str: "([^"]+)"', text).group(1)
    bandwidth = float(re.search(r"memory_bandwidth: (\d+)", text).group(1))
    peaks = roofline.device_peaks(kind)
    assert peaks.name == {"h100_sxm": "H100 SXM", "h200_sxm": "H200 SXM"}[target]
    assert bandwidth == pytest.approx(peaks.hbm_bytes_per_s, rel=1e-3)


def test_a_benchmark_measures_against_the_devices_peaks_or_the_flags():
    assert roofline.peaks_for("NVIDIA H200") == roofline.device_peaks("NVIDIA H200")
    given = roofline.peaks_for("NVIDIA H200", hbm_tb_s=4.0, peak_tflops=900.0)
    assert (given.hbm_bytes_per_s, given.dense_bf16_flops) == (4.0e12, 900.0e12)
    unknown = roofline.peaks_for("cpu")
    assert unknown.name == "H100 SXM (device 'cpu' not in roofline's table)"
    assert unknown[1:] == roofline.H100_SXM[1:]
