"""End to end: the smoke variant of the built-in task through `train_and_evaluate`.

The smoke variant runs the full code path (TFDS build, warm start, searcher
threads, replay buffer, TB learner, checkpoints, evaluation) with a micro
model in seconds. The async run records its learner batches, so its learner replays
(tba_jax.batch_replay; the batch log's own bookkeeping is in test_batch_log.py).
"""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from configs.arithmetic import get_config
from tba_jax import batch_log, batch_replay, runtime, tasks
from tba_jax.checkpoint import CheckpointMismatchError, WorkdirInUseError, WorkdirLock
from tba_jax.config_lib import ConfigError
from tba_jax.metrics import read_scalars
from tba_jax.run_view import RunView
from tba_jax.runs import load_config, load_trained_policy, restore_policy
from tba_jax.tasks import arithmetic as arithmetic_tasks
from tba_jax.train import train_and_evaluate

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED_SUMMARY_KEYS = {
    "config_name",
    "mode",
    "method",
    "learner_steps",
    "samples_generated",
    "wall_seconds",
    "eval_accuracy_start",
    "eval_accuracy_end",
    "max_policy_lag",
    "mean_policy_lag",
    "samples_per_second",
    "peak_device_gib",
}
FAILSAFE_SECONDS = 300
ASYNC = "smoke,record_learner_batches=True"


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("async"))
    summary = train_and_evaluate(get_config(ASYNC), workdir)
    return workdir, summary


@pytest.fixture(scope="module")
def extended_run(async_run, tmp_path_factory):
    """A copy of the async run extended to 6 steps, with a stale step 5 left in its batch
    log first (as a run killed after recording a step beyond its last checkpoint leaves
    it): (workdir, summary)."""
    workdir = str(tmp_path_factory.mktemp("extended") / "copy")
    shutil.copytree(async_run[0], workdir)
    log = batch_log.log_dir(workdir)
    shutil.copy(batch_log.step_path(log, 1), batch_log.step_path(log, 5))
    return workdir, train_and_evaluate(get_config(ASYNC + ",steps=6"), workdir)


def test_check_only_says_what_a_run_would_start_from_and_writes_nothing(async_run, tmp_path):
    """train.py --check_only: every check before the run's first write, then where it
    would start (a new workdir, a finished run, a resumable one); not a byte written."""
    from tba_jax.train import check_only

    workdir, _ = async_run
    before = _files_and_bytes(workdir)
    lines = check_only(get_config(ASYNC), workdir)
    assert lines[0].startswith("arithmetic (smoke,record_learner_batches=True): method=tb")
    assert lines[1].startswith("Meshes: the sampler's {'data': 1, 'fsdp': 1, 'tensor': 1}")
    assert lines[-1] == f"The run in {workdir} finished at step 4: a run gives its summary back."
    longer = check_only(get_config(ASYNC + ",steps=6"), workdir)
    assert longer[-1] == f"The run in {workdir} resumes from its checkpoint of step 4."
    assert _files_and_bytes(workdir) == before
    new = tmp_path / "new"
    assert check_only(get_config(ASYNC), str(new))[-1].endswith(
        "makes it and starts with a warm start."
    )
    assert not new.exists()
    with pytest.raises(CheckpointMismatchError, match=r"held vs asked: mode: 'async' vs 'sync'"):
        check_only(get_config(ASYNC + ",mode=sync"), workdir)


@pytest.fixture(scope="module")
def replay_bench(extended_run):
    with batch_replay.ReplayBench.build(extended_run[0]) as bench:
        yield bench


def _files_and_bytes(directory):
    contents = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                contents[os.path.relpath(path, directory)] = f.read()
    return contents


def test_async_run_writes_a_complete_summary(async_run):
    workdir, summary = async_run
    with open(os.path.join(workdir, "summary.json")) as f:
        on_disk = json.load(f)
    assert on_disk == json.loads(json.dumps(summary))
    assert set(on_disk) >= REQUIRED_SUMMARY_KEYS
    assert on_disk["mode"] == "async" and on_disk["method"] == "tb"
    assert on_disk["learner_steps"] == 4
    assert on_disk["samples_generated"] >= 4 * 4  # at least one batch worth
    assert 0.0 <= on_disk["eval_accuracy_start"] <= 1.0
    assert 0.0 <= on_disk["eval_accuracy_end"] <= 1.0
    assert on_disk["max_policy_lag"] >= on_disk["mean_policy_lag"] >= 0.0
    assert on_disk["samples_per_second"] > 0


