"""A decode step's attention as one Pallas kernel over the KV cache as it is laid out.

A decode step has one query slot per row. XLA's einsum attention and cuDNN's flash kernel
treat it as a general attention: cuDNN tiles the query axis (one valid row in a tile of
64), and both read every cache slot, the empty ones masked. This kernel is flash decoding
for grouped-query attention (`jax.experimental.pallas.ops.gpu.decode_attention`'s
structure): one program per (row, KV head) holds that head's G query heads in one tile
and walks the cache in blocks of `block_k` slots up to the row's last visible slot,
loading no slot past it (masked loads), with an online softmax in float32. It reads the
cache [B, S_kv, KV, hd] in place (the library's `gqa` transposes it to [B, KV, S_kv, hd]
first: a copy of the whole cache every layer of every step) and takes any mask of
visible slots (left-padded prompts, the slot engine's per-row prefixes), not only a
contiguous range.

On a GPU it lowers through Triton; elsewhere it runs in Pallas' interpret mode (slow:
for tests on a CPU).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tba_jax.models.config import (
    MIN_BLOCK_K,
    PALLAS_DECODE_TILE,
    KernelSettings,
    check_kernel_settings,
)
from tba_jax.models.kernel_mesh import ROWS, SPLIT, on_platform, per_shard, triton_launch

# Query heads sharing a KV head are loaded as a tile of this many rows, the rows past them
# masked: Triton's matmuls need at least 16 on each side (`ModelConfig` checks a model's
# heads against it).
QUERY_TILE = PALLAS_DECODE_TILE
QK_DIMS = (((1,), (1,)), ((), ()))  # [tile, hd] · [block_k, hd] over hd
KERNEL_NAME = "decode_attention"  # the pallas_call's name, which its compiled program keeps
# The kernel's operands (q, k, v, visible, length) that it reads only up to each row's
# length, a block at a time (`slots_read`): the cache and the mask of visible slots.
LENGTH_BOUNDED_OPERANDS = (1, 2, 3)


# What the model runs with unless `model.decode_kernel` says otherwise (the library kernel's
# launch settings, one program a row's walk).
SETTINGS = KernelSettings()


def block_k_for(cache_len: int, block_k: int = SETTINGS.block_k) -> int:
    """The cache slots the kernel reads at once: `block_k`, or the largest power of two
    that fits a shorter cache (Triton's blocks are powers of two, at least `MIN_BLOCK_K`
    for its matmuls), or a cache shorter than that whole (the interpreter's only). A cache
    length that is no multiple of it ends in a block that overlaps the one before."""
    if cache_len >= block_k:
        return block_k
    if cache_len >= MIN_BLOCK_K:
        return 1 << (cache_len.bit_length() - 1)
    return cache_len


def slots_read(length: int, cache_len: int) -> int:
    """Cache slots a row's walk reads when its last visible slot is `length - 1`: each slot
    up to that one, once, whatever the block size (its blocks load only the slots below
    the row's length, and the last block of a cache that is no multiple of the block only
    those the block before did not)."""
    return min(length, cache_len)


def _kernel(
    q_ref,
    k_ref,
    v_ref,
    visible_ref,
    length_ref,
    o_ref,
    *split_refs,
    groups: int,
    block_k: int,
    blocks_per_split: int,
    scale: float,
):
    """One (row, KV head, split of the cache): q_ref, o_ref [QUERY_TILE, hd] blocks over
    the head's `groups` query heads (the rows past them masked: zeros in, nothing written
    out); k_ref, v_ref [S_kv, hd]; visible_ref [S_kv] int32 (1: the query sees the slot);
    length_ref [1] int32 (the last visible slot + 1). The program reads blocks
    split × blocks_per_split onwards. Without `split_refs` it is the whole walk and writes
    the normalised output; with them (max_ref, sum_ref: [QUERY_TILE]) it writes its
    unnormalised sum of values and the softmax's running max and sum, for `_combine`."""
    tile_rows = pl.ds(0, QUERY_TILE)
    rows_kept = (jnp.arange(QUERY_TILE) < groups)[:, None]
    q = plgpu.load(q_ref.at[tile_rows, :], mask=rows_kept, other=0.0)
    head_dim = q.shape[-1]
    cache_len = k_ref.shape[0]
    length = length_ref[0]
    first_block = pl.program_id(2) * blocks_per_split
    end_block = jnp.minimum(first_block + blocks_per_split, pl.cdiv(length, block_k))

    def body(block, carry):
        out, row_max, row_sum = carry
        # the last block of a cache that is no multiple of block_k starts early: the slots
        # it shares with the block before were read there. A block loads only its own
        # slots below the row's length (masked loads read nothing from memory), so the
        # walk reads each slot up to the last visible one once (`slots_read`).
        first = block * block_k
        start = jnp.minimum(first, cache_len - block_k)
        slots = pl.ds(start, block_k)
        index = start + jnp.arange(block_k)
        wanted = (index >= first) & (index < length)
        k = plgpu.load(k_ref.at[slots, :], mask=wanted[:, None], other=0.0).astype(q.dtype)
        # q · kᵀ: [tile, block_k]
        scores = jax.lax.dot_general(q, k, QK_DIMS, preferred_element_type=jnp.float32) * scale
        seen = plgpu.load(visible_ref.at[slots], mask=wanted, other=0) != 0
        scores = jnp.where(seen[None, :], scores, -jnp.inf)
        new_max = jnp.maximum(row_max, scores.max(axis=-1))
        # rows that have seen nothing yet keep a max of -inf: shift by 0 there instead
        shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        correction = jnp.exp(row_max - shift)
        weights = jnp.exp(scores - shift[:, None])
        row_sum = correction * row_sum + weights.sum(axis=-1)
        v = plgpu.load(v_ref.at[slots, :], mask=wanted[:, None], other=0.0).astype(q.dtype)
        out = correction[:, None] * out + jnp.dot(
            weights.astype(q.dtype), v, preferred_element_type=jnp.float32
        )
        return out, new_max, row_sum

    tile = q.shape[0]
    init = (
        jnp.zeros((tile, head_dim), jnp.float32),
        jnp.full((tile,), -jnp.inf, jnp.float32),
        jnp.zeros((tile,), jnp.float32),
    )
    out, row_max, row_sum = jax.lax.fori_loop(first_block, end_block, body, init)
    if split_refs:
        max_ref, sum_ref = split_refs
        plgpu.store(max_ref.at[tile_rows], row_max, mask=rows_kept[:, 0])
        plgpu.store(sum_ref.at[tile_rows], row_sum, mask=rows_kept[:, 0])
    else:
        out = _normalised(out, row_sum)
    plgpu.store(o_ref.at[tile_rows, :], out.astype(o_ref.dtype), mask=rows_kept)


