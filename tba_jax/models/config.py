"""Model configuration and named size presets.

One decoder serves four architecture families; `ModelConfig.family` names the
family and a handful of switches select its parts:

| switch               | llama   | qwen2   | gpt_neox | gpt2     |
|----------------------|---------|---------|----------|----------|
| norm (+ norm_bias)   | rms     | rms     | layer+b  | layer+b  |
| mlp / activation     | gated / silu | gated / silu | dense / gelu | dense / gelu_new |
| mlp_bias             | no      | no      | yes      | yes      |
| qkv_bias             | no      | yes     | yes      | yes      |
| attn_out_bias        | no      | no      | yes      | yes      |
| parallel_residual    | no      | no      | yes      | no       |
| position_embedding   | rope    | rope    | rope (rotary_pct 0.25) | learned |
| tie_embeddings       | no      | no      | no       | yes      |

A switch left as None takes its family's value (`FAMILY_DEFAULTS`, the table above in
code). Presets and the Hugging Face import leave a switch None unless it differs, and the
export checks the switches transformers hard-codes against these values, so each is stated
once. Any switch may be set explicitly (e.g. a Llama with attention biases). `head="score"`
turns the language-model head into a `num_labels`-way score head (reward models).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp

FAMILIES = ("llama", "qwen2", "gpt_neox", "gpt2")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
NORMS = ("rms", "layer")
MLPS = ("gated", "dense")
ACTIVATIONS = ("silu", "gelu", "gelu_new")
POSITION_EMBEDDINGS = ("rope", "learned")
ROPE_SCALINGS = (None, "llama3")
HEADS = ("lm", "score")
# How a model is computed (not what it computes): see `ModelConfig`'s execution fields.
# "none", or a `jax.checkpoint_policies` name applied to each block ("nothing_saveable":
# recompute the whole block in the backward pass).
REMAT_POLICIES = ("none", "nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable")
# "einsum": the explicit einsum/softmax attention; "dot_product": `jax.nn.dot_product_attention`
# with JAX's choice of kernel (XLA in JAX 0.10); "cudnn": its cuDNN flash kernel (GPU, bf16/fp16);
# "splash": Pallas' splash attention kernel for TPUs in cache-free passes
# (`models.splash_attention`), "dot_product" in passes with a KV cache.
ATTENTIONS = ("einsum", "dot_product", "cudnn", "splash")
# A decode step's attention: "same" as `attention`, or "pallas" (`models.decode_attention`).
DECODE_ATTENTIONS = ("same", "pallas")
# The Pallas decode kernel loads a KV head's query heads as one tile of this many rows
# (Triton's matmuls take at least 16 on each side, and power-of-two array sizes only).
PALLAS_DECODE_TILE = 16
MIN_BLOCK_K = 16  # cache slots the kernel reads at once, at least (Triton's matmuls)
# A decode step's gated MLP hidden layer: "same" as every other pass (XLA's matmuls), or
# "pallas" (`models.gated_mlp`: both products and the activation in one kernel).
DECODE_MLPS = ("same", "pallas")
MIN_MLP_BLOCK = 16  # the Pallas MLP kernel's tiles, at least, on each side (Triton's matmuls)
# A decode step's output projections (attention's W_o, the MLP's W_down): "same" as every
# other pass (XLA's matmuls), or "pallas" (`models.decode_projection`: the contraction split
# between programs). Its tiles take MIN_MLP_BLOCK too.
DECODE_PROJECTIONS = ("same", "pallas")
# A decode step's attention input (the RMSNorm, the Q, K and V projections, the rotary
# embedding and the cache write): "same" as every other pass (XLA's kernels), or "pallas"
# (`models.decode_qkv`: all of it in one kernel). Head widths a power of two and at least
# this (each half of a head is one side of its matmuls, which take MIN_MLP_BLOCK, and an
# array of Triton's, whose sizes are powers of two).
DECODE_QKVS = ("same", "pallas")
QKV_MIN_HEAD = 2 * MIN_MLP_BLOCK


class KernelSettings(NamedTuple):
    """How the Pallas decode kernel (`models.decode_attention`) splits its work (the
    results are the same to float rounding):

    - k_splits: programs a row's walk over the cache is split between (each KV head's);
      > 1 adds a combining step outside the kernel;
    - block_k: cache slots a program reads at once (a power of two >= `MIN_BLOCK_K`; fewer
      for a shorter cache);
    - num_warps, num_stages: Triton's launch settings (ignored by the interpreter).

    `model.decode_kernel` sets them as "k_splits:block_k:num_warps:num_stages", and
    `benchmarks/decode_attention_kernel.py --settings` times a grid of them on a GPU.
    """

    k_splits: int = 1
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 2

    def spec(self) -> str:
        """e.g. "1:128:4:2", as `model.decode_kernel` and `parse_kernel_settings` take it."""
        return ":".join(str(value) for value in self)


def _check_powers_of_two(settings: NamedTuple, names: tuple[str, ...]) -> None:
    """ValueError naming the first of `settings`' fields `names` that is no power of two."""
    for name in names:
        value = getattr(settings, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"{settings}: {name} must be a power of two.")


