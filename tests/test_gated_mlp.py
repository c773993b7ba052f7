"""`models.gated_mlp`, the Pallas kernel of a decode step's gated MLP hidden layer (run by
Pallas' interpreter on this CPU), against act(x W_gate) * (x W_up) written in NumPy:
row counts that are no multiple of a block (padded), widths its blocks shrink to tile,
each activation, bfloat16 inputs; its settings' checks; and
`benchmarks/gated_mlp_kernel.py`, which checks it so on a GPU."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import run_repo_script

from tba_jax.models import gated_mlp as kernel
from tba_jax.models.config import MlpKernelSettings, parse_mlp_kernel_settings
from tba_jax.models.transformer import ACTIVATION_FNS


def reference(x, w_gate, w_up, activation: str) -> np.ndarray:
    """act(x W_gate) * (x W_up) in float64."""
    gate, up = x @ w_gate, x @ w_up
    if activation == "silu":
        return gate / (1.0 + np.exp(-gate)) * up
    inner = np.sqrt(2.0 / np.pi) * (gate + 0.044715 * gate**3)  # gelu_new: tanh's
    return 0.5 * gate * (1.0 + np.tanh(inner)) * up


def random_case(rows: int, width: int, hidden: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, width))
    w_gate, w_up = (rng.normal(size=(width, hidden)) / np.sqrt(width) for _ in range(2))
    return x, w_gate, w_up


@pytest.mark.parametrize(
    "rows, width, hidden, settings, activation",
    [
        (5, 64, 96, MlpKernelSettings(), "silu"),  # rows padded to 16; 96 tiled by 32
        (37, 128, 256, MlpKernelSettings(32, 128, 32, 4, 2), "silu"),  # rows padded to 64
        (64, 48, 80, MlpKernelSettings(64, 64, 64, 4, 3), "gelu_new"),  # blocks of 16
    ],
    ids=["few-rows", "rows-over-blocks", "odd-widths-gelu"],
)
def test_the_kernel_computes_the_gated_hidden_layer(rows, width, hidden, settings, activation):
    x, w_gate, w_up = random_case(rows, width, hidden)
    as_f32 = (jnp.asarray(a, jnp.float32) for a in (x, w_gate, w_up))
    out = kernel.gated_hidden(
        *as_f32, ACTIVATION_FNS[activation], settings=settings, interpret=True
    )
    assert out.shape == (rows, hidden) and out.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(out), reference(x, w_gate, w_up, activation), atol=2e-5, rtol=1e-5
    )


@pytest.mark.parametrize("settings", [MlpKernelSettings(16, 32, 16, 2, 2), MlpKernelSettings()])
def test_the_kernel_applies_a_folded_rmsnorm(settings):
    """With the block's RMSNorm (scale, epsilon) the kernel takes the rows before it: the
    hidden layer of x / rms(x) * scale, as written in NumPy."""
    x, w_gate, w_up = random_case(21, 64, 48, seed=2)
    x = 3 * x + 1  # far from unit RMS, so a norm left out would show
    scale = 1 + 0.2 * np.random.default_rng(3).normal(size=64)
    eps = 1e-5
    as_f32 = [jnp.asarray(a, jnp.float32) for a in (x, w_gate, w_up)]
    norm = (jnp.asarray(scale, jnp.float32), eps)
    out = kernel.gated_hidden(
        *as_f32, ACTIVATION_FNS["silu"], norm=norm, settings=settings, interpret=True
    )
    normed = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * scale
    expected = reference(normed, w_gate, w_up, "silu")
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=1e-5)


def test_bfloat16_inputs_give_bfloat16_rounded_once():
    """In bfloat16 the products are accumulated in float32 and rounded once, at the end:
    within a bfloat16 rounding of the float64 result, as close as XLA's path (which rounds
    each product first) or closer."""
    x, w_gate, w_up = random_case(16, 64, 64, seed=1)
    as_bf16 = [jnp.asarray(a, jnp.bfloat16) for a in (x, w_gate, w_up)]
    out = kernel.gated_hidden(*as_bf16, jax.nn.silu, interpret=True)
    assert out.dtype == jnp.bfloat16
    rounded = [np.asarray(a.astype(jnp.float32), np.float64) for a in as_bf16]
    expected = reference(*rounded, "silu")
    error = np.abs(np.asarray(out.astype(jnp.float32)) - expected)
    assert (error <= 2**-8 * np.abs(expected) + 1e-6).all()  # bfloat16: 8 bits of mantissa
    gate = jnp.dot(as_bf16[0], as_bf16[1])
    xla = np.asarray((jax.nn.silu(gate) * jnp.dot(as_bf16[0], as_bf16[2])).astype(jnp.float32))
    assert error.max() <= np.abs(xla - expected).max()


def test_the_platform_default_runs_the_interpreter_off_a_gpu():
    x, w_gate, w_up = (jnp.asarray(a, jnp.float32) for a in random_case(8, 32, 32))
    out = jax.jit(lambda *a: kernel.gated_hidden(*a, jax.nn.silu))(x, w_gate, w_up)
    np.testing.assert_allclose(
        np.asarray(out), reference(*map(np.asarray, (x, w_gate, w_up)), "silu"), atol=2e-5
    )


def test_blocks_shrink_to_tile_an_axis_and_refuse_below_sixteen():
    assert kernel.block_for(4864, 64) == 64  # qwen2.5-0.5b's d_ff: 2^8 * 19
    assert kernel.block_for(896, 256) == 128  # its d_model: 2^7 * 7
    assert kernel.block_for(80, 64) == 16
    with pytest.raises(ValueError, match="no multiple of 16"):
        kernel.block_for(24, 64)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("64:64:64:4", "is not block_m:block_n:block_k"),
        ("64:96:64:4:3", "block_n must be a power of two"),
        ("8:64:64:4:3", "block_m must be at least 16"),
        ("64:64:64:3:3", "num_warps must be a power of two"),
        ("64:64:64:4:0", "num_stages must be at least 1"),
    ],
)
def test_bad_settings_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_mlp_kernel_settings(spec)


def test_settings_print_as_they_parse():
    settings = MlpKernelSettings(128, 32, 64, 8, 4)
    assert parse_mlp_kernel_settings(settings.spec()) == settings


def test_the_benchmark_checks_the_kernel_against_float64_and_times_it():
    done = run_repo_script(
        "benchmarks/gated_mlp_kernel.py",
        "--shape=tiny",
        "--rows=5,32",
        "--dtype=float32",
        "--repeats=1",
        "--settings=64:64:64:4:3,16:32:16:4:2",
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert [line["rows"] for line in lines] == [5, 32]
    for line in lines:
        assert line["max_abs_error"] < 1e-5 and line["xla_max_abs_error"] < 1e-5
        assert set(line["kernel_us"]) == {"64:64:64:4:3", "16:32:16:4:2"}
        assert min(line["kernel_us"].values()) > 0 and line["fastest"] in line["kernel_us"]
        assert line["model_settings"] == kernel.SETTINGS.spec()
        assert line["xla_us"] > 0 and line["backend"] == "cpu"
        assert line["timing"] == "wall_clock_median"  # a CPU's trace has no device kernels
        assert set(line["kernel_cold_us"]) == set(line["kernel_us"]) and line["xla_cold_us"] > 0
        assert line["fastest_cold"] in line["kernel_cold_us"] and line["cold_copies"] == 64
        # tiny: d_model 128, d_ff 384; float32 weights and rows, the norm's float32 scale
        assert line["bytes"] == 4 * (2 * 128 * 384 + line["rows"] * (128 + 384)) + 4 * 128
    refused = run_repo_script("benchmarks/gated_mlp_kernel.py", "--settings=64:64:64", timeout=60)
    assert refused.returncode != 0 and "is not block_m:block_n" in refused.stderr
    refused = run_repo_script("benchmarks/gated_mlp_kernel.py", "--shape=gpt2", timeout=60)
    assert refused.returncode != 0 and "gated MLPs without biases" in refused.stderr
