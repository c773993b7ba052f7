"""Replays a recorded run's learner from its batch log, and finds where it diverges.

A run trained with `record_learner_batches=True` (see `tba_jax.batch_log`) can be re-run
through its learner alone: no searchers, no replay buffer, no evaluation.

    report = replay(workdir)                 # from checkpoint 0 to the last recorded step
    report = replay(workdir, from_step=200)  # from a later checkpoint
    print("\\n".join(report.lines())); report.ok

    with ReplayBench.build(workdir) as bench:  # several ranges, one compiled train step
        replay_with(bench, 0, 100); replay_with(bench, 100, 150)

`replay` restores the checkpoint of `from_step`, feeds each recorded batch through the
same jitted train step, built from the config of the segment that recorded it, on the
learner mesh the run's config makes, and checks:

- after every step, the fingerprint of the params against the recorded one: the first
  step that differs is where the replay diverged (the bisection, done by the log);
- at every checkpoint the workdir still holds in the range, every leaf of the train state
  (params, optimiser state, step; PPO's critic too) for bit identity.

It stops at the first divergence. Bit identity is expected on the same kind of machine
with the same JAX (the report notes where the recording's differed); every method
replays, VinePPO's per-token advantages being part of its recorded batch.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from tba_jax import batch_log, learner, runs, train
from tba_jax import mesh as mesh_lib
from tba_jax import topology as topology_lib
from tba_jax.checkpoint import Checkpointer
from tba_jax.config_lib import ConfigError
from tba_jax.models import abstract_model

MAX_LEAVES_SHOWN = 5
PROGRESS_EVERY = 50  # steps between progress notices


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first step a replay found different: `kind` is "fingerprint" (the params after
    the step) or "checkpoint" (a saved train state), `leaves` the differing leaves."""

    step: int
    kind: str
    leaves: list[str]
    recorded_loss: float | None = None
    replayed_loss: float | None = None

    def lines(self, from_step: int, checked: str) -> list[str]:
        """What a report says of it (`checked`: the checkpoints that matched before it)."""
        what = "params fingerprint" if self.kind == "fingerprint" else "checkpoint"
        shown = ", ".join(self.leaves[:MAX_LEAVES_SHOWN])
        more = ", ..." if len(self.leaves) > MAX_LEAVES_SHOWN else ""
        matched = {0: "no step", 1: f"step {from_step + 1}"}.get(
            self.step - 1 - from_step, f"steps {from_step + 1}-{self.step - 1}"
        )
        lines = [
            f"DIVERGED at learner step {self.step}: its {what} differs from the recording "
            f"({len(self.leaves)} leaves: {shown}{more}).",
            f"  Before it {matched} matched; checkpoints compared: {checked}. Step {self.step} "
            f"trained on {batch_log.step_path(batch_log.LOG_SUBDIR, self.step)}.",
        ]
        if self.recorded_loss is None:
            return lines
        if self.recorded_loss == self.replayed_loss:
            cause = (
                "the same, so the batch and the params before the step were: the update differs "
                "(optimiser, learning-rate or β schedule, or the compiled program)"
            )
        else:
            cause = "different: the batch, or the loss's program, differs from the recording's"
        lines.append(
            f"  Its loss: recorded {self.recorded_loss!r}, replayed {self.replayed_loss!r}; "
            f"{cause}."
        )
        return lines


@dataclasses.dataclass
class ReplayReport:
    """What a replay of `workdir` found over the steps after `from_step` up to `to_step`."""

    workdir: str
    from_step: int
    to_step: int
    steps_replayed: int = 0
    checkpoints_compared: list[int] = dataclasses.field(default_factory=list)
    divergence: Divergence | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.divergence is None and self.steps_replayed == self.to_step - self.from_step

    def lines(self) -> list[str]:
        """The report a person reads."""
        lines = [
            f"Replayed {self.workdir}: learner steps {self.from_step + 1}-{self.to_step} from "
            f"checkpoint {self.from_step}.",
            *(f"note: {note}" for note in self.notes),
        ]
        checked = ", ".join(map(str, self.checkpoints_compared)) or "none"
        if self.divergence is None:
            lines.append(
                f"OK: all {self.steps_replayed} steps matched their recorded params fingerprints "
                f"and the checkpoints compared ({checked}) are bit-identical."
            )
            return lines
        return lines + self.divergence.lines(self.from_step, checked)