def check_kernel_settings(settings: KernelSettings) -> None:
    """ValueError for settings the kernel cannot run with."""
    k_splits, block_k, _, num_stages = settings
    if k_splits < 1 or num_stages < 1:
        raise ValueError(f"{settings}: k_splits and num_stages must be at least 1.")
    _check_powers_of_two(settings, ("block_k", "num_warps"))
    if block_k < MIN_BLOCK_K:
        raise ValueError(f"{settings}: block_k must be at least {MIN_BLOCK_K}.")


class MlpKernelSettings(NamedTuple):
    """How the Pallas MLP kernel (`models.gated_mlp`) tiles its work (the results are the
    same to float rounding):

    - block_m, block_n: rows and hidden units a program computes (powers of two >=
      `MIN_MLP_BLOCK`; fewer where that tiles the axis: rows are padded up to a block,
      hidden units take the largest power of two dividing d_ff);
    - block_k: model-width entries a program reads at once (the same rule, over d_model);
    - num_warps, num_stages: Triton's launch settings (ignored by the interpreter).

    `model.decode_mlp_kernel` sets them as "block_m:block_n:block_k:num_warps:num_stages",
    and `benchmarks/gated_mlp_kernel.py --settings` times a grid of them on a GPU.
    """

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def spec(self) -> str:
        """e.g. "64:64:64:4:3", as `model.decode_mlp_kernel` takes it."""
        return ":".join(str(value) for value in self)


class ProjectionKernelSettings(NamedTuple):
    """How the Pallas projection kernel (`models.decode_projection`) tiles its work (the
    results are the same to float rounding):

    - block_m, block_n: rows and outputs a program computes (powers of two >=
      `MIN_MLP_BLOCK`; rows are padded up to a block, outputs take the largest power of
      two dividing the width);
    - block_k: contraction entries a program reads at once (the same rule, over its part);
    - k_splits: parts the contraction is split into, one program each, whose float32 sums
      are added after the kernel (a power of two; fewer where a part would not be a whole
      multiple of `MIN_MLP_BLOCK`);
    - num_warps, num_stages: Triton's launch settings (ignored by the interpreter).

    `model.decode_projection_kernel` sets them as
    "block_m:block_n:block_k:k_splits:num_warps:num_stages", and
    `benchmarks/decode_projection_kernel.py --settings` times a grid of them on a GPU.
    """

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    k_splits: int = 4
    num_warps: int = 4
    num_stages: int = 3

    def spec(self) -> str:
        """e.g. "64:64:64:4:4:3", as `model.decode_projection_kernel` takes it."""
        return ":".join(str(value) for value in self)


class QkvKernelSettings(NamedTuple):
    """How the Pallas attention-input kernel (`models.decode_qkv`) tiles its work (the
    results are the same to float rounding): one program per block of rows and head.

    - block_m: rows a program computes (a power of two >= `MIN_MLP_BLOCK`; rows are
      padded up to a block);
    - block_k: model-width entries a program reads at once (the largest power of two at
      most this that divides d_model);
    - num_warps, num_stages: Triton's launch settings (ignored by the interpreter).

    `model.decode_qkv_kernel` sets them as "block_m:block_k:num_warps:num_stages".
    """

    block_m: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def spec(self) -> str:
        """e.g. "64:64:4:3", as `model.decode_qkv_kernel` takes it."""
        return ":".join(str(value) for value in self)


def check_qkv_kernel_settings(settings: QkvKernelSettings) -> None:
    """ValueError for settings the attention-input kernel cannot run with."""
    if settings.num_stages < 1:
        raise ValueError(f"{settings}: num_stages must be at least 1.")
    _check_powers_of_two(settings, ("block_m", "block_k", "num_warps"))
    for name in ("block_m", "block_k"):
        if getattr(settings, name) < MIN_MLP_BLOCK:
            raise ValueError(f"{settings}: {name} must be at least {MIN_MLP_BLOCK}.")


