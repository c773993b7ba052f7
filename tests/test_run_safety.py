"""A run is never lost: stops at every phase save what exists and resume, non-finite
numbers are skipped and stop the run only after `max_nonfinite_steps`, corrupt checkpoints
are set aside for the one before.

Runs are the built-in smoke config, in process. A stop is a real SIGTERM sent to this
process at a chosen moment (from inside a patched function), so the handlers, the flag
and the safe points are the run's own.
"""

import dataclasses
import gc
import glob
import json
import logging
import os
import shutil
import signal
import sys
import time
import warnings

import jax
import numpy as np
import pytest
from support import sigterm_in_step

import tba_jax.train as train_module
from configs.arithmetic import get_config
from tba_jax import evaluation, learner, runs, runtime, tasks, warmstart
from tba_jax.checkpoint import (
    SET_ASIDE_SUBDIR,
    CheckpointMismatchError,
    CheckpointUnreadableError,
    RunStopped,
)
from tba_jax.config_lib import ConfigError
from tba_jax.metrics import read_scalars
from tba_jax.run_view import RunView
from tba_jax.runs import restore_policy, restore_run
from tba_jax.tasks import arithmetic as arithmetic_tasks
from tba_jax.train import WARM_START_SUBDIR, NonFiniteError, train_and_evaluate

# Smoke runs whose 16 test problems are evaluated 8 at a time (2 batches), while every
# training search call scores 16 samples (4 prompts × 4): the two are told apart by size.
ASYNC = "smoke,eval.batch_size=8"
SYNC = ASYNC + ",mode=sync"  # deterministic: a resumed run must end bit-identical
STEPS = 4
TRAINING_ROWS = 16


def steps_saved(workdir: str) -> list[int]:
    directory = os.path.join(workdir, "checkpoints")
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def leaves_equal(a, b) -> bool:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in pairs)


def sigterm_on_call(monkeypatch, module, name: str, call_index: int) -> None:
    """Makes call number `call_index` (from 0) of `module.name` send SIGTERM to this process
    before doing its work, as a preemption arriving at that moment would."""
    original = getattr(module, name)
    calls = []

    def wrapped(*args, **kwargs):
        if len(calls) == call_index:
            os.kill(os.getpid(), signal.SIGTERM)
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """The same sync run, never stopped: what every stopped-and-resumed run must equal."""
    workdir = str(tmp_path_factory.mktemp("straight"))
    return workdir, train_and_evaluate(get_config(SYNC), workdir)


def stop_in_the_warm_start(workdir: str, monkeypatch) -> None:
    """Runs the sync config in `workdir` until a SIGTERM in its second warm-start step."""
    with monkeypatch.context() as patch:
        # during the second of the 3 warm-start steps
        sigterm_in_step(patch, warmstart, "make_supervised_step", 1)
        with pytest.raises(RunStopped, match="SIGTERM"):
            train_and_evaluate(get_config(SYNC), workdir)


def test_a_stop_in_the_warm_start_saves_it_and_the_rerun_goes_on(
    straight_run, tmp_path, monkeypatch
):
    workdir = str(tmp_path)
    began = time.time()
    stop_in_the_warm_start(workdir, monkeypatch)
    stopped_segment = time.time() - began
    with open(os.path.join(workdir, WARM_START_SUBDIR, "progress.json")) as f:
        saved = json.load(f)["seconds"]  # the stopped segment's times
    assert 0 < saved["warm_start_seconds"] <= saved["wall_seconds"] <= stopped_segment
    assert not steps_saved(workdir)
    began = time.time()
    summary = train_and_evaluate(get_config(SYNC), workdir)
    # the summary's times are both segments'
    assert saved["wall_seconds"] < summary["wall_seconds"] <= stopped_segment + time.time() - began
    assert summary["warm_start_seconds"] > saved["warm_start_seconds"]
    assert summary["learner_steps"] == STEPS
    assert not os.path.exists(os.path.join(workdir, WARM_START_SUBDIR))  # superseded
    # Going on from step 2 of the warm start is exact: the run ends where a straight one does.
    _, resumed, _ = restore_policy(get_config(SYNC), workdir)
    _, straight, _ = restore_policy(get_config(SYNC), straight_run[0])
    assert leaves_equal(resumed, straight)
    assert summary["eval_accuracy_end"] == straight_run[1]["eval_accuracy_end"]


