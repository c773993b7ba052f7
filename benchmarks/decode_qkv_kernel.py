r"""The Pallas attention-input kernel (`model.decode_qkv=pallas`) on this machine's backend:
a decode step's RMSNorm, Q, K and V projections (with biases), rotary embedding and KV
cache write at a model's widths, against the same written in float64 NumPy, and its time
beside XLA's kernels for the same work (as the model computes it without the kernel).

    python benchmarks/decode_qkv_kernel.py                        # qwen2.5-0.5b, 256 rows
    python benchmarks/decode_qkv_kernel.py --shape=qwen2.5-1.5b --rows=64,256
    python benchmarks/decode_qkv_kernel.py --settings=64:64:4:3,32:64:4:3

On a GPU the kernel is Triton's; elsewhere Pallas' interpreter runs it (slow: a check of
the script, not a timing). One JSON line per row count: `max_abs_error` (against float64,
on the inputs rounded to `--dtype`: the rotated queries and the keys and values written,
the worst over `--settings`, with `xla_max_abs_error` beside it), `kernel_us` (one figure
per `--settings` entry `block_m:block_k:num_warps:num_stages`,
`models.config.QkvKernelSettings`, keyed so; `fastest`: the key of the least, a
`model.decode_qkv_kernel` value; `model_settings`: the kernel's defaults,
`decode_qkv.SETTINGS`) and `xla_us` (XLA's kernels for the same work), each one call's
time after a compiling one (`timing`, as `decode_attention_kernel.call_us`). Every call
writes one slot of a cache of `--cache_len` slots per row in place (the caches donated
and passed on, as in a decode loop). `bytes` is what the work must move (the weights, the
rows in, the queries out and the keys and values written) and `hbm_bound_us` its time at
the HBM bandwidth of `peaks`. Each is timed cold too (`kernel_cold_us`, `xla_cold_us`,
`fastest_cold`, `cold_copies`; `--cold_mb`, 0: not): the calls cycle through copies of
the inputs that no cache holds.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from tba_jax.models import transformer
from tba_jax.models.config import parse_qkv_kernel_settings
from tba_jax.models.decode_qkv import SETTINGS, project_qkv

# Run as a script, Python puts benchmarks/ on the path, not the repository root (see
# decode_projection_kernel.py).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from benchmarks.decode_attention_kernel import timed  # noqa: E402
from benchmarks.gated_mlp_kernel import row_kernel_command_line  # noqa: E402
from tba_jax import roofline  # noqa: E402

# block_m:block_k:num_warps:num_stages. The model's settings first, then fewer and more
# rows a program, shorter and longer walks, fewer and more warps and stages.
DEFAULT_SETTINGS = (
    "64:64:4:3,32:64:4:3,16:64:4:3,128:64:8:3,64:32:4:3,64:128:4:3,32:128:4:3,"
    "64:64:2:3,64:64:8:3,32:64:4:4"
)
CACHE_LEN = 512  # the README's decode shape: 256 prompt + 256 new tokens
SLOT = 300  # the slot every row writes (a decode step's offset)
ROTARY_THETA = 10_000.0


def reference(inputs: dict, eps: float, rotary: bool) -> tuple[np.ndarray, ...]:
    """(q [M, H, hd], the new keys, the new values [M, KV, hd]) in float64 NumPy: x
    normalised by its RMS times `scale`, projected, the biases added, q and k rotated by
    `angles` [M, hd / 2] (rotate_half's convention) where `rotary`."""
    x = np.asarray(inputs["x"], np.float64)
    normed = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * inputs["scale"]
    head_dim = inputs["wq"].shape[-1]
    theta = np.asarray(inputs["angles"], np.float64)[:, None, :]

    def project(w, b, rotate):
        out = np.einsum("md,dhe->mhe", normed, np.asarray(w, np.float64))
        out += np.asarray(b, np.float64)
        if not rotate:
            return out
        first, second = out[..., : head_dim // 2], out[..., head_dim // 2 :]
        cos, sin = np.cos(theta), np.sin(theta)
        return np.concatenate([first * cos - second * sin, second * cos + first * sin], -1)

    return (
        project(inputs["wq"], inputs["bq"], rotary),
        project(inputs["wk"], inputs["bk"], rotary),
        project(inputs["wv"], inputs["bv"], False),
    )


def random_inputs(cfg, rows: int, dtype, rng: np.random.Generator) -> dict:
    """A decode step's inputs at `cfg`'s widths, as float64 NumPy (cast for each call)."""
    heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    width = cfg.d_model
    scale = 1.0 / np.sqrt(width)  # unit-variance products, as a trained layer's

    def rounded(shape, factor=1.0):
        values = rng.normal(size=shape) * factor
        return np.asarray(jnp.asarray(values, dtype).astype(jnp.float32), np.float64)

    inv_freq = 1.0 / ROTARY_THETA ** (np.arange(0, head_dim, 2) / head_dim)
    positions = rng.integers(0, CACHE_LEN, size=rows)
    return {
        "x": rounded((rows, width), 3.0),
        "scale": 1 + 0.1 * rng.normal(size=width),
        "wq": rounded((width, heads, head_dim), scale),
        "wk": rounded((width, kv_heads, head_dim), scale),
        "wv": rounded((width, kv_heads, head_dim), scale),
        "bq": rounded((heads, head_dim)),
        "bk": rounded((kv_heads, head_dim)),
        "bv": rounded((kv_heads, head_dim)),
        "angles": positions[:, None] * inv_freq[None, :],
    }


def threaded(step, caches: tuple):
    """`step(*inputs, cache_k, cache_v) -> (q, cache_k, cache_v)` (jitted, the caches
    donated) as a function of the inputs alone, which passes each call's caches on to the
    next, as a decode loop does; returns q."""
    state = list(caches)

    def call(*inputs):
        q, *state[:] = step(*inputs, *state)
        return q

    return call


def kernel_step(settings, eps: float):
    def step(x, scale, wq, wk, wv, bq, bk, bv, cos, sin, slots, cache_k, cache_v):
        return project_qkv(
            x, scale, wq, wk, wv, (bq, bk, bv), cos, sin, cache_k, cache_v, slots,
            eps=eps, settings=settings,
        )  # fmt: skip

    return jax.jit(step, donate_argnums=(11, 12))


def xla_step(cfg):
    """The same work as the model does it without the kernel: `transformer.normalise`
    (`transformer.Norm`'s arithmetic), `transformer.dense`, the rotary embedding of
    `transformer.rotary_embedding` from the same angles, and `transformer.write_cache` at
    one offset for every row (a decode loop's)."""
    dt = cfg.compute_dtype

    def step(x, scale, wq, wk, wv, bq, bk, bv, cos, sin, slots, cache_k, cache_v):
        normed = transformer.normalise(x, scale, cfg.norm_eps)

        def rotate(t):
            t32 = t.astype(jnp.float32)
            first, second = jnp.split(t32, 2, axis=-1)
            c, s = cos[:, None], sin[:, None]
            return jnp.concatenate([first * c - second * s, second * c + first * s], -1).astype(dt)

        q = rotate(transformer.dense(normed, wq) + bq)
        k = rotate(transformer.dense(normed, wk) + bk)
        v = transformer.dense(normed, wv) + bv
        offset = slots[0]
        cache_k = transformer.write_cache(cache_k, k[:, None], offset)
        cache_v = transformer.write_cache(cache_v, v[:, None], offset)
        return q, cache_k, cache_v

    return jax.jit(step, donate_argnums=(11, 12))


def step_arrays(inputs: dict, rows: int, dtype) -> tuple:
    """The arguments of a step before the caches, from `random_inputs`' arrays: the
    weights and rows in `dtype`, the norm's scale and the angles' cos and sin in float32,
    and every row's slot (`SLOT`)."""
    in_dtype = [jnp.asarray(inputs[name], dtype) for name in ("wq", "wk", "wv", "bq", "bk", "bv")]
    cos, sin = (jnp.asarray(f(inputs["angles"]), jnp.float32) for f in (np.cos, np.sin))
    scale = jnp.asarray(inputs["scale"], jnp.float32)
    slots = jnp.full((rows,), SLOT, jnp.int32)
    return (jnp.asarray(inputs["x"], dtype), scale, *in_dtype, cos, sin, slots)


def fresh_caches(cfg, rows: int, dtype) -> tuple[jax.Array, jax.Array]:
    shape = (rows, CACHE_LEN, cfg.num_kv_heads, cfg.resolved_head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def worst_error(step, arrays: tuple, caches: tuple, expected: tuple) -> float:
    """The largest difference from `expected` (float64: q, keys, values) of one call of
    `step` on `caches`: its q and the keys and values it wrote at `SLOT`."""
    q, cache_k, cache_v = step(*arrays, *caches)
    got = (q, cache_k[:, SLOT], cache_v[:, SLOT])
    return max(
        float(np.abs(np.asarray(g.astype(jnp.float32), np.float64).reshape(w.shape) - w).max())
        for g, w in zip(got, expected, strict=True)
    )


def measure(args, cfg, rows: int, steps: dict, xla, rng: np.random.Generator) -> dict:
    """One JSON line's figures at `rows` rows (see the module's docstring)."""
    dtype = jnp.dtype(args.dtype)
    inputs = random_inputs(cfg, rows, dtype, rng)
    arrays = step_arrays(inputs, rows, dtype)
    expected = reference(inputs, cfg.norm_eps, rotary=True)
    heads = cfg.num_heads + 2 * cfg.num_kv_heads
    moved = dtype.itemsize * (
        cfg.d_model * heads * cfg.resolved_head_dim  # the weights
        + rows * cfg.d_model  # the rows in
        + rows * heads * cfg.resolved_head_dim  # q out, the keys and values written
    )
    kernels = {key: threaded(step, fresh_caches(cfg, rows, dtype)) for key, step in steps.items()}
    baseline = threaded(xla, fresh_caches(cfg, rows, dtype))
    peaks = roofline.peaks_for(jax.devices()[0].device_kind)
    return {
        "max_abs_error": max(
            worst_error(step, arrays, fresh_caches(cfg, rows, dtype), expected)
            for step in steps.values()
        ),
        "xla_max_abs_error": worst_error(xla, arrays, fresh_caches(cfg, rows, dtype), expected),
        "model_settings": SETTINGS.spec(),
        **timed(kernels, baseline, arrays, args.repeats, args.cold_mb, "xla"),
        "bytes": moved,
        "peaks": peaks.name,
        "hbm_bound_us": round(1e6 * moved / peaks.hbm_bytes_per_s, 1),
    }


def main() -> None:
    args, row_counts, settings, cfg = row_kernel_command_line(
        __doc__.splitlines()[0], DEFAULT_SETTINGS, parse_qkv_kernel_settings, "decode_qkv"
    )
    rng = np.random.default_rng(args.seed)
    steps = {each.spec(): kernel_step(each, cfg.norm_eps) for each in settings}
    xla = xla_step(cfg)
    for rows in row_counts:
        line = {
            "bench": "decode_qkv_kernel",
            "backend": jax.default_backend(),
            "shape": args.shape,
            "rows": rows,
            "d_model": cfg.d_model,
            "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.resolved_head_dim,
            "cache_len": CACHE_LEN,
            "dtype": args.dtype,
            **measure(args, cfg, rows, steps, xla, rng),
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
