"""Where a run's frozen role models go: `RolePlacement`, the sampler mesh and its rules.

The trainer builds the task's reward models, red-team victim and judge (a decoder, or a
BERT / RoBERTa classifier) with `RolePlacement(meshes.sampler, config.mesh.sampler_rules)`
(`models.frozen.Placement`), so they are sharded as the sampler's copy of the policy is
and score their batches with the rows split over the mesh's data axis (padded to a
multiple of its size).
`experiments/evaluate.py` uses the same axes and rules over every device
(`over_all_devices`).
"""

from __future__ import annotations

import dataclasses

import jax
import ml_collections
import numpy as np
from absl import logging

from tba_jax import mesh as mesh_lib
from tba_jax.config_lib import ConfigError
from tba_jax.models import Params


@dataclasses.dataclass(frozen=True)
class RolePlacement:
    """Frozen role models' params sharded over `mesh` by `rules` (logical axis → mesh
    axis); their batches' rows split over its data axis."""

    mesh: jax.sharding.Mesh
    rules: mesh_lib.Rules

    def param_shardings(
        self, role_name: str, logical_axes: Params, abstract_params: Params
    ) -> Params:
        """The role's params' shardings (`logical_axes`: a decoder's `Model.logical_axes`,
        an encoder's `encoder_checkpoint.logical_axes`); a ConfigError naming the role when
        a rule splits one of its parameters unevenly."""
        try:
            return mesh_lib.param_shardings(logical_axes, abstract_params, self.mesh, self.rules)
        except ValueError as error:
            raise ConfigError(
                f"{role_name} on the sampler mesh: {error} (mesh.sampler_rules, mesh.sampler_axes)"
            ) from None

    def put_rows(self, *arrays: np.ndarray) -> tuple:
        """A batch's `arrays` on the mesh, rows split over the data (and fsdp) axes
        (`mesh.split_rows`: padded to a multiple of their shards; callers keep the first
        rows)."""
        return mesh_lib.split_rows(self.mesh, *arrays)


def over_all_devices(config: ml_collections.ConfigDict) -> RolePlacement | None:
    """Where `experiments/evaluate.py` (one process, no learner; any device count) puts the
    role models: the sampler's rules on a mesh of its fsdp and tensor sizes whose data axis
    takes the rest of this machine's devices (those that do not fill a data shard are left
    out); None (the default device, with a warning) when fsdp × tensor is more than the
    devices."""
    axes = {name: int(size) for name, size in config.mesh.sampler_axes.items()}
    if -1 not in axes.values():
        axes["data"] = -1
    split = int(np.prod([size for size in axes.values() if size != -1]))
    devices = jax.devices()
    if split > len(devices):
        logging.warning(
            "mesh.sampler_axes=%s split each role model over %d devices; this machine has "
            "%d, so they sit whole on the default device.",
            axes,
            split,
            len(devices),
        )
        return None
    usable = devices[: len(devices) // split * split]
    return RolePlacement(
        mesh_lib.make_mesh(usable, axes, key="mesh.sampler_axes"), config.mesh.sampler_rules
    )
