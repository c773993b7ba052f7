"""VinePPO (Kazemnejad et al. 2024): PPO's clipped update with advantages from Monte Carlo
value estimates at reasoning-step boundaries instead of a critic.

A response y of length L is cut into steps after each token whose text holds one of
`loss.vineppo.step_delimiters` (a newline for GSM8K's solution lines; "," and ">" for the
arithmetic demo's running totals): steps start at s_0 = 0 < s_1 < … < s_{M−1} < L (at most
`max_steps`; the rest of a longer response is its last step). For each start s_j the
current policy continues (x, y_<s_j) `rollouts` times to the end (the response's token
budget, T − s_j tokens), and the task's reward of each whole response (with the
non-EOS penalty, as the searchers give it) averages to V̂(s_j). The final state is
terminal with value r(y), the sample's own reward. Every token of step j gets the advantage

    A_t = V̂(s_{j+1}) − V̂(s_j)        (γ = 1; V̂(s_M) = r(y)),

and the loss is PPO's clipped surrogate with the ratio to the behaviour policy plus β times
the k3 estimator of KL to π_ref per token (`losses.vineppo_loss`, GRPO's form with these
advantages).

The rollouts are made by `MonteCarloValues` on the sampler mesh with the learner's newest
params, published to the sampler before each batch's rollouts: they are the current policy
in sync and in async mode alike (in async mode the batch's responses are older; their
advantages are the current policy's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from tba_jax import mesh as mesh_lib
from tba_jax.metrics import RateMeter, TimeSplit
from tba_jax.models.tokenizers import Tokenizer
from tba_jax.rewards import apply_non_eos_penalty
from tba_jax.trajectories import SampledBatch

NO_STEP = -1  # padding of `step_starts`
ROLLOUT_SAMPLES = "vineppo_rollouts"  # RateMeter name of the rollouts made


@dataclasses.dataclass(frozen=True)
class VineConfig:
    """`config.loss.vineppo`'s rollout knobs (the loss's own are keyword options)."""

    rollouts: int = 4  # continuations per step start
    step_delimiters: str = "\n"  # a token holding one of these characters ends a step
    max_steps: int = 8  # step starts per response; a longer one's rest is its last step
    rows_per_call: int = 0  # rollout rows per generate call; 0: batch rows × rollouts


def boundary_tokens(tokenizer: Tokenizer, delimiters: str) -> np.ndarray:
    """bool [vocab_size]: the ids whose text holds one of `delimiters` (a step ends after
    such a token). ValueError when no id does: no response could be split."""
    if not delimiters:
        raise ValueError(
            "loss.vineppo.step_delimiters is empty; name the characters that end a step"
        )
    is_boundary = np.zeros(tokenizer.vocab_size, bool)
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id])
        is_boundary[token_id] = any(char in text for char in delimiters)
    if not is_boundary.any():
        raise ValueError(
            f"no token of the tokenizer holds any of loss.vineppo.step_delimiters="
            f"{delimiters!r}; pick characters the responses contain"
        )
    return is_boundary


def step_starts(
    response_tokens: np.ndarray, lengths: np.ndarray, is_boundary: np.ndarray, max_steps: int
) -> np.ndarray:
    """Start of each step of each response: 0, then every position after a boundary token
    that is inside the response (not after its last token); the first `max_steps`.

    response_tokens: int [N, T]; lengths: int [N]. Returns int32 [N, max_steps], padded
    with NO_STEP (a response of length 0 has no step)."""
    starts = np.full((len(lengths), max_steps), NO_STEP, np.int32)
    for row, length in enumerate(lengths):
        if length == 0:
            continue
        after = np.flatnonzero(is_boundary[response_tokens[row, : length - 1]]) + 1
        row_starts = np.concatenate([[0], after])[:max_steps]
        starts[row, : len(row_starts)] = row_starts
    return starts


def step_advantages(
    starts: np.ndarray,
    values: np.ndarray,
    reward: np.ndarray,
    lengths: np.ndarray,
    response_len: int,
) -> np.ndarray:
    """Per-token advantages V̂(s_{j+1}) − V̂(s_j) over each step j, V̂ after the last step
    = `reward`. starts, values: [N, M] (NO_STEP-padded); reward, lengths: [N]. Returns
    float32 [N, response_len], 0 past each response's end."""
    advantages = np.zeros((len(lengths), response_len), np.float32)
    for row, length in enumerate(lengths):
        row_starts = [int(s) for s in starts[row] if s != NO_STEP]
        if not row_starts:  # an empty response
            continue
        ends = [*row_starts[1:], int(length)]
        next_values = [*list(values[row, 1 : len(row_starts)]), reward[row]]
        for j, (start, end) in enumerate(zip(row_starts, ends, strict=True)):
            advantages[row, start:end] = next_values[j] - values[row, j]
    return advantages


