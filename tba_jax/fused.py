"""Searching with the slot engine: per-sample scoring overlapped with decoding.

`runtime.SearchWorker` generates a whole batch, then scores it. `FusedSearchWorker`
feeds prompts to `sampling.engine.SlotEngine` and scores finished samples in groups
while the engine keeps decoding (RLHFuse's inter-stage fusion): a group is the most
ready samples that make `score_rows` × 4^i rows or the decode width, its responses
padded to the smallest of `score_length_buckets` lengths (none closer than
`bucket_min_tokens`) that holds its longest (a few static shapes, each a program; the
last samples of a search are padded to `score_rows`). Each group's π_ref log-probs are
dispatched to the device behind the running decode chunk, its rewards (verifier, reward
model, judge) are computed on the host meanwhile, and its trajectories are ready one
chunk later, when the device has finished them; a prompt's S trajectories are handed on
together once its last is ready (the replay buffer draws a prompt's K rows from the
samples it holds), async searchers' `search.prompts_per_call` whole prompts at a time.

- `search(params, version, examples, rng)`: the same contract as `SearchWorker.search`
  (prompt-major trajectories of one params version), for the sync loop and for async
  searchers that finish each call on the params it started with;
- `stream(params_fn, examples, rng)`: each prompt's scored samples as soon as they are
  all ready, for async searchers: with in-flight weight updates (params re-read between
  decode chunks; each sample records its first and last version), or on one version
  until `restart` says a newer one is published, when the prompts not finished are
  returned to start over on it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from tba_jax.mesh import split_rows_like
from tba_jax.metrics import RateMeter, TimeSplit
from tba_jax.models.tokenizers import Tokenizer
from tba_jax.rewards import response_rewards
from tba_jax.runtime import DROPPED_NONFINITE, RESTARTED_PROMPTS, is_finite
from tba_jax.sampling.engine import (
    NO_REQUEST_YET,
    Finished,
    Request,
    SlotEngine,
    bucket_length,
    rows_at_most,
)
from tba_jax.trajectories import Trajectory


class Scored(NamedTuple):
    """A scored sample: its request's key, its index among the prompt's samples, and it."""

    key: Any
    sample: int
    trajectory: Trajectory


# How much a prompt's seconds weigh against the previous one's in `PromptSeconds`: about
# the last 1 / (1 - decay) = 20 prompts count.
PROMPT_SECONDS_DECAY = 0.95


class PromptSeconds:
    """The mean seconds from taking a prompt to the end of its last sample, recent prompts
    weighted most. Prompts given up unfinished (started over at a publish) count the
    seconds they ran but no ending, so that the long prompts a restart cuts short do not
    leave only the short ones in the mean: seconds over endings, the estimate of a mean
    duration from observations cut short (exact for exponentially distributed ones)."""

    def __init__(self, decay: float = PROMPT_SECONDS_DECAY):
        self.decay = decay
        self._seconds = 0.0  # decayed sum of the seconds prompts ran
        self._endings = 0.0  # decayed count of the prompts that ended

    def add(self, seconds: float, *, ended: bool) -> None:
        self._seconds = self.decay * self._seconds + seconds
        self._endings = self.decay * self._endings + float(ended)

    def mean(self) -> float | None:
        """None until a prompt has ended."""
        return self._seconds / self._endings if self._endings else None


class _Prompt(NamedTuple):
    """A prompt being searched: its example and its encoding (left-padded [P])."""

    example: dict
    tokens: np.ndarray
    mask: np.ndarray


class _Group(NamedTuple):
    """Samples being scored: π_ref log-probs in flight on the device, rewards done."""

    samples: list[Finished]
    prompt_tokens: np.ndarray  # [rows, P]
    prompt_mask: np.ndarray  # [rows, P]
    logp_ref: jax.Array  # [rows, T], not yet fetched
    rewards: np.ndarray  # [n]


@dataclasses.dataclass
class FusedSearchWorker:
    """Generates S responses per prompt with the slot engine and scores them as they end."""

    engine: SlotEngine
    score_fn: Callable  # (params, prompt_tokens, prompt_mask, response_tokens, mask) -> [N, T]
    reference_params: object
    tokenizer: Tokenizer
    rewards_fn: Callable  # (examples, response texts) -> float32 [N]
    max_prompt_len: int
    samples_per_prompt: int
    score_rows: int  # the unit of a π_ref scoring call's rows (score_rows × 4^i)
    time_split: TimeSplit
    rates: RateMeter
    # π_ref scoring pads responses to the smallest of this many lengths (max_new_tokens
    # × i / N, i = 1..N) that holds a group's longest: a program for each; 1: max_new_tokens
    score_length_buckets: int = 4
    # ...none of them shorter than this many tokens apart (1: exactly N buckets)
    bucket_min_tokens: int = 1
    non_eos_penalty: float | None = None
    drop_nonfinite: bool = False
    # how long the prompts of `stream` take to finish (an async searcher's restart rule)
    prompt_seconds: PromptSeconds = dataclasses.field(default_factory=PromptSeconds)

    def search(
        self, params, version: int, examples: Sequence[dict], rng: jax.Array
    ) -> list[Trajectory]:
        """len(examples) * samples_per_prompt trajectories of `params` (as `version`),
        prompt-major (fewer when non-finite ones are dropped)."""
        scored = [
            item
            for items in self.stream(lambda: (params, version), examples, rng)
            for item in items
        ]
        scored.sort(key=lambda item: (item.key, item.sample))
        return [item.trajectory for item in scored]

    def stream(
        self,
        params_fn: Callable[[], tuple[Any, int]],
        examples: Iterable[dict],
        rng: jax.Array,
        *,
        in_flight_updates: bool = False,
        prompts_per_hand_on: int = 1,
        should_stop: Callable[[], bool] | None = None,
        restart: Callable[[], bool] | None = None,
        restarted_prompts: int = 0,
    ) -> Generator[list[Scored], None, list[dict]]:
        """Scored samples of `examples` (read lazily; may be endless), whole prompts (a
        prompt's S samples once its last is scored), at least `prompts_per_hand_on` of them
        at a time (fewer at the end). Keys are the examples' indices in `examples`. Returns
        the examples read but not handed on (none when `examples` ran out). An item
        `engine.NO_REQUEST_YET` among `examples` (no prompt may start yet) is the engine's:
        it decodes its live samples on and reads `examples` again after a chunk.

        A prompt is handed on whole because the replay buffer draws a refreshed prompt's
        K rows from the samples it holds (with replacement when it holds fewer than K): a
        prompt added sample by sample could be drawn from its short samples alone, which
        end first, biasing TB's batch towards short responses. Several at a time because
        its recency draws take the prompts refreshed since the latest publish, repeating
        them when too few are: prompts added one by one right after a publish made batches
        of 16 prompt slots with as few as 3 distinct prompts (the async demo).

        With `should_stop` (an async searcher's stop), the stream ends once that returns
        True, checked before and after each decode chunk; what is not handed on yet is
        given up unscored.

        With `restart` (an async searcher's check for newer params), the stream ends once
        that returns True before a decode chunk: the prompts whose samples have all finished
        are scored and handed on, the live samples are given up, and the examples not
        handed on are returned to start over on the new params. Not until the first
        `restarted_prompts` examples (prompts started over before) are finished: a prompt
        starts over at most once, so each finishes however often params are published."""
        by_key: dict[int, _Prompt] = {}  # prompts read and not handed on
        samples_left: dict[int, int] = {}  # samples not scored yet, per prompt
        decoding: dict[int, int] = {}  # samples not finished yet, per prompt
        read_at: dict[int, float] = {}  # when each prompt was taken (time.monotonic)
        read = 0  # examples read

        def requests() -> Iterator[Request | object]:
            nonlocal read
            for example in examples:
                if example is NO_REQUEST_YET:  # passed on: the engine's live samples go on
                    yield NO_REQUEST_YET
                    continue
                key = read
                read += 1
                tokens, mask = self._encode(example)
                read_at[key] = time.monotonic()
                by_key[key] = _Prompt(example, tokens, mask)
                samples_left[key] = decoding[key] = self.samples_per_prompt
                yield Request(key, tokens, mask, self.samples_per_prompt)

        def end_early() -> bool:  # not before the prompts started over before are finished
            if read < restarted_prompts or any(key < restarted_prompts for key in by_key):
                return False
            return restart()

        finished: list[Finished] = []
        in_flight: list[_Group] = []
        scored_by_key: dict[int, list[Scored]] = {}  # scored samples of prompts not handed on
        complete: list[int] = []  # prompts whose samples are all scored, not handed on yet
        generation = self.engine.run(
            params_fn,
            requests(),
            rng,
            in_flight_updates=in_flight_updates,
            should_stop=should_stop,
            end_early=None if restart is None else end_early,
        )
        while True:
            with self.time_split.measure("generating"):
                chunk = next(generation, None)
            if should_stop is not None and should_stop():
                generation.close()
                return []  # the samples not handed on yet are given up: nothing is scored

            with self.time_split.measure("scoring"):
                # groups dispatched last time ran before the chunk now decoding
                ready = [self._complete(group, by_key) for group in in_flight]
                in_flight = []
                now = time.monotonic()
                for sample in chunk or []:
                    finished.append(sample)
                    decoding[sample.key] -= 1
                    if not decoding[sample.key]:
                        self.prompt_seconds.add(now - read_at.pop(sample.key), ended=True)
                last = chunk is None
                if last:  # after a restart, only prompts whose samples all finished count
                    finished = [sample for sample in finished if not decoding[sample.key]]
                    for key in read_at:  # given up unfinished
                        self.prompt_seconds.add(now - read_at[key], ended=False)
                while len(finished) >= self.score_rows or (last and finished):
                    rows = self._group_rows(len(finished))
                    group, finished = finished[:rows], finished[rows:]
                    in_flight.append(self._dispatch(group, rows, by_key))
                if last:
                    ready += [self._complete(group, by_key) for group in in_flight]
                for item in (item for items in ready for item in items):
                    scored_by_key.setdefault(item.key, []).append(item)
                    samples_left[item.key] -= 1
                    if not samples_left[item.key]:
                        complete.append(item.key)
                        del samples_left[item.key], decoding[item.key], by_key[item.key]
            if len(complete) >= prompts_per_hand_on or (last and complete):
                # counted as they are handed on (not the samples of prompts started over);
                # an empty list when every sample was dropped as non-finite
                yield self._count([item for key in complete for item in scored_by_key.pop(key)])
                complete = []
            if last:
                if by_key:
                    self.rates.add(RESTARTED_PROMPTS, len(by_key))
                return [by_key[key].example for key in sorted(by_key)]

    def _group_rows(self, ready: int) -> int:
        """The rows of the next scoring call with `ready` samples finished: the largest
        score_rows × ROW_GROWTH^i below the decode width, or the width, that they fill;
        score_rows (padded) for fewer."""
        return rows_at_most(ready, self.score_rows, self.engine.config.slots)

    def _encode(self, example: dict) -> tuple[np.ndarray, np.ndarray]:
        """The example's prompt, left-padded: tokens [P] int32, mask [P] bool."""
        tokens, mask = self.tokenizer.encode_prompts([example["prompt"]], self.max_prompt_len)
        return tokens[0], mask[0]

    def _dispatch(self, samples: list[Finished], rows: int, by_key: dict[int, _Prompt]) -> _Group:
        """Starts π_ref scoring of `samples` (padded to `rows`) on the device and computes
        their rewards. Responses are padded to the smallest of `score_length_buckets`
        lengths that holds the group's longest, so a group of short samples is not scored
        at full length."""
        longest = max(len(sample.tokens) for sample in samples)  # >= 1: EOS at least
        max_new = bucket_length(
            longest, self.engine.max_new, self.score_length_buckets, self.bucket_min_tokens
        )
        prompt_tokens = np.full((rows, self.max_prompt_len), self.tokenizer.pad_id, np.int32)
        prompt_mask = np.zeros((rows, self.max_prompt_len), bool)
        tokens = np.full((rows, max_new), self.tokenizer.pad_id, np.int32)
        mask = np.zeros((rows, max_new), np.float32)
        lengths = np.zeros(rows, np.int32)
        for row, sample in enumerate(samples):
            prompt_tokens[row], prompt_mask[row] = (
                by_key[sample.key].tokens,
                by_key[sample.key].mask,
            )
            length = len(sample.tokens)
            tokens[row, :length], mask[row, :length], lengths[row] = sample.tokens, 1.0, length
        # on a sampler mesh, each device scores its share of the rows (padding rows dropped)
        logp_ref = self.score_fn(
            self.reference_params,
            *split_rows_like(self.reference_params, prompt_tokens, prompt_mask, tokens, mask),
        )
        n = len(samples)
        rewards = response_rewards(
            self.rewards_fn,
            self.tokenizer,
            [by_key[sample.key].example for sample in samples],
            tokens[:n],
            lengths[:n],
            self.non_eos_penalty,
        )
        return _Group(samples, prompt_tokens, prompt_mask, logp_ref, rewards)

    def _complete(self, group: _Group, by_key: dict[int, _Prompt]) -> list[Scored]:
        """The group's trajectories, once its π_ref log-probs are back."""
        logp_ref = np.asarray(jax.device_get(group.logp_ref))
        created_at = time.time()
        scored = []
        for row, sample in enumerate(group.samples):
            trajectory = Trajectory.sampled(
                prompt_id=by_key[sample.key].example["id"],
                prompt_tokens=group.prompt_tokens[row][group.prompt_mask[row]],
                response_tokens=sample.tokens,
                token_logp_behaviour=sample.token_logp,
                token_logp_ref=logp_ref[row, : len(sample.tokens)],
                reward=group.rewards[row],
                policy_version=sample.version_first,
                created_at=created_at,
                policy_version_last=sample.version_last,
            )
            scored.append(Scored(sample.key, sample.sample, trajectory))
        return scored

    def _count(self, scored: list[Scored]) -> list[Scored]:
        """Counts samples and tokens handed on; leaves out non-finite samples with
        `drop_nonfinite`."""
        self.rates.add("samples", len(scored))
        self.rates.add("tokens", sum(item.trajectory.response_length for item in scored))
        if not self.drop_nonfinite:
            return scored
        kept = [item for item in scored if is_finite(item.trajectory)]
        self.rates.add(DROPPED_NONFINITE, len(scored) - len(kept))
        return kept
