"""Frozen models beside the policy: reward models, red-team victims and judges.

A role is described by a config section with

- `hf_path`: a local Hugging Face folder (its weights, config and tokenizer), or
- empty `hf_path`: a random `preset` stand-in initialised from `seed`, sharing the
  policy's tokenizer (the `tiny` variants run the same code path this way).

plus `dtype` ("float32" | "bfloat16") and `attention`, the role's attention kernel (a
`ModelConfig.attention`: einsum by default, `cudnn` on a GPU with a half-precision
dtype; where the process has no GPU a `cudnn` role is read with `dot_product`, the same
attention, with a warning, as `runs.runnable_execution_fields` does for the policy).
`load_frozen_model` checks the checkpoint's head against what the role needs before
loading any weights.

With a `Placement` (the trainer passes `tba_jax.placement.RolePlacement`: the sampler mesh
and `mesh.sampler_rules`) a
role's params are sharded over that mesh as the sampler's policy copy is (e.g. split over
its tensor axis, so an 8B judge need not fit one device), and `FrozenModel.put_rows`
splits a batch's rows over the mesh's data axis (padding them to a multiple of its size);
without one the model sits whole on the default device.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

import jax
import ml_collections
import numpy as np

from tba_jax.models import Model, ModelConfig, Params, abstract_model, init_model, preset
from tba_jax.models.config import off_platform
from tba_jax.models.tokenizers import Tokenizer


class Placement(Protocol):
    """Where frozen role models go (`tba_jax.placement.RolePlacement`: the sampler mesh)."""

    def param_shardings(
        self, role_name: str, logical_axes: Params, abstract_params: Params
    ) -> Params:
        """The shardings of the role's params, whose logical axis names `logical_axes`
        mirrors (an error naming `role_name` if none fit)."""
        ...

    def put_rows(self, *arrays: np.ndarray) -> tuple:
        """`arrays` (same leading dimension: rows) where a batch's rows go: padded (the
        last row repeated) to what the placement splits evenly; callers keep the first
        rows of what comes back."""
        ...


@dataclasses.dataclass(frozen=True)
class FrozenModel:
    """A model that is never trained, with the tokenizer its inputs are encoded with."""

    model: Model
    params: Params
    tokenizer: Tokenizer
    source: str  # the hf_path, or "preset:<name>:seed=<seed>" for a random stand-in
    placement: Placement | None = None  # None: whole on the default device

    def put_rows(self, *arrays: np.ndarray):
        """`arrays` (same leading dimension: rows) where the params are, rows split over
        the placement's data axis: padded (the last row repeated) to a multiple of its
        size, so callers keep the first rows of what comes back; as they are without a
        placement."""
        return arrays if self.placement is None else self.placement.put_rows(*arrays)


DEFAULT_ATTENTION = "einsum"  # a role section without `attention` (a run from before it)


def role_attention(role: ml_collections.ConfigDict, role_name: str, backend: str | None = None):
    """The attention kernel the role's model runs with on this process's platform
    (`backend`, default JAX's): its `attention`, or for one of another platform's (cuDNN's
    off a GPU, splash off a TPU) the kernel that computes the same attention here (with a
    warning)."""
    attention = role.get("attention", DEFAULT_ATTENTION)
    backend = backend or jax.default_backend()
    found = off_platform("attention", attention, backend)
    if found is not None:
        platform, instead = found
        logging.warning(
            "%s.attention=%s needs a %s; running the %s on %s with attention=%s (the same "
            "attention, another kernel).",
            role_name,
            attention,
            platform.upper(),
            role_name,
            backend,
            instead,
        )
        return instead
    return attention


def frozen_model_config(
    role: ml_collections.ConfigDict,
    *,
    role_name: str,
    vocab_size: int | None,
    max_seq_len: int,
    head: str = "lm",
    num_labels: int = 1,
) -> ModelConfig:
    """The architecture of the model `role` describes, read without loading weights:
    `hf_path`'s config.json, else the `preset` over `vocab_size` ids (only read for a
    preset) and `max_seq_len` positions; in the role's `dtype`, with its attention kernel
    as this platform runs it (`role_attention`). `head`, `num_labels`: see
    `load_frozen_model`."""
    execution = dict(
        dtype=role.dtype, param_dtype=role.dtype, attention=role_attention(role, role_name)
    )
    if role.hf_path:
        from tba_jax.models import hf  # optional: needs safetensors/tokenizers

        config = hf.config_from_hf(role.hf_path)
        if config.head != head:
            kind = "*ForSequenceClassification" if head == "score" else "*ForCausalLM"
            raise ValueError(
                f"{role_name}.hf_path={role.hf_path} holds a model with head={config.head!r} "
                f"but the {role_name} needs head={head!r}; point it at a {kind} checkpoint."
            )
        return dataclasses.replace(config, **execution)
    return preset(
        role.preset,
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        head=head,
        num_labels=num_labels,
        **execution,
    )


@dataclasses.dataclass(frozen=True)
class FrozenLayout:
    """A role's model before its weights: its architecture, its params' shapes and where
    `load_frozen_model` puts them."""

    config: ModelConfig
    model: Model
    abstract_params: Params  # ShapeDtypeStructs
    shardings: Params | None  # None: whole on the default device


def frozen_model_layout(
    role: ml_collections.ConfigDict,
    *,
    role_name: str,
    fallback_tokenizer: Tokenizer,
    max_seq_len: int,
    head: str = "lm",
    num_labels: int = 1,
    placement: Placement | None = None,
) -> FrozenLayout:
    """The layout of the model `role` describes, from config files alone (config.json or
    the preset; no weights read): a ConfigError naming `role_name` when `placement`'s rules
    split one of its params unevenly. A task calls it with `load_frozen_model`'s arguments
    before it prepares data or a run warms up, so that a mesh its role models cannot take
    is refused first."""
    config = frozen_model_config(
        role,
        role_name=role_name,
        vocab_size=None if role.hf_path else fallback_tokenizer.vocab_size,
        max_seq_len=max_seq_len,
        head=head,
        num_labels=num_labels,
    )
    model, abstract = abstract_model(config)
    shardings = (
        None
        if placement is None
        else placement.param_shardings(role_name, model.logical_axes, abstract)
    )
    return FrozenLayout(config, model, abstract, shardings)


def role_tokenizer(role: ml_collections.ConfigDict, fallback_tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer a decoder role reads its inputs with: its checkpoint's, or for a
    random stand-in the policy's (`fallback_tokenizer`)."""
    if not role.hf_path:
        return fallback_tokenizer
    from tba_jax.models.hf_tokenizer import HFTokenizer  # optional: needs tokenizers

    return HFTokenizer.from_pretrained(role.hf_path)


