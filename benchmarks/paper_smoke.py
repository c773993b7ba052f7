r"""Paper-scale smoke runs on one accelerator: a few async TB learner steps of a paper config
with random weights of its real shapes, sampler and learner sharing the device.

    python benchmarks/paper_smoke.py --run=tldr_pythia_1b
    python benchmarks/paper_smoke.py --run=gsm8k_rho1b --gsm8k_dir=../shared/data/gsm8k

Each run is `experiments/train.py` on the paper's config with its batch shapes, lengths
and model preset, changed only where no checkpoint or hub is at hand: the task's char
tokenizer (printable ASCII), a random policy of the preset's shape with the checkpoint's
embedding rows (`model.vocab_size`; the sampler draws only the tokenizer's ids, and a
random policy rarely ends early, so responses run to their cap: the slowest case), a short
held-out evaluation, and (TL;DR) a random pythia-2.8b stand-in reward model on the repo's
72-post fixture (`tests/data/tldr_tiny`). `--attention=cudnn` (GSM8K's default: with
einsum attention its learner step alone plans 69 GiB of an H100's 80) also turns off XLA's
CUDA command buffers: on an H100 a cuDNN attention captured into one failed ("cuda graph
end capture ... failed", in the train step) while the searcher thread ran beside it.

Prints one JSON line: steps, wall and RL seconds, the learner-step interval after the
first step (`step_s`: the median of the `rl_seconds` differences, the run's pace with
both roles busy), the training share of the time split per step, samples/s, and the peak
device memory (`summary.json`'s `peak_device_gib`). `--keep` keeps the workdir.

Where JAX has no GPU or TPU, a run of the paper's models (or of cuDNN's attention) is
refused at once in one line; `--set=model.preset=micro,...` (the line says what) runs the
script's path on a CPU with small models.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from tba_jax import cli, metrics  # noqa: E402

TLDR_FIXTURE = os.path.join(REPO_ROOT, "tests", "data", "tldr_tiny")
# Per run: the config (with its named variant), the overrides that stand in for a
# checkpoint and a hub, the attention kernel it runs with by default, and the keys of its
# paper-sized models (without a `--set` of each, the run needs an accelerator).
RUNS = {
    "gsm8k_rho1b": {
        "config": "configs/gsm8k_rho1b.py",
        "overrides": {
            "task.tokenizer": "char",
            "model.vocab_size": 32_000,  # rho-1b's (Llama's) embedding rows
            "eval.num_examples": 32,
            "eval.batch_size": 32,
            "replay.min_prompts": 7,  # one batch's prompts: the first step sooner
        },
        "attention": "cudnn",
        "models": ("model.preset",),
    },
    "tldr_pythia_1b": {
        "config": "configs/tldr_pythia.py:1b",
        "overrides": {
            "task.manual_dir": TLDR_FIXTURE,
            "task.tokenizer": "char",
            "model.vocab_size": 50_304,  # pythia's embedding rows
            "task.reward_model.preset": "pythia-2.8b",
            "task.gold_reward_model.preset": "micro",  # evaluation only
            "eval.num_examples": 16,
            "eval.batch_size": 16,
        },
        "attention": "einsum",
        "models": ("model.preset", "task.reward_model.preset"),
    },
}


def run_overrides(run: dict, args: argparse.Namespace) -> dict:
    """The run's overrides, then the command line's (`--attention`, `--steps`, `--set`)."""
    overrides = dict(run["overrides"])
    if args.run == "gsm8k_rho1b":
        if not args.gsm8k_dir:
            raise cli.UsageError("--run=gsm8k_rho1b needs --gsm8k_dir (train.jsonl, test.jsonl).")
        overrides["task.manual_dir"] = os.path.abspath(args.gsm8k_dir)
    overrides.update(
        {
            "model.attention": args.attention or run["attention"],
            "learner_steps": args.steps,
            "log_every": 1,
            "progress_bar": False,
        }
    )
    for item in filter(None, args.set.split(",")):
        key, _, value = item.partition("=")
        overrides[key] = value
    return overrides


def variant_string(run: dict, overrides: dict) -> str:
    """The config path with its variant: `overrides` after the config's named variant."""
    items = ",".join(f"{key}={value}" for key, value in overrides.items())
    config = run["config"]
    return f"{config},{items}" if ":" in config else f"{config}:{items}"


