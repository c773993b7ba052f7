r"""The Pallas decode-attention kernel (`model.decode_attention=pallas`) on this machine's
backend: its output against the attention formula in float64 NumPy, and its time beside
the attention `model.attention` gives a decode step, one layer at a time.

    python benchmarks/decode_attention_kernel.py                     # qwen2.5-0.5b's layer
    python benchmarks/decode_attention_kernel.py --attention=cudnn   # on a GPU
    python benchmarks/decode_attention_kernel.py --batch=4 --cache_lens=40 --repeats=1
    python benchmarks/decode_attention_kernel.py --settings=1:128:4:2,4:64:4:3   # a grid

On a GPU the kernel is Triton's; elsewhere Pallas' interpreter runs it (slow: a check of
the script, not a timing). Each row sees a random contiguous range of slots, as a
left-padded prompt and its response so far do; one row sees a random scatter of slots
and one sees none (its output must be zeros). One JSON line per cache length:
`max_abs_error` (against float64, on the inputs rounded to `--dtype`, the worst over
`--settings`), `empty_row_zero`, `kernel_us` (one figure per `--settings` entry
`k_splits:block_k:num_warps:num_stages`, `models.config.KernelSettings`, keyed so, e.g.
"1:128:4:2"; `fastest`: the key of the least, a `model.decode_kernel` value;
`model_settings`: the kernel's defaults, `decode_attention.SETTINGS`) and `baseline_us`
(each one call's time after a compiling one, `timing`: on an accelerator the mean of its
kernels' device time over `--repeats` traced calls, on a CPU the median of `--repeats`
timed calls; see `call_us`), `baseline_attention`, and the mean visible length.

Those times read the same buffers at every call, which a GPU's L2 cache (50 MB on an H100
or H200) may still hold from the call before; inside a decode step no kernel finds its
layer's weights or cache there. So each is timed cold too (`kernel_cold_us`,
`baseline_cold_us`, `fastest_cold`): the calls cycle through `cold_copies` copies of the
inputs in buffers of their own, `--cold_mb` MB of them in all (0: not timed cold).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import tempfile
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tba_jax import cli, device_trace
from tba_jax.models import preset, transformer
from tba_jax.models.config import ATTENTIONS, parse_kernel_settings
from tba_jax.models.decode_attention import SETTINGS, decode_attention

# k_splits:block_k:num_warps:num_stages. The model's settings first, then the cache walk
# split 2-8 ways, smaller blocks with deeper pipelines, and larger blocks with more warps.
DEFAULT_SETTINGS = (
    "1:128:4:2,2:128:4:2,4:128:4:2,8:128:4:2,1:64:4:2,2:64:4:3,4:64:4:3,4:64:2:2,"
    "1:256:8:2,2:256:8:2"
)


def parse_settings(text: str, parse=parse_kernel_settings) -> list:
    """`k:b:w:s,...` as KernelSettings, or comma-separated specs of another kernel's
    settings by its `parse` (ValueError naming a bad entry)."""
    settings = [parse(item) for item in filter(None, text.split(","))]
    if not settings:
        raise ValueError("--settings is empty.")
    return settings


def random_inputs(args, cfg, cache_len: int, rng: np.random.Generator):
    """q [B, H, hd], k, v [B, S, KV, hd] in --dtype, visible [B, S] bool."""
    heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    shapes = ((args.batch, heads, head_dim),) + ((args.batch, cache_len, kv_heads, head_dim),) * 2
    q, k, v = (jnp.asarray(rng.normal(size=shape), args.dtype) for shape in shapes)
    visible = np.zeros((args.batch, cache_len), bool)
    for row in range(args.batch):
        first = rng.integers(0, cache_len // 2 + 1)
        visible[row, first : rng.integers(first + 1, cache_len + 1)] = True
    visible[0] = rng.random(cache_len) < 0.3
    visible[-1] = False
    return q, k, v, visible


def reference(q, k, v, visible) -> np.ndarray:
    """Softmax attention in float64 over the visible slots; zeros for a row seeing none."""
    q, k, v = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
    batch, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    scores = np.einsum("bkgd,btkd->bkgt", grouped, k) / np.sqrt(head_dim)
    scores = np.where(visible[:, None, None], scores, -np.inf)
    peak = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(peak), peak, 0.0))
    total = weights.sum(axis=-1, keepdims=True)
    out = np.einsum("bkgt,btkd->bkgd", weights / np.where(total > 0, total, 1.0), v)
    return out.reshape(batch, heads, head_dim)


def baseline_fn(cfg):
    """A decode step's attention as `cfg.attention` computes it: [B, H, hd]."""

    def attend(q, k, v, visible):
        if cfg.attention in transformer.FUSED_ATTENTION_IMPLEMENTATIONS:
            out = transformer.fused_cached_attention(q[:, None], k, v, visible[:, None], cfg)
        else:
            out = transformer.einsum_attention(q[:, None], k, v, visible[:, None], cfg)
        return out[:, 0]

    return jax.jit(attend)


# Megabytes of inputs a cold timing cycles through by default: five times the L2 cache of
# an H100 or H200 (50 MB), so no call finds its inputs there.
COLD_MB = 256
MAX_COLD_COPIES = 64  # however small the inputs (a CPU test's)


