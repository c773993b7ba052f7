"""The learner's batch log (tba_jax.batch_log) without a run: writing, reading, truncation
on resume, the params fingerprint, and where recording is refused. A recorded async run
replayed end to end (tba_jax.batch_replay) is in test_train.py."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.arithmetic import get_config
from tba_jax import batch_log, batch_replay
from tba_jax.config_lib import ConfigError, validate


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


def test_a_divergence_says_whether_the_batch_or_only_the_update_differed():
    report = batch_replay.ReplayReport("/w", from_step=0, to_step=9, steps_replayed=3)
    report.divergence = batch_replay.Divergence(3, "fingerprint", ["['policy']['w']"], 1.5, 1.5)
    lines = report.lines()
    assert lines[1].startswith("DIVERGED at learner step 3: its params fingerprint differs")
    assert "Before it steps 1-2 matched; checkpoints compared: none." in lines[2]
    assert "learner_batches/step_00000003.npz" in lines[2] and "the update differs" in lines[3]
    report.divergence = batch_replay.Divergence(1, "fingerprint", ["['policy']['w']"], 1.5, 2.0)
    lines = report.lines()
    assert "Before it no step matched" in lines[2] and "the batch" in lines[3]
    assert not report.ok
