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

Rerunning in the same root goes on where the sweep stopped: finished runs are read back,
and the file keeps the rows of earlier calls (a count run again replaces its row), so a
rerun with fewer counts, or one that fails, loses none. SIGTERM or Ctrl-C stops the sweep
at its next safe point: a run being trained saves and stops, an evaluation being made is
passed the signal and waited for; the rows so far are written and the sweep exits
128 + the signal, like train.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator

from absl import flags, logging
from ml_collections import config_flags

from tba_jax import cli, config_lib
from tba_jax.checkpoint import (
    CheckpointMismatchError,
    StopSignal,
    WorkdirInUseError,
    communicate_passing_on_stop,
    stop_on_signals,
)
from tba_jax.config_lib import ConfigError
from tba_jax.metrics import write_json_atomically
from tba_jax.train import check_run, train_and_evaluate

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
# A refused run's message names train.py's flag (its advice, "pass another --workdir",
# and "--workdir=<the run's>"); the sweep's is --workdir_root.
WORKDIR_ADVICE = re.compile(r"another --workdir\b(?!_)")
WORKDIR_NAMED = re.compile(r"--workdir=")


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
    config_lib.check_config_kind(config)
    if config.mode != "async":
        raise ConfigError(
            f"mode={config.mode!r}: only async runs use searchers; sweep an async config."
        )


def run_workdir(workdir_root: str, num_searchers: int) -> str:
    return os.path.join(workdir_root, f"searchers_{num_searchers}")


def evaluate_in_subprocess(
    workdir: str, eval_flags: list[str], stop_signal: StopSignal | None = None
) -> dict:
    """Runs experiments/evaluate.py on `workdir` in a fresh process; returns the result it
    wrote (the file its last stdout line names: with `eval_flags` other than the defaults
    that is `evals/step_<step>_<id>.json`, not eval.json). When `stop_signal` is requested
    meanwhile, the child is sent the signal that asked (SIGTERM when none did) and waited
    for; if it ends without a result, RunStopped."""
    command = [sys.executable, EVALUATE_SCRIPT, f"--workdir={workdir}", *eval_flags]
    paths = [REPO_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    stdout, stderr = communicate_passing_on_stop(child, stop_signal)
    if child.returncode != 0:
        if stop_signal is not None and stop_signal.requested:
            raise stop_signal.stopped()
        refusal = cli.child_user_error(child.returncode, stderr)
        if refusal is not None:
            raise ConfigError(  # e.g. --eval_flags=--num_examples=-1
                f"experiments/evaluate.py refused the evaluation of {workdir}: {refusal} Fix "
                "--eval_flags and run the sweep again: its finished runs are read back, not "
                "trained again."
            )
        raise RuntimeError(
            f"experiments/evaluate.py failed on {workdir} (exit {child.returncode}):\n"
            f"{stderr[-3000:]}"
        )
    written = json.loads(stdout.strip().splitlines()[-1])["files"][0]
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


def held_rows(sweep_path: str, config) -> dict[int, dict]:
    """The rows an earlier call wrote to `sweep_path`, by searcher count: kept when this
    call runs fewer counts or fails ({} when there is no file, it is unreadable, or it is a
    sweep of another config, whose rows would not belong in this one's table)."""
    try:
        with open(sweep_path) as f:
            held = json.load(f)
        if held.get("config_name") != config.name:
            return {}
        return {int(row["num_searchers"]): row for row in held["runs"]}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        logging.warning("%s is unreadable (%s); writing it anew.", sweep_path, error)
        return {}


@contextlib.contextmanager
def workdir_advice_for_the_sweep() -> Iterator[None]:
    """A refused workdir's advice names the sweep's flag (--workdir_root), not train.py's."""
    try:
        yield
    except (CheckpointMismatchError, WorkdirInUseError) as error:
        message = WORKDIR_ADVICE.sub("another --workdir_root", str(error))
        raise type(error)(WORKDIR_NAMED.sub("workdir ", message)) from None


def train_in_sweep(config, workdir: str) -> dict:
    """`train_and_evaluate`, with the advice of a refused workdir naming the sweep's flag."""
    with workdir_advice_for_the_sweep():
        return train_and_evaluate(config, workdir)  # RunStopped on SIGTERM


def with_searchers(config, num_searchers: int):
    """A copy of `config` with `num_searchers` searchers."""
    run_config = config.copy_and_resolve_references()
    run_config.search.num_searchers = num_searchers
    return run_config


def check_runs(config, workdir_root: str, counts: list[int]) -> None:
    """Every run's config and workdir checked as train.py checks them (`check_run`),
    before the first trains or anything is written: a ConfigError for the sweep, not
    for its second run an hour in."""
    check_sweepable(config)
    for num_searchers in counts:
        with workdir_advice_for_the_sweep():
            check_run(
                with_searchers(config, num_searchers), run_workdir(workdir_root, num_searchers)
            )


def run_sweep(config, workdir_root: str, counts: list[int], eval_flags: list[str]) -> dict:
    """Trains and evaluates `config` once per searcher count; writes and returns the sweep
    (with the rows earlier calls wrote in `workdir_root` for other counts). SIGTERM or
    Ctrl-C: RunStopped once the run being trained is saved or the evaluation being made
    has ended, with the rows so far written."""
    check_runs(config, workdir_root, counts)
    os.makedirs(workdir_root, exist_ok=True)
    sweep_path = os.path.join(workdir_root, SWEEP_FILENAME)
    rows = held_rows(sweep_path, config)

    def sweep_so_far() -> dict:
        return {
            "config_name": config.name,
            "variant": config.get("variant", ""),
            "runs": [rows[n] for n in sorted(rows)],
        }

    try:
        # a run installs its own handlers inside these: a stop it gets (saving at its next
        # safe point, or after its last) stops the sweep too (checkpoint.install_stop_handlers)
        with stop_on_signals() as stop_signal:
            for num_searchers in counts:
                stop_signal.raise_if_requested()  # a stop between runs
                run_config = with_searchers(config, num_searchers)
                workdir = run_workdir(workdir_root, num_searchers)
                logging.info("Sweep: training with %d searcher(s) in %s.", num_searchers, workdir)
                summary = train_in_sweep(run_config, workdir)
                stop_signal.raise_if_requested()  # trained: evaluated on the rerun
                metrics = evaluate_in_subprocess(workdir, eval_flags, stop_signal)
                rows[num_searchers] = sweep_row(num_searchers, workdir, summary, metrics)
                write_json_atomically(sweep_path, sweep_so_far())  # as each run ends
    finally:  # stopped or failed: the rows so far are written, and none of the file's lost
        if not os.path.exists(sweep_path):
            write_json_atomically(sweep_path, sweep_so_far())
    return sweep_so_far()


def define_flags() -> None:
    """The command line's flags, defined only when run as a script (tba_jax.cli's rule)."""
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
