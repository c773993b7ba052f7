"""Scalar reward models: a frozen `head="score"` model that scores prompt + response texts.

The input of a reward model is encoded with *its own* tokenizer (which may differ from
the policy's) as

    [prefix] + prompt ids + response ids + [EOS]

where `prefix` is what the tokenizer puts before any text by default (BOS for Llama
tokenizers, nothing for Pythia's and the char tokenizer), prompt and response are
encoded separately without special tokens (the token-level concatenation of query and
response that Huang et al. 2024, "The N+ implementation details of RLHF with PPO", feed
their TL;DR reward models), and the EOS (`append_eos`) is the token the score is read
at: their reward models are trained on summaries that end with EOS and read at it.
A sequence longer than `max_len` loses prompt tokens from the left (after the prefix);
the response is always kept whole.

Rows are right-padded to a bucketed length (`bucket_lengths`: powers of two from
`min_bucket_len`, capped at `max_len`) and batched `batch_size` rows at a time (a short
last batch is filled by repeating its first row), so the jitted forward compiles once
per bucket. The score is label 0 of a num_labels=1 head at each row's last real token,
found from the mask (`tba_jax.models.sequence_scores`).

Note for tokenizers whose pad id is their EOS id (Pythia's): transformers'
*ForSequenceClassification finds the last token by `input_ids != pad_token_id` and so
skips a final EOS; this module reads the score at the EOS itself, as the reward-model
trainer (`tba_jax.train_reward_model`) trains it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import ml_collections
import numpy as np

from tba_jax.mesh import jit_on_mesh
from tba_jax.models import Model, sequence_scores
from tba_jax.models.frozen import (
    FrozenModel,
    Placement,
    frozen_role_config,
    load_frozen_model,
)
from tba_jax.models.tokenizers import Tokenizer, pad_sequences_with_mask

MIN_BUCKET_LEN = 64  # the shortest padded length; buckets double from here up to max_len
SCORE_LABEL = 0  # a scalar reward model's only label


# ------------------------------------------------------------------------------ encoding


def special_prefix(tokenizer: Tokenizer) -> list[int]:
    """The ids the tokenizer puts before any text by default (e.g. [BOS]; often [])."""
    return tokenizer.encode("", add_eos=False)


def encode_scored_text(
    tokenizer: Tokenizer, prompt: str, response: str, *, max_len: int, append_eos: bool
) -> list[int]:
    """The ids a reward model scores for one (prompt, response); see the module docstring.

    Keeps the response whole and drops prompt tokens from the left to fit `max_len`;
    ValueError when the response alone (with prefix and EOS) is longer than `max_len`.
    """
    prefix = special_prefix(tokenizer)
    prompt_ids = tokenizer.encode(prompt, add_bos=False, add_eos=False)
    response_ids = tokenizer.encode(response, add_bos=False, add_eos=False)
    suffix = [tokenizer.eos_id] if append_eos else []
    room = max_len - len(prefix) - len(response_ids) - len(suffix)
    if room < 0:
        raise ValueError(
            f"The response {response[:80]!r}... is {len(response_ids)} tokens, more than the "
            f"reward model's max_len={max_len} leaves after the prefix and EOS; raise max_len."
        )
    kept_prompt = prompt_ids[len(prompt_ids) - room :] if len(prompt_ids) > room else prompt_ids
    return [*prefix, *kept_prompt, *response_ids, *suffix]


def bucket_lengths(max_len: int, min_len: int = MIN_BUCKET_LEN) -> list[int]:
    """Padded lengths rows are rounded up to: min_len, 2·min_len, ... (< max_len), max_len."""
    if max_len < 1 or min_len < 1:
        raise ValueError(f"max_len={max_len} and min_len={min_len} must be >= 1.")
    lengths = []
    length = min_len
    while length < max_len:
        lengths.append(length)
        length *= 2
    return [*lengths, max_len]


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding `length` tokens (ValueError above the largest)."""
    for bucket in buckets:
        if length <= bucket:
            return bucket
    raise ValueError(f"A sequence of {length} tokens is longer than every bucket {list(buckets)}.")


def make_scalar_score_fn(model: Model):
    """Jitted `(params, tokens [B, S], mask [B, S]) -> scores [B]` (label 0 at the last token)."""
    return jit_on_mesh(
        lambda params, tokens, mask: sequence_scores(model, params, tokens, mask)[:, 0]
    )


# ------------------------------------------------------------------------------- the model


def reward_model_args(role: ml_collections.ConfigDict, role_name: str) -> dict:
    """`load_frozen_model`'s arguments for the reward model `role` (e.g. `role_name`
    "task.reward_model"), beside the role, the fallback tokenizer and the placement: one
    scalar label over `max_len` tokens. `frozen_model_layout` with them checks a mesh
    before the model loads."""
    return dict(role_name=role_name, max_seq_len=role.max_len, head="score", num_labels=1)


