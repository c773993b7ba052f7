"""Orbax checkpoints of a run: train state, replay-buffer state and JSON metadata.

Layout of a run's workdir::

    workdir/checkpoints/experiment.json     what run these checkpoints belong to
    workdir/checkpoints/<step>/train_state  orbax StandardSave of the train-state pytree
    workdir/checkpoints/<step>/buffer       buffer_process_<i>.npz, one per JAX process
    workdir/checkpoints/<step>/metadata     orbax JsonSave (policy version, data position, RNG…)

Orbax writes every step into a temporary directory and renames it into place
once all of its items are committed, so a save that dies half-way never
replaces the last complete checkpoint, and old steps are only removed after a
newer one is finalised.

The replay buffer is process-local (each process keeps the samples it made),
so every process writes and reads its own ``.npz`` file. NumPy's format keeps
every dtype and zero-size arrays, which orbax's array handlers refuse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from etils import epath

from tba_jax.config_lib import ConfigError, output_dir_problem

CHECKPOINTS_SUBDIR = "checkpoints"
EXPERIMENT_FILENAME = "experiment.json"
TRAIN_STATE_ITEM = "train_state"
BUFFER_ITEM = "buffer"
METADATA_ITEM = "metadata"
BUFFER_FILENAME_FORMAT = "buffer_process_{process_index}.npz"
PRIMARY_PROCESS_INDEX = 0
# Checkpoints that failed to restore are moved here (never deleted).
SET_ASIDE_SUBDIR = "checkpoints_set_aside"
MAX_DIFFERENCES_SHOWN = 3


class CheckpointMismatchError(ValueError):
    """The workdir holds checkpoints of a different experiment."""


class CheckpointUnreadableError(ValueError):
    """A checkpoint step is there but does not restore (a truncated or half-written file)."""


# --------------------------------------------------------------------------------------
# Replay-buffer item: a flat dict of NumPy arrays, one .npz per process.
# --------------------------------------------------------------------------------------


def _buffer_filename() -> str:
    return BUFFER_FILENAME_FORMAT.format(process_index=jax.process_index())


def _validate_buffer_state(buffer_state: Mapping[str, np.ndarray]) -> None:
    for name, array in buffer_state.items():
        if not isinstance(name, str):
            raise TypeError(f"buffer_state keys must be str, got {name!r}; pack names as strings.")
        if not isinstance(array, np.ndarray) or array.dtype == object:
            raise TypeError(
                f"buffer_state[{name!r}] must be a NumPy array of a numeric/bool dtype, got "
                f"{type(array).__name__}; pack ragged data into flat arrays first."
            )


class NumpyDictCheckpointHandler(ocp.CheckpointHandler):
    """Saves a flat ``dict[str, np.ndarray]`` as this process's ``.npz`` file."""

    def save(self, directory: epath.Path, args: NumpyDictSave) -> None:
        payload = io.BytesIO()
        np.savez(payload, **args.arrays)
        (directory / _buffer_filename()).write_bytes(payload.getvalue())

    def restore(
        self, directory: epath.Path, args: NumpyDictRestore | None = None
    ) -> dict[str, np.ndarray]:
        del args
        path = directory / _buffer_filename()
        if not path.exists():
            raise FileNotFoundError(
                f"No replay-buffer file {path}; {_missing_buffer_cause(directory)}"
            )
        with np.load(io.BytesIO(path.read_bytes()), allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}


def _missing_buffer_cause(directory: epath.Path) -> str:
    """Why this process's buffer file is not in `directory`: a checkpoint saved by fewer
    processes (other processes' files are there, fewer than this run has) or a file lost."""
    saved = len(list(directory.glob(BUFFER_FILENAME_FORMAT.format(process_index="*"))))
    if 0 < saved < jax.process_count():
        return (
            f"this checkpoint was written by {saved} process(es), this run has "
            f"{jax.process_count()}: restore with the number of processes that saved it."
        )
    return "the file is missing (deleted, or lost in a copy)."


@ocp.args.register_with_handler(NumpyDictCheckpointHandler, for_save=True)
@dataclasses.dataclass
class NumpyDictSave(ocp.args.CheckpointArgs):
    arrays: Mapping[str, np.ndarray]


