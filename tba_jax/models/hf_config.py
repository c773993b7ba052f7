"""config.json <-> ModelConfig for the decoder families (llama, qwen2, gpt_neox, gpt2).

Import reads both config.json layouts transformers writes (>= 5: `rope_parameters`; 4.x:
`rope_theta` / `rope_scaling`, GPT-NeoX's `rotary_pct` / `rotary_emb_base`). A switch the
file leaves out stays None in the ModelConfig, which then takes its family's value
(`FAMILY_DEFAULTS`, the one place those values are stated). Export writes both layouts and
refuses a config whose switches the family's transformers class cannot express.
"""

from __future__ import annotations

import os
from typing import Any

from tba_jax.models.config import FAMILIES, FAMILY_DEFAULTS, ModelConfig
from tba_jax.models.hf_checkpoint import CONFIG_FILENAME, architectures_of, read_hf_config

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
HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_new",
    "gelu_pytorch_tanh": "gelu_new",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
FULL_ROTARY_PCT = 1.0  # every head dim rotated: config.json leaves partial_rotary_factor out
# transformers' config defaults for keys a config.json may leave out (not switches).
HF_DEFAULT_ROPE_THETA = 10_000.0
HF_DEFAULT_NUM_LABELS = 2
HF_DEFAULT_RMS_NORM_EPS = 1e-6
HF_DEFAULT_LAYER_NORM_EPS = 1e-5
GPT2_FF_PER_D_MODEL = 4  # GPT-2's n_inner when null: 4 * n_embd
# The switches a family's transformers implementation hard-codes (their values are the
# family's FAMILY_DEFAULTS); the others have a config.json key.
_LLAMA_HARD_CODED = (
    "norm",
    "norm_bias",
    "mlp",
    "activation",
    "parallel_residual",
    "position_embedding",
    "rotary_pct",
)
HARD_CODED_SWITCHES: dict[str, tuple[str, ...]] = {
    "llama": _LLAMA_HARD_CODED,
    "qwen2": (*_LLAMA_HARD_CODED, "mlp_bias", "qkv_bias", "attn_out_bias"),
    "gpt_neox": ("norm", "norm_bias", "mlp", "mlp_bias", "position_embedding"),
    "gpt2": (
        "norm",
        "norm_bias",
        "mlp",
        "mlp_bias",
        "qkv_bias",
        "attn_out_bias",
        "parallel_residual",
        "position_embedding",
    ),
}


def _family_of(hf: dict[str, Any]) -> str:
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"model_type {model_type!r} (architectures {hf.get('architectures')}) is not "
            f"supported; tba_jax imports the model types {list(FAMILIES)}."
        )
    return model_type


