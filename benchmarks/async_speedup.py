r"""TBA against the on-policy baseline on the same two CPU cores: time to a held-out accuracy.

    python benchmarks/async_speedup.py                 # 3 seeds: the README's figures
    python benchmarks/async_speedup.py --seeds=1 --tba_variant=k=4,m=0.9

Every run is two local processes, each pinned to its own core with one CPU device
(`python -m tba_jax.launch --num_processes=2 --pin_cpus`):

- sync: `mode=sync` over `roles_within_host`: both processes generate their half of each
  batch with the current params, then train it in lockstep (the learner mesh spans both,
  data-parallel: its fastest layout here);
- TBA: `mode=async` over `roles_by_process`: process 0 only learns, process 1 only
  searches, and the two exchange trajectories and params through JAX collectives.

Both evaluate greedy accuracy on `--eval_examples` held-out problems every
`--eval_every` learner steps. A run's time to the target is its RL seconds (after the
warm start) at the first evaluation that reaches it, minus the seconds spent evaluating
until then. The target is the sync runs' mean final accuracy minus `--target_margin`.
`speedup` = sync seconds / TBA seconds (means over seeds). The last stdout line is JSON.
The runs go to `--workdir_root` (kept: a rerun skips its finished runs), else to a
temporary folder removed at the end (`--keep` keeps it and says where).

Run it on a quiet machine: the runs time the two cores they have.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from tba_jax.metrics import evaluation_curve, read_scalars  # noqa: E402

CONFIG = "configs/arithmetic.py"
# The baseline at its fastest on two CPU processes: a data-parallel learner (replicated
# params, one gradient all-reduce per step); the default fsdp axis gathers every layer's
# params across the processes through gloo (seed 0: RL 93 s against 68 s).
SYNC_VARIANT = "mode=sync,mesh.learner_axes.data=-1,mesh.learner_axes.fsdp=1"
# The TBA side's settings: the best of a small sweep on seed 0 (README, "Multi-host"):
# publish every step (k=1) and draw 95% of prompts by recency (m=0.95); the defaults
# (k=2, m=0.8), a learning rate of 2e-4 and K=4 of S=8 did not reach the target.
TBA_VARIANT = "k=1,m=0.95"
ACCURACY = "eval_accuracy"
TENSORBOARD_SUBDIR = "tensorboard"
RUN_TIMEOUT_S = 1800
LOG_TAIL_CHARS = 3000


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eval_every", type=int, default=20, help="learner steps")
    parser.add_argument("--eval_examples", type=int, default=128)
    parser.add_argument("--target_margin", type=float, default=0.02)
    parser.add_argument("--sync_variant", default=SYNC_VARIANT)
    parser.add_argument("--tba_variant", default=TBA_VARIANT)
    parser.add_argument(
        "--workdir_root",
        default=None,
        help="where the runs go, kept (a rerun skips the finished ones); default: a "
        "temporary folder, removed at the end unless --keep",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args()
    if args.seeds < 1 or args.eval_every < 1 or args.eval_examples < 0:
        parser.error("--seeds and --eval_every must be >= 1, --eval_examples >= 0 (0: all)")
    return args


def launch_command(variant: str, topology: str, workdir: str, args) -> list[str]:
    config = CONFIG + (f":{variant}" if variant else "")
    # roles_by_process: a second CPU device per process runs the exchanges (on the same
    # pinned core) so that a round never stalls generation (tba_jax.topology.working_devices)
    devices = 2 if topology == "roles_by_process" else 1
    return [
        sys.executable,
        "-m",
        "tba_jax.launch",
        "--num_processes=2",
        f"--devices_per_process={devices}",
        "--pin_cpus",
        "--",
        "experiments/train.py",
        f"--config={config}",
        f"--workdir={workdir}",
        f"--config.distributed.topology={topology}",
        f"--config.eval.every_steps={args.eval_every}",
        f"--config.eval.num_examples={args.eval_examples}",
        "--config.progress_bar=False",
    ]


def run(name: str, command: list[str], workdir: str) -> dict:
    """Runs one launch (unless `workdir` holds a finished run: reruns skip those); returns
    its summary and its evaluation curve."""
    log_path = workdir + ".log"
    finished = os.path.exists(os.path.join(workdir, "summary.json"))
    with open(log_path, "a" if finished else "w") as log:
        done = subprocess.run(
            command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S
        )
    if done.returncode != 0:
        with open(log_path) as log:
            raise SystemExit(f"error: the {name} run failed:\n{log.read()[-LOG_TAIL_CHARS:]}")
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    scalars = read_scalars(os.path.join(workdir, TENSORBOARD_SUBDIR))
    return {"summary": summary, "curve": evaluation_curve(scalars, ACCURACY)}


def time_to(curve, target: float) -> float | None:
    """RL seconds (evaluations left out) at the first evaluation reaching `target`."""
    return next((seconds for _, accuracy, seconds in curve if accuracy >= target), None)


def main() -> None:
    args = parse_args()
    root = args.workdir_root or tempfile.mkdtemp(prefix="async_speedup_")
    os.makedirs(root, exist_ok=True)
    if args.keep and not args.workdir_root:
        print(f"runs in {root}", file=sys.stderr, flush=True)
    try:
        runs = run_seeds(args, root)
    finally:
        if not args.keep and not args.workdir_root:
            shutil.rmtree(root, ignore_errors=True)
    report(runs, args)


def run_seeds(args: argparse.Namespace, root: str) -> dict[str, list[dict]]:
    """Both runs at each seed, alternating, in `root`; prints a JSON line per run."""
    runs = {"sync": [], "tba": []}
    for seed in range(args.seeds):
        for name, variant, topology in (
            ("sync", args.sync_variant, "roles_within_host"),
            ("tba", args.tba_variant, "roles_by_process"),
        ):
            full_variant = ",".join(item for item in (variant, f"seed={seed}") if item)
            workdir = os.path.join(root, f"{name}_seed{seed}")
            result = run(name, launch_command(full_variant, topology, workdir, args), workdir)
            summary = result["summary"]
            runs[name].append(result)
            print(
                json.dumps(
                    {
                        "run": name,
                        "seed": seed,
                        "accuracy_end": summary["eval_accuracy_end"],
                        "rl_seconds": round(summary["rl_seconds"], 1),
                        "wall_seconds": round(summary["wall_seconds"], 1),
                        "learner_steps_per_second": round(summary["learner_steps_per_second"], 2),
                        "samples_per_second": round(summary["samples_per_second"], 1),
                        "mean_policy_lag": round(summary["mean_policy_lag"], 2),
                        "exchange_seconds_per_step": round(summary["exchange_seconds_per_step"], 4),
                        "curve": [(s, round(a, 3), round(t, 1)) for s, a, t in result["curve"]],
                    }
                ),
                flush=True,
            )
    return runs


def report(runs: dict[str, list[dict]], args: argparse.Namespace) -> None:
    """The last line: each side's seconds to the sync runs' mean accuracy (less the margin)."""
    finals = [r["summary"]["eval_accuracy_end"] for r in runs["sync"]]
    target = statistics.mean(finals) - args.target_margin
    seconds = {
        name: [time_to(r["curve"], target) for r in results] for name, results in runs.items()
    }
    reached = {name: [s for s in values if s is not None] for name, values in seconds.items()}
    means = {
        name: statistics.mean(v) if len(v) == len(seconds[name]) else None
        for name, v in reached.items()
    }
    speedup = means["sync"] / means["tba"] if means["sync"] and means["tba"] else None
    print(
        json.dumps(
            {
                "target_accuracy": round(target, 4),
                "sync_final_accuracy": finals,
                "sync_seconds_to_target": seconds["sync"],
                "tba_seconds_to_target": seconds["tba"],
                "sync_mean_s": means["sync"],
                "tba_mean_s": means["tba"],
                "speedup": speedup,
                "seeds": args.seeds,
                "sync_variant": args.sync_variant,
                "tba_variant": args.tba_variant,
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
