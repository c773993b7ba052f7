"""BERT / RoBERTa encoders from Hugging Face folders: sentence embeddings and text classifiers.

`TextEncoder.from_pretrained(folder)` reads a local checkpoint folder (config.json,
``*.safetensors``, the tokenizer files, and for sentence-transformers models modules.json
with its pooling config) with NumPy only — no torch — and runs the encoder as pure jitted
JAX functions over a params dict:

- ``embed(texts)`` -> [N, D] sentence embeddings, pooled over the real tokens as the
  folder's sentence-transformers modules say (mean pooling when there is no modules.json)
  and L2-normalised when a ``Normalize`` module is listed (all-MiniLM-L6-v2: mean + normalise).
- ``classify(texts, text_pairs)`` -> [N, num_labels] logits of a
  ``*ForSequenceClassification`` checkpoint; ``id2label`` / ``label_index`` name the labels.

Families (``model_type``): ``bert`` (BertModel, BertForSequenceClassification: pooler
dense + tanh on [CLS], then the classifier) and ``roberta`` (RobertaModel,
RobertaForSequenceClassification: dense + tanh + out_proj on <s>; position ids start at
``pad_token_id + 1`` and count only real tokens; token type ids are all 0). Both are
post-LayerNorm transformers with learned absolute positions and token type embeddings.

The folder is read by `encoder_checkpoint` (config, weights, sentence-transformers modules)
and `encoder_tokenizer` (tokenizer.json, or vocab.json + merges.txt / vocab.txt). Texts
longer than `max_length` tokens are truncated, as sentence-transformers and transformers'
pipelines do. Batches are padded to
power-of-two row counts (at most `batch_size`) and power-of-two lengths (at least
`MIN_LENGTH_BUCKET`, at most `max_length`), so the forward compiles a few times, not per call.

With a `placement` (`tba_jax.placement.RolePlacement`, as a red-team judge on the sampler
mesh) the params are sharded by its rules over `encoder_checkpoint.logical_axes` (e.g. the
heads and the MLP split over a tensor axis) and each batch's rows are split over its data
axis (row counts rounded up to a multiple of its size); without one the encoder sits whole
on the default device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tba_jax.models.encoder_checkpoint import (
    BASE_ARCHITECTURE,
    CLASSIFIER_ARCHITECTURE,
    DEFAULT_POOLING_MODES,
    POOLING_MODE_KEYS,
    encoder_fields_from_hf,
    id2label_from_hf,
    load_encoder_params,
    logical_axes,
    read_sentence_modules,
)
from tba_jax.models.encoder_config import EncoderConfig
from tba_jax.models.encoder_tokenizer import load_tokenizer, lowercases_texts, max_length_of
from tba_jax.models.frozen import Placement
from tba_jax.models.hf_checkpoint import Params, read_hf_config

# The functions of `encoder_config.ACTIVATION_NAMES`.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
}
# sentence-transformers' constants: the mean's smallest token count, max pooling's fill
# value for padding, and the smallest norm Normalize divides by (torch's F.normalize eps).
MIN_TOKEN_COUNT = 1e-9
MAX_POOLING_PAD_VALUE = -1e9
NORMALIZE_EPS = 1e-12

# Batch shapes: lengths are padded to powers of two from this one up (capped at max_length).
MIN_LENGTH_BUCKET = 16


# ----------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------
# Forward (pure functions; shapes: B batch rows, S tokens, D hidden, L labels)
# ----------------------------------------------------------------------------------------


def _linear(x: jax.Array, layer: Params) -> jax.Array:
    return x @ layer["kernel"] + layer["bias"]


def _layer_norm(x: jax.Array, norm: Params, eps: float) -> jax.Array:
    """LayerNorm computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * norm["scale"].astype(jnp.float32) + norm["bias"].astype(jnp.float32)).astype(
        x.dtype
    )


def position_ids(cfg: EncoderConfig, valid: jax.Array) -> jax.Array:
    """[B, S] position ids of right-padded rows: BERT 0..S-1; RoBERTa pad_id+1, pad_id+2, ...
    over real tokens and pad_id on padding (as transformers' RoBERTa embeddings)."""
    if cfg.family == "roberta":
        counts = jnp.cumsum(valid, axis=1, dtype=jnp.int32) * valid
        return counts + cfg.pad_token_id
    return jnp.broadcast_to(jnp.arange(valid.shape[1], dtype=jnp.int32), valid.shape)