def jax_backend(env: dict) -> str | None:
    """JAX's platform ("cpu", "gpu", "tpu") as train.py will see it, asked of a short-lived
    process, so that this one holds no accelerator memory beside the run; None if unknown."""
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.default_backend())"],
        env={**env, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = probe.stdout.split()
    return lines[-1] if probe.returncode == 0 and lines else None


def check_accelerator(run: dict, args: argparse.Namespace, overrides: dict, env: dict) -> None:
    """UsageError where JAX has no GPU or TPU for a run of the paper's models (a
    `run["models"]` key `--set` leaves as it is: at full size they do not fit a CPU
    machine's memory, and the kernel stopped train.py with a bare -9) or of cuDNN's
    attention (GSM8K's default)."""
    given = {item.partition("=")[0] for item in args.set.split(",") if item}
    paper_models = not all(key in given for key in run["models"])
    cudnn = overrides["model.attention"] == "cudnn"
    if not (paper_models or cudnn) or jax_backend(env) != "cpu":
        return
    attention = " --attention=dot_product" if cudnn else ""
    if paper_models:
        small = ",".join(["model.preset=micro", "model.vocab_size=512"])
        small += "".join(f",{key}=micro" for key in run["models"] if key != "model.preset")
        raise cli.UsageError(
            f"--run={args.run} trains the paper's models and needs a GPU or TPU, and JAX's "
            "platform here is cpu; run it on an accelerator (or, to try the script on a CPU, "
            f"small models: --set={small}{attention})."
        )
    raise cli.UsageError(
        "--attention=cudnn (this run's default unless --attention is given) needs a GPU with "
        f"cuDNN, and JAX's platform here is cpu; pass{attention}."
    )


def step_seconds(workdir: str) -> float | None:
    """The median interval between learner steps after the first (RL seconds)."""
    scalars = metrics.read_scalars(os.path.join(workdir, "tensorboard"))
    seconds = [value for _, value in sorted(scalars.get("rl_seconds", []))]
    gaps = [later - earlier for earlier, later in itertools.pairwise(seconds)]
    return statistics.median(gaps) if gaps else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, choices=sorted(RUNS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--gsm8k_dir", default="", help="a folder of GSM8K's jsonl files")
    parser.add_argument("--attention", default="", help="model.attention; empty: the run's")
    parser.add_argument("--set", default="", help="more key=value overrides, comma-separated")
    parser.add_argument("--workdir", default="", help="empty: a temporary folder")
    parser.add_argument("--keep", action="store_true", help="keep the workdir")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the run")
    args = parser.parse_args()

    run = RUNS[args.run]
    env = dict(os.environ)
    try:
        overrides = run_overrides(run, args)
        check_accelerator(run, args, overrides, env)
    except cli.UsageError as error:
        cli.exit_with_error(str(error))
    config = variant_string(run, overrides)
    workdir = args.workdir or tempfile.mkdtemp(prefix=f"{args.run}_")
    if overrides["model.attention"] == "cudnn":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    command = [
        sys.executable,
        os.path.join(REPO_ROOT, "experiments", "train.py"),
        f"--config={os.path.join(REPO_ROOT, config)}",
        f"--workdir={workdir}",
    ]
    try:
        done = subprocess.run(command, env=env, cwd=REPO_ROOT, timeout=args.timeout)
        if done.returncode:
            raise SystemExit(f"{args.run}: train.py exited with {done.returncode}")
        with open(os.path.join(workdir, "summary.json")) as f:
            summary = json.load(f)
        steps = summary["learner_steps"]
        line = {
            "bench": "paper_smoke",
            "run": args.run,
            "config": config,
            "steps": steps,
            "wall_s": round(summary["wall_seconds"], 1),
            "rl_s": round(summary["rl_seconds"], 1),
            "step_s": step_seconds(workdir),
            "training_s_per_step": summary["time_split_seconds"].get("training", 0.0) / steps,
            "samples_per_s": round(summary["samples_per_second"], 1),
            "peak_device_gib": summary["peak_device_gib"],
            "time_split_s": {k: round(v, 1) for k, v in summary["time_split_seconds"].items()},
        }
        for key in ("step_s", "training_s_per_step"):
            line[key] = None if line[key] is None else round(line[key], 2)
        print(json.dumps(line), flush=True)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
