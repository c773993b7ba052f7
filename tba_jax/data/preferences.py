r"""Preference pairs for reward-model training, as a TFDS builder (array_record, no TensorFlow).

The builder reads a manual directory holding ``train.jsonl`` and ``test.jsonl``, one
JSON object per line with ``prompt``, ``chosen`` and ``rejected`` (the response humans
preferred and the other one); each example also gets ``id``, its index in the split.
There is no public download of this format: make it from OpenAI's summarize-from-feedback
comparisons with `convert_comparisons` or the command below.

Comparisons (Stiennon et al. 2020) are JSONL records

    {"info": {"post", "title", "subreddit", ...}, "summaries": [{"text"}, {"text"}],
     "choice": 0 | 1, "split": "train" | "valid1" | "valid2", ...}

from https://openaipublic.blob.core.windows.net/summarize-from-feedback/dataset/comparisons/
(the ``batch*.json`` files; see https://github.com/openai/summarize-from-feedback), also
published as the ``comparisons`` configuration of the Hugging Face dataset
``openai/summarize_from_feedback`` (export its splits to JSONL). Each becomes a pair with
the TL;DR prompt format of `tba_jax.data.tldr` and responses ``" " + text.strip()`` (the
leading space Huang et al. 2024 put before a summary). Records of the ``train`` split go
to train.jsonl, the validation ones (``valid1``, ``valid2``, ``validation``) to
test.jsonl; comparisons of CNN/DM articles (no Reddit post) are skipped.

    python -m tba_jax.data.preferences --comparisons=/data/comparisons/batch*.json \
        --out=/data/tldr_preferences [--tokenizer=/ckpt/pythia-1b-sft --max_prompt_len=512]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections.abc import Iterable, Sequence
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from tba_jax.data import builder_utils, tldr

SPLIT_FILES = {"train": "train.jsonl", "test": "test.jsonl"}
PAIR_FIELDS = ("prompt", "chosen", "rejected")
# The `split` of a comparison record -> the preference split it goes to.
COMPARISON_SPLITS = {"train": "train", "valid1": "test", "valid2": "test", "validation": "test"}
RESPONSE_PREFIX = " "  # summaries follow "TL;DR:" after one space


# ---------------------------------------------------------------------------- builder


def make_example(index: int, record: dict) -> dict:
    """The example for the `index`-th pair of a split; SourceFileError unless its fields are
    text."""
    builder_utils.check_text_fields(record, PAIR_FIELDS, f"Pair {index}")
    return {"id": index, **{field: record[field] for field in PAIR_FIELDS}}


class PreferencePairs(builder_utils.JsonlSourceBuilder):
    """(prompt, chosen, rejected) preference pairs, from a manual directory."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Initial release."}
    FEATURES: ClassVar[dict] = {
        "id": np.int64,
        **{field: tfds.features.Text() for field in PAIR_FIELDS},
    }
    SPLIT_FILES: ClassVar[dict[str, str]] = SPLIT_FILES
    REQUIRED_FIELDS = PAIR_FIELDS
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Write train.jsonl and test.jsonl (one JSON object per line with prompt, chosen and "
        "rejected) to a directory, e.g. with `python -m tba_jax.data.preferences "
        "--comparisons=... --out=DIR` from OpenAI's summarize-from-feedback comparisons, and "
        "pass that directory as `manual_dir`."
    )

    def make_example(self, index: int, record: dict) -> dict:
        return make_example(index, record)


def load_split(
    split: str, data_dir: epath.PathLike, manual_dir: epath.PathLike | None = None
) -> list[dict]:
    """Pairs of `split` ("train" | "test"), in file order, preparing the data if needed."""
    return builder_utils.load_split(PreferencePairs, split, data_dir, manual_dir)


# --------------------------------------------------------- summarize-from-feedback records


# The keys of a summarize-from-feedback comparison record that a pair is made from.
COMPARISON_KEYS = ("info", "summaries", "choice")


