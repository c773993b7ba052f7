"""`models.decode_projection`, the Pallas kernel of a decode step's output projections
(run by Pallas' interpreter on this CPU), against x W written in NumPy: contractions split
into several parts, row counts that are no multiple of a block (padded), widths its
blocks shrink to tile, bfloat16 inputs; its settings' checks; and
`benchmarks/decode_projection_kernel.py`, which checks it so on a GPU. (That the model
decodes alike through it: `tests/test_model_execution.py`; on a mesh:
`tests/mesh_subprocess_checks.py`.)"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from support import run_repo_script

from tba_jax.models import decode_projection as kernel
from tba_jax.models.config import ProjectionKernelSettings, parse_projection_kernel_settings


def random_case(rows: int, width: int, outputs: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, width)), rng.normal(size=(width, outputs)) / np.sqrt(width)


@pytest.mark.parametrize(
    "rows, width, outputs, settings, parts",
    [
        (5, 64, 48, ProjectionKernelSettings(16, 16, 32, 1, 2, 2), 1),  # rows padded to 16
        (5, 64, 48, ProjectionKernelSettings(16, 16, 32, 2, 2, 2), 2),
        (37, 128, 96, ProjectionKernelSettings(32, 64, 16, 4, 4, 2), 4),  # 96 tiled by 32
        (16, 64, 32, ProjectionKernelSettings(16, 16, 64, 8, 2, 2), 4),  # 4 parts of 16
        (16, 48, 32, ProjectionKernelSettings(), 1),  # 3 blocks of 16: no even split
    ],
    ids=["one-part", "two-parts", "rows-over-blocks", "parts-capped", "odd-width"],
)
def test_the_kernel_computes_x_w_over_parts_of_the_contraction(
    rows, width, outputs, settings, parts
):
    x, w = random_case(rows, width, outputs)
    assert kernel.parts_for(width, settings.k_splits) == parts
    out = kernel.project(
        jnp.asarray(x, jnp.float32),
        jnp.asarray(w, jnp.float32),
        split=1,
        settings=settings,
        interpret=True,
    )
    assert out.shape == (rows, outputs) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), x @ w, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "settings, fused",
    [
        (ProjectionKernelSettings(16, 16, 32, 1, 2, 2), True),  # one part: in the kernel
        (ProjectionKernelSettings(16, 16, 16, 2, 2, 2), False),  # two: XLA adds it
    ],
    ids=["one-part", "two-parts"],
)
def test_a_residual_is_added_in_the_kernel_with_one_part(monkeypatch, settings, fused):
    """With the residual stream the result is residual + x W in the residual's dtype: the
    kernel adds it where it computes the whole contraction in one part (rounded once),
    XLA otherwise (the product rounded first, as the model adds it)."""
    x, w = random_case(5, 64, 48, seed=4)
    residual = np.random.default_rng(5).normal(size=(5, 48))
    fused_calls = []
    real = kernel._with_residual

    def recording(*args, **kwargs):
        fused_calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel, "_with_residual", recording)
    out = kernel.project(
        jnp.asarray(x, jnp.float32),
        jnp.asarray(w, jnp.float32),
        split=1,
        residual=jnp.asarray(residual, jnp.bfloat16),
        settings=settings,
        interpret=True,
    )
    assert out.dtype == jnp.bfloat16 and bool(fused_calls) == fused
    product = x @ w
    expected = np.asarray(jnp.asarray(residual, jnp.bfloat16).astype(jnp.float32)) + product
    error = np.abs(np.asarray(out.astype(jnp.float32)) - expected)
    rounded = np.abs(expected) + (0 if fused else np.abs(product))  # bfloat16: 8 bits
    assert (error <= 2**-8 * rounded + 1e-5).all()


def test_the_residual_is_fused_only_where_no_device_splits_the_contraction():
    """One part on one device, or on a mesh whose tensor axis does not cut the
    contraction (it does not divide its `split` parts, or there is none); never with
    more parts."""
    one_part, two_parts = (ProjectionKernelSettings(16, 16, 16, k, 2, 2) for k in (1, 2))
    assert kernel.fuses_residual(32, 2, 4, one_part)
    assert not kernel.fuses_residual(32, 2, 4, two_parts)
    with jax.sharding.use_abstract_mesh(AbstractMesh((2, 2), ("data", "tensor"))):
        assert not kernel.fuses_residual(32, 2, 4, one_part)  # 2 devices' parts to add
        assert kernel.fuses_residual(32, 1, 4, one_part)  # tensor 2 cannot split 1 part
    with jax.sharding.use_abstract_mesh(AbstractMesh((4,), ("data",))):
        assert kernel.fuses_residual(32, 2, 4, one_part)


def test_bfloat16_inputs_give_bfloat16_rounded_once():
    """In bfloat16 the parts are summed in float32 and rounded once: within a bfloat16
    rounding of the float64 result, as XLA's matmul (float32 accumulator) is."""
    x, w = (jnp.asarray(a, jnp.bfloat16) for a in random_case(16, 256, 64, seed=1))
    out = kernel.project(x, w, split=1, interpret=True)
    assert out.dtype == jnp.bfloat16
    expected = np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(
        w.astype(jnp.float32), np.float64
    )
    error = np.abs(np.asarray(out.astype(jnp.float32)) - expected)
    assert (error <= 2**-8 * np.abs(expected) + 1e-6).all()  # bfloat16: 8 bits of mantissa


