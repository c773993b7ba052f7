"""GSM8K grade-school math word problems as a TFDS builder (array_record, no TensorFlow).

Source: ``train.jsonl`` (7473 problems) and ``test.jsonl`` (1319) from the
openai/grade-school-math repository (MIT licence), each line a JSON object
with ``question`` and ``answer``; the answer is a worked solution whose last
line is ``#### <number>``. Given a manual directory holding both files, the
builder reads them from it (see `Gsm8k.MANUAL_DOWNLOAD_INSTRUCTIONS`);
otherwise it downloads them from GitHub (offline, TFDS retries for a few
minutes before the download fails with an error explaining the manual route).

Each example has ``id`` (the line index in its file), ``question``, ``answer``
(the full worked solution), ``final_answer`` (the number after ``####``,
commas removed) and ``prompt`` (`PROMPT_TEMPLATE` filled with the question,
the TBA paper's prompt). Building and reading need no TensorFlow; see
`tba_jax.data.builder_utils`.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from tba_jax.data import builder_utils
from tba_jax.rewards.gsm8k import extract_final_answer

PROMPT_TEMPLATE = "[MATH TASK] Problem:\n{question}\n\nSolution:\n"
SPLITS = ("train", "test")
SOURCE_REPOSITORY = "https://github.com/openai/grade-school-math"
SOURCE_URL_PREFIX = (
    "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/"
)
SPLIT_FILES = {split: f"{split}.jsonl" for split in SPLITS}
REQUIRED_FIELDS = ("question", "answer")


def format_prompt(question: str) -> str:
    """The model's prompt for one problem."""
    return PROMPT_TEMPLATE.format(question=question)


def make_example(index: int, record: dict) -> dict:
    """The example for the `index`-th line of a GSM8K file; SourceFileError unless its
    question and answer are text."""
    builder_utils.check_text_fields(record, REQUIRED_FIELDS, f"Problem {index}")
    return {
        "id": index,
        "question": record["question"],
        "answer": record["answer"],
        "final_answer": extract_final_answer(record["answer"]),
        "prompt": format_prompt(record["question"]),
    }


class Gsm8k(builder_utils.JsonlSourceBuilder):
    """GSM8K math word problems with worked solutions and numeric final answers."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Initial release."}
    FEATURES: ClassVar[dict] = {
        "id": np.int64,
        "question": tfds.features.Text(),
        "answer": tfds.features.Text(),
        "final_answer": tfds.features.Text(),
        "prompt": tfds.features.Text(),
    }
    SUPERVISED_KEYS = ("prompt", "answer")
    SPLIT_FILES: ClassVar[dict[str, str]] = SPLIT_FILES
    SOURCE_URLS: ClassVar[dict[str, str]] = {
        split: SOURCE_URL_PREFIX + filename for split, filename in SPLIT_FILES.items()
    }
    REQUIRED_FIELDS = REQUIRED_FIELDS
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        f"Download {' and '.join(SPLIT_FILES.values())} from {SOURCE_URL_PREFIX} "
        f"(the grade_school_math/data/ directory of {SOURCE_REPOSITORY}) into one directory, "
        "unchanged, and pass that directory as `manual_dir`."
    )

    def make_example(self, index: int, record: dict) -> dict:
        return make_example(index, record)


def load_split(
    split: str, data_dir: epath.PathLike, manual_dir: epath.PathLike | None = None
) -> list[dict]:
    """Examples of `split`, in file order, preparing the array_record files if needed."""
    return builder_utils.load_split(Gsm8k, split, data_dir, manual_dir)
