"""Tests for tba_jax.checkpoint: orbax round trips, retention, mismatch guard, SIGTERM."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from etils import epath
from flax import nnx
from support import fake_cpu_devices_env

from tba_jax import checkpoint
from tba_jax.checkpoint import (
    SET_ASIDE_SUBDIR,
    Checkpointer,
    CheckpointMismatchError,
    RunStopped,
    StopSignal,
    check_experiment,
    install_stop_handlers,
    restore_pytree,
    save_pytree,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = {"config_name": "gsm8k_rho1b:tiny", "model": {"layers": 2}, "task": {"k": 4}}
SIGNAL_WAIT_SECONDS = 5.0
SUBPROCESS_TIMEOUT_SECONDS = 120


class TinyModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(7, 4, rngs=rngs)
        self.out = nnx.Linear(4, 3, rngs=rngs)


@jax.jit  # one compilation instead of many eager initialiser ops keeps the tests fast
def _init_train_state(seed: jax.Array) -> dict:
    _, params = nnx.split(TinyModel(nnx.Rngs(jax.random.key(seed))), nnx.Param)
    optimizer = optax.adamw(1e-3)
    opt_state = optimizer.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = optimizer.update(grads, opt_state, params)  # non-zero moments
    return {"params": params, "opt_state": opt_state, "step": (seed + 3).astype(jnp.int32)}


def make_train_state(seed: int = 0) -> dict:
    return _init_train_state(jnp.asarray(seed, jnp.int32))


def make_buffer_state() -> dict[str, np.ndarray]:
    return {
        "prompt_ids": np.arange(6, dtype=np.int32),
        "rewards": np.linspace(0.0, 1.0, 5, dtype=np.float32),
        "logprobs": np.array([-1.5, -2.25e-12], dtype=np.float64),
        "finished": np.array([True, False, True]),
        "created_ns": np.array([2**40, -(2**41)], dtype=np.int64),
        "empty_tokens": np.zeros((0,), dtype=np.int32),
        "empty_matrix": np.zeros((0, 3), dtype=np.float32),
    }


def make_metadata(step: int) -> dict:
    return {
        "policy_version": step // 2,
        "data_position": {"epoch": 1, "index": 17},
        "rng_key": [0, 42],
        "learner_step": step,
    }


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def assert_trees_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def snapshot_files(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def save_steps(checkpointer: Checkpointer, steps, *, force: bool = False) -> list[bool]:
    results = [
        checkpointer.save(
            step,
            train_state=make_train_state(step),
            buffer_state=make_buffer_state(),
            metadata=make_metadata(step),
            force=force,
        )
        for step in steps
    ]
    checkpointer.wait_until_finished()
    return results


def test_round_trip_restores_train_state_buffer_and_metadata(tmp_path):
    train_state, buffer_state = make_train_state(), make_buffer_state()
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        assert checkpointer.save(
            4, train_state=train_state, buffer_state=buffer_state, metadata=make_metadata(4)
        )
        checkpointer.wait_until_finished()

    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        template = abstract(make_train_state(seed=9))
        restored_state, restored_buffer, restored_metadata = checkpointer.restore(
            train_state_template=template
        )

    assert_trees_equal(restored_state, train_state)
    assert isinstance(restored_state["params"], nnx.State)
    assert restored_buffer.keys() == buffer_state.keys()
    for name, array in buffer_state.items():
        assert restored_buffer[name].dtype == array.dtype, name
        assert restored_buffer[name].shape == array.shape, name
        np.testing.assert_array_equal(restored_buffer[name], array)
    assert restored_metadata == make_metadata(4)


def test_empty_buffer_and_concrete_template_round_trip(tmp_path):
    train_state = make_train_state()
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        checkpointer.save(1, train_state=train_state, buffer_state={}, metadata={}, force=True)
        restored_state, restored_buffer, restored_metadata = checkpointer.restore(
            train_state_template=make_train_state(seed=5)
        )
    assert_trees_equal(restored_state, train_state)
    assert restored_buffer == {}
    assert restored_metadata == {}


def test_restore_buffer_reads_the_buffer_and_metadata_of_a_step(tmp_path):
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        save_steps(checkpointer, [2, 4], force=True)
        latest_buffer, latest_metadata = checkpointer.restore_buffer()
        _, step_2_metadata = checkpointer.restore_buffer(step=2)
        with pytest.raises(FileNotFoundError, match="available steps: \\[2, 4\\]"):
            checkpointer.restore_buffer(step=3)
    assert latest_buffer.keys() == make_buffer_state().keys()
    for name, array in make_buffer_state().items():
        np.testing.assert_array_equal(latest_buffer[name], array)
    assert (latest_metadata, step_2_metadata) == (make_metadata(4), make_metadata(2))


def test_restore_subset_reads_the_named_leaves_and_not_the_buffer(tmp_path, monkeypatch):
    from tba_jax import checkpoint

    def no_buffer_read(*args, **kwargs):
        raise AssertionError("restore_subset read the replay buffer")

    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        save_steps(checkpointer, [2, 4], force=True)
    monkeypatch.setattr(checkpoint.NumpyDictCheckpointHandler, "restore", no_buffer_read)
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        template = {"params": abstract(make_train_state(seed=9)["params"])}
        restored, metadata = checkpointer.restore_subset(template=template, step=2)
        latest, latest_metadata = checkpointer.restore_subset(template=template)
    # the params alone, as saved (an nnx.State, like the template), without opt_state or step
    assert_trees_equal(restored, {"params": make_train_state(2)["params"]})
    assert isinstance(restored["params"], nnx.State)
    assert_trees_equal(latest, {"params": make_train_state(4)["params"]})
    assert (metadata, latest_metadata) == (make_metadata(2), make_metadata(4))


def test_reading_a_trained_policy_logs_no_warning(tmp_path, caplog):
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        save_steps(checkpointer, [2], force=True)
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        template = {"params": abstract(make_train_state(seed=9)["params"])}
        with caplog.at_level(logging.WARNING):
            checkpointer.restore_subset(template=template)
    assert [record.getMessage() for record in caplog.records] == []


def test_read_metadata_reads_a_steps_metadata_alone(tmp_path):
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        save_steps(checkpointer, [2, 4], force=True)
        assert checkpointer.read_metadata() == make_metadata(4)
        assert checkpointer.read_metadata(2) == make_metadata(2)


def test_an_identity_that_named_the_params_layout_still_matches(tmp_path):
    from tba_jax.runs import checkpoint_stacked

    legacy = {**EXPERIMENT, "model": {**EXPERIMENT["model"], "scan_layers": True}}
    with Checkpointer(str(tmp_path), experiment=legacy) as checkpointer:
        save_steps(checkpointer, [2], force=True)
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        # a checkpoint without params_stacked in its metadata has the legacy identity's layout
        assert checkpoint_stacked(checkpointer.read_metadata(2), str(tmp_path))
    other = {**EXPERIMENT, "model": {"layers": 3}}
    with pytest.raises(CheckpointMismatchError, match=r"model\.layers"):
        Checkpointer(str(tmp_path), experiment=other)


def test_numpy_values_in_metadata_are_saved_as_plain_json(tmp_path):
    metadata = {"policy_version": np.int64(3), "rng_key": np.array([0, 42], dtype=np.uint32)}
    train_state = {"step": jnp.asarray(1)}
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        with pytest.raises(ValueError, match="train_state has no leaves"):
            checkpointer.save(1, train_state={}, buffer_state={}, metadata=metadata)
        checkpointer.save(1, train_state=train_state, buffer_state={}, metadata=metadata)
        _, _, restored = checkpointer.restore(train_state_template=train_state)
    assert restored == {"policy_version": 3, "rng_key": [0, 42]}


def test_restore_places_arrays_on_template_sharding(tmp_path):
    device = jax.devices()[0]
    mesh = jax.sharding.Mesh(np.array([device]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    train_state = {"w": jnp.arange(8.0).reshape(4, 2)}
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        checkpointer.save(2, train_state=train_state, buffer_state={}, metadata={})
        template = {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32, sharding=sharding)}
        restored, _, _ = checkpointer.restore(train_state_template=template)
    assert restored["w"].sharding == sharding
    np.testing.assert_array_equal(restored["w"], train_state["w"])


MULTI_DEVICE_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from tba_jax.checkpoint import Checkpointer

    assert jax.device_count() == 2, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    replicated = NamedSharding(mesh, PartitionSpec())
    split_rows = NamedSharding(mesh, PartitionSpec("fsdp"))
    w = jax.device_put(jnp.arange(16.0).reshape(4, 4), replicated)
    with Checkpointer(sys.argv[1], experiment={"name": "multi"}) as checkpointer:
        checkpointer.save(1, train_state={"w": w}, buffer_state={}, metadata={})
        template = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=split_rows)}
        restored, _, _ = checkpointer.restore(train_state_template=template)
    assert restored["w"].sharding == split_rows, restored["w"].sharding
    assert [s.data.shape for s in restored["w"].addressable_shards] == [(2, 4), (2, 4)]
    np.testing.assert_array_equal(restored["w"], np.arange(16.0).reshape(4, 4))
    print("OK")
    """
)


