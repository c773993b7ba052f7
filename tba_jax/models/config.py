"""Model configuration and named size presets."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

FAMILIES = ("llama",)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer.

    `dtype` is the compute dtype of matmuls and activations; `param_dtype` is how
    parameters are stored. Log-softmax and norms always run in float32.
    """

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    d_ff: int
    max_seq_len: int
    head_dim: int | None = None
    family: str = "llama"
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    init_std: float = 0.02
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"model.family={self.family!r} is not one of {FAMILIES}.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} must be a multiple of "
                f"model.num_kv_heads={self.num_kv_heads} (grouped-query attention)."
            )
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.num_heads="
                f"{self.num_heads}; set model.head_dim explicitly."
            )
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(
                    f"model.{name}={getattr(self, name)!r} is not one of {list(DTYPES)}."
                )

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    @property
    def storage_dtype(self):
        return DTYPES[self.param_dtype]

    def num_params(self) -> int:
        """Parameter count from the shapes alone (no allocation)."""
        hd = self.resolved_head_dim
        attn = self.d_model * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.d_model * self.d_ff
        norms = 2 * self.d_model
        embed = self.vocab_size * self.d_model
        head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        return self.num_layers * (attn + mlp + norms) + embed + head + self.d_model

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Named presets. `vocab_size` and `max_seq_len` of a preset are defaults that a
# config may override (the tokenizer decides the vocabulary).
PRESETS: dict[str, dict[str, Any]] = {
    # Test size: compiles and runs in seconds.
    "micro": dict(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, d_ff=64, max_seq_len=32),
    # CPU demo size: trains in minutes on 2 cores.
    "tiny": dict(d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=384, max_seq_len=64),
    "small": dict(
        d_model=256, num_layers=4, num_heads=8, num_kv_heads=4, d_ff=768, max_seq_len=256
    ),
    "llama-60m": dict(
        d_model=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        d_ff=1536,
        max_seq_len=1024,
        vocab_size=32_000,
    ),
    "llama-300m": dict(
        d_model=1024,
        num_layers=16,
        num_heads=16,
        num_kv_heads=8,
        d_ff=2816,
        max_seq_len=2048,
        vocab_size=32_000,
    ),
    # TinyLlama / Rho-1B shape (Llama architecture, 1.1B parameters).
    "llama-1b": dict(
        d_model=2048,
        num_layers=22,
        num_heads=32,
        num_kv_heads=4,
        d_ff=5632,
        max_seq_len=2048,
        vocab_size=32_000,
    ),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """Returns the named preset with `overrides` applied (e.g. vocab_size)."""
    if name not in PRESETS:
        raise ValueError(f"Unknown model preset {name!r}; choose one of {sorted(PRESETS)}.")
    fields = dict(PRESETS[name])
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return ModelConfig(**fields)