def check_projection_kernel_settings(settings: ProjectionKernelSettings) -> None:
    """ValueError for settings the projection kernel cannot run with."""
    if settings.num_stages < 1:
        raise ValueError(f"{settings}: num_stages must be at least 1.")
    _check_powers_of_two(settings, ("block_m", "block_n", "block_k", "k_splits", "num_warps"))
    for name in ("block_m", "block_n", "block_k"):
        if getattr(settings, name) < MIN_MLP_BLOCK:
            raise ValueError(f"{settings}: {name} must be at least {MIN_MLP_BLOCK}.")


def check_mlp_kernel_settings(settings: MlpKernelSettings) -> None:
    """ValueError for settings the MLP kernel cannot run with."""
    if settings.num_stages < 1:
        raise ValueError(f"{settings}: num_stages must be at least 1.")
    _check_powers_of_two(settings, ("block_m", "block_n", "block_k", "num_warps"))
    for name in ("block_m", "block_n", "block_k"):
        if getattr(settings, name) < MIN_MLP_BLOCK:
            raise ValueError(f"{settings}: {name} must be at least {MIN_MLP_BLOCK}.")


def _settings_from_spec(spec: str, settings_type, check, example: str):
    """`settings_type` (a NamedTuple of whole numbers) from its fields' values joined by
    ":", checked by `check` (ValueError naming the spec and an `example`)."""
    parts, fields = spec.split(":"), settings_type._fields
    if len(parts) != len(fields) or not all(part.isdigit() for part in parts):
        raise ValueError(
            f"{spec!r} is not {':'.join(fields)} ({len(fields)} whole numbers, e.g. {example})."
        )
    settings = settings_type(*map(int, parts))
    check(settings)
    return settings


def parse_kernel_settings(spec: str) -> KernelSettings:
    """KernelSettings from "k_splits:block_k:num_warps:num_stages" (e.g. "4:64:4:3"),
    checked (ValueError naming the spec)."""
    return _settings_from_spec(spec, KernelSettings, check_kernel_settings, "2:128:4:2")


def parse_mlp_kernel_settings(spec: str) -> MlpKernelSettings:
    """MlpKernelSettings from "block_m:block_n:block_k:num_warps:num_stages" (e.g.
    "64:128:64:4:3"), checked (ValueError naming the spec)."""
    return _settings_from_spec(spec, MlpKernelSettings, check_mlp_kernel_settings, "64:64:64:4:3")


def parse_qkv_kernel_settings(spec: str) -> QkvKernelSettings:
    """QkvKernelSettings from "block_m:block_k:num_warps:num_stages" (e.g. "64:64:4:3"),
    checked (ValueError naming the spec)."""
    return _settings_from_spec(spec, QkvKernelSettings, check_qkv_kernel_settings, "64:64:4:3")


def parse_projection_kernel_settings(spec: str) -> ProjectionKernelSettings:
    """ProjectionKernelSettings from "block_m:block_n:block_k:k_splits:num_warps:num_stages"
    (e.g. "64:64:64:4:4:3"), checked (ValueError naming the spec)."""
    return _settings_from_spec(
        spec, ProjectionKernelSettings, check_projection_kernel_settings, "64:64:64:4:4:3"
    )


class DecodeKernelKnob(NamedTuple):
    """A decode-step kernel's knob (a `ModelConfig` field, "same" or "pallas"), its values,
    and the key of its settings with their type (the fields a `model.<settings_key>` spec
    gives, joined by ":") and parser."""

    knob: str
    choices: tuple[str, ...]
    settings_key: str
    settings_type: type
    parse: Callable[[str], Any]


DECODE_KERNEL_KNOBS = (
    DecodeKernelKnob(
        "decode_attention", DECODE_ATTENTIONS, "decode_kernel", KernelSettings,
        parse_kernel_settings,
    ),
    DecodeKernelKnob(
        "decode_mlp", DECODE_MLPS, "decode_mlp_kernel", MlpKernelSettings,
        parse_mlp_kernel_settings,
    ),
    DecodeKernelKnob(
        "decode_projection", DECODE_PROJECTIONS, "decode_projection_kernel",
        ProjectionKernelSettings, parse_projection_kernel_settings,
    ),
    DecodeKernelKnob(
        "decode_qkv", DECODE_QKVS, "decode_qkv_kernel", QkvKernelSettings,
        parse_qkv_kernel_settings,
    ),
)  # fmt: skip

HALF_DTYPES = ("bfloat16", "float16")
# Execution field values only one platform (JAX's name for it) runs, and the value that
# computes the same elsewhere: what a run's checkpoint is read with there.
PLATFORM_EXECUTION = {
    ("attention", "cudnn"): ("gpu", "dot_product"),
    ("decode_attention", "pallas"): ("gpu", "same"),
    ("decode_mlp", "pallas"): ("gpu", "same"),
    ("decode_projection", "pallas"): ("gpu", "same"),
    ("decode_qkv", "pallas"): ("gpu", "same"),
    ("attention", "splash"): ("tpu", "dot_product"),
}


