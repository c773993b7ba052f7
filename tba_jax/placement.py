"""Where a run's frozen role models go: `RolePlacement`, the sampler mesh and its rules.

The trainer builds the task's reward models, red-team victim and judge with
`RolePlacement(meshes.sampler, config.mesh.sampler_rules)` (`models.frozen.Placement`), so
they are sharded as the sampler's copy of the policy is and score their batches with the
rows split over the mesh's data axis (padded to a multiple of its size).
"""

from __future__ import annotations

import dataclasses

import jax

from tba_jax import mesh as mesh_lib
from tba_jax.config_lib import ConfigError
from tba_jax.models import Model, Params


@dataclasses.dataclass(frozen=True)
class RolePlacement:
    """Frozen role models' params sharded over `mesh` by `rules` (logical axis → mesh
    axis); their batches' rows split over its data axis."""

    mesh: jax.sharding.Mesh
    rules: mesh_lib.Rules

    def param_shardings(self, role_name: str, model: Model, abstract_params: Params) -> Params:
        """The role's params' shardings; a ConfigError naming the role when a rule splits
        one of its parameters unevenly."""
        try:
            return mesh_lib.param_shardings(
                model.logical_axes, abstract_params, self.mesh, self.rules
            )
        except ValueError as error:
            raise ConfigError(
                f"{role_name} on the sampler mesh: {error} (mesh.sampler_rules, mesh.sampler_axes)"
            ) from None

    def row_sharding(self) -> jax.sharding.NamedSharding:
        """A batch's rows split over the data (and fsdp) axes."""
        return mesh_lib.batch_sharding(self.mesh)

    def row_multiple(self) -> int:
        """What a batch's row count must be a multiple of: the data (× fsdp) shards."""
        return mesh_lib.batch_shards(self.mesh)