def test_the_platform_default_runs_the_interpreter_off_a_gpu():
    x, w = random_case(8, 64, 32)
    out = jax.jit(lambda *a: kernel.project(*a, split=1))(
        jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
    )
    np.testing.assert_allclose(np.asarray(out), x @ w, atol=2e-5)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("64:64:64:4:3", "is not block_m:block_n:block_k:k_splits"),
        ("64:64:64:3:4:3", "k_splits must be a power of two"),
        ("64:64:8:4:4:3", "block_k must be at least 16"),
        ("64:64:64:4:4:0", "num_stages must be at least 1"),
    ],
)
def test_bad_settings_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_projection_kernel_settings(spec)


def test_settings_print_as_they_parse():
    settings = ProjectionKernelSettings(128, 32, 64, 8, 8, 4)
    assert parse_projection_kernel_settings(settings.spec()) == settings


def test_the_benchmark_checks_the_kernel_against_float64_and_times_it():
    done = run_repo_script(
        "benchmarks/decode_projection_kernel.py",
        "--shape=tiny",
        "--rows=5,32",
        "--dtype=float32",
        "--repeats=1",
        "--settings=64:64:64:4:4:3,16:32:16:2:4:2",
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()]
    # tiny: d_model 128, 4 heads of 32, d_ff 384
    assert [(line["projection"], line["rows"], line["width"]) for line in lines] == [
        ("attention_out", 5, 128),
        ("attention_out", 32, 128),
        ("mlp_down", 5, 384),
        ("mlp_down", 32, 384),
    ]
    for line in lines:
        assert line["max_abs_error"] < 1e-4 and line["xla_max_abs_error"] < 1e-4
        assert set(line["kernel_us"]) == {"64:64:64:4:4:3", "16:32:16:2:4:2"}
        assert min(line["kernel_us"].values()) > 0 and line["fastest"] in line["kernel_us"]
        assert line["model_settings"] == kernel.SETTINGS.spec()
        assert line["xla_us"] > 0 and line["backend"] == "cpu"
        assert line["timing"] == "wall_clock_median"
        assert set(line["kernel_cold_us"]) == set(line["kernel_us"]) and line["xla_cold_us"] > 0
        assert line["fastest_cold"] in line["kernel_cold_us"] and line["cold_copies"] == 64
        width, rows = line["width"], line["rows"]
        assert line["bytes"] == 4 * (width * 128 + rows * (width + 2 * 128))  # residual in, sum out
    refused = run_repo_script(
        "benchmarks/decode_projection_kernel.py", "--settings=64:64:64:4", timeout=60
    )
    assert refused.returncode != 0 and "is not block_m:block_n:block_k:k_splits" in refused.stderr
