"""`models.decode_qkv`, the Pallas kernel of a decode step's attention input (run by
Pallas' interpreter on this CPU), against the same computation written in NumPy in
float64: the RMSNorm, the Q, K and V projections with their biases, the rotary
embedding, and the write of each row's key and value into its cache slot, every other
slot left as it was; rows that are no multiple of a block (padded, their writes
masked), bfloat16 inputs, no rotary embedding; and its settings' checks. (That the model
decodes alike through it: `tests/test_model_execution.py`; on a mesh:
`tests/mesh_subprocess_checks.py`.)"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import run_repo_script

from benchmarks import decode_qkv_kernel as qkv_benchmark
from tba_jax.models import decode_qkv as kernel
from tba_jax.models.config import QkvKernelSettings, parse_qkv_kernel_settings

EPS = 1e-6


def random_case(rows, width, heads, kv_heads, head_dim, slots, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(rows, width)) * 3,
        "scale": 1 + 0.2 * rng.normal(size=width),
        "wq": rng.normal(size=(width, heads, head_dim)) / np.sqrt(width),
        "wk": rng.normal(size=(width, kv_heads, head_dim)) / np.sqrt(width),
        "wv": rng.normal(size=(width, kv_heads, head_dim)) / np.sqrt(width),
        "bq": rng.normal(size=(heads, head_dim)),
        "bk": rng.normal(size=(kv_heads, head_dim)),
        "bv": rng.normal(size=(kv_heads, head_dim)),
        "positions": rng.integers(0, 1000, size=rows),
        "cache_k": rng.normal(size=(rows, slots, kv_heads, head_dim)),
        "cache_v": rng.normal(size=(rows, slots, kv_heads, head_dim)),
        "slots": rng.integers(0, slots, size=rows),
    }


def angles(case, head_dim):
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, head_dim, 2) / head_dim))
    return case["positions"][:, None] * inv_freq[None, :]  # [rows, head_dim / 2]


def numpy_reference(case, rotary: bool):
    """(q, cache_k, cache_v) in float64: the benchmark's NumPy reference for the new q,
    keys and values, written into copies of the caches at each row's slot."""
    angles_of_rows = angles(case, case["wq"].shape[-1])
    q, k, v = qkv_benchmark.reference({**case, "angles": angles_of_rows}, EPS, rotary)
    cache_k, cache_v = case["cache_k"].copy(), case["cache_v"].copy()
    rows = np.arange(len(case["x"]))
    cache_k[rows, case["slots"]] = k
    cache_v[rows, case["slots"]] = v
    return q, cache_k, cache_v


def run_kernel(case, dtype, rotary, settings=kernel.SETTINGS, interpret=True):
    cast = {name: jnp.asarray(value, dtype) for name, value in case.items()}
    cos = sin = None
    if rotary:
        theta = angles(case, case["wq"].shape[-1])
        cos, sin = (jnp.asarray(f(theta), jnp.float32) for f in (np.cos, np.sin))
    return kernel.project_qkv(
        cast["x"],
        jnp.asarray(case["scale"], jnp.float32),
        cast["wq"],
        cast["wk"],
        cast["wv"],
        (cast["bq"], cast["bk"], cast["bv"]),
        cos,
        sin,
        cast["cache_k"],
        cast["cache_v"],
        jnp.asarray(case["slots"], jnp.int32),
        eps=EPS,
        settings=settings,
        interpret=interpret,
    )


@pytest.mark.parametrize(
    "rows, width, heads, kv_heads, head_dim, settings, rotary",
    [
        (5, 64, 4, 2, 32, QkvKernelSettings(16, 16, 2, 2), True),  # rows padded to 16
        (37, 128, 6, 2, 64, QkvKernelSettings(32, 64, 4, 2), True),  # rows over 2 blocks
        (16, 48, 2, 1, 32, QkvKernelSettings(), True),  # width 48: blocks of 16
        (8, 64, 2, 2, 32, QkvKernelSettings(16, 32, 2, 2), False),  # no rotary (or none)
    ],
    ids=["padded-rows", "rows-over-blocks", "odd-width", "no-rotary"],
)
def test_the_kernel_normalises_projects_rotates_and_writes_the_cache(
    rows, width, heads, kv_heads, head_dim, settings, rotary
):
    case = random_case(rows, width, heads, kv_heads, head_dim, slots=6)
    q, cache_k, cache_v = run_kernel(case, jnp.float32, rotary, settings)
    expected_q, expected_k, expected_v = numpy_reference(case, rotary)
    assert q.shape == (rows, heads, head_dim) and q.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(q), expected_q, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(cache_k), expected_k, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(cache_v), expected_v, atol=2e-4, rtol=1e-4)
    # every slot but each row's own is left exactly as it was
    untouched = np.ones(case["cache_k"].shape[:2], bool)
    untouched[np.arange(rows), case["slots"]] = False
    for new, old in ((cache_k, case["cache_k"]), (cache_v, case["cache_v"])):
        np.testing.assert_array_equal(np.asarray(new)[untouched], old.astype(np.float32)[untouched])


