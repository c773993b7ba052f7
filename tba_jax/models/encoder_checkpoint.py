"""BERT / RoBERTa checkpoint folders: config.json fields, tensor layout, params, pooling modules.

What `encoder.TextEncoder.from_pretrained` reads from a local folder, through the shared
reader (`hf_checkpoint`):

- `encoder_fields_from_hf`: the `EncoderConfig` fields of a parsed config.json (family,
  sizes, head), with errors that name the folder;
- `weight_layout` / `tensor_naming` / `load_encoder_params`: the checkpoint's tensors as a
  params dict with the layers stacked on a leading axis (what `jax.lax.scan` runs over);
- `read_sentence_modules`: a sentence-transformers modules.json (where the transformer
  lives, how token states are pooled).

The tokenizer files are read by `encoder_tokenizer`.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from tba_jax.models.config import DTYPES
from tba_jax.models.encoder_config import FAMILIES, EncoderConfig
from tba_jax.models.hf_checkpoint import (
    Params,
    Path,
    TensorNaming,
    TensorRule,
    architectures_of,
    copy_rule,
    linear_rule,
    place_tensors,
    read_json,
    read_json_object,
    read_tensors,
    set_path,
)

BASE_ARCHITECTURE = {"bert": "BertModel", "roberta": "RobertaModel"}
CLASSIFIER_ARCHITECTURE = {
    "bert": "BertForSequenceClassification",
    "roberta": "RobertaForSequenceClassification",
}
# transformers' BertConfig defaults, for config.json files that leave a field out.
HF_CONFIG_DEFAULTS = {
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "pad_token_id": 0,
    "hidden_act": "gelu",
    "num_labels": 2,
}

# The body's tensors carry this prefix in a *ForSequenceClassification state dict.
BODY_PREFIX = {"bert": "bert.", "roberta": "roberta."}
# Buffers some checkpoints store that are not parameters.
IGNORED_TENSORS = (r"^embeddings\.position_ids$", r"^embeddings\.token_type_ids$")
# A bare model's pooler: sentence embeddings pool themselves (only BERT classifiers use it).
POOLER_TENSORS = r"^pooler\.dense\."
# Old (TF-converted) checkpoints name LayerNorm parameters gamma / beta.
LEGACY_NORM_RENAMES = (
    (r"^(.*LayerNorm.*)\.gamma$", r"\1.weight"),
    (r"^(.*LayerNorm.*)\.beta$", r"\1.bias"),
)
LAYERS = "layers"  # params key of the per-layer weights, stacked on a leading axis

# sentence-transformers folder layout.
MODULES_FILENAME = "modules.json"
POOLING_CONFIG_FILENAME = "config.json"
# Pooling modes, in the order sentence-transformers concatenates them, by config key.
POOLING_MODE_KEYS = {
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "mean": "pooling_mode_mean_tokens",
    "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
}
UNSUPPORTED_POOLING_KEYS = ("pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")
DEFAULT_POOLING_MODES = ("mean",)


# ----------------------------------------------------------------------------------------
# config.json
# ----------------------------------------------------------------------------------------


def _head_of(hf_config: dict[str, Any], family: str, source: str) -> str:
    """The head `architectures` names: "classifier" or "base" (none listed: the bare encoder)."""
    known = {BASE_ARCHITECTURE[family]: "base", CLASSIFIER_ARCHITECTURE[family]: "classifier"}
    architectures = architectures_of(
        hf_config, family, known, BASE_ARCHITECTURE[family], f"{source}/config.json"
    )
    return known[architectures[0]]


def _get(hf_config: dict[str, Any], key: str) -> Any:
    """config.json's `key`, or transformers' BertConfig default when absent or null."""
    value = hf_config.get(key)
    return HF_CONFIG_DEFAULTS[key] if value is None else value


def _num_labels_of(hf_config: dict[str, Any]) -> int:
    if hf_config.get("id2label"):
        return len(hf_config["id2label"])
    return int(hf_config.get("num_labels", HF_CONFIG_DEFAULTS["num_labels"]))


def encoder_fields_from_hf(hf_config: dict[str, Any], *, source: str) -> dict[str, Any]:
    """`EncoderConfig` fields (all but dtype) of a parsed config.json; `source` names the
    folder in errors."""
    family = hf_config.get("model_type")
    if family not in FAMILIES:
        raise ValueError(
            f"model_type {family!r} in {source}/config.json is not supported; the text "
            f"encoder loads {list(FAMILIES)} checkpoints (BERT / RoBERTa families)."
        )
    position_type = hf_config.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ValueError(
            f"position_embedding_type={position_type!r} in {source}/config.json is not "
            "supported; the encoder implements learned absolute positions only."
        )
    if hf_config.get("is_decoder"):
        raise ValueError(f"{source}/config.json has is_decoder=true; load an encoder checkpoint.")
    return dict(
        family=family,
        vocab_size=int(hf_config["vocab_size"]),
        hidden_size=int(hf_config["hidden_size"]),
        num_layers=int(hf_config["num_hidden_layers"]),
        num_heads=int(hf_config["num_attention_heads"]),
        intermediate_size=int(hf_config["intermediate_size"]),
        max_position_embeddings=int(hf_config["max_position_embeddings"]),
        type_vocab_size=int(_get(hf_config, "type_vocab_size")),
        layer_norm_eps=float(_get(hf_config, "layer_norm_eps")),
        pad_token_id=int(_get(hf_config, "pad_token_id")),
        activation=_get(hf_config, "hidden_act"),
        head=_head_of(hf_config, family, source),
        num_labels=_num_labels_of(hf_config),
    )


def id2label_from_hf(hf_config: dict[str, Any], num_labels: int) -> dict[int, str]:
    """config.json's label names by index (LABEL_i where it names none)."""
    names = {int(index): str(name) for index, name in (hf_config.get("id2label") or {}).items()}
    return {i: names.get(i, f"LABEL_{i}") for i in range(num_labels)}