def test_restore_reshards_across_two_fake_devices(tmp_path):
    environment = fake_cpu_devices_env(2)
    environment["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO_ROOT), environment.get("PYTHONPATH")])
    )
    result = subprocess.run(
        [sys.executable, "-c", MULTI_DEVICE_SCRIPT, str(tmp_path)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_SECONDS,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout


def test_latest_step_and_max_to_keep(tmp_path):
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT, max_to_keep=2) as checkpointer:
        assert checkpointer.latest_step() is None
        assert save_steps(checkpointer, [1, 2, 3]) == [True, True, True]
        assert checkpointer.latest_step() == 3
        assert checkpointer.all_steps() == [2, 3]
        _, _, metadata = checkpointer.restore(train_state_template=make_train_state(), step=2)
        assert metadata == make_metadata(2)
    step_dirs = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert step_dirs == ["2", "3"]


def test_kept_steps_outlive_max_to_keep(tmp_path):
    with Checkpointer(
        str(tmp_path), experiment=EXPERIMENT, max_to_keep=2, keep_steps=(0,)
    ) as checkpointer:
        save_steps(checkpointer, [0, 1, 2, 3])
        assert checkpointer.all_steps() == [0, 2, 3]  # a recorded run's replay starts at 0


def test_save_interval_force_and_existing_step(tmp_path):
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT, save_interval_steps=5) as checkpointer:
        assert save_steps(checkpointer, [3, 5, 7]) == [False, True, False]
        assert save_steps(checkpointer, [7], force=True) == [True]
        assert save_steps(checkpointer, [7], force=True) == [False]  # never overwrites
        assert checkpointer.all_steps() == [5, 7]


