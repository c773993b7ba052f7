"""roles_by_process: the learner processes' batch source and the searcher processes' loop.

Searcher processes run `runtime.Searcher` threads on their own devices into an
`exchange.Outbox` (async), or generate their share of each batch on demand (sync); their
main thread takes part in every exchange (`tba_jax.exchange`). Learner processes draw
batches from a replay buffer fed by the rounds (`RemoteSource`). Time a learner spends
inside exchanges is its `exchanging` time (per step in summary.json).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from tba_jax import exchange, runtime
from tba_jax import mesh as mesh_lib
from tba_jax.checkpoint import RunStopped, StopSignal
from tba_jax.data.pipeline import PromptStream
from tba_jax.models import Params
from tba_jax.replay import ReplayBuffer
from tba_jax.run_totals import EXCHANGING, Meters
from tba_jax.sources import (
    SAMPLES_DROPPED_STALE,
    SEARCHER_JOIN_TIMEOUT_S,
    SourceState,
    make_searcher_pool,
)
from tba_jax.topology import LearnerGroup, Topology
from tba_jax.trajectories import SampledBatch, Trajectory, collate

SOURCE = 0  # learner process 0 sends params
# An async searcher process sends at most this many search calls' samples per round (the
# newest) and holds at most OUTBOX_CALLS calls' worth (older samples are dropped first).
BLOCK_CALLS = 4
OUTBOX_CALLS = 8


def block_rows(config: ml_collections.ConfigDict, num_searchers: int) -> int:
    """Rows of a searcher's block per round: its share of a sync batch, or (async) up to
    BLOCK_CALLS search calls of every searcher thread."""
    batch = config.batch
    if config.mode == "sync":
        return batch.prompts_per_batch // num_searchers * batch.samples_per_prompt
    per_call = config.search.prompts_per_call * batch.samples_generated_per_prompt
    return BLOCK_CALLS * per_call * config.search.num_searchers


def stream_positions(flags: np.ndarray, searchers) -> list[dict[str, int]]:
    return [
        {
            "epoch": int(flags[p, exchange.FLAG_STREAM_EPOCH]),
            "index": int(flags[p, exchange.FLAG_STREAM_INDEX]),
        }
        for p in searchers
    ]


class RemoteSource:
    """A learner process's batches: trajectories from searcher processes, by exchange."""

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        topology: Topology,
        group: LearnerGroup,
        *,
        exchange_mesh: exchange.ExchangeMesh,
        params: Params,
        reference: Params,
        version: int,
        buffer: ReplayBuffer | None,
        meters: Meters,
        pad_id: int,
    ):
        self.config, self.topology, self.group = config, topology, group
        self.exchange_mesh = exchange_mesh
        self.buffer, self.meters, self.pad_id = buffer, meters, pad_id
        self.is_sync = config.mode == "sync"
        self.publish_every = 1 if self.is_sync else config.sync_period
        self.version = version
        self.rows = block_rows(config, topology.num_searchers)
        self.my_searchers = exchange.searchers_of(
            topology.learner_rank, topology.num_learners, topology.searcher_processes
        )
        self.positions = [{"epoch": 0, "index": 0}] * topology.num_searchers
        self._start_params, self._start_reference = params, reference
        self._stop_agreed = False
        self._publish_next = False
        self._stop_signal: StopSignal | None = None
        self._fresh: list[Trajectory] = []
        self.remote_counts = {"samples": 0.0, "tokens": 0.0}
        self.store = None  # the searchers are other processes
        self.max_policy_lag = 0 if self.is_sync else config.replay.max_policy_lag
        self.dropped_stale = 0  # samples past replay.max_policy_lag, this segment
        # the last round's learners all held enough prompts fresh for the next step
        self._next_step_ready = False

    # -- the exchange --------------------------------------------------------------------

    def _round(self, next_op: int, ready: bool = True) -> None:
        flags = np.zeros(exchange.NUM_FLAGS, np.int64)
        flags[exchange.FLAG_STOP] = self._stop_signal is not None and self._stop_signal.requested
        flags[exchange.FLAG_NEXT] = next_op
        flags[exchange.FLAG_READY] = ready
        flags[exchange.FLAG_PROMPTS] = 0 if self.buffer is None else self.buffer.num_prompts
        block = exchange.empty_block(
            self.rows, self.config.max_prompt_len, self.config.max_response_len
        )
        with self.meters.time_split.measure(EXCHANGING):
            all_flags, blocks = exchange.exchange_round(self.exchange_mesh, flags, block)
        searchers = list(self.topology.searcher_processes)
        self.positions = stream_positions(all_flags, searchers)
        self.remote_counts = {
            "samples": float(all_flags[searchers, exchange.FLAG_SAMPLES].sum()),
            "tokens": float(all_flags[searchers, exchange.FLAG_TOKENS].sum()),
        }
        self._stop_agreed = (
            bool(all_flags[:, exchange.FLAG_STOP].any()) or next_op == exchange.NEXT_FINISH
        )
        if self._stop_agreed and self._stop_signal is not None and not self._stop_signal.requested:
            asked = [p for p in range(len(all_flags)) if all_flags[p, exchange.FLAG_STOP]]
            if asked:
                self._stop_signal.request(f"a stop request on process {asked[0]}")
        self._publish_next = next_op == exchange.NEXT_PUBLISH and not self._stop_agreed
        self._fresh = exchange.blocks_of(blocks, self.my_searchers)
        learners = list(self.topology.learner_processes)
        self._all_ready = bool(all_flags[learners, exchange.FLAG_READY].all())
        self._every_learner_has_prompts = bool(all_flags[learners, exchange.FLAG_PROMPTS].all())
        if self.buffer is not None and self._fresh:
            self.buffer.add(self._fresh)

    def _broadcast(self, device_tree: Any, host_values: dict[str, np.ndarray]) -> None:
        """`device_tree` (on the learner mesh) and `host_values` from learner process 0 to
        every process. Every learner process gathers its copy (a collective); only
        process 0's values are sent."""
        with self.meters.time_split.measure(EXCHANGING):
            local = self.group.local_copy(device_tree)
            if self.topology.is_primary:
                tree = jax.device_get(local)
            else:
                tree = exchange.zeros_like_abstract(local)
            self.exchange_mesh.broadcast({**tree, **host_values}, self.topology.is_primary)

    # -- BatchSource -------------------------------------------------------------------

    def start(self, stop_signal: StopSignal, meanwhile: Callable[[], None] | None = None) -> None:
        self._stop_signal = stop_signal
        positions = [[p["epoch"], p["index"]] for p in self.positions]
        self._broadcast(
            {"params": self._start_params, "reference": self._start_reference},
            {
                "version": np.asarray(self.version, np.int64),
                "positions": np.asarray(positions, np.int64),
            },
        )
        self._start_params = self._start_reference = None
        if meanwhile is not None:  # the searcher processes generate from the start params
            with self.meters.time_split.measure("training"):
                meanwhile()
        if self.is_sync:
            return  # the first round brings the first batch
        min_prompts = self.config.replay.min_prompts
        while True:
            self._round(exchange.NEXT_ROUND, ready=self.buffer.num_prompts >= min_prompts)
            if self._all_ready or self._stop_agreed:
                return

    def agreed_stop(self, requested: bool) -> bool:
        del requested  # sent in the next round's flags; agreed there
        return self._stop_agreed

    def next_batch(self, step: int) -> SampledBatch:
        if self.max_policy_lag:
            self._drop_stale(step)
        last = step + 1 >= self.config.learner_steps
        publish = (step + 1) % self.publish_every == 0
        next_op = (
            exchange.NEXT_FINISH
            if last
            else (exchange.NEXT_PUBLISH if publish else exchange.NEXT_ROUND)
        )
        if not self._stop_agreed:  # agreed in _drop_stale's rounds: nothing more is exchanged
            self._round(next_op, ready=self._fresh_enough(step + 1))
            self._next_step_ready = self._all_ready
        batch_cfg = self.config.batch
        prompts = batch_cfg.prompts_per_batch // self.topology.num_learners
        if self.is_sync:
            return self._collate_fresh(prompts, batch_cfg.samples_per_prompt)
        return self.buffer.sample(
            prompts,
            batch_cfg.samples_per_prompt,
            np.random.default_rng([self.config.seed, step, self.topology.process_index]),
        )

    def _fresh_enough(self, step: int) -> bool:
        """Whether this learner's buffer holds `replay.min_prompts` prompts with samples
        fresh enough for `step` (before the round's samples arrive: they only add)."""
        if self.buffer is None:
            return True
        if self.max_policy_lag:
            prompts = self.buffer.num_prompts_since(step - self.max_policy_lag)
        else:
            prompts = self.buffer.num_prompts
        return prompts >= self.config.replay.min_prompts

    def _drop_stale(self, step: int) -> None:
        """Drops samples more than `replay.max_policy_lag` versions behind `step`; unless the
        last round said every learner still holds `replay.min_prompts` prompts after that,
        rounds follow until they all do. A stop agreed meanwhile ends the rounds (the
        searcher processes are gone): the step trains if every learner holds a prompt,
        else the run stops before it (`RunStopped`; the step before is saved)."""
        self.dropped_stale += self.buffer.drop_older_than(step - self.max_policy_lag)
        if self._next_step_ready:
            return
        while True:  # the rounds' time counts as exchanging, as the first fill's does
            self._round(exchange.NEXT_ROUND, ready=self._fresh_enough(step))
            if self._all_ready:
                return
            if self._stop_agreed:
                if self._every_learner_has_prompts:
                    return
                raise RunStopped("the run stopped while the learners waited for fresh samples")

    def _collate_fresh(self, prompts: int, k: int) -> SampledBatch:
        if len(self._fresh) != prompts * k:
            raise RuntimeError(
                f"A sync round brought {len(self._fresh)} samples for {prompts} prompts × {k}; "
                "the searcher processes must send exactly their share."
            )
        return collate(
            self._fresh,
            max_prompt_len=self.config.max_prompt_len,
            max_response_len=self.config.max_response_len,
            pad_id=self.pad_id,
            prompt_ids=np.array([t.prompt_id for t in self._fresh[::k]]),
            from_recency=np.ones(prompts, bool),
        )

    def publish(self, params: Params, version: int) -> None:
        self.version = version
        if self._publish_next:
            self._publish_next = False
            self._broadcast({"params": params}, {"version": np.asarray(version, np.int64)})
            if self.buffer is not None:
                self.buffer.mark_sync(version)  # the searchers generate with it from now on

    def metrics(self, step: int) -> dict[str, float]:
        if self.buffer is None:
            return {}
        metrics = {f"buffer_{k}": v for k, v in self.buffer.stats(step).items()}
        if self.max_policy_lag:
            metrics[SAMPLES_DROPPED_STALE] = float(self.dropped_stale + self.buffer.refused_stale)
        return metrics

    def state(self) -> SourceState:
        buffer = {} if self.buffer is None else self.buffer.state_dict()
        return SourceState(buffer, {"searchers": self.positions}, self.version)

    def restore(self, state: SourceState) -> None:
        if self.buffer is not None and state.buffer:
            self.buffer.load_state_dict(state.buffer)
        saved = state.data_position.get("searchers")
        if saved is not None and len(saved) == self.topology.num_searchers:
            self.positions = [dict(p) for p in saved]

    def close(self) -> None:
        pass


