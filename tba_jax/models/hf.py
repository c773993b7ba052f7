"""Hugging Face checkpoints: import, export and a transformers comparison CLI.

Import reads a transformers checkpoint directory (config.json plus one or
several `*.safetensors` files) with NumPy only, converts each tensor to this
package's layout and places it straight onto its target sharding, one tensor at
a time. Export writes a directory `transformers.AutoModelForCausalLM` (or
`AutoModelForSequenceClassification`) loads with no missing or unexpected keys.

Supported model types: llama, qwen2, gpt_neox, gpt2; causal-LM checkpoints and
`*ForSequenceClassification` ones (a `score` head, see `ModelConfig.head`).

    python -m tba_jax.models.hf compare --hf_path=DIR   # logits vs transformers
    python -m tba_jax.models.hf export --workdir=WORKDIR --out=DIR

torch and transformers are needed only by `compare`.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from tba_jax.models import Model, Params, abstract_model, positions_from_mask, sequence_scores
from tba_jax.models.config import DTYPES, FAMILIES, ModelConfig

CONFIG_FILENAME = "config.json"
SINGLE_WEIGHTS_FILENAME = "model.safetensors"
INDEX_FILENAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' default max_shard_size ("5GB")
SHOWN_NAMES = 5  # how many offending tensor names an error message lists

# Where the decoder body's tensors live in a *ForCausalLM / *ForSequenceClassification
# state dict (a bare base-model checkpoint, like the hub's gpt2, has no prefix).
BASE_PREFIX = {
    "llama": "model.",
    "qwen2": "model.",
    "gpt_neox": "gpt_neox.",
    "gpt2": "transformer.",
}
CAUSAL_LM_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}
SCORE_ARCHITECTURE = {
    "llama": "LlamaForSequenceClassification",
    "qwen2": "Qwen2ForSequenceClassification",
    "gpt_neox": "GPTNeoXForSequenceClassification",
    "gpt2": "GPT2ForSequenceClassification",
}
BASE_ARCHITECTURE = {
    "llama": "LlamaModel",
    "qwen2": "Qwen2Model",
    "gpt_neox": "GPTNeoXModel",
    "gpt2": "GPT2Model",
}
# Output-embedding names a checkpoint may use (transformers 5 renames GPT-NeoX's
# `embed_out` to `lm_head` in memory and back on save).
LM_HEAD_NAME = {
    "llama": "lm_head.weight",
    "qwen2": "lm_head.weight",
    "gpt_neox": "embed_out.weight",
    "gpt2": "lm_head.weight",
}
LM_HEAD_ALIASES = ("lm_head.weight", "embed_out.weight")
# Buffers some checkpoints carry that are not parameters (causal masks, rotary tables).
IGNORED_TENSORS = {
    "llama": (r"rotary_emb\.inv_freq$",),
    "qwen2": (r"rotary_emb\.inv_freq$",),
    "gpt_neox": (
        r"attention\.bias$",
        r"attention\.masked_bias$",
        r"rotary_emb\.inv_freq$",
    ),
    "gpt2": (r"\.attn\.bias$", r"\.attn\.masked_bias$", r"^attn\.bias$"),
}
HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_new",
    "gelu_pytorch_tanh": "gelu_new",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")

# Switch values a family's transformers implementation hard-codes.
FIXED_SWITCHES: dict[str, dict[str, Any]] = {
    "llama": dict(
        norm="rms",
        norm_bias=False,
        mlp="gated",
        activation="silu",
        parallel_residual=False,
        position_embedding="rope",
        rotary_pct=1.0,
    ),
    "qwen2": dict(
        norm="rms",
        norm_bias=False,
        mlp="gated",
        activation="silu",
        mlp_bias=False,
        qkv_bias=True,
        attn_out_bias=False,
        parallel_residual=False,
        position_embedding="rope",
        rotary_pct=1.0,
    ),
    "gpt_neox": dict(
        norm="layer", norm_bias=True, mlp="dense", mlp_bias=True, position_embedding="rope"
    ),
    "gpt2": dict(
        norm="layer",
        norm_bias=True,
        mlp="dense",
        mlp_bias=True,
        qkv_bias=True,
        attn_out_bias=True,
        parallel_residual=False,
        position_embedding="learned",
        rope_scaling=None,
    ),
}

Path = tuple  # keys into the params dict, e.g. ("blocks", 0, "attn", "wq")


# ----------------------------------------------------------------------------------------
# config.json <-> ModelConfig
# ----------------------------------------------------------------------------------------


def read_hf_config(hf_path: str) -> dict[str, Any]:
    """The parsed config.json of a checkpoint directory."""
    path = os.path.join(hf_path, CONFIG_FILENAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing: pass the directory a transformers `save_pretrained` wrote "
            "(config.json next to the *.safetensors weights)."
        )
    with open(path) as f:
        return json.load(f)


def _family_of(hf: dict[str, Any]) -> str:
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"model_type {model_type!r} (architectures {hf.get('architectures')}) is not "
            f"supported; tba_jax imports the model types {list(FAMILIES)}."
        )
    return model_type


def _head_of(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """head / num_labels from `architectures` (a missing list means a causal LM)."""
    known = {CAUSAL_LM_ARCHITECTURE[family], BASE_ARCHITECTURE[family], SCORE_ARCHITECTURE[family]}
    architectures = hf.get("architectures") or [CAUSAL_LM_ARCHITECTURE[family]]
    unknown = [name for name in architectures if name not in known]
    if unknown:
        raise ValueError(
            f"architectures {unknown} are not supported for model_type {family!r}; "
            f"tba_jax imports {sorted(known)}."
        )
    if SCORE_ARCHITECTURE[family] not in architectures:
        return dict(head="lm")
    num_labels = len(hf["id2label"]) if hf.get("id2label") else hf.get("num_labels", 2)
    return dict(head="score", num_labels=int(num_labels))


def _activation_of(hf_name: str) -> str:
    if hf_name not in HF_ACTIVATIONS:
        raise ValueError(
            f"Activation {hf_name!r} is not supported; tba_jax implements {sorted(HF_ACTIVATIONS)}."
        )
    return HF_ACTIVATIONS[hf_name]


def _rope_fields(hf: dict[str, Any], default_pct: float) -> dict[str, Any]:
    """ModelConfig rotary fields from either config.json layout.

    transformers >= 5 writes `rope_parameters` = {rope_type, rope_theta,
    partial_rotary_factor, factor, ...}; 4.x wrote `rope_theta` and `rope_scaling`
    (and GPT-NeoX `rotary_emb_base` and `rotary_pct`). A `rope_scaling` dict wins
    over `rope_parameters`, as in transformers.
    """
    params = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    theta = params.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10_000.0)))
    pct = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    pct = hf.get("rotary_pct", default_pct) if pct is None else pct
    fields: dict[str, Any] = dict(rope_theta=float(theta), rotary_pct=float(pct))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; tba_jax implements {SUPPORTED_ROPE_TYPES}."
        )
    if rope_type == "llama3":
        fields.update(
            rope_scaling="llama3",
            rope_scaling_factor=float(params["factor"]),
            rope_low_freq_factor=float(params["low_freq_factor"]),
            rope_high_freq_factor=float(params["high_freq_factor"]),
            rope_original_max_len=int(
                params.get("original_max_position_embeddings", hf["max_position_embeddings"])
            ),
        )
    return fields


def _explicit_head_dim(hf: dict[str, Any]) -> int | None:
    """config.json's head_dim, or None when it is the default hidden_size / heads."""
    head_dim = hf.get("head_dim")
    if head_dim is None or head_dim * hf["num_attention_heads"] == hf["hidden_size"]:
        return None
    return head_dim