@ocp.args.register_with_handler(NumpyDictCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class NumpyDictRestore(ocp.args.CheckpointArgs):
    pass


# --------------------------------------------------------------------------------------
# Experiment identity: refuse to mix checkpoints of different runs in one workdir.
# --------------------------------------------------------------------------------------


def _plain_json_value(value: Any) -> Any:
    """NumPy/JAX scalars and arrays as Python numbers and lists, for json.dumps."""
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "__array__"):
        return np.asarray(value).tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _canonical_json(value: Any, what: str) -> Any:
    """The value as JSON would give it back (tuples become lists, keys become str)."""
    try:
        return json.loads(json.dumps(value, sort_keys=True, default=_plain_json_value))
    except TypeError as error:
        raise TypeError(
            f"{what} must be JSON-able ({error}); convert it to plain types."
        ) from error


def _differences(held: Any, asked: Any, prefix: str = "") -> list[str]:
    """Human-readable paths where two JSON values differ."""
    if isinstance(held, dict) and isinstance(asked, dict):
        found = []
        for key in sorted(set(held) | set(asked)):
            path = f"{prefix}.{key}" if prefix else key
            if key not in held or key not in asked:
                found.append(
                    f"{path}: {held.get(key, '<absent>')!r} vs {asked.get(key, '<absent>')!r}"
                )
            else:
                found.extend(_differences(held[key], asked[key], path))
        return found
    if held != asked:
        return [f"{prefix or '<root>'}: {held!r} vs {asked!r}"]
    return []


def _summarise_differences(held: Any, asked: Any) -> str:
    found = _differences(held, asked)
    shown = "; ".join(found[:MAX_DIFFERENCES_SHOWN])
    hidden = len(found) - MAX_DIFFERENCES_SHOWN
    return shown + (f"; and {hidden} more" if hidden > 0 else "")


def _step_directories(directory: epath.Path) -> list[epath.Path]:
    """The saved steps in a checkpoints folder (`<step>` and orbax's temporary
    `<step>.orbax-checkpoint-tmp-*`); [] when it does not exist."""
    if not directory.exists():
        return []
    return [
        child
        for child in directory.iterdir()
        if child.is_dir() and child.name.split(".")[0].isdigit()
    ]


def _holds_step_directories(directory: epath.Path) -> bool:
    return bool(_step_directories(directory))


