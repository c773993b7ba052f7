"""benchmarks/paper_smoke.py: the paper runs' overrides (a char tokenizer, the checkpoint's
embedding rows) reach train.py, and a micro-sized TL;DR run prints its JSON line from the
run's summary and scalars. The paper shapes themselves need an accelerator."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest
from support import REPO_ROOT, run_repo_script

from configs import gsm8k_rho1b, tldr_pythia
from tba_jax import cli


def load_script():
    spec = importlib.util.spec_from_file_location(
        "paper_smoke", REPO_ROOT / "benchmarks/paper_smoke.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_variants_build_the_paper_configs_with_real_embedding_rows(tmp_path):
    smoke = load_script()
    args = argparse.Namespace(
        run="gsm8k_rho1b", gsm8k_dir=str(tmp_path), attention="", steps=3, set="sync_period=4"
    )
    run = smoke.RUNS["gsm8k_rho1b"]
    path, _, variant = smoke.variant_string(run, smoke.run_overrides(run, args)).partition(":")
    assert path == "configs/gsm8k_rho1b.py"
    config = gsm8k_rho1b.get_config(variant)
    assert (config.model.preset, config.model.vocab_size) == ("rho-1b", 32_000)
    assert (config.model.attention, config.learner_steps, config.sync_period) == ("cudnn", 3, 4)
    assert config.batch.prompts_per_batch == 7 and config.max_response_len == 512
    args.run = "tldr_pythia_1b"
    run = smoke.RUNS["tldr_pythia_1b"]
    path, _, variant = smoke.variant_string(run, smoke.run_overrides(run, args)).partition(":")
    config = tldr_pythia.get_config(variant)
    assert (config.model.preset, config.model.vocab_size) == ("pythia-1b", 50_304)
    assert config.task.reward_model.preset == "pythia-2.8b"
    args.run = "gsm8k_rho1b"
    args.gsm8k_dir = ""
    with pytest.raises(cli.UsageError, match="needs --gsm8k_dir"):
        smoke.run_overrides(smoke.RUNS["gsm8k_rho1b"], args)


def test_micro_tldr_run_prints_its_step_time_and_rates():
    micro = "model.preset=micro,model.vocab_size=512,model.dtype=float32"
    # the tiny variant's batch shapes and short sequences: the script's path, in seconds
    small = (
        "batch.prompts_per_batch=2,batch.samples_per_prompt=4,"
        "batch.samples_generated_per_prompt=4,batch.num_microbatches=2,replay.min_prompts=2,"
        "search.prompts_per_call=2,search.score_rows_per_chunk=0,max_prompt_len=128,"
        "max_response_len=16"
    )
    done = run_repo_script(
        "benchmarks/paper_smoke.py",
        "--run=tldr_pythia_1b",
        "--steps=2",
        f"--set={micro},task.reward_model.preset=micro,{small}",
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["bench"] == "paper_smoke" and line["steps"] == 2
    assert line["step_s"] > 0 and line["samples_per_s"] > 0 and line["training_s_per_step"] > 0
    assert line["peak_device_gib"] is None  # a CPU reports no device memory
    assert "model.vocab_size=512" in line["config"]


@pytest.mark.parametrize(
    "args, small",
    [
        (["--run=tldr_pythia_1b"], "model.preset=micro,model.vocab_size=512,task.reward_model"),
        (["--run=tldr_pythia_1b", "--set=model.preset=micro"], "model.preset=micro,"),
        (
            ["--run=gsm8k_rho1b", "--gsm8k_dir=."],
            "model.preset=micro,model.vocab_size=512 --attention=dot_product).",
        ),
    ],
)
def test_paper_models_on_a_cpu_are_refused_at_once(args, small, tmp_path):
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("an accelerator runs the paper's models")
    done = run_repo_script("benchmarks/paper_smoke.py", *args, f"--workdir={tmp_path}", timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: {args[0]} trains the paper's models and needs a GPU or TPU")
    assert f"--set={small}" in line
    assert not any(tmp_path.iterdir())  # train.py never started


def test_cudnn_attention_on_a_cpu_is_refused_at_once(tmp_path):
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("an accelerator may have cuDNN")
    small = "--set=model.preset=micro,model.vocab_size=512"
    args = ["--run=gsm8k_rho1b", "--gsm8k_dir=.", small, f"--workdir={tmp_path}"]
    done = run_repo_script("benchmarks/paper_smoke.py", *args, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "error: --attention=cudnn (this run's default unless --attention is given) needs a GPU "
        "with cuDNN, and JAX's platform here is cpu; pass --attention=dot_product."
    ]
    assert not any(tmp_path.iterdir())


def test_a_gsm8k_run_without_its_folder_is_one_error_line():
    done = run_repo_script("benchmarks/paper_smoke.py", "--run=gsm8k_rho1b", timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "error: --run=gsm8k_rho1b needs --gsm8k_dir (train.jsonl, test.jsonl)."
    ]
