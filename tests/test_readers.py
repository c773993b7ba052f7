"""What reads a run's workdir (tba_jax.runs, RunView, experiments/evaluate.py and
export_hf.py) on workdirs that are not a finished, intact run: an export never lands in a
run, a config.json that is not a run's is named as such, a run still training is read past
the checkpoints it removes meanwhile, an unreadable checkpoint's error names the caller's
own step flag and the other steps, and a run stopped in its warm start is told to go on.

One smoke run (checkpoints 2 and 4) is trained in process; each test reads a copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from configs.arithmetic import get_config
from experiments import evaluate, export_hf
from tba_jax import runs, train
from tba_jax.checkpoint import Checkpointer, CheckpointUnreadableError
from tba_jax.config_lib import ConfigError
from tba_jax.run_view import RunView

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = [2, 4]  # the smoke run's checkpoints
# the first entries of an exported model's config.json: what `load_config` must refuse
EXPORTED_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("readers") / "run")
    train.train_and_evaluate(get_config("smoke"), workdir)
    assert steps_saved(workdir) == STEPS
    return workdir


@pytest.fixture
def run_copy(finished_run, tmp_path):
    """A copy of the finished run that a test may break."""
    workdir = str(tmp_path / "run")
    shutil.copytree(finished_run, workdir)
    return workdir


@pytest.fixture
def run_in_progress(run_copy, monkeypatch):
    """The copy as a run still training (no summary.json), read without waiting between
    tries."""
    os.remove(os.path.join(run_copy, runs.SUMMARY_FILENAME))
    monkeypatch.setattr(runs, "READ_RETRY_S", 0.0)
    return run_copy


def steps_saved(workdir: str) -> list[int]:
    return sorted(int(name) for name in os.listdir(f"{workdir}/checkpoints") if name.isdigit())


def checkpoint_folder(workdir: str, step: int) -> str:
    return os.path.join(workdir, "checkpoints", str(step))


def recorded_reads(monkeypatch, pruned_step: int | None = None) -> list[int]:
    """The steps the policy is read from, in order (a list that fills as they are read);
    the first read of checkpoint `pruned_step` finds it removed, as the trainer's
    keep_checkpoints does while a reader opens it."""
    original, reads = Checkpointer.restore_subset, []

    def restore_subset(checkpointer, *, template, step):
        reads.append(step)
        if step == pruned_step and reads.count(step) == 1:
            shutil.rmtree(checkpoint_folder(checkpointer.workdir, step))
        return original(checkpointer, template=template, step=step)

    monkeypatch.setattr(Checkpointer, "restore_subset", restore_subset)
    return reads


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def folder_contents(folder: str) -> dict[str, bytes]:
    """Each file under `folder` (by its path there) and its bytes."""
    paths = (os.path.join(root, name) for root, _, names in os.walk(folder) for name in names)
    return {os.path.relpath(path, folder): read_bytes(path) for path in paths}


# ---------------------------------------------------------------- export never lands in a run


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("kept", ["checkpoints", "config.json"])
def test_export_refuses_another_runs_workdir(finished_run, tmp_path, kept, overwrite):
    """Even with --overwrite: it would replace that run's config.json."""
    victim = tmp_path / "victim"
    victim.mkdir()
    source = os.path.join(finished_run, kept)
    copy = shutil.copytree if os.path.isdir(source) else shutil.copy
    copy(source, victim / kept)
    before = folder_contents(str(victim))
    with pytest.raises(ConfigError, match=r"is the workdir of a training run") as refused:
        export_hf.export_run(finished_run, str(victim), overwrite=overwrite)
    assert "--overwrite" not in str(refused.value) and "\n" not in str(refused.value)
    assert folder_contents(str(victim)) == before


@pytest.mark.parametrize("inside", ["checkpoints", "hf", "checkpoints/new"])
def test_export_refuses_a_folder_inside_a_runs_workdir(run_copy, inside):
    before = folder_contents(run_copy)
    out = os.path.join(run_copy, inside)
    with pytest.raises(ConfigError, match=r"lies inside the workdir of a training run"):
        export_hf.export_run(run_copy, out, overwrite=True)
    assert folder_contents(run_copy) == before


def test_an_export_is_not_taken_for_a_run(finished_run, tmp_path):
    """A folder holding an earlier export (its config.json is a model's) is replaced with
    --overwrite, and read as a run by nothing."""
    out = str(tmp_path / "exported")
    export_hf.export_run(finished_run, out)
    assert not runs.holds_a_run(out)
    summary = export_hf.export_run(finished_run, out, overwrite=True)
    assert "config.json" in summary["files"]
    with pytest.raises(FileNotFoundError, match=r"config.json is not a training run's config"):
        runs.load_config(out)
    with pytest.raises(FileNotFoundError, match=r"is not the workdir of a tba_jax training run"):
        RunView(out)


