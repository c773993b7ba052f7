"""Where experiments/evaluate.py writes: one file per step and settings under <workdir>/evals,
eval.json only for the default evaluation of the latest step, and nothing replaced by an
evaluation of another step or settings (the end-to-end runs are in test_gsm8k_experiment.py)."""

import json
import os

import ml_collections
import pytest

from configs import arithmetic
from experiments import evaluate
from tba_jax import evaluation, runs
from tba_jax.errors import ConfigError

LATEST_STEP = 4
OLDER_STEP = 2


@pytest.fixture(scope="module")
def run_config():
    """A run's config as evaluate.py reads it back from config.json."""
    config = arithmetic.get_config("smoke")
    return ml_collections.ConfigDict(json.loads(config.to_json_best_effort()))


def identity_of(run_config, step, overrides=None, eval_config=None):
    eval_config = eval_config or run_config
    settings = runs.eval_settings(eval_config, overrides)
    return evaluate.eval_identity(run_config, eval_config, settings, step)


def fake_result(identity, accuracy: float) -> dict:
    """What evaluate_run returns, without a model: the identity and one metric."""
    return {"task": "arithmetic", **identity.as_dict(), "greedy_pass@1": accuracy}


def read(path) -> dict:
    with open(path) as f:
        return json.load(f)


# ------------------------------------------------------------------------ settings ids


def test_the_run_config_without_flags_is_the_default_evaluation(run_config):
    identity = identity_of(run_config, LATEST_STEP)
    assert identity.settings_id == evaluate.DEFAULT_SETTINGS_ID
    assert identity.settings["config_changes"] == {}
    assert identity.settings["num_samples"] == runs.FALLBACK_NUM_SAMPLES


def test_flags_equal_to_the_defaults_are_still_the_default_evaluation(run_config):
    default = runs.eval_settings(run_config)
    overrides = {"num_samples": default.num_samples, "ks": default.ks}
    assert identity_of(run_config, 1, overrides).settings_id == evaluate.DEFAULT_SETTINGS_ID


def test_other_flags_get_a_short_stable_hash_id(run_config):
    first = identity_of(run_config, 1, {"num_samples": 4, "ks": (1, 2)})
    again = identity_of(run_config, 1, {"num_samples": 4, "ks": (1, 2)})
    other = identity_of(run_config, 1, {"num_samples": 8, "ks": (1, 2)})
    assert first.settings_id == again.settings_id != other.settings_id
    assert len(first.settings_id) == evaluate.SETTINGS_ID_HEX_DIGITS
    assert int(first.settings_id, 16) >= 0  # hex digits
    assert first.settings["num_samples"] == 4 and first.settings["ks"] == [1, 2]


def test_another_config_records_what_it_changes(run_config):
    other = arithmetic.get_config("smoke,sampling.temperature=0.5")
    identity = identity_of(run_config, 1, eval_config=other)
    assert identity.settings_id != evaluate.DEFAULT_SETTINGS_ID
    # The variant string is a label: only the value it sets counts.
    assert identity.settings["config_changes"] == {"sampling.temperature": 0.5}
    same = arithmetic.get_config("smoke")
    assert identity_of(run_config, 1, eval_config=same).settings_id == "default"


def test_bad_ks_is_a_config_error():
    with pytest.raises(evaluate.ConfigError, match=r"--ks=1,four must be integers"):
        evaluate.parse_ks(["1", "four"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_examples": -1}, r"num_examples=-1 must be >= 0 \(0: all\)"),  # not "all but one"
        ({"max_new_tokens": 0}, r"max_new_tokens=0 must be >= 1"),
        ({"num_samples": -1}, r"num_samples=-1 must be >= 0"),
        ({"num_samples": 4, "ks": (1, 8)}, r"each in \[1, num_samples=4\]"),
    ],
)
def test_settings_that_cannot_work_are_refused_before_anything_is_loaded(
    run_config, overrides, message
):
    with pytest.raises(ConfigError, match=message):
        evaluation.check_settings(runs.eval_settings(run_config, overrides))


# ------------------------------------------------------------------------ files


def test_file_names_say_the_step_and_settings(run_config, tmp_path):
    default = identity_of(run_config, 250)
    other = identity_of(run_config, 250, {"num_samples": 4, "ks": (1,)})
    evals = tmp_path / evaluate.EVALS_SUBDIR
    assert evaluate.eval_path(str(tmp_path), default) == str(evals / "step_250.json")
    expected = evals / f"step_250_{other.settings_id}.json"
    assert evaluate.eval_path(str(tmp_path), other) == str(expected)


