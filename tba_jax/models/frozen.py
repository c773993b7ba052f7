"""Frozen models beside the policy: reward models, red-team victims and judges.

A role is described by a config section with

- `hf_path`: a local Hugging Face folder (its weights, config and tokenizer), or
- empty `hf_path`: a random `preset` stand-in initialised from `seed`, sharing the
  policy's tokenizer (the `tiny` variants run the same code path this way).

plus `dtype` ("float32" | "bfloat16"). `load_frozen_model` checks the checkpoint's
head against what the role needs before loading any weights.
"""

from __future__ import annotations

import dataclasses

import jax
import ml_collections

from tba_jax.models import Model, ModelConfig, Params, init_model, preset
from tba_jax.models.tokenizers import Tokenizer


@dataclasses.dataclass(frozen=True)
class FrozenModel:
    """A model that is never trained, with the tokenizer its inputs are encoded with."""

    model: Model
    params: Params
    tokenizer: Tokenizer
    source: str  # the hf_path, or "preset:<name>:seed=<seed>" for a random stand-in


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
    preset) and `max_seq_len` positions. `head`, `num_labels`: see `load_frozen_model`."""
    if role.hf_path:
        from tba_jax.models import hf  # optional: needs safetensors/tokenizers

        config = hf.config_from_hf(role.hf_path)
        if config.head != head:
            kind = "*ForSequenceClassification" if head == "score" else "*ForCausalLM"
            raise ValueError(
                f"{role_name}.hf_path={role.hf_path} holds a model with head={config.head!r} "
                f"but the {role_name} needs head={head!r}; point it at a {kind} checkpoint."
            )
        return dataclasses.replace(config, dtype=role.dtype, param_dtype=role.dtype)
    return preset(
        role.preset,
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        head=head,
        num_labels=num_labels,
        dtype=role.dtype,
        param_dtype=role.dtype,
    )


def load_frozen_model(
    role: ml_collections.ConfigDict,
    *,
    role_name: str,
    fallback_tokenizer: Tokenizer,
    max_seq_len: int,
    head: str = "lm",
    num_labels: int = 1,
) -> FrozenModel:
    """The model `role` describes (see the module docstring), on the default device.

    `head` ("lm" | "score") is what the role needs; a checkpoint with another head is a
    ValueError naming `role_name` (e.g. "reward_model"). For a "score" head from a
    checkpoint, `num_labels` is the checkpoint's own.
    """
    config = frozen_model_config(
        role,
        role_name=role_name,
        vocab_size=None if role.hf_path else fallback_tokenizer.vocab_size,
        max_seq_len=max_seq_len,
        head=head,
        num_labels=num_labels,
    )
    if role.hf_path:
        from tba_jax.models import hf  # optional: needs safetensors/tokenizers
        from tba_jax.models.hf_tokenizer import HFTokenizer

        model, params = hf.load_model(role.hf_path, dtype=role.dtype)
        tokenizer = HFTokenizer.from_pretrained(role.hf_path)
        return FrozenModel(model, params, tokenizer, role.hf_path)
    model, params = init_model(config, role.seed)
    params = jax.device_put(params)
    return FrozenModel(model, params, fallback_tokenizer, f"preset:{role.preset}:seed={role.seed}")


def frozen_role_config(
    *, preset_name: str = "micro", seed: int = 0, dtype: str = "float32"
) -> ml_collections.ConfigDict:
    """A role section for configs: `hf_path` (empty: a random `preset` stand-in), `preset`,
    `seed`, `dtype`."""
    role = ml_collections.ConfigDict()
    role.hf_path = ""
    role.preset = preset_name
    role.seed = seed
    role.dtype = dtype
    return role
