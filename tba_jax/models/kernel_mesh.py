"""How the model calls its Pallas kernels: compiled on their platform or in Pallas'
interpreter (`on_platform`), with Triton's launch settings on a GPU (`triton_launch`), and
on a mesh of several devices one call per shard (`per_shard`).

XLA cannot split a Pallas kernel between devices. In a program sharded over several
devices, a Mosaic kernel (TPU: splash attention) is refused as it is lowered ("Mosaic
kernels cannot be automatically partitioned"), and a Triton kernel (GPU: the decode
attention and gated MLP kernels) has its inputs gathered and runs whole on every device.
So the model calls its kernels through `per_shard`, which runs the kernel under
`jax.shard_map` on the mesh the program is traced under: each device runs it on its own
rows (the mesh's data and fsdp axes) and its own heads or hidden units (the tensor axis).
An axis that does not divide them is left out: every device on it computes that part
whole. Without a mesh, or on one device, the kernel is called as it is.

The mesh is the one `jax.set_mesh` puts in context while the program is traced. The
programs that run the model (`tba_jax.mesh.jit_on_mesh`) enter the mesh their arguments
lie on, so every role's programs split their kernels over that role's own mesh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
from jax.experimental.pallas import triton as plgpu
from jax.sharding import AbstractMesh, PartitionSpec

# Every mesh's axes (`tba_jax.mesh` builds them): a batch's rows are split over the data and
# fsdp axes, heads and hidden units over the tensor axis.
MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
SPLIT_AXIS = "tensor"

# What each dimension of a kernel's operand is, for `per_shard`.
ROWS = "rows"  # the batch's rows: over the mesh's data and fsdp axes
SPLIT = "split"  # heads or hidden units: over its tensor axis

Dims = Sequence[str | None]


def on_platform(
    kernel: Callable[..., jax.Array], platform: str, interpret: bool | None
) -> Callable[..., jax.Array]:
    """`kernel(*args, interpret=...)` as a function of its arrays. `interpret` None: the
    compiled kernel where the program is lowered for `platform` (JAX's lowering name,
    "cuda" or "tpu") and Pallas' interpreter elsewhere, chosen as the program is lowered
    (`jax.lax.platform_dependent`: a program compiled for a GPU or TPU on a machine
    without one gets the kernel); else as `interpret` says."""
    if interpret is not None:
        return functools.partial(kernel, interpret=interpret)
    compiled, interpreted = (functools.partial(kernel, interpret=flag) for flag in (False, True))

    def chosen(*args):
        return jax.lax.platform_dependent(*args, default=interpreted, **{platform: compiled})

    return chosen


def triton_launch(settings, interpret: bool) -> dict:
    """`pallas_call`'s keyword for Triton's num_warps and num_stages from `settings` (a
    kernel's settings with those fields; none for the interpreter, which takes no compiler
    params)."""
    if interpret:
        return {}
    params = plgpu.CompilerParams(num_warps=settings.num_warps, num_stages=settings.num_stages)
    return {"compiler_params": params}


def shard_axes(mesh: AbstractMesh, rows: int, split: int) -> dict[str, tuple[str, ...]]:
    """The mesh axes each kind of dimension is split over: ROWS over the batch axes whose
    sizes, multiplied, divide `rows` (taken in order, an axis that would not divide left
    out), SPLIT over the tensor axis where its size divides `split`. Axes of size 1 are
    left out."""
    row_axes: list[str] = []
    row_shards = 1
    for axis in BATCH_AXES:
        size = mesh.shape.get(axis, 1)
        if size > 1 and rows % (row_shards * size) == 0:
            row_axes.append(axis)
            row_shards *= size
    split_size = mesh.shape.get(SPLIT_AXIS, 1)
    split_axes = (SPLIT_AXIS,) if split_size > 1 and split % split_size == 0 else ()
    return {ROWS: tuple(row_axes), SPLIT: split_axes}


def spec(dims: Dims, axes: dict[str, tuple[str, ...]]) -> PartitionSpec:
    """The PartitionSpec of an operand whose dimensions are `dims` (ROWS, SPLIT or None)."""
    return PartitionSpec(*(axes[dim] or None if dim else None for dim in dims))


def per_shard(
    kernel: Callable[..., jax.Array],
    args: Sequence[jax.Array],
    dims: Sequence[Dims],
    out_dims: Dims | tuple[Dims, ...],
    *,
    rows: int,
    split: int,
) -> jax.Array:
    """kernel(*args), one call per shard of the mesh in context (`jax.set_mesh`; none, or
    one device: the call as it is). `dims`: each argument's dimensions (ROWS, SPLIT or
    None, replicated), `out_dims` the output's (a tuple of them for a kernel with several
    outputs). `rows`: the size of every ROWS dimension;
    `split`: how many equal parts the SPLIT dimensions may be cut into (KV heads; for
    hidden units, the kernel's least blocks), which the tensor axis must divide.

    The shard_map does not check which outputs vary over which axes (`check_vma=False`):
    Pallas' kernels do not declare it. The outputs are exact per shard either way, and
    gradients through it (splash attention in the learner) are the unsplit call's
    (`tests/mesh_subprocess_checks.py`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kernel(*args)
    axes = shard_axes(mesh, rows, split)
    several = bool(out_dims) and isinstance(out_dims[0], tuple)
    out_specs = tuple(spec(d, axes) for d in out_dims) if several else spec(out_dims, axes)
    return jax.shard_map(
        kernel,
        mesh=mesh,
        in_specs=tuple(spec(d, axes) for d in dims),
        out_specs=out_specs,
        check_vma=False,
    )(*args)