def _llama_like_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    if hf.get("use_sliding_window"):
        raise ValueError(
            "use_sliding_window=True is not supported (tba_jax attends to the full context)."
        )
    heads = hf["num_attention_heads"]
    fields = dict(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        d_ff=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"],
        head_dim=_explicit_head_dim(hf),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        activation=_activation_of(hf.get("hidden_act", "silu")),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        **_rope_fields(hf, default_pct=1.0),
    )
    if family == "llama":
        bias = hf.get("attention_bias", False)
        fields.update(qkv_bias=bias, attn_out_bias=bias, mlp_bias=hf.get("mlp_bias", False))
    return fields


def _gpt_neox_fields(hf: dict[str, Any]) -> dict[str, Any]:
    heads = hf["num_attention_heads"]
    bias = hf.get("attention_bias", True)
    return dict(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        d_ff=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"],
        norm_eps=hf.get("layer_norm_eps", 1e-5),
        activation=_activation_of(hf.get("hidden_act", "gelu")),
        parallel_residual=hf.get("use_parallel_residual", True),
        qkv_bias=bias,
        attn_out_bias=bias,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        **_rope_fields(hf, default_pct=0.25),
    )


def _gpt2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if hf.get(flag):
            raise ValueError(f"GPT-2 with {flag}=True is not supported by tba_jax.")
    if not hf.get("scale_attn_weights", True):
        raise ValueError("GPT-2 with scale_attn_weights=False is not supported by tba_jax.")
    heads, d = hf["n_head"], hf["n_embd"]
    return dict(
        vocab_size=hf["vocab_size"],
        d_model=d,
        num_layers=hf["n_layer"],
        num_heads=heads,
        num_kv_heads=heads,
        d_ff=hf.get("n_inner") or 4 * d,
        max_seq_len=hf["n_positions"],
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=_activation_of(hf.get("activation_function", "gelu_new")),
        tie_embeddings=hf.get("tie_word_embeddings", True),
    )


