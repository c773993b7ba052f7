r"""The README's demo table, from measured runs: wall time, held-out accuracy and policy lag.

    python benchmarks/demo_table.py
    # seconds, on the smoke variant (what tests/test_demo_table.py runs)
    python benchmarks/demo_table.py --config=configs/arithmetic.py:smoke \
        --variants "" mode=sync --workdir_root=/tmp/demo_table

For each variant, runs the README's main command,

    python experiments/train.py --config=<config>[:<variant>] --workdir=<fresh workdir>

as a subprocess in a fresh workdir under `--workdir_root` (default: a temporary folder,
removed afterwards), timing its wall clock from start to exit as `/usr/bin/time` does. A
variant's items are added to `--config`'s (`configs/arithmetic.py:smoke` with `mode=sync`
runs `configs/arithmetic.py:smoke,mode=sync`); "" runs the config as it is. Then it reads
each run's summary.json and prints, on stdout, the table in the README's format, the
samples/s and warm-start figures the paragraph below it quotes, and the machine (CPUs,
JAX and Python versions). Each run's console output goes to `<workdir>.log`.

Run it on a quiet machine: the runs time the cores they share with everything else.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile

from tba_jax.reproduce.cells import (
    SUMMARY_FILENAME,
    RunError,
    run_logged,
    runnable_config,
    train_command,
    with_variant,
)
from tba_jax.reproduce.report import machine_line

DEFAULT_CONFIG = "configs/arithmetic.py"
# The README's rows: async TB, sync TB, sync RLOO ("" = the config's own defaults).
DEFAULT_VARIANTS = ("", "mode=sync", "mode=sync,method=rloo")
METHOD_NAMES = {"tb": "TB", "rloo": "RLOO"}
TABLE_HEADER = (
    "| command | wall | held-out greedy accuracy, start → end | policy lag mean / max |",
    "|---|---|---|---|",
)
START_KEY, END_KEY = "eval_accuracy_start", "eval_accuracy_end"


# A mistake in the flags or a run that failed: reported in one `error:` message.
DemoTableError = RunError


@dataclasses.dataclass(frozen=True)
class DemoRun:
    """One measured run: the config it ran, its wall clock and its summary.json."""

    config: str  # path[:variant], as the table shows it
    wall_seconds: float
    summary: dict

    @property
    def label(self) -> str:
        """'async TB', 'sync RLOO', ...: the run's mode and method."""
        method = self.summary["method"]
        return f"{self.summary['mode']} {METHOD_NAMES.get(method, method.upper())}"


# ------------------------------------------------------------------------ what to run


def workdir_name(index: int, variant: str) -> str:
    """A folder name per variant: '1_default', '2_mode=sync', ..."""
    return f"{index + 1}_" + (re.sub(r"[^A-Za-z0-9=.+-]+", "_", variant) or "default")


def check_fresh(workdirs: list[str]) -> None:
    """DemoTableError when a workdir already holds files: a rerun would resume, not time."""
    used = [workdir for workdir in workdirs if os.path.exists(workdir) and os.listdir(workdir)]
    if used:
        raise DemoTableError(
            f"{used[0]} is not empty: the table needs fresh runs (a second run resumes the "
            "first); pass an empty or new --workdir_root."
        )


# ------------------------------------------------------------------------ running


def read_summary(workdir: str) -> dict:
    path = os.path.join(workdir, SUMMARY_FILENAME)
    with open(path) as f:
        summary = json.load(f)
    if START_KEY not in summary:
        raise DemoTableError(
            f"{path} has no {START_KEY}: the demo table is for tasks scored by accuracy "
            f"({DEFAULT_CONFIG} and its variants)."
        )
    return summary


def measure(config: str, variants: list[str], workdir_root: str) -> list[DemoRun]:
    """Trains `config` with each variant in a fresh workdir under `workdir_root`."""
    configs = [with_variant(config, variant) for variant in variants]
    workdirs = [os.path.join(workdir_root, workdir_name(i, v)) for i, v in enumerate(variants)]
    for each in configs:
        runnable_config(each)  # every config file exists before the first long run
    check_fresh(workdirs)
    os.makedirs(workdir_root, exist_ok=True)
    runs = []
    for number, (each, workdir) in enumerate(zip(configs, workdirs, strict=True), start=1):
        print(f"[{number}/{len(configs)}] training {each} in {workdir}", file=sys.stderr)
        wall_seconds = run_logged(train_command(each, workdir), workdir + ".log")
        print(f"[{number}/{len(configs)}] {wall_seconds:.1f} s", file=sys.stderr)
        runs.append(DemoRun(each, wall_seconds, read_summary(workdir)))
    return runs


# ------------------------------------------------------------------------ the table


def percent(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"


def mean_lag(value: float) -> str:
    """One decimal; a lag of exactly zero (sync mode) as '0'."""
    return "0" if value == 0 else f"{value:.1f}"


def table_row(run: DemoRun) -> str:
    summary = run.summary
    cells = (
        f"`{run.config}` ({run.label})",
        f"{run.wall_seconds:.0f} s",
        f"{percent(summary[START_KEY])} → {percent(summary[END_KEY])}",
        f"{mean_lag(summary['mean_policy_lag'])} / {summary['max_policy_lag']:.0f}",
    )
    return "| " + " | ".join(cells) + " |"


def markdown_table(runs: list[DemoRun]) -> str:
    return "\n".join([*TABLE_HEADER, *(table_row(run) for run in runs)])


def throughput_line(runs: list[DemoRun]) -> str:
    """The samples/s the paragraph below the table compares (RL phase only)."""
    rates = ", ".join(f"{run.label} {run.summary['samples_per_second']:,.0f}/s" for run in runs)
    return f"Samples generated per second: {rates}."


def warm_start_line(runs: list[DemoRun]) -> str:
    """Seconds of each run spent on the warm start and its evaluation."""
    times = ", ".join(f"{run.label} {run.summary['warm_start_seconds']:.0f} s" for run in runs)
    return f"Warm start and its evaluation: {times}."


def report(runs: list[DemoRun]) -> str:
    """The table and the figures the README quotes around it."""
    lines = [markdown_table(runs), "", throughput_line(runs), warm_start_line(runs)]
    return "\n".join([*lines, f"Machine: {machine_line()}."])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="path[:variant]")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(DEFAULT_VARIANTS),
        help='variant items added to --config, one table row each ("": none)',
    )
    parser.add_argument(
        "--workdir_root", default=None, help="where the runs go; default: a temporary folder"
    )
    args = parser.parse_args(argv)
    try:
        if args.workdir_root is None:
            with tempfile.TemporaryDirectory(prefix="demo_table_") as workdir_root:
                runs = measure(args.config, args.variants, workdir_root)
        else:
            runs = measure(args.config, args.variants, os.path.abspath(args.workdir_root))
    except DemoTableError as error:
        sys.exit(f"error: {error}")
    print(report(runs))


if __name__ == "__main__":
    main()
