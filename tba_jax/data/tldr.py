"""Reddit TL;DR summarization (OpenAI's ``tldr_3_filtered``) as a TFDS builder.

Source: the filtered Reddit TL;DR set of "Learning to summarize from human
feedback" (Stiennon et al., 2020), which the TBA paper uses: ``train.jsonl``,
``valid.jsonl`` and ``test.jsonl`` under `SOURCE_URL_PREFIX`, each line a JSON
object with ``id``, ``subreddit``, ``title``, ``post`` and ``summary``. Given a
manual directory holding the three files, the builder reads them from it;
otherwise it downloads them.

Prompts follow the summarize-from-feedback code's query format,
`PROMPT_TEMPLATE` (``"SUBREDDIT: r/{subreddit}\\n\\nTITLE: {title}\\n\\nPOST:
{post}\\n\\nTL;DR:"``, no trailing space). A prompt over its length budget has
its POST cut at a whitespace boundary, keeping the longest prefix that fits
(`truncate_post`). The budget is counted in characters by default or in tokens
with any length function (`prompt_budget`); the builder stores the full
``post`` as well, so prompts can be rebuilt for a model's tokenizer with
`build_prompt`. ``reference_summary`` is the human summary verbatim; the
original code prepends a space when appending it to the prompt.

Splits: ``train``, ``validation`` (from ``valid.jsonl``) and ``test``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import ClassVar

import tensorflow_datasets as tfds
from etils import epath

from tba_jax.data import builder_utils

PROMPT_TEMPLATE = "SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
SOURCE_URL_PREFIX = (
    "https://openaipublic.blob.core.windows.net/summarize-from-feedback/datasets/tldr_3_filtered/"
)
SOURCE_REPOSITORY = "https://github.com/openai/summarize-from-feedback"
SPLIT_FILES = {"train": "train.jsonl", "validation": "valid.jsonl", "test": "test.jsonl"}
REQUIRED_FIELDS = ("id", "subreddit", "title", "post", "summary")
UNTRUNCATED_CONFIG_NAME = "untruncated"

# True when a prompt built with the given (possibly truncated) post is within budget.
BudgetFn = Callable[[str], bool]
LengthFn = Callable[[str], int]

_WHITESPACE_RUN = re.compile(r"\s+")

# --------------------------------------------------------------------------- prompts


def format_prompt(subreddit: str, title: str, post: str) -> str:
    """The query for one post, untruncated."""
    return PROMPT_TEMPLATE.format(subreddit=subreddit, title=title, post=post)


def prompt_budget(
    subreddit: str, title: str, max_length: int, length_fn: LengthFn = len
) -> BudgetFn:
    """A budget function: does the prompt with this post measure at most `max_length`?

    `length_fn` measures a whole prompt: ``len`` counts characters, and
    ``lambda text: len(tokenizer.encode(text))`` counts tokens.
    """
    return lambda post: length_fn(format_prompt(subreddit, title, post)) <= max_length


def whitespace_cut_points(post: str) -> list[int]:
    """Ascending lengths of the post's whitespace-boundary prefixes, starting with 0.

    Each prefix ``post[:cut]`` ends right before a run of whitespace, so it keeps
    only whole words and has no trailing whitespace.
    """
    return [0, *(match.start() for match in _WHITESPACE_RUN.finditer(post) if match.start())]


def longest_fitting_cut(post: str, cut_points: Sequence[int], budget_fn: BudgetFn) -> int | None:
    """The largest cut whose prefix fits, by binary search, or None if none fits.

    Assumes a longer prefix never measures less than a shorter one.
    """
    low, high = 0, len(cut_points)  # Prefixes before `low` fit; those from `high` on do not.
    while low < high:
        middle = (low + high) // 2
        if budget_fn(post[: cut_points[middle]]):
            low = middle + 1
        else:
            high = middle
    return cut_points[low - 1] if low else None


def truncate_post(post: str, budget_fn: BudgetFn) -> str:
    """`post` itself if it fits, else its longest whitespace-boundary prefix that fits.

    Raises ValueError when even an empty post does not fit (the subreddit and
    title alone exceed the budget).
    """
    if budget_fn(post):
        return post
    cut = longest_fitting_cut(post, whitespace_cut_points(post), budget_fn)
    if cut is None:
        raise ValueError(
            "The prompt exceeds its length budget even with an empty post (the subreddit and "
            "title alone are too long); raise the budget (e.g. max_prompt_chars)."
        )
    return post[:cut]


def build_prompt(
    subreddit: str,
    title: str,
    post: str,
    max_length: int | None = None,
    length_fn: LengthFn = len,
) -> str:
    """The query, with the post truncated so the prompt measures at most `max_length`."""
    if max_length is not None:
        post = truncate_post(post, prompt_budget(subreddit, title, max_length, length_fn))
    return format_prompt(subreddit, title, post)


# ------------------------------------------------------------------------------ TFDS


@dataclasses.dataclass(eq=False)
class TldrConfig(tfds.core.BuilderConfig):
    """A TL;DR builder config: the prompt budget in characters (None: untruncated)."""

    max_prompt_chars: int | None = None


def builder_config_name(max_prompt_chars: int | None) -> str:
    """A name encoding the budget, so each budget prepares into its own directory."""
    if max_prompt_chars is None:
        return UNTRUNCATED_CONFIG_NAME
    return f"max_prompt_chars_{max_prompt_chars}"


def _new_builder_config(max_prompt_chars: int | None) -> TldrConfig:
    if max_prompt_chars is not None and max_prompt_chars < 1:
        raise ValueError(
            f"max_prompt_chars={max_prompt_chars} must be a positive number of characters, "
            "or None for untruncated prompts."
        )
    budget = "untruncated" if max_prompt_chars is None else f"at most {max_prompt_chars} chars"
    return TldrConfig(
        name=builder_config_name(max_prompt_chars),
        description=f"Reddit TL;DR prompts, {budget}.",
        max_prompt_chars=max_prompt_chars,
    )


DEFAULT_BUILDER_CONFIG = _new_builder_config(None)


def builder_config_for(max_prompt_chars: int | None) -> TldrConfig:
    """The config for a budget (the registered object for the default, as TFDS requires)."""
    if max_prompt_chars == DEFAULT_BUILDER_CONFIG.max_prompt_chars:
        return DEFAULT_BUILDER_CONFIG
    return _new_builder_config(max_prompt_chars)


def make_example(record: dict, max_prompt_chars: int | None) -> dict:
    """The example for one source record; SourceFileError unless its fields are text,
    ValueError naming the record if it cannot fit."""
    builder_utils.check_text_fields(record, REQUIRED_FIELDS, f"Post {record['id']!r}")
    try:
        prompt = build_prompt(
            record["subreddit"], record["title"], record["post"], max_prompt_chars
        )
    except ValueError as error:
        raise ValueError(f"Post {record['id']!r}: {error}") from error
    return {
        "id": record["id"],
        "subreddit": record["subreddit"],
        "title": record["title"],
        "post": record["post"],
        "prompt": prompt,
        "reference_summary": record["summary"],
    }


class RedditTldr(builder_utils.JsonlSourceBuilder):
    """Reddit posts with human TL;DR summaries (OpenAI's filtered tldr_3 set)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS: ClassVar[list[tfds.core.BuilderConfig]] = [DEFAULT_BUILDER_CONFIG]
    FEATURES: ClassVar[dict] = {
        name: tfds.features.Text()
        for name in ("id", "subreddit", "title", "post", "prompt", "reference_summary")
    }
    SUPERVISED_KEYS = ("prompt", "reference_summary")
    SPLIT_FILES: ClassVar[dict[str, str]] = SPLIT_FILES
    SOURCE_URLS: ClassVar[dict[str, str]] = {
        split: SOURCE_URL_PREFIX + filename for split, filename in SPLIT_FILES.items()
    }
    REQUIRED_FIELDS = REQUIRED_FIELDS
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        f"Download {', '.join(SPLIT_FILES.values())} from {SOURCE_URL_PREFIX} (the "
        f"tldr_3_filtered set of {SOURCE_REPOSITORY}) into one directory, unchanged, and pass "
        "that directory as `manual_dir`."
    )

    def make_example(self, index: int, record: dict) -> dict:
        del index  # Records carry their own string ids.
        return make_example(record, self.builder_config.max_prompt_chars)


def load_split(
    split: str,
    data_dir: epath.PathLike,
    manual_dir: epath.PathLike | None = None,
    max_prompt_chars: int | None = None,
) -> list[dict]:
    """Examples of `split`, in file order, preparing the array_record files if needed."""
    config = builder_config_for(max_prompt_chars)
    return builder_utils.load_split(RedditTldr, split, data_dir, manual_dir, config)