@dataclasses.dataclass
class MonteCarloValues:
    """VinePPO's value stage: continues each step start of a batch's responses with the
    current policy and turns the rewards into per-token advantages.

    generate_fn: `(params, prompt_tokens, prompt_mask, rng) -> Generation` for left-padded
    prompts of `max_prompt_len + max_response_len` tokens and `max_response_len` new ones.
    """

    generate_fn: Callable
    tokenizer: Tokenizer
    rewards_fn: Callable  # (examples, response texts) -> float32 [N]
    examples_by_id: dict
    max_prompt_len: int
    max_response_len: int
    is_boundary: np.ndarray
    config: VineConfig
    time_split: TimeSplit
    rates: RateMeter
    non_eos_penalty: float | None = None

    def advantages(self, params, batch: SampledBatch, rng: jax.Array) -> np.ndarray:
        """float32 [N, T] per-token advantages of `batch` (see the module docstring)."""
        lengths = batch.response_mask.sum(axis=1).astype(np.int64)
        starts = step_starts(
            batch.response_tokens, lengths, self.is_boundary, self.config.max_steps
        )
        rows, steps = np.nonzero(starts != NO_STEP)
        values = np.zeros(starts.shape, np.float32)
        if len(rows):
            rollout_rewards = self._rollout_rewards(params, batch, rows, starts[rows, steps], rng)
            values[rows, steps] = rollout_rewards.reshape(len(rows), self.config.rollouts).mean(1)
        return step_advantages(starts, values, batch.reward, lengths, self.max_response_len)

    def _rollout_rewards(
        self, params, batch: SampledBatch, rows: np.ndarray, starts: np.ndarray, rng
    ) -> np.ndarray:
        """The rewards [len(rows) × rollouts] of `rollouts` continuations of each (row, start),
        rollouts of one start next to each other."""
        repeats = self.config.rollouts
        rows, starts = np.repeat(rows, repeats), np.repeat(starts, repeats)
        prefixes = [
            np.concatenate(
                [
                    batch.prompt_tokens[row][batch.prompt_mask[row]],
                    batch.response_tokens[row, :start],
                ]
            )
            for row, start in zip(rows, starts, strict=True)
        ]
        per_call = self.config.rows_per_call or len(batch.reward) * repeats
        tokens, lengths = self._generate(params, prefixes, per_call, rng)
        budgets = self.max_response_len - starts
        kept = np.minimum(lengths, budgets)
        texts = [
            self.tokenizer.decode(
                np.concatenate([batch.response_tokens[row, :start], tokens[i, : kept[i]]])
            )
            for i, (row, start) in enumerate(zip(rows, starts, strict=True))
        ]
        samples_per_prompt = len(batch.reward) // batch.num_prompts
        examples = [
            self.examples_by_id[int(batch.prompt_ids[row // samples_per_prompt])] for row in rows
        ]
        with self.time_split.measure("scoring"):
            rewards = np.asarray(self.rewards_fn(examples, texts), np.float32)
        ended = np.array(
            [
                kept[i] > 0 and tokens[i, kept[i] - 1] == self.tokenizer.eos_id
                for i in range(len(rows))
            ]
        )
        self.rates.add(ROLLOUT_SAMPLES, len(rows))
        return apply_non_eos_penalty(rewards, ended, self.non_eos_penalty)

    def _generate(
        self, params, prefixes: Sequence[np.ndarray], per_call: int, rng: jax.Array
    ) -> tuple[np.ndarray, np.ndarray]:
        """Continuations of `prefixes` in calls of `per_call` rows, a shape that does not
        change from batch to batch (the last call is padded with copies of its first
        row): tokens [R, T] and lengths [R]."""
        width = self.max_prompt_len + self.max_response_len
        tokens, lengths = [], []
        for call, begin in enumerate(range(0, len(prefixes), per_call)):
            chunk = list(prefixes[begin : begin + per_call])
            real = len(chunk)
            chunk += [chunk[0]] * (per_call - real)
            prompt_tokens = np.full((per_call, width), self.tokenizer.pad_id, np.int32)
            prompt_mask = np.zeros((per_call, width), bool)
            for i, prefix in enumerate(chunk):
                prompt_tokens[i, width - len(prefix) :] = prefix
                prompt_mask[i, width - len(prefix) :] = True
            with self.time_split.measure("generating"):
                # on a sampler mesh, each device rolls out its share of the rows
                placed = mesh_lib.split_rows_like(params, prompt_tokens, prompt_mask)
                gen = self.generate_fn(params, *placed, jax.random.fold_in(rng, call))
                gen_tokens, gen_lengths = jax.device_get((gen.tokens, gen.lengths))
            tokens.append(gen_tokens[:real])
            lengths.append(gen_lengths[:real])
        return np.concatenate(tokens), np.concatenate(lengths)