def load_frozen_model(
    role: ml_collections.ConfigDict,
    *,
    role_name: str,
    fallback_tokenizer: Tokenizer,
    max_seq_len: int,
    head: str = "lm",
    num_labels: int = 1,
    placement: Placement | None = None,
) -> FrozenModel:
    """The model `role` describes (see the module docstring), sharded by `placement`, or
    on the default device without one.

    `head` ("lm" | "score") is what the role needs; a checkpoint with another head is a
    ValueError naming `role_name` (e.g. "task.reward_model"). For a "score" head from a
    checkpoint, `num_labels` is the checkpoint's own.
    """
    layout = frozen_model_layout(
        role,
        role_name=role_name,
        fallback_tokenizer=fallback_tokenizer,
        max_seq_len=max_seq_len,
        head=head,
        num_labels=num_labels,
        placement=placement,
    )
    if role.hf_path:
        from tba_jax.models import hf  # optional: needs safetensors/tokenizers

        params = hf.load_params(role.hf_path, layout.model, shardings=layout.shardings)
        tokenizer = role_tokenizer(role, fallback_tokenizer)
        return FrozenModel(layout.model, params, tokenizer, role.hf_path, placement)
    model, params = init_model(layout.config, role.seed)
    params = jax.device_put(params, layout.shardings)
    source = f"preset:{role.preset}:seed={role.seed}"
    return FrozenModel(model, params, fallback_tokenizer, source, placement)


def frozen_role_config(
    *,
    preset_name: str = "micro",
    seed: int = 0,
    dtype: str = "float32",
    attention: str = DEFAULT_ATTENTION,
) -> ml_collections.ConfigDict:
    """A role section for configs: `hf_path` (empty: a random `preset` stand-in), `preset`,
    `seed`, `dtype`, `attention`."""
    role = ml_collections.ConfigDict()
    role.hf_path = ""
    role.preset = preset_name
    role.seed = seed
    role.dtype = dtype
    role.attention = attention
    return role