def config_from_hf_dict(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """A ModelConfig from a parsed transformers config.json (float32 unless overridden)."""
    family = _family_of(hf)
    if family == "gpt2":
        fields = _gpt2_fields(hf)
    elif family == "gpt_neox":
        fields = _gpt_neox_fields(hf)
    else:
        fields = _llama_like_fields(hf, family)
    fields.update(family=family, **_head_of(hf, family))
    fields.update(overrides)
    return ModelConfig(**fields)


def config_from_hf(hf_path: str, **overrides: Any) -> ModelConfig:
    """The ModelConfig of the checkpoint in `hf_path` (its config.json).

    Params and compute are float32 unless `overrides` say otherwise (e.g.
    `param_dtype="bfloat16"`).
    """
    return config_from_hf_dict(read_hf_config(hf_path), **overrides)


def unrepresentable_switches(cfg: ModelConfig) -> list[str]:
    """Ways `cfg` differs from what its family's transformers class can express."""
    problems = [
        f"{name}={getattr(cfg, name)!r} (the {cfg.family} format needs {value!r})"
        for name, value in FIXED_SWITCHES[cfg.family].items()
        if getattr(cfg, name) != value
    ]
    if cfg.family in ("llama", "gpt_neox") and cfg.qkv_bias != cfg.attn_out_bias:
        problems.append(
            f"qkv_bias={cfg.qkv_bias} != attn_out_bias={cfg.attn_out_bias} (one attention_bias "
            f"switch in {cfg.family})"
        )
    if cfg.family in ("gpt_neox", "gpt2"):
        if cfg.num_kv_heads != cfg.num_heads:
            problems.append(f"num_kv_heads={cfg.num_kv_heads} != num_heads={cfg.num_heads}")
        if cfg.resolved_head_dim * cfg.num_heads != cfg.d_model:
            problems.append(f"head_dim={cfg.head_dim} != d_model / num_heads")
    return problems


def _check_representable(cfg: ModelConfig) -> None:
    problems = unrepresentable_switches(cfg)
    if problems:
        raise ValueError(
            f"This {cfg.family} config cannot be written as a transformers {cfg.family} "
            f"checkpoint: {'; '.join(problems)}. Change model.family or those fields."
        )


def _hf_rope(cfg: ModelConfig) -> dict[str, Any]:
    """Rotary settings in both the transformers 5 and the 4.x layouts."""
    scaling = None
    if cfg.rope_scaling == "llama3":
        scaling = dict(
            rope_type="llama3",
            factor=cfg.rope_scaling_factor,
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_len,
        )
    parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(scaling or {})}
    if cfg.rotary_pct != 1.0:
        parameters["partial_rotary_factor"] = cfg.rotary_pct
    fields = dict(rope_parameters=parameters, rope_theta=cfg.rope_theta, rope_scaling=scaling)
    if cfg.family == "gpt_neox":
        fields.update(rotary_pct=cfg.rotary_pct, rotary_emb_base=cfg.rope_theta)
    return fields


def config_to_hf(cfg: ModelConfig, dtype: str | None = None) -> dict[str, Any]:
    """The transformers config.json for `cfg` (with `architectures`)."""
    _check_representable(cfg)
    if cfg.family == "gpt2":
        hf = dict(
            n_embd=cfg.d_model,
            n_layer=cfg.num_layers,
            n_head=cfg.num_heads,
            n_inner=cfg.d_ff,
            n_positions=cfg.max_seq_len,
            layer_norm_epsilon=cfg.norm_eps,
            activation_function=cfg.activation,
        )
    else:
        hf = dict(
            hidden_size=cfg.d_model,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            intermediate_size=cfg.d_ff,
            max_position_embeddings=cfg.max_seq_len,
            hidden_act=cfg.activation,
            **_hf_rope(cfg),
        )
    if cfg.family in ("llama", "qwen2"):
        hf.update(
            num_key_value_heads=cfg.num_kv_heads,
            head_dim=cfg.resolved_head_dim,
            rms_norm_eps=cfg.norm_eps,
        )
    if cfg.family == "llama":
        hf.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    if cfg.family == "qwen2":
        hf.update(use_sliding_window=False)
    if cfg.family == "gpt_neox":
        hf.update(
            layer_norm_eps=cfg.norm_eps,
            use_parallel_residual=cfg.parallel_residual,
            attention_bias=cfg.qkv_bias,
        )
    if cfg.head == "score":
        hf.update(
            id2label={str(i): f"LABEL_{i}" for i in range(cfg.num_labels)},
            label2id={f"LABEL_{i}": i for i in range(cfg.num_labels)},
        )
    architecture = (SCORE_ARCHITECTURE if cfg.head == "score" else CAUSAL_LM_ARCHITECTURE)[
        cfg.family
    ]
    dtype = dtype or cfg.param_dtype
    return dict(
        architectures=[architecture],
        model_type=cfg.family,
        vocab_size=cfg.vocab_size,
        tie_word_embeddings=bool(cfg.tie_embeddings),
        dtype=dtype,
        torch_dtype=dtype,
        **hf,
    )


# ----------------------------------------------------------------------------------------
# Tensor layout: one rule per checkpoint tensor, both directions.
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """How one checkpoint tensor maps onto our params.

    `to_ours(hf_array)` returns one array per path in `paths`; `to_hf(*arrays)`
    (arrays in `paths` order) rebuilds the checkpoint tensor of shape `hf_shape`.
    """

    hf_shape: tuple[int, ...]
    paths: tuple[Path, ...]
    to_ours: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    to_hf: Callable[..., np.ndarray]


def _copy_rule(path: Path, shape: tuple[int, ...]) -> TensorRule:
    return TensorRule(tuple(shape), (path,), lambda w: (w,), lambda w: w)


def _vector_rule(path: Path, shape: tuple[int, ...]) -> TensorRule:
    """A flat bias [prod(shape)] <-> ours [*shape]."""
    return TensorRule(
        (math.prod(shape),), (path,), lambda b: (b.reshape(shape),), lambda b: b.reshape(-1)
    )


