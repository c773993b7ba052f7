"""A decode step's gated MLP hidden layer, act(x W_gate) * (x W_up), as one Pallas kernel.

In a decode step the MLP's input is one slot per row (a few hundred rows), so its
matmuls are short and wide. XLA runs the gate and up products as one merged matmul that
writes [rows, 2 d_ff] to device memory, then a second kernel reads it back to apply the
activation and the product (on an H100 at qwen2.5-0.5b's shape, batch 256: 22 µs and
5 µs a layer, where its 17 MB of weights take 5 µs at HBM bandwidth). This kernel keeps
both products of a tile in registers and writes only the hidden layer: one program per
(block of rows, block of hidden units) walks the model width in blocks of `block_k`,
accumulating x·W_gate and x·W_up in float32, and writes act(gate) * up in x's dtype.
The down projection stays XLA's (or `models.decode_projection`'s).

Given the block's RMSNorm (its scale and epsilon), the kernel takes the block's input
before the norm and applies it itself, as `models.decode_qkv` does: it accumulates the
products over x * scale and the rows' sums of squares beside them, and scales both
products by each row's inverse RMS before the activation (the RMS is a factor of each
row). So XLA's kernel before it need not write the normalised rows.

On a GPU it lowers through Triton; elsewhere it runs in Pallas' interpreter (slow: for
tests on a CPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from tba_jax.models.config import MIN_MLP_BLOCK, MlpKernelSettings, check_mlp_kernel_settings
from tba_jax.models.kernel_mesh import ROWS, SPLIT, on_platform, per_shard, triton_launch

# What the model runs with unless `model.decode_mlp_kernel` says otherwise.
SETTINGS = MlpKernelSettings()


def block_for(size: int, block: int) -> int:
    """The largest power of two at most `block` that divides `size` (a block that tiles
    the axis exactly, so no load needs a mask); ValueError where that is below
    `MIN_MLP_BLOCK`, the least Triton's matmuls take."""
    fitted = min(block, size & -size)  # size & -size: the largest power of two dividing it
    if fitted < MIN_MLP_BLOCK:
        raise ValueError(
            f"the Pallas MLP kernel tiles widths in blocks of at least {MIN_MLP_BLOCK}, and "
            f"{size} is no multiple of {MIN_MLP_BLOCK}; use model.decode_mlp='same'."
        )
    return fitted