@dataclasses.dataclass
class ReplayBench:
    """A run's learner rebuilt from its workdir (model, meshes, shardings, checkpoints),
    with one train step per distinct segment config."""

    workdir: str
    config: ml_collections.ConfigDict
    model: Any
    abstract_params: Any
    meshes: mesh_lib.RoleMeshes
    learner_shardings: Any
    reference_shardings: Any
    checkpointer: Checkpointer
    _parts: dict[str, train.LearnerParts] = dataclasses.field(default_factory=dict)

    @classmethod
    def build(cls, workdir: str) -> ReplayBench:
        config = runs.load_config(workdir)
        model_cfg = runs.stored_model_config(workdir)
        layout = runs.stored_experiment(workdir).get(runs.PROCESSES_KEY)
        if layout is not None:
            raise ConfigError(
                f"{workdir} is a run over {layout['num_processes']} processes; replays are "
                "built for single-process runs only."
            )
        topology = topology_lib.make_topology(config, num_processes=1, process_index=0)
        meshes = topology_lib.role_meshes(topology, config)
        model_cfg = dataclasses.replace(model_cfg, **runs.execution_fields(config))
        model, abstract_params = abstract_model(model_cfg)
        learner_shardings, sampler_shardings = train.role_shardings(
            config, model, abstract_params, meshes
        )
        checkpointer = Checkpointer(
            workdir, experiment=runs.experiment_identity(config, model_cfg, layout)
        )
        return cls(
            workdir,
            config,
            model,
            abstract_params,
            meshes,
            learner_shardings,
            sampler_shardings,
            checkpointer,
        )

    def parts(self, segment_config: dict) -> train.LearnerParts:
        """The learner a segment trained with (built once per distinct config)."""
        key = json.dumps(segment_config, sort_keys=True)
        if key not in self._parts:
            config = ml_collections.ConfigDict(segment_config)
            # the segment's execution knobs (remat, attention, ...): they may change on resume
            model_cfg = dataclasses.replace(self.model.config, **runs.execution_fields(config))
            if model_cfg.scan_layers != self.model.config.scan_layers:
                raise ConfigError(
                    f"The run in {self.workdir} changed model.scan_layers between the segments "
                    "of the steps asked for; a replay keeps one params layout (the fingerprints "
                    "hash the params in it). Replay the steps of each segment separately."
                )
            model = self.model if model_cfg == self.model.config else abstract_model(model_cfg)[0]
            self._parts[key] = train.make_learner(
                config,
                model,
                self.abstract_params,
                self.learner_shardings,
                self.meshes.learner,
            )
        return self._parts[key]

    def restore(self, step: int, parts: train.LearnerParts) -> learner.TrainState:
        """The train state (the critic's included) of the checkpoint of `step`, in the
        bench's params layout (converted from a segment's other `scan_layers`)."""
        template = train.checkpoint_template(parts, self.abstract_params, self.reference_shardings)
        stacked = self.model.config.scan_layers
        restored, _, _ = runs.restore_in_layout(
            self.checkpointer,
            step,
            template,
            stacked,
            lambda: train.layout_template(
                self.config, self.model, self.meshes, multi_process=False, stacked=not stacked
            ),
        )
        return runs.restored_state(restored)

    def close(self) -> None:
        self.checkpointer.close()

    def __enter__(self) -> ReplayBench:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def train_step(self, parts, state, batch: dict[str, np.ndarray]):
        sharded = jax.device_put(batch, mesh_lib.batch_sharding(self.meshes.learner))
        return parts.train_step(state, sharded)


