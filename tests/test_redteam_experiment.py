"""The red-teaming experiments end to end on CPU: the `tiny` variants of both configs train a
few steps and experiments/evaluate.py writes their red-teaming metrics; the searcher sweep
runs the GPT-2 setup with 1 and 2 searchers (its runs double as that config's end-to-end
test)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from configs import redteam_gpt2, redteam_llama
from experiments import sweep_searchers
from tba_jax.metrics import read_scalars
from tba_jax.train import train_and_evaluate

REPO_ROOT = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 300
TINY_STEPS = 4
TINY_ATTACKS = 32  # eval.num_attacks of the tiny variants
SWEEP_COUNTS = [1, 2]
EVAL_KEYS = ("toxic_percent", "diversity_all", "diversity_toxic", "mean_toxic_logprob")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """One prepared copy of the seed-prompt fixture for every run in this module."""
    return str(tmp_path_factory.mktemp("redteam_data"))


@pytest.fixture(scope="module")
def gpt2_sweep(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("sweep")
    config = redteam_gpt2.get_config(f"tiny,task.data_dir={data_dir}")
    return root, sweep_searchers.run_sweep(config, str(root), SWEEP_COUNTS, eval_flags=[])


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "experiments" / script), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=SUBPROCESS_TIMEOUT_S,
    )


def check_red_teaming_metrics(metrics: dict, num_attacks: int, max_attack_len: int) -> None:
    """The eval.json keys and how they relate (see tba_jax/tasks/redteam.py)."""
    assert metrics["task"] == "redteam" and metrics["step"] == TINY_STEPS
    assert metrics["num_attacks"] == num_attacks and metrics["responses_per_attack"] == 2
    assert metrics["toxic_percent"] == pytest.approx(100 * metrics["num_toxic"] / num_attacks)
    assert metrics["mean_toxic_logprob"] < 0.0 and 0.0 < metrics["mean_toxicity"] < 1.0
    assert 0.0 < metrics["diversity_all"] <= 2.0
    if metrics["num_toxic"] >= 2:
        assert 0.0 <= metrics["diversity_toxic"] <= 2.0
    else:
        assert metrics["diversity_toxic"] is None
    assert 1 <= metrics["mean_attack_length"] <= max_attack_len
    toxicity = [example["toxicity"] for example in metrics["example_attacks"]]
    assert toxicity == sorted(toxicity, reverse=True) and len(toxicity) == 8


def test_sweep_writes_metrics_and_time_per_searcher_count(gpt2_sweep):
    root, sweep = gpt2_sweep
    assert json.loads((root / sweep_searchers.SWEEP_FILENAME).read_text()) == sweep
    assert sweep["config_name"] == "redteam_gpt2" and sweep["variant"].startswith("tiny")
    assert [run["num_searchers"] for run in sweep["runs"]] == SWEEP_COUNTS
    for run in sweep["runs"]:
        workdir = Path(run["workdir"])
        config = json.loads((workdir / "config.json").read_text())
        assert config["search"]["num_searchers"] == run["num_searchers"]
        metrics = json.loads((workdir / "eval.json").read_text())  # by experiments/evaluate.py
        assert {key: run[key] for key in EVAL_KEYS} == {key: metrics[key] for key in EVAL_KEYS}
        assert run["learner_steps"] == TINY_STEPS and run["num_attacks"] == TINY_ATTACKS
        assert run["wall_seconds"] > run["rl_seconds"] > 0 and run["samples_per_second"] > 0


def test_tiny_gpt2_run_evaluates_to_red_teaming_metrics(gpt2_sweep):
    root, _ = gpt2_sweep
    workdir = root / "searchers_1"
    check_red_teaming_metrics(json.loads((workdir / "eval.json").read_text()), TINY_ATTACKS, 48)
    losses = read_scalars(str(workdir / "tensorboard"))["loss"]
    assert [step for step, _ in losses] == list(range(1, TINY_STEPS + 1))
    assert all(np.isfinite(value) for _, value in losses)


def test_tiny_llama_trains_and_evaluates_with_a_generative_judge(tmp_path, data_dir):
    config = redteam_llama.get_config(f"tiny,task.data_dir={data_dir}")
    summary = train_and_evaluate(config, str(tmp_path))
    assert summary["config_name"] == "redteam_llama" and summary["learner_steps"] == TINY_STEPS
    assert summary["eval_mean_reward_start"] < 0.0  # the greedy attack's mean toxic log-prob
    result = run_script("evaluate.py", f"--workdir={tmp_path}", "--num_samples=16")
    assert result.returncode == 0, result.stderr[-3000:]
    # Not the default number of attacks: its own file, named on evaluate.py's last line.
    [written] = json.loads(result.stdout.strip().splitlines()[-1])["files"]
    assert Path(written).parent == tmp_path / "evals" and not (tmp_path / "eval.json").exists()
    check_red_teaming_metrics(json.loads(Path(written).read_text()), 16, 48)


def test_sweep_cli_reports_a_sync_config_in_one_line(tmp_path):
    config = "--config=configs/redteam_gpt2.py:tiny,mode=sync"
    result = run_script("sweep_searchers.py", config, f"--workdir_root={tmp_path}")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: mode='sync': only async runs use searchers; sweep an async config."
    )
