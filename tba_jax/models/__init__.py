"""Models: the Flax decoder, its presets, and the functional interface used in jitted code.

Parameters travel as *pure* nested dicts of arrays (what optax, orbax and
`jax.device_put` see); the module graph is kept as an `nnx.GraphDef` and
re-attached inside jitted functions with `nnx.merge`.

`params["blocks"]` is {0: block, 1: block, ...} per layer, or with
`ModelConfig.scan_layers` one block's tree whose leaves are stacked [num_layers, ...];
`stack_layers` and `unstack_layers` convert between the two exactly.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tba_jax.models.config import FAMILIES, PRESETS, PUBLISHED_NUM_PARAMS, ModelConfig, preset
from tba_jax.models.transformer import (
    Decoder,
    KVCache,
    cache_batch_axis,
    compute_dtype_cast,
    init_cache,
    last_valid_index,
    params_in_compute_dtype,
    positions_from_mask,
)

Params = dict[str, Any]

__all__ = [
    "FAMILIES",
    "PRESETS",
    "PUBLISHED_NUM_PARAMS",
    "Decoder",
    "KVCache",
    "Model",
    "ModelConfig",
    "abstract_model",
    "cache_batch_axis",
    "compute_dtype_cast",
    "init_cache",
    "init_model",
    "last_valid_index",
    "params_in_compute_dtype",
    "positions_from_mask",
    "preset",
    "sequence_scores",
    "stack_layers",
    "unstack_layers",
]


@dataclasses.dataclass(frozen=True)
class Model:
    """The static half of a model: its config, graph definition and logical axes.

    `logical_axes` mirrors the params dict with a tuple of axis names per leaf.
    """

    config: ModelConfig
    graphdef: Any
    logical_axes: Params

    def apply(
        self,
        params: Params,
        tokens: jax.Array,
        positions: jax.Array,
        key_valid: jax.Array,
        cache: KVCache | None = None,
        cache_offset: jax.Array | int = 0,
        *,
        logits_dtype=jnp.float32,
    ) -> tuple[jax.Array, KVCache | None]:
        """Runs the decoder with `params`; see `Decoder.__call__` for shapes."""
        module = nnx.merge(self.graphdef, params)
        return module(tokens, positions, key_valid, cache, cache_offset, logits_dtype=logits_dtype)

    def features(
        self, params: Params, tokens: jax.Array, positions: jax.Array, key_valid: jax.Array
    ) -> jax.Array:
        """Final hidden states [B, S, d_model] of a cache-free pass; see `Decoder.features`."""
        return nnx.merge(self.graphdef, params).features(tokens, positions, key_valid)

    def head(self, params: Params, features: jax.Array, *, out_dtype=jnp.float32) -> jax.Array:
        """The output head on hidden states [..., d_model]: [..., V or num_labels] in
        `out_dtype` (None: the compute dtype it is computed in)."""
        return nnx.merge(self.graphdef, params).head(features, out_dtype=out_dtype)

    def head_weight(self, params: Params) -> jax.Array:
        """The output head's matrix [d_model, V or num_labels] in `params`, as stored: the
        head is `features @ head_weight` in the compute dtype."""
        return nnx.merge(self.graphdef, params).head_weight()

    def init_cache(self, batch: int, length: int) -> KVCache:
        return init_cache(self.config, batch, length)

    @property
    def cache_batch_axis(self) -> int:
        """The axis of this model's KV cache leaves that holds the rows (1 with
        `scan_decode`: [L, B, ...])."""
        return cache_batch_axis(self.config)

    def for_decoding(self, params: Params) -> tuple[Model, Params]:
        """The model and params a decode loop runs, called once before the loop. The
        weights are cast to the compute dtype (`params_in_compute_dtype`; the same values
        the model would cast them to at each step: with float32 params, XLA converted every
        weight again at every decode step, 7.48 against 4.52 GB a step for qwen2.5-0.5b at
        batch 256 on an H100). The layout stays (per-layer params, or `scan_decode`, which
        scans the stacked blocks), but with `scan_layers` alone the same model runs
        unscanned on `params` unstacked (copies), since static slices of the stacked
        weights inside each step would be copied every step."""
        params = params_in_compute_dtype(self.config, params)
        if not self.config.scan_layers or self.config.scan_decode:
            return self, params
        return _per_layer_model(self.config), unstack_layers(params)

    def __hash__(self):  # Hashable so a Model can be a static jit argument.
        return id(self)


def _split(module: Decoder, cfg: ModelConfig) -> tuple[Model, Params]:
    graphdef, state = nnx.split(module)
    logical_axes: Params = {}
    for path, variable in nnx.to_flat_state(state):
        node = logical_axes
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = tuple(variable.logical_axes)
    return Model(cfg, graphdef, logical_axes), nnx.to_pure_dict(state)


@functools.cache
def _per_layer_model(cfg: ModelConfig) -> Model:
    """The model of `cfg` without scan_layers (built once per config)."""
    return abstract_model(cfg.in_layout(False))[0]


def init_model(cfg: ModelConfig, seed: int) -> tuple[Model, Params]:
    """Builds the model and randomly initialised params (on the default device)."""
    return _split(Decoder(cfg, rngs=nnx.Rngs(params=seed)), cfg)


def abstract_model(cfg: ModelConfig) -> tuple[Model, Params]:
    """Like `init_model` but params are `jax.ShapeDtypeStruct`s: nothing is allocated."""
    module = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(params=0)))
    model, params = _split(module, cfg)
    return model, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)


def stack_layers(params: Params) -> Params:
    """Per-layer params ({"blocks": {0: tree, ..., L-1: tree}, ...}) in the `scan_layers`
    layout ({"blocks": tree of [L, ...] leaves, ...}); every other entry is kept as it is.
    The values are copied exactly (`unstack_layers` is the inverse)."""
    blocks = params["blocks"]
    layers = [blocks[index] for index in range(len(blocks))]
    return {**params, "blocks": jax.tree.map(lambda *leaves: jnp.stack(leaves), *layers)}


def unstack_layers(params: Params) -> Params:
    """`scan_layers` params ({"blocks": tree of [L, ...] leaves, ...}) in the per-layer
    layout ({"blocks": {0: tree, ..., L-1: tree}, ...}); the inverse of `stack_layers`."""
    blocks = params["blocks"]
    num_layers = jax.tree.leaves(blocks)[0].shape[0]
    layers = {
        index: jax.tree.map(lambda leaf, i=index: leaf[i], blocks) for index in range(num_layers)
    }
    return {**params, "blocks": layers}


def sequence_scores(model: Model, params: Params, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """A score-head model's output at the last real token of each row: [B, num_labels].

    tokens, mask: [B, S] (left- or right-padded; mask 1 on real tokens). This is
    what transformers' *ForSequenceClassification returns (the rightmost non-pad
    token), with padding found from the mask instead of a pad token id.
    """
    if model.config.head != "score":
        raise ValueError(
            f"sequence_scores needs a model with head='score', got head={model.config.head!r}; "
            "load a *ForSequenceClassification checkpoint or set ModelConfig.head='score'."
        )
    valid = jnp.asarray(mask).astype(bool)
    scores, _ = model.apply(params, tokens, positions_from_mask(valid), valid)
    last = last_valid_index(valid)
    return jnp.take_along_axis(scores, last[:, None, None], axis=1)[:, 0]
