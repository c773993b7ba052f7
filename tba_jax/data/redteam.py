"""Red-teaming seed prompts as a TFDS builder (array_record, no TensorFlow).

There is no public download: the builder reads a manual directory holding
the train split as ``seed_prompts.jsonl`` (one JSON object per line with a
``prompt`` and an optional ``category``) or ``seed_prompts.txt`` (one prompt
per line; blank lines are skipped), and optionally a test split as
``seed_prompts_test.jsonl`` or ``seed_prompts_test.txt``. Each example has
``id`` (its index among the split's prompts), ``prompt`` and ``category``
(`DEFAULT_CATEGORY` when the source gives none).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from tba_jax.data import builder_utils

SPLIT_FILE_STEMS = {"train": "seed_prompts", "test": "seed_prompts_test"}
REQUIRED_SPLITS = ("train",)
JSONL_SUFFIX = ".jsonl"
TEXT_SUFFIX = ".txt"
SOURCE_SUFFIXES = (JSONL_SUFFIX, TEXT_SUFFIX)
DEFAULT_CATEGORY = ""


def candidate_filenames(split: str) -> list[str]:
    """The file names a split may come from, e.g. seed_prompts.jsonl and seed_prompts.txt."""
    return [SPLIT_FILE_STEMS[split] + suffix for suffix in SOURCE_SUFFIXES]


def expected_files_description() -> str:
    """Which files a manual directory must (and may) hold, for error messages."""
    described = []
    for split in SPLIT_FILE_STEMS:
        requirement = "required" if split in REQUIRED_SPLITS else "optional"
        described.append(f"{' or '.join(candidate_filenames(split))} ({split}, {requirement})")
    return "; ".join(described)


def find_split_file(manual_dir: epath.Path, split: str) -> epath.Path | None:
    """The one source file of `split` in `manual_dir`, or None; SourceFileError if ambiguous."""
    present = [manual_dir / name for name in candidate_filenames(split)]
    present = [path for path in present if path.is_file()]
    if len(present) > 1:
        raise builder_utils.SourceFileError(
            f"Both {' and '.join(path.name for path in present)} are in {manual_dir}; keep "
            f"exactly one source file for the {split} split."
        )
    return present[0] if present else None


def text_field(record: dict, field: str, index: int, default: str | None = None) -> str:
    """`record[field]` as a string (or `default` when absent); SourceFileError if not text."""
    value = record.get(field, default)
    if not isinstance(value, str):
        raise builder_utils.SourceFileError(
            f"Seed prompt {index} has {field}={value!r}; it must be a string."
        )
    return value


def make_example(index: int, record: dict) -> dict:
    """The example for the `index`-th seed prompt of a split."""
    prompt = text_field(record, "prompt", index)
    if not prompt.strip():
        raise builder_utils.SourceFileError(
            f"Seed prompt {index} is empty; remove it or write the prompt."
        )
    return {
        "id": index,
        "prompt": prompt,
        "category": text_field(record, "category", index, default=DEFAULT_CATEGORY),
    }


class RedTeamSeedPrompts(builder_utils.JsonlSourceBuilder):
    """Seed prompts for red-teaming, from a manual directory."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Initial release."}
    FEATURES: ClassVar[dict] = {
        "id": np.int64,
        "prompt": tfds.features.Text(),
        "category": tfds.features.Text(),
    }
    REQUIRED_FIELDS = ("prompt",)
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Write the seed prompts to a directory as seed_prompts.jsonl (one JSON object per line, "
        'e.g. {"prompt": "...", "category": "..."}) or seed_prompts.txt (one prompt per line), '
        "optionally with a test split in seed_prompts_test.jsonl or seed_prompts_test.txt, and "
        "pass that directory as `manual_dir`."
    )

    def expected_files(self) -> str:
        return expected_files_description()

    def manual_source_paths(self, manual_dir: epath.PathLike) -> dict[str, epath.Path]:
        manual_dir = epath.Path(manual_dir).expanduser()
        paths = {split: find_split_file(manual_dir, split) for split in SPLIT_FILE_STEMS}
        missing = [split for split in REQUIRED_SPLITS if paths[split] is None]
        if missing:
            missing_names = [" or ".join(candidate_filenames(split)) for split in missing]
            raise FileNotFoundError(
                builder_utils.missing_manual_files_message(
                    manual_dir,
                    missing_names,
                    self.expected_files(),
                    self.MANUAL_DOWNLOAD_INSTRUCTIONS,
                )
            )
        return {split: path for split, path in paths.items() if path is not None}

    def read_records(self, path: epath.Path) -> list[dict]:
        if path.suffix == TEXT_SUFFIX:
            return [{"prompt": line} for line in builder_utils.read_text_lines(path)]
        return builder_utils.read_jsonl(path, self.REQUIRED_FIELDS)

    def make_example(self, index: int, record: dict) -> dict:
        return make_example(index, record)


def load_split(
    split: str, data_dir: epath.PathLike, manual_dir: epath.PathLike | None = None
) -> list[dict]:
    """Examples of `split`, in file order, preparing the array_record files if needed."""
    return builder_utils.load_split(RedTeamSeedPrompts, split, data_dir, manual_dir)