def _normalised(out: jax.Array, row_sum: jax.Array) -> jax.Array:
    """out [..., hd] over its softmax sum [...]; zeros where the query saw no slot (a
    padded prompt's row), as the fused kernels give."""
    return jnp.where(row_sum[..., None] > 0, out / jnp.maximum(row_sum, 1e-30)[..., None], 0.0)


def _combine(out: jax.Array, row_max: jax.Array, row_sum: jax.Array) -> jax.Array:
    """The splits' partial results, out [..., splits, G, hd] and their softmax's max and
    sum [..., splits, G], as one attention output [..., G, hd] (float32). A split that
    saw no slot has a max of -inf and weighs nothing."""
    top = row_max.max(axis=-2, keepdims=True)
    weight = jnp.exp(row_max - jnp.where(top == -jnp.inf, 0.0, top))
    total = (weight * row_sum).sum(axis=-2)
    return _normalised((weight[..., None] * out).sum(axis=-3), total)


def decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    visible: jax.Array,
    *,
    settings: KernelSettings = SETTINGS,
    interpret: bool | None = None,
) -> jax.Array:
    """Attention of one query slot per row over a KV cache.

    q: [B, H, hd]; k, v: [B, S_kv, KV, hd] (H a multiple of KV, at most `QUERY_TILE`
    query heads per KV head); visible: [B, S_kv] bool, the slots each row's query sees
    (causal and not padding). Scores and softmax in float32, the weights cast to the
    queries' dtype for their matmul with the values (as `transformer.einsum_attention`).
    Returns [B, H, hd] in q's dtype, zero for a row that sees no slot. `settings`: how the
    work is split and launched (`KernelSettings`; at most one split per block). `interpret`:
    None runs the Triton kernel where the program is lowered for a CUDA GPU and Pallas'
    interpreter elsewhere (chosen as the program is lowered, so a GPU program compiled on a
    machine without one gets the kernel), and the interpreter for a cache shorter than
    `MIN_BLOCK_K` slots or heads narrower than that, which Triton's matmuls do not take (a
    toy model's; its cost is nothing beside the rest of the step). A head width that is no
    power of two has no Triton kernel (`ModelConfig` refuses it for the model). On a mesh
    of several devices each runs it on its rows and KV heads (`kernel_mesh.per_shard`).
    """
    if interpret is None and min(k.shape[1], k.shape[3]) < MIN_BLOCK_K:
        interpret = True
    kernel = on_platform(functools.partial(_decode_attention, settings=settings), "cuda", interpret)
    cache_dims = (ROWS, None, SPLIT, None)
    return per_shard(
        kernel,
        (q, k, v, visible),
        ((ROWS, SPLIT, None), cache_dims, cache_dims, (ROWS, None)),
        (ROWS, SPLIT, None),
        rows=q.shape[0],
        split=k.shape[2],
    )


