"""Tokenizers of Hugging Face checkpoints, behind the `Tokenizer` protocol.

`HFTokenizer.from_pretrained(folder)` reads a local checkpoint folder in Hugging
Face layout; nothing is downloaded and `transformers` is not needed:

- ``tokenizer.json`` is loaded with the `tokenizers` library (fast path); without
  it, a SentencePiece ``tokenizer.model`` (Llama-2 / TinyLlama style) is loaded
  with `sentencepiece`.
- Special tokens come from the checkpoint. Each is looked up in order, the first
  source that names it wins:

  ======  ==============================================================
  BOS     tokenizer_config.json ``bos_token``, special_tokens_map.json,
          the tokenizer itself (the one token tokenizer.json's
          post-processor puts first, or SentencePiece's BOS piece),
          generation_config.json / config.json ``bos_token_id``;
          none of them: the EOS id.
  EOS     tokenizer_config.json ``eos_token``, special_tokens_map.json,
          the tokenizer itself; then every ``eos_token_id`` of
          generation_config.json and config.json (an int or a list) is
          added too. `eos_id` is the first, `decode` stops at any.
  pad     tokenizer_config.json ``pad_token``, special_tokens_map.json,
          the tokenizer itself, generation_config.json / config.json
          ``pad_token_id``; none of them: the EOS id (GPT-2, Pythia and
          Llama checkpoints have no pad token).
  ======  ==============================================================

  Token entries may be strings or dicts with a ``"content"`` key.
- Whether `encode` adds BOS / EOS when not told follows the checkpoint:
  ``add_bos_token`` / ``add_eos_token`` in tokenizer_config.json when present,
  otherwise what tokenizer.json's post-processor adds (SentencePiece: BOS yes,
  EOS no, the defaults of transformers' LlamaTokenizer). Explicit
  ``add_bos=`` / ``add_eos=`` arguments override it. (transformers >= 5 ignores
  the tokenizer_config flags when a tokenizer.json exists; checkpoints normally
  agree with their post-processor, and where they do not we take the flag as
  the author's stated intent.)

Decoding: padding and BOS ids at the start are dropped first, so a left-padded
prompt decodes correctly even when pad (or BOS) is the EOS id; decoding then
stops at the first EOS id and skips every special token. Spaces are left as the
tokenizer's decoder produces them (no ``clean_up_tokenization_spaces``), so
``decode(encode(text)) == text`` for lossless tokenizers.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from tba_jax.models.hf_checkpoint import CONFIG_FILENAME, read_optional_json_object
from tba_jax.models.tokenizers import BatchCoding, Tokenizer

TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
MODEL_CONFIG = CONFIG_FILENAME

# transformers' LlamaTokenizer defaults, used for a SentencePiece model whose
# tokenizer_config.json does not say whether to add BOS / EOS.
SENTENCEPIECE_ADDS_BOS_BY_DEFAULT = True
SENTENCEPIECE_ADDS_EOS_BY_DEFAULT = False
# SentencePiece reports a disabled special piece with this id.
SENTENCEPIECE_NO_ID = -1
# Encoded with and without special tokens to see what tokenizer.json's
# post-processor adds around a text.
POST_PROCESSOR_PROBE_TEXT = "a"


class _Backend(Protocol):
    """The tokenizer library behind an `HFTokenizer`, without any special-token policy."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """The text's ids, without special tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, skipping special tokens."""
        ...

    def token_id(self, content: str) -> int | None:
        """Id of the token spelled `content`, or None if there is none."""
        ...

    def builtin_specials(self) -> _BuiltinSpecials:
        """What the tokenizer file itself says about special tokens."""
        ...


@dataclasses.dataclass(frozen=True)
class _BuiltinSpecials:
    """Special tokens as the tokenizer file alone defines them.

    `prefix_ids` / `suffix_ids` are what the tokenizer adds around a text by default.
    """

    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    prefix_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """The special-token policy of a checkpoint (see the module docstring)."""

    bos_id: int
    eos_ids: tuple[int, ...]
    pad_id: int
    adds_bos_by_default: bool
    adds_eos_by_default: bool


