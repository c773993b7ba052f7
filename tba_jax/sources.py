"""Where the learner's batches come from: one small interface, one source per mode.

The training loop (`tba_jax.train`) sees only `BatchSource`:

    source.start(stop_signal)          begin producing; returns once a batch can be drawn
    batch = source.next_batch(step)    B prompts × K responses, a `SampledBatch`
    source.publish(params, version)    every `source.publish_every` learner steps
    source.metrics(step)               the source's own numbers for the log (buffer stats)
    source.state() / restore(state)    what a checkpoint keeps of it
    source.close()

- `AsyncSource` (TBA): searcher threads generate S responses per prompt with the
  latest published params into a replay buffer, never waiting for the learner;
  `next_batch` samples the buffer; params are published every `sync_period` steps.
- `SyncSource` (the on-policy baseline): `next_batch` generates K fresh responses per
  prompt with the current params, scores and collates them; it publishes every step.

A source may be local threads (as here), other processes, or a fused generation
engine: the loop does not know which.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, NamedTuple, Protocol

import jax
import ml_collections
import numpy as np

from tba_jax import runtime
from tba_jax.checkpoint import StopSignal
from tba_jax.data.pipeline import PromptStream
from tba_jax.models import Model, Params
from tba_jax.replay import ReplayBuffer
from tba_jax.run_totals import Meters
from tba_jax.sampling.generate import SamplingConfig, make_generate_fn
from tba_jax.sampling.scoring import make_score_fn
from tba_jax.tasks.base import Task
from tba_jax.trajectories import SampledBatch, collate

SEARCHER_JOIN_TIMEOUT_S = 60.0
BUFFER_POLL_S = 0.05


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

    def start(self, stop_signal: StopSignal) -> None: ...

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
    """Generates `samples_per_prompt` responses per prompt and scores them for the task."""
    tokenizer = task.tokenizer
    return runtime.SearchWorker(
        generate_fn=make_generate_fn(
            model,
            sampling_config(config, tokenizer.vocab_size),
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
        ),
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


def make_replay_buffer(config: ml_collections.ConfigDict, pad_id: int) -> ReplayBuffer:
    return ReplayBuffer(
        max_prompt_len=config.max_prompt_len,
        max_response_len=config.max_response_len,
        pad_id=pad_id,
        capacity=config.replay.capacity,
        capacity_per_prompt=config.replay.capacity_per_prompt,
        recency_prob=config.replay.recency_prob,
        priority=config.replay.priority,
        priority_inverse_temperature=config.replay.priority_inverse_temperature,
    )


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
    ):
        self.config, self.store, self.stream, self.buffer = config, store, stream, buffer
        self.meters = meters
        self.publish_every = config.sync_period
        stop, errors = threading.Event(), queue.Queue()
        self.pool = runtime.SearcherPool(
            [
                runtime.Searcher(
                    index,
                    worker,
                    store,
                    stream,
                    buffer,
                    prompts_per_call=config.search.prompts_per_call,
                    seed=config.seed + start_step,
                    stop=stop,
                    errors=errors,
                    max_empty_calls=config.max_nonfinite_steps,
                )
                for index in range(config.search.num_searchers)
            ],
            stop,
            errors,
        )

    def start(self, stop_signal: StopSignal) -> None:
        self.pool.start()
        with self.meters.time_split.measure("waiting"):
            self.pool.wait_for_buffer(
                self.buffer, self.config.replay.min_prompts, BUFFER_POLL_S, stop_signal
            )

    def next_batch(self, step: int) -> SampledBatch:
        self.pool.raise_if_failed()
        batch_cfg = self.config.batch
        return self.buffer.sample(
            batch_cfg.prompts_per_batch,
            batch_cfg.samples_per_prompt,
            np.random.default_rng([self.config.seed, step]),
        )

    def publish(self, params: Params, version: int) -> None:
        self.store.publish(params, version=version)

    def metrics(self, step: int) -> dict[str, float]:
        metrics = {f"buffer_{k}": v for k, v in self.buffer.stats(step).items()}
        dropped = self.meters.rates.totals().get(runtime.DROPPED_NONFINITE, 0)
        metrics[runtime.DROPPED_NONFINITE] = float(dropped)
        return metrics

    def state(self) -> SourceState:
        return SourceState(self.buffer.state_dict(), self.stream.position, self.store.get()[1])

    def restore(self, state: SourceState) -> None:
        self.buffer.load_state_dict(state.buffer)
        self.stream.restore(state.data_position)

    def close(self) -> None:
        self.pool.close(SEARCHER_JOIN_TIMEOUT_S)


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
    ):
        self.config, self.worker, self.store, self.stream = config, worker, store, stream
        self.pad_id = pad_id

    def start(self, stop_signal: StopSignal) -> None:
        del stop_signal  # nothing runs between batches

    def next_batch(self, step: int) -> SampledBatch:
        params, version = self.store.get()
        examples = self.stream.next_batch(self.config.batch.prompts_per_batch)
        rng = jax.random.fold_in(jax.random.key(self.config.seed), step)
        trajectories = self.worker.search(params, version, examples, rng)
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
        return SourceState({}, self.stream.position, self.store.get()[1])

    def restore(self, state: SourceState) -> None:
        self.stream.restore(state.data_position)

    def close(self) -> None:
        pass


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
) -> BatchSource:
    """The batch source of `config.mode`, publishing `params` as `version` to start with."""
    store = runtime.PolicyStore(sampler_shardings, params, version=version)
    stream = PromptStream(task.train, seed=config.seed)
    is_async = config.mode == "async"
    worker = make_search_worker(
        config,
        task,
        model,
        reference_params,
        # async: S per prompt, of which batches draw K; sync: the K of the batch
        samples_per_prompt=(
            config.batch.samples_generated_per_prompt
            if is_async
            else config.batch.samples_per_prompt
        ),
        meters=meters,
        drop_nonfinite=is_async,  # a sync batch keeps its shape (see SearchWorker)
    )
    if is_async:
        buffer = make_replay_buffer(config, task.tokenizer.pad_id)
        return AsyncSource(config, worker, store, stream, buffer, meters, start_step=version)
    return SyncSource(config, worker, store, stream, task.tokenizer.pad_id)