def _held_experiment(workdir: str, experiment_path: epath.Path) -> Any:
    """The experiment identity a workdir's checkpoints were written for."""
    try:
        return json.loads(experiment_path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointMismatchError(
            f"{experiment_path} is unreadable ({error}); it names the experiment the "
            f"checkpoints in {workdir} belong to, so they cannot be resumed safely. Restore the "
            "file from a copy, or pass another --workdir."
        ) from None


def _check_experiment(
    workdir: str,
    directory: epath.Path,
    experiment: Any,
    ignored_keys: tuple[str, ...] = (),
    mismatch_advice: str | None = None,
) -> None:
    """Raises CheckpointMismatchError if `directory` belongs to another experiment
    (comparing every key of the identity but `ignored_keys`), ending with `mismatch_advice`
    (default: a trainer's, another workdir or starting over)."""
    experiment_path = directory / EXPERIMENT_FILENAME
    if experiment_path.exists():
        held = _without_params_layout(_held_experiment(workdir, experiment_path))
        if isinstance(held, dict) and ignored_keys:
            held = {key: value for key, value in held.items() if key not in ignored_keys}
            experiment = {
                key: value for key, value in experiment.items() if key not in ignored_keys
            }
        if held != experiment:
            raise CheckpointMismatchError(
                f"Workdir {workdir} holds checkpoints of another experiment (held vs asked: "
                f"{_summarise_differences(held, experiment)}); "
                + (
                    mismatch_advice
                    or f"pass another --workdir, or delete {workdir} to start over (the whole "
                    "folder: its warm start and logs are the other experiment's too)."
                )
            )
    elif _holds_step_directories(directory):
        raise CheckpointMismatchError(
            f"Workdir {workdir} holds checkpoints with no {EXPERIMENT_FILENAME}, so they may "
            f"belong to another experiment; pass another --workdir, or delete {workdir} to "
            "start over."
        )


def _without_params_layout(held: Any) -> Any:
    """An identity written while the params' layout was part of it (`model.scan_layers`,
    present only when on) as identities are now: without it."""
    if isinstance(held, dict) and isinstance(held.get("model"), dict):
        held = {**held, "model": {k: v for k, v in held["model"].items() if k != "scan_layers"}}
    return held


def check_experiment(workdir: str, experiment: dict, ignored_keys: tuple[str, ...] = ()) -> None:
    """The experiment check of `Checkpointer`, without creating anything: a run can refuse
    a workdir of another experiment before it writes a byte (`ignored_keys`: parts of the
    identity not known yet, checked again when the Checkpointer is made)."""
    directory = epath.Path(workdir) / CHECKPOINTS_SUBDIR
    _check_experiment(workdir, directory, _canonical_json(experiment, "experiment"), ignored_keys)


def _write_text_atomically(path: epath.Path, text: str) -> None:
    temporary = path.parent / f"{path.name}.tmp"
    temporary.write_text(text)
    temporary.rename(path)


# --------------------------------------------------------------------------------------
# The workdir itself: created only once a run is known to be valid, held by one run.
# --------------------------------------------------------------------------------------


def make_workdir(workdir: str) -> str | None:
    """Creates `workdir`, or a ConfigError saying why it cannot be (the launchers' check,
    `config_lib.output_dir_problem`, for callers that come from Python). Returns the
    outermost folder it created (None: `workdir` existed)."""
    problem = output_dir_problem(workdir)
    if problem:
        raise ConfigError(f"--workdir={workdir} {problem}; pass a folder you can write to.")
    created, path = None, os.path.abspath(workdir)
    while not os.path.exists(path):
        created, path = path, os.path.dirname(path)
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as error:  # e.g. the disk filled up or a parent went since the check
        raise ConfigError(
            f"--workdir={workdir} cannot be created ({error.strerror}); pass a folder you "
            "can write to."
        ) from None
    return created


@contextlib.contextmanager
def removed_if_refused(created: str | None) -> Iterator[None]:
    """Around the checks that need a workdir (the task's data): a folder this run created
    is removed if they fail, so a refused run leaves no trace."""
    try:
        yield
    except BaseException:  # a Ctrl-C while the task's data is prepared too
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise


class WorkdirInUseError(ConfigError):
    """Another run (a process on this machine) holds the workdir."""


class WorkdirLock:
    """An exclusive lock on a workdir while a run trains in it, so a second run of the same
    workdir is refused at once instead of writing the same checkpoints. It is a `flock` on
    the folder itself: nothing is written, and the lock goes with the process that holds
    it, however that process ends. A filesystem without `flock` (some network ones) leaves
    the workdir unlocked. A context manager; `release()` ends it early."""

    def __init__(self, workdir: str):
        self._fd: int | None = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.release()
            raise WorkdirInUseError(
                f"--workdir={workdir} is in use by another run on this machine (one still "
                "training in it); wait for it to end, or pass another --workdir."
            ) from None
        except OSError:  # flock not supported here: nothing to hold
            self.release()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the folder's descriptor ends the lock
            self._fd = None

    def __enter__(self) -> WorkdirLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


@contextlib.contextmanager
def claimed_workdir(workdir: str, held: contextlib.ExitStack | None) -> Iterator[None]:
    """Around a run's first writes (its task's data): `make_workdir`, locked by a
    `WorkdirLock` until `held` closes (None: not locked), and removed again if the body
    fails and this call created it (`removed_if_refused`)."""
    with removed_if_refused(make_workdir(workdir)):
        if held is not None:
            held.enter_context(WorkdirLock(workdir))
        yield


def held_experiment(workdir: str) -> Any:
    """The experiment identity `workdir`'s checkpoints were written for (as identities are
    now); None when it holds none."""
    experiment_path = epath.Path(workdir) / CHECKPOINTS_SUBDIR / EXPERIMENT_FILENAME
    if not experiment_path.exists():
        return None
    return _without_params_layout(_held_experiment(workdir, experiment_path))


def latest_saved_step(workdir: str) -> int | None:
    """The newest finished save in `workdir`'s checkpoints, read without the experiment
    they were written for (a save in flight or cut short does not count); None if none."""
    directory = epath.Path(workdir) / CHECKPOINTS_SUBDIR
    if not _holds_step_directories(directory):
        return None
    with _read_only_manager(directory) as reader:
        return reader.latest_step()


def _read_only_manager(
    directory: epath.Path, item_handlers: dict[str, Any] | None = None
) -> ocp.CheckpointManager:
    """An orbax manager that only reads `directory` (without orbax's read-only notice)."""
    with _read_only_notice_left_out():
        return ocp.CheckpointManager(
            directory,
            # what read_only implies (orbax warns each time it has to change them)
            options=ocp.CheckpointManagerOptions(
                read_only=True, save_interval_steps=0, create=False
            ),
            item_handlers=item_handlers,
        )


def remove_saved_steps(workdir: str) -> None:
    """Removes every saved step of the workdir's checkpoints and keeps `experiment.json`,
    which later runs in the workdir are still checked against (a run whose result is
    exported elsewhere, such as a reward model's folder)."""
    for step in _step_directories(epath.Path(workdir) / CHECKPOINTS_SUBDIR):
        shutil.rmtree(step)


def holds_saved_steps(workdir: str) -> bool:
    """Whether the workdir's checkpoints folder holds a saved step (what
    `remove_saved_steps` removes)."""
    return _holds_step_directories(epath.Path(workdir) / CHECKPOINTS_SUBDIR)


# --------------------------------------------------------------------------------------
# Train-state templates.
# --------------------------------------------------------------------------------------


def _abstract_leaf(leaf: Any) -> Any:
    """A ShapeDtypeStruct (keeping the sharding) for arrays; other leaves pass through."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    return leaf


def _abstract_train_state(template: Any) -> Any:
    return jax.tree.map(_abstract_leaf, template)


def _host_template(template: Any) -> Any:
    """Host arrays of the template's shapes: what a host-local save restores into."""
    return jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), template)