def test_async_run_writes_tensorboard_scalars_and_a_final_checkpoint(async_run):
    workdir, _ = async_run
    scalars = read_scalars(os.path.join(workdir, "tensorboard"))
    assert [step for step, _ in scalars["loss"]] == [1, 2, 3, 4]
    assert all(np.isfinite(value) for _, value in scalars["loss"])
    assert "policy_lag_mean" in scalars and "buffer_num_prompts" in scalars
    _, params, metadata = restore_policy(get_config(ASYNC), workdir)
    assert metadata["policy_version"] == 4
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params))


def test_the_learner_logs_what_each_batch_drew_from_the_buffer(async_run):
    """The draw metrics of each step against the batch the run recorded for it."""
    workdir, _ = async_run
    scalars = {
        name: dict(values) for name, values in read_scalars(workdir + "/tensorboard").items()
    }
    reader = batch_log.BatchLogReader(batch_log.log_dir(workdir))
    for step in (1, 2, 3, 4):
        recorded = reader.read(step)
        prompt_ids, recency = recorded.rows["prompt_ids"], recorded.rows["from_recency"]
        expected = {
            "batch_distinct_prompt_share": len(set(prompt_ids.tolist())) / len(prompt_ids),
            "batch_recency_share": np.mean(recency),
            "batch_response_length_mean": np.mean(recorded.batch["response_mask"].sum(axis=1)),
        }
        # the lags of each kind of draw: the batch's K rows per prompt slot, step s - 1
        lags = step - 1 - recorded.rows["policy_version"].reshape(len(recency), -1)
        for kind, slots in (("recency", recency == 1), ("priority", recency == 0)):
            if slots.any():
                expected[f"policy_lag_{kind}_mean"] = lags[slots].mean()
            else:
                assert (
                    f"policy_lag_{kind}_mean" not in scalars
                    or step not in scalars[f"policy_lag_{kind}_mean"]
                )
        for name, value in expected.items():
            assert scalars[name][step] == pytest.approx(value), (name, step)
    assert "policy_lag_recency_mean" in scalars and "policy_lag_priority_mean" in scalars


def test_draw_metrics_count_prompt_slots_not_rows():
    rows = runtime.BatchRows(
        version_first=np.zeros(6, np.int64),
        version_last=np.zeros(6, np.int64),
        prompt_id=np.array([7, 7, 3, 3, 7, 7]),  # three slots of K = 2, prompt 7 twice
        from_recency=np.array([1, 1, 0, 0, 1, 1]),
        response_length=np.array([1, 2, 3, 4, 5, 6]),
    )
    assert runtime.draw_metrics(rows, samples_per_prompt=2) == {
        "batch_distinct_prompt_share": 2 / 3,
        "batch_recency_share": 2 / 3,
        "batch_response_length_mean": 3.5,
    }


def test_a_workdir_alone_gives_back_its_config_and_policy(async_run):
    workdir, _ = async_run
    saved, expected = load_config(workdir), get_config(ASYNC)
    assert saved.to_json_best_effort(sort_keys=True) == expected.to_json_best_effort(sort_keys=True)
    model_config, params = load_trained_policy(workdir)
    assert model_config.d_model == 32  # the micro preset of the smoke variant
    _, expected, _ = restore_policy(get_config(ASYNC), workdir)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)


def test_reading_a_run_with_another_config_says_to_leave_it_out_not_to_delete(async_run):
    workdir, _ = async_run
    before = _files_and_bytes(workdir)
    with pytest.raises(CheckpointMismatchError, match="another experiment") as refused:
        restore_policy(get_config("smoke,task.num_train=300"), workdir)
    assert "leave --config out" in str(refused.value)
    assert "delete" not in str(refused.value)
    assert _files_and_bytes(workdir) == before


def test_a_workdir_another_run_is_in_is_refused_before_anything_is_written(async_run):
    workdir, _ = async_run
    before = _files_and_bytes(workdir)
    # as another run holds it
    with WorkdirLock(workdir), pytest.raises(WorkdirInUseError, match="in use by another run"):
        train_and_evaluate(get_config(ASYNC), workdir)
    assert _files_and_bytes(workdir) == before
    assert train_and_evaluate(get_config(ASYNC), workdir)  # released: finished, given back