def test_a_saved_warm_start_is_not_gone_on_with_other_warm_start_settings(tmp_path, monkeypatch):
    workdir = str(tmp_path)
    stop_in_the_warm_start(workdir, monkeypatch)
    config = get_config(SYNC)
    config.warm_start.learning_rate = 1e-9
    with pytest.raises(ConfigError, match=r"warm_start\.learning_rate: 0\.003 vs 1e-09"):
        train_and_evaluate(config, workdir)
    assert warmstart.WarmStartCheckpoint(os.path.join(workdir, WARM_START_SUBDIR)).exists()


def test_a_corrupt_saved_warm_start_is_set_aside_and_started_over(
    straight_run, tmp_path, monkeypatch, caplog
):
    workdir = str(tmp_path)
    stop_in_the_warm_start(workdir, monkeypatch)
    saved = os.path.join(workdir, WARM_START_SUBDIR)
    truncate(largest_file(saved))
    with caplog.at_level(logging.WARNING):
        summary = train_and_evaluate(get_config(SYNC), workdir)
    assert summary["learner_steps"] == STEPS
    warned = [r.getMessage() for r in caplog.records if "does not restore" in r.getMessage()]
    assert len(warned) == 1 and "starting the warm start over" in warned[0]
    set_aside = os.listdir(os.path.join(workdir, SET_ASIDE_SUBDIR))
    assert len(set_aside) == 1 and set_aside[0].startswith(WARM_START_SUBDIR + "-")  # kept
    # started over from step 0: the run ends where a straight one does
    _, params, _ = restore_policy(get_config(SYNC), workdir)
    _, straight, _ = restore_policy(get_config(SYNC), straight_run[0])
    assert leaves_equal(params, straight)


def test_a_sigterm_while_a_new_run_prepares_its_data_stops_it_and_leaves_no_workdir(
    tmp_path, monkeypatch
):
    workdir = tmp_path / "new_run"
    original = tasks.build_task

    def preempted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's preemption, mid-preparation
        return original(*args, **kwargs)

    monkeypatch.setattr(tasks, "build_task", preempted)
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunStopped, match="SIGTERM") as stopped:
        train_and_evaluate(get_config(SYNC), str(workdir))
    assert stopped.value.exit_status == 143  # what the launchers exit with
    assert not workdir.exists()  # nothing of it was worth keeping
    assert signal.getsignal(signal.SIGTERM) is previous


def test_a_stop_in_the_first_evaluation_keeps_the_warm_start(straight_run, tmp_path, monkeypatch):
    workdir = str(tmp_path)
    with monkeypatch.context() as patch:
        sigterm_on_call(patch, evaluation, "generate_and_score", call_index=0)
        with pytest.raises(RunStopped, match="SIGTERM"):
            train_and_evaluate(get_config(SYNC), workdir)
    assert steps_saved(workdir) == [0]
    summary = train_and_evaluate(get_config(SYNC), workdir)
    assert summary["warm_start_seconds"] > 0  # from the saved history, not redone
    assert summary["eval_accuracy_start"] == straight_run[1]["eval_accuracy_start"]
    assert summary["eval_accuracy_end"] == straight_run[1]["eval_accuracy_end"]