def test_evaluations_of_two_steps_and_two_settings_live_side_by_side(run_config, tmp_path):
    workdir = str(tmp_path)
    latest = identity_of(run_config, LATEST_STEP)
    older = identity_of(run_config, OLDER_STEP)
    other = identity_of(run_config, LATEST_STEP, {"num_samples": 4, "ks": (1, 2)})
    for identity, accuracy in ((latest, 0.75), (older, 0.25), (other, 0.5)):
        evaluate.write_result(workdir, None, fake_result(identity, accuracy), LATEST_STEP)
    files = sorted(os.listdir(tmp_path / evaluate.EVALS_SUBDIR))
    assert files == ["step_2.json", "step_4.json", f"step_4_{other.settings_id}.json"]
    for identity, accuracy in ((latest, 0.75), (older, 0.25), (other, 0.5)):
        stored = read(evaluate.eval_path(workdir, identity))
        assert stored["step"] == identity.step and stored["greedy_pass@1"] == accuracy
        assert stored["settings"] == identity.settings
    # eval.json: the default evaluation of the latest step, replaced by neither other one.
    assert read(tmp_path / evaluate.OUT_FILENAME) == fake_result(latest, 0.75)


def test_an_older_step_never_replaces_the_latest_default(run_config, tmp_path):
    workdir, out = str(tmp_path), tmp_path / evaluate.OUT_FILENAME
    latest = identity_of(run_config, LATEST_STEP)
    evaluate.write_result(workdir, None, fake_result(latest, 0.75), LATEST_STEP)
    # Even when the older step is the latest checkpoint left (newer ones removed).
    older = identity_of(run_config, OLDER_STEP)
    written = evaluate.write_result(workdir, None, fake_result(older, 0.25), OLDER_STEP)
    assert written == [evaluate.eval_path(workdir, older)]
    assert read(out)["step"] == LATEST_STEP


def test_a_newer_latest_step_replaces_the_default(run_config, tmp_path):
    workdir, out = str(tmp_path), tmp_path / evaluate.OUT_FILENAME
    older = identity_of(run_config, OLDER_STEP)
    evaluate.write_result(workdir, None, fake_result(older, 0.25), OLDER_STEP)
    assert read(out)["step"] == OLDER_STEP  # the latest step then
    latest = identity_of(run_config, LATEST_STEP)
    evaluate.write_result(workdir, None, fake_result(latest, 0.75), LATEST_STEP)
    assert read(out)["step"] == LATEST_STEP
    assert read(evaluate.eval_path(workdir, older))["step"] == OLDER_STEP


def test_running_the_same_evaluation_again_rewrites_its_own_file(run_config, tmp_path):
    workdir = str(tmp_path)
    identity = identity_of(run_config, LATEST_STEP, {"num_samples": 4, "ks": (1,)})
    path = evaluate.eval_path(workdir, identity)
    evaluate.write_result(workdir, None, fake_result(identity, 0.25), LATEST_STEP)
    evaluate.check_replaceable(path, identity)  # no error: the same evaluation
    evaluate.write_result(workdir, None, fake_result(identity, 0.5), LATEST_STEP)
    assert read(path)["greedy_pass@1"] == 0.5
    assert os.listdir(tmp_path / evaluate.EVALS_SUBDIR) == [os.path.basename(path)]


def test_an_eval_json_from_before_this_layout_is_kept_when_replaced(run_config, tmp_path):
    workdir, out = str(tmp_path), tmp_path / evaluate.OUT_FILENAME
    legacy = {"step": OLDER_STEP, "num_samples": 4, "greedy_pass@1": 0.125}  # no settings
    out.write_text(json.dumps(legacy))
    latest = identity_of(run_config, LATEST_STEP)
    evaluate.write_result(workdir, None, fake_result(latest, 0.75), LATEST_STEP)
    assert read(out)["step"] == LATEST_STEP
    kept = [name for name in os.listdir(tmp_path / "evals") if "unrecorded" in name]
    assert len(kept) == 1 and kept[0].startswith(f"step_{OLDER_STEP}_unrecorded_")
    assert read(tmp_path / "evals" / kept[0]) == legacy


def test_out_refuses_a_file_of_another_step_or_settings(run_config, tmp_path):
    out = str(tmp_path / "mine.json")
    older = identity_of(run_config, OLDER_STEP)
    evaluate.write_result(str(tmp_path), out, fake_result(older, 0.25), LATEST_STEP)
    assert os.listdir(tmp_path) == ["mine.json"]  # --out: only there
    latest = identity_of(run_config, LATEST_STEP)
    message = r"mine.json holds the evaluation of step 2 \(settings default\), not one of step 4"
    with pytest.raises(evaluate.OutputConflictError, match=message):
        evaluate.check_replaceable(out, latest)
    other = identity_of(run_config, OLDER_STEP, {"num_samples": 4, "ks": (1,)})
    with pytest.raises(evaluate.OutputConflictError, match="pass another --out"):
        evaluate.check_replaceable(out, other)


def test_out_refuses_a_file_that_is_not_an_evaluation(run_config, tmp_path):
    config_json = tmp_path / "config.json"
    config_json.write_text(run_config.to_json())
    not_json = tmp_path / "notes.txt"
    not_json.write_text("my notes")
    for path in (config_json, not_json):
        with pytest.raises(evaluate.OutputConflictError, match="something other than an eval"):
            evaluate.check_replaceable(str(path), identity_of(run_config, LATEST_STEP))