def _decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    visible: jax.Array,
    *,
    settings: KernelSettings,
    interpret: bool,
) -> jax.Array:
    """`decode_attention` with Pallas' interpreter or not."""
    batch, num_heads, head_dim = q.shape
    cache_len, kv_heads = k.shape[1], k.shape[2]
    groups = num_heads // kv_heads
    if groups * kv_heads != num_heads or groups > QUERY_TILE:
        raise ValueError(
            f"decode attention 'pallas' takes up to {QUERY_TILE} query heads per KV head; "
            f"this model has {num_heads} query and {kv_heads} KV heads."
        )
    check_kernel_settings(settings)
    block_k = block_k_for(cache_len, settings.block_k)
    blocks = -(-cache_len // block_k)
    blocks_per_split = -(-blocks // settings.k_splits)
    splits = -(-blocks // blocks_per_split)  # no split left without a block
    q_groups = q.reshape(batch, kv_heads, groups, head_dim)  # each KV head's query heads
    slots = jnp.arange(cache_len)
    length = jnp.max(jnp.where(visible, slots[None, :] + 1, 0), axis=1).astype(jnp.int32)
    kernel = functools.partial(
        _kernel,
        groups=groups,
        block_k=block_k,
        blocks_per_split=blocks_per_split,
        scale=1.0 / math.sqrt(head_dim),
    )
    cache_spec = pl.BlockSpec((None, cache_len, None, head_dim), lambda b, h, s: (b, 0, h, 0))
    tile = (QUERY_TILE, head_dim)
    q_spec = pl.BlockSpec((None, None, *tile), lambda b, h, s: (b, h, 0, 0))
    if splits == 1:
        out_specs = q_spec
        out_shape = jax.ShapeDtypeStruct(q_groups.shape, q.dtype)
    else:  # per split: the unnormalised output, the softmax's max and sum
        grouped = (batch, kv_heads, splits, groups)
        out_specs = [
            pl.BlockSpec((None, None, None, *tile), lambda b, h, s: (b, h, s, 0, 0)),
            *[pl.BlockSpec((None, None, None, QUERY_TILE), lambda b, h, s: (b, h, s, 0))] * 2,
        ]
        out_shape = [
            jax.ShapeDtypeStruct((*grouped, head_dim), jnp.float32),
            *[jax.ShapeDtypeStruct(grouped, jnp.float32)] * 2,
        ]
    out = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, splits),
        in_specs=[
            q_spec,
            cache_spec,
            cache_spec,
            pl.BlockSpec((None, cache_len), lambda b, h, s: (b, 0)),
            pl.BlockSpec((None, 1), lambda b, h, s: (b, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name=KERNEL_NAME,
        **triton_launch(settings, interpret),
    )(q_groups, k, v, visible.astype(jnp.int32), length[:, None])
    if splits > 1:
        out = _combine(*out).astype(q.dtype)
    return out.reshape(batch, num_heads, head_dim)