def test_bfloat16_inputs_round_each_result_once():
    """In bfloat16 (the decode steps' dtype) the products are summed in float32 and each
    result rounded once: within a few bfloat16 roundings of the float64 result (x * the
    norm scale is rounded to bfloat16 before the products, as XLA's path rounds the
    normalised input)."""
    case = random_case(16, 128, 4, 2, 32, slots=4, seed=1)
    rounded = {
        name: np.asarray(jnp.asarray(value, jnp.bfloat16).astype(jnp.float32), np.float64)
        for name, value in case.items()
        if name not in ("positions", "slots", "scale")
    }
    q, cache_k, cache_v = run_kernel(case, jnp.bfloat16, rotary=True)
    assert q.dtype == cache_k.dtype == jnp.bfloat16
    expected = numpy_reference({**case, **rounded}, rotary=True)
    for got, want in zip((q, cache_k, cache_v), expected, strict=True):
        error = np.abs(np.asarray(got.astype(jnp.float32), np.float64) - want)
        assert (error <= 3 * 2**-8 * np.abs(want) + 0.02).all(), error.max()


def test_the_platform_default_runs_the_interpreter_off_a_gpu():
    case = random_case(4, 32, 2, 1, 32, slots=3)
    run = jax.jit(lambda arrays: run_kernel({**case, **arrays}, jnp.float32, True, interpret=None))
    q, cache_k, _ = run({name: case[name] for name in ("x", "cache_k", "cache_v")})
    expected_q, expected_k, _ = numpy_reference(case, rotary=True)
    np.testing.assert_allclose(np.asarray(q), expected_q, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(cache_k), expected_k, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("64:64:4", "is not block_m:block_k:num_warps:num_stages"),
        ("48:64:4:3", "block_m must be a power of two"),
        ("64:8:4:3", "block_k must be at least 16"),
        ("64:64:4:0", "num_stages must be at least 1"),
    ],
)
def test_bad_settings_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_qkv_kernel_settings(spec)


def test_settings_print_as_they_parse():
    settings = QkvKernelSettings(32, 128, 8, 4)
    assert parse_qkv_kernel_settings(settings.spec()) == settings


def test_the_benchmark_checks_the_kernel_against_float64_and_times_it():
    done = run_repo_script(
        "benchmarks/decode_qkv_kernel.py",
        "--shape=tiny",
        "--rows=5,32",
        "--dtype=float32",
        "--repeats=1",
        "--settings=64:64:4:3,16:32:2:2",
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert [line["rows"] for line in lines] == [5, 32]
    for line in lines:  # tiny: d_model 128, 4 heads of 32, 2 KV heads
        assert (line["d_model"], line["heads"], line["kv_heads"], line["head_dim"]) == (
            128,
            4,
            2,
            32,
        )
        assert line["max_abs_error"] < 1e-4 and line["xla_max_abs_error"] < 1e-4
        assert set(line["kernel_us"]) == {"64:64:4:3", "16:32:2:2"}
        assert min(line["kernel_us"].values()) > 0 and line["fastest"] in line["kernel_us"]
        assert line["model_settings"] == kernel.SETTINGS.spec() and line["xla_us"] > 0
        assert line["fastest_cold"] in line["kernel_cold_us"] and line["xla_cold_us"] > 0
        rows = line["rows"]
        assert line["bytes"] == 4 * (128 * 8 * 32 + rows * 128 + rows * 8 * 32)
    refused = run_repo_script("benchmarks/decode_qkv_kernel.py", "--settings=64:64:4", timeout=60)
    assert refused.returncode != 0 and "is not block_m:block_k:num_warps" in refused.stderr
