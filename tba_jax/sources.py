"""Where the learner's batches come from: one small interface, one source per mode.

The training loop (`tba_jax.train`) sees only `BatchSource`:

    source.start(stop_signal, meanwhile)  begin producing; runs `meanwhile` (the learner's
                                       first-step compile) while the first samples are
                                       made; returns once a batch can be drawn
    batch = source.next_batch(step)    B prompts × K responses, a `SampledBatch`
    source.publish(params, version)    every `source.publish_every` learner steps
    source.metrics(step)               the source's own numbers for the log (buffer stats)
    source.state() / restore(state)    what a checkpoint keeps of it
    source.close()

- `AsyncSource` (TBA): searcher threads generate S responses per prompt with the
  latest published params into a replay buffer, never waiting for the learner;
  `next_batch` samples the buffer; params are published every `sync_period` steps (and
  the buffer told so: `ReplayBuffer.mark_sync`, which starts its next sync window).
- `SyncSource` (the on-policy baseline): `next_batch` generates K fresh responses per
  prompt with the current params, scores and collates them; it publishes every step.

A source may be local threads (as here), other processes, or a fused generation
engine: the loop does not know which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import ml_collections
import numpy as np

from tba_jax import config_lib, runtime
from tba_jax.checkpoint import StopSignal
from tba_jax.data.pipeline import PromptStream
from tba_jax.fused import FusedSearchWorker
from tba_jax.models import Model, Params, compute_dtype_cast
from tba_jax.replay import ReplayBuffer
from tba_jax.run_totals import Meters
from tba_jax.sampling.engine import EngineConfig, SlotEngine
from tba_jax.sampling.generate import SamplingConfig, make_generate_fn
from tba_jax.sampling.scoring import make_score_fn
from tba_jax.tasks.base import Task
from tba_jax.topology import LearnerGroup, Topology, shard_of
from tba_jax.trajectories import SampledBatch, collate

SEARCHER_JOIN_TIMEOUT_S = 60.0
BUFFER_POLL_S = 0.05
# seconds the searchers waited for room under search.max_samples_per_draw, this segment
SEARCHERS_PAUSED_SECONDS = "searchers_paused_seconds"
SAMPLES_DROPPED_STALE = "samples_dropped_stale"  # by replay.max_policy_lag, this segment


class SourceState(NamedTuple):
    """What a checkpoint keeps of a source.

    buffer: the replay buffer's arrays (`ReplayBuffer.state_dict`; empty without one);
    data_position: the prompt stream's position; policy_version: the published version.
    """

    buffer: dict[str, np.ndarray]
    data_position: dict[str, int]
    policy_version: int


class BatchSource(Protocol):
    publish_every: int
    # samples and tokens other processes generated this segment (summary totals)
    remote_counts: dict[str, float]
    # the params this process's searchers generate with; None where the searchers are
    # other processes (a roles_by_process learner)
    store: runtime.PolicyStore | None

    def start(self, stop_signal: StopSignal, meanwhile: Callable[[], None] | None = None) -> None:
        """Begins producing; returns once a batch can be drawn. `meanwhile` (when given)
        runs once, done before the first batch is returned, while that batch is made:
        async, on this thread while the searchers fill the buffer; sync, on a thread beside
        the first generation (by process, either mode: on this thread after the start
        broadcast, while the searcher processes make the first samples)."""

    def agreed_stop(self, requested: bool) -> bool: ...

    def next_batch(self, step: int) -> SampledBatch: ...

    def publish(self, params: Params, version: int) -> None: ...

    def metrics(self, step: int) -> dict[str, float]: ...

    def state(self) -> SourceState: ...

    def restore(self, state: SourceState) -> None: ...

    def close(self) -> None: ...


def sampling_config(
    config: ml_collections.ConfigDict, vocab_limit: int, greedy: bool = False
) -> SamplingConfig:
    """How the run draws responses (`config.sampling`), or greedily for evaluation.
    `vocab_limit`: the tokenizer's vocabulary size (ids past it are never drawn)."""
    if greedy:
        return SamplingConfig(
            max_new_tokens=config.max_response_len, greedy=True, vocab_limit=vocab_limit
        )
    return SamplingConfig(
        max_new_tokens=config.max_response_len, vocab_limit=vocab_limit, **config.sampling.to_dict()
    )


