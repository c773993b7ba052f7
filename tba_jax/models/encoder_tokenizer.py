"""Tokenizers of BERT / RoBERTa checkpoint folders, as `tokenizers.Tokenizer`s.

`load_tokenizer(folder, family, max_length)` loads the folder's tokenizer.json through the
`tokenizers` library (its post-processor adds [CLS]/[SEP] or <s>/</s>); a folder without one
is rebuilt from its vocabulary files as transformers converts them: vocab.json + merges.txt
(RoBERTa's byte-level BPE) or vocab.txt (BERT's WordPiece), with the special tokens
tokenizer_config.json / special_tokens_map.json name (the family's defaults otherwise).
`max_length_of` and `lowercases_texts` read how a folder wants texts truncated and cased
(sentence_bert_config.json, tokenizer_config.json). Used by `encoder.TextEncoder`; decoder
checkpoints' tokenizers are `hf_tokenizer.HFTokenizer`.
"""

from __future__ import annotations

import pathlib
from typing import Any

from tba_jax.models.hf_checkpoint import read_optional_json_object
from tba_jax.models.hf_tokenizer import (
    SPECIAL_TOKENS_MAP,
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    import_or_explain,
)

SENTENCE_BERT_CONFIG = "sentence_bert_config.json"

# Special tokens of tokenizers rebuilt from vocabulary files (tokenizer_config.json wins).
ADDED_TOKEN_FLAGS = ("lstrip", "rstrip", "single_word", "normalized")
DEFAULT_SPECIAL_TOKENS = {
    "roberta": {
        "cls_token": "<s>",
        "sep_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
    },
    "bert": {
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "mask_token": "[MASK]",
    },
}


def _special_tokens(tokenizer_config: dict[str, Any], family: str) -> dict[str, Any]:
    """`tokenizers.AddedToken` per special-token key: as tokenizer_config.json (merged with
    special_tokens_map.json) spells it — a string or a dict with "content" and optional
    lstrip / rstrip / single_word / normalized flags — else the family's default."""
    from tokenizers import AddedToken

    tokens = {}
    for key, default in DEFAULT_SPECIAL_TOKENS[family].items():
        entry = tokenizer_config.get(key) or default
        if not isinstance(entry, dict):
            entry = {"content": str(entry)}
        flags = {flag: bool(entry[flag]) for flag in ADDED_TOKEN_FLAGS if flag in entry}
        tokens[key] = AddedToken(entry["content"], special=True, **flags)
    return tokens


def _require_token_id(tokenizer: Any, token: str, folder: pathlib.Path) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"The vocabulary in {folder} has no {token!r} token.")
    return token_id


def _roberta_tokenizer_from_vocab(folder: pathlib.Path, tokenizer_config: dict[str, Any]):
    """RoBERTa's byte-level BPE from vocab.json + merges.txt, as transformers converts it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    add_prefix_space = bool(tokenizer_config.get("add_prefix_space", False))
    tokenizer = Tokenizer(
        models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt"))
    )
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tokenizer.decoder = decoders.ByteLevel()
    specials = _special_tokens(tokenizer_config, "roberta")
    tokenizer.add_special_tokens(list(specials.values()))
    cls, sep = specials["cls_token"].content, specials["sep_token"].content
    tokenizer.post_processor = processors.RobertaProcessing(
        (sep, _require_token_id(tokenizer, sep, folder)),
        (cls, _require_token_id(tokenizer, cls, folder)),
        trim_offsets=True,
        add_prefix_space=add_prefix_space,
    )
    return tokenizer


def _bert_tokenizer_from_vocab(folder: pathlib.Path, tokenizer_config: dict[str, Any]):
    """BERT's WordPiece from vocab.txt, as transformers converts it."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    specials = _special_tokens(tokenizer_config, "bert")
    tokenizer = Tokenizer(
        models.WordPiece.from_file(
            str(folder / "vocab.txt"), unk_token=specials["unk_token"].content
        )
    )
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=bool(tokenizer_config.get("tokenize_chinese_chars", True)),
        strip_accents=tokenizer_config.get("strip_accents"),
        lowercase=bool(tokenizer_config.get("do_lower_case", True)),
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.add_special_tokens(list(specials.values()))
    cls, sep = specials["cls_token"].content, specials["sep_token"].content
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0",
        pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[
            (cls, _require_token_id(tokenizer, cls, folder)),
            (sep, _require_token_id(tokenizer, sep, folder)),
        ],
    )
    return tokenizer


VOCAB_FILES = {"roberta": ("vocab.json", "merges.txt"), "bert": ("vocab.txt",)}
VOCAB_TOKENIZERS = {"roberta": _roberta_tokenizer_from_vocab, "bert": _bert_tokenizer_from_vocab}


def load_tokenizer(folder: pathlib.Path, family: str, max_length: int):
    """The folder's `tokenizers.Tokenizer`, truncating to `max_length`, padding off."""
    tokenizers = import_or_explain("tokenizers", folder)
    if (folder / TOKENIZER_JSON).is_file():
        tokenizer = tokenizers.Tokenizer.from_file(str(folder / TOKENIZER_JSON))
    elif all((folder / name).is_file() for name in VOCAB_FILES[family]):
        tokenizer_config = {
            **read_optional_json_object(folder / SPECIAL_TOKENS_MAP),
            **read_optional_json_object(folder / TOKENIZER_CONFIG),
        }
        tokenizer = VOCAB_TOKENIZERS[family](folder, tokenizer_config)
    else:
        raise FileNotFoundError(
            f"No tokenizer in {folder}: expected {TOKENIZER_JSON} or "
            f"{' + '.join(VOCAB_FILES[family])} for a {family} checkpoint. Copy the "
            "tokenizer files saved with the model into the folder."
        )
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_length)
    return tokenizer


def max_length_of(folder: pathlib.Path, limit: int, requested: int | None) -> int:
    """Tokens per text: `requested`, else the smallest of `limit` (what the position
    embeddings hold), sentence_bert_config.json's max_seq_length and tokenizer_config.json's
    model_max_length."""
    if requested is not None:
        if not 0 < requested <= limit:
            raise ValueError(
                f"max_length={requested} must be in [1, {limit}] (the checkpoint's position "
                "embeddings hold at most that many tokens)."
            )
        return requested
    sentence_config = read_optional_json_object(folder / SENTENCE_BERT_CONFIG)
    tokenizer_config = read_optional_json_object(folder / TOKENIZER_CONFIG)
    candidates = [
        limit,
        sentence_config.get("max_seq_length"),
        tokenizer_config.get("model_max_length"),
    ]
    return int(min(c for c in candidates if isinstance(c, int | float) and c > 0))


def lowercases_texts(folder: pathlib.Path) -> bool:
    """sentence_bert_config.json's do_lower_case (sentence-transformers lowercases texts)."""
    return bool(read_optional_json_object(folder / SENTENCE_BERT_CONFIG).get("do_lower_case"))