def cold_copies(inputs: tuple, cold_mb: float) -> list[tuple]:
    """`inputs`, then copies of them in buffers of their own, as many as make `cold_mb`
    megabytes in all (at least 2, at most `MAX_COLD_COPIES` sets): timed in turn
    (`call_us`), no call finds its inputs in a cache the call before filled."""
    size = sum(array.nbytes for array in inputs)
    count = min(MAX_COLD_COPIES, max(2, math.ceil(cold_mb * 2**20 / size)))
    copies = [tuple(jnp.array(array, copy=True) for array in inputs) for _ in range(count - 1)]
    return [inputs, *copies]


def call_us(fn, input_sets: Sequence[tuple], repeats: int) -> float:
    """Microseconds one call of `fn(*inputs)` takes on the device, after a compiling call,
    the calls taking the sets of `input_sets` in turn (one set: the same buffers at every
    call; `cold_copies`: buffers no cache holds from the call before).

    On an accelerator: the time of its kernels, summed over `repeats` calls traced by
    `jax.profiler` (`device_trace`), over `repeats`. A wall clock around a call would
    time JAX's dispatch too, about 60 us on a GPU, more than a layer's kernel (an H200
    timed every setting of both kernels at 64-74 us at 64 rows that way). On a CPU, whose
    trace has no device plane: the median of `repeats` timed calls.
    """
    calls = [input_sets[i % len(input_sets)] for i in range(repeats)]
    jax.block_until_ready(fn(*input_sets[-1]))  # compiles
    if jax.default_backend() != "cpu":
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir):
                for inputs in calls:
                    jax.block_until_ready(fn(*inputs))
            summary = device_trace.kernel_summary(trace_dir)
        if summary["kernels"]:
            return 1e3 * summary["kernel_ms"] / repeats
    times = []
    for inputs in calls:
        began = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        times.append(time.perf_counter() - began)
    return 1e6 * statistics.median(times)


def timed(kernels: dict, baseline, inputs: tuple, repeats: int, cold_mb: float, name: str):
    """The timing fields of a kernel benchmark's line: `kernel_us` (each of `kernels`, by
    its settings' key) and `<name>_us` (the `baseline` it is set beside), `fastest`, and
    the same timed cold (`kernel_cold_us`, `<name>_cold_us`, `fastest_cold`, with
    `cold_copies`) unless `cold_mb` is 0; `timing` says what was measured."""
    fields = {}
    input_sets = {"": [inputs]}
    if cold_mb > 0:
        input_sets["_cold"] = cold_copies(inputs, cold_mb)
        fields["cold_copies"] = len(input_sets["_cold"])
    for suffix, sets in input_sets.items():
        kernel_us = {
            label: round(call_us(kernel, sets, repeats), 1) for label, kernel in kernels.items()
        }
        fields[f"kernel{suffix}_us"] = kernel_us
        fields[f"{name}{suffix}_us"] = round(call_us(baseline, sets, repeats), 1)
        fields[f"fastest{suffix}"] = min(kernel_us, key=kernel_us.get)
    fields["timing"] = timing()
    return fields


def timing() -> str:
    """What `call_us` measures on this backend (the JSON lines' `timing`)."""
    return "wall_clock_median" if jax.default_backend() == "cpu" else "device_kernels_mean"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="model preset (its heads)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--cache_lens", default="512,300", help="comma-separated slots")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--attention", default="einsum", choices=ATTENTIONS)
    parser.add_argument(
        "--settings", default=DEFAULT_SETTINGS, help="k_splits:block_k:num_warps:num_stages,..."
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cold_mb", type=float, default=COLD_MB, help="0: no cold timing")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        cache_lens = [int(item) for item in args.cache_lens.split(",")]
        settings = parse_settings(args.settings)
        # the preset's heads; its vocabulary plays no part here
        cfg = preset(args.shape, vocab_size=16, dtype=args.dtype, attention=args.attention)
        if args.batch < 2 or args.repeats < 1 or min(cache_lens) < 1 or args.cold_mb < 0:
            raise ValueError(
                "--batch must be >= 2, --repeats >= 1, --cold_mb >= 0, and every cache length >= 1."
            )
        if args.attention == "cudnn":
            cli.check_cudnn_backend(
                "--attention=cudnn", "pass another --attention (dot_product, einsum)."
            )
    except (ValueError, cli.UsageError) as error:
        cli.exit_with_error(str(error))
    rng = np.random.default_rng(args.seed)
    kernels = {
        each.spec(): jax.jit(functools.partial(decode_attention, settings=each))
        for each in settings
    }
    baseline = baseline_fn(cfg)
    for cache_len in cache_lens:
        q, k, v, visible = random_inputs(args, cfg, cache_len, rng)
        inputs = (q, k, v, jnp.asarray(visible))
        expected = reference(q, k, v, visible)
        outs = [np.asarray(kernel(*inputs).astype(jnp.float32)) for kernel in kernels.values()]
        line = {
            "bench": "decode_attention_kernel",
            "backend": jax.default_backend(),
            "shape": args.shape,
            "batch": args.batch,
            "cache_len": cache_len,
            "mean_visible_len": round(float(visible.sum(axis=1).mean()), 1),
            "dtype": args.dtype,
            "max_abs_error": max(float(np.abs(out - expected).max()) for out in outs),
            "empty_row_zero": all(bool((out[-1] == 0).all()) for out in outs),
            "model_settings": SETTINGS.spec(),
            "baseline_attention": args.attention,
            **timed(kernels, baseline, inputs, args.repeats, args.cold_mb, "baseline"),
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
