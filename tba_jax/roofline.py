"""What the hardware allows: the bytes a decode step must move and the FLOPs a learner step
must compute, from a model's shapes alone (`benchmarks/gpu_throughput.py` prints measured
figures as fractions of these).

Decode is memory-bound: each step reads every weight the step multiplies by once and
each row's KV cache up to its position, so at HBM bandwidth `hbm_bytes_per_s`

    tokens/s ≤ batch × hbm_bytes_per_s / (weight bytes + batch × cached tokens × bytes per token)

averaged over the response (the cache grows from `prompt` to `prompt + new` tokens). The
input embedding is a gather of `batch` rows, not a read of the table, unless the output
head is tied to it.

A learner step (forward and backward) computes 6 FLOPs per parameter per token that
multiplies (the embedding gather is not a matmul) plus causal attention's
6 · layers · heads · head_dim · sequence per token (12 for full attention, halved by the
mask); model FLOP utilisation (MFU) divides by the device's dense peak.
"""

from __future__ import annotations

from typing import NamedTuple

from tba_jax.models import ModelConfig

# H100 SXM: HBM3 bandwidth and dense bf16 tensor-core peak (NVIDIA's datasheet).
H100_HBM_BYTES_PER_S = 3.35e12
H100_DENSE_BF16_FLOPS = 989e12


class DevicePeaks(NamedTuple):
    """A device's memory bandwidth and dense bf16 matmul peak (its datasheet's)."""

    name: str
    hbm_bytes_per_s: float
    dense_bf16_flops: float


H100_SXM = DevicePeaks("H100 SXM", H100_HBM_BYTES_PER_S, H100_DENSE_BF16_FLOPS)
# (a substring of JAX's `device_kind`, the device's peaks), the more specific first:
# NVIDIA's and Google Cloud's datasheets, dense (not sparse) bf16.
DEVICE_PEAKS = (
    ("H200 NVL", DevicePeaks("H200 NVL", 4.8e12, 835e12)),
    ("H200", DevicePeaks("H200 SXM", 4.8e12, 989e12)),
    ("H100 NVL", DevicePeaks("H100 NVL", 3.9e12, 835e12)),
    ("H100 PCIe", DevicePeaks("H100 PCIe", 2.0e12, 756e12)),
    ("H100", H100_SXM),
    ("A100-SXM4-80GB", DevicePeaks("A100 SXM 80GB", 2.039e12, 312e12)),
    ("A100 80GB PCIe", DevicePeaks("A100 PCIe 80GB", 1.935e12, 312e12)),
    ("A100", DevicePeaks("A100 40GB", 1.555e12, 312e12)),
    ("TPU v6 lite", DevicePeaks("TPU v6e", 1.64e12, 918e12)),
    ("TPU v5 lite", DevicePeaks("TPU v5e", 0.819e12, 197e12)),
    ("TPU v5", DevicePeaks("TPU v5p", 2.765e12, 459e12)),
    ("TPU v4", DevicePeaks("TPU v4", 1.2e12, 275e12)),
)


def device_peaks(device_kind: str) -> DevicePeaks | None:
    """The peaks of a device JAX names `device_kind` (e.g. "NVIDIA H100 80GB HBM3"), or
    None for one the table does not know (a CPU)."""
    for key, peaks in DEVICE_PEAKS:
        if key in device_kind:
            return peaks
    return None


def peaks_for(
    device_kind: str, hbm_tb_s: float | None = None, peak_tflops: float | None = None
) -> DevicePeaks:
    """The peaks a benchmark measures a device against: `hbm_tb_s` and `peak_tflops` where
    given, else the device's datasheet figures (`device_peaks`), or an H100 SXM's for a
    device the table does not know (its name then says so)."""
    known = device_peaks(device_kind)
    peaks = known or H100_SXM
    name = peaks.name if known else f"{peaks.name} (device {device_kind!r} not in roofline's table)"
    return DevicePeaks(
        name,
        peaks.hbm_bytes_per_s if hbm_tb_s is None else hbm_tb_s * 1e12,
        peaks.dense_bf16_flops if peak_tflops is None else peak_tflops * 1e12,
    )


def kv_bytes_per_token(cfg: ModelConfig, cache_bytes: int) -> int:
    """Bytes of one token's keys and values over every layer."""
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.resolved_head_dim * cache_bytes


def input_table_params(cfg: ModelConfig) -> int:
    """Params of the lookup tables a step gathers rows from instead of reading whole: the
    token embedding (unless the head is tied to it) and a learned position table."""
    gathered = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    if cfg.position_embedding == "learned":
        gathered += cfg.max_seq_len * cfg.d_model
    return gathered


def matmul_params(cfg: ModelConfig) -> int:
    """Params every token multiplies by (all but the gathered tables)."""
    return cfg.num_params() - input_table_params(cfg)


def decode_step_bytes(
    cfg: ModelConfig, batch: int, prompt: int, new: int, param_bytes: int, cache_bytes: int
) -> float:
    """Mean bytes one decode step of `batch` rows must read: the weights once and each
    row's cache at its mean length over the `new` steps (prompt + (new - 1) / 2 tokens)."""
    mean_cached = prompt + (new - 1) / 2
    weights = matmul_params(cfg) * param_bytes
    return weights + batch * mean_cached * kv_bytes_per_token(cfg, cache_bytes)


def decode_roofline_tokens_per_s(
    cfg: ModelConfig,
    batch: int,
    prompt: int,
    new: int,
    param_bytes: int,
    cache_bytes: int,
    hbm_bytes_per_s: float = H100_HBM_BYTES_PER_S,
) -> float:
    """The most tokens/s a memory-bound decode of this shape can make."""
    step_seconds = decode_step_bytes(cfg, batch, prompt, new, param_bytes, cache_bytes) / (
        hbm_bytes_per_s
    )
    return batch / step_seconds


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token on sequences of `seq_len` (π_ref scoring's pass): 2 per
    matmul parameter plus causal attention's 2 · layers · heads · head_dim · sequence."""
    attention = 2 * cfg.num_layers * cfg.num_heads * cfg.resolved_head_dim * seq_len
    return 2 * matmul_params(cfg) + attention


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token of a learner step on sequences of `seq_len`:
    three forward passes' worth (the backward pass computes two)."""
    return 3 * forward_flops_per_token(cfg, seq_len)
