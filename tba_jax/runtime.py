"""Searchers, the policy store, and the async (TBA) and sync training loops.

Policy versions count learner steps: the params published after learner step
s carry version s, and every sample records the version it was started with
(and, under in-flight updates, the version of its last token). The *policy lag*
of a sample in a training batch is the learner step at which it is trained on
minus its first version (0 on-policy); `policy_lag_last_*` count from the last.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np
from absl import logging

from tba_jax import mesh as mesh_lib
from tba_jax.config_lib import ConfigError
from tba_jax.data.pipeline import PromptStream
from tba_jax.metrics import RateMeter, TimeSplit
from tba_jax.models.tokenizers import Tokenizer
from tba_jax.replay import ReplayBuffer
from tba_jax.rewards import response_rewards
from tba_jax.sampling.engine import NO_REQUEST_YET
from tba_jax.trajectories import Trajectory

DROPPED_NONFINITE = "samples_dropped_nonfinite"
# prompts a fused searcher gave up at a publish, to start over on the new params
RESTARTED_PROMPTS = "prompts_restarted"
# the gaps between the latest publishes that `PolicyStore.publish_interval` averages
PUBLISH_GAPS_KEPT = 8


def is_finite(trajectory: Trajectory) -> bool:
    """Whether a sample's reward and summed log-probs are all finite numbers."""
    values = (trajectory.reward, trajectory.logp_behaviour, trajectory.logp_ref)
    return all(np.isfinite(value) for value in values)


class PolicyStore:
    """The params the searchers sample with, and their version. Thread-safe.

    It also times the publishes: `publish_interval()` is the mean of the gaps between the
    latest `PUBLISH_GAPS_KEPT` + 1 of them (the store's creation counts as the first)."""

    def __init__(
        self, sampler_shardings, params, version: int, copy_fn: Callable = mesh_lib.publish
    ):
        """`copy_fn(params, sampler_shardings)` copies the learner's (or host) params onto
        the sampler: `mesh.publish`, or `LearnerGroup.publish` over several processes."""
        self._shardings, self._copy = sampler_shardings, copy_fn
        self._lock = threading.Lock()
        self._params = copy_fn(params, sampler_shardings)
        self._version = version
        self._published_at = collections.deque([time.monotonic()], maxlen=PUBLISH_GAPS_KEPT + 1)

    def publish(self, learner_params, version: int) -> None:
        """Copies `learner_params` onto the sampler mesh (asynchronously) as `version`."""
        published = self._copy(learner_params, self._shardings)
        with self._lock:
            self._params, self._version = published, version
            self._published_at.append(time.monotonic())

    def get(self):
        with self._lock:
            return self._params, self._version

    def publish_interval(self) -> float | None:
        """The mean seconds between the latest publishes; None before the first."""
        with self._lock:
            times = list(self._published_at)
        if len(times) < 2:
            return None
        return (times[-1] - times[0]) / (len(times) - 1)