# ----------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------


def _linear_rules(hf_name: str, path: Path, in_dim: int, out_dim: int) -> dict[str, TensorRule]:
    """A torch Linear: weight [out, in] -> kernel [in, out], bias [out]."""
    return {
        f"{hf_name}.weight": linear_rule((*path, "kernel"), (in_dim,), (out_dim,)),
        f"{hf_name}.bias": copy_rule((*path, "bias"), (out_dim,)),
    }


def _norm_rules(hf_name: str, path: Path, dim: int) -> dict[str, TensorRule]:
    return {
        f"{hf_name}.weight": copy_rule((*path, "scale"), (dim,)),
        f"{hf_name}.bias": copy_rule((*path, "bias"), (dim,)),
    }


def _embedding_rules(cfg: EncoderConfig) -> dict[str, TensorRule]:
    d = cfg.hidden_size
    return {
        "embeddings.word_embeddings.weight": copy_rule(("embeddings", "word"), (cfg.vocab_size, d)),
        "embeddings.position_embeddings.weight": copy_rule(
            ("embeddings", "position"), (cfg.max_position_embeddings, d)
        ),
        "embeddings.token_type_embeddings.weight": copy_rule(
            ("embeddings", "token_type"), (cfg.type_vocab_size, d)
        ),
        **_norm_rules("embeddings.LayerNorm", ("embeddings", "norm"), d),
    }


