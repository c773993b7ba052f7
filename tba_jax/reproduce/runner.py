"""Runs an experiment's grid and writes its report (what `experiments/reproduce.py` does).

Runs go to `<out>/runs/<experiment>/<cell name>` (one folder per label, x and seed); a
rerun skips the finished ones and resumes an interrupted one, so a grid can be grown
(more seeds) or finished after a stop by running the same command again.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shlex
from collections.abc import Callable, Sequence

import ml_collections

from tba_jax import config_keys
from tba_jax.config_lib import ConfigError, output_dir_problem
from tba_jax.reproduce import report
from tba_jax.reproduce.cells import (
    Cell,
    CellResult,
    evaluate_command,
    is_finished,
    run_cell,
    runnable_config,
    train_command,
)
from tba_jax.reproduce.grids import EXPERIMENTS, SCALES, Experiment

RUNS_SUBDIR = "runs"
COMMANDS_FILENAME = "commands.sh"  # a paper-scale grid's commands, without its checkpoints
EXECUTABLE_MODE = 0o755  # rwxr-xr-x: commands.sh runs as ./commands.sh
SCRIPT = "experiments/reproduce.py"


class MissingSettings(Exception):
    """A paper-scale grid whose configs lack checkpoint folders; the message says which are
    missing and where `save_commands` put the grid's commands."""


def experiment_named(name: str) -> Experiment:
    if name not in EXPERIMENTS:
        raise ValueError(f"--experiment={name!r} is not one of {sorted(EXPERIMENTS)}.")
    return EXPERIMENTS[name]


def grid(experiment: Experiment, scale: str, seeds: int, items: str = "") -> list[Cell]:
    """The experiment's cells at `scale`, each for seeds 0 .. seeds-1, with `items`
    (key=value,... given to every run, e.g. checkpoint folders) added."""
    if scale not in SCALES:
        raise ValueError(f"--scale={scale!r} is not one of {SCALES}.")
    if seeds < 1:
        raise ValueError(f"--seeds={seeds} must be at least 1.")
    base = experiment.cells(scale)
    return [
        dataclasses.replace(cell, seed=seed).with_items(items)
        for seed in range(seeds)
        for cell in base
    ]


def cell_workdir(out: str, experiment: Experiment, cell: Cell) -> str:
    return os.path.join(os.path.abspath(out), RUNS_SUBDIR, experiment.name, cell.name)


def load_config(spec: str) -> ml_collections.ConfigDict:
    """The config `path[:variant]` describes, as `--config=` loads it."""
    path, _, variant = runnable_config(spec).partition(":")
    module_spec = importlib.util.spec_from_file_location("reproduced_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(variant or None)


def missing_settings(experiment: Experiment, cells: Sequence[Cell]) -> list[str]:
    """The `required` keys left empty in the first cell's config (every cell of a grid
    shares its checkpoints)."""
    config = load_config(cells[0].config_with_seed)
    return [key for key in experiment.required if not config_keys.lookup(config, key)[1]]


def commands_text(experiment: Experiment, cells: Sequence[Cell], out: str) -> str:
    """The training (and evaluation) command of every cell, one per line."""
    lines = []
    for cell in cells:
        workdir = cell_workdir(out, experiment, cell)
        lines.append(shlex.join(train_command(cell.config_with_seed, workdir)))
        if cell.evaluate:
            lines.append(shlex.join(evaluate_command(workdir)))
    return "\n".join(lines)


def commands_script(experiment: Experiment, commands: str, placeholders: str) -> str:
    """A bash script of `commands` (one per line), saying what to fill in first."""
    header = [
        "#!/usr/bin/env bash",
        f"# The paper-scale {experiment.name} grid, one command per line, written by {SCRIPT}.",
        "# Replace these placeholders with your local Hugging Face folders first (or pass",
        f"# your folders to {SCRIPT} as --set=..., which also writes the report):",
        *(f"#   {item}" for item in placeholders.split(",")),
        "set -euo pipefail",
    ]
    return "\n".join([*header, commands]) + "\n"


def save_commands(out: str, script: str, log: Callable[[str], None]) -> str:
    """Writes `script` to `<out>/commands.sh` (executable) when `out` can be written, else
    logs it one line at a time; returns where it went, to finish a sentence."""
    if output_dir_problem(out) is not None:
        for line in script.splitlines():
            log(line)
        return f"printed above ({out} cannot be written)"
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, COMMANDS_FILENAME)
    with open(path, "w") as f:
        f.write(script)
    os.chmod(path, EXECUTABLE_MODE)
    return f"in {path}"


