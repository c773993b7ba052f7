"""The tensors of a decoder checkpoint (llama, qwen2, gpt_neox, gpt2), by state-dict name.

`weight_layout(cfg)` gives one `TensorRule` per tensor transformers' `save_pretrained`
writes for `cfg` (both directions: import and export); `tensor_naming(cfg)` says how a
stored checkpoint may spell those names differently (a bare base model without the prefix,
the other output-embedding name, buffers that are not parameters).
"""

from __future__ import annotations

import math
import re

import numpy as np

from tba_jax.models.config import ModelConfig
from tba_jax.models.hf_checkpoint import (
    Path,
    TensorNaming,
    TensorRule,
    copy_rule,
    linear_rule,
    vector_rule,
)
from tba_jax.models.hf_config import check_representable

# Where the decoder body's tensors live in a *ForCausalLM / *ForSequenceClassification
# state dict (a bare base-model checkpoint, like the hub's gpt2, has no prefix).
BASE_PREFIX = {
    "llama": "model.",
    "qwen2": "model.",
    "gpt_neox": "gpt_neox.",
    "gpt2": "transformer.",
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
SCORE_HEAD_NAME = "score.weight"
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
    rules = {f"{hf_name}.weight": copy_rule((*path, "scale"), (cfg.d_model,))}
    if cfg.norm_bias:
        rules[f"{hf_name}.bias"] = copy_rule((*path, "bias"), (cfg.d_model,))
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
        f"{name}.self_attn.q_proj.weight": linear_rule((*attn, "wq"), (d,), (h, hd)),
        f"{name}.self_attn.k_proj.weight": linear_rule((*attn, "wk"), (d,), (kv, hd)),
        f"{name}.self_attn.v_proj.weight": linear_rule((*attn, "wv"), (d,), (kv, hd)),
        f"{name}.self_attn.o_proj.weight": linear_rule((*attn, "wo"), (h, hd), (d,)),
        f"{name}.mlp.gate_proj.weight": linear_rule((*mlp, "w_gate"), (d,), (ff,)),
        f"{name}.mlp.up_proj.weight": linear_rule((*mlp, "w_up"), (d,), (ff,)),
        f"{name}.mlp.down_proj.weight": linear_rule((*mlp, "w_down"), (ff,), (d,)),
    }
    if cfg.qkv_bias:
        rules[f"{name}.self_attn.q_proj.bias"] = vector_rule((*attn, "bq"), (h, hd))
        rules[f"{name}.self_attn.k_proj.bias"] = vector_rule((*attn, "bk"), (kv, hd))
        rules[f"{name}.self_attn.v_proj.bias"] = vector_rule((*attn, "bv"), (kv, hd))
    if cfg.attn_out_bias:
        rules[f"{name}.self_attn.o_proj.bias"] = copy_rule((*attn, "bo"), (d,))
    if cfg.mlp_bias:
        rules[f"{name}.mlp.gate_proj.bias"] = copy_rule((*mlp, "b_gate"), (ff,))
        rules[f"{name}.mlp.up_proj.bias"] = copy_rule((*mlp, "b_up"), (ff,))
        rules[f"{name}.mlp.down_proj.bias"] = copy_rule((*mlp, "b_down"), (d,))
    return rules


def _neox_block_rules(i: int, cfg: ModelConfig) -> dict[str, TensorRule]:
    d, h, hd, ff = cfg.d_model, cfg.num_heads, cfg.resolved_head_dim, cfg.d_ff
    name, attn, mlp = f"layers.{i}", ("blocks", i, "attn"), ("blocks", i, "mlp")
    rules = {
        **_norm_rules(f"{name}.input_layernorm", ("blocks", i, "attn_norm"), cfg),
        **_norm_rules(f"{name}.post_attention_layernorm", ("blocks", i, "mlp_norm"), cfg),
        f"{name}.attention.query_key_value.weight": _neox_qkv_weight_rule(attn, cfg),
        f"{name}.attention.dense.weight": linear_rule((*attn, "wo"), (h, hd), (d,)),
        f"{name}.mlp.dense_h_to_4h.weight": linear_rule((*mlp, "w_up"), (d,), (ff,)),
        f"{name}.mlp.dense_h_to_4h.bias": copy_rule((*mlp, "b_up"), (ff,)),
        f"{name}.mlp.dense_4h_to_h.weight": linear_rule((*mlp, "w_down"), (ff,), (d,)),
        f"{name}.mlp.dense_4h_to_h.bias": copy_rule((*mlp, "b_down"), (d,)),
    }
    if cfg.qkv_bias:
        rules[f"{name}.attention.query_key_value.bias"] = _neox_qkv_bias_rule(attn, cfg)
        rules[f"{name}.attention.dense.bias"] = copy_rule((*attn, "bo"), (d,))
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
        f"{name}.attn.c_proj.bias": copy_rule((*attn, "bo"), (d,)),
        f"{name}.mlp.c_fc.weight": _conv1d_rule((*mlp, "w_up"), (d,), (ff,)),
        f"{name}.mlp.c_fc.bias": copy_rule((*mlp, "b_up"), (ff,)),
        f"{name}.mlp.c_proj.weight": _conv1d_rule((*mlp, "w_down"), (ff,), (d,)),
        f"{name}.mlp.c_proj.bias": copy_rule((*mlp, "b_down"), (d,)),
    }


def _body_rules(cfg: ModelConfig) -> dict[str, TensorRule]:
    """Rules of the base model's tensors, named without the base-model prefix."""
    embedding = copy_rule(("embedding",), (cfg.vocab_size, cfg.d_model))
    if cfg.family == "gpt2":
        rules = {
            "wte.weight": embedding,
            "wpe.weight": copy_rule(("position_embedding",), (cfg.max_seq_len, cfg.d_model)),
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
    check_representable(cfg)
    prefix = BASE_PREFIX[cfg.family]
    layout = {prefix + name: rule for name, rule in _body_rules(cfg).items()}
    if cfg.head == "score":
        layout[SCORE_HEAD_NAME] = linear_rule(("score",), (cfg.d_model,), (cfg.num_labels,))
    elif cfg.has_lm_head:
        layout[LM_HEAD_NAME[cfg.family]] = linear_rule(
            ("lm_head",), (cfg.d_model,), (cfg.vocab_size,)
        )
    return layout


def tensor_naming(cfg: ModelConfig) -> TensorNaming:
    """How a stored checkpoint of `cfg` may name its tensors (see `TensorNaming`)."""
    ignored = IGNORED_TENSORS[cfg.family]
    if cfg.head == "lm" and cfg.tie_embeddings:
        # A tied checkpoint may still store the output embedding (a copy of the input one).
        ignored += tuple(f"^{re.escape(name)}$" for name in LM_HEAD_ALIASES)
    head_name = LM_HEAD_NAME[cfg.family]
    aliases = tuple(
        (f"^{re.escape(alias)}$", head_name) for alias in LM_HEAD_ALIASES if alias != head_name
    )
    return TensorNaming(prefix=BASE_PREFIX[cfg.family], ignored=ignored, renames=aliases)