RUN_FILES = ("summary", "config")


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_rerunning_a_finished_run_keeps_its_summary_and_config(async_run, tmp_path, monkeypatch):
    workdir = str(tmp_path / "copy")
    shutil.copytree(async_run[0], workdir)
    summary_path, config_path = (os.path.join(workdir, f"{name}.json") for name in RUN_FILES)
    before = {path: read_bytes(path) for path in (summary_path, config_path)}
    config = get_config(ASYNC)
    config.replay.recency_prob = 0.5  # a knob the finished run did not train with

    def build_task(*args, **kwargs):
        raise AssertionError("a finished run builds its task (a paper task's reward model)")

    monkeypatch.setattr(tasks, "build_task", build_task)
    summary = train_and_evaluate(config, workdir)
    # not replaced by the figures of an empty segment, nor by a config it did not train with
    assert {path: read_bytes(path) for path in before} == before
    assert summary == json.loads(before[summary_path])


def test_a_finished_run_extended_reports_the_whole_run(async_run, extended_run):
    first, summary = async_run[1], extended_run[1]
    assert summary["learner_steps"] == 6
    # The warm start is not redone: its time and first evaluation come from the history.
    assert summary["warm_start_seconds"] == first["warm_start_seconds"]
    assert summary["eval_accuracy_start"] == first["eval_accuracy_start"]
    # Totals cover both segments, not only the two new steps (whose searchers, on a loaded
    # machine, may not finish a call before the learner's two steps from the restored buffer).
    assert summary["samples_generated"] >= first["samples_generated"]
    # (the first summary's RL seconds also hold its final evaluation, which the step-4
    # checkpoint the extension resumed from does not: compared with that checkpoint's)
    saved = RunView(async_run[0]).checkpoint_metadata(4)["history"]
    assert summary["rl_seconds"] > saved["rl_seconds"]
    assert summary["wall_seconds"] > first["wall_seconds"]
    assert summary["max_policy_lag"] >= first["max_policy_lag"]


def test_a_recorded_run_extended_without_recording_keeps_its_replay(async_run, tmp_path, caplog):
    workdir = str(tmp_path / "copy")
    shutil.copytree(async_run[0], workdir)
    with caplog.at_level(logging.INFO):
        train_and_evaluate(get_config("smoke,steps=6"), workdir)
    assert "--config.record_learner_batches=True to go on recording" in caplog.text
    assert batch_log.recorded_steps(batch_log.log_dir(workdir)) == [1, 2, 3, 4]
    assert "0" in os.listdir(os.path.join(workdir, "checkpoints"))  # the replay's start


def test_the_extended_async_run_replays_bit_identically(extended_run, replay_bench):
    log = batch_log.BatchLogReader(batch_log.log_dir(extended_run[0]))
    assert log.steps == [1, 2, 3, 4, 5, 6]
    assert [segment.start_step for segment in log.segments] == [0, 4]
    assert [segment.config["learner_steps"] for segment in log.segments] == [4, 6]
    recorded = log.read(5)  # recorded again by the extension, not the stale copy of step 1
    assert not np.array_equal(recorded.fingerprint, log.read(1).fingerprint)
    assert recorded.batch["reward"].shape == (16,) and recorded.rows["prompt_ids"].shape == (4,)
    assert set(recorded.rows) == set(batch_log.ROW_FIELDS) and "loss" in recorded.metrics
    report = batch_replay.replay_with(replay_bench)
    assert report.ok, "\n".join(report.lines())
    assert (report.from_step, report.to_step, report.steps_replayed) == (0, 6, 6)
    assert report.checkpoints_compared == [4, 6]  # 0 is kept, and the newest two
    assert report.lines()[-1].startswith("OK: all 6 steps matched")


def test_a_tampered_batch_is_named_as_the_first_divergence(extended_run, replay_bench):
    path = batch_log.step_path(batch_log.log_dir(extended_run[0]), 3)
    with open(path, "rb") as f:
        original = f.read()
    with np.load(path) as data:
        arrays = dict(data)
    arrays["batch.reward"] = arrays["batch.reward"].copy()
    arrays["batch.reward"][0] += 1.0  # one row: TB's loss moves (a shift of all would not)
    try:
        with open(path, "wb") as f:
            np.savez_compressed(f, **arrays)
        report = batch_replay.replay_with(replay_bench)
    finally:
        with open(path, "wb") as f:
            f.write(original)
    assert not report.ok
    assert report.divergence.step == 3 and report.divergence.kind == "fingerprint"
    assert report.divergence.recorded_loss != report.divergence.replayed_loss
    assert any("DIVERGED at learner step 3" in line for line in report.lines())