def test_a_stop_before_the_first_step_keeps_the_start_evaluation(
    straight_run, tmp_path, monkeypatch
):
    workdir = str(tmp_path)
    with monkeypatch.context() as patch:  # the start evaluation is done; step 1 is not
        sigterm_on_call(patch, train_module, "precompile_train_step", call_index=0)
        with pytest.raises(RunStopped, match="SIGTERM"):
            train_and_evaluate(get_config(SYNC), workdir)
    assert steps_saved(workdir) == [0]
    evaluated = []
    original = evaluation.generate_and_score
    monkeypatch.setattr(
        evaluation,
        "generate_and_score",
        lambda *args, **kwargs: evaluated.append(1) or original(*args, **kwargs),
    )
    summary = train_and_evaluate(get_config(SYNC), workdir)
    assert len(evaluated) == 2  # the final evaluation's two batches: the start's is read back
    assert summary["eval_accuracy_start"] == straight_run[1]["eval_accuracy_start"]
    assert summary["eval_accuracy_end"] == straight_run[1]["eval_accuracy_end"]


def test_a_stop_in_the_final_evaluation_saves_the_last_step(straight_run, tmp_path, monkeypatch):
    workdir = str(tmp_path)
    start_batches = 2  # the first evaluation: 16 problems, 8 at a time
    with monkeypatch.context() as patch:
        sigterm_on_call(patch, evaluation, "generate_and_score", call_index=start_batches)
        with pytest.raises(RunStopped, match="SIGTERM"):
            train_and_evaluate(get_config(SYNC), workdir)
    assert steps_saved(workdir)[-1] == STEPS
    assert not os.path.exists(os.path.join(workdir, "summary.json"))
    summary = train_and_evaluate(get_config(SYNC), workdir)  # evaluates, trains nothing
    assert summary["learner_steps"] == STEPS
    assert summary["samples_generated"] == straight_run[1]["samples_generated"]
    assert summary["eval_accuracy_end"] == straight_run[1]["eval_accuracy_end"]


def test_a_stop_in_an_evaluation_during_training_keeps_that_steps_metrics(tmp_path, monkeypatch):
    workdir = str(tmp_path)
    config = get_config(SYNC + ",eval.every_steps=2,log_every=1")
    start_batches = 2  # the first evaluation: 16 problems, 8 at a time; then step 2's
    with monkeypatch.context() as patch:
        sigterm_on_call(patch, evaluation, "generate_and_score", call_index=start_batches)
        with pytest.raises(RunStopped, match="SIGTERM"):
            train_and_evaluate(config, workdir)
    assert steps_saved(workdir)[-1] == 2
    train_and_evaluate(config, workdir)
    scalars = read_scalars(os.path.join(workdir, "tensorboard"))
    assert [step for step, _ in scalars["loss"]] == [1, 2, 3, 4]  # step 2's too
    assert [step for step, _ in scalars["eval_accuracy"]] == [4]  # 2's was stopped


def task_with_rewards(monkeypatch, rewards_of):
    """Registers an arithmetic task whose training rewards are `rewards_of(task)`
    (evaluation keeps the exact ones)."""

    def build(task_config, workdir, tokenizer=None):
        task = arithmetic_tasks.arithmetic_task(task_config, workdir, tokenizer)
        return dataclasses.replace(task, rewards=rewards_of(task))

    monkeypatch.setitem(tasks.base._TASKS, "arithmetic", build)


def nan_for_training(task, every: int = 1):
    """Rewards that are NaN for every `every`-th training sample (a reward model gone bad);
    the evaluation's calls (8 rows) stay exact."""

    def rewards(examples, responses):
        values = np.array(task.rewards(examples, responses), np.float32)
        if len(examples) == TRAINING_ROWS:
            values[::every] = np.nan
        return values

    return rewards


def test_non_finite_losses_are_skipped_then_stop_the_run_with_finite_params(tmp_path, monkeypatch):
    task_with_rewards(monkeypatch, nan_for_training)
    workdir = str(tmp_path)
    config = get_config(SYNC + ",max_nonfinite_steps=3,checkpoint_every=1,keep_checkpoints=9")
    with pytest.raises(NonFiniteError, match="not finite for 3 learner steps in a row"):
        train_and_evaluate(config, workdir)
    assert isinstance(NonFiniteError("x"), ConfigError)  # the launcher prints it in one line
    assert steps_saved(workdir) == [0, 1, 2, 3]
    _, params, _ = restore_policy(config, workdir)
    assert bool(learner.all_finite(params))
    # Every update was skipped: the params are still the warm-started ones of step 0.
    _, params_start, _ = restore_policy(config, workdir, step=0)
    assert leaves_equal(params, params_start)