def state_leaves(state: learner.TrainState) -> dict[str, np.ndarray]:
    """{leaf path: host array} of what a checkpoint holds of the learner (π_ref aside)."""
    items = runs.checkpoint_items(state, reference=None)
    del items["reference"]
    flat, _ = jax.tree_util.tree_flatten_with_path(jax.device_get(items))
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def bit_identical(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and bytes (stricter than ==: tells -0.0 from 0.0, NaN from NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def differing_leaves(replayed: dict, saved: dict) -> list[str]:
    """The leaves (paths) that differ between two `state_leaves`, with their largest
    absolute difference where both are numbers of one shape."""
    differing = []
    for name in sorted(set(replayed) | set(saved)):
        a, b = replayed.get(name), saved.get(name)
        if a is not None and b is not None and bit_identical(a, b):
            continue
        if a is None or b is None or a.shape != b.shape:
            differing.append(f"{name} (missing or reshaped)")
            continue
        gap = np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0)
        differing.append(f"{name} (max |diff| {gap:.3g})")
    return differing


def fingerprint_leaves(names: list[str], replayed: np.ndarray, recorded: np.ndarray) -> list[str]:
    """The leaves whose fingerprints ([leaves, 2] each) differ."""
    if replayed.shape != recorded.shape:
        return [f"the params' structure ({len(recorded)} leaves recorded, {len(replayed)} now)"]
    differs = np.any(replayed != recorded, axis=-1)
    return [name for name, differ in zip(names, differs, strict=True) if differ]


def environment_notes(reader: batch_log.BatchLogReader, learner_devices: int) -> list[str]:
    """Where the recording's machine or JAX differ from this one's (bit identity is only
    expected on the same)."""
    here = batch_log.environment(learner_devices)
    notes = []
    for segment in reader.segments:
        changed = {k: v for k, v in segment.environment.items() if here.get(k) != v}
        if changed:
            now = {k: here.get(k) for k in changed}
            notes.append(
                f"the segment from step {segment.start_step} was recorded with {changed}, this "
                f"replay runs with {now}; bit identity is expected only on the same."
            )
    return notes


def steps_to_replay(
    reader: batch_log.BatchLogReader, checkpoints: list[int], from_step, to_step
) -> tuple[int, int]:
    """(from_step, to_step) checked against what the workdir holds; defaults: the first
    checkpoint that recorded steps follow, and the end of the recorded steps after it."""
    recorded = set(reader.steps)
    if from_step is None:
        starts = [c for c in checkpoints if c + 1 in recorded]
        if not starts:
            raise ConfigError(
                f"No checkpoint of {reader.directory}'s run is followed by recorded steps "
                f"(checkpoints: {checkpoints or 'none'}; recorded steps: "
                f"{batch_log.describe_steps(reader.steps)})."
            )
        from_step = starts[0]
    if from_step not in checkpoints:
        raise ConfigError(
            f"--from_step={from_step} has no checkpoint; the run keeps {checkpoints} (step 0 "
            "is kept by recording runs; raise keep_checkpoints to keep more)."
        )
    last = from_step
    while last + 1 in recorded:
        last += 1
    if to_step is None:
        to_step = last
    if not from_step < to_step <= last:
        raise ConfigError(
            f"Cannot replay steps {from_step + 1}-{to_step}: after checkpoint {from_step} the "
            f"recorded steps run to {last} (recorded: {batch_log.describe_steps(reader.steps)})."
        )
    return from_step, to_step


def replay(workdir: str, from_step: int | None = None, to_step: int | None = None) -> ReplayReport:
    """Replays the learner steps `from_step`+1 .. `to_step` of the run in `workdir` (see the
    module docstring); returns the report, whose `ok` says whether it reproduced them."""
    with ReplayBench.build(workdir) as bench:
        return replay_with(bench, from_step, to_step)


def replay_with(
    bench: ReplayBench, from_step: int | None = None, to_step: int | None = None
) -> ReplayReport:
    """`replay` on a bench already built: a notebook that bisects replays several ranges
    of one run with one compiled train step."""
    reader = batch_log.BatchLogReader(batch_log.log_dir(bench.workdir))
    checkpoints = sorted(bench.checkpointer.all_steps())
    from_step, to_step = steps_to_replay(reader, checkpoints, from_step, to_step)
    report = ReplayReport(bench.workdir, from_step, to_step)
    report.notes = environment_notes(reader, bench.meshes.learner.devices.size)
    replay_steps(bench, reader, report, checkpoints)
    return report


def replay_steps(
    bench: ReplayBench,
    reader: batch_log.BatchLogReader,
    report: ReplayReport,
    checkpoints: list[int],
) -> None:
    """The loop of `replay`: fills `report` (stops at the first divergence)."""
    parts = bench.parts(reader.segment_of(report.from_step + 1).config)
    state = bench.restore(report.from_step, parts)
    leaf_names = batch_log.leaf_names(batch_log.trained_params(state))
    for step in range(report.from_step + 1, report.to_step + 1):
        recorded = reader.read(step)
        parts = bench.parts(reader.segment_of(step).config)
        state, metrics = bench.train_step(parts, state, recorded.batch)
        replayed = np.asarray(batch_log.fingerprint(batch_log.trained_params(state)))
        report.steps_replayed += 1
        if not bit_identical(replayed, recorded.fingerprint):
            report.divergence = Divergence(
                step,
                "fingerprint",
                fingerprint_leaves(leaf_names, replayed, recorded.fingerprint),
                recorded.metrics.get("loss"),
                float(jax.device_get(metrics["loss"])),
            )
            return
        if step in checkpoints:
            saved = bench.restore(step, parts)
            differing = differing_leaves(state_leaves(state), state_leaves(saved))
            report.checkpoints_compared.append(step)
            if differing:
                report.divergence = Divergence(step, "checkpoint", differing)
                return
            logging.info("Step %d: the checkpoint is bit-identical.", step)
        elif step % PROGRESS_EVERY == 0:
            logging.info("Step %d of %d: fingerprints match.", step, report.to_step)
