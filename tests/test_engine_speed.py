"""benchmarks/engine_speed.py --smoke: both paths run on both length mixes and the JSON last
line carries every figure the benchmark reports (the figures themselves are not checked:
they are wall-clock times of tiny shapes). And the EOS bias that sets the mixes' lengths
holds on a model deeper and wider than the smoke run's."""

from __future__ import annotations

import json
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest
from support import run_repo_script

from benchmarks import engine_speed
from tba_jax.models import init_model, preset
from tba_jax.models.tokenizers import CharTokenizer

SCRIPT = "benchmarks/engine_speed.py"
SMOKE_SECONDS = 120  # ~13 s on 2 CPU cores, most of it imports and compiling

PATH_FIELDS = {
    "seconds",
    "cpu_ms_per_sample",
    "samples",
    "samples_per_s",
    "decode_steps",
    "slot_steps",
    "occupancy",
    "generating_s",
    "scoring_s",
    "mean_length",
    "max_length",
    "share_at_limit",
}
ENGINE_FIELDS = {"chunks", "prefills", "compactions"}


def run_benchmark(*args: str) -> subprocess.CompletedProcess:
    return run_repo_script(SCRIPT, *args, timeout=SMOKE_SECONDS)


def test_smoke_run_reports_both_paths_on_both_mixes():
    """In bfloat16 on float32 params, as a run's searchers decode on a GPU, with the three
    Pallas decode kernels (their interpreter here): the EOS bias still sets the lengths."""
    result = run_benchmark(
        "--smoke",
        "--dtype=bfloat16",
        "--param_dtype=float32",
        "--decode_attention=pallas",
        "--decode_mlp=pallas",
        "--decode_projection=pallas",
        "--decode_projection_kernel=16:16:16:2:4:2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["benchmark"] == "engine_speed"
    assert line["smoke"] is True and line["repeats"] == 1 and line["dtype"] == "bfloat16"
    assert line["param_dtype"] == "float32"
    assert (line["attention"], line["decode_attention"]) == ("einsum", "pallas")
    assert (line["decode_mlp"], line["decode_projection"]) == ("pallas", "pallas")
    assert line["decode_projection_kernel"] == "16:16:16:2:4:2"
    samples = line["prompts"] * line["samples_per_prompt"]
    assert line["samples_per_measurement"] == samples
    assert list(line["mixes"]) == ["long_tailed", "uniform"]
    for mix, figures in line["mixes"].items():
        assert set(figures["batch"]) >= PATH_FIELDS, mix
        assert set(figures["fused"]) >= PATH_FIELDS | ENGINE_FIELDS, mix
        for path in ("batch", "fused"):
            assert figures[path]["samples"] == samples, (mix, path)
            assert figures[path]["samples_per_s"] > 0, (mix, path)
            assert figures[path]["cpu_ms_per_sample"] > 0, (mix, path)
            assert 0 < figures[path]["occupancy"] <= 1, (mix, path)
        ratio = figures["fused"]["samples_per_s"] / figures["batch"]["samples_per_s"]
        assert abs(figures["fused_over_batch"] - ratio) < 1e-3 * ratio + 1e-4, mix
        assert isinstance(figures["compiles_while_timing"], int), mix
    uniform = line["mixes"]["uniform"]
    for path in ("batch", "fused"):  # EOS is never drawn: every response runs to the limit
        assert uniform[path]["share_at_limit"] == 1.0
        assert uniform[path]["occupancy"] == 1.0
    assert "mix          path" in result.stdout  # the table


def test_a_width_that_does_not_hold_whole_prompts_is_a_one_line_error():
    result = run_benchmark("--smoke", "--width=7", "--samples_per_prompt=2")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: --width=7")


@pytest.mark.parametrize(
    "flag, error",
    [
        ("--chunk_steps=0", "error: --chunk_steps=0 must be >= 1."),
        ("--refill_free=2", "error: --refill_free=2.0 must be in [0, 1]."),
        ("--compact_below=1", "error: --compact_below=1.0 must be in [0, 1)."),
        ("--attention=cudnn", "error: model.attention='cudnn' needs a half-precision compute"),
        ("--eos_bias=nan", "error: --eos_bias=nan must be a finite number."),
        ("--no_eos_bias=-inf", "error: --no_eos_bias=-inf must be a finite number."),
    ],
)
def test_a_bad_engine_flag_is_one_error_line_naming_the_flag(flag, error):
    result = run_benchmark("--smoke", flag)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(error)


@pytest.mark.parametrize("bias", [-50.0, 2.0])
def test_the_eos_bias_sets_the_eos_logit_at_every_position_of_a_deeper_model(bias):
    """`length_params` on the `small` preset in bfloat16 (4 layers, width 256): the EOS
    logit is the bias at every position and the other logits stay near 0, so the EOS
    probability per step is what the mixes assume. With the old carrier (embedding column
    0 = 3) the EOS logit came out at -31 for a bias of -50 here, and near 0 on rho-1b."""
    tokenizer = CharTokenizer.for_text()
    config = preset(
        "small", dtype="bfloat16", param_dtype="bfloat16", vocab_size=tokenizer.vocab_size
    )
    model, params = init_model(config, seed=0)
    tokens = jnp.asarray(
        np.random.default_rng(0).integers(3, tokenizer.vocab_size, size=(2, 48)), jnp.int32
    )
    positions = jnp.broadcast_to(jnp.arange(48), tokens.shape)
    valid = jnp.ones_like(tokens, bool)
    biased = engine_speed.length_params(params, tokenizer.eos_id, bias)
    logits = np.asarray(
        model.head(biased, model.features(biased, tokens, positions, valid)), np.float32
    )
    eos = logits[..., tokenizer.eos_id]
    assert eos.shape == (2, 48)
    np.testing.assert_allclose(eos, bias, atol=0.05 * abs(bias), rtol=0)
    others = np.delete(logits, tokenizer.eos_id, axis=-1)
    assert np.abs(others).max() < 0.05