def test_async_searchers_drop_non_finite_samples_and_count_them(tmp_path, monkeypatch):
    task_with_rewards(monkeypatch, lambda task: nan_for_training(task, every=2))
    summary = train_and_evaluate(get_config(ASYNC), str(tmp_path))
    assert summary["learner_steps"] == STEPS
    assert summary["skipped_nonfinite_steps"] == 0  # nothing non-finite reached the learner
    dropped = read_scalars(os.path.join(str(tmp_path), "tensorboard"))[runtime.DROPPED_NONFINITE]
    assert dropped[-1][1] > 0


def test_async_searchers_that_only_make_non_finite_samples_stop_the_run(tmp_path, monkeypatch):
    task_with_rewards(monkeypatch, nan_for_training)
    with pytest.raises(runtime.NonFiniteSamplesError, match="non-finite reward or log-prob"):
        train_and_evaluate(get_config(ASYNC + ",max_nonfinite_steps=2"), str(tmp_path))


@pytest.fixture(scope="module")
def run_with_three_checkpoints(tmp_path_factory):
    """A sync run saved at steps 0, 2 and 4 (then extended to 6 by each test)."""
    workdir = str(tmp_path_factory.mktemp("three"))
    train_and_evaluate(get_config(SYNC + ",checkpoint_every=2,keep_checkpoints=3"), workdir)
    assert steps_saved(workdir) == [0, 2, 4]
    return workdir


def truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(max(os.path.getsize(path) // 2, 1))


ORBAX_MARKERS = ("commit_success.txt", "_CHECKPOINT_METADATA", "_METADATA", "_sharding")


def largest_file(directory: str) -> str:
    """The largest data file under `directory` (not one of orbax's marker files)."""
    paths = [
        os.path.join(root, name)
        for root, _, names in os.walk(directory)
        for name in names
        if name not in ORBAX_MARKERS
    ]
    return max(paths, key=os.path.getsize)


@pytest.mark.parametrize("item", ["train_state", "buffer", "metadata"])
def test_a_corrupt_newest_checkpoint_is_set_aside_for_the_one_before(
    run_with_three_checkpoints, tmp_path, item
):
    workdir = str(tmp_path / "run")
    shutil.copytree(run_with_three_checkpoints, workdir)
    truncate(largest_file(os.path.join(workdir, "checkpoints", "4", item)))
    config = get_config(SYNC + ",checkpoint_every=2,keep_checkpoints=3,steps=6")
    summary = train_and_evaluate(config, workdir)
    assert summary["learner_steps"] == 6
    set_aside = os.listdir(os.path.join(workdir, SET_ASIDE_SUBDIR))
    assert len(set_aside) == 1 and set_aside[0].startswith("4-")  # kept, not deleted
    assert steps_saved(workdir) == [2, 4, 6]  # step 4 trained again from step 2


def step_4_corrupt(run: str, tmp_path, monkeypatch) -> tuple[str, list]:
    """A copy of `run` with every array data file of step 4's train state truncated (the
    params too, whichever files orbax put them in: reading the policy alone must fail), and
    a list that records every unraisable exception from now on (what Python would print as
    "Exception ignored")."""
    workdir = str(tmp_path / "run")
    shutil.copytree(run, workdir)
    train_state = os.path.join(workdir, "checkpoints", "4", "train_state")
    data_files = glob.glob(os.path.join(train_state, "ocdbt.process_*", "d", "*"))
    assert data_files, os.listdir(train_state)
    for path in data_files:
        truncate(path)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    return workdir, unraisable


def test_a_corrupt_checkpoint_is_one_warning_without_the_failed_reads_leftovers(
    run_with_three_checkpoints, tmp_path, monkeypatch, caplog
):
    """orbax leaves a failed restore's reads behind (coroutines that raise when collected,
    TensorStore callbacks into a closed event loop, asyncio's "never retrieved" futures):
    dozens of tracebacks on stderr for the one error the run reports."""
    workdir, unraisable = step_4_corrupt(run_with_three_checkpoints, tmp_path, monkeypatch)
    config = get_config(SYNC + ",checkpoint_every=2,keep_checkpoints=3,steps=6")
    with warnings.catch_warnings(record=True) as warned, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        train_and_evaluate(config, workdir)
        gc.collect()
    assert not unraisable, [item.exc_value for item in unraisable][:3]
    assert not [w for w in warned if "never awaited" in str(w.message)]
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert len([r for r in caplog.records if "does not restore" in r.getMessage()]) == 1


def test_loading_a_corrupt_checkpoint_is_a_one_line_error_naming_the_other_steps(
    run_with_three_checkpoints, tmp_path, monkeypatch
):
    workdir, unraisable = step_4_corrupt(run_with_three_checkpoints, tmp_path, monkeypatch)
    config = get_config(SYNC + ",checkpoint_every=2,keep_checkpoints=3")
    restore_run(config, workdir, 2)  # a good step leaves the hook as it was
    assert sys.unraisablehook == unraisable.append
    with pytest.raises(CheckpointUnreadableError) as raised:
        restore_run(config, workdir, 4)
    gc.collect()
    message = str(raised.value)
    assert "Checkpoint 4" in message and "[0, 2]" in message and "\n" not in message
    assert "TensorStore" not in message and raised.value.__cause__ is None
    assert not unraisable, [item.exc_value for item in unraisable][:3]


def test_a_run_views_corrupt_buffer_is_the_same_one_line_error(
    run_with_three_checkpoints, tmp_path
):
    workdir = str(tmp_path / "run")
    shutil.copytree(run_with_three_checkpoints, workdir)
    truncate(largest_file(os.path.join(workdir, "checkpoints", "4", "buffer")))
    view = RunView(workdir)
    view.replay_buffer(2)  # a good step reads
    with pytest.raises(CheckpointUnreadableError) as raised:
        view.replay_buffer(4)
    message = str(raised.value)
    assert "Checkpoint 4" in message and "[0, 2]" in message and "\n" not in message
    assert "pass one as `step`" in message and raised.value.__cause__ is None


def test_no_readable_checkpoint_is_a_clear_error(run_with_three_checkpoints, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(run_with_three_checkpoints, workdir)
    for step in (0, 2, 4):
        truncate(largest_file(os.path.join(workdir, "checkpoints", str(step), "train_state")))
    config = get_config(SYNC + ",checkpoint_every=2,keep_checkpoints=3,steps=6")
    with pytest.raises(ConfigError, match=r"No checkpoint in .* restores"):
        train_and_evaluate(config, workdir)
    assert len(os.listdir(os.path.join(workdir, SET_ASIDE_SUBDIR))) == 3


def test_saving_the_same_warm_start_step_again_keeps_the_saved_progress(tmp_path):
    """A stop right after going on from a saved warm start (no new step) must not remove
    the one copy the record names before writing it again."""
    tree = {"w": np.arange(4, dtype=np.float32)}
    progress = warmstart.WarmStartProgress(tree, {"count": np.zeros((), np.int32)}, 2, {"s": 1})
    saved = warmstart.WarmStartCheckpoint(str(tmp_path / "warm_start"))
    saved.save(progress, {"wall_seconds": 1.0}, settings={})
    state_dir = tmp_path / "warm_start" / "2"
    before = {p: p.stat().st_mtime_ns for p in state_dir.rglob("*") if p.is_file()}
    saved.save(progress, {"wall_seconds": 2.0}, settings={})
    assert {p: p.stat().st_mtime_ns for p in state_dir.rglob("*") if p.is_file()} == before
    assert saved.seconds_so_far() == {"wall_seconds": 2.0}  # the second stop's times
    restored = saved.restore(tree, progress.opt_state)
    assert restored.steps_done == 2 and restored.rng_state == {"s": 1}
    np.testing.assert_array_equal(restored.params["w"], tree["w"])
    saved.save(progress._replace(steps_done=3), {}, settings={})  # a later step supersedes it
    assert saved.steps_saved() == 3 and not state_dir.exists()


def test_a_view_of_a_run_in_progress_reads_past_checkpoints_removed_meanwhile(
    run_with_three_checkpoints, tmp_path, monkeypatch
):
    """The training run prunes a checkpoint (keep_checkpoints) while a notebook reads it:
    the latest is read again at the new latest, and an asked-for step that is gone is
    named as removed, not as a truncated file."""
    workdir = str(tmp_path / "run")
    shutil.copytree(run_with_three_checkpoints, workdir)
    os.remove(os.path.join(workdir, "summary.json"))  # still training
    monkeypatch.setattr(runs, "READ_RETRY_S", 0.0)
    original, reads = runs.restore_run, []

    def pruned_while_read(config, workdir_read, step, **kwargs):
        reads.append(step)
        if step == 4:  # the run removes it as the read begins
            shutil.rmtree(os.path.join(workdir_read, "checkpoints", "4"))
        return original(config, workdir_read, step, **kwargs)

    monkeypatch.setattr(runs, "restore_run", pruned_while_read)
    view = RunView(workdir)
    assert view.policy().metadata["policy_version"] == 2 and reads == [4, 2]
    shutil.copytree(run_with_three_checkpoints + "/checkpoints/4", workdir + "/checkpoints/4")
    with pytest.raises(FileNotFoundError, match=r"Checkpoint 4 .* was removed while it was read"):
        view.policy(4)


def test_a_resume_whose_config_makes_another_train_state_is_refused_and_moves_nothing(
    run_with_three_checkpoints, tmp_path
):
    """No gradient clipping makes an optimiser state of another structure: that is a changed
    config, not three damaged checkpoints to set aside (after which the same command would
    have started the run over)."""
    workdir = str(tmp_path / "run")
    shutil.copytree(run_with_three_checkpoints, workdir)
    with open(os.path.join(workdir, "config.json")) as f:
        config_before = f.read()
    config = get_config(SYNC + ",checkpoint_every=2,keep_checkpoints=3,steps=6")
    config.optim.grad_clip_norm = 0.0
    with pytest.raises(CheckpointMismatchError) as refused:
        train_and_evaluate(config, workdir)
    assert "another structure" in str(refused.value)
    assert "optim.grad_clip_norm: 1.0 vs 0.0" in str(refused.value)
    assert steps_saved(workdir) == [0, 2, 4]
    assert not os.path.exists(os.path.join(workdir, SET_ASIDE_SUBDIR))
    with open(os.path.join(workdir, "config.json")) as f:
        assert f.read() == config_before  # still the config the run trained with


def test_a_resume_with_other_settings_names_them(run_with_three_checkpoints, tmp_path, caplog):
    workdir = str(tmp_path / "run")
    shutil.copytree(run_with_three_checkpoints, workdir)
    config = get_config(SYNC + ",checkpoint_every=2,keep_checkpoints=3,steps=6,seed=5")
    with caplog.at_level(logging.WARNING):
        train_and_evaluate(config, workdir)
    messages = [record.getMessage() for record in caplog.records]
    (notice,) = [message for message in messages if "differ from the run's" in message]
    assert notice.endswith("(saved vs now): seed: 0 vs 5.")  # more steps are no news
    with open(os.path.join(workdir, "config.json")) as f:
        assert json.load(f)["seed"] == 5  # config.json: the last segment's settings