# --------------------------------------------------------------------------- files


@dataclasses.dataclass(frozen=True)
class _CheckpointConfigs:
    """The JSON files of a checkpoint folder that describe special tokens."""

    folder: pathlib.Path
    tokenizer_config: dict[str, Any]
    special_tokens_map: dict[str, Any]
    generation_config: dict[str, Any]
    model_config: dict[str, Any]

    @classmethod
    def read(cls, folder: pathlib.Path) -> _CheckpointConfigs:
        return cls(
            folder=folder,
            tokenizer_config=read_optional_json_object(folder / TOKENIZER_CONFIG),
            special_tokens_map=read_optional_json_object(folder / SPECIAL_TOKENS_MAP),
            generation_config=read_optional_json_object(folder / GENERATION_CONFIG),
            model_config=read_optional_json_object(folder / MODEL_CONFIG),
        )


# ------------------------------------------------------------------------ backends


def import_or_explain(module_name: str, needed_for: pathlib.Path) -> Any:
    """The module `module_name`, or an ImportError saying what needs it and how to install it."""
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(
            f"Loading {needed_for} needs the `{module_name}` package; "
            f"install it with `pip install {module_name}`."
        ) from error


class _FastBackend:
    """A `tokenizers.Tokenizer` loaded from tokenizer.json."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    @classmethod
    def load(cls, path: pathlib.Path) -> _FastBackend:
        tokenizers = import_or_explain("tokenizers", path)
        try:
            return cls(tokenizers.Tokenizer.from_file(str(path)))
        except Exception as error:  # tokenizers raises a bare Exception on bad files.
            raise ValueError(
                f"Could not load {path} with the `tokenizers` library ({error}); "
                "is it a tokenizer.json written by Hugging Face tokenizers?"
            ) from error

    @property
    def vocab_size(self) -> int:
        """One more than the largest id, added tokens included."""
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_id(self, content: str) -> int | None:
        return self._tokenizer.token_to_id(content)

    def builtin_specials(self) -> _BuiltinSpecials:
        prefix, suffix = self._post_processor_additions()
        padding = self._tokenizer.padding
        return _BuiltinSpecials(
            bos_id=prefix[0] if len(prefix) == 1 else None,
            eos_id=suffix[0] if len(suffix) == 1 else None,
            pad_id=padding["pad_id"] if padding else None,
            prefix_ids=prefix,
            suffix_ids=suffix,
        )

    def _post_processor_additions(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The ids the post-processor puts before and after a text."""
        encoding = self._tokenizer.encode(POST_PROCESSOR_PROBE_TEXT, add_special_tokens=True)
        text_positions = [i for i, seq in enumerate(encoding.sequence_ids) if seq is not None]
        if not text_positions:
            return tuple(encoding.ids), ()
        return (
            tuple(encoding.ids[: text_positions[0]]),
            tuple(encoding.ids[text_positions[-1] + 1 :]),
        )


@dataclasses.dataclass(frozen=True)
class _AddedToken:
    content: str
    special: bool


def _added_tokens(tokenizer_config: dict[str, Any], folder: pathlib.Path) -> dict[int, _AddedToken]:
    """tokenizer_config.json's ``added_tokens_decoder``, by id."""
    added = {}
    for token_id, entry in tokenizer_config.get("added_tokens_decoder", {}).items():
        if not (isinstance(entry, dict) and isinstance(entry.get("content"), str)):
            raise ValueError(
                f"added_tokens_decoder[{token_id!r}] in {folder / TOKENIZER_CONFIG} is "
                f"{entry!r}; expected a dict with a 'content' string."
            )
        added[int(token_id)] = _AddedToken(entry["content"], bool(entry.get("special", False)))
    return added


def _sentencepiece_special_ids(
    processor: Any, added_tokens: dict[int, _AddedToken]
) -> frozenset[int]:
    """What decoding skips: control and unknown pieces, and added tokens marked special."""
    pieces = range(processor.get_piece_size())
    special_pieces = [i for i in pieces if processor.is_control(i) or processor.is_unknown(i)]
    special_added = [i for i, token in added_tokens.items() if token.special]
    return frozenset(special_pieces + special_added)


