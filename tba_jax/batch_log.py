"""The learner's batch log: what every learner step trained on, so a run can be replayed.

An asynchronous run is not reproducible from its config: thread timing decides which
samples each batch holds. With `config.record_learner_batches=True` the training loop
writes, for every learner step, the exact host arrays its train step consumed, the
provenance of their rows, the step's metrics and a fingerprint of the params it left.
`tba_jax.batch_replay` feeds them through the same jitted train step and finds the
first step whose params differ.

Layout (under the run's workdir)::

    learner_batches/segments.json      one entry per training segment (a fresh start or
                                       a resume): its first step, config and machine
    learner_batches/step_00000001.npz  the update from step 0 to step 1, compressed:
        batch.<field>       the train step's input, as it was (`learner.batch_fields`)
        rows.<field>        where each row came from: prompt_ids [B], from_recency [B],
                            policy_version / policy_version_last / created_at [N]
        metrics.<name>      the train step's own metrics (loss, grad_norm, ...) as float64
        fingerprint         uint32 [leaves, 2]: `fingerprint` of the params after the step

Steps are numbered as checkpoints and TensorBoard number them: file `s` holds the batch
that took the params of step s-1 to those of step s. A segment that resumes from the
checkpoint of step c removes the files after c (steps a stopped run took after its last
checkpoint are redone, and recorded again as they are redone).

Files are written by one background thread, so the loop only dispatches the fingerprint
(a small program over the params) and queues the arrays; `flush` (before every
checkpoint) waits for the files written so far.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import queue
import re
import threading
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

LOG_SUBDIR = "learner_batches"
SEGMENTS_FILENAME = "segments.json"
STEP_FILENAME_FORMAT = "step_{step:08d}.npz"
STEP_FILENAME_PATTERN = re.compile(r"^step_(\d{8})\.npz$")
BATCH_PREFIX, ROWS_PREFIX, METRICS_PREFIX = "batch.", "rows.", "metrics."
FINGERPRINT_KEY = "fingerprint"
# SampledBatch fields that say where each row came from (not read by the train step).
ROW_FIELDS = ("prompt_ids", "from_recency", "policy_version", "policy_version_last", "created_at")
QUEUED_STEPS = 8  # steps waiting for the writer thread before `record` blocks


def log_dir(workdir: str) -> str:
    return os.path.join(workdir, LOG_SUBDIR)


def step_path(directory: str, step: int) -> str:
    return os.path.join(directory, STEP_FILENAME_FORMAT.format(step=step))


def recorded_steps(directory: str) -> list[int]:
    """The steps with a complete file in `directory`, ascending."""
    if not os.path.isdir(directory):
        return []
    matches = (STEP_FILENAME_PATTERN.match(name) for name in os.listdir(directory))
    return sorted(int(match.group(1)) for match in matches if match)


# ----------------------------------------------------------------------------- fingerprint


def _leaf_bits(leaf: jax.Array) -> jax.Array:
    """The bits of every element of `leaf` as uint32 [M] (8-byte elements give two each)."""
    if leaf.dtype == jnp.bool_:
        return leaf.astype(jnp.uint32).ravel()
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[leaf.dtype.itemsize]
    return jax.lax.bitcast_convert_type(leaf, width).astype(jnp.uint32).ravel()


def _leaf_fingerprint(leaf: jax.Array) -> jax.Array:
    """uint32 [2]: the sum of the bits of `leaf`'s elements and a position-weighted sum of
    them mixed, both modulo 2^32. Integer sums are exact in any order, so the fingerprint
    does not depend on how the leaf is sharded; one flipped bit changes both."""
    bits = _leaf_bits(leaf)
    mixed = (bits ^ (bits >> 16)) * np.uint32(0x85EBCA6B)
    weights = jnp.arange(bits.size, dtype=jnp.uint32) * np.uint32(0x9E3779B1) | np.uint32(1)
    return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(mixed * weights, dtype=jnp.uint32)])


@jax.jit
def fingerprint(tree: Any) -> jax.Array:
    """uint32 [leaves, 2]: a bit-exact fingerprint of every leaf of `tree` (in
    `jax.tree.leaves` order), computed where the leaves are."""
    return jnp.stack([_leaf_fingerprint(leaf) for leaf in jax.tree.leaves(tree)])


def trained_params(state: Any) -> dict[str, Any]:
    """What a learner step changes and the fingerprint covers: the policy's params and
    (PPO) the critic's, of a `learner.TrainState`."""
    trees = {"policy": state.params}
    if getattr(state, "critic", None) is not None:
        trees["critic"] = state.critic.params
    return trees


def leaf_names(tree: Any) -> list[str]:
    """The path of every leaf of `tree`, in the order `fingerprint` lists them."""
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


# -------------------------------------------------------------------------------- segments


def environment(learner_devices: int) -> dict[str, Any]:
    """Where a segment ran: what a replay must match to reproduce it bit for bit."""
    devices = jax.devices()
    return {
        "jax": jax.__version__,
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "learner_devices": learner_devices,
    }


@dataclasses.dataclass(frozen=True)
class Segment:
    """A stretch of a run recorded by one process start: the learner steps after
    `start_step` (the checkpoint it started from) up to the next segment's start."""

    start_step: int
    config: dict  # the run's config as that segment had it (config.json then)
    environment: dict


def read_segments(directory: str) -> list[Segment]:
    path = os.path.join(directory, SEGMENTS_FILENAME)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [Segment(**entry) for entry in json.load(f)]


