"""A decode step's attention input as one Pallas kernel: the RMSNorm, the Q, K and V
projections (and their biases), the rotary embedding of Q and K, and the write of the
new K and V into the cache.

In a decode step XLA runs these as five kernels a layer (qwen2.5-0.5b, batch 256,
compiled for an H200): the norm, one matmul over the concatenated Q|K|V weights that
writes float32 partial sums, then one kernel each for K (sum, bias, rotary, cache write),
V (sum, bias, cache write) and Q (sum, bias, rotary). Each moves well under a megabyte
besides the 2 MB of weights, so each costs about a kernel's fixed latency (the README's
H200 profile puts "the rest" of a layer, these among them, at about 20 µs). This kernel
does all of it in one: one program per (block of rows, head), for the query heads, then
the key heads, then the value heads. It walks the model width in blocks of `block_k`,
accumulating (x * norm scale) · W for the head's two halves in float32 and the rows'
sum of squares beside them, and scales the sums by the rows' inverse RMS at the end
(the RMS is a factor of each row, so it can wait for the products). A query head's
program writes its rotated head to the output; a key or value head's writes its head
into the cache at each row's slot, in place.

It takes RMSNorm without a bias, full rotary (rotary dims = head dim) or none, and
head dims that are powers of two of at least 32. On a GPU it lowers through Triton;
elsewhere it runs in Pallas' interpreter (slow: for tests on a CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tba_jax.models.config import QkvKernelSettings, check_qkv_kernel_settings
from tba_jax.models.gated_mlp import (
    block_for,
    inverse_rms,
    pad_to_row_blocks,
    scaled_for_folded_norm,
)
from tba_jax.models.kernel_mesh import ROWS, SPLIT, on_platform, per_shard, triton_launch

# What the model runs with unless `model.decode_qkv_kernel` says otherwise.
SETTINGS = QkvKernelSettings()


def _kernel(
    x_ref,
    scale_ref,
    wq_ref,
    wk_ref,
    wv_ref,
    bq_ref,
    bk_ref,
    bv_ref,
    cos_ref,
    sin_ref,
    slots_ref,
    k_cache_in,
    v_cache_in,
    q_ref,
    k_cache_ref,
    v_cache_ref,
    *,
    block_k: int,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    rotary: bool,
):
    """One (block of rows, head). x_ref [block_m, d]; scale_ref [d]; w*_ref [d, head_dim]
    (this head's columns); b*_ref [head_dim]; cos_ref, sin_ref [block_m, head_dim / 2];
    slots_ref [block_m]; the caches [B, S, KV, head_dim] whole (aliased in and out);
    q_ref [block_m, head_dim]."""
    del k_cache_in, v_cache_in  # the same buffers as k_cache_ref and v_cache_ref
    block_m, width = x_ref.shape
    half = q_ref.shape[1] // 2
    row_block, head = pl.program_id(0), pl.program_id(1)

    def halves(w_ref, b_ref):
        """(first, second) [block_m, half] float32: the head's halves of norm(x) W + b."""

        def body(step, sums):
            first, second, squares = sums
            cols = pl.ds(pl.multiple_of(step * block_k, block_k), block_k)
            scaled, block_squares = scaled_for_folded_norm(x_ref[:, cols], scale_ref[cols])
            squares += block_squares
            first += jnp.dot(scaled, w_ref[cols, :half], preferred_element_type=jnp.float32)
            second += jnp.dot(scaled, w_ref[cols, half:], preferred_element_type=jnp.float32)
            return first, second, squares

        zeros = jnp.zeros((block_m, half), jnp.float32)
        init = (zeros, zeros, jnp.zeros((block_m,), jnp.float32))
        first, second, squares = jax.lax.fori_loop(0, width // block_k, body, init)
        row_scale = inverse_rms(squares, width, eps)
        first = first * row_scale + b_ref[:half].astype(jnp.float32)[None, :]
        second = second * row_scale + b_ref[half:].astype(jnp.float32)[None, :]
        return first, second

    def rotated(first, second):
        if not rotary:
            return first, second
        cos, sin = cos_ref[...], sin_ref[...]
        return first * cos - second * sin, second * cos + first * sin

    def write_cache(cache_ref, kv_head, first, second):
        # every index an array of [block_m, half] (rows, slots, the head, the dims): a
        # scatter, which Triton and Pallas' interpreter both take
        rows = (row_block * block_m + jnp.arange(block_m))[:, None]
        slots = slots_ref[...][:, None]
        dims = jnp.arange(half)[None, :]
        kept = jnp.broadcast_to(rows < cache_ref.shape[0], (block_m, half))
        for start, value in ((0, first), (half, second)):
            target = cache_ref.at[rows, slots, kv_head, start + dims]
            plgpu.store(target, value.astype(cache_ref.dtype), mask=kept)

    @pl.when(head < num_heads)
    def _():
        first, second = rotated(*halves(wq_ref, bq_ref))
        q_ref[:, :half] = first.astype(q_ref.dtype)
        q_ref[:, half:] = second.astype(q_ref.dtype)

    @pl.when((head >= num_heads) & (head < num_heads + num_kv_heads))
    def _():
        write_cache(k_cache_ref, head - num_heads, *rotated(*halves(wk_ref, bk_ref)))

    @pl.when(head >= num_heads + num_kv_heads)
    def _():
        write_cache(v_cache_ref, head - num_heads - num_kv_heads, *halves(wv_ref, bv_ref))


def project_qkv(
    x: jax.Array,
    norm_scale: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array,
    biases: tuple[jax.Array, jax.Array, jax.Array],
    cos: jax.Array | None,
    sin: jax.Array | None,
    cache_k: jax.Array,
    cache_v: jax.Array,
    slots: jax.Array,
    *,
    eps: float,
    settings: QkvKernelSettings = SETTINGS,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q [M, H, hd], cache_k, cache_v) for one decode slot of M rows.

    x [M, d] the block's input (before its RMSNorm, whose `norm_scale` [d] and `eps`
    these are); wq [d, H, hd], wk and wv [d, KV, hd] and `biases` ([H, hd], [KV, hd],
    [KV, hd]) in x's dtype; `cos`, `sin` [M, hd / 2] float32, the rotary angles' of each
    row's position (None: no rotary embedding); the caches [M, S, KV, hd], into which
    each row's new key and value are written at slot `slots` [M] (int). The products are
    accumulated in float32 over x * norm_scale rounded to x's dtype, scaled by each row's
    inverse RMS, the biases added and the rotary embedding applied in float32, and each
    result rounded once. `settings`: the kernel's tiles and launch
    (`QkvKernelSettings`). `interpret`: None runs the Triton kernel where the program is
    lowered for a CUDA GPU and Pallas' interpreter elsewhere. On a mesh of several devices
    each runs it on its rows and its heads (`kernel_mesh.per_shard`; the tensor axis must
    divide the KV heads, else every device computes all heads)."""
    rows, _ = x.shape
    num_kv_heads, head_dim = wk.shape[1:]
    rotary = cos is not None
    if not rotary:
        cos = sin = jnp.zeros((rows, head_dim // 2), jnp.float32)
    run = functools.partial(_project_qkv, eps=eps, rotary=rotary, settings=settings)
    kernel = on_platform(run, "cuda", interpret)
    heads = (None, SPLIT, None)
    return per_shard(
        kernel,
        (x, norm_scale, wq, wk, wv, *biases, cos, sin, slots, cache_k, cache_v),
        (
            (ROWS, None),
            (None,),
            heads,
            heads,
            heads,
            (SPLIT, None),
            (SPLIT, None),
            (SPLIT, None),
            (ROWS, None),
            (ROWS, None),
            (ROWS,),
            (ROWS, None, SPLIT, None),
            (ROWS, None, SPLIT, None),
        ),
        ((ROWS, SPLIT, None), (ROWS, None, SPLIT, None), (ROWS, None, SPLIT, None)),
        rows=rows,
        split=num_kv_heads,
    )


def _project_qkv(
    x: jax.Array,
    norm_scale: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array,
    bq: jax.Array,
    bk: jax.Array,
    bv: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    slots: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    *,
    eps: float,
    rotary: bool,
    settings: QkvKernelSettings,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`project_qkv` on one device's shard, with Pallas' interpreter or not."""
    check_qkv_kernel_settings(settings)
    rows, width = x.shape
    _, num_heads, head_dim = wq.shape
    num_kv_heads = wk.shape[1]
    block_k = block_for(width, settings.block_k)
    x, block_m = pad_to_row_blocks(x, settings.block_m)
    cos, sin, slots = (pad_to_row_blocks(a, block_m)[0] for a in (cos, sin, slots))
    padded_rows = x.shape[0]
    last_q, last_kv = num_heads - 1, num_kv_heads - 1

    def q_head(j):
        return jnp.minimum(j, last_q)

    def k_head(j):
        return jnp.clip(j - num_heads, 0, last_kv)

    def v_head(j):
        return jnp.clip(j - num_heads - num_kv_heads, 0, last_kv)

    def weight_spec(head_of):
        return pl.BlockSpec((width, head_dim), lambda i, j: (0, head_of(j)))

    def bias_spec(head_of):
        return pl.BlockSpec((head_dim,), lambda i, j: (head_of(j),))

    half = head_dim // 2
    row_spec = pl.BlockSpec((block_m, half), lambda i, j: (i, 0))
    cache_spec = pl.BlockSpec(cache_k.shape, lambda i, j: (0, 0, 0, 0))
    kernel = functools.partial(
        _kernel,
        block_k=block_k,
        eps=eps,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        rotary=rotary,
    )
    q, cache_k, cache_v = pl.pallas_call(
        kernel,
        grid=(padded_rows // block_m, num_heads + 2 * num_kv_heads),
        in_specs=[
            pl.BlockSpec((block_m, width), lambda i, j: (i, 0)),
            pl.BlockSpec((width,), lambda i, j: (0,)),
            weight_spec(q_head),
            weight_spec(k_head),
            weight_spec(v_head),
            bias_spec(q_head),
            bias_spec(k_head),
            bias_spec(v_head),
            row_spec,
            row_spec,
            pl.BlockSpec((block_m,), lambda i, j: (i,)),
            cache_spec,
            cache_spec,
        ],
        out_specs=[
            pl.BlockSpec((block_m, head_dim), lambda i, j: (i, q_head(j))),
            cache_spec,
            cache_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((padded_rows, num_heads * head_dim), x.dtype),
            jax.ShapeDtypeStruct(cache_k.shape, cache_k.dtype),
            jax.ShapeDtypeStruct(cache_v.shape, cache_v.dtype),
        ],
        input_output_aliases={11: 1, 12: 2},
        interpret=interpret,
        name="decode_qkv",
        **triton_launch(settings, interpret),
    )(
        x,
        norm_scale,
        wq.reshape(width, num_heads * head_dim),
        wk.reshape(width, num_kv_heads * head_dim),
        wv.reshape(width, num_kv_heads * head_dim),
        bq.reshape(-1),
        bk.reshape(-1),
        bv.reshape(-1),
        cos,
        sin,
        slots.astype(jnp.int32),
        cache_k,
        cache_v,
    )
    return q[:rows].reshape(rows, num_heads, head_dim), cache_k, cache_v
