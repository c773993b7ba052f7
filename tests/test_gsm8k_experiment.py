"""The GSM8K experiment: the task, configs/gsm8k_rho1b.py, its tiny variant end to end
(async and sync, on the real GSM8K files) and experiments/evaluate.py on the run."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support import GSM8K_DIR, requires_gsm8k, save_tiny_llama_folder

from configs.gsm8k_rho1b import get_config
from tba_jax import tasks
from tba_jax.config_lib import ConfigError, validate
from tba_jax.learner import make_lr_schedule
from tba_jax.metrics import read_scalars
from tba_jax.models.tokenizers import TEXT_ALPHABET, CharTokenizer
from tba_jax.runs import optim_config
from tba_jax.train import train_and_evaluate

REPO_ROOT = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 300
TINY_STEPS = 4


# ------------------------------------------------------------------ the paper's config


def test_paper_config_has_the_papers_hyper_parameters():
    config = get_config()
    assert config.task.name == "gsm8k" and config.method == "tb" and config.mode == "async"
    assert config.batch.samples_per_prompt == 20  # K
    assert config.batch.samples_generated_per_prompt == 24  # S
    assert config.replay.recency_prob == 0.95  # m
    assert config.replay.draw_rule == "authors"  # their src/buffer_utils.py
    assert config.sync_period == 2  # k
    assert config.batch.prompts_per_batch == 7  # 7 prompts × 20 per step
    assert config.optim.learning_rate == 1e-5 and config.optim.schedule == "wsd"
    assert config.sampling.temperature == 0.7
    assert (config.loss.beta_schedule, config.loss.beta_start, config.loss.beta_end) == (
        "linear",
        0.014,  # the authors' launch script (their yml's default: 0.012)
        0.004,
    )
    assert (config.loss.beta_anneal_steps, config.loss.beta_cut_steps) == (500, 500)
    assert config.learner_steps == 700  # the launch script's 98,000 episodes
    assert config.max_response_len == 512 and config.eval.max_new_tokens == 512
    assert config.model.preset == "rho-1b" and config.warm_start.steps == 0


def test_paper_learning_rate_warms_up_stays_then_decays_as_the_authors_ran_it():
    lr = make_lr_schedule(optim_config(get_config()))

    def authors(step: int) -> float:  # warmup 50, stable 350, a 600-step decay to 0
        if step < 50:
            return 1e-5 * step / 50
        return 1e-5 * (1 - max(step - 400, 0) / 600)

    for step in (0, 25, 50, 200, 400, 450, 550, 650, 699, 700):
        assert float(lr(step)) == pytest.approx(authors(step), rel=1e-5, abs=1e-12), step


@pytest.mark.parametrize("num_devices", [1, 2, 4, 8])
def test_paper_config_validates_on_one_host(num_devices):
    validate(get_config(), num_devices=num_devices)


def test_reference_follows_the_policy_checkpoint_unless_set():
    assert get_config("hf_path=/ckpt/sft").reference.hf_path == "/ckpt/sft"
    both = get_config("reference.hf_path=/ckpt/ref,hf_path=/ckpt/sft")
    assert (both.model.hf_path, both.reference.hf_path) == ("/ckpt/sft", "/ckpt/ref")
    assert get_config("max_prompt_len=300").task.max_prompt_len == 300


def test_paper_config_without_a_checkpoint_stops_with_the_flag_to_pass(tmp_path):
    with pytest.raises(ConfigError, match=r"--config\.model\.hf_path=/path/to/rho-1b-sft"):
        train_and_evaluate(get_config(), str(tmp_path))
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "data").exists()


def test_a_manual_dir_that_does_not_exist_leaves_no_new_workdir(tmp_path):
    workdir = tmp_path / "new" / "run"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train_and_evaluate(get_config(f"tiny,manual_dir={tmp_path / 'nowhere'}"), str(workdir))
    assert os.listdir(tmp_path) == []  # neither the run's folder nor the one above it


# ---------------------------------------------------------------------------- the task


def test_char_tokenizer_covers_printable_ascii_and_newline():
    tokenizer = CharTokenizer.for_text()
    text = "[MATH TASK] Problem:\nA $1,000.50 ~ {x} = 3/4?\n#### 72"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.vocab_size == 3 + 95 + 1  # pad, bos, eos; " ".."~"; newline


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """One prepared copy of GSM8K for every run in this module."""
    return str(tmp_path_factory.mktemp("gsm8k_data"))


def tiny_variant(data_dir: str, extra: str = "") -> str:
    return f"tiny,manual_dir={GSM8K_DIR},task.data_dir={data_dir}" + extra


def first_fitting_ids(
    split: str, max_prompt_chars: int, max_solution_chars: int, limit: int | None = None
):
    """An independent reading of the source file: ids of the first `limit` problems (None:
    all) whose prompt (and, when max_solution_chars > 0, answer + EOS) fit as printable
    ASCII characters."""
    allowed = set(TEXT_ALPHABET)
    ids = []
    lines = (GSM8K_DIR / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
    for index, record in enumerate(map(json.loads, lines)):
        prompt = f"[MATH TASK] Problem:\n{record['question']}\n\nSolution:\n"
        solution_ok = not max_solution_chars or (
            set(record["answer"]) <= allowed and len(record["answer"]) + 1 <= max_solution_chars
        )
        if set(prompt) <= allowed and len(prompt) <= max_prompt_chars and solution_ok:
            ids.append(index)
    return ids[:limit]


@requires_gsm8k
def test_tiny_task_keeps_the_first_problems_that_fit(data_dir):
    config = get_config(tiny_variant(data_dir))
    task = tasks.build_task(config.task, "/unused")
    assert [ex["id"] for ex in task.train] == first_fitting_ids("train", 160, 128, 32)
    assert [ex["id"] for ex in task.test] == first_fitting_ids("test", 160, 0, 8)
    assert all(ex["solution"] == ex["answer"] for ex in task.train)
    # The worked answers earn the reward; another problem's answer does not.
    answers = [ex["answer"] for ex in task.train[:4]]
    np.testing.assert_array_equal(task.rewards(task.train[:4], answers), [1.0] * 4)
    assert task.rewards(task.train[:1], [task.train[1]["answer"]])[0] == 0.0
    assert task.identity == tasks.task_identity(config.task)
    assert "manual_dir" not in task.identity and "data_dir" not in task.identity


@requires_gsm8k
def test_paper_task_uses_the_checkpoint_tokenizer_it_is_given(data_dir):
    config = get_config(f"manual_dir={GSM8K_DIR},task.data_dir={data_dir},task.num_train=4")
    given = CharTokenizer.for_text()  # standing in for the checkpoint's
    task = tasks.build_task(config.task, "/unused", tokenizer=given)
    assert task.tokenizer is given
    assert [ex["id"] for ex in task.train] == first_fitting_ids("train", 256, 0, 4)
    assert [ex["id"] for ex in task.test] == first_fitting_ids("test", 256, 0)


@requires_gsm8k
def test_prompt_limits_nothing_fits_is_a_clear_error(data_dir):
    config = get_config(tiny_variant(data_dir, ",max_prompt_len=20"))
    with pytest.raises(ConfigError, match=r"GSM8K train \(prompt <= 20 tokens.*no example fits"):
        tasks.build_task(config.task, "/unused")


# ------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, data_dir):
    workdir = str(tmp_path_factory.mktemp("gsm8k_async"))
    return workdir, train_and_evaluate(get_config(tiny_variant(data_dir)), workdir)


@requires_gsm8k
def test_tiny_variant_trains_async_end_to_end(async_run):
    workdir, summary = async_run
    assert summary["config_name"] == "gsm8k_rho1b" and summary["mode"] == "async"
    assert summary["learner_steps"] == TINY_STEPS
    assert summary["samples_generated"] >= 2 * 4  # at least one batch of B × K
    assert 0.0 <= summary["eval_accuracy_start"] <= 1.0
    assert 0.0 <= summary["eval_accuracy_end"] <= 1.0
    losses = read_scalars(os.path.join(workdir, "tensorboard"))["loss"]
    assert [step for step, _ in losses] == list(range(1, TINY_STEPS + 1))
    assert all(np.isfinite(value) for _, value in losses)


@requires_gsm8k
def test_tiny_variant_trains_sync_end_to_end(tmp_path, data_dir):
    summary = train_and_evaluate(get_config(tiny_variant(data_dir, ",mode=sync")), str(tmp_path))
    assert summary["mode"] == "sync" and summary["learner_steps"] == TINY_STEPS
    assert summary["samples_generated"] == TINY_STEPS * 2 * 4  # steps × prompts × K
    assert summary["max_policy_lag"] == 0.0


HF_VOCAB_SIZE = 400
HF_MAX_POSITIONS = 512
HF_CORPUS_PROBLEMS = 300


def make_hf_folder(folder: Path) -> str:
    """A small random Llama with a byte-level BPE tokenizer trained on GSM8K text: the
    shape of the paper-scale run (policy, tokenizer and π_ref from one HF folder)."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    lines = (GSM8K_DIR / "train.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines[:HF_CORPUS_PROBLEMS]]
    return save_tiny_llama_folder(
        folder,
        [r["question"] + r["answer"] for r in records],
        vocab_size=HF_VOCAB_SIZE,
        max_position_embeddings=HF_MAX_POSITIONS,
    )