class SampleLimit:
    """Bounds what async searchers make to what the learner draws (the insert side of
    Reverb's `SampleToInsertRatio`): they start a prompt only while the samples they have
    started stay under `warm_samples` + `max_samples_per_draw` × the samples the learner
    has drawn and will draw in its next step. The learner never waits on it. Off (None)
    the searchers decode without pause, as TBA's do; on shared devices that takes compute
    from the learner (README "The generation engine"). Thread-safe."""

    def __init__(self, max_samples_per_draw: float, warm_samples: int, draws_per_step: int):
        """`warm_samples`: the samples allowed before the learner's first draw (its first
        fill of the buffer, and a searcher's first hand-on); `draws_per_step`: the samples
        one learner step draws."""
        self.max_samples_per_draw = max_samples_per_draw
        self.warm_samples, self.draws_per_step = warm_samples, draws_per_step
        self._changed = threading.Condition()
        self._started = 0  # samples the searchers have started
        self._learner_steps = 0  # steps the learner has drawn for
        self._lifted = False  # while the learner waits for the buffer
        self.paused_seconds = 0.0  # summed over the searchers

    def allowed(self) -> float:
        """The samples the searchers may have started by now."""
        if self._lifted:
            return float("inf")
        drawn_and_next = (self._learner_steps + 1) * self.draws_per_step
        return self.warm_samples + self.max_samples_per_draw * drawn_and_next

    def learner_drew(self, steps: int) -> None:
        """The learner has drawn `steps` batches (this segment)."""
        with self._changed:
            self._learner_steps = steps
            self._changed.notify_all()

    @contextlib.contextmanager
    def lifted(self, dropped_samples: int = 0) -> Iterator[None]:
        """No bound while the learner waits for the buffer (it was emptied of stale
        samples: `replay.max_policy_lag`), so that neither waits on the other; the
        `dropped_samples` no longer count as started, so the searchers may replace them."""
        with self._changed:
            self._started = max(self._started - dropped_samples, 0)
            self._lifted = True
            self._changed.notify_all()
        try:
            yield
        finally:
            with self._changed:
                self._lifted = False

    def try_start(self, samples: int) -> bool:
        """Counts `samples` as started if there is room (the last start may go over)."""
        with self._changed:
            if self._started >= self.allowed():
                return False
            self._started += samples
            return True

    def start(self, samples: int, stop: threading.Event) -> bool:
        """Counts `samples` as started once there is room, waiting for the learner if need
        be; False if `stop` is set first."""
        while not stop.is_set():
            if self.try_start(samples):
                return True
            self.wait_for_room(stop)
        return False

    def wait_for_room(self, stop: threading.Event, poll_s: float = 0.05) -> bool:
        """Blocks until a sample may start; False if `stop` is set meanwhile."""
        began = time.monotonic()
        with self._changed:
            while self._started >= self.allowed() and not stop.is_set():
                self._changed.wait(poll_s)
            self.paused_seconds += time.monotonic() - began
        return not stop.is_set()


