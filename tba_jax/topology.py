"""Which process does what in a run over several JAX processes, and the learner group's
collectives.

Two layouts (`config.distributed.topology`):

- `roles_within_host` (a TPU pod's natural layout): every process splits its own devices
  into sampler and learner devices (`mesh.sampler_devices`). Its searcher threads
  generate on its sampler devices into its own replay buffer; the learner mesh spans the
  learner devices of all processes, and each process contributes its share of the
  global batch from its own buffer.
- `roles_by_process` (the paper's layout): processes 0 .. L-1 only learn
  (`distributed.learner_processes` = L), the others only search (`tba_jax.exchange`
  moves trajectories and params between them).

With one process both roles share it, as `tba_jax.mesh` describes.

The learner group's collectives (`LearnerGroup`) are programs over the learner mesh, so
only the processes holding learner devices call them, all at the same point of the loop.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tba_jax import mesh as mesh_lib
from tba_jax.config_lib import ConfigError

SINGLE_PROCESS = "single_process"
ROLES_WITHIN_HOST = "roles_within_host"
ROLES_BY_PROCESS = "roles_by_process"
TOPOLOGIES = (ROLES_WITHIN_HOST, ROLES_BY_PROCESS)
PRIMARY = 0
GROUP_AXIS = "learner_devices"


@dataclasses.dataclass(frozen=True)
class Topology:
    """This process's place in the run. `learner_processes` / `searcher_processes`: the
    process indices of each role (a process may hold both)."""

    name: str
    num_processes: int
    process_index: int
    learner_processes: tuple[int, ...]
    searcher_processes: tuple[int, ...]

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1

    @property
    def is_learner(self) -> bool:
        return self.process_index in self.learner_processes

    @property
    def is_searcher(self) -> bool:
        return self.process_index in self.searcher_processes

    @property
    def is_primary(self) -> bool:
        """Process 0: writes the workdir's shared files (config, metrics, summary)."""
        return self.process_index == PRIMARY

    @property
    def learner_rank(self) -> int:
        return self.learner_processes.index(self.process_index)

    @property
    def searcher_rank(self) -> int:
        return self.searcher_processes.index(self.process_index)

    @property
    def num_learners(self) -> int:
        return len(self.learner_processes)

    @property
    def num_searchers(self) -> int:
        return len(self.searcher_processes)

    def describe(self) -> dict:
        """What summary.json and the experiment identity record of the layout."""
        return {
            "topology": self.name,
            "num_processes": self.num_processes,
            "learner_processes": len(self.learner_processes),
            "searcher_processes": len(self.searcher_processes),
        }


def make_topology(
    config: ml_collections.ConfigDict,
    num_processes: int | None = None,
    process_index: int | None = None,
) -> Topology:
    """The layout `config.distributed` asks for over this run's processes (default: JAX's),
    or a ConfigError saying why it cannot be made."""
    num_processes = jax.process_count() if num_processes is None else num_processes
    process_index = jax.process_index() if process_index is None else process_index
    everyone = tuple(range(num_processes))
    name = config.distributed.topology
    if name not in TOPOLOGIES:
        raise ConfigError(f"distributed.topology={name!r} is not one of {TOPOLOGIES}.")
    if num_processes == 1:
        return Topology(SINGLE_PROCESS, 1, 0, everyone, everyone)
    batch = config.batch
    if name == ROLES_WITHIN_HOST:
        if batch.prompts_per_batch % num_processes:
            raise ConfigError(
                f"batch.prompts_per_batch={batch.prompts_per_batch} does not split over "
                f"{num_processes} processes (each draws its share from its own buffer); "
                "make it a multiple of the process count."
            )
        return Topology(name, num_processes, process_index, everyone, everyone)
    learners = config.distributed.learner_processes
    if not 1 <= learners < num_processes:
        raise ConfigError(
            f"distributed.learner_processes={learners} must leave at least one of the "
            f"{num_processes} processes to search (roles_by_process); lower it or add processes."
        )
    searchers = num_processes - learners
    if searchers < learners:
        raise ConfigError(
            f"roles_by_process needs at least as many searcher processes as learner processes "
            f"(each learner's buffer is fed by its own searchers); got {searchers} searchers for "
            f"distributed.learner_processes={learners}."
        )
    if batch.prompts_per_batch % learners:
        raise ConfigError(
            f"batch.prompts_per_batch={batch.prompts_per_batch} does not split over "
            f"distributed.learner_processes={learners}."
        )
    if config.mode == "sync" and batch.prompts_per_batch % searchers:
        raise ConfigError(
            f"Sync mode over roles_by_process: batch.prompts_per_batch={batch.prompts_per_batch} "
            f"must split over the {searchers} searcher processes (each generates its share)."
        )
    if config.mode == "sync" and searchers % learners:
        raise ConfigError(
            f"Sync mode over roles_by_process: the {searchers} searcher processes must split "
            f"evenly over distributed.learner_processes={learners}."
        )
    return Topology(
        name,
        num_processes,
        process_index,
        tuple(range(learners)),
        tuple(range(learners, num_processes)),
    )