def check_settings(
    experiment: Experiment,
    scale: str,
    cells: Sequence[Cell],
    out: str,
    log: Callable[[str], None] = print,
):
    """MissingSettings when a paper-scale grid lacks a checkpoint, after saving the grid's
    commands (`save_commands`; the message says where)."""
    if scale != "paper":
        return
    missing = missing_settings(experiment, cells)
    if missing:
        placeholders = ",".join(f"{key}=/path/to/{key.split('.')[-2]}" for key in missing)
        shown = grid(experiment, scale, 1, placeholders)
        commands = commands_text(experiment, shown, out)
        where = save_commands(out, commands_script(experiment, commands, placeholders), log)
        raise MissingSettings(
            f"The paper-scale {experiment.name} grid needs {', '.join(missing)} (local "
            f"Hugging Face folders). Pass them as --set={placeholders} (your paths), or put "
            f"your paths in the {len(commands.splitlines())} train/evaluate commands {where} "
            "and run them yourself."
        )


def check_configs(experiment: Experiment, cells: Sequence[Cell], out: str) -> None:
    """A ConfigError naming the first cell whose run train.py would refuse (a `--set` item
    it has no key for or gives a value out of range, a Hugging Face folder that is none, a
    mesh or a role model's template that cannot work, a workdir of another experiment:
    `train.check_run`), before any run starts: in a paper grid a later cell would
    otherwise fail hours in."""
    from tba_jax.train import check_run  # the training loop's module: only for the checks

    for cell in cells:
        try:
            check_run(load_config(cell.config_with_seed), cell_workdir(out, experiment, cell))
        except ConfigError as error:
            raise ConfigError(f"{describe(cell)}: {error}") from None


def describe(cell: Cell) -> str:
    """The cell as progress lines name it: its label, x (when the grid has one), seed."""
    x_part = [] if cell.x is None else [f"x={cell.x:g}"]
    return " ".join([cell.label, *x_part, f"seed {cell.seed}"])


def run_grid(
    experiment: Experiment, cells: Sequence[Cell], out: str, log: Callable[[str], None]
) -> list[CellResult]:
    """Runs (or reads back) every cell, saying which it skipped."""
    results = []
    for number, cell in enumerate(cells, start=1):
        workdir = cell_workdir(out, experiment, cell)
        state = "finished, read back" if is_finished(cell, workdir) else "running"
        log(f"[{number}/{len(cells)}] {describe(cell)}: {state}")
        results.append(run_cell(cell, workdir))
    return results


def command_line(name: str, scale: str, seeds: int, items: str) -> str:
    """The `experiments/reproduce.py` command of these results, with every flag that
    changes them (--out does not)."""
    arguments = [f"--experiment={name}", f"--scale={scale}", f"--seeds={seeds}"]
    if items:
        arguments.append(f"--set={items}")
    return shlex.join(["python", SCRIPT, *arguments])


def write_report(
    experiment: Experiment,
    scale: str,
    results: Sequence[CellResult],
    out: str,
    *,
    command: str,
) -> list[str]:
    """The experiment's CSV, markdown and plot in `out`, the page saying that `command`
    (`command_line`) wrote them; returns their paths."""
    base = os.path.join(out, experiment.name)
    columns = experiment.columns
    if experiment.plot_column is None:
        plot = report.plot_curves(
            base + ".png", results, experiment.curve_metric, experiment.curve_metric
        )
    else:
        plot = report.plot_against_x(
            base + ".png", results, experiment.plot_column, experiment.x_name, experiment.x_log
        )
    seeds = len({result.cell.seed for result in results})
    page = report.write_markdown(
        base + ".md",
        title=experiment.title,
        intro=[
            f"Scale `{scale}`, {seeds} seed(s) per run; written by `{command}` on "
            f"{report.machine_line()}. Runs and their logs: `{RUNS_SUBDIR}/{experiment.name}/`.",
        ],
        ours=report.results_table(results, columns, experiment.x_name),
        paper=experiment.paper.markdown(),
        plots=[plot],
        notes=experiment.notes(scale),
    )
    table = report.write_csv(base + ".csv", results, columns)
    return [page, table, plot]


def reproduce(
    name: str,
    scale: str,
    out: str,
    *,
    seeds: int = 1,
    items: str = "",
    log: Callable[[str], None] = print,
) -> list[str]:
    """Runs experiment `name` at `scale` into `out` and writes its report (see the
    module docstring); returns the report's paths."""
    experiment = experiment_named(name)
    cells = grid(experiment, scale, seeds, items)
    check_settings(experiment, scale, cells, out, log)
    check_configs(experiment, cells, out)
    os.makedirs(out, exist_ok=True)
    results = run_grid(experiment, cells, out, log)
    command = command_line(name, scale, seeds, items)
    return write_report(experiment, scale, results, out, command=command)