def comparison_to_pair(
    record: dict, *, max_prompt_len: int | None = None, length_fn: tldr.LengthFn = len
) -> dict | None:
    """The pair of one comparison record, or None for a CNN/DM one (no Reddit post).

    The prompt is `tldr.build_prompt`'s, its post truncated at whitespace to measure at
    most `max_prompt_len` with `length_fn` (None: untruncated).
    """
    missing = [key for key in COMPARISON_KEYS if key not in record]
    if missing:
        raise ValueError(
            f"A comparison record has no {', '.join(missing)} (its keys: {sorted(record)}); "
            f"expected summarize-from-feedback's {', '.join(COMPARISON_KEYS)}."
        )
    info = record["info"]
    if not info.get("post"):
        return None
    summaries, choice = record["summaries"], record["choice"]
    if len(summaries) != 2 or choice not in (0, 1):
        raise ValueError(
            f"A comparison of post {info.get('id')!r} has {len(summaries)} summaries and "
            f"choice={choice!r}; expected 2 summaries and choice 0 or 1."
        )
    prompt = tldr.build_prompt(
        info["subreddit"], info["title"], info["post"], max_prompt_len, length_fn
    )
    return {
        "prompt": prompt,
        "chosen": RESPONSE_PREFIX + summaries[choice]["text"].strip(),
        "rejected": RESPONSE_PREFIX + summaries[1 - choice]["text"].strip(),
    }


def convert_comparisons(
    records: Iterable[dict], *, max_prompt_len: int | None = None, length_fn: tldr.LengthFn = len
) -> dict[str, list[dict]]:
    """{"train": pairs, "test": pairs} from comparison records, routed by their `split`."""
    pairs: dict[str, list[dict]] = {split: [] for split in SPLIT_FILES}
    for record in records:
        split = record.get("split")
        if split not in COMPARISON_SPLITS:
            raise ValueError(
                f"A comparison record has split={split!r}; expected one of "
                f"{sorted(COMPARISON_SPLITS)} (as in summarize-from-feedback's files)."
            )
        pair = comparison_to_pair(record, max_prompt_len=max_prompt_len, length_fn=length_fn)
        if pair is not None:
            pairs[COMPARISON_SPLITS[split]].append(pair)
    return pairs


def write_pairs(out_dir: str, pairs: dict[str, list[dict]]) -> dict[str, int]:
    """Writes train.jsonl and test.jsonl to `out_dir`; returns the pair count per split."""
    os.makedirs(out_dir, exist_ok=True)
    for split, filename in SPLIT_FILES.items():
        with open(os.path.join(out_dir, filename), "w", encoding=builder_utils.TEXT_ENCODING) as f:
            f.writelines(json.dumps(pair) + "\n" for pair in pairs[split])
    return {split: len(rows) for split, rows in pairs.items()}


def read_comparison_files(patterns: Sequence[str]) -> list[dict]:
    """Every record of the JSONL files matching `patterns` (globs), in sorted file order."""
    paths = sorted({path for pattern in patterns for path in glob.glob(pattern)})
    if not paths:
        raise FileNotFoundError(f"No comparison file matches {list(patterns)}.")
    return [record for path in paths for record in builder_utils.read_jsonl(path)]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tba_jax.data.preferences", description=__doc__)
    parser.add_argument("--comparisons", nargs="+", required=True, help="comparison JSONL files")
    parser.add_argument("--out", required=True, help="directory for train.jsonl and test.jsonl")
    parser.add_argument("--tokenizer", default="", help="HF folder: count max_prompt_len in tokens")
    parser.add_argument("--max_prompt_len", type=int, default=None, help="prompt budget")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Converts comparison files to pairs; a file or record that cannot be converted is one
    `error: ...` line on stderr and status 1."""
    args = _parser().parse_args(argv)
    try:
        return convert_files(args)
    except (ValueError, FileNotFoundError) as error:  # ConfigError / SourceFileError too
        print("error: " + " ".join(str(error).split()), file=sys.stderr)
        return 1


def convert_files(args: argparse.Namespace) -> int:
    length_fn = len
    if args.tokenizer:
        from tba_jax.models.hf_tokenizer import HFTokenizer

        tokenizer = HFTokenizer.from_pretrained(args.tokenizer)
        length_fn = lambda text: len(tokenizer.encode(text))
    pairs = convert_comparisons(
        read_comparison_files(args.comparisons),
        max_prompt_len=args.max_prompt_len,
        length_fn=length_fn,
    )
    print(json.dumps({"out": args.out, "pairs": write_pairs(args.out, pairs)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
