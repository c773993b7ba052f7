"""Tokenizers: the interface the rest of tba_jax uses, and a character tokenizer.

`Tokenizer` is what samplers, scorers and data pipelines rely on; a Hugging Face
wrapper implements the same protocol. `CharTokenizer` maps each character of
a fixed alphabet to one id: the built-in arithmetic task and the tiny variants of the
text tasks (`CharTokenizer.for_text()`) train with it, and `save_pretrained` writes
it as a tokenizer.json that transformers loads.

Conventions shared by every implementation:
- `encode` returns the text's ids without special tokens unless asked
  (``add_bos`` / ``add_eos``; None means the tokenizer's own default, which for
  CharTokenizer is no special tokens);
- `decode` drops pad and BOS ids and stops at the first EOS;
- `encode_batch` pads to ``max_len`` with ``pad_id``: on the left for prompts
  that decoding continues from (``left_pad=True``), on the right otherwise;
  `encode_prompts` left-pads and also returns the mask of real tokens, taken from
  the lengths (a prompt may hold the pad id as text when pad = EOS).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
NUM_SPECIAL_IDS = 3

# `CharTokenizer.for_text()`: newline and printable ASCII (text tasks with a tiny policy).
PRINTABLE_ASCII = "".join(chr(code) for code in range(ord(" "), ord("~") + 1))
TEXT_ALPHABET = "\n" + PRINTABLE_ASCII
# Special-token spellings of a char tokenizer saved for transformers (ids as above).
CHAR_SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}
ARITHMETIC_DIGITS = "0123456789"
# Punctuation of the arithmetic task format (see tba_jax/data/arithmetic.py):
# "=" ends the prompt, "," separates running totals, ">" marks the final answer.
ARITHMETIC_PUNCTUATION = "=,>"


@runtime_checkable
class Tokenizer(Protocol):
    """What tba_jax needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(
        self, text: str, *, add_bos: bool | None = None, add_eos: bool | None = None
    ) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def encode_batch(
        self,
        texts: Sequence[str],
        max_len: int,
        *,
        left_pad: bool,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
    ) -> np.ndarray: ...

    def encode_prompts(
        self, texts: Sequence[str], max_len: int
    ) -> tuple[np.ndarray, np.ndarray]: ...

    def decode_batch(self, ids: Iterable[Iterable[int]]) -> list[str]: ...


# Texts two tokenizers must encode alike to be taken as one: letters, digits, punctuation,
# whitespace runs and non-ASCII text (byte-level fallbacks differ there first).
PROBE_TEXTS = (
    "TL;DR: The quick brown fox jumps over the lazy dog.",
    "  Q: 12 + 30 = 42?\n\tA: yes, 42 >= 41 (100%)  ",
    "Naïve café — “quoted” 日本語 ❤",
)


def tokenizer_mismatch(a: Tokenizer, b: Tokenizer, texts: Sequence[str] = PROBE_TEXTS) -> str:
    """Why `a` and `b` do not map text to the same ids ("" when their vocabulary sizes,
    special ids and the ids of every text in `texts` agree; a text neither can encode,
    e.g. outside a character alphabet, is skipped)."""
    for name in ("vocab_size", "pad_id", "bos_id", "eos_id"):
        if getattr(a, name) != getattr(b, name):
            return f"{name} {getattr(a, name)} vs {getattr(b, name)}"
    for text in texts:
        ids_a, ids_b = _ids_or_error(a, text), _ids_or_error(b, text)
        if ids_a != ids_b:
            return f"{text!r} encodes to {ids_a} vs {ids_b}"
    return ""


def _ids_or_error(tokenizer: Tokenizer, text: str) -> list[int] | str:
    """The ids of `text`, or "cannot encode it" (compares equal only to another refusal)."""
    try:
        return tokenizer.encode(text)
    except ValueError:
        return "cannot encode it"


