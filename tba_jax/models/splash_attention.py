"""Causal attention of a cache-free pass (the learner's, π_ref scoring's) through the splash
attention kernel Pallas ships for TPUs (`jax.experimental.pallas.ops.tpu.splash_attention`):
flash attention that skips the blocks the causal mask hides, forward and backward.

`model.attention="splash"`. The kernel takes one row's [heads, S, hd] queries, a causal
mask built once per sequence length (host NumPy), and segment ids: a key is visible to a
query when both are real tokens (segment 1) or both padding (segment 0), so a real token
attends over the real tokens before it, as `key_valid` says, and a padding query sees at
least itself (no empty softmax, no NaN). Grouped-query heads run as multi-query attention
per KV head (the kernel's `mqa` form: the KV head is read once for its G query heads), and
the batch and KV heads are vmapped. The kernel does not scale the scores: the queries are
scaled by 1/sqrt(hd) first.

On a TPU it lowers through Mosaic; elsewhere Pallas' interpreter runs it (slow: for tests
on a CPU; a run is refused off a TPU, `config_lib.check_attention`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from tba_jax.models.kernel_mesh import ROWS, SPLIT, on_platform, per_shard

# The kernel's query and key blocks (`splash.BlockSizes.get_default()`): a pass's sequence
# is padded to a multiple of this (`transformer.FUSED_SEQ_MULTIPLE`).
BLOCK = 128


def _kernel(seq_len: int, groups: int, interpret: bool):
    """The MQA kernel for `groups` query heads over `seq_len` slots, causal. Made anew in
    each program that asks for it: its block tables become the program's constants (the
    library caches the tables themselves, `mask_info._process_mask`). Made once as
    concrete arrays, under a mesh in context they would be put on the mesh's devices
    while the program is traced. The kernel's modules are imported here: most programs
    never ask for one."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    mask = masks.MultiHeadMask([masks.CausalMask((seq_len, seq_len))] * groups)
    return splash.make_splash_mqa(
        mask,
        block_sizes=splash.BlockSizes.get_default(),
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, key_valid: jax.Array, *, interpret: bool | None = None
) -> jax.Array:
    """q [B, S, H, hd]; k, v [B, S, KV, hd]; key_valid [B, S] bool; S a multiple of
    `BLOCK`. Softmax attention of each query over the real keys at or before its slot,
    in q's dtype: [B, S, H, hd] (a padding query's output is its attention over the
    padding before it: callers drop it). `interpret`: None runs the TPU kernel where the
    program is lowered for a TPU and Pallas' interpreter elsewhere. On a mesh of several
    devices each runs it on its rows and KV heads (`kernel_mesh.per_shard`: XLA refuses to
    split a Mosaic kernel itself)."""
    kernel = on_platform(_causal_attention, "tpu", interpret)
    heads_dims = (ROWS, None, SPLIT, None)
    return per_shard(
        kernel,
        (q, k, v, key_valid),
        (heads_dims, heads_dims, heads_dims, (ROWS, None)),
        heads_dims,
        rows=q.shape[0],
        split=k.shape[2],
    )


def _causal_attention(q, k, v, key_valid, *, interpret: bool) -> jax.Array:
    batch, seq_len, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    if seq_len % BLOCK:
        raise ValueError(f"splash attention takes a multiple of {BLOCK} slots, got {seq_len}.")
    kernel = _kernel(seq_len, groups, interpret)
    scaled = (q.astype(jnp.float32) / math.sqrt(head_dim)).astype(q.dtype)
    # [B, KV, G, S, hd] queries and [B, KV, S, hd] keys and values: one MQA call each
    grouped = scaled.reshape(batch, seq_len, kv_heads, groups, head_dim).transpose(0, 2, 3, 1, 4)
    keys, values = (x.transpose(0, 2, 1, 3) for x in (k, v))
    segment = key_valid.astype(jnp.int32)

    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import (
        SegmentIds,
    )

    def one_head(q_head, k_head, v_head, row_segment):
        ids = SegmentIds(q=row_segment, kv=row_segment)
        return kernel(q_head, k_head, v_head, segment_ids=ids)

    per_kv_head = jax.vmap(one_head, in_axes=(0, 0, 0, None))
    out = jax.vmap(per_kv_head)(grouped, keys, values, segment)  # [B, KV, G, S, hd]
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, seq_len, heads, head_dim)
