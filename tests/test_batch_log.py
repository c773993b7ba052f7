"""Replayable runs: the learner's batch log (tba_jax.batch_log) and its replay
(tba_jax.batch_replay).

One recorded async smoke run (warm start skipped) is stopped after its last step was
recorded but before that step's checkpoint, and resumed: the replay through the learner
alone must reproduce its params bit for bit, and a tampered batch must be named as the
first divergence. The log's own bookkeeping is tested without a run.
"""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.arithmetic import get_config
from tba_jax import batch_log, batch_replay
from tba_jax.config_lib import ConfigError, validate
from tba_jax.train import train_and_evaluate

RECORDED = "smoke,warm_start.steps=0,record_learner_batches=True"


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    """A recorded 4-step async run whose step-4 checkpoint was lost (as if killed after
    recording step 4), with a stale step 5 left in its log, then resumed from step 2."""
    workdir = str(tmp_path_factory.mktemp("recorded"))
    train_and_evaluate(get_config(RECORDED), workdir)
    log = batch_log.log_dir(workdir)
    shutil.rmtree(os.path.join(workdir, "checkpoints", "4"))
    shutil.copy(batch_log.step_path(log, 1), batch_log.step_path(log, 5))
    train_and_evaluate(get_config(RECORDED), workdir)  # resumes from 2, redoes 3 and 4
    return workdir


@pytest.fixture(scope="module")
def bench(recorded_run):
    with batch_replay.ReplayBench.build(recorded_run) as bench:
        yield bench


def test_a_resumed_async_run_replays_bit_identically(recorded_run, bench):
    log = batch_log.BatchLogReader(batch_log.log_dir(recorded_run))
    assert log.steps == [1, 2, 3, 4]  # the stale step 5 is gone
    assert [segment.start_step for segment in log.segments] == [0, 2]
    recorded = log.read(3)
    assert recorded.batch["reward"].shape == (16,) and recorded.rows["prompt_ids"].shape == (4,)
    assert set(recorded.rows) == set(batch_log.ROW_FIELDS) and "loss" in recorded.metrics
    report = batch_replay.replay_with(bench)
    assert report.ok, "\n".join(report.lines())
    assert (report.from_step, report.to_step, report.steps_replayed) == (0, 4, 4)
    assert report.checkpoints_compared == [2, 4]
    assert report.lines()[-1].startswith("OK: all 4 steps matched")


def test_a_tampered_batch_is_named_as_the_first_divergence(recorded_run, bench):
    path = batch_log.step_path(batch_log.log_dir(recorded_run), 3)
    with open(path, "rb") as f:
        original = f.read()
    with np.load(path) as data:
        arrays = dict(data)
    arrays["batch.reward"] = arrays["batch.reward"].copy()
    arrays["batch.reward"][0] += 1.0  # one row: TB's loss moves (a shift of all would not)
    try:
        with open(path, "wb") as f:
            np.savez_compressed(f, **arrays)
        report = batch_replay.replay_with(bench)
    finally:
        with open(path, "wb") as f:
            f.write(original)
    assert not report.ok
    assert report.divergence.step == 3 and report.divergence.kind == "fingerprint"
    assert report.checkpoints_compared == [2]  # matched before it
    assert report.divergence.recorded_loss != report.divergence.replayed_loss
    assert any("DIVERGED at learner step 3" in line for line in report.lines())


def test_replay_ranges_are_checked_against_the_workdir(recorded_run, bench):
    assert batch_replay.replay_with(bench, from_step=2, to_step=3).ok
    with pytest.raises(ConfigError, match=r"--from_step=1 has no checkpoint; the run keeps"):
        batch_replay.replay_with(bench, from_step=1)
    with pytest.raises(ConfigError, match=r"recorded steps run to 4 \(recorded: 1-4\)"):
        batch_replay.replay_with(bench, from_step=2, to_step=9)


# ---------------------------------------------------------------------- without a run


def record_steps(writer, steps, params):
    for step in steps:
        batch = {"reward": np.full(4, step, np.float32)}
        rows = {"prompt_ids": np.arange(2)}
        writer.record(step, batch, rows, params, {"loss": np.float32(step)})


def test_resuming_truncates_what_was_recorded_after_the_checkpoint(tmp_path):
    directory, params = str(tmp_path / "log"), {"w": jnp.ones(3)}
    first = batch_log.BatchLogWriter(directory, start_step=0, config={"a": 1}, env={})
    record_steps(first, [1, 2, 3], params)
    first.close()
    resumed = batch_log.BatchLogWriter(directory, start_step=1, config={"a": 2}, env={})
    assert batch_log.recorded_steps(directory) == [1]
    record_steps(resumed, [2], params)
    resumed.flush()
    resumed.close()
    reader = batch_log.BatchLogReader(directory)
    assert reader.steps == [1, 2]
    assert [reader.segment_of(step).config["a"] for step in (1, 2)] == [1, 2]
    step = reader.read(2)
    np.testing.assert_array_equal(step.batch["reward"], np.full(4, 2, np.float32))
    assert step.metrics == {"loss": 2.0} and step.fingerprint.shape == (1, 2)
    batch_log.truncate_after(directory, 0)  # a fresh start in the same workdir
    assert os.listdir(directory) == [batch_log.SEGMENTS_FILENAME]
    assert batch_log.BatchLogReader(directory).segments == []


def test_the_fingerprint_sees_every_bit_and_every_position():
    tree = {"a": jnp.arange(6, dtype=jnp.float32), "b": jnp.ones((2, 2), jnp.bfloat16)}
    base = np.asarray(batch_log.fingerprint(tree))
    bits = jax.lax.bitcast_convert_type(tree["a"], jnp.uint32)
    flipped = jax.lax.bitcast_convert_type(bits.at[3].add(1), jnp.float32)  # one ulp
    swapped = tree["a"][jnp.array([1, 0, 2, 3, 4, 5])]
    for changed in (flipped, swapped):
        other = np.asarray(batch_log.fingerprint({**tree, "a": changed}))
        assert (other[0] != base[0]).any() and (other[1] == base[1]).all()
    assert batch_log.leaf_names(tree) == ["['a']", "['b']"]
    assert np.asarray(jax.jit(batch_log.fingerprint)(tree)).tolist() == base.tolist()


def test_a_workdir_that_did_not_record_says_how_to(tmp_path):
    with pytest.raises(FileNotFoundError, match="record_learner_batches=True"):
        batch_log.BatchLogReader(batch_log.log_dir(str(tmp_path)))


def test_recording_over_several_processes_is_refused():
    config = get_config("smoke,record_learner_batches=True")
    validate(config, num_devices=1)
    with pytest.raises(ConfigError, match="not built for runs over several processes"):
        validate(config, num_devices=2, num_processes=2)


def test_recorded_steps_are_described_as_ranges():
    assert batch_log.describe_steps([1, 2, 3, 7, 8, 10]) == "1-3, 7-8, 10"
    assert batch_log.describe_steps([]) == "none"
