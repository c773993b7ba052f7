"""The benchmark scripts refuse a bad command line at once, before any work, with one
`error: ...` line on stderr and a non-zero exit status (no traceback, no hang)."""

from __future__ import annotations

import subprocess

import pytest
from support import REPO_ROOT, run_repo_script

ERROR_SECONDS = 60  # imports only: a refusal comes before anything is built or compiled


def error_lines(done: subprocess.CompletedProcess) -> list[str]:
    return done.stderr.strip().splitlines()


@pytest.mark.parametrize(
    "args, problem",
    [
        (
            (),
            "error: name the part to run; usage: bash benchmarks/gpu_report.sh mlp | projection "
            "| qkv | fused PEER | decode PEER",
        ),
        (("foo",), "error: unknown part 'foo'; usage: "),
        (("decode",), "error: decode needs the peer script's path (PEER); usage: "),
        (("fused",), "error: fused needs the peer script's path (PEER); usage: "),
        (("smoke_gsm8k",), "error: smoke_gsm8k needs a GSM8K folder (GSM8K_DIR); usage: "),
    ],
)
def test_gpu_report_without_its_arguments_prints_one_usage_line(args, problem):
    done = subprocess.run(
        ["bash", str(REPO_ROOT / "benchmarks/gpu_report.sh"), *args],
        capture_output=True,
        text=True,
        timeout=ERROR_SECONDS,
    )
    assert done.returncode == 2
    assert len(error_lines(done)) == 1 and error_lines(done)[0].startswith(problem), done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize(
    "flag, problem",
    [
        ("--samples_per_prompt=0", "error: flag --samples_per_prompt=0: 0 is not a positive"),
        ("--prompts_per_call=0", "error: flag --prompts_per_call=0: 0 is not a positive"),
        ("--calls_per_version=0", "error: flag --calls_per_version=0: 0 is not a positive"),
        ("--batch_prompts=0", "error: flag --batch_prompts=0: 0 is not a positive"),
        ("--batch_k=0", "error: flag --batch_k=0: 0 is not a positive"),
        ("--recency_prob=2", "error: flag --recency_prob=2: 2.0 is not a number in the range"),
        ("--draw_rules=newst", "error: --draw_rules=newst: choose from ['authors', 'newest']."),
        ("--sizes=0", "error: --sizes=0: each buffer size must be at least the samples one"),
        ("--sizes=1e4", "error: --sizes=1e4: pass integers"),
    ],
)
def test_replay_scale_refuses_a_bad_flag_in_the_parent_without_hanging(flag, problem):
    done = run_repo_script("benchmarks/replay_scale.py", flag, timeout=ERROR_SECONDS)
    assert done.returncode == 1
    assert len(error_lines(done)) == 1 and error_lines(done)[0].startswith(problem), done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize(
    "flags, problem",
    [
        (["--layers=0"], "error: --layers=0: pass integers >= 1."),
        (["--layers=2,x"], "error: --layers=2,x: pass integers, comma-separated."),
        (["--remat_layers=0"], "error: flag --remat_layers=0: 0 is not a positive integer"),
        (["--chunks=-1"], "error: --chunks=-1: pass integers >= 0."),
        (["--attentions=flash"], "error: --attentions names ['flash']; choose from ['einsum',"),
        (["--attentions=cudnn"], "error: --attentions=cudnn needs a half-precision --dtype"),
    ],
)
def test_learner_compile_refuses_a_bad_flag_before_compiling(flags, problem):
    done = run_repo_script(
        "benchmarks/learner_compile.py", "--smoke", *flags, timeout=ERROR_SECONDS
    )
    assert done.returncode == 1
    assert len(error_lines(done)) == 1 and error_lines(done)[0].startswith(problem), done.stderr
    assert done.stdout == ""


def test_learner_compile_refuses_cudnn_attention_off_a_gpu():
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("a GPU runs the cuDNN kernel")
    done = run_repo_script(
        "benchmarks/learner_compile.py",
        "--smoke",
        "--sweeps=attention",
        "--attentions=einsum,cudnn",
        "--dtype=bfloat16",
        timeout=ERROR_SECONDS,
    )
    assert done.returncode == 1
    assert error_lines(done) == [
        f"error: --attentions=cudnn needs a GPU with cuDNN, and JAX's platform here is "
        f"{jax.default_backend()}; leave cudnn out of --attentions."
    ]
    assert done.stdout == ""


@pytest.mark.parametrize(
    "flags, problem",
    [
        (["--shape=small"], "error: --shape=small is a preset without a vocabulary size; pass"),
        (["--shape=tiny"], "error: --shape=tiny is a preset without a vocabulary size; pass"),
        (["--shape=qwen3"], "error: --shape=qwen3: choose one of ['gpt2',"),
        (
            ["--attention=cudnn", "--dtype=float32"],
            "error: model.attention='cudnn' needs a half-precision compute dtype",
        ),
    ],
)
def test_static_profile_refuses_a_model_it_cannot_build_before_compiling(flags, problem):
    done = run_repo_script("benchmarks/static_profile.py", *flags, timeout=ERROR_SECONDS)
    assert done.returncode == 1
    assert len(error_lines(done)) == 1 and error_lines(done)[0].startswith(problem), done.stderr
    assert done.stdout == ""