def test_stale_temporary_directory_is_not_a_checkpoint(tmp_path):
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        save_steps(checkpointer, [2])
    partial = tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp"  # a save killed half-way
    (partial / "train_state").mkdir(parents=True)
    (partial / "train_state" / "half_written").write_bytes(b"\x00" * 8)

    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        assert checkpointer.latest_step() == 2
        _, _, metadata = checkpointer.restore(train_state_template=make_train_state())
        assert metadata == make_metadata(2)
        assert save_steps(checkpointer, [3]) == [True]
        _, _, metadata = checkpointer.restore(train_state_template=make_train_state())
    assert metadata == make_metadata(3)
    assert not (tmp_path / "checkpoints" / "3" / "train_state" / "half_written").exists()


def test_mismatched_experiment_raises_and_touches_nothing(tmp_path):
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        save_steps(checkpointer, [1])
    before = snapshot_files(tmp_path)
    other = {**EXPERIMENT, "model": {"layers": 4}}

    with pytest.raises(CheckpointMismatchError) as error:
        Checkpointer(str(tmp_path), experiment=other, max_to_keep=1)

    message = str(error.value)
    assert "\n" not in message
    assert str(tmp_path) in message
    assert "model.layers: 2 vs 4" in message
    assert "--workdir" in message
    assert snapshot_files(tmp_path) == before


def test_unlabelled_checkpoints_are_refused(tmp_path):
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        save_steps(checkpointer, [1])
    (tmp_path / "checkpoints" / "experiment.json").unlink()
    with pytest.raises(CheckpointMismatchError, match="--workdir"):
        Checkpointer(str(tmp_path), experiment=EXPERIMENT)


def test_same_experiment_with_tuples_resumes(tmp_path):
    experiment = {"config_name": "x", "shape": (2, 3)}
    with Checkpointer(str(tmp_path), experiment=experiment) as checkpointer:
        save_steps(checkpointer, [1])
    with Checkpointer(str(tmp_path), experiment={"config_name": "x", "shape": [2, 3]}) as again:
        assert again.latest_step() == 1