def _linear_rule(path: Path, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> TensorRule:
    """A torch nn.Linear weight [out, in] <-> ours [*in_shape, *out_shape]."""
    n_in, n_out = math.prod(in_shape), math.prod(out_shape)
    return TensorRule(
        (n_out, n_in),
        (path,),
        lambda w: (w.T.reshape(*in_shape, *out_shape),),
        lambda w: w.reshape(n_in, n_out).T,
    )


def _conv1d_rule(path: Path, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> TensorRule:
    """A GPT-2 Conv1D weight, stored [in, out] <-> ours [*in_shape, *out_shape]."""
    n_in, n_out = math.prod(in_shape), math.prod(out_shape)
    return TensorRule(
        (n_in, n_out),
        (path,),
        lambda w: (w.reshape(*in_shape, *out_shape),),
        lambda w: w.reshape(n_in, n_out),
    )


def _neox_qkv_weight_rule(prefix: Path, cfg: ModelConfig) -> TensorRule:
    """GPT-NeoX's fused query_key_value Linear weight [3 * H * hd, d].

    Its output rows are grouped per head, [H, (q | k | v), hd]; ours are
    wq, wk, wv of shape [d, H, hd].
    """
    d, h, hd = cfg.d_model, cfg.num_heads, cfg.resolved_head_dim

    def to_ours(w):
        per_head = w.reshape(h, 3, hd, d)
        return tuple(per_head[:, part].transpose(2, 0, 1) for part in range(3))

    def to_hf(wq, wk, wv):
        return np.stack([wq, wk, wv]).transpose(2, 0, 3, 1).reshape(3 * h * hd, d)

    paths = tuple((*prefix, name) for name in ("wq", "wk", "wv"))
    return TensorRule((3 * h * hd, d), paths, to_ours, to_hf)


def _neox_qkv_bias_rule(prefix: Path, cfg: ModelConfig) -> TensorRule:
    """GPT-NeoX's fused bias [3 * H * hd], grouped per head like the weight."""
    h, hd = cfg.num_heads, cfg.resolved_head_dim

    def to_ours(b):
        per_head = b.reshape(h, 3, hd)
        return tuple(per_head[:, part] for part in range(3))

    def to_hf(bq, bk, bv):
        return np.stack([bq, bk, bv], axis=1).reshape(-1)

    paths = tuple((*prefix, name) for name in ("bq", "bk", "bv"))
    return TensorRule((3 * h * hd,), paths, to_ours, to_hf)


def _gpt2_qkv_weight_rule(prefix: Path, cfg: ModelConfig) -> TensorRule:
    """GPT-2's c_attn Conv1D weight [d, 3d]: columns are [q | k | v], each [H, hd]."""
    d, h, hd = cfg.d_model, cfg.num_heads, cfg.resolved_head_dim

    def to_ours(w):
        parts = w.reshape(d, 3, h, hd)
        return tuple(parts[:, part] for part in range(3))

    def to_hf(wq, wk, wv):
        return np.stack([wq, wk, wv], axis=1).reshape(d, 3 * h * hd)

    paths = tuple((*prefix, name) for name in ("wq", "wk", "wv"))
    return TensorRule((d, 3 * h * hd), paths, to_ours, to_hf)


def _gpt2_qkv_bias_rule(prefix: Path, cfg: ModelConfig) -> TensorRule:
    """GPT-2's c_attn bias [3d] = [q | k | v]."""
    h, hd = cfg.num_heads, cfg.resolved_head_dim

    def to_ours(b):
        parts = b.reshape(3, h, hd)
        return tuple(parts[part] for part in range(3))

    def to_hf(bq, bk, bv):
        return np.stack([bq, bk, bv]).reshape(-1)

    paths = tuple((*prefix, name) for name in ("bq", "bk", "bv"))
    return TensorRule((3 * h * hd,), paths, to_ours, to_hf)


def _norm_rules(hf_name: str, path: Path, cfg: ModelConfig) -> dict[str, TensorRule]:
    rules = {f"{hf_name}.weight": _copy_rule((*path, "scale"), (cfg.d_model,))}
    if cfg.norm_bias:
        rules[f"{hf_name}.bias"] = _copy_rule((*path, "bias"), (cfg.d_model,))
    return rules


def _llama_block_rules(i: int, cfg: ModelConfig) -> dict[str, TensorRule]:
    d, h, kv, hd, ff = (
        cfg.d_model,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.resolved_head_dim,
        cfg.d_ff,
    )
    name, attn, mlp = f"layers.{i}", ("blocks", i, "attn"), ("blocks", i, "mlp")
    rules = {
        **_norm_rules(f"{name}.input_layernorm", ("blocks", i, "attn_norm"), cfg),
        **_norm_rules(f"{name}.post_attention_layernorm", ("blocks", i, "mlp_norm"), cfg),
        f"{name}.self_attn.q_proj.weight": _linear_rule((*attn, "wq"), (d,), (h, hd)),
        f"{name}.self_attn.k_proj.weight": _linear_rule((*attn, "wk"), (d,), (kv, hd)),
        f"{name}.self_attn.v_proj.weight": _linear_rule((*attn, "wv"), (d,), (kv, hd)),
        f"{name}.self_attn.o_proj.weight": _linear_rule((*attn, "wo"), (h, hd), (d,)),
        f"{name}.mlp.gate_proj.weight": _linear_rule((*mlp, "w_gate"), (d,), (ff,)),
        f"{name}.mlp.up_proj.weight": _linear_rule((*mlp, "w_up"), (d,), (ff,)),
        f"{name}.mlp.down_proj.weight": _linear_rule((*mlp, "w_down"), (ff,), (d,)),
    }
    if cfg.qkv_bias:
        rules[f"{name}.self_attn.q_proj.bias"] = _vector_rule((*attn, "bq"), (h, hd))
        rules[f"{name}.self_attn.k_proj.bias"] = _vector_rule((*attn, "bk"), (kv, hd))
        rules[f"{name}.self_attn.v_proj.bias"] = _vector_rule((*attn, "bv"), (kv, hd))
    if cfg.attn_out_bias:
        rules[f"{name}.self_attn.o_proj.bias"] = _copy_rule((*attn, "bo"), (d,))
    if cfg.mlp_bias:
        rules[f"{name}.mlp.gate_proj.bias"] = _copy_rule((*mlp, "b_gate"), (ff,))
        rules[f"{name}.mlp.up_proj.bias"] = _copy_rule((*mlp, "b_up"), (ff,))
        rules[f"{name}.mlp.down_proj.bias"] = _copy_rule((*mlp, "b_down"), (d,))
    return rules


def _neox_block_rules(i: int, cfg: ModelConfig) -> dict[str, TensorRule]:
    d, h, hd, ff = cfg.d_model, cfg.num_heads, cfg.resolved_head_dim, cfg.d_ff
    name, attn, mlp = f"layers.{i}", ("blocks", i, "attn"), ("blocks", i, "mlp")
    rules = {
        **_norm_rules(f"{name}.input_layernorm", ("blocks", i, "attn_norm"), cfg),
        **_norm_rules(f"{name}.post_attention_layernorm", ("blocks", i, "mlp_norm"), cfg),
        f"{name}.attention.query_key_value.weight": _neox_qkv_weight_rule(attn, cfg),
        f"{name}.attention.dense.weight": _linear_rule((*attn, "wo"), (h, hd), (d,)),
        f"{name}.mlp.dense_h_to_4h.weight": _linear_rule((*mlp, "w_up"), (d,), (ff,)),
        f"{name}.mlp.dense_h_to_4h.bias": _copy_rule((*mlp, "b_up"), (ff,)),
        f"{name}.mlp.dense_4h_to_h.weight": _linear_rule((*mlp, "w_down"), (ff,), (d,)),
        f"{name}.mlp.dense_4h_to_h.bias": _copy_rule((*mlp, "b_down"), (d,)),
    }
    if cfg.qkv_bias:
        rules[f"{name}.attention.query_key_value.bias"] = _neox_qkv_bias_rule(attn, cfg)
        rules[f"{name}.attention.dense.bias"] = _copy_rule((*attn, "bo"), (d,))
    return rules


def _gpt2_block_rules(i: int, cfg: ModelConfig) -> dict[str, TensorRule]:
    d, h, hd, ff = cfg.d_model, cfg.num_heads, cfg.resolved_head_dim, cfg.d_ff
    name, attn, mlp = f"h.{i}", ("blocks", i, "attn"), ("blocks", i, "mlp")
    return {
        **_norm_rules(f"{name}.ln_1", ("blocks", i, "attn_norm"), cfg),
        **_norm_rules(f"{name}.ln_2", ("blocks", i, "mlp_norm"), cfg),
        f"{name}.attn.c_attn.weight": _gpt2_qkv_weight_rule(attn, cfg),
        f"{name}.attn.c_attn.bias": _gpt2_qkv_bias_rule(attn, cfg),
        f"{name}.attn.c_proj.weight": _conv1d_rule((*attn, "wo"), (h, hd), (d,)),
        f"{name}.attn.c_proj.bias": _copy_rule((*attn, "bo"), (d,)),
        f"{name}.mlp.c_fc.weight": _conv1d_rule((*mlp, "w_up"), (d,), (ff,)),
        f"{name}.mlp.c_fc.bias": _copy_rule((*mlp, "b_up"), (ff,)),
        f"{name}.mlp.c_proj.weight": _conv1d_rule((*mlp, "w_down"), (ff,), (d,)),
        f"{name}.mlp.c_proj.bias": _copy_rule((*mlp, "b_down"), (d,)),
    }


def _body_rules(cfg: ModelConfig) -> dict[str, TensorRule]:
    """Rules of the base model's tensors, named without the base-model prefix."""
    embedding = _copy_rule(("embedding",), (cfg.vocab_size, cfg.d_model))
    if cfg.family == "gpt2":
        rules = {
            "wte.weight": embedding,
            "wpe.weight": _copy_rule(("position_embedding",), (cfg.max_seq_len, cfg.d_model)),
            **_norm_rules("ln_f", ("final_norm",), cfg),
        }
        block_rules = _gpt2_block_rules
    elif cfg.family == "gpt_neox":
        rules = {
            "embed_in.weight": embedding,
            **_norm_rules("final_layer_norm", ("final_norm",), cfg),
        }
        block_rules = _neox_block_rules
    else:
        rules = {"embed_tokens.weight": embedding, **_norm_rules("norm", ("final_norm",), cfg)}
        block_rules = _llama_block_rules
    for i in range(cfg.num_layers):
        rules.update(block_rules(i, cfg))
    return rules


def weight_layout(cfg: ModelConfig) -> dict[str, TensorRule]:
    """Every tensor of the transformers checkpoint for `cfg`, by its state-dict name."""
    _check_representable(cfg)
    prefix = BASE_PREFIX[cfg.family]
    layout = {prefix + name: rule for name, rule in _body_rules(cfg).items()}
    if cfg.head == "score":
        layout["score.weight"] = _linear_rule(("score",), (cfg.d_model,), (cfg.num_labels,))
    elif cfg.has_lm_head:
        layout[LM_HEAD_NAME[cfg.family]] = _linear_rule(
            ("lm_head",), (cfg.d_model,), (cfg.vocab_size,)
        )
    return layout


# ----------------------------------------------------------------------------------------
# Import
# ----------------------------------------------------------------------------------------


def checkpoint_files(hf_path: str) -> list[str]:
    """The safetensors files of a checkpoint: from the shard index, or the single file."""
    index_path = os.path.join(hf_path, INDEX_FILENAME)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(hf_path, name) for name in names]
        missing = [path for path in files if not os.path.isfile(path)]
        if missing:
            raise FileNotFoundError(
                f"{index_path} lists shards that are missing: {missing[:SHOWN_NAMES]}; "
                "copy the whole checkpoint directory."
            )
        return files
    single = os.path.join(hf_path, SINGLE_WEIGHTS_FILENAME)
    if os.path.isfile(single):
        return [single]
    found = sorted(glob.glob(os.path.join(hf_path, "*.safetensors")))
    if found:
        return found
    others = sorted(os.path.basename(p) for p in glob.glob(os.path.join(hf_path, "*.bin")))
    raise FileNotFoundError(
        f"No *.safetensors weights in {hf_path} (other weight files: {others or 'none'}). "
        "Re-save the model with transformers' `save_pretrained` (safetensors is its default)."
    )


def _is_ignored(name: str, cfg: ModelConfig) -> bool:
    if any(re.search(pattern, name) for pattern in IGNORED_TENSORS[cfg.family]):
        return True
    # A tied checkpoint may still store the output embedding (a copy of the input one).
    return cfg.head == "lm" and cfg.tie_embeddings and name in LM_HEAD_ALIASES


def _canonical_name(name: str, cfg: ModelConfig, layout: dict[str, TensorRule]) -> str:
    """The layout name of a stored tensor: adds a missing base-model prefix, maps aliases."""
    if name in layout:
        return name
    if BASE_PREFIX[cfg.family] + name in layout:
        return BASE_PREFIX[cfg.family] + name
    if name in LM_HEAD_ALIASES and LM_HEAD_NAME[cfg.family] in layout:
        return LM_HEAD_NAME[cfg.family]
    return name


class StoredTensor(NamedTuple):
    file: str
    shape: tuple[int, ...]


def _stored_tensors(files: Iterable[str]) -> dict[str, StoredTensor]:
    """Stored tensor name -> its file and shape (reads the headers only)."""
    stored: dict[str, StoredTensor] = {}
    for path in files:
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                stored[name] = StoredTensor(path, tuple(f.get_slice(name).get_shape()))
    return stored


def _check_stored_shapes(
    stored: dict[str, StoredTensor], matched: dict[str, str], layout: dict[str, TensorRule]
) -> None:
    for stored_name, name in matched.items():
        tensor = stored[stored_name]
        if tensor.shape != layout[name].hf_shape:
            raise ValueError(
                f"Tensor {stored_name!r} in {tensor.file} has shape {tensor.shape}, but "
                f"config.json implies {layout[name].hf_shape}; the weights and config.json "
                "disagree (a different model's config?)."
            )


def _match_names(
    stored: Iterable[str], cfg: ModelConfig, layout: dict[str, TensorRule], hf_path: str
) -> dict[str, str]:
    """Stored name -> layout name for every tensor to load; raises on unknown or missing ones."""
    matched, unexpected = {}, []
    for name in sorted(stored):
        if _is_ignored(name, cfg):
            continue
        canonical = _canonical_name(name, cfg, layout)
        if canonical in layout:
            matched[name] = canonical
        else:
            unexpected.append(name)
    missing = sorted(set(layout) - set(matched.values()))
    if unexpected or missing:
        raise ValueError(
            f"The checkpoint in {hf_path} does not match its {cfg.family} config "
            f"(head={cfg.head!r}, tie_embeddings={cfg.tie_embeddings}): "
            f"{len(missing)} missing tensors {missing[:SHOWN_NAMES]}, "
            f"{len(unexpected)} unexpected tensors {unexpected[:SHOWN_NAMES]}. "
            "Check config.json against the weights (a different model's checkpoint?)."
        )
    return matched


def _get(tree: Any, path: Path) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: Path, value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _flat_shapes(abstract: Params) -> dict[Path, tuple[int, ...]]:
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    return {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}


def load_params(hf_path: str, model: Model, *, shardings: Any = None, dtype: Any = None) -> Params:
    """Reads the checkpoint in `hf_path` into params for `model`.

    Each tensor is read (NumPy, no torch), converted to this package's layout and
    dtype (`dtype`, default the model's param_dtype) and placed with
    `jax.device_put` onto its entry of `shardings` (a pytree like the params; None:
    the default device), one tensor at a time. Raises if a tensor is missing,
    unexpected or of the wrong shape.
    """
    cfg = model.config
    target = np.dtype(cfg.storage_dtype if dtype is None else _jnp_dtype(dtype))
    layout = weight_layout(cfg)
    files = checkpoint_files(hf_path)
    stored = _stored_tensors(files)
    matched = _match_names(stored, cfg, layout, hf_path)
    _check_stored_shapes(stored, matched, layout)  # every check before any data is read
    params: Params = {}
    for file in files:
        with safe_open(file, framework="numpy") as f:
            for stored_name, name in matched.items():
                if stored[stored_name].file != file:
                    continue
                rule = layout[name]
                values = rule.to_ours(f.get_tensor(stored_name))
                for path, value in zip(rule.paths, values, strict=True):
                    sharding = None if shardings is None else _get(shardings, path)
                    _set(params, path, jax.device_put(np.asarray(value, target), sharding))
    return params


def load_model(
    hf_path: str,
    *,
    dtype: Any = None,
    shardings_fn: Callable[[Model, Params], Any] | None = None,
) -> tuple[Model, Params]:
    """The model and params of the checkpoint in `hf_path`.

    `dtype` (e.g. "bfloat16") sets both param and compute dtypes (default
    float32). `shardings_fn(model, abstract_params)` returns the params'
    shardings (e.g. from `tba_jax.mesh.param_shardings`); None: default device.
    """
    overrides = {}
    if dtype is not None:
        name = _dtype_name(dtype)
        overrides = dict(dtype=name, param_dtype=name)
    cfg = config_from_hf(hf_path, **overrides)
    model, abstract = abstract_model(cfg)
    shardings = None if shardings_fn is None else shardings_fn(model, abstract)
    return model, load_params(hf_path, model, shardings=shardings)


def _jnp_dtype(dtype: Any):
    return DTYPES[dtype] if isinstance(dtype, str) else dtype


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {list(DTYPES)}.")
        return dtype
    for name, value in DTYPES.items():
        if np.dtype(value) == np.dtype(dtype):
            return name
    raise ValueError(f"dtype {dtype!r} is not one of {list(DTYPES)}.")


# ----------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------


def _plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Groups tensor names, in order, into shards of at most max_shard_bytes (a tensor
    larger than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _check_param_shapes(cfg: ModelConfig, params: Params) -> None:
    expected = _flat_shapes(abstract_model(cfg)[1])
    actual = _flat_shapes(params)
    if expected.keys() != actual.keys():
        extra, absent = (
            sorted(actual.keys() - expected.keys()),
            sorted(expected.keys() - actual.keys()),
        )
        raise ValueError(
            f"params do not match the model config: missing {absent[:SHOWN_NAMES]}, "
            f"unexpected {extra[:SHOWN_NAMES]}; pass the config the params were made with."
        )
    wrong = [
        (path, actual[path], shape) for path, shape in expected.items() if actual[path] != shape
    ]
    if wrong:
        raise ValueError(
            "params do not match the model config: (path, shape, expected) "
            f"{wrong[:SHOWN_NAMES]}; pass the config the params were made with."
        )


def save_hf(
    out_dir: str,
    model_cfg: ModelConfig,
    params: Params,
    *,
    dtype: Any = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    hf_config_overrides: dict[str, Any] | None = None,
) -> list[str]:
    """Writes `params` as a transformers checkpoint: config.json plus model.safetensors,
    or `model-0000k-of-0000n.safetensors` shards and their index when the weights
    exceed `max_shard_bytes`. `dtype` (default the config's param_dtype) is the stored
    dtype; `hf_config_overrides` adds config.json keys (e.g. eos_token_id,
    pad_token_id). Host memory holds one shard at a time. Returns the files written.
    """
    _check_param_shapes(model_cfg, params)
    name = _dtype_name(model_cfg.param_dtype if dtype is None else dtype)
    target = np.dtype(DTYPES[name])
    layout = weight_layout(model_cfg)
    sizes = {key: math.prod(rule.hf_shape) * target.itemsize for key, rule in layout.items()}
    shards = _plan_shards(sizes, max_shard_bytes)
    os.makedirs(out_dir, exist_ok=True)
    filenames = (
        [SINGLE_WEIGHTS_FILENAME]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    for filename, shard in zip(filenames, shards, strict=True):
        tensors = {}
        for key in shard:
            rule = layout[key]
            ours = [np.asarray(jax.device_get(_get(params, path))) for path in rule.paths]
            tensors[key] = np.ascontiguousarray(rule.to_hf(*ours).astype(target))
        save_file(tensors, os.path.join(out_dir, filename), metadata={"format": "pt"})
    written = [os.path.join(out_dir, filename) for filename in filenames]
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(sizes.values())},
            "weight_map": {
                key: filename
                for filename, shard in zip(filenames, shards, strict=True)
                for key in shard
            },
        }
        written.append(_write_json(os.path.join(out_dir, INDEX_FILENAME), index))
    hf_config = {**config_to_hf(model_cfg, dtype=name), **(hf_config_overrides or {})}
    written.append(_write_json(os.path.join(out_dir, CONFIG_FILENAME), hf_config))
    return written


def _write_json(path: str, value: Any) -> str:
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
    return path


# ----------------------------------------------------------------------------------------
# CLI: compare with transformers, export a training run.
# ----------------------------------------------------------------------------------------

COMPARE_PAD_ID = 0  # real tokens are drawn from 1..vocab-1


def left_padded_batch(
    vocab_size: int, batch: int, seq_len: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Random tokens, row r right-aligned with length from seq_len down to about seq_len/3.

    Returns tokens [B, S] int32 (COMPARE_PAD_ID on padding) and mask [B, S] bool.
    """
    rng = np.random.default_rng(seed)
    lengths = np.linspace(seq_len, max(1, seq_len // 3), batch).round().astype(int)
    mask = np.arange(seq_len)[None, :] >= seq_len - lengths[:, None]
    tokens = rng.integers(COMPARE_PAD_ID + 1, vocab_size, size=(batch, seq_len))
    return np.where(mask, tokens, COMPARE_PAD_ID).astype(np.int32), mask


def hf_position_ids(mask: np.ndarray) -> np.ndarray:
    """Positions transformers' generate uses for a padded batch (real tokens before a slot)."""
    return np.asarray(positions_from_mask(mask))


def load_torch_model(hf_path: str, head: str):
    """The checkpoint in transformers (PyTorch, CPU, float32, eval mode, eager attention)."""
    import torch
    import transformers

    auto = (
        transformers.AutoModelForSequenceClassification
        if head == "score"
        else transformers.AutoModelForCausalLM
    )
    model = auto.from_pretrained(hf_path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def torch_outputs(torch_model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Logits [B, S, V] (causal LM) or pooled scores [B, num_labels] (classifier)."""
    import torch

    with torch.no_grad():
        out = torch_model(
            input_ids=torch.from_numpy(np.asarray(tokens, np.int64)),
            attention_mask=torch.from_numpy(np.asarray(mask, np.int64)),
            position_ids=torch.from_numpy(np.asarray(hf_position_ids(mask), np.int64)),
        )
    return out.logits.float().numpy()


def compare(hf_path: str, *, batch: int = 3, seq_len: int = 16, seed: int = 0) -> dict[str, Any]:
    """Runs one left-padded batch through transformers and tba_jax; returns the max
    |difference| of the logits (scores for a classifier) over real positions."""
    model, params = load_model(hf_path)
    cfg = model.config
    seq_len = min(seq_len, cfg.max_seq_len)
    tokens, mask = left_padded_batch(cfg.vocab_size, batch, seq_len, seed)
    torch_model = load_torch_model(hf_path, cfg.head)
    if cfg.head == "score":
        torch_model.config.pad_token_id = COMPARE_PAD_ID  # finds each row's last real token
        ours = np.asarray(sequence_scores(model, params, tokens, mask))
        diff = np.abs(ours - torch_outputs(torch_model, tokens, mask))
    else:
        logits, _ = jax.jit(model.apply)(params, tokens, positions_from_mask(mask), mask)
        diff = np.abs(np.asarray(logits) - torch_outputs(torch_model, tokens, mask))[mask]
    return dict(
        family=cfg.family,
        head=cfg.head,
        hf_path=hf_path,
        num_params=cfg.num_params(),
        batch=batch,
        seq_len=seq_len,
        max_abs_logit_diff=float(diff.max()),
    )


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
)
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _token_ids_of(hf_path: str) -> dict[str, Any]:
    """The special-token ids in `hf_path`'s config.json (those that are set)."""
    with open(os.path.join(hf_path, CONFIG_FILENAME)) as f:
        source_config = json.load(f)
    return {key: source_config[key] for key in TOKEN_ID_KEYS if source_config.get(key) is not None}


def copy_tokenizer_files(hf_path: str, out: str) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        source = os.path.join(hf_path, name)
        if os.path.exists(source):
            copied.append(shutil.copy(source, os.path.join(out, name)))
    return copied


def export_run(
    workdir: str,
    out: str,
    *,
    dtype: str | None = None,
    step: int | None = None,
    hf_config_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Writes the latest (or `step`'s) policy of the training run in `workdir` to `out`.

    A run started from a Hugging Face folder (`model.hf_path`) also gets that folder's
    tokenizer files and its token ids in config.json, so the export is usable as is.
    """
    from tba_jax.runs import load_config, load_trained_policy  # only when exporting

    model_cfg, params = load_trained_policy(workdir, step)
    source = load_config(workdir).model.hf_path
    overrides = {**(_token_ids_of(source) if source else {}), **(hf_config_overrides or {})}
    files = save_hf(out, model_cfg, params, dtype=dtype, hf_config_overrides=overrides)
    if source:
        files += copy_tokenizer_files(source, out)
    return dict(
        workdir=workdir,
        out=out,
        family=model_cfg.family,
        num_params=model_cfg.num_params(),
        files=[os.path.basename(path) for path in files],
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tba_jax.models.hf", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    cmp = commands.add_parser("compare", help="logits of tba_jax vs transformers on one batch")
    cmp.add_argument("--hf_path", required=True, help="checkpoint directory")
    cmp.add_argument("--batch", type=int, default=3)
    cmp.add_argument("--seq_len", type=int, default=16)
    cmp.add_argument("--seed", type=int, default=0)
    export = commands.add_parser("export", help="write a training run's policy for transformers")
    export.add_argument("--workdir", required=True, help="the training run's --workdir")
    export.add_argument("--out", required=True, help="output directory")
    export.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    export.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
    export.add_argument(
        "--hf_config_overrides",
        type=json.loads,
        default=None,
        help="JSON object of extra config.json keys, e.g. '{\"eos_token_id\": 2}'",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "compare":
        result = compare(args.hf_path, batch=args.batch, seq_len=args.seq_len, seed=args.seed)
    else:
        result = export_run(
            args.workdir,
            args.out,
            dtype=args.dtype,
            step=args.step,
            hf_config_overrides=args.hf_config_overrides,
        )
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