def reward_model_role_config(
    *,
    preset_name: str = "",
    seed: int = 0,
    dtype: str = "float32",
    batch_size: int = 32,
    max_len: int = 512,
    append_eos: bool = True,
    min_bucket_len: int = MIN_BUCKET_LEN,
) -> ml_collections.ConfigDict:
    """A config section for a reward model: `frozen_role_config`'s hf_path / preset / seed /
    dtype plus `batch_size` (rows per forward), `max_len` (tokens per row), `append_eos`
    and `min_bucket_len` (the shortest padded length; >= max_len: one shape only).

    An empty `preset` means no random stand-in: `hf_path` is then required.
    """
    role = frozen_role_config(preset_name=preset_name, seed=seed, dtype=dtype)
    role.batch_size = batch_size
    role.max_len = max_len
    role.append_eos = append_eos
    role.min_bucket_len = min_bucket_len
    return role


class RewardModel:
    """A frozen scalar reward model with its tokenizer and a jitted, bucketed scorer.

    `scores(prompts, responses) -> float32 [N]`; `__call__(examples, responses)` is the
    `Task.rewards` contract (prompt = example["prompt"]).
    """

    def __init__(
        self,
        frozen: FrozenModel,
        *,
        batch_size: int,
        max_len: int,
        append_eos: bool = True,
        min_bucket_len: int = MIN_BUCKET_LEN,
    ):
        config = frozen.model.config
        if config.head != "score" or config.num_labels != 1:
            raise ValueError(
                f"The reward model from {frozen.source} has head={config.head!r}, "
                f"num_labels={config.num_labels}; a scalar reward model needs head='score' "
                "with num_labels=1 (a *ForSequenceClassification checkpoint with one label)."
            )
        if batch_size < 1:
            raise ValueError(f"reward model batch_size={batch_size} must be >= 1.")
        if config.position_embedding == "learned" and max_len > config.max_seq_len:
            raise ValueError(
                f"reward model max_len={max_len} is more than the {config.max_seq_len} learned "
                f"positions of the model from {frozen.source}; lower max_len."
            )
        self.frozen = frozen
        self.batch_size = batch_size
        self.max_len = max_len
        self.append_eos = append_eos
        self.buckets = bucket_lengths(max_len, min_bucket_len)
        self._score_fn = make_scalar_score_fn(frozen.model)

    @classmethod
    def from_config(
        cls,
        role: ml_collections.ConfigDict,
        *,
        role_name: str,
        fallback_tokenizer: Tokenizer,
        placement: Placement | None = None,
    ) -> RewardModel:
        """The reward model a role section describes (`reward_model_role_config`), sharded
        by `placement`."""
        frozen = load_frozen_model(
            role,
            fallback_tokenizer=fallback_tokenizer,
            placement=placement,
            **reward_model_args(role, role_name),
        )
        return cls(
            frozen,
            batch_size=role.batch_size,
            max_len=role.max_len,
            append_eos=role.append_eos,
            min_bucket_len=role.min_bucket_len,
        )

    @property
    def tokenizer(self) -> Tokenizer:
        return self.frozen.tokenizer

    @property
    def source(self) -> str:
        return self.frozen.source

    def encode(self, prompts: Sequence[str], responses: Sequence[str]) -> list[list[int]]:
        """The scored ids of each (prompt, response) pair (`encode_scored_text`)."""
        if len(prompts) != len(responses):
            raise ValueError(
                f"Got {len(prompts)} prompts but {len(responses)} responses; pass one each."
            )
        encode = functools.partial(
            encode_scored_text, self.tokenizer, max_len=self.max_len, append_eos=self.append_eos
        )
        return [
            encode(prompt, response) for prompt, response in zip(prompts, responses, strict=True)
        ]

    def score_ids(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """Scores of already-encoded rows, float32 [N], in batches of `batch_size`."""
        scores = []
        for start in range(0, len(rows), self.batch_size):
            batch = list(rows[start : start + self.batch_size])
            real = len(batch)
            batch += [batch[0]] * (self.batch_size - real)  # one compiled batch shape
            length = bucket_for(max(len(ids) for ids in batch), self.buckets)
            tokens, mask = pad_sequences_with_mask(
                batch, length, pad_id=self.tokenizer.pad_id, left_pad=False
            )
            tokens, mask = self.frozen.put_rows(tokens, mask)
            scores.append(np.asarray(self._score_fn(self.frozen.params, tokens, mask))[:real])
        return np.concatenate(scores).astype(np.float32) if scores else np.zeros(0, np.float32)

    def scores(self, prompts: Sequence[str], responses: Sequence[str]) -> np.ndarray:
        """The reward model's score of each (prompt, response) text pair, float32 [N]."""
        return self.score_ids(self.encode(prompts, responses))

    def __call__(self, examples: Sequence[dict], responses: Sequence[str]) -> np.ndarray:
        """`Task.rewards`: examples[i]["prompt"] with responses[i], float32 [N]."""
        return self.scores([example["prompt"] for example in examples], responses)