def test_a_bucket_url_is_not_read_as_a_local_folder():
    with pytest.raises(FileNotFoundError, match=r"^gs://b/run is a URL: .* mount the bucket"):
        runs.load_config("gs://b/run")


def test_the_launchers_name_a_config_json_that_is_not_a_runs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(EXPORTED_CONFIG))
    for script, args in [
        ("evaluate.py", []),
        ("export_hf.py", [f"--out={tmp_path / 'out'}"]),
    ]:
        result = subprocess.run(
            [sys.executable, f"{REPO_ROOT}/experiments/{script}", f"--workdir={tmp_path}", *args],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": REPO_ROOT},
            timeout=120,
        )
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and "is not a training run's config" in last


# ---------------------------------------------------------------- a run still training


def test_the_latest_checkpoint_removed_while_read_is_read_at_the_new_latest(
    run_in_progress, tmp_path, monkeypatch
):
    """evaluate.py and export_hf.py read the run's newest checkpoint: one the trainer removes
    as the read begins (keep_checkpoints) is read again at the newest there is then."""
    reads = recorded_reads(monkeypatch, pruned_step=4)
    summary = export_hf.export_run(run_in_progress, str(tmp_path / "exported"))
    assert reads == [4, 2] and summary["files"]

    shutil.copytree(checkpoint_folder(run_in_progress, 2), checkpoint_folder(run_in_progress, 4))
    reads = recorded_reads(monkeypatch, pruned_step=4)
    config = runs.load_config(run_in_progress)
    settings = runs.eval_settings(config, {"num_samples": 0, "num_examples": 2})
    identified = []

    def identify(step):
        identified.append(step)
        return evaluate.eval_identity(config, config, settings, step)

    result = evaluate.evaluate_run(config, run_in_progress, None, settings, identify)
    assert reads == [4, 2] and identified == [2] and result["step"] == 2


def test_an_asked_for_step_removed_while_read_is_named_as_removed(run_in_progress, monkeypatch):
    reads = recorded_reads(monkeypatch, pruned_step=2)
    with (
        runs.steps_picked_with("--step"),
        pytest.raises(FileNotFoundError, match=r"Checkpoint 2 .* was removed while it was read"),
    ):
        runs.restore_run(runs.load_config(run_in_progress), run_in_progress, 2)
    assert reads == [2]


def test_a_view_of_a_run_in_progress_still_reads_past_removed_checkpoints(
    run_in_progress, monkeypatch
):
    """RunView reads as the tools do (runs.read_checkpoint)."""
    reads = recorded_reads(monkeypatch, pruned_step=4)
    view = RunView(run_in_progress)
    assert view.policy().metadata["policy_version"] == 2 and reads == [4, 2]
    assert view.checkpoint_steps == [2]


# ---------------------------------------------------------------- unreadable checkpoints


def truncate_params(workdir: str, step: int) -> None:
    """Cuts every data file of checkpoint `step`'s train state in half. (Cutting only the
    largest left the params readable in about one run in three: which arrays share a
    file depends on the order orbax's writes happen to finish in.)"""
    folder = os.path.join(checkpoint_folder(workdir, step), "train_state")
    for root, _, names in os.walk(folder):
        if os.path.basename(root) != "d":  # ocdbt's data files
            continue
        for name in names:
            path = os.path.join(root, name)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("flag", ["--step", "--checkpoint_step"])
def test_an_unreadable_checkpoint_names_the_callers_step_flag(run_copy, monkeypatch, flag):
    """A finished run's truncated checkpoint is read once, and the error tells to pass
    another step as the launcher's own flag."""
    truncate_params(run_copy, 4)
    reads = recorded_reads(monkeypatch)
    with (
        runs.steps_picked_with(flag),
        pytest.raises(CheckpointUnreadableError, match=r"truncated") as unreadable,
    ):
        runs.restore_run(runs.load_config(run_copy), run_copy, None)
    assert str(unreadable.value).endswith(f"The other saved steps: [2]; pass one as {flag}.")
    assert reads == [4]


def test_a_checkpoint_without_its_metadata_file_is_unreadable_naming_the_others(run_copy):
    os.remove(os.path.join(checkpoint_folder(run_copy, 4), "metadata", "metadata"))
    with pytest.raises(CheckpointUnreadableError, match=r"other saved steps: \[2\]"):
        runs.restore_run(runs.load_config(run_copy), run_copy, 4)
    runs.restore_run(runs.load_config(run_copy), run_copy, 2)  # the other step restores