# --------------------------------------------------------------------------------------
# The checkpointer.
# --------------------------------------------------------------------------------------


def _save_decision_policy(save_interval_steps: int) -> Any:
    """Save on multiples of the interval, or when JAX reports a preemption.

    Unlike orbax's default, there is no extra save on the first call of a fresh run.
    """
    policies = ocp.checkpoint_managers
    return policies.AnySavePolicy(
        [
            policies.FixedIntervalPolicy(save_interval_steps),
            policies.PreemptionCheckpointingPolicy(),
        ]
    )


def _preservation_policy(max_to_keep: int, keep_steps: Sequence[int]) -> Any:
    """Keep the newest `max_to_keep` steps, and `keep_steps` whatever their age."""
    policies = ocp.checkpoint_managers
    newest = policies.LatestN(max_to_keep)
    if not keep_steps:
        return newest
    return policies.AnyPreservationPolicy([newest, policies.CustomSteps(list(keep_steps))])


class Checkpointer:
    """Saves and restores a run's train state, replay buffer and metadata with orbax.

    Train-state saves are asynchronous (device arrays are copied to host before
    `save` returns); the buffer and metadata are written before `save` returns
    or in orbax's commit thread. Call `wait_until_finished()` before exiting.
    """

    def __init__(
        self,
        workdir: str,
        *,
        experiment: dict,
        max_to_keep: int = 2,
        save_interval_steps: int = 1,
        active_processes: Sequence[int] | None = None,
        keep_steps: Sequence[int] = (),
        mismatch_advice: str | None = None,
    ):
        """`active_processes`: the processes that save and restore (the learners of a
        multi-process run; None: every process). A single saving process among several
        saves its train state from host memory (orbax refuses process-local arrays in a
        multi-process run). `keep_steps`: steps kept beside the newest `max_to_keep` (a
        recorded run keeps step 0, where its replay starts). `mismatch_advice`: what the
        error for checkpoints of another experiment tells a tool that only reads them."""
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}.")
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}.")
        self.workdir = workdir
        self.directory = epath.Path(workdir) / CHECKPOINTS_SUBDIR
        self.experiment = _canonical_json(experiment, "experiment")
        _check_experiment(workdir, self.directory, self.experiment, mismatch_advice=mismatch_advice)
        self._experiment_written = (self.directory / EXPERIMENT_FILENAME).exists()
        subset = active_processes is not None and len(active_processes) < jax.process_count()
        self._host_local = subset and len(active_processes) == 1
        multiprocessing = ocp.options.MultiprocessingOptions()
        if subset:  # orbax leaves the folder to the caller when only some processes save
            self.directory.mkdir(parents=True, exist_ok=True)
            multiprocessing = ocp.options.MultiprocessingOptions(
                primary_host=PRIMARY_PROCESS_INDEX, active_processes=set(active_processes)
            )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                save_decision_policy=_save_decision_policy(save_interval_steps),
                preservation_policy=_preservation_policy(max_to_keep, keep_steps),
                create=not subset,
                multiprocessing_options=multiprocessing,
            ),
            item_handlers={
                TRAIN_STATE_ITEM: ocp.StandardCheckpointHandler(),
                BUFFER_ITEM: NumpyDictCheckpointHandler(),
                METADATA_ITEM: ocp.JsonCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        """The newest checkpoint's step, or None if there is none.

        A save of this process still in flight counts; `wait_until_finished()` completes it.
        """
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(
        self,
        step: int,
        *,
        train_state: Any,
        buffer_state: Mapping[str, np.ndarray],
        metadata: dict,
        force: bool = False,
    ) -> bool:
        """Saves at `step` if it is a save step (or `force`); returns whether it saved.

        A step that already has a checkpoint is never overwritten (returns False).
        """
        if step in self._manager.all_steps():
            return False
        if not force and not self._manager.should_save(step):
            return False
        if not jax.tree.leaves(train_state):
            raise ValueError("train_state has no leaves; pass the learner's train-state pytree.")
        _validate_buffer_state(buffer_state)
        if self._host_local:
            train_state = jax.device_get(train_state)
        self.write_experiment()
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                **{
                    TRAIN_STATE_ITEM: ocp.args.StandardSave(train_state),
                    BUFFER_ITEM: NumpyDictSave(dict(buffer_state)),
                    METADATA_ITEM: ocp.args.JsonSave(_canonical_json(metadata, "metadata")),
                }
            ),
            force=True,
        )

    def restore(
        self, *, train_state_template: Any, step: int | None = None
    ) -> tuple[Any, dict[str, np.ndarray], dict]:
        """Restores (train_state, buffer_state, metadata) from `step` (default: latest).

        `train_state_template` is a pytree of jax.ShapeDtypeStruct (with .sharding)
        or concrete arrays; restored arrays land on the template's shardings.
        """
        self._manager.wait_until_finished()
        step = self._resolve_step(step)
        template = _abstract_train_state(train_state_template)
        restored = self._restore_items(
            step,
            **{
                TRAIN_STATE_ITEM: ocp.args.StandardRestore(
                    _host_template(template) if self._host_local else template
                ),
                BUFFER_ITEM: NumpyDictRestore(),
                METADATA_ITEM: ocp.args.JsonRestore(),
            },
        )
        train_state = restored[TRAIN_STATE_ITEM]
        if self._host_local:
            train_state = jax.tree.map(
                lambda value, leaf: jax.device_put(value, leaf.sharding), train_state, template
            )
        return train_state, restored[BUFFER_ITEM], restored[METADATA_ITEM]

    def restore_subset(self, *, template: Any, step: int | None = None) -> tuple[Any, dict]:
        """Restores (train_state, metadata) from `step` (default: latest), reading only the
        train-state leaves `template` names (a sub-tree of the saved one, ShapeDtypeStructs
        with .sharding): the params without the optimizer state, and no replay buffer.
        What using a trained policy needs; resuming training needs `restore`."""
        self._manager.wait_until_finished()
        step = self._resolve_step(step)
        template = _abstract_train_state(template)
        restore_args = jax.tree.map(
            lambda leaf: ocp.ArrayRestoreArgs(sharding=leaf.sharding, dtype=leaf.dtype), template
        )
        # orbax's standard handler restores whole trees only; its PyTree handler reads the
        # same files and restores part of one.
        reader = _read_only_manager(
            self.directory,
            {
                TRAIN_STATE_ITEM: ocp.PyTreeCheckpointHandler(),
                METADATA_ITEM: ocp.JsonCheckpointHandler(),
            },
        )
        with reader, quiet_if_the_restore_fails():
            restored = reader.restore(
                step,
                args=ocp.args.Composite(
                    **{
                        TRAIN_STATE_ITEM: ocp.args.PyTreeRestore(
                            item=template, restore_args=restore_args, partial_restore=True
                        ),
                        METADATA_ITEM: ocp.args.JsonRestore(),
                    }
                ),
            )
        return restored[TRAIN_STATE_ITEM], restored[METADATA_ITEM]

    def read_metadata(self, step: int | None = None) -> dict:
        """The metadata of `step` (default: latest) alone: what to know before restoring."""
        self._manager.wait_until_finished()
        step = self._resolve_step(step)
        restored = self._restore_items(step, **{METADATA_ITEM: ocp.args.JsonRestore()})
        return restored[METADATA_ITEM]

    def restore_buffer(self, step: int | None = None) -> tuple[dict[str, np.ndarray], dict]:
        """Restores (buffer_state, metadata) from `step` (default: latest) without reading
        the train state: what inspecting a run's replay buffer needs."""
        self._manager.wait_until_finished()
        step = self._resolve_step(step)
        restored = self._restore_items(
            step, **{BUFFER_ITEM: NumpyDictRestore(), METADATA_ITEM: ocp.args.JsonRestore()}
        )
        return restored[BUFFER_ITEM], restored[METADATA_ITEM]

    def wait_until_finished(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _restore_items(self, step: int, **items: ocp.args.CheckpointArgs) -> Any:
        """orbax's restore of `items` at `step`, quiet about a failed read's leftovers
        (`quiet_if_the_restore_fails`): every restore of a checkpoint goes through here."""
        with quiet_if_the_restore_fails():
            return self._manager.restore(step, args=ocp.args.Composite(**items))

    def _resolve_step(self, step: int | None) -> int:
        available = self.all_steps()
        if not available:
            raise FileNotFoundError(
                f"No checkpoint in workdir {self.workdir} ({self.directory} holds no complete "
                "step); train first or pass the workdir of a run that saved one."
            )
        if step is None:
            return max(available)
        if step not in available:
            raise FileNotFoundError(
                f"No checkpoint for step {step} in workdir {self.workdir}; available steps: "
                f"{sorted(available)}."
            )
        return step

    def set_aside(self, step: int) -> str:
        """Moves `step`'s checkpoint (one that fails to restore) out of the checkpoint
        directory into `workdir/SET_ASIDE_SUBDIR`, keeping it for inspection; returns where."""
        self._manager.wait_until_finished()
        target = set_aside(str(self.directory / str(step)), self.workdir, str(step))
        self._manager.reload()
        return target

    def write_experiment(self) -> None:
        """Writes experiment.json (once), which later runs in this workdir are checked against."""
        if self._experiment_written:
            return
        if jax.process_index() == PRIMARY_PROCESS_INDEX:
            self.directory.mkdir(parents=True, exist_ok=True)
            text = json.dumps(self.experiment, indent=2, sort_keys=True)
            _write_text_atomically(self.directory / EXPERIMENT_FILENAME, text)
        self._experiment_written = True


# --------------------------------------------------------------------------------------
# A checkpoint that fails to restore: set aside (never deleted), reported in one line,
# without orbax's leftovers.
# --------------------------------------------------------------------------------------


# orbax's words when a checkpoint's train state has another tree than the template: the
# config makes another optimiser state or critic, not a damaged file
OTHER_STRUCTURE = "tree structures do not match"


def newest_restorable(
    checkpointer: Checkpointer,
    restore: Callable[[int], Any],
    other_structure_advice: Callable[[], str] = lambda: "",
) -> Any:
    """`restore(step)` of the newest step for which it succeeds. A step whose restore
    raises (a truncated file, or params `restore` refuses) is moved to `SET_ASIDE_SUBDIR`,
    not deleted, with a one-line warning, and the one before it is tried; a ConfigError
    when none restores (the workdir must hold a checkpoint). A step whose train state has
    another structure than `restore`'s template (a changed optimiser or critic setting) is
    a CheckpointMismatchError, nothing moved, ending with `other_structure_advice()`."""
    set_aside_paths = []
    while (step := checkpointer.latest_step()) is not None:
        try:
            return restore(step)
        except Exception as error:
            if OTHER_STRUCTURE in str(error):
                raise CheckpointMismatchError(
                    f"Checkpoint {step} in {checkpointer.workdir} holds a train state of "
                    "another structure than this config makes (its optimiser state or critic; "
                    f"nothing was moved){other_structure_advice()}; resume with the settings it "
                    "was saved with, or pass another --workdir."
                ) from None
            failure = restore_failure(error)
        where = checkpointer.set_aside(step)
        set_aside_paths.append(where)
        absl_logging.warning(
            "Checkpoint %d in %s does not restore (%s); moved it to %s and trying the one before.",
            step,
            checkpointer.workdir,
            failure,
            where,
        )
    raise ConfigError(
        f"No checkpoint in {checkpointer.workdir} restores; the unreadable ones were moved to "
        f"{', '.join(set_aside_paths)}. Rerun to start the run over in this workdir, or pass "
        "another --workdir."
    )


def set_aside(path: str, workdir: str, name: str) -> str:
    """Moves `path` (saved state that fails to restore) into `workdir/SET_ASIDE_SUBDIR` as
    `<name>-<time>`, keeping it for inspection; returns where."""
    aside = epath.Path(workdir) / SET_ASIDE_SUBDIR
    aside.mkdir(parents=True, exist_ok=True)
    target = aside / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    epath.Path(path).rename(target)
    return str(target)


ORBAX_READ = "_read_array_index_and_device_put"  # the coroutine a failed read leaves behind
ORBAX_READ_ONLY_NOTICE = "Given directory is read only"  # opening a checkpoint read-only
TENSORSTORE_DETAILS = " See full TensorStore details"  # what orbax appends to a read error


@contextlib.contextmanager
def _read_only_notice_left_out() -> Iterator[None]:
    """Around opening a checkpoint read-only: orbax logs a warning that it is read-only
    each time, which is how every trained policy is read (evaluation, export, notebooks),
    so there is nothing to act on."""

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(ORBAX_READ_ONLY_NOTICE)

    logger = logging.getLogger("absl")  # orbax logs through absl
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


@contextlib.contextmanager
def quiet_if_the_restore_fails() -> Iterator[None]:
    """Around a restore that may fail (a corrupt checkpoint); if it does, for the rest of
    the process.

    A failed orbax restore leaves its shard reads behind as coroutines that raise when
    they are collected, and TensorStore's threads post their results to orbax's closed
    event loop, during the failure and up to seconds after it. Python prints a traceback
    for each, dozens per checkpoint, for an error the caller reports once: "Exception
    ignored in: <coroutine object _read_array_index_and_device_put ...>" or "coroutine ...
    was never awaited", "RuntimeError: Event loop is closed", and asyncio's
    "_GatheringFuture exception was never retrieved" with the read error's whole
    TensorStore spec. Those are left out; any other unraisable exception, warning or
    asyncio log is reported as usual. After a restore that succeeds, nothing is changed."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if not _failed_read_leftover(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    except BaseException:
        warnings.filterwarnings("ignore", f"coroutine '{ORBAX_READ}'", RuntimeWarning)
        asyncio_logger = logging.getLogger("asyncio")
        if not any(isinstance(f, _NeverRetrievedFilter) for f in asyncio_logger.filters):
            asyncio_logger.addFilter(_NeverRetrievedFilter())
        raise
    else:
        if sys.unraisablehook is hook:
            sys.unraisablehook = previous


def restore_failure(error: Exception) -> str:
    """What a failed restore says, in one line: the error's type and first line, without
    the TensorStore spec orbax appends ("See full TensorStore details: ...")."""
    first_line = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {first_line.split(TENSORSTORE_DETAILS)[0].strip()}"


class _NeverRetrievedFilter(logging.Filter):
    """Drops asyncio's report of a failed read's future that nothing awaited."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "exception was never retrieved" not in str(record.msg)


def _failed_read_leftover(unraisable) -> bool:
    leftover, error = unraisable.object, unraisable.exc_value
    orbax_read = isinstance(leftover, types.CoroutineType) and (
        f"{os.sep}orbax{os.sep}" in leftover.cr_code.co_filename
    )
    closed_loop = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
    return orbax_read or closed_loop


# --------------------------------------------------------------------------------------
# SIGTERM and Ctrl-C: ask the run to save and stop at its next safe point.
# --------------------------------------------------------------------------------------


SIGNAL_EXIT_BASE = 128  # a process ended by signal s exits 128 + s, as shells report it
# What a run that SIGTERM or Ctrl-C stopped exits with once it has saved (RunStopped)
STOPPED_STATUSES = (SIGNAL_EXIT_BASE + signal.SIGINT, SIGNAL_EXIT_BASE + signal.SIGTERM)


class RunStopped(Exception):
    """Raised at a safe point of a run after SIGTERM or Ctrl-C asked it to stop (once what
    exists is saved). `signum`: the signal this process got (None: the stop came from
    another process of the run)."""

    def __init__(self, reason: str, signum: int | None = None):
        super().__init__(reason)
        self.reason = reason  # what stopped it ("Ctrl-C", "SIGTERM", ...)
        self.signum = signum

    def __str__(self) -> str:  # what a notebook shows; the launchers print their own line
        return f"{self.reason}: stopped and saved; run it again on the same workdir to go on."

    @property
    def exit_status(self) -> int:
        """What a launcher exits with, so that `train && evaluate` and a scheduler tell a
        stopped run from a finished one: 128 + the signal (130 for Ctrl-C, 143 for SIGTERM),
        as a shell reports a process the signal ended; 143 for a stop from elsewhere."""
        return SIGNAL_EXIT_BASE + (self.signum or signal.SIGTERM)


class StopSignal:
    """A flag the run polls at safe points; `request` is safe to call from a signal handler."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""
        self.signum: int | None = None  # the signal that asked first, if one did

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request(self, reason: str = "a stop request", signum: int | None = None) -> None:
        if not self.requested:
            self.reason, self.signum = reason, signum
        self._event.set()

    def stopped(self) -> RunStopped:
        """The RunStopped to raise for this stop."""
        return RunStopped(self.reason, self.signum)

    def raise_if_requested(self) -> None:
        """RunStopped when a stop was asked for; call it where stopping loses nothing."""
        if self.requested:
            raise self.stopped()


STOP_SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}
STOP_POLL_S = 0.2  # how soon a stop asked of this process reaches a child it waits for


def install_stop_handlers(stop: StopSignal) -> Callable[[], None]:
    """SIGTERM and Ctrl-C (SIGINT) set `stop` instead of killing the process, so the run
    saves at its next safe point (never in the middle of a step). A second Ctrl-C raises
    KeyboardInterrupt as usual. Returns a function that restores the previous handlers.

    Installed inside another's (a run inside a sweep): a signal sets both stops, so the
    outer loop stops too once the inner run has saved (even after the run's last safe
    point), and a stop the outer one already holds is this one's from the start.

    Must be called from the main thread (Python delivers signals only there).
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "install_stop_handlers must be called from the main thread; call it before "
            "starting worker threads."
        )
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    enclosing = {signum: _stop_of(handler) for signum, handler in previous.items()}
    for outer in filter(None, enclosing.values()):
        if outer.requested and not stop.requested:
            stop.request(outer.reason, outer.signum)
    # a Ctrl-C the enclosing handler took before this one: the next one quits at once
    ctrl_c_quits = (
        stop.signum == signal.SIGINT and previous[signal.SIGINT] is signal.default_int_handler
    )

    def handle(signum: int, frame: object) -> None:
        stop.request(STOP_SIGNALS[signum], signum)
        if enclosing[signum] is not None:
            previous[signum](signum, frame)
        if signum == signal.SIGINT:  # the next Ctrl-C quits at once
            signal.signal(signal.SIGINT, signal.default_int_handler)

    handle.stop_signal = stop  # type: ignore[attr-defined]  # what `_stop_of` reads
    for signum in STOP_SIGNALS:
        if not (signum == signal.SIGINT and ctrl_c_quits):
            signal.signal(signum, handle)

    def restore_previous_handlers() -> None:
        ctrl_c_taken = signal.getsignal(signal.SIGINT) is signal.default_int_handler
        for signum, handler in previous.items():
            if signum == signal.SIGINT and ctrl_c_taken and enclosing[signum] is not None:
                continue  # the enclosing handler took that Ctrl-C too: the next one quits
            signal.signal(signum, handler)

    return restore_previous_handlers