def test_replay_ranges_are_checked_against_the_workdir(replay_bench):
    with pytest.raises(ConfigError, match=r"--from_step=2 has no checkpoint; the run keeps"):
        batch_replay.replay_with(replay_bench, from_step=2)
    with pytest.raises(ConfigError, match=r"recorded steps run to 6 \(recorded: 1-6\)"):
        batch_replay.replay_with(replay_bench, from_step=4, to_step=9)


@pytest.mark.parametrize(
    "variant", ["smoke,model=tiny", "smoke,mode=sync", "smoke,task.num_train=300"]
)
def test_workdir_of_another_experiment_is_refused_and_left_intact(async_run, variant):
    workdir, _ = async_run
    before = _files_and_bytes(workdir)
    with pytest.raises(CheckpointMismatchError, match="another experiment"):
        train_and_evaluate(get_config(variant), workdir)
    assert _files_and_bytes(workdir) == before  # config.json and data/ included


def test_async_slot_engine_run_with_in_flight_updates_and_a_lag_bound(tmp_path, caplog):
    """...and a sample limit so tight (a prompt per 20 steps beyond the first fill) that
    the learner would wait forever for the stale samples it drops to be replaced, did the
    limit not lift while it waits."""
    config = get_config(
        "smoke,search.engine=slots,search.in_flight_updates=True,replay.max_policy_lag=1,"
        "search.max_samples_per_draw=0.05"
    )
    with caplog.at_level(logging.INFO), jax.log_compiles():
        summary = train_and_evaluate(config, str(tmp_path))
    # the learner step is compiled once, while the searchers fill the buffer
    assert_train_step_compiled_once_ahead(caplog.records)
    assert summary["learner_steps"] == 4 and summary["samples_generated"] >= 4 * 4
    assert summary["max_policy_lag"] <= 1  # the smoke run's lags reach 3 without the bound
    scalars = read_scalars(os.path.join(str(tmp_path), "tensorboard"))
    first, last = dict(scalars["policy_lag_max"]), dict(scalars["policy_lag_last_max"])
    assert sorted(first) == sorted(last) == [1, 2, 3, 4]
    # a sample's last params are never older than its first
    assert all(0 <= last[step] <= first[step] for step in first)
    assert "samples_dropped_stale" in scalars


def test_async_slot_engine_run_starting_live_prompts_over_at_publishes_under_a_sample_limit(
    tmp_path,
):
    config = get_config("smoke,search.engine=slots,search.max_samples_per_draw=0.5")
    summary = train_and_evaluate(config, str(tmp_path))
    assert summary["learner_steps"] == 4 and summary["samples_generated"] >= 4 * 4
    scalars = read_scalars(os.path.join(str(tmp_path), "tensorboard"))
    restarted = dict(scalars["prompts_restarted"])
    assert sorted(restarted) == [1, 2, 3, 4] and restarted[4] >= restarted[1] >= 0
    # the first fill (4 + 4 prompts of S = 4) and half of 5 steps' draws of 4 × 4, and the
    # last prompt's samples over; the searcher made 144 unbounded (2026-11-27)
    samples_per_prompt = config.batch.samples_generated_per_prompt
    bound = (8 + 0.5 * 5 * 4) * samples_per_prompt + samples_per_prompt
    assert summary["samples_generated"] <= bound
    assert dict(scalars["searchers_paused_seconds"])[4] > 0


def assert_train_step_compiled_once_ahead(records):
    """The learner step compiled exactly once, ahead of its first call (the log lines of
    `jax.log_compiles` and of `train.precompile_train_step`, in order)."""
    messages = [record.getMessage() for record in records]
    compiles = [m for m in messages if m.startswith("Compiling jit(train_step)")]
    ahead = [m for m in messages if m.startswith("Compiled the learner step")]
    assert len(compiles) == len(ahead) == 1
    assert messages.index(compiles[0]) < messages.index(ahead[0])


def test_a_background_compile_error_is_raised_where_it_is_joined():
    from tba_jax.sources import InBackground

    failing = InBackground(lambda: 1 / 0, name="test")
    with pytest.raises(ZeroDivisionError):
        failing.join()
    done = []
    InBackground(lambda: done.append(1), name="test").join()
    assert done == [1]