def test_missing_checkpoint_error_names_workdir(tmp_path):
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        with pytest.raises(FileNotFoundError, match=str(tmp_path)):
            checkpointer.restore(train_state_template=make_train_state())
        save_steps(checkpointer, [1])
        with pytest.raises(FileNotFoundError, match="available steps: \\[1\\]"):
            checkpointer.restore(train_state_template=make_train_state(), step=9)


def test_object_arrays_in_buffer_are_rejected(tmp_path):
    ragged = np.empty(2, dtype=object)
    ragged[:] = [[1], [2, 3]]
    with (
        Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer,
        pytest.raises(TypeError, match="ragged"),
    ):
        checkpointer.save(
            1, train_state=make_train_state(), buffer_state={"tokens": ragged}, metadata={}
        )


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


@pytest.mark.parametrize("signum, reason", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C")])
def test_sigterm_and_ctrl_c_set_the_stop_flag_and_handlers_are_restored(signum, reason):
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop = StopSignal()
    restore = install_stop_handlers(stop)
    try:
        assert not stop.requested
        stop.raise_if_requested()  # nothing asked yet
        os.kill(os.getpid(), signum)
        assert wait_for(lambda: stop.requested, SIGNAL_WAIT_SECONDS)
        assert stop.reason == reason
        with pytest.raises(RunStopped, match=reason) as stopped:
            stop.raise_if_requested()
        # what a notebook shows (the launchers print their own line from .reason)
        assert str(stopped.value) == (
            f"{reason}: stopped and saved; run it again on the same workdir to go on."
        )
    finally:
        restore()
    assert {s: signal.getsignal(s) for s in previous} == previous


def test_a_second_ctrl_c_interrupts_at_once():
    stop = StopSignal()
    restore = install_stop_handlers(stop)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert wait_for(lambda: stop.requested, SIGNAL_WAIT_SECONDS)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(SIGNAL_WAIT_SECONDS)
    finally:
        restore()


def test_a_stop_inside_another_sets_both_and_a_later_one_starts_stopped():
    # a run's handlers inside a sweep's: the sweep stops too once the run has saved
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    outer = StopSignal()
    restore_outer = install_stop_handlers(outer)
    try:
        inner = StopSignal()
        restore_inner = install_stop_handlers(inner)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            assert wait_for(lambda: inner.requested, SIGNAL_WAIT_SECONDS)
            assert outer.requested and (outer.reason, outer.signum) == ("SIGTERM", signal.SIGTERM)
        finally:
            restore_inner()
        assert signal.getsignal(signal.SIGTERM).stop_signal is outer
        later = StopSignal()  # e.g. the next run, had the sweep gone on: stopped at once
        install_stop_handlers(later)()
        assert later.requested and later.reason == "SIGTERM"
    finally:
        restore_outer()
    assert {s: signal.getsignal(s) for s in previous} == previous


def test_a_ctrl_c_inside_another_stop_leaves_the_next_one_quitting_at_once():
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    outer, inner = StopSignal(), StopSignal()
    restore_outer = install_stop_handlers(outer)
    try:
        restore_inner = install_stop_handlers(inner)
        os.kill(os.getpid(), signal.SIGINT)
        assert wait_for(lambda: inner.requested and outer.requested, SIGNAL_WAIT_SECONDS)
        restore_inner()  # the run saved and returned: a second Ctrl-C ends the sweep at once
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        later = StopSignal()  # one installed now takes the Ctrl-C over, and keeps it so
        restore_later = install_stop_handlers(later)
        assert later.reason == "Ctrl-C"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        restore_later()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(SIGNAL_WAIT_SECONDS)
    finally:
        restore_outer()
    assert {s: signal.getsignal(s) for s in previous} == previous


def test_stop_handlers_refuse_worker_threads():
    errors = []

    def install_from_worker():
        try:
            install_stop_handlers(StopSignal())
        except RuntimeError as error:
            errors.append(error)

    worker = threading.Thread(target=install_from_worker)
    worker.start()
    worker.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])


def test_experiment_precheck_refuses_without_writing_and_ignores_unknown_keys(tmp_path):
    check_experiment(str(tmp_path / "fresh"), EXPERIMENT)  # nothing there: nothing to refuse
    assert not (tmp_path / "fresh").exists()
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        save_steps(checkpointer, [1])
    before = snapshot_files(tmp_path)
    check_experiment(str(tmp_path), {**EXPERIMENT, "model": {"layers": 9}}, ("model",))
    with pytest.raises(CheckpointMismatchError, match=r"task\.k: 4 vs 5"):
        check_experiment(str(tmp_path), {**EXPERIMENT, "task": {"k": 5}}, ("model",))
    assert snapshot_files(tmp_path) == before