def make_search_worker(
    config: ml_collections.ConfigDict,
    task: Task,
    model: Model,
    reference_params: Params,
    *,
    samples_per_prompt: int,
    meters: Meters,
    drop_nonfinite: bool,
) -> runtime.SearchWorker:
    """Generates `samples_per_prompt` responses per prompt and scores them for the task,
    with `search.engine`'s generator (a `SearchWorker` or a `FusedSearchWorker`)."""
    tokenizer = task.tokenizer
    sampling = sampling_config(config, tokenizer.vocab_size)
    shared = dict(
        score_fn=make_score_fn(
            model,
            temperature=config.sampling.temperature,
            rows_per_chunk=config.search.score_rows_per_chunk,
        ),
        reference_params=reference_params,
        tokenizer=tokenizer,
        rewards_fn=task.rewards,
        max_prompt_len=config.max_prompt_len,
        samples_per_prompt=samples_per_prompt,
        time_split=meters.time_split,
        rates=meters.rates,
        non_eos_penalty=task.non_eos_penalty,
        drop_nonfinite=drop_nonfinite,
    )
    if config.search.engine == "slots":
        engine = SlotEngine(
            model,
            sampling,
            engine_config(
                config.search, config.search.slots or config_lib.samples_per_search_call(config)
            ),
            max_prompt_len=config.max_prompt_len,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
        )
        return FusedSearchWorker(
            engine=engine,
            score_rows=config.search.score_rows or samples_per_prompt,
            score_length_buckets=config.search.get(  # a config saved before it existed
                "score_length_buckets", FusedSearchWorker.score_length_buckets
            ),
            bucket_min_tokens=bucket_min_tokens(config.search),
            **shared,
        )
    generate_fn = make_generate_fn(
        model, sampling, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id
    )
    return runtime.SearchWorker(generate_fn=generate_fn, **shared)


def bucket_min_tokens(search: ml_collections.ConfigDict) -> int:
    """search.bucket_min_tokens; 1 (exactly N length buckets, as before the key existed)
    for a config saved without it."""
    return search.get("bucket_min_tokens", 1)


def engine_config(search: ml_collections.ConfigDict, slots: int) -> EngineConfig:
    """The slot engine's settings from `config.search`, with `slots` decode slots."""
    return EngineConfig(
        slots=slots,
        chunk_steps=search.chunk_steps,
        # a config saved before it existed ended tail chunks at chunk_steps
        tail_chunk_steps=search.get("tail_chunk_steps", search.chunk_steps),
        prefill_prompts=search.prefill_prompts,
        refill_free=search.get("refill_free", 0.0),  # a config saved before it existed
        prefill_buckets=search.prefill_buckets,
        bucket_min_tokens=bucket_min_tokens(search),
        compact_below=search.compact_below,
        min_width=search.min_width,
        compact_min_steps=search.get("compact_min_steps", 0),  # a config saved before it
    )


def evaluation_engine_config(config: ml_collections.ConfigDict) -> EngineConfig | None:
    """The slot engine with eval.batch_size slots and eval.refill_free when the run
    searches with it (search.engine=slots), else None: batches of eval.batch_size. A
    config saved before the engine existed has no search.engine: batches; one saved before
    eval.refill_free refilled as its searchers did."""
    if config.search.get("engine", "batch") != "slots":
        return None
    searching = engine_config(config.search, config.eval.batch_size)
    refill_free = config.eval.get("refill_free", searching.refill_free)
    return dataclasses.replace(searching, refill_free=refill_free)


def make_replay_buffer(config: ml_collections.ConfigDict, pad_id: int) -> ReplayBuffer:
    """The replay buffer of `config.replay`. A config saved before `replay.draw_rule`
    existed ran the "newest" rule."""
    return ReplayBuffer(
        max_prompt_len=config.max_prompt_len,
        max_response_len=config.max_response_len,
        pad_id=pad_id,
        capacity=config.replay.capacity,
        capacity_per_prompt=config.replay.capacity_per_prompt,
        recency_prob=config.replay.recency_prob,
        priority=config.replay.priority,
        priority_inverse_temperature=config.replay.priority_inverse_temperature,
        draw_rule=config.replay.get("draw_rule", "newest"),
    )


STREAM_POSITION_KEYS = ("stream_epoch", "stream_index")  # in a process's buffer file