def pad_to_row_blocks(x: jax.Array, block_m: int) -> tuple[jax.Array, int]:
    """(x [M, ...] padded with zero rows to a whole number of row blocks, the block): the
    block is `block_m`, or for fewer rows the least power of two >= M and
    `MIN_MLP_BLOCK` (a decode batch is usually a whole number of blocks already)."""
    rows = x.shape[0]
    block_m = min(block_m, max(MIN_MLP_BLOCK, 1 << (rows - 1).bit_length()))
    padded_rows = -(-rows // block_m) * block_m
    if padded_rows != rows:
        x = jnp.pad(x, ((0, padded_rows - rows),) + ((0, 0),) * (x.ndim - 1))
    return x, block_m


def row_tiles(x: jax.Array, outputs: int, walk: int, settings) -> tuple[jax.Array, int, int, int]:
    """(x padded with zero rows to whole row blocks, block_m, block_n, block_k): the tiles
    of a kernel over x's rows that computes `outputs` columns walking a contraction of
    `walk` entries, from `settings`' block_m, block_n and block_k (`block_for`,
    `pad_to_row_blocks`)."""
    block_k = block_for(walk, settings.block_k)
    block_n = block_for(outputs, settings.block_n)
    x, block_m = pad_to_row_blocks(x, settings.block_m)
    return x, block_m, block_n, block_k


def scaled_for_folded_norm(x: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(x * scale rounded to x's dtype, each row's sum of squares [rows] float32): one
    block [rows, cols] of a kernel's walk over the model width that applies the block's
    RMSNorm after its products (`inverse_rms`; the RMS is a factor of each row). Used in
    the kernels' bodies (here and `models.decode_qkv`)."""
    x32 = x.astype(jnp.float32)
    scaled = (x32 * scale.astype(jnp.float32)[None, :]).astype(x.dtype)
    return scaled, jnp.sum(x32 * x32, axis=1)


def inverse_rms(squares: jax.Array, width: int, eps: float) -> jax.Array:
    """[rows, 1] float32: 1 / RMS of each row from its sum of squares over `width`."""
    return jax.lax.rsqrt(squares / width + eps)[:, None]


def _kernel(x_ref, gate_ref, up_ref, *refs, block_k: int, activation: Callable, eps: float | None):
    """One (block of rows, block of hidden units): x_ref [block_m, d]; gate_ref, up_ref
    [d, block_n]; then (with `eps`, the RMSNorm's) scale_ref [d]; out_ref [block_m,
    block_n]."""
    *scale_ref, out_ref = refs
    block_m, width = x_ref.shape

    def body(step, sums):
        gate_sum, up_sum, squares = sums
        cols = pl.ds(pl.multiple_of(step * block_k, block_k), block_k)
        x = x_ref[:, cols]
        if eps is not None:  # the norm's scale now, its inverse RMS after the sums
            x, block_squares = scaled_for_folded_norm(x, scale_ref[0][cols])
            squares += block_squares
        gate_sum += jnp.dot(x, gate_ref[cols, :], preferred_element_type=jnp.float32)
        up_sum += jnp.dot(x, up_ref[cols, :], preferred_element_type=jnp.float32)
        return gate_sum, up_sum, squares

    zeros = jnp.zeros(out_ref.shape, jnp.float32)
    init = (zeros, zeros, jnp.zeros((block_m,), jnp.float32))
    gate_sum, up_sum, squares = jax.lax.fori_loop(0, width // block_k, body, init)
    if eps is not None:
        row_scale = inverse_rms(squares, width, eps)
        gate_sum, up_sum = gate_sum * row_scale, up_sum * row_scale
    out_ref[...] = (activation(gate_sum) * up_sum).astype(out_ref.dtype)


def gated_hidden(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    activation: Callable[[jax.Array], jax.Array],
    *,
    norm: tuple[jax.Array, float] | None = None,
    settings: MlpKernelSettings = SETTINGS,
    interpret: bool | None = None,
) -> jax.Array:
    """act(x W_gate) * (x W_up): x [M, d]; w_gate, w_up [d, F] in x's dtype (d and F
    multiples of `MIN_MLP_BLOCK`). Products accumulated in float32, the activation and
    the product taken in float32 and the result cast to x's dtype once (XLA's path rounds
    each product to the compute dtype first, so the two agree to that rounding). Returns
    [M, F]. `settings`: the kernel's tiles and launch (`MlpKernelSettings`; blocks shrink
    to the largest power of two that tiles each axis). `interpret`: None runs the Triton
    kernel where the program is lowered for a CUDA GPU and Pallas' interpreter elsewhere
    (chosen as the program is lowered, as `decode_attention`). On a mesh of several devices
    each runs it on its rows and hidden units (`kernel_mesh.per_shard`). `norm` (scale
    [d], epsilon): x is the block's input before its RMSNorm, which the kernel applies
    (x * scale rounded to x's dtype for the products, which are scaled by each row's
    inverse RMS in float32)."""
    eps = None if norm is None else norm[1]
    run = functools.partial(_gated_hidden, activation=activation, eps=eps, settings=settings)
    kernel = on_platform(run, "cuda", interpret)
    args, dims = [x, w_gate, w_up], [(ROWS, None), (None, SPLIT), (None, SPLIT)]
    if norm is not None:
        args.append(norm[0])
        dims.append((None,))
    # the tensor axis splits the hidden units into parts of whole blocks of the least size
    return per_shard(
        kernel,
        tuple(args),
        tuple(dims),
        (ROWS, SPLIT),
        rows=x.shape[0],
        split=w_gate.shape[1] // MIN_MLP_BLOCK,
    )


def _gated_hidden(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    *scale: jax.Array,
    activation: Callable[[jax.Array], jax.Array],
    eps: float | None,
    settings: MlpKernelSettings,
    interpret: bool,
) -> jax.Array:
    """`gated_hidden` with Pallas' interpreter or not; `scale` (with `eps`): the norm's."""
    check_mlp_kernel_settings(settings)
    rows, width = x.shape
    hidden = w_gate.shape[1]
    x, block_m, block_n, block_k = row_tiles(x, hidden, width, settings)
    padded_rows = x.shape[0]
    weight_spec = pl.BlockSpec((width, block_n), lambda i, j: (0, j))
    scale_specs = [pl.BlockSpec((width,), lambda i, j: (0,))] * len(scale)
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, activation=activation, eps=eps),
        grid=(padded_rows // block_m, hidden // block_n),
        in_specs=[
            pl.BlockSpec((block_m, width), lambda i, j: (i, 0)),
            weight_spec,
            weight_spec,
            *scale_specs,
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((padded_rows, hidden), x.dtype),
        interpret=interpret,
        name="gated_mlp",
        **triton_launch(settings, interpret),
    )(x, w_gate, w_up, *scale)
    return out[:rows]