@requires_gsm8k
def test_tiny_variant_from_a_checkpoint_folder_like_the_paper(tmp_path, data_dir):
    folder = make_hf_folder(tmp_path / "hf")
    # As at paper scale: policy and tokenizer from hf_path, no warm start, π_ref follows.
    extra = f",hf_path={folder},task.tokenizer=checkpoint,warm_start.steps=0"
    config = get_config(tiny_variant(data_dir, extra + ",task.max_solution_len=0,mode=sync"))
    assert config.reference.hf_path == folder
    workdir = tmp_path / "run"
    summary = train_and_evaluate(config, str(workdir))
    assert summary["learner_steps"] == TINY_STEPS and summary["samples_generated"] > 0
    experiment = json.loads((workdir / "checkpoints" / "experiment.json").read_text())
    assert experiment["policy_init"] == folder and experiment["reference"] == folder


def run_evaluate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "experiments" / "evaluate.py"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=SUBPROCESS_TIMEOUT_S,
    )


def files_written(result: subprocess.CompletedProcess) -> list[str]:
    """The files evaluate.py says it wrote (its last stdout line)."""
    return json.loads(result.stdout.strip().splitlines()[-1])["files"]


@pytest.fixture(scope="module")
def default_evaluation(async_run):
    """The run's default evaluation (its latest step, no flags), run once."""
    workdir, _ = async_run
    result = run_evaluate(f"--workdir={workdir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir, result


@requires_gsm8k
def test_evaluate_writes_greedy_and_sampled_metrics_of_a_run(default_evaluation):
    workdir, result = default_evaluation
    latest_default = os.path.join(workdir, "eval.json")
    assert files_written(result) == [os.path.join(workdir, "evals", "step_4.json"), latest_default]
    with open(latest_default) as f:
        metrics = json.load(f)
    assert metrics["settings_id"] == "default" and metrics["settings"]["config_changes"] == {}
    assert metrics["config_name"] == "gsm8k_rho1b" and metrics["task"] == "gsm8k"
    assert metrics["step"] == TINY_STEPS and metrics["num_problems"] == 8
    assert metrics["max_new_tokens"] == 128 and metrics["num_samples"] == 4  # the tiny eval
    for key in ("greedy_pass@1", "pass@1", "pass@2", "pass@4"):
        assert 0.0 <= metrics[key] <= 1.0
    assert metrics["pass@1"] <= metrics["pass@2"] <= metrics["pass@4"]
    assert 0 < metrics["greedy_response_length"] <= 128
    assert 0 < metrics["sampled_response_length"] <= 128


@requires_gsm8k
def test_evaluate_flags_pick_the_checkpoint_samples_and_output(async_run, tmp_path):
    workdir, _ = async_run
    out = tmp_path / "greedy.json"
    checkpoint = os.path.join(workdir, "checkpoints", "2")  # the folder, as the issue names it
    flags = ["--num_samples=0", "--max_new_tokens=16", f"--out={out}"]
    result = run_evaluate(f"--checkpoint={checkpoint}", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(out.read_text())
    assert metrics["step"] == 2 and metrics["policy_version"] == 2
    assert metrics["max_new_tokens"] == 16 and metrics["greedy_response_length"] <= 16
    assert not [key for key in metrics if key.startswith("pass@")]


@requires_gsm8k
def test_evaluate_of_another_step_or_settings_replaces_no_other_file(default_evaluation):
    workdir, _ = default_evaluation
    evals = Path(workdir) / "evals"
    latest_default = json.loads((Path(workdir) / "eval.json").read_text())
    older = run_evaluate(f"--checkpoint={os.path.join(workdir, 'checkpoints', '2')}")
    assert older.returncode == 0, older.stderr[-3000:]
    assert files_written(older) == [str(evals / "step_2.json")]  # not eval.json
    other = run_evaluate(f"--workdir={workdir}", "--num_samples=0", "--max_new_tokens=16")
    assert other.returncode == 0, other.stderr[-3000:]
    [other_file] = [os.path.basename(path) for path in files_written(other)]
    assert re.fullmatch(r"step_4_[0-9a-f]{8}\.json", other_file)  # step and settings id
    for name, step in (("step_2.json", 2), ("step_4.json", 4), (other_file, 4)):
        assert json.loads((evals / name).read_text())["step"] == step
    settings = json.loads((evals / other_file).read_text())["settings"]
    assert settings["num_samples"] == 0 and settings["max_new_tokens"] == 16
    # eval.json is still the default evaluation of the latest step.
    assert json.loads((Path(workdir) / "eval.json").read_text()) == latest_default
    assert json.loads((evals / "step_4.json").read_text()) == latest_default


@requires_gsm8k
def test_evaluate_reports_bad_settings_in_one_line(async_run):
    workdir, _ = async_run
    result = run_evaluate(f"--workdir={workdir}", "--num_samples=2", "--ks=1,4")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith("error: ks=[1, 4] must be")
    assert "Traceback" not in result.stderr