class ProcessShare:
    """This process's part of a roles_within_host run (or all of a single-process run):
    its share of each batch, its RNG streams, and the per-step agreement on stopping."""

    def __init__(self, topology: Topology, group: LearnerGroup | None, meters: Meters):
        self.topology, self.group, self.meters = topology, group, meters
        self.remote_counts = {"samples": 0.0, "tokens": 0.0}

    def prompts(self, prompts_per_batch: int) -> int:
        return prompts_per_batch // self.topology.num_learners

    def rng_seed(self, *seed: int) -> list[int]:
        """`seed` extended by the process index when there are several processes."""
        return [*seed, self.topology.process_index] if self.topology.multi_process else list(seed)

    def agreed_stop(self, requested: bool) -> bool:
        """Whether any process asked to stop (a collective over the learner group), and the
        other processes' sample counts."""
        if not self.topology.multi_process:
            return requested
        totals = self.meters.rates.totals()
        mine = np.asarray([requested, totals.get("samples", 0), totals.get("tokens", 0)], float)
        everyone = self.group.gather(mine)
        others = everyone.sum(axis=0) - mine
        self.remote_counts = {"samples": float(others[1]), "tokens": float(others[2])}
        return bool(everyone[:, 0].any())

    def with_position(self, buffer_state: dict, stream: PromptStream) -> dict:
        """A process's buffer file also keeps its own prompt-stream position."""
        if not self.topology.multi_process:
            return buffer_state
        position = stream.position
        return {
            **buffer_state,
            "stream_epoch": np.asarray(position["epoch"], np.int64),
            "stream_index": np.asarray(position["index"], np.int64),
        }

    def restore_position(self, state: SourceState, stream: PromptStream) -> dict:
        """Restores `stream` (from the process's file, else the metadata); returns the
        buffer state without the position keys."""
        buffer = dict(state.buffer)
        if all(key in buffer for key in STREAM_POSITION_KEYS):
            epoch, index = (int(buffer.pop(key)) for key in STREAM_POSITION_KEYS)
            stream.restore({"epoch": epoch, "index": index})
        else:
            stream.restore(state.data_position)
        return buffer


def restarts_on_publish(config: ml_collections.ConfigDict) -> bool:
    """Whether async searchers start their live prompts over at a publish: slot-engine
    searchers without in-flight updates, unless `search.restart_on_publish` is False (a
    config saved before the key: no, as then)."""
    search = config.search
    return (
        search.get("engine", "batch") == "slots"
        and not search.get("in_flight_updates", False)
        and search.get("restart_on_publish", False)
    )


def make_searcher_pool(
    config: ml_collections.ConfigDict,
    worker: runtime.SearchWorker,
    store: runtime.PolicyStore,
    stream: PromptStream,
    sink: Any,
    process_index: int,
    start_step: int,
    limit: runtime.SampleLimit | None = None,
) -> runtime.SearcherPool:
    """`search.num_searchers` searcher threads adding to `sink` (a replay buffer or an
    outbox; anything with `add(trajectories)`), sharing `limit` when given. Searcher
    indices count across processes, so every thread of every process has its own RNG
    stream."""
    first_index = process_index * config.search.num_searchers
    stop, errors = threading.Event(), queue.Queue()
    searchers = [
        runtime.Searcher(
            first_index + index,
            worker,
            store,
            stream,
            sink,
            prompts_per_call=config.search.prompts_per_call,
            seed=config.seed + start_step,
            stop=stop,
            errors=errors,
            max_empty_calls=config.max_nonfinite_steps,
            in_flight_updates=config.search.in_flight_updates,
            restart_on_publish=restarts_on_publish(config),
            limit=limit,
        )
        for index in range(config.search.num_searchers)
    ]
    return runtime.SearcherPool(searchers, stop, errors)


def sample_limit(
    config: ml_collections.ConfigDict, share: ProcessShare
) -> runtime.SampleLimit | None:
    """This process's bound on its searchers' samples (`search.max_samples_per_draw`;
    None when 0): its learner's draws per step, and before the first draw room for the
    buffer's first fill and one hand-on of `prompts_per_call` prompts (which the buffer
    takes whole), so the fill cannot wait on a draw that waits on the fill."""
    ratio = config.search.get("max_samples_per_draw", 0.0)
    if not ratio:
        return None
    first_prompts = config.replay.min_prompts + config.search.prompts_per_call
    draws = share.prompts(config.batch.prompts_per_batch) * config.batch.samples_per_prompt
    warm_samples = first_prompts * config_lib.samples_per_search_prompt(config)
    return runtime.SampleLimit(ratio, warm_samples, draws)