def _layer_rules(i: int, cfg: EncoderConfig) -> dict[str, TensorRule]:
    """Layer i's tensors; paths end in the layer index (stacked on a leading axis later)."""
    d, f, prefix = cfg.hidden_size, cfg.intermediate_size, f"encoder.layer.{i}."
    rules = {}
    for hf_name, name, in_dim, out_dim in [
        ("attention.self.query", "query", d, d),
        ("attention.self.key", "key", d, d),
        ("attention.self.value", "value", d, d),
        ("attention.output.dense", "attn_out", d, d),
        ("intermediate.dense", "mlp_in", d, f),
        ("output.dense", "mlp_out", f, d),
    ]:
        rules.update(_linear_rules(prefix + hf_name, (LAYERS, name), in_dim, out_dim))
    rules.update(_norm_rules(prefix + "attention.output.LayerNorm", (LAYERS, "attn_norm"), d))
    rules.update(_norm_rules(prefix + "output.LayerNorm", (LAYERS, "mlp_norm"), d))
    return {
        name: dataclasses.replace(rule, paths=tuple((*path, i) for path in rule.paths))
        for name, rule in rules.items()
    }


def _head_rules(cfg: EncoderConfig) -> dict[str, TensorRule]:
    """The classification head: dense + tanh on the first token, then the output layer."""
    d, n = cfg.hidden_size, cfg.num_labels
    names = {
        "bert": ("pooler.dense", "classifier"),
        "roberta": ("classifier.dense", "classifier.out_proj"),
    }[cfg.family]
    return {
        **_linear_rules(names[0], ("head", "dense"), d, d),
        **_linear_rules(names[1], ("head", "out"), d, n),
    }


def weight_layout(cfg: EncoderConfig) -> dict[str, TensorRule]:
    """Checkpoint tensor name (without the body prefix) -> where it goes in the params."""
    layout = _embedding_rules(cfg)
    for i in range(cfg.num_layers):
        layout.update(_layer_rules(i, cfg))
    if cfg.head == "classifier":
        layout.update(_head_rules(cfg))
    return layout


def tensor_naming(cfg: EncoderConfig) -> TensorNaming:
    """How a stored checkpoint of `cfg` may name its tensors (see `TensorNaming`)."""
    uses_pooler = cfg.family == "bert" and cfg.head == "classifier"
    ignored = IGNORED_TENSORS if uses_pooler else (*IGNORED_TENSORS, POOLER_TENSORS)
    return TensorNaming(
        prefix=BODY_PREFIX[cfg.family], ignored=ignored, renames=LEGACY_NORM_RENAMES
    )


def _stack_layers(flat: dict[Path, np.ndarray], num_layers: int) -> dict[Path, np.ndarray]:
    """`flat` with the per-layer arrays (paths (LAYERS, ..., i)) stacked on a leading axis."""
    stacked: dict[Path, np.ndarray] = {}
    per_layer: dict[Path, dict[int, np.ndarray]] = {}
    for path, value in flat.items():
        if path[0] == LAYERS:
            per_layer.setdefault(path[:-1], {})[path[-1]] = value
        else:
            stacked[path] = value
    for path, layers in per_layer.items():
        stacked[path] = np.stack([layers[i] for i in range(num_layers)])
    return stacked


def logical_axes(cfg: EncoderConfig) -> Params:
    """Each param's logical axis names, in `load_encoder_params`' layout, for the sharding
    rules of `tba_jax.mesh` (the decoder's names: "heads" for the attention projections'
    heads × head_dim side, "mlp" for the MLP's hidden side, "layers" for the stack)."""

    def linear(in_axis: str, out_axis: str) -> Params:
        return {"kernel": (LAYERS, in_axis, out_axis), "bias": (LAYERS, out_axis)}

    def norm(*stack: str) -> Params:
        return {"scale": (*stack, "norm"), "bias": (*stack, "norm")}

    axes: Params = {
        "embeddings": {
            "word": ("vocab", "embed"),
            "position": ("positions", "embed"),
            "token_type": ("token_types", "embed"),
            "norm": norm(),
        },
        LAYERS: {
            "query": linear("embed", "heads"),
            "key": linear("embed", "heads"),
            "value": linear("embed", "heads"),
            "attn_out": linear("heads", "embed"),
            "mlp_in": linear("embed", "mlp"),
            "mlp_out": linear("mlp", "embed"),
            "attn_norm": norm(LAYERS),
            "mlp_norm": norm(LAYERS),
        },
    }
    if cfg.head == "classifier":
        axes["head"] = {
            "dense": {"kernel": ("embed", "pooled"), "bias": ("pooled",)},
            "out": {"kernel": ("pooled", "labels"), "bias": ("labels",)},
        }
    return axes