class _SentencePieceBackend:
    """A SentencePiece model, plus the added tokens listed in tokenizer_config.json.

    Added tokens are only decoded: text is encoded by SentencePiece alone.
    """

    def __init__(self, processor: Any, added_tokens: dict[int, _AddedToken]):
        self._processor = processor
        self._added_tokens = added_tokens
        self._num_pieces = processor.get_piece_size()
        self._vocab_size = max([self._num_pieces - 1, *added_tokens]) + 1
        self._special_ids = _sentencepiece_special_ids(processor, added_tokens)

    @classmethod
    def load(cls, path: pathlib.Path, tokenizer_config: dict[str, Any]) -> _SentencePieceBackend:
        sentencepiece = import_or_explain("sentencepiece", path)
        try:
            processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as error:
            raise ValueError(
                f"Could not load {path} with `sentencepiece` ({error}); "
                "is it a SentencePiece model file?"
            ) from error
        return cls(processor, _added_tokens(tokenizer_config, path.parent))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        parts, piece_run = [], []
        for token_id in ids:
            if token_id in self._special_ids:
                continue
            if token_id < self._num_pieces:
                piece_run.append(token_id)
                continue
            parts.append(self._processor.decode(piece_run))
            piece_run = []
            parts.append(self._added_tokens[token_id].content)
        parts.append(self._processor.decode(piece_run))
        return "".join(parts)

    def token_id(self, content: str) -> int | None:
        for token_id, token in self._added_tokens.items():
            if token.content == content:
                return token_id
        piece_id = self._processor.piece_to_id(content)  # Unknown pieces give the UNK id.
        return piece_id if self._processor.id_to_piece(piece_id) == content else None

    def builtin_specials(self) -> _BuiltinSpecials:
        bos, eos, pad = (
            self._piece_id_or_none(self._processor.bos_id()),
            self._piece_id_or_none(self._processor.eos_id()),
            self._piece_id_or_none(self._processor.pad_id()),
        )
        return _BuiltinSpecials(
            bos_id=bos,
            eos_id=eos,
            pad_id=pad,
            prefix_ids=(bos,) if SENTENCEPIECE_ADDS_BOS_BY_DEFAULT and bos is not None else (),
            suffix_ids=(eos,) if SENTENCEPIECE_ADDS_EOS_BY_DEFAULT and eos is not None else (),
        )

    @staticmethod
    def _piece_id_or_none(piece_id: int) -> int | None:
        return None if piece_id == SENTENCEPIECE_NO_ID else piece_id


def _load_backend(folder: pathlib.Path, configs: _CheckpointConfigs) -> _Backend:
    if (folder / TOKENIZER_JSON).is_file():
        return _FastBackend.load(folder / TOKENIZER_JSON)
    if (folder / SENTENCEPIECE_MODEL).is_file():
        return _SentencePieceBackend.load(folder / SENTENCEPIECE_MODEL, configs.tokenizer_config)
    raise FileNotFoundError(
        f"{folder} has neither {TOKENIZER_JSON} nor {SENTENCEPIECE_MODEL}; point to a "
        "Hugging Face checkpoint folder that contains its tokenizer files."
    )


# ------------------------------------------------------------------ special tokens


def _token_content(entry: Any, key: str, source: pathlib.Path) -> str | None:
    """A special-token entry: a string, a dict with "content", or null."""
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    raise ValueError(
        f"{key!r} in {source} is {entry!r}; expected a token string or a dict with a "
        "'content' string."
    )


def _named_token_id(key: str, backend: _Backend, configs: _CheckpointConfigs) -> int | None:
    """Id of the token that tokenizer_config.json or special_tokens_map.json names under `key`."""
    for file_name, config in (
        (TOKENIZER_CONFIG, configs.tokenizer_config),
        (SPECIAL_TOKENS_MAP, configs.special_tokens_map),
    ):
        content = _token_content(config.get(key), key, configs.folder / file_name)
        if content is None:
            continue
        token_id = backend.token_id(content)
        if token_id is None:
            raise ValueError(
                f"{key}={content!r} in {configs.folder / file_name} is not a token of the "
                "tokenizer; the tokenizer and its config disagree — re-save them together."
            )
        return token_id
    return None


