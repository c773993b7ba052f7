r"""Trains and evaluates one experiment per searcher count: red-teaming metrics vs searchers.

    python experiments/sweep_searchers.py --config=configs/redteam_gpt2.py \
        --workdir_root=/ckpt/rt_sweep --num_searchers=1,2,4 \
        --config.model.hf_path=/ckpts/gpt2 ...
    # seconds on a CPU: the tiny variant
    python experiments/sweep_searchers.py --config=configs/redteam_gpt2.py:tiny \
        --workdir_root=/tmp/rt_sweep --num_searchers=1,2

For each count n, the config (with `search.num_searchers=n`) trains in
`<workdir_root>/searchers_<n>` (resuming a run that is already there), then
experiments/evaluate.py evaluates it in a fresh process (its result lands in the run's
workdir, `evals/`; `--eval_flags` passes it flags such as `--num_samples=256`).
`<workdir_root>/searcher_sweep.json` holds, per count, the evaluation's toxic_percent,
diversity_all, diversity_toxic, mean_toxic_logprob and num_attacks next to the training
summary's wall_seconds, rl_seconds, samples_per_second, learner_steps and mean/max
policy lag; the same table is printed as markdown. The TBA paper sweeps the number of
searchers this way (more searchers: more attacks explored per learner step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import flags, logging
from ml_collections import config_flags

from tba_jax import cli
from tba_jax.checkpoint import CheckpointMismatchError
from tba_jax.config_lib import ConfigError
from tba_jax.metrics import write_json_atomically
from tba_jax.train import train_and_evaluate

SWEEP_FILENAME = "searcher_sweep.json"
EVALUATE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "evaluate.py")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL_KEYS = (
    "toxic_percent",
    "diversity_all",
    "diversity_toxic",
    "mean_toxic_logprob",
    "num_attacks",
)
SUMMARY_KEYS = (
    "wall_seconds",
    "rl_seconds",
    "samples_per_second",
    "learner_steps",
    "mean_policy_lag",
    "max_policy_lag",
)
TABLE_COLUMNS = (
    "num_searchers",
    "toxic_percent",
    "diversity_all",
    "diversity_toxic",
    "wall_seconds",
    "samples_per_second",
)


def parse_counts(values: list[str]) -> list[int]:
    """['1', '2', '4'] -> [1, 2, 4]; ConfigError for anything but distinct positive ints."""
    try:
        counts = [int(value) for value in values]
    except ValueError:
        raise ConfigError(
            f"--num_searchers={','.join(values)} must be integers, e.g. 1,2,4."
        ) from None
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise ConfigError(
            f"--num_searchers={','.join(values)} must list distinct counts >= 1, e.g. 1,2,4."
        )
    return counts


def check_sweepable(config) -> None:
    """ConfigError unless searchers matter: sync mode runs none (the learner samples)."""
    if config.mode != "async":
        raise ConfigError(
            f"mode={config.mode!r}: only async runs use searchers; sweep an async config."
        )


def run_workdir(workdir_root: str, num_searchers: int) -> str:
    return os.path.join(workdir_root, f"searchers_{num_searchers}")


def evaluate_in_subprocess(workdir: str, eval_flags: list[str]) -> dict:
    """Runs experiments/evaluate.py on `workdir` in a fresh process; returns the result it
    wrote (the file its last stdout line names: with `eval_flags` other than the defaults
    that is `evals/step_<step>_<id>.json`, not eval.json)."""
    command = [sys.executable, EVALUATE_SCRIPT, f"--workdir={workdir}", *eval_flags]
    paths = [REPO_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(
            f"experiments/evaluate.py failed on {workdir} (exit {result.returncode}):\n"
            f"{result.stderr[-3000:]}"
        )
    written = json.loads(result.stdout.strip().splitlines()[-1])["files"][0]
    with open(written) as f:
        return json.load(f)


def sweep_row(num_searchers: int, workdir: str, summary: dict, metrics: dict) -> dict:
    """One row of the sweep: the evaluation's metrics and the training's timing."""
    return {
        "num_searchers": num_searchers,
        "workdir": workdir,
        **{key: metrics.get(key) for key in EVAL_KEYS},
        **{key: summary.get(key) for key in SUMMARY_KEYS},
    }


def markdown_table(rows: list[dict]) -> str:
    """The rows' TABLE_COLUMNS as a markdown table (floats with 3 decimals, null as '-')."""

    def cell(value) -> str:
        if value is None:
            return "-"
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(cell(row[key]) for key in TABLE_COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def run_sweep(config, workdir_root: str, counts: list[int], eval_flags: list[str]) -> dict:
    """Trains and evaluates `config` once per searcher count; writes and returns the sweep."""
    check_sweepable(config)
    os.makedirs(workdir_root, exist_ok=True)
    rows = []
    try:
        for num_searchers in counts:
            run_config = config.copy_and_resolve_references()
            run_config.search.num_searchers = num_searchers
            workdir = run_workdir(workdir_root, num_searchers)
            logging.info("Sweep: training with %d searcher(s) in %s.", num_searchers, workdir)
            summary = train_and_evaluate(run_config, workdir)  # RunStopped on SIGTERM
            metrics = evaluate_in_subprocess(workdir, eval_flags)
            rows.append(sweep_row(num_searchers, workdir, summary, metrics))
    finally:  # stopped: the run's checkpoint is saved, and the sweep so far is written
        sweep = {
            "config_name": config.name,
            "variant": config.get("variant", ""),
            "runs": rows,
        }
        write_json_atomically(os.path.join(workdir_root, SWEEP_FILENAME), sweep)
    return sweep


def define_flags() -> None:
    """The command line's flags (defined only when run as a script, so importing this module
    for its functions registers nothing in absl's global flags)."""
    config_flags.DEFINE_config_file("config", None, "Config file (path[:variant]).")
    flags.DEFINE_string("workdir_root", None, "Each run trains in <workdir_root>/searchers_<n>.")
    flags.DEFINE_list("num_searchers", "1,2,4", "Searcher counts, e.g. 1,2,4.")
    flags.DEFINE_list(
        "eval_flags", [], "Extra flags for experiments/evaluate.py, e.g. --num_samples=256."
    )
    cli.define_print_config_flag()
    flags.adopt_module_key_flags(cli)
    flags.mark_flag_as_required("config")


def main(argv):
    del argv
    values = flags.FLAGS
    if values[cli.PRINT_CONFIG_FLAG].value:
        cli.print_config(values.config, values["config"].config_filename)
        return
    counts = parse_counts(values.num_searchers)
    workdir_root = cli.required(values["workdir_root"])
    cli.check_output_dir(workdir_root, "workdir_root")
    sweep = run_sweep(values.config, workdir_root, counts, values.eval_flags)
    print(markdown_table(sweep["runs"]))


if __name__ == "__main__":
    define_flags()
    cli.run(main, user_errors=(ConfigError, CheckpointMismatchError, FileNotFoundError))
