"""A decode step's output projections (attention's W_o, the MLP's W_down) as one Pallas
kernel that splits the contraction.

In a decode step these products have a few hundred rows, a narrow output and a long
contraction: the MLP's down projection at qwen2.5-0.5b is [256, 4,864] x [4,864, 896].
In output tiles of 128 x 128 that is 14 programs for an H200's 132 multiprocessors, each
walking the whole contraction one block after another: XLA's matmul took 9.5 µs alone on
an H200 (17.4 µs a layer inside the decode step), where its 8.7 MB of weights take
1.8 µs at the HBM bandwidth (README, "On an H200"). This kernel splits the contraction
into `k_splits` parts: one program per (block of rows, block of outputs, part) walks its
part in blocks of `block_k`, accumulating in float32, and writes its partial sum. XLA
adds the parts (a reduce over [k_splits, rows, outputs] float32 that fuses with the cast)
and rounds the sum to the compute dtype once, as XLA's own matmul rounds its float32
accumulator.

Given the block's residual stream, the result is residual + x W. With one part (and no
split of the contraction between devices) the kernel adds it itself and writes the sum
in the residual's dtype: no partial sums, and no kernel after it. Otherwise XLA adds it
with the parts.

On a GPU it lowers through Triton; elsewhere it runs in Pallas' interpreter (slow: for
tests on a CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from tba_jax.models.config import (
    MIN_MLP_BLOCK,
    ProjectionKernelSettings,
    check_projection_kernel_settings,
)
from tba_jax.models.gated_mlp import pad_to_row_blocks, row_tiles
from tba_jax.models.kernel_mesh import (
    ROWS,
    SPLIT,
    on_platform,
    per_shard,
    shard_axes,
    triton_launch,
)

# What the model runs with unless `model.decode_projection_kernel` says otherwise.
SETTINGS = ProjectionKernelSettings()


def parts_for(width: int, k_splits: int) -> int:
    """How many parts a contraction of `width` is split into: at most `k_splits` (a power
    of two), fewer where the parts would not be whole multiples of `MIN_MLP_BLOCK`."""
    blocks = width // MIN_MLP_BLOCK
    # blocks & -blocks: its largest power-of-two factor (a width under one block: one part,
    # which `block_for` refuses by name)
    return max(1, min(k_splits, blocks & -blocks))


def _kernel(x_ref, w_ref, out_ref, *, block_k: int):
    """One (block of rows, block of outputs, part of the contraction): x_ref [block_m,
    part]; w_ref [part, block_n]; out_ref [block_m, block_n], the part's float32 sum."""
    part = x_ref.shape[1]

    def body(step, total):
        cols = pl.ds(pl.multiple_of(step * block_k, block_k), block_k)
        return total + jnp.dot(x_ref[:, cols], w_ref[cols, :], preferred_element_type=jnp.float32)

    zeros = jnp.zeros(out_ref.shape, jnp.float32)
    out_ref[...] = jax.lax.fori_loop(0, part // block_k, body, zeros)


def _kernel_with_residual(x_ref, w_ref, residual_ref, out_ref, *, block_k: int):
    """One (block of rows, block of outputs) of residual + x w, the whole contraction:
    x_ref [block_m, K]; w_ref [K, block_n]; residual_ref, out_ref [block_m, block_n]."""
    width = x_ref.shape[1]

    def body(step, total):
        cols = pl.ds(pl.multiple_of(step * block_k, block_k), block_k)
        return total + jnp.dot(x_ref[:, cols], w_ref[cols, :], preferred_element_type=jnp.float32)

    total = jax.lax.fori_loop(0, width // block_k, body, residual_ref[...].astype(jnp.float32))
    out_ref[...] = total.astype(out_ref.dtype)


def fuses_residual(width: int, split: int, rows: int, settings: ProjectionKernelSettings) -> bool:
    """Whether `project` adds a residual inside the kernel: one part of a contraction of
    `width`, which no device split of the mesh in context cuts (`kernel_mesh.shard_axes`
    over `split` parts)."""
    if parts_for(width, settings.k_splits) != 1:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return True
    return not shard_axes(mesh, rows, split)[SPLIT]


def project(
    x: jax.Array,
    w: jax.Array,
    *,
    split: int,
    residual: jax.Array | None = None,
    settings: ProjectionKernelSettings = SETTINGS,
    interpret: bool | None = None,
) -> jax.Array:
    """x w: x [M, K]; w [K, N] in x's dtype (K and N multiples of `MIN_MLP_BLOCK`).
    Accumulated in float32 over parts of the contraction, the parts added in float32 and
    the sum cast to x's dtype once. Returns [M, N].

    `split`: how many equal parts a mesh's tensor axis may cut K into (the heads of
    attention's output, the MLP's least blocks of hidden units): on a mesh of several
    devices each runs the kernel on its rows and its share of K (`kernel_mesh.per_shard`),
    and XLA adds the devices' partial sums with the parts. `settings`: the kernel's tiles,
    parts and launch (`ProjectionKernelSettings`). `interpret`: None runs the Triton kernel
    where the program is lowered for a CUDA GPU and Pallas' interpreter elsewhere (as
    `gated_mlp`). `residual` [M, N]: returns residual + x w in the residual's dtype, added
    in the kernel where it computes the whole contraction in one part (`fuses_residual`),
    else to the parts' sum rounded to its dtype (as the model adds a projection's output)."""
    rows, width = x.shape
    if residual is not None and fuses_residual(width, split, rows, settings):
        run = functools.partial(_with_residual, settings=settings)
        kernel = on_platform(run, "cuda", interpret)
        dims = ((ROWS, None), (None, None), (ROWS, None))
        return per_shard(kernel, (x, w, residual), dims, (ROWS, None), rows=rows, split=split)
    kernel = on_platform(functools.partial(_partial_sums, settings=settings), "cuda", interpret)
    partials = per_shard(
        kernel,
        (x, w),
        ((ROWS, SPLIT), (SPLIT, None)),
        (SPLIT, ROWS, None),
        rows=rows,
        split=split,
    )
    if residual is None:
        return partials.sum(axis=0).astype(x.dtype)
    # the sum rounded first, as the model adds a projection to its residual stream
    return residual + partials.sum(axis=0).astype(residual.dtype)


def _with_residual(
    x: jax.Array,
    w: jax.Array,
    residual: jax.Array,
    *,
    settings: ProjectionKernelSettings,
    interpret: bool,
) -> jax.Array:
    """[M, N] in the residual's dtype: residual + x w, the whole contraction in one part."""
    check_projection_kernel_settings(settings)
    rows, width = x.shape
    outputs = w.shape[1]
    x, block_m, block_n, block_k = row_tiles(x, outputs, width, settings)
    residual = pad_to_row_blocks(residual, block_m)[0]
    padded_rows = x.shape[0]
    out = pl.pallas_call(
        functools.partial(_kernel_with_residual, block_k=block_k),
        grid=(padded_rows // block_m, outputs // block_n),
        in_specs=[
            pl.BlockSpec((block_m, width), lambda i, j: (i, 0)),
            pl.BlockSpec((width, block_n), lambda i, j: (0, j)),
            pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((padded_rows, outputs), residual.dtype),
        interpret=interpret,
        name="decode_projection",
        **triton_launch(settings, interpret),
    )(x, w, residual)
    return out[:rows]


def _partial_sums(
    x: jax.Array, w: jax.Array, *, settings: ProjectionKernelSettings, interpret: bool
) -> jax.Array:
    """[parts, M, N] float32: each part's sum of x w over its share of K."""
    check_projection_kernel_settings(settings)
    rows, width = x.shape
    outputs = w.shape[1]
    parts = parts_for(width, settings.k_splits)
    part = width // parts
    x, block_m, block_n, block_k = row_tiles(x, outputs, part, settings)
    padded_rows = x.shape[0]
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k),
        grid=(padded_rows // block_m, outputs // block_n, parts),
        in_specs=[
            pl.BlockSpec((block_m, part), lambda i, j, p: (i, p)),
            pl.BlockSpec((part, block_n), lambda i, j, p: (p, j)),
        ],
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda i, j, p: (p, i, j)),
        out_shape=jax.ShapeDtypeStruct((parts, padded_rows, outputs), jnp.float32),
        interpret=interpret,
        name="decode_projection",
        **triton_launch(settings, interpret),
    )(x, w)
    return out[:, :rows]
