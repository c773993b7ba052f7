"""One run of an experiment's grid (a `Cell`), run as a user runs it from the README.

A cell trains with the README's main command,

    python experiments/train.py --config=<path[:variant]>,seed=<seed> --workdir=<workdir>

in a subprocess (a fresh JAX per run; its console output goes to `<workdir>.log`), then,
for tasks scored by their own evaluation (TL;DR, red-teaming), runs

    python experiments/evaluate.py --workdir=<workdir>

A cell whose workdir holds its summary.json (and eval.json, when it is evaluated) is
finished and is not run again; an interrupted one resumes from its last checkpoint, as
the training command always does. Wall times are the summary's (every segment of the run
summed), not the subprocess's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

from tba_jax.checkpoint import (
    SIGNAL_EXIT_BASE,
    STOPPED_STATUSES,
    RunStopped,
    communicate_passing_on_stop,
    stop_on_signals,
)
from tba_jax.metrics import RL_SECONDS, TENSORBOARD_SUBDIR, evaluation_curve, read_scalars

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN_SCRIPT = os.path.join(REPO_ROOT, "experiments", "train.py")
EVALUATE_SCRIPT = os.path.join(REPO_ROOT, "experiments", "evaluate.py")
SUMMARY_FILENAME = "summary.json"  # what experiments/train.py writes into its workdir
EVAL_FILENAME = "eval.json"  # what experiments/evaluate.py writes into the run's workdir
CONFIG_FILENAME = "config.json"  # the run's config, written when it starts
LOG_TAIL_CHARS = 3000
# summary.json's evaluations of a metric (experiments/train.py): `<metric>_start` at
# step 0, before any RL, and `<metric>_end` after its `learner_steps` steps
START_SUFFIX, END_SUFFIX = "_start", "_end"
START_STEP = 0
SUMMARY_STEPS_KEY = "learner_steps"


class RunError(Exception):
    """A config that cannot be found or a run that failed: reported in one message."""


@dataclasses.dataclass(frozen=True)
class Cell:
    """One training run of a grid.

    Attributes:
      label: the series it belongs to in tables and plots ("TB async", "K=8").
      config: `path[:variant]`, the path relative to the repository root.
      seed: the run's `seed` (added to the config's items).
      x: its value on the grid's x axis (off-policyness, searchers, K, ...); None for a
        grid plotted against time.
      evaluate: run `experiments/evaluate.py` after training (the task's own metrics).
    """

    label: str
    config: str
    seed: int = 0
    x: float | None = None
    evaluate: bool = False

    @property
    def name(self) -> str:
        """A folder name: 'tb_async_seed0', 'k_8_x8_seed1', ..."""
        slug = re.sub(r"[^a-z0-9]+", "_", self.label.lower()).strip("_")
        x_part = "" if self.x is None else f"_x{self.x:g}"
        return f"{slug}{x_part}_seed{self.seed}"

    @property
    def config_with_seed(self) -> str:
        return with_variant(self.config, f"seed={self.seed}")

    def with_items(self, items: str) -> Cell:
        """The cell with `items` (key=value,...) added to its config's."""
        return dataclasses.replace(self, config=with_variant(self.config, items))


@dataclasses.dataclass(frozen=True)
class CellResult:
    """A finished cell: its summary.json, eval.json (None when not evaluated) and the
    scalars its train loop wrote ({tag: [(step, value), ...]})."""

    cell: Cell
    workdir: str
    summary: dict
    evaluation: dict | None
    scalars: dict

    def curve(self, metric: str) -> list[tuple[float, float]]:
        """(RL seconds without the evaluations themselves, value) at each evaluation of
        `metric`, by step: the in-loop ones TensorBoard holds, and the start (step 0) and
        end (the last learner step) ones of summary.json where TensorBoard has none at
        their step (a short run may have no in-loop evaluation at all)."""
        by_step = {
            step: (seconds, value)
            for step, value, seconds in evaluation_curve(self.scalars, metric)
        }
        for step, seconds, value in self.summary_points(metric):
            by_step.setdefault(step, (seconds, value))
        return [by_step[step] for step in sorted(by_step)]

    def summary_points(self, metric: str) -> list[tuple[int, float, float]]:
        """(step, RL seconds, value) of summary.json's start and end evaluations of
        `metric` (its `<metric>_start` and `<metric>_end`), leaving out one it lacks."""
        end_step = self.summary[SUMMARY_STEPS_KEY]
        points = [
            (START_STEP, 0.0, self.summary.get(f"{metric}{START_SUFFIX}")),
            (end_step, self.rl_seconds_at(end_step), self.summary.get(f"{metric}{END_SUFFIX}")),
        ]
        return [(step, seconds, value) for step, seconds, value in points if value is not None]

    def rl_seconds_at(self, step: int) -> float:
        """The RL clock at `step` without the in-loop evaluations, as `curve` counts it;
        summary.json's `rl_seconds` (evaluations included) where TensorBoard lacks it."""
        clock = {s: seconds for s, _, seconds in evaluation_curve(self.scalars, RL_SECONDS)}
        return clock.get(step, self.summary[RL_SECONDS])


def with_variant(config: str, items: str) -> str:
    """`config` (path[:variant]) with the key=value `items` added ("" adds nothing)."""
    if not items:
        return config
    return f"{config},{items}" if ":" in config else f"{config}:{items}"


def runnable_config(config: str) -> str:
    """`config` with its path made absolute: as given when it exists from here, else from
    the repository root (so the defaults work from any folder)."""
    path, colon, variant = config.partition(":")
    for candidate in (path, os.path.join(REPO_ROOT, path)):
        if os.path.isfile(candidate):
            return os.path.abspath(candidate) + colon + variant
    raise RunError(f"--config={config}: no config file {path}; pass a configs/*.py file.")


def train_command(config: str, workdir: str) -> list[str]:
    """The README's main command for `config` in `workdir`."""
    return [
        sys.executable,
        TRAIN_SCRIPT,
        f"--config={runnable_config(config)}",
        f"--workdir={workdir}",
    ]


def evaluate_command(workdir: str) -> list[str]:
    """The README's evaluation of the run in `workdir` (its task's own metrics)."""
    return [sys.executable, EVALUATE_SCRIPT, f"--workdir={workdir}"]


def run_logged(command: list[str], log_path: str) -> float:
    """Runs `command` with its output appended to `log_path`; returns its wall seconds
    from start to exit (what /usr/bin/time reports as elapsed). RunError when it fails;
    RunStopped when SIGTERM or Ctrl-C stopped it: a stop asked of this process is passed
    on and waited for while the run saves, so the grid's rerun goes on from there."""
    paths = [REPO_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    with open(log_path, "a") as log, stop_on_signals() as stop_signal:
        start = time.perf_counter()
        # Its own session: a terminal's Ctrl-C reaches this process alone, which passes the
        # stop on once (a second SIGINT would make the child quit without saving).
        child = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        communicate_passing_on_stop(child, stop_signal)
        returncode = child.returncode
        wall_seconds = time.perf_counter() - start
    if returncode in STOPPED_STATUSES:  # SIGTERM / Ctrl-C: it saved, a rerun goes on
        signum = returncode - SIGNAL_EXIT_BASE
        raise RunStopped(
            f"a run of the grid (its log {log_path}) was stopped by {signal.Signals(signum).name}",
            signum,
        )
    stop_signal.raise_if_requested()  # it ended as the stop came: stop before the next one
    if returncode != 0:
        with open(log_path) as log:
            tail = log.read()[-LOG_TAIL_CHARS:]
        raise RunError(
            f"{' '.join(command)} failed (exit {returncode}); its log is {log_path}, "
            f"ending:\n{tail}"
        )
    return wall_seconds


def is_finished(cell: Cell, workdir: str) -> bool:
    """Whether `workdir` holds the cell's summary (and evaluation, when it needs one)."""
    needed = [SUMMARY_FILENAME, *([EVAL_FILENAME] if cell.evaluate else [])]
    return all(os.path.isfile(os.path.join(workdir, name)) for name in needed)


def read_result(cell: Cell, workdir: str) -> CellResult:
    """The finished cell's files (see `CellResult`)."""

    def load(name: str) -> dict:
        with open(os.path.join(workdir, name)) as f:
            return json.load(f)

    event_dir = os.path.join(workdir, TENSORBOARD_SUBDIR)
    return CellResult(
        cell,
        workdir,
        load(SUMMARY_FILENAME),
        load(EVAL_FILENAME) if cell.evaluate else None,
        read_scalars(event_dir) if os.path.isdir(event_dir) else {},
    )


def check_same_run(cell: Cell, workdir: str) -> None:
    """RunError when `workdir` holds a run of another config than `cell`'s (a grid that
    changed since): its results would be read back as this cell's."""
    config_path = os.path.join(workdir, CONFIG_FILENAME)
    if not os.path.isfile(config_path):
        return
    with open(config_path) as f:
        stored = json.load(f).get("variant", "")
    wanted = cell.config_with_seed.partition(":")[2]
    if stored != wanted:
        raise RunError(
            f"{workdir} holds a run of variant {stored!r}, not this grid's {wanted!r} (the "
            "grid changed since it ran); move that folder away or pass another --out."
        )


def run_cell(cell: Cell, workdir: str) -> CellResult:
    """Trains (and evaluates) `cell` in `workdir` unless it is finished there already;
    RunError when the workdir holds another config's run."""
    check_same_run(cell, workdir)
    if not is_finished(cell, workdir):
        os.makedirs(os.path.dirname(workdir), exist_ok=True)
        log_path = workdir + ".log"
        if not os.path.isfile(os.path.join(workdir, SUMMARY_FILENAME)):
            run_logged(train_command(cell.config_with_seed, workdir), log_path)
        if cell.evaluate:
            run_logged(evaluate_command(workdir), log_path)
    return read_result(cell, workdir)