def test_an_unreadable_experiment_file_is_a_one_line_error(tmp_path):
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        save_steps(checkpointer, [1])
    path = tmp_path / "checkpoints" / "experiment.json"
    path.write_text(path.read_text()[:10])  # truncated
    with pytest.raises(CheckpointMismatchError) as error:
        Checkpointer(str(tmp_path), experiment=EXPERIMENT)
    assert "unreadable" in str(error.value) and "\n" not in str(error.value)


def test_set_aside_moves_a_step_out_and_the_previous_one_is_latest(tmp_path):
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT, max_to_keep=3) as checkpointer:
        save_steps(checkpointer, [1, 2])
        where = Path(checkpointer.set_aside(2))
        assert checkpointer.latest_step() == 1
        assert checkpointer.all_steps() == [1]
    assert where.parent == tmp_path / SET_ASIDE_SUBDIR and (where / "metadata").exists()
    with Checkpointer(str(tmp_path), experiment=EXPERIMENT) as checkpointer:
        assert checkpointer.latest_step() == 1


def test_a_pytree_round_trips(tmp_path):
    tree = make_train_state(4)
    save_pytree(str(tmp_path / "tree"), tree)
    restored = restore_pytree(str(tmp_path / "tree"), tree)
    for expected, got in zip(jax.tree.leaves(tree), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(expected), np.asarray(got))


@pytest.mark.parametrize("interruption", [ValueError, KeyboardInterrupt])
def test_a_workdir_claimed_by_a_refused_or_interrupted_run_is_removed(tmp_path, interruption):
    workdir = tmp_path / "new" / "run"
    with (
        contextlib.ExitStack() as held,
        pytest.raises(interruption),
        checkpoint.claimed_workdir(str(workdir), held),
    ):
        (workdir / "data").mkdir()  # the task's data, half prepared
        raise interruption()
    assert list(tmp_path.iterdir()) == []  # the folders this run made are gone
    (tmp_path / "kept").mkdir()
    with (
        contextlib.ExitStack() as held,
        pytest.raises(KeyboardInterrupt),
        checkpoint.claimed_workdir(str(tmp_path / "kept"), held),
    ):
        raise KeyboardInterrupt()
    assert (tmp_path / "kept").is_dir()  # one that was there stays


def test_a_workdir_lock_refuses_a_second_holder_until_released_and_writes_nothing(tmp_path):
    first = checkpoint.WorkdirLock(str(tmp_path))
    with pytest.raises(checkpoint.WorkdirInUseError, match=f"--workdir={tmp_path} is in use"):
        checkpoint.WorkdirLock(str(tmp_path))
    first.release()
    first.release()  # twice is harmless
    with checkpoint.WorkdirLock(str(tmp_path)):
        pass
    assert os.listdir(tmp_path) == []


def test_a_workdir_lock_goes_with_the_process_that_held_it(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_AND_WAIT, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(checkpoint.WorkdirInUseError):
        checkpoint.WorkdirLock(str(tmp_path))
    holder.kill()  # no clean-up of its own
    holder.wait(timeout=SUBPROCESS_TIMEOUT_SECONDS)
    checkpoint.WorkdirLock(str(tmp_path)).release()


HOLD_AND_WAIT = """
import sys
from tba_jax.checkpoint import WorkdirLock
lock = WorkdirLock(sys.argv[1])
print("held", flush=True)
sys.stdin.read()
"""


def test_a_missing_buffer_file_is_named_as_missing_or_as_fewer_processes(tmp_path, monkeypatch):
    handler = checkpoint.NumpyDictCheckpointHandler()
    with pytest.raises(FileNotFoundError, match=r"the file is missing"):
        handler.restore(epath.Path(tmp_path))
    handler.save(epath.Path(tmp_path), checkpoint.NumpyDictSave({"a": np.arange(3)}))
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # this run: 2 processes, we are 1
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    with pytest.raises(FileNotFoundError, match=r"written by 1 process\(es\), this run has 2"):
        handler.restore(epath.Path(tmp_path))