# ---------------------------------------------------------------- the run's execution knobs


def test_a_restored_policy_computes_with_its_runs_execution_knobs(finished_run):
    """The checkpoint's identity leaves the execution knobs out; `restore_run` (evaluate.py,
    RunView, restore_policy) takes them from the run's config."""
    config = runs.load_config(finished_run)
    config.model.attention, config.model.logprob_chunk = "dot_product", 4
    model_cfg = runs.restore_run(config, finished_run).model.config
    assert (model_cfg.attention, model_cfg.logprob_chunk) == ("dot_product", 4)


def test_another_platforms_kernels_are_read_here_as_the_same_attention(finished_run, caplog):
    config = runs.load_config(finished_run)
    config.model.attention, config.model.decode_attention = "cudnn", "pallas"
    config.model.decode_mlp = config.model.decode_projection = "pallas"
    gpu = runs.runnable_execution_fields(config, backend="gpu")
    kernel_keys = ("attention", "decode_attention", "decode_mlp", "decode_projection")
    assert tuple(gpu[key] for key in kernel_keys) == ("cudnn", "pallas", "pallas", "pallas")
    with caplog.at_level("WARNING"):
        model_cfg = runs.restore_run(config, finished_run).model.config
    kernels = tuple(getattr(model_cfg, key) for key in kernel_keys)
    assert kernels == ("dot_product", "same", "same", "same")
    assert "model.attention=cudnn, which needs a GPU; reading it on cpu" in caplog.text
    assert "model.decode_attention=pallas, which needs a GPU" in caplog.text
    assert "model.decode_mlp=pallas, which needs a GPU" in caplog.text
    assert "model.decode_projection=pallas, which needs a GPU" in caplog.text
    config.model.decode_mlp = config.model.decode_projection = "same"
    # a TPU run's splash attention, read on a GPU
    config.model.attention, config.model.decode_attention = "splash", "same"
    assert runs.runnable_execution_fields(config, backend="tpu")["attention"] == "splash"
    assert runs.runnable_execution_fields(config, backend="gpu")["attention"] == "dot_product"
    assert "model.attention=splash, which needs a TPU; reading it on gpu" in caplog.text


# ---------------------------------------------------------------- a run stopped in its warm start


def test_a_run_stopped_in_its_warm_start_is_told_to_go_on(finished_run, tmp_path):
    workdir = tmp_path / "stopped"
    (workdir / "checkpoints").mkdir(parents=True)
    shutil.copy(os.path.join(finished_run, "config.json"), workdir)
    shutil.copy(
        os.path.join(finished_run, "checkpoints", "experiment.json"), workdir / "checkpoints"
    )
    (workdir / runs.WARM_START_SUBDIR).mkdir()
    (workdir / runs.WARM_START_SUBDIR / "progress.json").write_text('{"steps_done": 2}')
    config = runs.load_config(str(workdir))
    told = pytest.raises(FileNotFoundError, match=r"stopped during its warm start.*to go on")
    with told:
        evaluate.latest_checkpoint_step(config, str(workdir))
    with told:
        export_hf.export_run(str(workdir), str(tmp_path / "out"))
    os.remove(workdir / "checkpoints" / "experiment.json")
    with told:
        runs.restore_run(config, str(workdir))


def test_a_checkpoint_folder_gives_its_workdir_and_step(tmp_path):
    """evaluate.py's and export_hf.py's --checkpoint, beside --workdir and --checkpoint_step."""
    folder = tmp_path / "run" / "checkpoints" / "40"
    folder.mkdir(parents=True)
    assert runs.run_and_step(None, str(folder), None) == (str(tmp_path / "run"), 40)
    assert runs.run_and_step(str(tmp_path / "run"), str(folder) + "/", 40)[1] == 40
    assert runs.run_and_step("/w", None, 3) == ("/w", 3)
    with pytest.raises(ConfigError, match="Pass --workdir"):
        runs.run_and_step(None, None, None)
    with pytest.raises(ConfigError, match="is not a checkpoint folder"):
        runs.run_and_step(None, str(tmp_path / "run"), None)
    with pytest.raises(ConfigError, match="is not in --workdir"):
        runs.run_and_step(str(tmp_path / "other"), str(folder), None)
    with pytest.raises(ConfigError, match="is step 40, not 20"):
        runs.run_and_step(None, str(folder), 20)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        runs.run_and_step(None, str(tmp_path / "run" / "checkpoints" / "41"), None)