@pytest.mark.parametrize("method", ["rloo", "grpo"])  # a summed and a token-level loss
def test_sync_run_of_another_method(tmp_path, method, caplog):
    jax.config.update("jax_log_compiles", True)  # on every thread, the compiling one too
    try:
        with caplog.at_level(logging.INFO):
            config = get_config(f"smoke,mode=sync,method={method}")
            summary = train_and_evaluate(config, str(tmp_path))
    finally:
        jax.config.update("jax_log_compiles", False)
    # compiled on a thread beside the first generation, before the first step
    assert_train_step_compiled_once_ahead(caplog.records)
    assert summary["mode"] == "sync" and summary["method"] == method
    assert summary["learner_steps"] == 4
    assert summary["max_policy_lag"] == 0.0  # on-policy: trained right after generation
    assert summary["samples_generated"] == 4 * 4 * 4  # steps × prompts × K


SYNC_CONSTANT_LR = "smoke,mode=sync,optim.schedule=constant,optim.warmup_steps=0"


@pytest.fixture(scope="module")
def straight_sync_params(tmp_path_factory):
    """The params of a sync run trained straight to step 4 (the resumes below end there)."""
    workdir = str(tmp_path_factory.mktemp("straight"))
    train_and_evaluate(get_config(SYNC_CONSTANT_LR + ",steps=4"), workdir)
    return restore_policy(get_config(SYNC_CONSTANT_LR), workdir)[1]


def test_resumed_sync_run_ends_with_the_same_params(tmp_path, straight_sync_params):
    interrupted = str(tmp_path / "interrupted")
    train_and_evaluate(get_config(SYNC_CONSTANT_LR + ",steps=2"), interrupted)
    train_and_evaluate(get_config(SYNC_CONSTANT_LR + ",steps=4"), interrupted)
    _, params_resumed, meta = restore_policy(get_config(SYNC_CONSTANT_LR), interrupted)
    assert meta["policy_version"] == 4
    pairs = zip(jax.tree.leaves(straight_sync_params), jax.tree.leaves(params_resumed), strict=True)
    for a, b in pairs:
        np.testing.assert_array_equal(a, b)


def test_a_run_resumes_in_the_other_params_layout(tmp_path, straight_sync_params):
    from tba_jax.checkpoint import Checkpointer
    from tba_jax.models import unstack_layers
    from tba_jax.runs import PARAMS_STACKED_KEY, stored_experiment

    switched = str(tmp_path / "switched")
    train_and_evaluate(get_config(SYNC_CONSTANT_LR + ",steps=2"), switched)
    # stacked, and decoding with the scanned blocks over a stacked cache (`scan_decode`)
    stacked = ",steps=4,model.scan_layers=True,model.scan_decode=True"
    train_and_evaluate(get_config(SYNC_CONSTANT_LR + stacked), switched)
    model, params_switched, metadata = restore_policy(get_config(SYNC_CONSTANT_LR), switched)
    assert model.config.scan_layers and metadata[PARAMS_STACKED_KEY]
    unstacked = unstack_layers(params_switched)
    assert jax.tree.structure(unstacked) == jax.tree.structure(straight_sync_params)
    pairs = zip(jax.tree.leaves(unstacked), jax.tree.leaves(straight_sync_params), strict=True)
    for got, want in pairs:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    # and back: the stacked step-4 checkpoint resumes per layer
    summary = train_and_evaluate(get_config(SYNC_CONSTANT_LR + ",steps=6"), switched)
    assert summary["learner_steps"] == 6
    with Checkpointer(switched, experiment=stored_experiment(switched)) as checkpointer:
        assert checkpointer.read_metadata(6)[PARAMS_STACKED_KEY] is False
    # a notebook's view samples each checkpoint in its own layout
    view = RunView(switched)
    assert {4, 6} <= set(view.checkpoint_steps)
    for step in (4, 6):
        assert len(view.sample(1, greedy=True, step=step)) == 1