@dataclasses.dataclass
class SearchWorker:
    """Generates S responses per prompt and scores them: reward, log π_ref, log π_behaviour."""

    generate_fn: Callable  # (params, prompt_tokens, prompt_mask, rng) -> Generation
    score_fn: Callable  # (params, prompt_tokens, prompt_mask, response_tokens, mask) -> [N, T]
    reference_params: object
    tokenizer: Tokenizer
    rewards_fn: Callable  # (examples, response texts) -> float32 [N]; see tasks.Task.rewards
    max_prompt_len: int
    samples_per_prompt: int
    time_split: TimeSplit
    rates: RateMeter
    non_eos_penalty: float | None = None  # see tba_jax.rewards.apply_non_eos_penalty
    # Leave out samples whose reward or log-probs are not finite (counted as
    # "samples_dropped_nonfinite" in `rates`). The async buffer takes samples one by one;
    # a sync batch keeps its shape, and the learner skips a step with a non-finite loss.
    drop_nonfinite: bool = False

    def search(
        self,
        params,
        version: int,
        examples: Sequence[dict],
        rng: jax.Array,
        *,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Trajectory]:
        """Returns len(examples) * samples_per_prompt trajectories, prompt-major; none when
        `should_stop` (an async searcher's stop) returns True once they are generated: the
        run is stopping, so they are not scored (π_ref, a reward model) only to be dropped."""
        s = self.samples_per_prompt
        prompts = [ex["prompt"] for ex in examples for _ in range(s)]
        prompt_tokens, prompt_mask = self.tokenizer.encode_prompts(prompts, self.max_prompt_len)
        # on a sampler mesh, each device generates and scores its share of the rows
        placed_tokens, placed_mask = mesh_lib.split_rows_like(params, prompt_tokens, prompt_mask)
        with self.time_split.measure("generating"):
            gen = self.generate_fn(params, placed_tokens, placed_mask, rng)
            gen = jax.block_until_ready(gen)
        if should_stop is not None and should_stop():
            return []
        with self.time_split.measure("scoring"):
            token_logp_ref = self.score_fn(
                self.reference_params, placed_tokens, placed_mask, gen.tokens, gen.mask
            )
            rows = len(prompt_tokens)  # the padding rows are left out
            tokens, lengths, token_logp, token_logp_ref = (
                array[:rows]
                for array in jax.device_get(
                    (gen.tokens, gen.lengths, gen.token_logp, token_logp_ref)
                )
            )
            created_at = time.time()
            sample_examples = [examples[row // s] for row in range(len(prompt_tokens))]
            rewards = response_rewards(
                self.rewards_fn,
                self.tokenizer,
                sample_examples,
                tokens,
                lengths,
                self.non_eos_penalty,
            )
            trajectories = []
            for row, prompt_row in enumerate(prompt_tokens):
                length = int(lengths[row])
                trajectories.append(
                    Trajectory.sampled(
                        prompt_id=sample_examples[row]["id"],
                        prompt_tokens=prompt_row[prompt_mask[row]],
                        response_tokens=tokens[row, :length],
                        token_logp_behaviour=token_logp[row, :length],
                        token_logp_ref=token_logp_ref[row, :length],
                        reward=rewards[row],
                        policy_version=version,
                        created_at=created_at,
                    )
                )
        self.rates.add("samples", len(trajectories))
        self.rates.add("tokens", int(lengths.sum()))
        if self.drop_nonfinite:
            finite = [t for t in trajectories if is_finite(t)]
            self.rates.add(DROPPED_NONFINITE, len(trajectories) - len(finite))
            trajectories = finite
        return trajectories


class NonFiniteSamplesError(ConfigError):
    """Every sample of many search calls in a row had a non-finite reward or log-prob."""


class Searcher(threading.Thread):
    """A host thread that generates and scores continuously into the replay buffer.

    It never waits for the learner, unless given a `SampleLimit`. With a `SearchWorker` it
    reads whatever params the policy store holds at the start of each call of
    `prompts_per_call` prompts. With a `FusedSearchWorker` (the slot engine) it streams
    prompts through the engine's slots and adds whole prompts, at least `prompts_per_call`
    at a time (a stream's last few wait for the next stream's first), each once its last
    sample is scored: on the params it started with until a newer version is published, or
    with `in_flight_updates` on the newest params of every decode chunk. At a publish it
    stops taking prompts; with `restart_on_publish` it hands on the prompts whose samples
    have all finished and starts the live ones over on the new params, first in its next
    stream (a prompt starts over at most once: one that did finishes on its params), while
    prompts take less time to finish than the gap between publishes (`_restart_pays`);
    otherwise it finishes the live samples on the old params, then starts over with the
    new ones. With a `limit` it starts prompts only while that has room; while the slot
    engine finds none, its live samples decode on and it asks again after each chunk
    (`engine.NO_REQUEST_YET`), so the next prompts start beside the last ones' tail; with
    no live sample left it waits for the learner's next draw.
    Prompts started over at a publish were counted when they first started: they do not
    wait for room.
    An exception stops the run: it is put on `errors` and `stop` is set, and the learner
    re-raises it. So does a run of `max_empty_calls` calls (or hand-offs of scored
    prompts) in a row whose samples were all dropped as non-finite (the buffer would
    never fill).
    """

    def __init__(
        self,
        index: int,
        worker: SearchWorker,
        store: PolicyStore,
        stream: PromptStream,
        buffer: ReplayBuffer,
        prompts_per_call: int,
        seed: int,
        stop: threading.Event,
        errors: queue.Queue,
        max_empty_calls: int,
        in_flight_updates: bool = False,
        restart_on_publish: bool = False,
        limit: SampleLimit | None = None,
    ):
        super().__init__(name=f"searcher-{index}", daemon=True)
        self.limit = limit
        self.max_empty_calls, self.in_flight_updates = max_empty_calls, in_flight_updates
        self.restart_on_publish = restart_on_publish and not in_flight_updates
        self.index = index
        self.worker, self.store, self.stream, self.buffer = worker, store, stream, buffer
        self.prompts_per_call = prompts_per_call
        self.rng = jax.random.fold_in(jax.random.key(seed), index)
        self.stop, self.errors = stop, errors
        self.calls = 0
        self.said_restarts_wait = False  # logged once that restarts do not pay

    def run(self) -> None:
        try:
            if hasattr(self.worker, "stream"):
                self._stream_through_slots()
            else:
                self._search_in_calls()
        except BaseException as error:
            self.errors.put(error)
            self.stop.set()

    def _search_in_calls(self) -> None:
        empty_calls = 0
        while self._may_start(self.prompts_per_call):
            params, version = self.store.get()
            examples = self.stream.next_batch(self.prompts_per_call)
            rng = jax.random.fold_in(self.rng, self.calls)
            trajectories = self.worker.search(
                params, version, examples, rng, should_stop=self.stop.is_set
            )
            if self.stop.is_set():  # the run is stopping: nothing more goes in
                break
            self.buffer.add(trajectories)
            self.calls += 1
            empty_calls = self._check_empty(trajectories, empty_calls)

    def _stream_through_slots(self) -> None:
        empty_groups = 0
        restarted: list[dict] = []  # examples given up at the last publish
        held: list[Trajectory] = []  # whole prompts, fewer than prompts_per_call
        while not self.stop.is_set():
            # prompts started over were counted when they first started: they go on
            # without waiting for room
            waits = self.limit is not None and not restarted
            if waits and not self.limit.wait_for_room(self.stop):
                break
            params_fn = self.store.get
            if not self.in_flight_updates:
                pinned = self.store.get()
                params_fn = lambda pinned=pinned: pinned
            version = params_fn()[1]

            def prompts(version=version, first=restarted):
                yield from first
                while not self.stop.is_set() and (
                    self.in_flight_updates or self.store.get()[1] == version
                ):
                    if self.limit is None or self.limit.try_start(self.samples_per_prompt):
                        yield from self.stream.next_batch(1)
                    else:  # no room yet: the live samples decode on, the limit is asked again
                        yield NO_REQUEST_YET

            restart = None
            if self.restart_on_publish:
                restart = lambda version=version: (
                    self.store.get()[1] != version and self._restart_pays()
                )
            rng = jax.random.fold_in(self.rng, self.calls)
            scored_groups = self.worker.stream(
                params_fn,
                prompts(),
                rng,
                in_flight_updates=self.in_flight_updates,
                prompts_per_hand_on=self.prompts_per_call,
                should_stop=self.stop.is_set,
                restart=restart,
                restarted_prompts=len(restarted),
            )
            while not self.stop.is_set():
                try:
                    scored = next(scored_groups)
                except StopIteration as end:
                    restarted = end.value
                    break
                trajectories = [item.trajectory for item in scored]
                empty_groups = self._check_empty(trajectories, empty_groups)
                held += trajectories
                # a stream's last prompts join the next's first: the recency draws take the
                # prompts added since the latest publish, and a few alone would repeat
                if len({t.prompt_id for t in held}) >= self.prompts_per_call:
                    self.buffer.add(held)
                    held = []
            scored_groups.close()
            self.calls += 1

    @property
    def samples_per_prompt(self) -> int:
        return self.worker.samples_per_prompt

    def _may_start(self, prompts: int) -> bool:
        """Whether a call of `prompts` prompts may start: not at a stop, and (with a
        `limit`) once there is room, waiting for the learner if need be."""
        if self.limit is None:
            return not self.stop.is_set()
        return self.limit.start(prompts * self.samples_per_prompt, self.stop)

    def _restart_pays(self) -> bool:
        """Whether a prompt started over on the newly published params may end before the
        next publish: while prompts take longer than the gap between publishes, it would
        end a version behind anyway, having given up the tokens it had decoded for one
        version of freshness, so the live samples finish on the params they started with."""
        seconds, interval = self.worker.prompt_seconds.mean(), self.store.publish_interval()
        pays = seconds is None or interval is None or seconds < interval
        if not pays and not self.said_restarts_wait:
            self.said_restarts_wait = True
            logging.info(
                "Searcher %d: prompts take %.2f s to finish, params are published every "
                "%.2f s, so live prompts finish on their params instead of starting over "
                "(while this lasts).",
                self.index,
                seconds,
                interval,
            )
        return pays

    def _check_empty(self, trajectories: list[Trajectory], empty_calls: int) -> int:
        empty_calls = 0 if trajectories else empty_calls + 1
        if empty_calls >= self.max_empty_calls:
            raise NonFiniteSamplesError(
                f"Every sample of the last {empty_calls} search calls had a non-finite "
                "reward or log-prob and was dropped; check the task's reward (and "
                "π_ref's checkpoint)."
            )
        return empty_calls


class SearcherPool:
    """Starts searcher threads, surfaces their errors, and stops them."""

    def __init__(self, searchers: Sequence[Searcher], stop: threading.Event, errors: queue.Queue):
        self.searchers, self.stop, self.errors = list(searchers), stop, errors

    def start(self) -> None:
        for searcher in self.searchers:
            searcher.start()

    def raise_if_failed(self) -> None:
        """Re-raises a searcher's error: a ConfigError as it is (its message says what to
        change), anything else as the bug it is."""
        if not self.errors.empty():
            error = self.errors.get()
            if isinstance(error, ConfigError):
                raise error
            raise RuntimeError(f"A searcher thread failed: {error!r}") from error

    def close(self, timeout_s: float) -> None:
        self.stop.set()
        for searcher in self.searchers:
            searcher.join(timeout=timeout_s)

    def wait_for_buffer(
        self, buffer: ReplayBuffer, min_prompts: int, poll_s: float, stop_signal
    ) -> None:
        """Blocks until the buffer holds `min_prompts` prompts (or `stop_signal`, when
        given, is requested); raises a searcher's error."""
        while buffer.num_prompts < min_prompts:
            self.raise_if_failed()
            if stop_signal is not None and stop_signal.requested:
                return
            time.sleep(poll_s)
        self.raise_if_failed()


def policy_lags(learner_step: int, sample_versions: np.ndarray) -> np.ndarray:
    """Each sample's lag in learner steps: `learner_step` minus its version. int64 [N]."""
    return learner_step - sample_versions.astype(np.int64)


@dataclasses.dataclass(frozen=True)
class BatchRows:
    """Per-row facts of a learner batch of N = B × K rows (prompt-major): int64 [N] each."""

    version_first: np.ndarray
    version_last: np.ndarray
    prompt_id: np.ndarray
    from_recency: np.ndarray  # 1 where the row's prompt slot was a recency (online) draw
    response_length: np.ndarray


def draw_metrics(rows: BatchRows, samples_per_prompt: int) -> dict[str, float]:
    """What the replay buffer handed the learner: `batch_distinct_prompt_share` (distinct
    prompt ids over the N / K prompt slots: 1 when no prompt fills two slots),
    `batch_recency_share` (the slots that were recency draws; 1 in sync mode, whose batches
    are all fresh) and `batch_response_length_mean` (beside `buffer_response_length_mean`:
    whether draws lean to short or long responses)."""
    prompt_slots = len(rows.prompt_id) // samples_per_prompt
    return {
        "batch_distinct_prompt_share": len(np.unique(rows.prompt_id)) / prompt_slots,
        "batch_recency_share": float(rows.from_recency.mean()),
        "batch_response_length_mean": float(rows.response_length.mean()),
    }


def lag_by_draw_metrics(lags: np.ndarray, from_recency: np.ndarray) -> dict[str, float]:
    """The mean lag of a batch's recency-draw rows and of its priority-draw rows:
    `policy_lag_recency_mean` and `policy_lag_priority_mean` (a kind the batch did not draw
    is left out). `policy_lag_mean` mixes them, and old priority draws hide how fresh the
    recency draws are (README "The generation engine": 2.7 versions against 2.1)."""
    metrics = {}
    for kind, rows in (("recency", from_recency == 1), ("priority", from_recency == 0)):
        if rows.any():
            metrics[f"policy_lag_{kind}_mean"] = float(lags[rows].mean())
    return metrics


def lag_metrics(lags: np.ndarray, prefix: str = "policy_lag") -> dict[str, float]:
    """`{prefix}_mean` and `{prefix}_max` of a batch's lags."""
    return {f"{prefix}_mean": float(lags.mean()), f"{prefix}_max": float(lags.max())}