def _write_segments(directory: str, segments: list[Segment]) -> None:
    path = os.path.join(directory, SEGMENTS_FILENAME)
    with open(path + ".tmp", "w") as f:
        json.dump([dataclasses.asdict(s) for s in segments], f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def truncate_after(directory: str, step: int) -> None:
    """Forgets everything recorded after the checkpoint of `step`: the step files after it
    and the segments that began at or after it (a run resuming from `step` redoes them)."""
    if not os.path.isdir(directory):
        return
    for later in (s for s in recorded_steps(directory) if s > step):
        os.remove(step_path(directory, later))
    for leftover in glob.glob(os.path.join(directory, "*.tmp")):
        os.remove(leftover)
    segments = read_segments(directory)
    kept = [segment for segment in segments if segment.start_step < step]
    if kept != segments:
        _write_segments(directory, kept)


# ---------------------------------------------------------------------------------- writer


@dataclasses.dataclass
class _Entry:
    step: int
    arrays: dict[str, np.ndarray]
    fingerprint: jax.Array


class BatchLogWriter:
    """Records learner steps into `directory` from one background thread.

    Opening it at `start_step` (the step the run starts or resumes from) truncates what
    was recorded after that step and adds a segment. `record` never copies the arrays it
    is given: they must not change afterwards (a `SampledBatch`'s never do).
    """

    def __init__(self, directory: str, *, start_step: int, config: dict, env: dict):
        os.makedirs(directory, exist_ok=True)
        truncate_after(directory, start_step)
        segments = read_segments(directory)
        _write_segments(directory, [*segments, Segment(start_step, config, env)])
        self.directory = directory
        self._queue: queue.Queue[_Entry | None] = queue.Queue(maxsize=QUEUED_STEPS)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write_all, name="batch-log", daemon=True)
        self._thread.start()

    def record(
        self,
        step: int,
        batch: Mapping[str, np.ndarray],
        rows: Mapping[str, np.ndarray],
        params: Any,
        metrics: Mapping[str, Any],
    ) -> None:
        """Queues learner step `step`: the train step's input `batch` (host arrays), the
        rows' provenance, the params it produced (device arrays; fingerprinted on device
        now, so before the next step donates them) and its metrics (host scalars)."""
        self._raise_if_failed()
        arrays = {BATCH_PREFIX + name: value for name, value in batch.items()}
        arrays.update({ROWS_PREFIX + name: value for name, value in rows.items()})
        arrays.update({METRICS_PREFIX + k: np.float64(v) for k, v in metrics.items()})
        self._queue.put(_Entry(step, arrays, fingerprint(params)))

    def flush(self) -> None:
        """Returns once every queued step is on disk (raises the writer's error, if any)."""
        self._queue.join()
        self._raise_if_failed()

    def close(self) -> None:
        """Writes what is queued and stops the thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"Recording the learner's batches into {self.directory} failed: {self._error}"
            ) from self._error

    def _write_all(self) -> None:
        while (entry := self._queue.get()) is not None:
            try:
                if self._error is None:
                    self._write(entry)
            except BaseException as error:  # reported to the loop by the next call
                self._error = error
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, entry: _Entry) -> None:
        path = step_path(self.directory, entry.step)
        arrays = {**entry.arrays, FINGERPRINT_KEY: np.asarray(entry.fingerprint)}
        with open(path + ".tmp", "wb") as f:
            np.savez_compressed(f, **arrays)
        os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------------------- reader


@dataclasses.dataclass(frozen=True)
class RecordedStep:
    """One recorded learner step (see the module docstring for the fields' shapes)."""

    step: int
    batch: dict[str, np.ndarray]
    rows: dict[str, np.ndarray]
    metrics: dict[str, float]
    fingerprint: np.ndarray  # uint32 [leaves, 2]


class BatchLogReader:
    """Reads a run's batch log (`log_dir(workdir)`)."""

    def __init__(self, directory: str):
        if not os.path.isfile(os.path.join(directory, SEGMENTS_FILENAME)):
            raise FileNotFoundError(
                f"{directory} holds no batch log: the run did not record its learner batches. "
                "Train with --config.record_learner_batches=True to make a run replayable."
            )
        self.directory = directory
        self.segments = read_segments(directory)
        self.steps = recorded_steps(directory)

    def segment_of(self, step: int) -> Segment:
        """The segment that recorded learner step `step` (the last that began before it)."""
        before = [s for s in self.segments if s.start_step < step]
        if not before:
            raise FileNotFoundError(f"No segment of {self.directory} recorded step {step}.")
        return before[-1]

    def read(self, step: int) -> RecordedStep:
        path = step_path(self.directory, step)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"Learner step {step} was not recorded ({path} is missing); recorded steps: "
                f"{describe_steps(self.steps)}."
            )
        with np.load(path) as data:
            arrays = {name: data[name] for name in data.files}

        def with_prefix(prefix: str) -> dict[str, np.ndarray]:
            return {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}

        return RecordedStep(
            step=step,
            batch=with_prefix(BATCH_PREFIX),
            rows=with_prefix(ROWS_PREFIX),
            metrics={k: float(v) for k, v in with_prefix(METRICS_PREFIX).items()},
            fingerprint=arrays[FINGERPRINT_KEY],
        )


def describe_steps(steps: list[int]) -> str:
    """[1, 2, 3, 7, 8] → '1-3, 7-8' (none: 'none')."""
    if not steps:
        return "none"
    runs, start = [], steps[0]
    for previous, current in zip(steps, [*steps[1:], None], strict=True):
        if current != previous + 1:
            runs.append(str(start) if start == previous else f"{start}-{previous}")
            start = current
    return ", ".join(runs)