def _model_config_ids(key: str, configs: _CheckpointConfigs) -> list[int]:
    """Ids under `key` in generation_config.json then config.json (each an int or a list)."""
    ids = []
    for file_name, config in (
        (GENERATION_CONFIG, configs.generation_config),
        (MODEL_CONFIG, configs.model_config),
    ):
        value = config.get(key)
        values = value if isinstance(value, list) else [value]
        for token_id in values:
            if token_id is None:
                continue
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise ValueError(
                    f"{key}={value!r} in {configs.folder / file_name} must be an int or a "
                    "list of ints."
                )
            ids.append(token_id)
    return ids


def _first_present(*candidates: int | None) -> int | None:
    return next((c for c in candidates if c is not None), None)


def _unique(ids: Iterable[int | None]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _adds_by_default(flag_key: str, configs: _CheckpointConfigs, builtin: bool) -> bool:
    flag = configs.tokenizer_config.get(flag_key)
    if flag is None:
        return builtin
    if not isinstance(flag, bool):
        raise ValueError(
            f"{flag_key}={flag!r} in {configs.folder / TOKENIZER_CONFIG} must be true or false."
        )
    return flag


def _check_ids_in_vocab(specials: SpecialTokens, vocab_size: int, folder: pathlib.Path) -> None:
    for name, token_id in [
        ("bos", specials.bos_id),
        ("pad", specials.pad_id),
        *(("eos", i) for i in specials.eos_ids),
    ]:
        if not 0 <= token_id < vocab_size:
            raise ValueError(
                f"The {name} token id {token_id} of {folder} is outside the tokenizer's "
                f"vocabulary [0, {vocab_size}); its config files belong to another tokenizer."
            )


def _resolve_special_tokens(backend: _Backend, configs: _CheckpointConfigs) -> SpecialTokens:
    builtin = backend.builtin_specials()
    eos_ids = _unique(
        [
            _first_present(_named_token_id("eos_token", backend, configs), builtin.eos_id),
            *_model_config_ids("eos_token_id", configs),
        ]
    )
    if not eos_ids:
        raise ValueError(
            f"No EOS token found for {configs.folder} in {TOKENIZER_CONFIG}, "
            f"{SPECIAL_TOKENS_MAP}, {GENERATION_CONFIG}, {MODEL_CONFIG} or the tokenizer "
            f'itself; add "eos_token": "<its token>" to {TOKENIZER_CONFIG}.'
        )
    bos_id = _first_present(
        _named_token_id("bos_token", backend, configs),
        builtin.bos_id,
        *_model_config_ids("bos_token_id", configs),
    )
    pad_id = _first_present(
        _named_token_id("pad_token", backend, configs),
        builtin.pad_id,
        *_model_config_ids("pad_token_id", configs),
        eos_ids[0],
    )
    specials = SpecialTokens(
        bos_id=eos_ids[0] if bos_id is None else bos_id,
        eos_ids=eos_ids,
        pad_id=pad_id,
        adds_bos_by_default=bos_id is not None
        and _adds_by_default("add_bos_token", configs, bos_id in builtin.prefix_ids),
        adds_eos_by_default=_adds_by_default(
            "add_eos_token", configs, eos_ids[0] in builtin.suffix_ids
        ),
    )
    _check_ids_in_vocab(specials, backend.vocab_size, configs.folder)
    return specials


# ----------------------------------------------------------------------- tokenizer


class HFTokenizer(BatchCoding):
    """A Hugging Face checkpoint's tokenizer implementing `Tokenizer`.

    Build it with `from_pretrained`. `encode`'s ``add_bos`` / ``add_eos`` default to
    None, meaning "as the checkpoint does" (`adds_bos_by_default`,
    `adds_eos_by_default`); True / False override that. `eos_ids` lists every id
    that ends a sequence; `eos_id` is the first and the one `encode` appends. With
    no pad token in the checkpoint, `pad_id` is `eos_id`.
    """

    def __init__(self, backend: _Backend, special_tokens: SpecialTokens, source: str):
        self._backend = backend
        self._special = special_tokens
        self._source = source
        self._vocab_size = backend.vocab_size
        self._eos_set = frozenset(special_tokens.eos_ids)
        self._skipped_ids = frozenset((special_tokens.pad_id, special_tokens.bos_id))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> HFTokenizer:
        """Loads the tokenizer of the local checkpoint folder `path`."""
        folder = pathlib.Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(
                f"Tokenizer folder {folder} does not exist (or is not a folder); pass the "
                "local folder of a Hugging Face checkpoint — nothing is downloaded."
            )
        configs = _CheckpointConfigs.read(folder)
        backend = _load_backend(folder, configs)
        return cls(backend, _resolve_special_tokens(backend, configs), str(folder))

    @property
    def source(self) -> str:
        """The folder this tokenizer was loaded from."""
        return self._source

    @property
    def vocab_size(self) -> int:
        """One more than the largest id the tokenizer can produce, added tokens included."""
        return self._vocab_size

    @property
    def pad_id(self) -> int:
        return self._special.pad_id

    @property
    def bos_id(self) -> int:
        return self._special.bos_id

    @property
    def eos_id(self) -> int:
        return self._special.eos_ids[0]

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self._special.eos_ids

    @property
    def adds_bos_by_default(self) -> bool:
        return self._special.adds_bos_by_default

    @property
    def adds_eos_by_default(self) -> bool:
        return self._special.adds_eos_by_default

    def encode(
        self, text: str, *, add_bos: bool | None = None, add_eos: bool | None = None
    ) -> list[int]:
        """Ids of `text`; BOS / EOS added as the checkpoint does unless told otherwise."""
        ids = self._backend.encode(text)
        if self.adds_bos_by_default if add_bos is None else add_bos:
            ids.insert(0, self.bos_id)
        if self.adds_eos_by_default if add_eos is None else add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`: leading pad/BOS dropped, up to the first EOS, special tokens skipped."""
        ids = [int(token_id) for token_id in ids]
        self._check_in_vocab(ids)
        return self._backend.decode(self._content_ids(ids))

    def _content_ids(self, ids: list[int]) -> list[int]:
        """The ids that carry text: padding before the first EOS never ends a sequence."""
        start = 0
        while start < len(ids) and ids[start] in self._skipped_ids:
            start += 1
        content = []
        for token_id in ids[start:]:
            if token_id in self._eos_set:
                break
            if token_id not in self._skipped_ids:
                content.append(token_id)
        return content

    def _check_in_vocab(self, ids: list[int]) -> None:
        for token_id in ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"Token id {token_id} is outside the vocabulary [0, {self.vocab_size}) of "
                    f"the tokenizer in {self._source}. If the model's embedding is padded "
                    "beyond the tokenizer, mask logits of ids >= tokenizer.vocab_size when "
                    "sampling; otherwise the ids come from a different tokenizer."
                )

    def __repr__(self) -> str:
        return (
            f"HFTokenizer({self._source!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_ids={self.eos_ids}, pad_id={self.pad_id})"
        )


def check_vocab_matches(tokenizer: Tokenizer, model_vocab_size: int, *, where: str) -> None:
    """Raises ValueError if `tokenizer` has ids the model's embedding cannot hold.

    A model vocabulary larger than the tokenizer's is fine: models pad their
    embedding to a round size (Pythia: 50304 rows for a 50277-token tokenizer),
    and the extra rows are simply never produced by the tokenizer. `where` names
    the checkpoint (e.g. its path) in the error.
    """
    if tokenizer.vocab_size > model_vocab_size:
        raise ValueError(
            f"The tokenizer for {where} has {tokenizer.vocab_size} ids but the model's "
            f"vocabulary has only {model_vocab_size}, so ids >= {model_vocab_size} cannot "
            "be embedded. Load the tokenizer saved with this checkpoint, or build the model "
            f"with vocab_size >= {tokenizer.vocab_size}."
        )