class AsyncSource:
    """TBA: searcher threads fill a replay buffer; batches are sampled from it."""

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        worker: runtime.SearchWorker,
        store: runtime.PolicyStore,
        stream: PromptStream,
        buffer: ReplayBuffer,
        meters: Meters,
        start_step: int,
        share: ProcessShare,
    ):
        self.config, self.store, self.stream, self.buffer = config, store, stream, buffer
        self.meters, self.share = meters, share
        self.publish_every = config.sync_period
        self.start_step = start_step
        self.limit = sample_limit(config, share)
        self.pool = make_searcher_pool(
            config,
            worker,
            store,
            stream,
            buffer,
            share.topology.process_index,
            start_step,
            self.limit,
        )
        self.dropped_stale = 0  # samples past replay.max_policy_lag, this segment
        self.stop_signal: StopSignal | None = None

    def start(self, stop_signal: StopSignal, meanwhile: Callable[[], None] | None = None) -> None:
        self.stop_signal = stop_signal
        self.pool.start()
        if meanwhile is not None:  # while the searchers fill the buffer
            with self.meters.time_split.measure("training"):
                meanwhile()
        with self.meters.time_split.measure("waiting"):
            self.pool.wait_for_buffer(
                self.buffer, self.config.replay.min_prompts, BUFFER_POLL_S, stop_signal
            )

    @property
    def remote_counts(self) -> dict[str, float]:
        return self.share.remote_counts

    def agreed_stop(self, requested: bool) -> bool:
        return self.share.agreed_stop(requested)

    def next_batch(self, step: int) -> SampledBatch:
        self.pool.raise_if_failed()
        if self.limit is not None:  # room for the samples of the step after this one
            self.limit.learner_drew(step - self.start_step + 1)
        if self.config.replay.max_policy_lag:
            self._drop_stale(step)
        batch_cfg = self.config.batch
        return self.buffer.sample(
            self.share.prompts(batch_cfg.prompts_per_batch),
            batch_cfg.samples_per_prompt,
            np.random.default_rng(self.share.rng_seed(self.config.seed, step)),
        )

    def _drop_stale(self, step: int) -> None:
        """Drops samples more than `replay.max_policy_lag` versions behind `step`, then
        waits for the searchers to refill the buffer to `replay.min_prompts` prompts."""
        dropped = self.buffer.drop_older_than(step - self.config.replay.max_policy_lag)
        self.dropped_stale += dropped
        lifted = contextlib.nullcontext() if self.limit is None else self.limit.lifted(dropped)
        with self.meters.time_split.measure("waiting"), lifted:
            self.pool.wait_for_buffer(
                self.buffer, self.config.replay.min_prompts, BUFFER_POLL_S, self.stop_signal
            )
            # a stop asked for meanwhile still trains this step: on at least one prompt
            self.pool.wait_for_buffer(self.buffer, 1, BUFFER_POLL_S, None)

    def publish(self, params: Params, version: int) -> None:
        self.store.publish(params, version=version)
        self.buffer.mark_sync(version)  # the authors' online samples start anew

    def metrics(self, step: int) -> dict[str, float]:
        metrics = {f"buffer_{k}": v for k, v in self.buffer.stats(step).items()}
        totals = self.meters.rates.totals()
        metrics[runtime.DROPPED_NONFINITE] = float(totals.get(runtime.DROPPED_NONFINITE, 0))
        if self.limit is not None:
            metrics[SEARCHERS_PAUSED_SECONDS] = self.limit.paused_seconds
        if restarts_on_publish(self.config):
            metrics[runtime.RESTARTED_PROMPTS] = float(totals.get(runtime.RESTARTED_PROMPTS, 0))
        if self.config.replay.max_policy_lag:
            metrics[SAMPLES_DROPPED_STALE] = float(self.dropped_stale + self.buffer.refused_stale)
        return metrics

    def state(self) -> SourceState:
        buffer = self.share.with_position(self.buffer.state_dict(), self.stream)
        return SourceState(buffer, self.stream.position, self.store.get()[1])

    def restore(self, state: SourceState) -> None:
        self.buffer.load_state_dict(self.share.restore_position(state, self.stream))

    def close(self) -> None:
        self.pool.close(SEARCHER_JOIN_TIMEOUT_S)