def process_devices(process_index: int) -> list[jax.Device]:
    return sorted(jax.local_devices(process_index=process_index), key=lambda d: d.id)


def working_devices(process_index: int) -> list[jax.Device]:
    """roles_by_process: a process's devices for its role. With two or more, the last
    only runs the exchanges (`tba_jax.exchange.ExchangeMesh`), so a round never waits
    behind generation or a train step, nor stalls them."""
    devices = process_devices(process_index)
    return devices[:-1] if len(devices) > 1 else devices


def role_meshes(topology: Topology, config: ml_collections.ConfigDict) -> mesh_lib.RoleMeshes:
    """The sampler mesh (this process's own devices) and the learner mesh (spanning the
    learner devices of every learner process)."""
    mesh_cfg = config.mesh
    if not topology.multi_process:
        return mesh_lib.make_role_meshes(
            mesh_cfg.sampler_devices,
            mesh_cfg.colocate,
            mesh_cfg.sampler_axes,
            mesh_cfg.learner_axes,
        )
    if topology.name == ROLES_WITHIN_HOST:
        splits = [
            mesh_lib.split_devices(process_devices(p), mesh_cfg.sampler_devices, mesh_cfg.colocate)
            for p in range(topology.num_processes)
        ]
        sampler = splits[topology.process_index][0]
        learner = [device for _, learner_devices in splits for device in learner_devices]
        devices_from = mesh_lib.DEVICES_SPLIT
    else:
        sampler = working_devices(topology.process_index)
        learner = [d for p in topology.learner_processes for d in working_devices(p)]
        devices_from = mesh_lib.DEVICES_BY_PROCESS
    return mesh_lib.RoleMeshes(
        mesh_lib.role_mesh("sampler", sampler, mesh_cfg.sampler_axes, devices_from),
        mesh_lib.role_mesh("learner", learner, mesh_cfg.learner_axes, devices_from),
    )


class LearnerGroup:
    """Collectives over the learner mesh: every learner process calls each at the same
    point of the loop (in lockstep with its train steps)."""

    def __init__(self, learner_mesh: Mesh):
        self.mesh = learner_mesh
        devices = list(learner_mesh.devices.flat)
        self._group_mesh = Mesh(np.asarray(devices), (GROUP_AXIS,))
        self._local_devices = [d for d in devices if d.process_index == jax.process_index()]
        # the row of each process's first learner device in a gathered [devices, ...] array
        first_rows: dict[int, int] = {}
        for row, device in enumerate(devices):
            first_rows.setdefault(device.process_index, row)
        self._process_rows = [first_rows[p] for p in sorted(first_rows)]

    @property
    def multi_process(self) -> bool:
        return len(self._process_rows) > 1

    def gather(self, local: np.ndarray) -> np.ndarray:
        """Every learner process's `local` (same shape and dtype everywhere), stacked in
        process order: [learner processes, *local.shape]."""
        local = np.asarray(local)
        if not self.multi_process:
            return local[None]
        sharding = NamedSharding(self._group_mesh, PartitionSpec(GROUP_AXIS))
        shards = [jax.device_put(local[None], device) for device in self._local_devices]
        shape = (self._group_mesh.size, *local.shape)
        stacked = jax.make_array_from_single_device_arrays(shape, sharding, shards)
        everywhere = _replicate(stacked, NamedSharding(self._group_mesh, PartitionSpec()))
        return np.asarray(everywhere.addressable_data(0))[self._process_rows]

    def replicate(self, tree: Any) -> Any:
        """`tree` (arrays on the learner mesh) replicated on every learner device: an
        all-gather of sharded params."""
        return _replicate(tree, mesh_lib.replicated(self.mesh))

    def local_copy(self, tree: Any) -> Any:
        """A full copy of `tree` on one of this process's learner devices."""
        if not self.multi_process:
            return tree
        return jax.tree.map(lambda x: x.addressable_data(0), self.replicate(tree))

    def publish(self, params: Any, sampler_shardings: Any, cast: Any = None) -> Any:
        """The learner's params copied onto this process's sampler shardings
        (`mesh.publish`, through `cast` if given), gathering them from the other processes
        first."""
        return mesh_lib.publish(self.local_copy(params), sampler_shardings, cast)

    def global_batch(self, local_fields: dict[str, np.ndarray], sharding: NamedSharding):
        """This process's rows of the batch as part of the global batch on the learner mesh."""
        if not self.multi_process:
            return jax.device_put(local_fields, sharding)
        return {
            name: jax.make_array_from_process_local_data(sharding, value)
            for name, value in local_fields.items()
        }


@functools.cache
def _identity_onto(sharding: NamedSharding):
    """A compiled identity whose outputs land on `sharding` (one per sharding)."""
    return jax.jit(lambda tree: tree, out_shardings=sharding)


def _replicate(tree: Any, sharding: NamedSharding) -> Any:
    return _identity_onto(sharding)(tree)


def shard_of(examples: Sequence[dict], rank: int, count: int) -> list[dict]:
    """The examples a process of `count` draws prompts from: every `count`-th, from `rank`
    (disjoint across processes, so no two generate for the same prompt)."""
    return list(examples[rank::count])
