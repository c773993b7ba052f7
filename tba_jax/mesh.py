"""Device split between the sampler and the learner, meshes, shardings, publishing.

Each role gets its own `jax.sharding.Mesh` with the axes `data`, `fsdp`,
`tensor`. Parameters carry logical axis names (see `tba_jax.models`); a rule
set per role maps each logical name onto a mesh axis (or none: replicated).
With one device both roles share it (colocated). The stacked blocks of
`ModelConfig.scan_layers` lead with a `layers` axis that no default rule maps:
every device holds every layer's slice of a parameter, split as that parameter's
other axes say.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tba_jax.batching import pad_rows
from tba_jax.errors import ConfigError
from tba_jax.models.kernel_mesh import BATCH_AXES, MESH_AXES  # the kernels split over them too

Rules = Sequence[tuple[str, str | None]]


@dataclasses.dataclass(frozen=True)
class RoleMeshes:
    sampler: Mesh
    learner: Mesh

    @property
    def colocated(self) -> bool:
        return set(self.sampler.devices.flat) == set(self.learner.devices.flat)


def split_devices(
    devices: Sequence[jax.Device], sampler_devices: float, colocate: bool
) -> tuple[list[jax.Device], list[jax.Device]]:
    """Splits `devices` into (sampler, learner) lists.

    `sampler_devices` >= 1 is a count, in (0, 1) a fraction of all devices.
    With `colocate` or a single device, both roles use every device.
    """
    devices = list(devices)
    if colocate or len(devices) == 1:
        return devices, devices
    if 0 < sampler_devices < 1:
        count = max(1, round(sampler_devices * len(devices)))
    elif sampler_devices >= 1 and float(sampler_devices).is_integer():
        count = int(sampler_devices)
    else:
        raise ConfigError(
            f"mesh.sampler_devices={sampler_devices} must be a count >= 1 or a fraction in (0, 1)."
        )
    if count >= len(devices):
        raise ConfigError(
            f"mesh.sampler_devices={sampler_devices} leaves no device for the learner out of "
            f"{len(devices)}; lower it or set mesh.colocate=True."
        )
    return devices[:count], devices[count:]


# How a run gives its roles their devices, as a refused mesh's error says it: one process
# (or each process of roles_within_host) splits its devices; roles_by_process gives each
# role whole processes (`topology.working_devices`).
DEVICES_SPLIT = "mesh.sampler_devices and mesh.colocate split the devices"
DEVICES_BY_PROCESS = (
    "roles_by_process: a role's processes' devices, each process's last kept for the "
    "exchanges when it has two or more"
)


def mesh_shape(
    count: int,
    axis_sizes: Mapping[str, int],
    key: str = "mesh axes",
    role: str | None = None,
    devices_from: str = DEVICES_SPLIT,
) -> list[int]:
    """The sizes of the axes data/fsdp/tensor (`MESH_AXES`) that `axis_sizes` gives `count`
    devices; one size may be -1 (the rest). Sizes the devices cannot take are a
    `ConfigError` naming `key`, the config key that holds `axis_sizes` (e.g.
    `mesh.learner_axes`), the run's `role` the devices are for and, for a role, where its
    devices came from (`devices_from`)."""
    given = dict(axis_sizes)
    unknown = set(axis_sizes) - set(MESH_AXES)
    if unknown:
        raise ConfigError(f"{key}={given}: unknown mesh axes {sorted(unknown)}; use {MESH_AXES}.")
    sizes = [int(axis_sizes.get(name, 1)) for name in MESH_AXES]
    if any(size < 1 and size != -1 for size in sizes):
        raise ConfigError(f"{key}={given}: mesh axis sizes must be >= 1 or -1 (the rest).")
    if sizes.count(-1) > 1:
        raise ConfigError(
            f"{key}={given}: at most one mesh axis may be -1 (the rest); give the "
            "others a size (e.g. --config.mesh.learner_axes.data=-1 "
            "--config.mesh.learner_axes.fsdp=1 for a data-parallel learner)."
        )
    whose, has = (f"the {role}'s ", f"the {role} has") if role else ("", "there are")
    split = f" ({devices_from})" if role else ""
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if count % known:
            raise ConfigError(
                f"{key}={given}: {whose}{count} devices do not divide over these axes; give "
                f"the others sizes whose product divides {count}{split}."
            )
        sizes[sizes.index(-1)] = count // known
    if int(np.prod(sizes)) != count:
        raise ConfigError(
            f"{key}={given}: these axes need {int(np.prod(sizes))} devices and {has} {count}; "
            f"make their product {count} or set one to -1 (the rest){split}."
        )
    return sizes


def make_mesh(
    devices: Sequence[jax.Device],
    axis_sizes: Mapping[str, int],
    key: str = "mesh axes",
    role: str | None = None,
    devices_from: str = DEVICES_SPLIT,
) -> Mesh:
    """A mesh over `devices` with axes data/fsdp/tensor, sized by `mesh_shape` (its errors
    naming `key`, and for a run's `role` where its devices came from: `role_mesh`)."""
    sizes = mesh_shape(len(devices), axis_sizes, key, role, devices_from)
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def role_mesh(
    role: str,
    devices: Sequence[jax.Device],
    axis_sizes: Mapping[str, int],
    devices_from: str = DEVICES_SPLIT,
) -> Mesh:
    """`make_mesh` for the `role` ("sampler" or "learner") of a run: its errors name
    `mesh.<role>_axes` and what gave the role its devices (`devices_from`)."""
    return make_mesh(devices, axis_sizes, f"mesh.{role}_axes", role, devices_from)


def make_role_meshes(
    sampler_devices: float,
    colocate: bool,
    sampler_axes: Mapping[str, int],
    learner_axes: Mapping[str, int],
    devices: Sequence[jax.Device] | None = None,
) -> RoleMeshes:
    sampler, learner = split_devices(devices or jax.devices(), sampler_devices, colocate)
    return RoleMeshes(
        role_mesh("sampler", sampler, sampler_axes), role_mesh("learner", learner, learner_axes)
    )


def logical_to_spec(logical_axes: Sequence[str], rules: Rules) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec; names without a rule are replicated."""
    table = dict(rules)
    mesh_axes = [table.get(name) for name in logical_axes]
    used = [axis for axis in mesh_axes if axis is not None]
    if len(used) != len(set(used)):
        raise ConfigError(f"Rules {dict(rules)} map two axes of {tuple(logical_axes)} onto one.")
    return PartitionSpec(*mesh_axes)


def param_shardings(logical_axes: Any, abstract_params: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedShardings for every parameter; checks each sharded dim divides evenly."""

    def one(axes, param):
        spec = logical_to_spec(axes, rules)
        for dim, mesh_axis in zip(param.shape, spec, strict=False):
            if mesh_axis is not None and dim % mesh.shape[mesh_axis]:
                raise ConfigError(
                    f"A parameter with axes {axes} and shape {param.shape} cannot be split over "
                    f"mesh axis {mesh_axis!r} of size {mesh.shape[mesh_axis]}; change the rule "
                    f"for {axes[list(spec).index(mesh_axis)]!r} or the mesh."
                )
        return NamedSharding(mesh, spec)

    return jax.tree.map(one, logical_axes, abstract_params, is_leaf=lambda x: isinstance(x, tuple))


def abstract_on(shapes: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `shapes` carrying `shardings` (same tree): restore targets and
    jit templates that allocate nothing."""
    return jax.tree.map(
        lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        shapes,
        shardings,
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (example) dimension split over the data and fsdp axes (`row_axes`); the
    rest replicated."""
    return NamedSharding(mesh, PartitionSpec(row_axes(mesh)))


def split_rows_like(params: Any, *arrays: np.ndarray) -> tuple:
    """`arrays` (same leading dimension: rows) split over the data (× fsdp) axes of the
    mesh `params` live on, padded (the last row repeated) to a multiple of its shards, so
    each sampler device computes its share of a batch's rows; as they are when `params`
    are not on a mesh of several batch shards. Callers keep the first rows of what comes
    back."""
    leaves = jax.tree.leaves(params)
    sharding = getattr(leaves[0], "sharding", None) if leaves else None
    if not isinstance(sharding, NamedSharding) or row_shards(sharding.mesh) == 1:
        return arrays
    return split_rows(sharding.mesh, *arrays)


def split_rows(mesh: Mesh, *arrays: np.ndarray) -> tuple:
    """`arrays` (same leading dimension: rows) on `mesh`, rows split over its `row_axes`:
    padded (the last row repeated) to a multiple of its `row_shards`, so callers keep the
    first rows of what comes back."""
    rows = batch_sharding(mesh)
    return tuple(jax.device_put(array, rows) for array in pad_rows(arrays, row_shards(mesh)))


def row_axes(mesh: Mesh) -> tuple[str, ...]:
    """The batch axes (data, fsdp) `mesh` has: a batch's rows are split over them."""
    return tuple(axis for axis in BATCH_AXES if axis in mesh.shape)


def row_shards(mesh: Mesh) -> int:
    """How many parts a batch's rows are split into on `mesh` (its `row_axes`)."""
    return int(np.prod([mesh.shape[axis] for axis in row_axes(mesh)]))


def argument_mesh(tree: Any) -> Mesh | None:
    """The mesh of several devices the first array (or abstract array) in `tree` lies on;
    None where it lies on one device, has no mesh, or is being traced (a program called
    inside another: the outer program's mesh holds)."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.core.Tracer):
            return None
        if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
            sharding = leaf.sharding
            if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
                return sharding.mesh
            return None
    return None


class MeshJit:
    """`jax.jit(fun, **jit_kwargs)` traced under the mesh its arguments lie on
    (`argument_mesh`, entered with `jax.set_mesh`), so the model's Pallas kernels split
    themselves over it (`models.kernel_mesh.per_shard`). Calls, `lower` and `trace` enter
    it; everything else is the jitted function's."""

    def __init__(self, fun: Callable, **jit_kwargs):
        self._jitted = jax.jit(fun, **jit_kwargs)
        functools.update_wrapper(self, fun)

    def _on_mesh(self, args: tuple, kwargs: dict):
        mesh = argument_mesh((args, kwargs))
        return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)

    def __call__(self, *args, **kwargs):
        with self._on_mesh(args, kwargs):
            return self._jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with self._on_mesh(args, kwargs):
            return self._jitted.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        with self._on_mesh(args, kwargs):
            return self._jitted.trace(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._jitted, name)


def jit_on_mesh(fun: Callable, **jit_kwargs) -> MeshJit:
    """`jax.jit` for programs that run the model: see `MeshJit`."""
    return MeshJit(fun, **jit_kwargs)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def publish(params: Any, sampler_shardings: Any, cast: Callable[[Any], Any] | None = None) -> Any:
    """Copies learner params onto the sampler's shardings, always into new buffers, so
    the learner may donate its own to the next train step without invalidating what the
    searchers hold. Both ways are asynchronous: the copy runs while the learner goes on.
    `cast` (a pure function of the params tree, e.g. `models.compute_dtype_cast(cfg)`:
    the weights in the compute dtype, as the searchers use them) is applied in the copy.

    When every leaf already lies on its sampler sharding (the roles share devices and
    layout) the copy is one compiled program whose outputs are the sampler's shardings
    (`_copy_program`): one dispatch, whatever the leaf count. Otherwise
    `jax.device_put(..., may_alias=False)` moves each leaf. What a publish costs is mostly
    host work per leaf: on an H100, qwen2.5-0.5b's 290 float32 leaves (1.8 GiB) took
    26 ms through `device_put`, where the bytes alone need about 1 ms; on this CPU, the
    same tree at micro widths took 5.5 ms through a compiled copy relabelled leaf by
    leaf (`device_put` onto the sampler's sharding objects) and 1.5 ms through
    `_copy_program` (`benchmarks/publish_cost.py`).
    """
    leaves, treedef = jax.tree.flatten(params)
    targets = tuple(treedef.flatten_up_to(sampler_shardings))
    if all(
        isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(target, leaf.ndim)
        for leaf, target in zip(leaves, targets, strict=True)
    ):
        return treedef.unflatten(_copy_program(treedef, targets, cast)(leaves))
    if cast is not None:  # cast where the params are (fewer bytes to move), then moved
        params = jax.jit(cast)(params)
    return jax.device_put(params, sampler_shardings, may_alias=False)


# Compiled copies kept: one per (role meshes, model) a process publishes to.
COPY_PROGRAMS_KEPT = 8


@functools.lru_cache(maxsize=COPY_PROGRAMS_KEPT)
def _copy_program(treedef: Any, targets: tuple, cast: Callable[[Any], Any] | None) -> Any:
    """A compiled copy (through `cast`, if given) of a list of leaves of `treedef` into new
    buffers on `targets` (their sharding objects, not the inputs': a program compiled for
    the sampler's arrays sees the sampler's shardings, so it does not compile again for
    the learner's). Every output is a copy: a leaf `cast` leaves as it is would otherwise
    be the input buffer itself, which the learner donates."""

    def copy(leaves: list) -> list:
        if cast is not None:
            leaves = treedef.flatten_up_to(cast(treedef.unflatten(leaves)))
        return [jnp.copy(leaf) for leaf in leaves]

    return jax.jit(copy, out_shardings=list(targets))


def from_identical_host_data(tree: Any, shardings: Any) -> Any:
    """Host arrays that every process holds alike, as global arrays on `shardings` (a
    sharding or a matching tree of them). With one process they are returned as they are
    (jit places them)."""
    if jax.process_count() == 1:
        return tree
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)
    return jax.tree.map(
        lambda value, sharding: jax.make_array_from_callback(
            np.shape(value), sharding, lambda index: np.asarray(value)[index]
        ),
        tree,
        shardings,
    )