def _head_of(hf: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """head / num_labels from `architectures` (a missing list means a causal LM)."""
    known = {CAUSAL_LM_ARCHITECTURE[family], BASE_ARCHITECTURE[family], SCORE_ARCHITECTURE[family]}
    architectures = architectures_of(hf, family, known, CAUSAL_LM_ARCHITECTURE[family], source)
    if SCORE_ARCHITECTURE[family] not in architectures:
        return dict(head="lm")
    num_labels = (
        len(hf["id2label"]) if hf.get("id2label") else hf.get("num_labels", HF_DEFAULT_NUM_LABELS)
    )
    return dict(head="score", num_labels=int(num_labels))


def _activation_of(hf_name: str | None) -> str | None:
    """Our name of config.json's activation (None when absent: the family's)."""
    if hf_name is None:
        return None
    if hf_name not in HF_ACTIVATIONS:
        raise ValueError(
            f"Activation {hf_name!r} is not supported; tba_jax implements {sorted(HF_ACTIVATIONS)}."
        )
    return HF_ACTIVATIONS[hf_name]


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig rotary fields from either config.json layout (rotary_pct None when
    absent: the family's).

    transformers >= 5 writes `rope_parameters` = {rope_type, rope_theta,
    partial_rotary_factor, factor, ...}; 4.x wrote `rope_theta` and `rope_scaling`
    (and GPT-NeoX `rotary_emb_base` and `rotary_pct`). A `rope_scaling` dict wins
    over `rope_parameters`, as in transformers.
    """
    params = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    theta = params.get(
        "rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", HF_DEFAULT_ROPE_THETA))
    )
    pct = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    pct = hf.get("rotary_pct") if pct is None else pct
    fields: dict[str, Any] = dict(
        rope_theta=float(theta), rotary_pct=None if pct is None else float(pct)
    )
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
    """llama / qwen2 fields; switches config.json leaves out stay None (the family's)."""
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
        norm_eps=hf.get("rms_norm_eps", HF_DEFAULT_RMS_NORM_EPS),
        activation=_activation_of(hf.get("hidden_act")),
        tie_embeddings=hf.get("tie_word_embeddings"),
        **_rope_fields(hf),
    )
    if family == "llama":  # qwen2 hard-codes these
        bias = hf.get("attention_bias")
        fields.update(qkv_bias=bias, attn_out_bias=bias, mlp_bias=hf.get("mlp_bias"))
    return fields


def _gpt_neox_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """gpt_neox fields; switches config.json leaves out stay None (the family's)."""
    heads = hf["num_attention_heads"]
    bias = hf.get("attention_bias")
    return dict(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        d_ff=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"],
        norm_eps=hf.get("layer_norm_eps", HF_DEFAULT_LAYER_NORM_EPS),
        activation=_activation_of(hf.get("hidden_act")),
        parallel_residual=hf.get("use_parallel_residual"),
        qkv_bias=bias,
        attn_out_bias=bias,
        tie_embeddings=hf.get("tie_word_embeddings"),
        **_rope_fields(hf),
    )


def _gpt2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """gpt2 fields; switches config.json leaves out stay None (the family's)."""
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
        d_ff=hf.get("n_inner") or GPT2_FF_PER_D_MODEL * d,
        max_seq_len=hf["n_positions"],
        norm_eps=hf.get("layer_norm_epsilon", HF_DEFAULT_LAYER_NORM_EPS),
        activation=_activation_of(hf.get("activation_function")),
        tie_embeddings=hf.get("tie_word_embeddings"),
    )


def config_from_hf_dict(
    hf: dict[str, Any], source: str = CONFIG_FILENAME, **overrides: Any
) -> ModelConfig:
    """A ModelConfig from a parsed transformers config.json (float32 unless overridden);
    `source` names the file in errors."""
    family = _family_of(hf)
    if family == "gpt2":
        fields = _gpt2_fields(hf)
    elif family == "gpt_neox":
        fields = _gpt_neox_fields(hf)
    else:
        fields = _llama_like_fields(hf, family)
    fields.update(family=family, **_head_of(hf, family, source))
    fields.update(overrides)
    return ModelConfig(**fields)


def config_from_hf(hf_path: str, **overrides: Any) -> ModelConfig:
    """The ModelConfig of the checkpoint in `hf_path` (its config.json).

    Params and compute are float32 unless `overrides` say otherwise (e.g.
    `param_dtype="bfloat16"`).
    """
    source = os.path.join(hf_path, CONFIG_FILENAME)
    return config_from_hf_dict(read_hf_config(hf_path), source, **overrides)


def unrepresentable_switches(cfg: ModelConfig) -> list[str]:
    """Ways `cfg` differs from what its family's transformers class can express."""
    family_values = FAMILY_DEFAULTS[cfg.family]
    problems = [
        f"{name}={getattr(cfg, name)!r} (the {cfg.family} format needs {family_values[name]!r})"
        for name in HARD_CODED_SWITCHES[cfg.family]
        if getattr(cfg, name) != family_values[name]
    ]
    if cfg.rope_scaling is not None and cfg.position_embedding != "rope":
        problems.append(
            f"rope_scaling={cfg.rope_scaling!r} (the {cfg.family} format has no rotary "
            "positions to scale; needs None)"
        )
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


def check_representable(cfg: ModelConfig) -> None:
    """Raises a ValueError listing `unrepresentable_switches` when there are any."""
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
    if cfg.rotary_pct != FULL_ROTARY_PCT:
        parameters["partial_rotary_factor"] = cfg.rotary_pct
    fields = dict(rope_parameters=parameters, rope_theta=cfg.rope_theta, rope_scaling=scaling)
    if cfg.family == "gpt_neox":
        fields.update(rotary_pct=cfg.rotary_pct, rotary_emb_base=cfg.rope_theta)
    return fields


def config_to_hf(cfg: ModelConfig, dtype: str | None = None) -> dict[str, Any]:
    """The transformers config.json for `cfg` (with `architectures`)."""
    check_representable(cfg)
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