def embed_tokens(
    params: Params, cfg: EncoderConfig, token_ids: jax.Array, type_ids: jax.Array, valid
) -> jax.Array:
    """[B, S, D] word + position + token type embeddings, layer-normalised."""
    emb = params["embeddings"]
    x = (
        emb["word"][token_ids]
        + emb["position"][position_ids(cfg, valid)]
        + emb["token_type"][type_ids]
    )
    return _layer_norm(x, emb["norm"], cfg.layer_norm_eps)


def _self_attention(x: jax.Array, layer: Params, valid: jax.Array, cfg: EncoderConfig):
    """Bidirectional multi-head attention over the valid keys; softmax in float32."""
    b, s, _ = x.shape
    heads = lambda name: _linear(x, layer[name]).reshape(b, s, cfg.num_heads, cfg.head_dim)
    q, k, v = heads("query"), heads("key"), heads("value")
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(cfg.head_dim)
    scores = jnp.where(valid[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, cfg.hidden_size)


def _encoder_layer(x: jax.Array, layer: Params, valid: jax.Array, cfg: EncoderConfig):
    """One post-LayerNorm block: x = LN(x + attn(x)); x = LN(x + mlp(x))."""
    attn = _linear(_self_attention(x, layer, valid, cfg), layer["attn_out"])
    x = _layer_norm(x + attn, layer["attn_norm"], cfg.layer_norm_eps)
    hidden = ACTIVATIONS[cfg.activation](_linear(x, layer["mlp_in"]))
    return _layer_norm(x + _linear(hidden, layer["mlp_out"]), layer["mlp_norm"], cfg.layer_norm_eps)


def encode(
    params: Params, cfg: EncoderConfig, token_ids: jax.Array, type_ids: jax.Array, valid
) -> jax.Array:
    """[B, S, D] final hidden states of right-padded token_ids [B, S] (valid: [B, S] bool)."""
    x = embed_tokens(params, cfg, token_ids, type_ids, valid)

    def step(x, layer):
        return _encoder_layer(x, layer, valid, cfg), None

    x, _ = jax.lax.scan(step, x, params["layers"])
    return x


def classifier_logits(params: Params, hidden: jax.Array) -> jax.Array:
    """[B, L] float32 logits from the first token's hidden state (hidden: [B, S, D])."""
    pooled = jnp.tanh(_linear(hidden[:, 0], params["head"]["dense"]))
    return _linear(pooled, params["head"]["out"]).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class SentencePooling:
    """How token states become a sentence embedding (a sentence-transformers Pooling +
    optional Normalize). `modes` are concatenated in order: any of POOLING_MODE_KEYS."""

    modes: tuple[str, ...] = DEFAULT_POOLING_MODES
    normalize: bool = False

    def __post_init__(self):
        unknown = [mode for mode in self.modes if mode not in POOLING_MODE_KEYS]
        if unknown or not self.modes:
            raise ValueError(
                f"Pooling modes {self.modes} are not supported; use one or more of "
                f"{list(POOLING_MODE_KEYS)}."
            )


def _pool_one(hidden: jax.Array, valid: jax.Array, mode: str) -> jax.Array:
    weights = valid[..., None].astype(jnp.float32)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return jnp.where(weights > 0, hidden, MAX_POOLING_PAD_VALUE).max(axis=1)
    total = (hidden * weights).sum(axis=1)
    count = jnp.maximum(weights.sum(axis=1), MIN_TOKEN_COUNT)
    return total / (count if mode == "mean" else jnp.sqrt(count))


def pool_sentences(hidden: jax.Array, valid: jax.Array, pooling: SentencePooling) -> jax.Array:
    """[B, D * len(modes)] float32 sentence embeddings of hidden [B, S, D] over valid tokens."""
    hidden = hidden.astype(jnp.float32)
    pooled = jnp.concatenate([_pool_one(hidden, valid, mode) for mode in pooling.modes], axis=-1)
    if pooling.normalize:
        norm = jnp.linalg.norm(pooled, axis=-1, keepdims=True)
        pooled = pooled / jnp.maximum(norm, NORMALIZE_EPS)
    return pooled


def _embed_batch(params, token_ids, type_ids, valid, *, cfg, pooling):
    return pool_sentences(encode(params, cfg, token_ids, type_ids, valid), valid, pooling)


def _classify_batch(params, token_ids, type_ids, valid, *, cfg):
    return classifier_logits(params, encode(params, cfg, token_ids, type_ids, valid))


# ----------------------------------------------------------------------------------------
# Batching
# ----------------------------------------------------------------------------------------


def bucket(n: int, *, smallest: int, largest: int) -> int:
    """The smallest power of two >= max(n, smallest), capped at `largest`."""
    return min(largest, 1 << (max(n, smallest, 1) - 1).bit_length())


def _pad_rows(rows: Sequence[tuple[list[int], list[int]]], num_rows: int, length: int, pad_id):
    """Right-padded token_ids, type_ids [num_rows, length] int32 and valid [num_rows, length]."""
    token_ids = np.full((num_rows, length), pad_id, np.int32)
    type_ids = np.zeros((num_rows, length), np.int32)
    valid = np.zeros((num_rows, length), bool)
    for i, (ids, types) in enumerate(rows):
        token_ids[i, : len(ids)] = ids
        type_ids[i, : len(types)] = types
        valid[i, : len(ids)] = True
    return token_ids, type_ids, valid


def _check_texts(texts: Sequence[str], name: str) -> list[str]:
    if isinstance(texts, str):
        raise TypeError(f"{name} must be a sequence of strings, not one string; wrap it in [].")
    texts = list(texts)
    bad = [i for i, text in enumerate(texts) if not isinstance(text, str)]
    if bad:
        raise TypeError(f"{name}[{bad[0]}] is a {type(texts[bad[0]]).__name__}, not a str.")
    return texts


def _check_batch_size(batch_size: int) -> None:
    if not (isinstance(batch_size, int) and batch_size > 0):
        raise ValueError(f"batch_size={batch_size!r} must be a positive int.")


# ----------------------------------------------------------------------------------------
# TextEncoder
# ----------------------------------------------------------------------------------------


class TextEncoder:
    """A BERT / RoBERTa checkpoint with its tokenizer and jitted forward functions.

    Build it with `from_pretrained`. `embed` gives sentence embeddings, `classify` the
    logits of a classifier checkpoint. `max_length` is the tokens per text (longer texts are
    truncated), `id2label` the label names by logit index.
    """

    def __init__(
        self,
        config: EncoderConfig,
        params: Params,
        tokenizer: Any,
        *,
        pooling: SentencePooling,
        id2label: dict[int, str],
        max_length: int,
        lowercase: bool = False,
        source: str = "",
        placement: Placement | None = None,
    ):
        """`params` already where `placement` puts them (see `from_pretrained`)."""
        self.config = config
        self.params = params
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.id2label = dict(id2label)
        self.max_length = max_length
        self.lowercase = lowercase
        self.source = source
        self.placement = placement
        self._embed_fn = jax.jit(functools.partial(_embed_batch, cfg=config, pooling=pooling))
        self._classify_fn = jax.jit(functools.partial(_classify_batch, cfg=config))

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        dtype: str = "float32",
        *,
        max_length: int | None = None,
        placement: Placement | None = None,
        role_name: str = "encoder",
    ) -> TextEncoder:
        """Loads the local folder `path` (a transformers or sentence-transformers layout).

        `dtype`: params and activations ("float32" | "bfloat16" | "float16"; outputs are
        float32). `max_length` overrides the tokens per text (see
        `encoder_tokenizer.max_length_of`). `placement`: where the params and batches go
        (None: the default device); a rule that cannot split a parameter is its error,
        naming `role_name`.
        """
        folder = pathlib.Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(
                f"Encoder folder {folder} does not exist; pass a local Hugging Face folder "
                "(config.json, *.safetensors, tokenizer files) — nothing is downloaded."
            )
        modules = read_sentence_modules(folder)
        model_folder = modules.transformer_folder
        hf_config = read_hf_config(model_folder)
        fields = encoder_fields_from_hf(hf_config, source=str(model_folder))
        config = EncoderConfig(**fields, dtype=dtype)
        tokens = max_length_of(model_folder, config.max_tokens, max_length)
        tokenizer = load_tokenizer(model_folder, config.family, tokens)
        shardings_fn = None
        if placement is not None:
            axes = logical_axes(config)
            shardings_fn = functools.partial(placement.param_shardings, role_name, axes)
        params = load_encoder_params(str(model_folder), config, shardings_fn)
        return cls(
            config,
            params,
            tokenizer,
            pooling=SentencePooling(modules.pooling_modes, modules.normalize),
            id2label=id2label_from_hf(hf_config, config.num_labels),
            max_length=tokens,
            lowercase=lowercases_texts(model_folder),
            source=str(folder),
            placement=placement,
        )

    @property
    def embedding_dim(self) -> int:
        """D of `embed`'s [N, D] output."""
        return self.config.hidden_size * len(self.pooling.modes)

    def token_ids(
        self, texts: Sequence[str], text_pairs: Sequence[str] | None = None
    ) -> list[list[int]]:
        """Each text's (or text pair's) ids as the model sees them: special tokens added,
        truncated to `max_length`."""
        return [ids for ids, _ in self._tokenize(texts, text_pairs)]

    def embed(self, texts: Sequence[str], *, batch_size: int = 64) -> np.ndarray:
        """[N, D] float32 sentence embeddings, pooled (and normalised) as the folder says."""
        rows = self._tokenize(texts, None)
        return self._run(self._embed_fn, rows, batch_size, self.embedding_dim)

    def classify(
        self,
        texts: Sequence[str],
        text_pairs: Sequence[str] | None = None,
        *,
        batch_size: int = 64,
    ) -> np.ndarray:
        """[N, num_labels] float32 logits of a *ForSequenceClassification checkpoint;
        `text_pairs[i]` (optional) is text i's second segment."""
        if self.config.head != "classifier":
            raise ValueError(
                f"{self.source} holds a {BASE_ARCHITECTURE[self.config.family]} without a "
                f"classification head; classify needs a "
                f"{CLASSIFIER_ARCHITECTURE[self.config.family]} checkpoint."
            )
        rows = self._tokenize(texts, text_pairs)
        return self._run(self._classify_fn, rows, batch_size, self.config.num_labels)

    def label_index(self, name: str) -> int:
        """The logit index of label `name` (as config.json's id2label spells it)."""
        for index, label in self.id2label.items():
            if label == name:
                return index
        raise ValueError(
            f"Label {name!r} is not one of {self.source}'s labels "
            f"{sorted(self.id2label.values())} (id2label {self.id2label})."
        )

    def _tokenize(
        self, texts: Sequence[str], text_pairs: Sequence[str] | None
    ) -> list[tuple[list[int], list[int]]]:
        """(ids, type ids) per text; RoBERTa's type ids are all 0."""
        texts = self._prepare(_check_texts(texts, "texts"))
        if text_pairs is None:
            inputs: list[Any] = texts
        else:
            pairs = self._prepare(_check_texts(text_pairs, "text_pairs"))
            if len(pairs) != len(texts):
                raise ValueError(
                    f"Got {len(texts)} texts but {len(pairs)} text_pairs; pass one pair each."
                )
            inputs = list(zip(texts, pairs, strict=True))
        encodings = self.tokenizer.encode_batch(inputs) if inputs else []
        zero_types = self.config.family == "roberta"
        return [(e.ids, [0] * len(e.ids) if zero_types else e.type_ids) for e in encodings]

    def _prepare(self, texts: list[str]) -> list[str]:
        return [text.lower() for text in texts] if self.lowercase else texts

    def _run(self, fn, rows, batch_size: int, width: int) -> np.ndarray:
        """fn's [N, width] float32 outputs, longest texts batched together, in input order."""
        _check_batch_size(batch_size)
        out = np.zeros((len(rows), width), np.float32)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            num_rows = bucket(len(chunk), smallest=1, largest=batch_size)
            longest = len(rows[chunk[0]][0])
            length = bucket(longest, smallest=MIN_LENGTH_BUCKET, largest=self.max_length)
            arrays = _pad_rows([rows[i] for i in chunk], num_rows, length, self.config.pad_token_id)
            if self.placement is not None:  # rows split over its data axis (padded)
                arrays = self.placement.put_rows(*arrays)
            out[chunk] = np.asarray(fn(self.params, *arrays))[: len(chunk)]
        return out

    def __repr__(self) -> str:
        return (
            f"TextEncoder({self.source!r}, family={self.config.family}, "
            f"head={self.config.head}, layers={self.config.num_layers}, "
            f"hidden={self.config.hidden_size}, max_length={self.max_length})"
        )