def pad_sequences_with_mask(
    sequences: Sequence[Sequence[int]],
    max_len: int,
    *,
    pad_id: int,
    left_pad: bool,
    texts: Sequence[str] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Stack id sequences into int32 tokens [N, max_len] padded with `pad_id`, and the bool
    mask [N, max_len] of real tokens.

    The mask comes from each sequence's length, never from `tokens != pad_id`: a
    tokenizer without a pad token pads with EOS, which chat-formatted prompts also hold as
    real text (e.g. Llama 3's "<|eot_id|>"). A sequence longer than `max_len` is a
    ValueError; `texts`, when given, name the offending text in the message.
    """
    if max_len < 0:
        raise ValueError(f"max_len={max_len} must be >= 0.")
    batch = np.full((len(sequences), max_len), pad_id, dtype=np.int32)
    mask = np.zeros((len(sequences), max_len), dtype=bool)
    for row, ids in enumerate(sequences):
        if len(ids) > max_len:
            described = f"Text {texts[row]!r}" if texts is not None else f"Sequence {row}"
            raise ValueError(
                f"{described} is {len(ids)} tokens long but max_len={max_len}; "
                "raise max_len or shorten the text."
            )
        if not ids:
            continue
        span = slice(max_len - len(ids), max_len) if left_pad else slice(0, len(ids))
        batch[row, span] = ids
        mask[row, span] = True
    return batch, mask


def pad_sequences(
    sequences: Sequence[Sequence[int]],
    max_len: int,
    *,
    pad_id: int,
    left_pad: bool,
    texts: Sequence[str] | None = None,
) -> np.ndarray:
    """The tokens of `pad_sequences_with_mask`: int32 [N, max_len] padded with `pad_id`."""
    return pad_sequences_with_mask(
        sequences, max_len, pad_id=pad_id, left_pad=left_pad, texts=texts
    )[0]


class BatchCoding:
    """`encode_batch` / `decode_batch` for a tokenizer with `encode`, `decode` and `pad_id`."""

    def encode_batch(
        self,
        texts: Sequence[str],
        max_len: int,
        *,
        left_pad: bool,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
    ) -> np.ndarray:
        """int32 [len(texts), max_len], padded with `pad_id` (left for prompts)."""
        sequences = [self.encode(t, add_bos=add_bos, add_eos=add_eos) for t in texts]
        return pad_sequences(sequences, max_len, pad_id=self.pad_id, left_pad=left_pad, texts=texts)

    def encode_prompts(self, texts: Sequence[str], max_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Left-padded prompt tokens int32 [N, max_len] and their bool mask (True on real
        tokens, from the lengths: prompts may hold the pad id as text)."""
        sequences = [self.encode(t) for t in texts]
        return pad_sequences_with_mask(
            sequences, max_len, pad_id=self.pad_id, left_pad=True, texts=texts
        )

    def decode_batch(self, ids: Iterable[Iterable[int]]) -> list[str]:
        return [self.decode(row) for row in ids]


class CharTokenizer(BatchCoding):
    """One id per character of `alphabet`, after pad=0, bos=1 and eos=2."""

    TYPE_NAME = "char"

    def __init__(self, alphabet: str):
        if not alphabet:
            raise ValueError("CharTokenizer needs a non-empty alphabet.")
        repeated = sorted({c for c in alphabet if alphabet.count(c) > 1})
        if repeated:
            raise ValueError(
                f"Alphabet {alphabet!r} repeats {''.join(repeated)!r}; list each character once."
            )
        self._alphabet = alphabet
        self._char_to_id = {c: NUM_SPECIAL_IDS + i for i, c in enumerate(alphabet)}

    @classmethod
    def for_arithmetic(cls, ops: str = "+-") -> CharTokenizer:
        """Digits, the task's operators and its punctuation."""
        return cls(ARITHMETIC_DIGITS + ops + ARITHMETIC_PUNCTUATION)

    @classmethod
    def for_text(cls) -> CharTokenizer:
        """Newline and printable ASCII: text tasks (GSM8K, TL;DR, red-teaming) at tiny scale."""
        return cls(TEXT_ALPHABET)

    @property
    def alphabet(self) -> str:
        return self._alphabet

    @property
    def vocab_size(self) -> int:
        return NUM_SPECIAL_IDS + len(self._alphabet)

    @property
    def pad_id(self) -> int:
        return PAD_ID

    @property
    def bos_id(self) -> int:
        return BOS_ID

    @property
    def eos_id(self) -> int:
        return EOS_ID

    def _char_id(self, char: str, text: str) -> int:
        try:
            return self._char_to_id[char]
        except KeyError:
            raise ValueError(
                f"Character {char!r} in {text!r} is not in the tokenizer alphabet "
                f"{self._alphabet!r}; build the tokenizer with an alphabet that contains it."
            ) from None

    def encode(
        self, text: str, *, add_bos: bool | None = None, add_eos: bool | None = None
    ) -> list[int]:
        ids = [self._char_id(c, text) for c in text]
        if add_bos:
            ids.insert(0, BOS_ID)
        if add_eos:
            ids.append(EOS_ID)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        chars = []
        for token_id in ids:
            token_id = int(token_id)
            if token_id == EOS_ID:
                break
            if token_id in (PAD_ID, BOS_ID):
                continue
            if not NUM_SPECIAL_IDS <= token_id < self.vocab_size:
                raise ValueError(
                    f"Token id {token_id} is outside this tokenizer's vocabulary "
                    f"[0, {self.vocab_size}); was it produced with a different tokenizer?"
                )
            chars.append(self._alphabet[token_id - NUM_SPECIAL_IDS])
        return "".join(chars)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable description, e.g. for checkpoint metadata."""
        return {"type": self.TYPE_NAME, "alphabet": self._alphabet}

    @classmethod
    def from_dict(cls, description: dict[str, Any]) -> CharTokenizer:
        """Inverse of `to_dict`."""
        if description.get("type") != cls.TYPE_NAME or "alphabet" not in description:
            raise ValueError(
                f"{description!r} does not describe a CharTokenizer; expected "
                f"{{'type': {cls.TYPE_NAME!r}, 'alphabet': ...}} as written by to_dict()."
            )
        return cls(description["alphabet"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.alphabet == self.alphabet

    def __hash__(self) -> int:
        return hash((self.TYPE_NAME, self._alphabet))

    def __repr__(self) -> str:
        return f"CharTokenizer(alphabet={self._alphabet!r})"

    def to_fast_tokenizer(self):
        """A `tokenizers.Tokenizer` with the same ids and decoding: a BPE over single
        characters with no merges, joined back without spaces."""
        import tokenizers

        specials = list(CHAR_SPECIAL_TOKENS.values())
        vocab = dict(zip(specials, [self.pad_id, self.bos_id, self.eos_id], strict=True))
        vocab.update({char: self._char_to_id[char] for char in self.alphabet})
        fast = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token=None))
        fast.decoder = tokenizers.decoders.Fuse()
        fast.add_special_tokens([tokenizers.AddedToken(token, special=True) for token in specials])
        return fast

    def save_pretrained(self, out_dir: str) -> list[str]:
        """Writes tokenizer.json and tokenizer_config.json with the same ids (no BOS/EOS
        added by default), which `HFTokenizer` and transformers load. Returns the paths."""
        json_path = os.path.join(out_dir, "tokenizer.json")
        self.to_fast_tokenizer().save(json_path)
        config_path = os.path.join(out_dir, "tokenizer_config.json")
        tokenizer_config = {
            **CHAR_SPECIAL_TOKENS,
            "add_bos_token": False,
            "add_eos_token": False,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        with open(config_path, "w") as f:
            json.dump(tokenizer_config, f, indent=2)
        return [json_path, config_path]