def _stop_of(handler: object) -> StopSignal | None:
    """The StopSignal a handler `install_stop_handlers` installed sets (None: another)."""
    return getattr(handler, "stop_signal", None)


@contextlib.contextmanager
def sigterm_stops_at_once() -> Iterator[None]:
    """While the block runs (a run's setup, before there is anything to save), SIGTERM
    raises RunStopped at once, as Ctrl-C raises KeyboardInterrupt: the launchers say so in
    one line and exit 143 (not a silent death by the signal), and a workdir the run made is
    removed (`claimed_workdir`). On another thread than the main one nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: object) -> None:
        del frame
        raise RunStopped(STOP_SIGNALS[signum], signum)

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopSignal]:
    """A StopSignal that SIGTERM and Ctrl-C set while the block runs (main thread only)."""
    stop_signal = StopSignal()
    on_main_thread = threading.current_thread() is threading.main_thread()
    restore = install_stop_handlers(stop_signal) if on_main_thread else None
    try:
        yield stop_signal
    finally:
        if restore is not None:
            restore()


def communicate_passing_on_stop(
    child: subprocess.Popen, stop_signal: StopSignal | None
) -> tuple[Any, Any]:
    """`child.communicate()`: its stdout and stderr (None where not piped). A stop requested
    of `stop_signal` meanwhile (SIGTERM, Ctrl-C) is passed on to the child once, as the
    signal that asked (SIGTERM when none did), and the child is waited for while it saves;
    anything raised here (a second Ctrl-C) kills it rather than leave it running."""
    passed_on = False
    try:
        while True:
            try:
                return child.communicate(timeout=STOP_POLL_S)
            except subprocess.TimeoutExpired:  # trying again loses no output
                if stop_signal is not None and stop_signal.requested and not passed_on:
                    child.send_signal(stop_signal.signum or signal.SIGTERM)
                    passed_on = True
    except BaseException:
        child.kill()
        child.wait()
        raise


# --------------------------------------------------------------------------------------
# A pytree on its own (the warm start's progress), outside the run's step checkpoints.
# --------------------------------------------------------------------------------------


def save_pytree(directory: str, tree: Any) -> None:
    """Saves `tree` (arrays) to a new `directory` with orbax, atomically (written to a
    temporary folder and renamed when complete); waits until it is on disk."""
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(epath.Path(directory), tree)
        checkpointer.wait_until_finished()


def restore_pytree(directory: str, template: Any) -> Any:
    """The pytree `save_pytree` wrote, on the shardings of `template` (ShapeDtypeStructs or
    arrays)."""
    with ocp.StandardCheckpointer() as checkpointer, quiet_if_the_restore_fails():
        return checkpointer.restore(epath.Path(directory), _abstract_train_state(template))