def off_platform(key: str, value: Any, backend: str) -> tuple[str, str] | None:
    """(the platform it runs on, the value that computes the same elsewhere)
    when `value` of execution field `key` is a kernel of another platform than `backend`
    (JAX's name for this run's); None when `backend` runs it."""
    platform, instead = PLATFORM_EXECUTION.get((key, value), (backend, value))
    return None if platform == backend else (platform, instead)


# Fields that change how the model runs but neither its outputs (up to float rounding) nor
# its params: left out of `ModelConfig.to_dict`, the identity a run's checkpoints carry.
EXECUTION_FIELDS = (
    "scan_decode",
    "remat",
    "attention",
    "decode_attention",
    "decode_kernel",
    "decode_mlp",
    "decode_mlp_kernel",
    "decode_projection",
    "decode_projection_kernel",
    "decode_qkv",
    "decode_qkv_kernel",
    "logprob_chunk",
)

# Values the architecture switches take when a config leaves them as None.
_LLAMA_SWITCHES = dict(
    norm="rms",
    norm_bias=False,
    mlp="gated",
    activation="silu",
    mlp_bias=False,
    qkv_bias=False,
    attn_out_bias=False,
    parallel_residual=False,
    position_embedding="rope",
    rotary_pct=1.0,
    tie_embeddings=False,
)
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA_SWITCHES,
    "qwen2": {**_LLAMA_SWITCHES, "qkv_bias": True},
    "gpt_neox": dict(
        norm="layer",
        norm_bias=True,
        mlp="dense",
        activation="gelu",
        mlp_bias=True,
        qkv_bias=True,
        attn_out_bias=True,
        parallel_residual=True,
        position_embedding="rope",
        rotary_pct=0.25,
        tie_embeddings=False,
    ),
    "gpt2": dict(
        norm="layer",
        norm_bias=True,
        mlp="dense",
        activation="gelu_new",
        mlp_bias=True,
        qkv_bias=True,
        attn_out_bias=True,
        parallel_residual=False,
        position_embedding="learned",
        rotary_pct=1.0,
        tie_embeddings=True,
    ),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer.

    `dtype` is the compute dtype of matmuls and activations; `param_dtype` is how
    parameters are stored. Log-softmax and norms always run in float32.

    `max_seq_len` is the number of rows of the learned position table when
    `position_embedding="learned"` (GPT-2's n_positions); for rotary models it is
    only the longest sequence the config is meant for.

    `rope_scaling="llama3"` remaps the rotary frequencies as Llama 3.1/3.2 do
    (`rope_scaling_factor`, `rope_low_freq_factor`, `rope_high_freq_factor`,
    `rope_original_max_len`).

    Execution fields (the same model, computed differently):

    - `scan_layers`: the blocks' params are stacked on a leading `layers` axis
      (`params["blocks"]` is one block's tree with [num_layers, ...] leaves instead of
      {0: ..., 1: ...}) and the cache-free pass (learner, scoring) runs them with one
      `jax.lax.scan`, so compile time does not grow with depth. Passes with a KV cache
      (prefill, decode) run layer by layer: decode loops unstack the params once per call
      (`Model.for_decoding`). `models.stack_layers` / `unstack_layers` convert params
      between the layouts exactly.
    - `scan_decode` (with `scan_layers`): passes with a KV cache scan the stacked blocks
      too, over a stacked cache ([L, B, S_kv, KV, hd]), so decode programs compile in a
      time that does not grow with depth and no per-layer copy of the weights is made.
    - `remat`: a rematerialisation policy (`REMAT_POLICIES`) applied to each block of the
      cache-free pass: what the backward pass recomputes instead of keeping.
    - `attention`: the attention kernel (`ATTENTIONS`) of every pass, with a KV cache
      (prefill, decode steps) or without (learner, scoring); "splash" (TPU) is a kernel
      for cache-free passes, and passes with a cache take "dot_product" then.
    - `decode_attention`: a decode step's attention (one query slot per row over the KV
      cache): "same" as `attention`, or "pallas", flash decoding in one Pallas kernel
      over the cache as it is laid out (`models.decode_attention`: Triton on a GPU, Pallas'
      interpreter, slow, elsewhere). Prefill and cache-free passes keep `attention`.
    - `decode_kernel`: the Pallas kernel's `KernelSettings` as
      "k_splits:block_k:num_warps:num_stages" ("": its defaults, `KernelSettings()`), for
      tuning it to a GPU; read only with `decode_attention="pallas"`.
    - `decode_mlp`: a decode step's gated MLP hidden layer, act(x W_gate) * (x W_up):
      "same" as every other pass (XLA's matmuls), or "pallas", both products and the
      activation in one Pallas kernel that writes only the hidden layer
      (`models.gated_mlp`: Triton on a GPU, Pallas' interpreter, slow, elsewhere). Gated
      MLPs without biases, d_model and d_ff multiples of `MIN_MLP_BLOCK`.
    - `decode_mlp_kernel`: that kernel's `MlpKernelSettings` as
      "block_m:block_n:block_k:num_warps:num_stages" ("": its defaults); read only with
      `decode_mlp="pallas"`.
    - `decode_projection`: a decode step's output projections, attention's W_o and the
      MLP's W_down: "same" as every other pass (XLA's matmuls), or "pallas", one Pallas
      kernel that splits the contraction between programs and adds their float32 sums
      after it (`models.decode_projection`: Triton on a GPU, Pallas' interpreter, slow,
      elsewhere). Their widths (heads x head width, d_ff, d_model) multiples of
      `MIN_MLP_BLOCK`.
    - `decode_projection_kernel`: that kernel's `ProjectionKernelSettings` as
      "block_m:block_n:block_k:k_splits:num_warps:num_stages" ("": its defaults); read
      only with `decode_projection="pallas"`.
    - `decode_qkv`: a decode step's attention input, the block's RMSNorm, the Q, K and V
      projections with their biases, the rotary embedding and the write of the new key
      and value into the cache: "same" as every other pass (XLA's kernels, five a
      layer), or "pallas", all of it in one Pallas kernel (`models.decode_qkv`: Triton on
      a GPU, Pallas' interpreter, slow, elsewhere). RMSNorm without a bias, full rotary
      or no position rotation, head widths a power of two >= `QKV_MIN_HEAD`, d_model a
      multiple of `MIN_MLP_BLOCK`, and an unscanned decode (`scan_decode=False`).
    - `decode_qkv_kernel`: that kernel's `QkvKernelSettings` as
      "block_m:block_k:num_warps:num_stages" ("": its defaults); read only with
      `decode_qkv="pallas"`.
    - `logprob_chunk`: teacher-forced log-probs (`sampling.scoring.token_logprobs`) project
      and normalise this many response slots at a time, so [rows, length, vocab] float32
      logits never exist at once (0: all slots in one go).
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
    tie_embeddings: bool | None = None
    qkv_bias: bool | None = None
    init_std: float = 0.02
    dtype: str = "float32"
    param_dtype: str = "float32"
    # Architecture switches; None: the family's value (FAMILY_DEFAULTS).
    norm: str | None = None
    norm_bias: bool | None = None
    mlp: str | None = None
    activation: str | None = None
    mlp_bias: bool | None = None
    attn_out_bias: bool | None = None
    parallel_residual: bool | None = None
    position_embedding: str | None = None
    rotary_pct: float | None = None
    rope_scaling: str | None = None
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    # Output head: "lm" (vocabulary logits) or "score" ([num_labels] per slot).
    head: str = "lm"
    num_labels: int = 1
    # Execution (see the docstring).
    scan_layers: bool = False
    scan_decode: bool = False
    remat: str = "none"
    attention: str = "einsum"
    decode_attention: str = "same"
    decode_kernel: str = ""
    decode_mlp: str = "same"
    decode_mlp_kernel: str = ""
    decode_projection: str = "same"
    decode_projection_kernel: str = ""
    decode_qkv: str = "same"
    decode_qkv_kernel: str = ""
    logprob_chunk: int = 0

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"model.family={self.family!r} is not one of {FAMILIES}.")
        for name, value in FAMILY_DEFAULTS[self.family].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        self._check_choices()
        self._check_shapes()
        self._check_rotary()
        self._check_execution()

    def _check_choices(self):
        choices = {
            "norm": NORMS,
            "mlp": MLPS,
            "activation": ACTIVATIONS,
            "position_embedding": POSITION_EMBEDDINGS,
            "rope_scaling": ROPE_SCALINGS,
            "head": HEADS,
            "dtype": tuple(DTYPES),
            "param_dtype": tuple(DTYPES),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"model.{name}={getattr(self, name)!r} is not one of {list(allowed)}."
                )
        if self.norm_bias and self.norm != "layer":
            raise ValueError("model.norm_bias=True needs model.norm='layer' (RMSNorm has no bias).")
        if self.num_labels < 1:
            raise ValueError(f"model.num_labels={self.num_labels} must be >= 1.")

    def _check_shapes(self):
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

    def _check_rotary(self):
        if not 0.0 < self.rotary_pct <= 1.0:
            raise ValueError(f"model.rotary_pct={self.rotary_pct} must be in (0, 1].")
        if self.position_embedding == "rope" and self.rotary_dim % 2:
            raise ValueError(
                f"model.rotary_pct={self.rotary_pct} of head_dim={self.resolved_head_dim} gives "
                f"an odd rotary dimension {self.rotary_dim}; rotary pairs need an even one."
            )
        if self.rope_scaling == "llama3" and not (
            0 < self.rope_low_freq_factor < self.rope_high_freq_factor
        ):
            raise ValueError(
                f"model.rope_low_freq_factor={self.rope_low_freq_factor} must be positive and "
                f"below model.rope_high_freq_factor={self.rope_high_freq_factor}."
            )

    def _check_pallas_decode_shape(self):
        """ValueError for heads the Pallas decode kernel cannot take: a head width that is
        no power of two, which Triton has no kernel for (e.g. pythia-2.8b's 80; heads
        narrower than 16, a toy model's, run in Pallas' interpreter), or more query heads
        per KV head than its tile."""
        head_dim, groups = self.resolved_head_dim, self.num_heads // self.num_kv_heads
        if head_dim & (head_dim - 1):
            raise ValueError(
                "model.decode_attention='pallas' needs a head width that is a power of two "
                f"(Triton's arrays), and this model's is {head_dim}; use "
                "decode_attention='same'."
            )
        if groups > PALLAS_DECODE_TILE:
            raise ValueError(
                f"model.decode_attention='pallas' takes up to {PALLAS_DECODE_TILE} query heads "
                f"per KV head, and this model has {groups}; use decode_attention='same'."
            )

    def _check_pallas_mlp_shape(self):
        """ValueError for an MLP the Pallas MLP kernel does not compute: a dense one, one
        with biases, or widths it cannot tile."""
        if self.mlp != "gated" or self.mlp_bias:
            raise ValueError(
                "model.decode_mlp='pallas' computes gated MLPs without biases (llama, qwen2), "
                f"and this model's is {self.mlp!r}{' with biases' if self.mlp_bias else ''}; "
                "use decode_mlp='same'."
            )
        for name in ("d_model", "d_ff"):
            if getattr(self, name) % MIN_MLP_BLOCK:
                raise ValueError(
                    f"model.decode_mlp='pallas' tiles the MLP in blocks of {MIN_MLP_BLOCK}, and "
                    f"model.{name}={getattr(self, name)} is no multiple of it; use "
                    "decode_mlp='same'."
                )

    def _check_pallas_projection_shape(self):
        """ValueError for output projections the Pallas projection kernel cannot tile."""
        widths = {
            "num_heads x head width": self.num_heads * self.resolved_head_dim,
            "d_ff": self.d_ff,
            "d_model": self.d_model,
        }
        for name, width in widths.items():
            if width % MIN_MLP_BLOCK:
                raise ValueError(
                    f"model.decode_projection='pallas' tiles the projections in blocks of "
                    f"{MIN_MLP_BLOCK}, and this model's {name} is {width}, no multiple of it; "
                    "use decode_projection='same'."
                )

    def _check_pallas_qkv_shape(self):
        """ValueError for an attention input the Pallas attention-input kernel does not
        compute: another norm, partial rotary, widths it cannot tile, a scanned decode."""
        if self.norm != "rms" or self.norm_bias:
            raise ValueError(
                "model.decode_qkv='pallas' folds an RMSNorm without a bias into the "
                f"projections, and this model's norm is {self.norm!r}"
                f"{' with a bias' if self.norm_bias else ''}; use decode_qkv='same'."
            )
        if self.position_embedding == "rope" and self.rotary_dim != self.resolved_head_dim:
            raise ValueError(
                "model.decode_qkv='pallas' rotates whole heads, and this model rotates "
                f"{self.rotary_dim} of {self.resolved_head_dim} dims; use decode_qkv='same'."
            )
        head_dim = self.resolved_head_dim
        if head_dim < QKV_MIN_HEAD or head_dim & (head_dim - 1) or self.d_model % MIN_MLP_BLOCK:
            raise ValueError(
                "model.decode_qkv='pallas' needs a head width that is a power of two of at "
                f"least {QKV_MIN_HEAD} (Triton's arrays) and d_model a multiple of "
                f"{MIN_MLP_BLOCK}, and this model's are {head_dim} and {self.d_model}; use "
                "decode_qkv='same'."
            )
        if self.scan_decode:
            raise ValueError(
                "model.decode_qkv='pallas' writes each layer's own cache, and "
                "model.scan_decode=True decodes a stacked one; use decode_qkv='same' or "
                "scan_decode=False."
            )

    def _check_execution(self):
        if self.remat not in REMAT_POLICIES:
            raise ValueError(
                f"model.remat={self.remat!r} is not one of {list(REMAT_POLICIES)} ('none': keep "
                "every activation; the others name jax.checkpoint_policies)."
            )
        if self.attention not in ATTENTIONS:
            raise ValueError(
                f"model.attention={self.attention!r} is not one of {list(ATTENTIONS)}."
            )
        xla = "('same': XLA's matmuls, as every other pass)"
        # what "same" means for each knob, and the shapes its Pallas kernel computes
        same_and_shape_check = {
            "decode_attention": ("('same': as model.attention)", self._check_pallas_decode_shape),
            "decode_mlp": (xla, self._check_pallas_mlp_shape),
            "decode_projection": (xla, self._check_pallas_projection_shape),
            "decode_qkv": (
                "('same': XLA's kernels, as every other pass)",
                self._check_pallas_qkv_shape,
            ),
        }
        for kernel in DECODE_KERNEL_KNOBS:
            value = getattr(self, kernel.knob)
            same, check_shape = same_and_shape_check[kernel.knob]
            if value not in kernel.choices:
                raise ValueError(
                    f"model.{kernel.knob}={value!r} is not one of {list(kernel.choices)} {same}."
                )
            if value == "pallas":
                check_shape()
            if getattr(self, kernel.settings_key):
                try:
                    kernel.parse(getattr(self, kernel.settings_key))
                except ValueError as error:
                    raise ValueError(f"model.{kernel.settings_key}: {error}") from None
        if self.attention == "cudnn" and self.dtype not in HALF_DTYPES:
            raise ValueError(
                "model.attention='cudnn' needs a half-precision compute dtype "
                f"{list(HALF_DTYPES)}, got model.dtype={self.dtype!r}; use "
                "attention='dot_product' for float32."
            )
        if self.scan_decode and not self.scan_layers:
            raise ValueError(
                "model.scan_decode=True scans the stacked blocks of model.scan_layers=True; "
                "set model.scan_layers=True too (or leave scan_decode off)."
            )
        if not isinstance(self.logprob_chunk, int) or self.logprob_chunk < 0:
            raise ValueError(
                f"model.logprob_chunk={self.logprob_chunk!r} must be an integer >= 0 (0: no "
                "chunking)."
            )

    @property
    def decode_kernel_settings(self) -> KernelSettings:
        """The Pallas decode kernel's settings (`decode_kernel`, parsed)."""
        return parse_kernel_settings(self.decode_kernel) if self.decode_kernel else KernelSettings()

    @property
    def decode_mlp_kernel_settings(self) -> MlpKernelSettings:
        """The Pallas MLP kernel's settings (`decode_mlp_kernel`, parsed)."""
        spec = self.decode_mlp_kernel
        return parse_mlp_kernel_settings(spec) if spec else MlpKernelSettings()

    @property
    def decode_projection_kernel_settings(self) -> ProjectionKernelSettings:
        """The Pallas projection kernel's settings (`decode_projection_kernel`, parsed)."""
        spec = self.decode_projection_kernel
        return parse_projection_kernel_settings(spec) if spec else ProjectionKernelSettings()

    @property
    def decode_qkv_kernel_settings(self) -> QkvKernelSettings:
        """The Pallas attention-input kernel's settings (`decode_qkv_kernel`, parsed)."""
        spec = self.decode_qkv_kernel
        return parse_qkv_kernel_settings(spec) if spec else QkvKernelSettings()

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head are rotated (transformers' int(hd * pct))."""
        return int(self.resolved_head_dim * self.rotary_pct)

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    @property
    def storage_dtype(self):
        return DTYPES[self.param_dtype]

    @property
    def has_lm_head(self) -> bool:
        """Whether a separate [d_model, vocab] output matrix exists (not tied, LM head)."""
        return self.head == "lm" and not self.tie_embeddings

    def num_params(self) -> int:
        """Parameter count from the shapes alone (no allocation)."""
        d, hd = self.d_model, self.resolved_head_dim
        norm = d * (2 if self.norm_bias else 1)
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        if self.attn_out_bias:
            attn += d
        up_matrices = 2 if self.mlp == "gated" else 1
        mlp = (up_matrices + 1) * d * self.d_ff
        if self.mlp_bias:
            mlp += up_matrices * self.d_ff + d
        embed = self.vocab_size * d
        if self.position_embedding == "learned":
            embed += self.max_seq_len * d
        if self.head == "score":
            head = d * self.num_labels
        else:
            head = self.vocab_size * d if self.has_lm_head else 0
        return self.num_layers * (attn + mlp + 2 * norm) + embed + head + norm

    def in_layout(self, stacked: bool) -> ModelConfig:
        """This config with `scan_layers=stacked` (and `scan_decode` only where stacked)."""
        return dataclasses.replace(
            self, scan_layers=stacked, scan_decode=self.scan_decode and stacked
        )

    def to_dict(self) -> dict[str, Any]:
        """The fields that say what the params are: what a run's checkpoints are matched
        against. `EXECUTION_FIELDS` and `scan_layers` are left out: they may change
        between a run's segments (each checkpoint records its params' layout, and a
        resume converts it; `tba_jax.runs.restore_in_layout`)."""
        fields = dataclasses.asdict(self)
        for name in (*EXECUTION_FIELDS, "scan_layers"):
            del fields[name]
        return fields


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
    # microsoft/rho-math-1b-v0.1 (TinyLlama/TinyLlama_v1.1 shape): 1,100,048,384 params.
    "rho-1b": dict(
        family="llama",
        vocab_size=32_000,
        d_model=2048,
        num_layers=22,
        num_heads=32,
        num_kv_heads=4,
        d_ff=5632,
        max_seq_len=2048,
        rope_theta=10_000.0,
        norm_eps=1e-5,
    ),
    # EleutherAI/pythia-410m (also -deduped): 405,334,016 params.
    "pythia-410m": dict(
        family="gpt_neox",
        vocab_size=50_304,
        d_model=1024,
        num_layers=24,
        num_heads=16,
        num_kv_heads=16,
        d_ff=4096,
        max_seq_len=2048,
    ),
    # EleutherAI/pythia-1b: 1,011,781,632 params.
    "pythia-1b": dict(
        family="gpt_neox",
        vocab_size=50_304,
        d_model=2048,
        num_layers=16,
        num_heads=8,
        num_kv_heads=8,
        d_ff=8192,
        max_seq_len=2048,
    ),
    # EleutherAI/pythia-2.8b: 2,775,208,960 params.
    "pythia-2.8b": dict(
        family="gpt_neox",
        vocab_size=50_304,
        d_model=2560,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        d_ff=10_240,
        max_seq_len=2048,
    ),
    # openai-community/gpt2: 124,439,808 params (tied head).
    "gpt2": dict(
        family="gpt2",
        vocab_size=50_257,
        d_model=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=12,
        d_ff=3072,
        max_seq_len=1024,
    ),
    # openai-community/gpt2-medium: 354,823,168 params (tied head).
    "gpt2-medium": dict(
        family="gpt2",
        vocab_size=50_257,
        d_model=1024,
        num_layers=24,
        num_heads=16,
        num_kv_heads=16,
        d_ff=4096,
        max_seq_len=1024,
    ),
    # meta-llama/Llama-3.2-1B: 1,235,814,400 params (tied head, llama3 rope scaling).
    "llama-3.2-1b": dict(
        family="llama",
        vocab_size=128_256,
        d_model=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        d_ff=8192,
        max_seq_len=131_072,
        rope_theta=500_000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
        rope_scaling="llama3",
        rope_scaling_factor=32.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_len=8192,
    ),
    # Qwen/Qwen2.5-0.5B: 494,032,768 params (qkv bias, tied head).
    "qwen2.5-0.5b": dict(
        family="qwen2",
        vocab_size=151_936,
        d_model=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        d_ff=4864,
        max_seq_len=32_768,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        tie_embeddings=True,
    ),
    # Qwen/Qwen2.5-1.5B: 1,543,714,304 params (qkv bias, tied head).
    "qwen2.5-1.5b": dict(
        family="qwen2",
        vocab_size=151_936,
        d_model=1536,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        d_ff=8960,
        max_seq_len=32_768,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        tie_embeddings=True,
    ),
}

# Published parameter counts of the presets that stand for public checkpoints.
PUBLISHED_NUM_PARAMS: dict[str, int] = {
    "llama-1b": 1_100_048_384,
    "rho-1b": 1_100_048_384,
    "pythia-410m": 405_334_016,
    "pythia-1b": 1_011_781_632,
    "pythia-2.8b": 2_775_208_960,
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "llama-3.2-1b": 1_235_814_400,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """Returns the named preset with `overrides` applied (e.g. vocab_size)."""
    if name not in PRESETS:
        raise ValueError(f"Unknown model preset {name!r}; choose one of {sorted(PRESETS)}.")
    fields = dict(PRESETS[name])
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return ModelConfig(**fields)