def run_searcher_process(
    config: ml_collections.ConfigDict,
    topology: Topology,
    *,
    worker: runtime.SearchWorker,
    stream: PromptStream,
    sampler_shardings: Any,
    exchange_mesh: exchange.ExchangeMesh,
    abstract_params: Any,
    meters: Meters,
    stop_signal: StopSignal,
    params_cast: Callable[[Params], Params] | None = None,
) -> None:
    """A searcher process's whole run: receive the start (params, π_ref, its stream
    position), then search and exchange until the learners finish or any process asks to
    stop. `worker.reference_params` is set from the start broadcast. The policy's params
    are held through `params_cast` (`models.compute_dtype_cast`)."""
    start_template = {
        "params": abstract_params,
        "reference": abstract_params,
        "version": jax.ShapeDtypeStruct((), np.int64),
        "positions": jax.ShapeDtypeStruct((topology.num_searchers, 2), np.int64),
    }
    start = exchange_mesh.broadcast(exchange.zeros_like_abstract(start_template), is_source=False)
    epoch, index = start["positions"][topology.searcher_rank]
    stream.restore({"epoch": int(epoch), "index": int(index)})
    worker.reference_params = mesh_lib.publish(start["reference"], sampler_shardings)
    store = runtime.PolicyStore(
        sampler_shardings,
        start["params"],
        version=int(start["version"]),
        copy_fn=functools.partial(mesh_lib.publish, cast=params_cast),
    )
    rows = block_rows(config, topology.num_searchers)
    is_sync = config.mode == "sync"
    outbox = exchange.Outbox(rows // BLOCK_CALLS * OUTBOX_CALLS)
    pool = None
    if not is_sync:
        pool = make_searcher_pool(
            config, worker, store, stream, outbox, topology.process_index, int(start["version"])
        )
        pool.start()
    try:
        while True:
            if is_sync:
                fresh = search_share(config, topology, worker, store, stream)
            else:
                pool.raise_if_failed()
                fresh = outbox.take(rows)
            flags = searcher_flags(stream, meters, outbox, stop_signal)
            block = exchange.pack_block(fresh, rows, config.max_prompt_len, config.max_response_len)
            all_flags, _ = exchange.exchange_round(exchange_mesh, flags, block)
            next_op = all_flags[SOURCE, exchange.FLAG_NEXT]
            if all_flags[:, exchange.FLAG_STOP].any() or next_op == exchange.NEXT_FINISH:
                break
            if next_op == exchange.NEXT_PUBLISH:
                published = exchange_mesh.broadcast(
                    {
                        "params": exchange.zeros_like_abstract(abstract_params),
                        "version": np.zeros((), np.int64),
                    },
                    is_source=False,
                )
                store.publish(published["params"], version=int(published["version"]))
    finally:
        if pool is not None:
            pool.close(SEARCHER_JOIN_TIMEOUT_S)
    logging.info(
        "Searcher process %d: done (%d samples).",
        topology.process_index,
        meters.rates.totals().get("samples", 0),
    )


def search_share(config, topology, worker, store, stream) -> list[Trajectory]:
    """Sync mode: this searcher process's share of the next batch, with the newest params."""
    params, version = store.get()
    prompts = config.batch.prompts_per_batch // topology.num_searchers
    rng = jax.random.fold_in(jax.random.key(config.seed), version)
    rng = jax.random.fold_in(rng, topology.process_index)
    return worker.search(params, version, stream.next_batch(prompts), rng)


def searcher_flags(stream, meters: Meters, outbox, stop_signal: StopSignal) -> np.ndarray:
    position, totals = stream.position, meters.rates.totals()
    flags = np.zeros(exchange.NUM_FLAGS, np.int64)
    flags[exchange.FLAG_STOP] = stop_signal.requested
    flags[exchange.FLAG_STREAM_EPOCH] = position["epoch"]
    flags[exchange.FLAG_STREAM_INDEX] = position["index"]
    flags[exchange.FLAG_SAMPLES] = totals.get("samples", 0)
    flags[exchange.FLAG_TOKENS] = totals.get("tokens", 0)
    flags[exchange.FLAG_DROPPED] = outbox.dropped
    return flags
