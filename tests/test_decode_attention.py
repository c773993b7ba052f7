"""`models.decode_attention`, the Pallas kernel of a decode step's attention (run by
Pallas' interpreter on this CPU), against the attention formula written in NumPy: grouped
query heads, any mask of visible slots (a row that sees none gets zeros), and caches whose
length is no multiple of the kernel's block (the last block overlaps the one before); and
`benchmarks/decode_attention_kernel.py`, which checks it so on a GPU."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from support import run_repo_script

from tba_jax.models import decode_attention as kernel


def reference(q, k, v, visible):
    """Softmax attention of q [B, H, hd] over k, v [B, S, KV, hd] where `visible` [B, S],
    in float64; zeros for a row that sees no slot."""
    batch, heads, head_dim = q.shape
    groups = heads // k.shape[2]
    out = np.zeros((batch, heads, head_dim))
    for b in range(batch):
        if not visible[b].any():
            continue
        for h in range(heads):
            scores = k[b, :, h // groups] @ q[b, h] / np.sqrt(head_dim)
            scores = np.where(visible[b], scores, -np.inf)
            weights = np.exp(scores - scores.max())
            out[b, h] = weights @ v[b, :, h // groups] / weights.sum()
    return out


def random_case(cache_len, heads, kv_heads, head_dim=32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(4, heads, head_dim))
    k, v = (rng.normal(size=(4, cache_len, kv_heads, head_dim)) for _ in range(2))
    visible = np.zeros((4, cache_len), bool)
    visible[0, 3 : cache_len // 2] = True  # a left-padded prompt and its response so far
    visible[1] = rng.random(cache_len) < 0.3  # any mask
    visible[2, [0, cache_len - 1]] = True  # the cache's first and last slots only
    return q, k, v, visible  # row 3 sees nothing


@pytest.mark.parametrize(
    "cache_len, heads, kv_heads",
    [(300, 14, 2), (256, 4, 4), (40, 6, 2), (9, 4, 1)],
    ids=["overlapping-last-block", "one-head-per-kv-head", "short-cache", "under-one-block"],
)
def test_the_kernel_computes_attention_over_the_visible_slots(cache_len, heads, kv_heads):
    q, k, v, visible = random_case(cache_len, heads, kv_heads)
    as_f32 = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    out = kernel.decode_attention(*as_f32, jnp.asarray(visible), interpret=True)
    assert out.shape == q.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), reference(q, k, v, visible), atol=2e-6)
    assert not np.asarray(out[3]).any()


@pytest.mark.parametrize(
    "settings",
    [
        kernel.KernelSettings(k_splits=2),
        kernel.KernelSettings(k_splits=3),
        kernel.KernelSettings(k_splits=8),  # more splits than the 3 blocks
        kernel.KernelSettings(k_splits=4, block_k=32),  # 10 blocks, the last overlapping
        kernel.KernelSettings(block_k=256),  # one block and a half
    ],
    ids=lambda settings: settings.spec(),
)
def test_a_walk_split_between_programs_combines_to_the_same_attention(settings):
    """Split over the cache (some splits past a row's last visible slot see nothing), in
    blocks of any size, the partial results combine to the formula's output."""
    q, k, v, visible = random_case(300, 14, 2)
    as_f32 = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    out = kernel.decode_attention(*as_f32, jnp.asarray(visible), settings=settings, interpret=True)
    np.testing.assert_allclose(np.asarray(out), reference(q, k, v, visible), atol=2e-6)
    assert not np.asarray(out[3]).any()


def test_the_kernel_in_bfloat16_rounds_as_bfloat16():
    q, k, v, visible = random_case(300, 14, 2)
    as_bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    out = kernel.decode_attention(*as_bf16, jnp.asarray(visible), interpret=True)
    assert out.dtype == jnp.bfloat16
    rounded = (np.asarray(x.astype(jnp.float32), np.float64) for x in as_bf16)
    np.testing.assert_allclose(np.asarray(out, np.float32), reference(*rounded, visible), atol=2e-2)


def test_the_block_is_a_power_of_two_of_at_least_16_slots_or_a_shorter_cache_whole():
    assert kernel.block_k_for(768) == kernel.SETTINGS.block_k == 128
    assert kernel.block_k_for(768, 64) == 64
    assert kernel.block_k_for(100) == 64
    assert kernel.block_k_for(16) == 16
    assert kernel.block_k_for(9) == 9


def test_a_walk_reads_each_slot_up_to_the_last_visible_one_once():
    assert [kernel.slots_read(n, 512) for n in (1, 128, 129, 257, 512)] == [1, 128, 129, 257, 512]
    assert kernel.slots_read(600, 512) == 512


@pytest.mark.parametrize(
    "settings, problem",
    [
        (kernel.KernelSettings(k_splits=0), "k_splits and num_stages must be at least 1"),
        (kernel.KernelSettings(block_k=96), "block_k must be a power of two"),
        (kernel.KernelSettings(block_k=8), "block_k must be at least 16"),
        (kernel.KernelSettings(num_warps=3), "num_warps must be a power of two"),
    ],
)
def test_settings_the_kernel_cannot_run_with_are_refused(settings, problem):
    q, k, v, visible = random_case(40, 4, 2)
    with pytest.raises(ValueError, match=problem):
        kernel.decode_attention(
            *(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
            jnp.asarray(visible),
            settings=settings,
            interpret=True,
        )


def test_too_many_query_heads_per_kv_head_are_refused():
    q = jnp.zeros((1, 34, 16))
    k = jnp.zeros((1, 32, 2, 16))
    with pytest.raises(ValueError, match="up to 16 query heads per KV head"):
        kernel.decode_attention(q, k, k, jnp.ones((1, 32), bool), interpret=True)


def test_the_benchmark_checks_the_kernel_against_float64_and_times_it():
    done = run_repo_script(
        "benchmarks/decode_attention_kernel.py",
        "--batch=3",
        "--cache_lens=40,130",
        "--dtype=float32",
        "--repeats=1",
        "--settings=1:128:4:2,2:16:4:3",
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert [line["cache_len"] for line in lines] == [40, 130]
    for line in lines:
        assert line["max_abs_error"] < 1e-5 and line["empty_row_zero"]
        assert set(line["kernel_us"]) == {"1:128:4:2", "2:16:4:3"}
        assert min(line["kernel_us"].values()) > 0 and line["fastest"] in line["kernel_us"]
        assert line["model_settings"] == kernel.SETTINGS.spec()
        assert line["baseline_us"] > 0
        assert line["baseline_attention"] == "einsum" and line["backend"] == "cpu"
        assert line["timing"] == "wall_clock_median"  # a CPU's trace has no device kernels
        # and timed cold: 64 sets of inputs (the most; these are far under --cold_mb)
        assert set(line["kernel_cold_us"]) == set(line["kernel_us"])
        assert line["fastest_cold"] in line["kernel_cold_us"] and line["baseline_cold_us"] > 0
        assert line["cold_copies"] == 64
    refused = run_repo_script(
        "benchmarks/decode_attention_kernel.py", "--attention=cudnn", timeout=60
    )
    assert refused.returncode != 0 and "needs a GPU" in refused.stderr
    refused = run_repo_script(
        "benchmarks/decode_attention_kernel.py", "--settings=2:128:4", timeout=60
    )
    assert refused.returncode != 0 and "is not k_splits:block_k" in refused.stderr


def test_a_cold_timing_cycles_through_copies_of_the_inputs_in_buffers_of_their_own():
    """Kernel benchmarks time each kernel cold too: inside a decode step no kernel finds its
    layer's weights in the GPU's L2 cache, as a kernel called on the same buffers may."""
    from benchmarks import decode_attention_kernel as bench

    x = jnp.arange(256 * 1024, dtype=jnp.float32).reshape(256, 1024)  # 1 MiB
    sets = bench.cold_copies((x,), cold_mb=4)
    assert len(sets) == 4 and sets[0][0] is x
    assert len({inputs[0].unsafe_buffer_pointer() for inputs in sets}) == 4
    assert all(np.array_equal(inputs[0], x) for inputs in sets)
    assert len(bench.cold_copies((x,), cold_mb=0.1)) == 2  # a copy at least
    assert len(bench.cold_copies((x[:1],), cold_mb=256)) == bench.MAX_COLD_COPIES
    read = []

    def kernel(array):
        read.append(array.unsafe_buffer_pointer())
        return array

    bench.call_us(kernel, sets, repeats=6)
    # a compiling call, then the sets in turn
    assert read[1:] == [sets[i % 4][0].unsafe_buffer_pointer() for i in range(6)]
    warm_only = bench.timed({"a": kernel}, kernel, (x,), 1, cold_mb=0, name="xla")
    assert set(warm_only) == {"kernel_us", "xla_us", "fastest", "timing"}
    both = bench.timed({"a": kernel}, kernel, (x,), 1, cold_mb=4, name="xla")
    assert both["cold_copies"] == 4 and both["fastest_cold"] == "a"