class InBackground:
    """Runs `fn` on a daemon thread; `join` waits for it and re-raises its error."""

    def __init__(self, fn: Callable[[], Any], name: str):
        self.error: BaseException | None = None

        def run() -> None:
            try:
                fn()
            except BaseException as error:  # re-raised in the thread that joins
                self.error = error

        self.thread = threading.Thread(target=run, name=name, daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


class SyncSource:
    """On-policy: each batch is generated fresh with the current params."""

    publish_every = 1

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        worker: runtime.SearchWorker,
        store: runtime.PolicyStore,
        stream: PromptStream,
        pad_id: int,
        share: ProcessShare,
    ):
        self.config, self.worker, self.store, self.stream = config, worker, store, stream
        self.pad_id, self.share = pad_id, share
        self._meanwhile: InBackground | None = None

    @property
    def remote_counts(self) -> dict[str, float]:
        return self.share.remote_counts

    def start(self, stop_signal: StopSignal, meanwhile: Callable[[], None] | None = None) -> None:
        del stop_signal  # nothing runs between batches
        if meanwhile is not None:  # on a thread, beside the first batch's generation
            self._meanwhile = InBackground(meanwhile, name="precompile")

    def agreed_stop(self, requested: bool) -> bool:
        return self.share.agreed_stop(requested)

    def next_batch(self, step: int) -> SampledBatch:
        params, version = self.store.get()
        examples = self.stream.next_batch(self.share.prompts(self.config.batch.prompts_per_batch))
        rng = jax.random.key(self.config.seed)
        for value in self.share.rng_seed(step):
            rng = jax.random.fold_in(rng, value)
        trajectories = self.worker.search(params, version, examples, rng)
        if self._meanwhile is not None:  # done before the first step: it must not compile twice
            self._meanwhile.join()
            self._meanwhile = None
        return collate(
            trajectories,
            max_prompt_len=self.config.max_prompt_len,
            max_response_len=self.config.max_response_len,
            pad_id=self.pad_id,
            prompt_ids=np.array([example["id"] for example in examples]),
            from_recency=np.ones(len(examples), bool),
        )

    def publish(self, params: Params, version: int) -> None:
        self.store.publish(params, version=version)

    def metrics(self, step: int) -> dict[str, float]:
        del step
        return {}

    def state(self) -> SourceState:
        buffer = self.share.with_position({}, self.stream)
        return SourceState(buffer, self.stream.position, self.store.get()[1])

    def restore(self, state: SourceState) -> None:
        self.share.restore_position(state, self.stream)

    def close(self) -> None:
        if self._meanwhile is not None:  # a run stopped before its first batch
            self._meanwhile.thread.join()


def prompt_stream(task: Task, topology: Topology, seed: int) -> PromptStream:
    """This process's prompts: the whole train split, or with several searching processes
    its own disjoint shard of it (`topology.shard_of`)."""
    if not topology.multi_process:
        return PromptStream(task.train, seed=seed)
    searchers = topology.searcher_processes
    return PromptStream(
        shard_of(task.train, searchers.index(topology.process_index), len(searchers)), seed=seed
    )


def make_source(
    config: ml_collections.ConfigDict,
    *,
    task: Task,
    model: Model,
    sampler_shardings: Any,
    params: Params,
    version: int,
    reference_params: Params,
    meters: Meters,
    topology: Topology,
    group: LearnerGroup,
) -> BatchSource:
    """The batch source of `config.mode` on a process that both searches and learns,
    publishing `params` as `version` to start with. `reference_params`: π_ref on the
    sampler."""
    # the searchers hold the weights in the compute dtype, as they use them
    copy_fn = functools.partial(group.publish, cast=compute_dtype_cast(model.config))
    store = runtime.PolicyStore(sampler_shardings, params, version=version, copy_fn=copy_fn)
    stream = prompt_stream(task, topology, config.seed)
    is_async = config.mode == "async"
    worker = make_search_worker(
        config,
        task,
        model,
        reference_params,
        samples_per_prompt=config_lib.samples_per_search_prompt(config),
        meters=meters,
        drop_nonfinite=is_async,  # a sync batch keeps its shape (see SearchWorker)
    )
    share = ProcessShare(topology, group, meters)
    if is_async:
        buffer = make_replay_buffer(config, task.tokenizer.pad_id)
        return AsyncSource(
            config, worker, store, stream, buffer, meters, start_step=version, share=share
        )
    return SyncSource(config, worker, store, stream, task.tokenizer.pad_id, share=share)