def load_encoder_params(
    folder: str, cfg: EncoderConfig, shardings_fn: Callable[[Params], Any] | None = None
) -> Params:
    """The checkpoint's params (NumPy reads, no torch), in `cfg.dtype`.

    Layout: embeddings {word [V,D], position [P,D], token_type [T,D], norm}; layers {query,
    key, value, attn_out, mlp_in, mlp_out: {kernel [L,in,out], bias [L,out]}, attn_norm,
    mlp_norm: {scale [L,D], bias [L,D]}}; classifiers add head {dense, out}.
    `shardings_fn(host_params)` (NumPy arrays in that layout) returns their shardings, each
    array put straight there; None: the default device.
    """
    tensors = read_tensors(
        folder,
        weight_layout(cfg),
        tensor_naming(cfg),
        dtype=DTYPES[cfg.dtype],
        expected=f"its {cfg.family} config (head={cfg.head!r}, {cfg.num_layers} layers)",
        advice=(
            "Check that config.json belongs to these weights (a "
            f"{CLASSIFIER_ARCHITECTURE[cfg.family]} needs its classifier tensors)."
        ),
    )
    stacked = _stack_layers(dict(tensors), cfg.num_layers)
    shardings = None
    if shardings_fn is not None:
        host: Params = {}
        for path, value in stacked.items():
            set_path(host, path, value)
        shardings = shardings_fn(host)
    return place_tensors(stacked.items(), shardings)


# ----------------------------------------------------------------------------------------
# sentence-transformers modules
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SentenceModules:
    """What a sentence-transformers modules.json says: where the transformer lives (a
    subfolder in old layouts) and how its token states are pooled (`pooling_modes`, any of
    POOLING_MODE_KEYS in concatenation order, then L2-normalised when `normalize`)."""

    transformer_folder: pathlib.Path
    pooling_modes: tuple[str, ...] = DEFAULT_POOLING_MODES
    normalize: bool = False


def _pooling_modes_from_config(path: pathlib.Path) -> tuple[str, ...]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the Pooling module needs its config.")
    config = read_json_object(path)
    unsupported = [key for key in UNSUPPORTED_POOLING_KEYS if config.get(key)]
    if unsupported:
        raise ValueError(
            f"{path} turns on {unsupported}; the encoder implements {list(POOLING_MODE_KEYS)}."
        )
    return tuple(mode for mode, key in POOLING_MODE_KEYS.items() if config.get(key))


def read_sentence_modules(folder: pathlib.Path) -> SentenceModules:
    """The folder's modules.json (absent: the folder is the transformer, mean pooling)."""
    path = folder / MODULES_FILENAME
    if not path.is_file():
        return SentenceModules(folder)
    transformer, modes, normalize = folder, None, False
    for module in read_json(path):
        kind = module.get("type", "").rsplit(".", 1)[-1]
        if kind == "Transformer":
            transformer = folder / module.get("path", "")
        elif kind == "Pooling":
            modes = _pooling_modes_from_config(folder / module["path"] / POOLING_CONFIG_FILENAME)
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(
                f"{path} lists a {module.get('type')!r} module; the encoder supports "
                "sentence-transformers Transformer, Pooling and Normalize modules only."
            )
    if modes is None:
        raise ValueError(f"{path} lists no Pooling module; embed needs one to pool tokens.")
    return SentenceModules(transformer, modes, normalize)
