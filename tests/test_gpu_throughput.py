"""benchmarks/gpu_throughput.py at micro size on the CPU: every measurement prints its JSON
line with the figures the README quotes (decode's compile seconds and share of the HBM
roofline, the learner's FLOPs per token and MFU). The figures themselves are not checked:
they are wall-clock times of tiny shapes."""

from __future__ import annotations

import json

import jax
import pytest
from support import run_repo_script

from tba_jax import roofline, train_reward_model
from tba_jax.models import preset

SHAPE = dict(batch=2, prompt=4, new=4)
ARGS = [
    "--shape=micro",
    "--vocab=64",
    "--dtype=float32",
    "--param_dtype=bfloat16",  # decode and score on params of another dtype than compute
    "--layers=2",
    "--scan_decode",
    "--remat=dots_saveable",
    "--attention=dot_product",
    "--decode_mlp=pallas",  # Pallas' interpreter here, inside the scanned decode
    "--decode_mlp_kernel=16:32:16:4:2",
    "--decode_projection=pallas",
    "--decode_projection_kernel=16:16:16:2:4:2",
    "--logprob_chunk=2",
    "--train_prompts=2",
    "--train_k=2",
    "--microbatches=1",
    "--repeats=1",
    "--profile=3",
    "--pairs=2",
    *(f"--{name}={value}" for name, value in SHAPE.items()),
]


def test_micro_run_prints_decode_score_and_learner_lines():
    done = run_repo_script("benchmarks/gpu_throughput.py", *ARGS, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = {
        line["bench"]: line for line in map(json.loads, done.stdout.splitlines()) if "bench" in line
    }
    assert set(lines) == {
        "decode",
        "score",
        "train_step",
        "publish",
        "reward_model_step",
        "decode_profile",
        "score_profile",
        "train_step_profile",
    }
    assert lines["decode_profile"]["kernels"] == 0  # a CPU trace has no device plane
    assert lines["decode_profile"]["note"].endswith("profile on a GPU")  # ...and it says so
    publish = lines["publish"]
    assert publish["share_of_step_percent"] > 0 and publish["step_with_publish_ms"] > 0
    decode = lines["decode"]
    assert decode["layers"] == 2 and decode["scan_layers"] and decode["scan_decode"]
    assert decode["compile_s"] > 0 and decode["tokens_per_s"] > 0
    assert decode["param_dtype"] == lines["score"]["param_dtype"] == "bfloat16"
    assert (decode["decode_mlp"], decode["decode_mlp_kernel"]) == ("pallas", "16:32:16:4:2")
    projection = (decode["decode_projection"], decode["decode_projection_kernel"])
    assert projection == ("pallas", "16:16:16:2:4:2")
    cfg = preset("micro", vocab_size=64, num_layers=2, max_seq_len=8)
    ceiling = roofline.decode_roofline_tokens_per_s(cfg, *SHAPE.values(), 4, 4)
    assert decode["roofline_tokens_per_s"] == pytest.approx(ceiling, rel=1e-3)
    share = 100 * decode["tokens_per_s"] / ceiling
    assert decode["roofline_percent"] == pytest.approx(share, abs=0.051)  # printed to 0.1
    train = lines["train_step"]
    assert (train["remat"], train["attention"], train["logprob_chunk"]) == (
        "dots_saveable",
        "dot_product",
        2,
    )
    assert train["flops_per_token"] == pytest.approx(roofline.train_flops_per_token(cfg, 8))
    peak = roofline.H100_DENSE_BF16_FLOPS
    mfu = 100 * train["tokens_per_s"] * train["flops_per_token"] / peak
    assert train["mfu_percent"] == pytest.approx(mfu, abs=0.051)
    # the reward model's step: 2 pairs of prompt + new tokens, FLOPs of the scalar-head shape
    scored = lines["reward_model_step"]
    assert (scored["pairs"], scored["seq_len"], scored["remat"]) == (2, 8, "dots_saveable")
    scorer = train_reward_model.scalar_score_config(cfg)
    assert scored["flops_per_token"] == pytest.approx(roofline.train_flops_per_token(scorer, 8))
    assert scored["flops_per_token"] < train["flops_per_token"]  # no vocabulary projection
    assert scored["tokens_per_s"] > 0


@pytest.mark.parametrize(
    "flags, problem",
    [
        (
            ["--skip=foo"],
            "error: --skip=foo names ['foo']; choose from ['decode', 'score', 'train'].",
        ),
        (["--shape=qwen3"], "error: --shape=qwen3: choose one of ['gpt2',"),
        (["--shape=small"], "error: --shape=small is a preset without a vocabulary size; pass"),
        (["--shape=tiny"], "error: --shape=tiny is a preset without a vocabulary size; pass"),
        (["--batch=0"], "error: --batch=0 must be >= 1."),
        (["--logprob_chunk=-2"], "error: --logprob_chunk=-2 must be >= 0."),
        (["--profile=-1"], "error: --profile=-1 must be >= 0."),
        (["--decode_mlp_kernel=64:64"], "error: model.decode_mlp_kernel: '64:64' is not block_m"),
        (
            ["--decode_projection_kernel=64:64:64:4:3"],
            "error: model.decode_projection_kernel: '64:64:64:4:3' is not block_m",
        ),
        (
            ["--attention=cudnn", "--dtype=float32"],
            "error: model.attention='cudnn' needs a half-precision compute dtype",
        ),
    ],
)
def test_a_bad_flag_is_one_error_line_before_any_work(flags, problem):
    done = run_repo_script("benchmarks/gpu_throughput.py", *flags, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[0].startswith(problem), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == ""


def test_cudnn_attention_off_a_gpu_is_one_error_line():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU runs the cuDNN kernel")
    done = run_repo_script("benchmarks/gpu_throughput.py", "--attention=cudnn", timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"error: --attention=cudnn needs a GPU with cuDNN, and JAX's platform here is "
        f"{jax.default_backend()}; pass another --attention (dot_product, einsum)."
    ]
