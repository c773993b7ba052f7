r"""Checks a Hugging Face checkpoint's conversion: transformers and tba_jax on the same batch.

    python experiments/compare_hf.py --hf_path=/ckpts/pythia-410m [--batch=3 --seq_len=16 --seed=0]

Runs one left-padded batch of random tokens through transformers (PyTorch, CPU, float32,
eager attention) and through tba_jax's import of the same folder, and prints one JSON line:
family, head, hf_path, num_params, tokenizer_vocab_size, batch, seq_len and
max_abs_logit_diff (the largest |difference| of the logits over real positions; of the
scores for a *ForSequenceClassification checkpoint). A tokenizer in the folder with more ids
than the model has embeddings is an error. torch and transformers are needed only here.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
from absl import flags

from tba_jax import cli
from tba_jax.models import hf, positions_from_mask, sequence_scores
from tba_jax.models.hf_tokenizer import (
    SENTENCEPIECE_MODEL,
    TOKENIZER_JSON,
    HFTokenizer,
    check_vocab_matches,
)

TOKENIZER_FILES = (TOKENIZER_JSON, SENTENCEPIECE_MODEL)  # either one makes a tokenizer
PAD_ID = 0  # real tokens are drawn from 1..vocab-1
SHORTEST_ROW_FRACTION = 3  # the last row holds about seq_len / 3 real tokens
DEFAULT_BATCH = 3
DEFAULT_SEQ_LEN = 16


def left_padded_batch(
    vocab_size: int, batch: int, seq_len: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Random tokens, row r right-aligned with length from seq_len down to about seq_len/3.

    Returns tokens [B, S] int32 (PAD_ID on padding) and mask [B, S] bool.
    """
    rng = np.random.default_rng(seed)
    shortest = max(1, seq_len // SHORTEST_ROW_FRACTION)
    lengths = np.linspace(seq_len, shortest, batch).round().astype(int)
    mask = np.arange(seq_len)[None, :] >= seq_len - lengths[:, None]
    tokens = rng.integers(PAD_ID + 1, vocab_size, size=(batch, seq_len))
    return np.where(mask, tokens, PAD_ID).astype(np.int32), mask


def hf_position_ids(mask: np.ndarray) -> np.ndarray:
    """Positions transformers' generate uses for a padded batch (real tokens before a slot)."""
    return np.asarray(positions_from_mask(mask))


def load_torch_model(hf_path: str, head: str):
    """The checkpoint in transformers (PyTorch, CPU, float32, eval mode, eager attention),
    loaded without transformers' progress bar (the command's output is its JSON line)."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
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


def tokenizer_vocab_size(hf_path: str, model_vocab_size: int) -> int | None:
    """The vocabulary size of the folder's tokenizer (None when it has no tokenizer files);
    a ValueError when the tokenizer has ids the model cannot embed."""
    if not any(os.path.isfile(os.path.join(hf_path, name)) for name in TOKENIZER_FILES):
        return None
    tokenizer = HFTokenizer.from_pretrained(hf_path)
    check_vocab_matches(tokenizer, model_vocab_size, where=hf_path)
    return tokenizer.vocab_size


def compare(
    hf_path: str, *, batch: int = DEFAULT_BATCH, seq_len: int = DEFAULT_SEQ_LEN, seed: int = 0
) -> dict[str, Any]:
    """Checks the folder's tokenizer fits the model, runs one left-padded batch through
    transformers and tba_jax, and returns the max |difference| of the logits (scores for a
    classifier) over real positions."""
    tokenizer_vocab = tokenizer_vocab_size(hf_path, hf.config_from_hf(hf_path).vocab_size)
    model, params = hf.load_model(hf_path)
    cfg = model.config
    seq_len = min(seq_len, cfg.max_seq_len)
    tokens, mask = left_padded_batch(cfg.vocab_size, batch, seq_len, seed)
    torch_model = load_torch_model(hf_path, cfg.head)
    if cfg.head == "score":
        torch_model.config.pad_token_id = PAD_ID  # finds each row's last real token
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
        tokenizer_vocab_size=tokenizer_vocab,
        batch=batch,
        seq_len=seq_len,
        max_abs_logit_diff=float(diff.max()),
    )


def define_flags() -> None:
    """The command line's flags, defined only when run as a script (tba_jax.cli's rule)."""
    flags.DEFINE_string("hf_path", None, "The checkpoint folder (config.json, *.safetensors).")
    flags.DEFINE_integer("batch", DEFAULT_BATCH, "Rows in the batch.", lower_bound=1)
    flags.DEFINE_integer(
        "seq_len", DEFAULT_SEQ_LEN, "Tokens per row (capped at max_seq_len).", lower_bound=1
    )
    flags.DEFINE_integer("seed", 0, "Seed of the random tokens.")
    flags.adopt_module_key_flags(cli)
    flags.mark_flags_as_required(["hf_path"])


def main(argv):
    del argv
    values = flags.FLAGS
    result = compare(values.hf_path, batch=values.batch, seq_len=values.seq_len, seed=values.seed)
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    define_flags()
    cli.run(main, user_errors=(FileNotFoundError, ValueError))