def test_a_failing_searcher_stops_the_run_with_its_error(tmp_path, monkeypatch):
    def broken_task(task_config, workdir, tokenizer=None):
        task = arithmetic_tasks.arithmetic_task(task_config, workdir, tokenizer)

        def failing_rewards(examples, responses):
            if threading.current_thread() is threading.main_thread():  # evaluation
                return task.rewards(examples, responses)
            raise ZeroDivisionError("reward model exploded")

        return tasks.Task(
            task.name, task.train, task.test, task.tokenizer, failing_rewards, task.identity
        )

    monkeypatch.setitem(tasks.base._TASKS, "arithmetic", broken_task)

    def fail_the_test_instead_of_hanging(signum, frame):
        raise TimeoutError("train_and_evaluate hung after a searcher failed")

    previous = signal.signal(signal.SIGALRM, fail_the_test_instead_of_hanging)
    signal.alarm(FAILSAFE_SECONDS)
    try:
        with pytest.raises(RuntimeError, match="searcher thread failed") as raised:
            train_and_evaluate(get_config("smoke"), str(tmp_path))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert isinstance(raised.value.__cause__, ZeroDivisionError)


STEP_FOUR_LINE = "step 4/100000 |"  # the console line of learner step 4


@pytest.mark.parametrize(
    "mode, signum, reason",
    [("sync", signal.SIGTERM, "SIGTERM"), ("async", signal.SIGINT, "Ctrl-C")],
)
def test_a_signal_in_the_loop_saves_and_the_run_resumes(tmp_path, mode, signum, reason):
    workdir = str(tmp_path)
    variant = f"smoke,mode={mode}"
    command = [
        sys.executable,
        os.path.join(REPO_ROOT, "experiments", "train.py"),
        "--config=" + os.path.join(REPO_ROOT, "configs", "arithmetic.py") + ":" + variant,
        "--workdir=" + workdir,
        "--config.learner_steps=100000",
        "--config.checkpoint_every=100000",
    ]
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []  # read as they come: the console logs every 2 steps (smoke's log_every)

    def read() -> None:
        with process.stdout:  # closed once the run's stdout ends
            lines.extend(process.stdout)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.time() + FAILSAFE_SECONDS
    while time.time() < deadline and process.poll() is None:
        if any(STEP_FOUR_LINE in line for line in list(lines)):
            break
        time.sleep(0.2)
    assert process.poll() is None, "".join(lines)[-3000:]
    process.send_signal(signum)
    process.wait(timeout=FAILSAFE_SECONDS)
    reader.join(timeout=FAILSAFE_SECONDS)
    output = "".join(lines)
    assert process.returncode == 128 + signum, output[-3000:]  # stopped, as a shell says
    assert f"{reason}: stopped and saved" in output and "Traceback" not in output, output[-3000:]
    saved = os.listdir(os.path.join(workdir, "checkpoints"))
    assert not any("tmp" in name for name in saved)  # no half-written save left behind
    stopped_at = max(int(name) for name in saved if name.isdigit())
    assert 3 <= stopped_at < 100000
    restore_policy(get_config(variant), workdir)  # the saved step restores
    summary = train_and_evaluate(get_config(f"{variant},steps={stopped_at + 2}"), workdir)
    assert summary["learner_steps"] == stopped_at + 2


@pytest.mark.parametrize("method", ["tb", "grpo"])  # a summed and a token-level loss
def test_the_precompiled_batch_is_shaped_as_the_buffers_batches(method):
    from tba_jax.sources import make_replay_buffer
    from tba_jax.train import batch_arrays, batch_spec
    from tba_jax.trajectories import Trajectory

    config = get_config(f"smoke,method={method}")
    buffer = make_replay_buffer(config, pad_id=0)  # the run's own buffer
    for prompt_id in range(config.batch.prompts_per_batch):
        for length in range(1, config.batch.samples_per_prompt + 1):
            buffer.add(
                [
                    Trajectory.sampled(
                        prompt_id=prompt_id,
                        prompt_tokens=np.arange(3, dtype=np.int32),
                        response_tokens=np.arange(length, dtype=np.int32),
                        token_logp_behaviour=np.full(length, -0.5, np.float32),
                        token_logp_ref=np.full(length, -0.7, np.float32),
                        reward=1.0,
                        policy_version=0,
                        created_at=0.0,
                    )
                ]
            )
    sampled = buffer.sample(
        config.batch.prompts_per_batch, config.batch.samples_per_prompt, np.random.default_rng(0)
    )
    spec = batch_spec(config, sharding=None)
    fields = batch_arrays(config, sampled)
    assert {name: (v.shape, v.dtype) for name, v in spec.items()} == {
        name: (v.shape, v.dtype) for name, v in fields.items()
    }
    # VinePPO's advantages are attached after sampling: its step compiles on first use
    assert batch_spec(get_config("smoke,method=vineppo"), sharding=None) is None
