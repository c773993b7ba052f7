"""An experiment's results as the files `experiments/reproduce.py` writes:

<out>/<name>.csv   one row per run (cell and seed): its label, x, seed, workdir and
                   every column of the experiment's table
<out>/<name>.md    our table (mean ± standard deviation over seeds, per label and x)
                   beside the paper's numbers and setting, and the plots
<out>/<name>.png   the main metric against wall-clock (one line per run) or against
                   the grid's x (mean and error bars over seeds, one line per label)
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.metadata
import os
import platform
from collections.abc import Sequence

import numpy as np

from tba_jax.reproduce.cells import CellResult

PLOT_DPI = 120
PLOT_SIZE = (6.4, 4.2)  # inches
MISSING = "–"


@dataclasses.dataclass(frozen=True)
class Column:
    """One figure per run: `key` of the run's summary.json ("summary") or eval.json
    ("evaluation"), shown with `fmt` (a format spec; "%" shows a fraction as percent)."""

    header: str
    key: str
    source: str = "summary"
    fmt: str = ".3g"

    def value(self, result: CellResult) -> float | None:
        holder = result.summary if self.source == "summary" else (result.evaluation or {})
        value = holder.get(self.key)
        return None if value is None else float(value)

    def show(self, value: float) -> str:
        if self.fmt == "%":
            return f"{100 * value:.1f}%"
        return format(value, self.fmt)


def group_key(result: CellResult) -> tuple[str, float | None]:
    return result.cell.label, result.cell.x


def grouped(results: Sequence[CellResult]) -> dict[tuple[str, float | None], list[CellResult]]:
    """Runs by (label, x), in the grid's order."""
    groups: dict[tuple[str, float | None], list[CellResult]] = {}
    for result in results:
        groups.setdefault(group_key(result), []).append(result)
    return groups


def mean_and_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    array = np.asarray(values, np.float64)
    return float(array.mean()), float(array.std(ddof=1)) if len(array) > 1 else 0.0


def summarised(column: Column, runs: Sequence[CellResult]) -> str:
    """'mean ± std' of the column over `runs` (the mean alone for one run)."""
    values = [v for v in (column.value(run) for run in runs) if v is not None]
    if not values:
        return MISSING
    mean, std = mean_and_std(values)
    if len(values) == 1:
        return column.show(mean)
    return f"{column.show(mean)} ± {column.show(std)}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def results_table(results: Sequence[CellResult], columns: Sequence[Column], x_name: str | None):
    """Our markdown table: a row per (label, x) with its seed count and each column."""
    header = ["run", *([x_name] if x_name else []), "seeds", *(c.header for c in columns)]
    rows = []
    for (label, x), runs in grouped(results).items():
        x_cells = [f"{x:g}"] if x_name else []
        rows.append(
            [label, *x_cells, str(len(runs)), *(summarised(column, runs) for column in columns)]
        )
    return markdown_table(header, rows)


def write_csv(path: str, results: Sequence[CellResult], columns: Sequence[Column]) -> str:
    fields = ["label", "x", "seed", "config", "workdir", *(c.key for c in columns)]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(fields)
        for result in results:
            cell = result.cell
            values = [column.value(result) for column in columns]
            writer.writerow(
                [
                    cell.label,
                    "" if cell.x is None else cell.x,
                    cell.seed,
                    cell.config,
                    result.workdir,
                    *("" if v is None else v for v in values),
                ]
            )
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_curves(path: str, results: Sequence[CellResult], metric: str, y_label: str) -> str:
    """`metric` at each evaluation (`CellResult.curve`: in-loop, start and end) against RL
    seconds, one line per run, one colour per label (the paper's Fig. 1 axes)."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=PLOT_SIZE)
    colours = _colours(plt, [result.cell.label for result in results])
    labelled = set()
    for result in results:
        points = result.curve(metric)
        if not points:
            continue
        seconds, values = zip(*points, strict=True)
        label = result.cell.label
        axes.plot(
            seconds,
            values,
            marker="o",
            markersize=3,
            color=colours[label],
            label=None if label in labelled else label,
        )
        labelled.add(label)
    axes.set_xlabel("RL wall-clock seconds (evaluations left out)")
    axes.set_ylabel(y_label)
    axes.grid(alpha=0.3)
    _legend_or_note(axes, f"no run has an evaluation of {metric}")
    return _save(figure, path, plt)


def plot_against_x(
    path: str, results: Sequence[CellResult], column: Column, x_name: str, x_log: bool = False
) -> str:
    """`column`'s mean over seeds against the grid's x, error bars of one standard
    deviation, one line per label."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=PLOT_SIZE)
    by_label: dict[str, list[tuple[float, float, float]]] = {}
    for (label, x), runs in grouped(results).items():
        values = [v for v in (column.value(run) for run in runs) if v is not None]
        if x is not None and values:
            by_label.setdefault(label, []).append((x, *mean_and_std(values)))
    scale = 100.0 if column.fmt == "%" else 1.0
    for label, points in by_label.items():
        xs, means, stds = zip(*sorted(points), strict=True)
        axes.errorbar(
            xs,
            np.multiply(means, scale),
            yerr=np.multiply(stds, scale),
            marker="o",
            capsize=3,
            label=label,
        )
    axes.set_xlabel(x_name)
    if x_log:
        axes.set_xscale("log")
    axes.set_ylabel(column.header + (" (%)" if column.fmt == "%" else ""))
    axes.grid(alpha=0.3)
    _legend_or_note(axes, f"no run has a value of {column.key} and an x")
    return _save(figure, path, plt)


def _legend_or_note(axes, empty_note: str) -> None:
    """The legend of the labelled lines, or `empty_note` written on the empty axes (a
    legend of nothing only draws a warning)."""
    handles, _ = axes.get_legend_handles_labels()
    if handles:
        axes.legend(fontsize="small")
    else:
        axes.text(0.5, 0.5, empty_note, ha="center", va="center", transform=axes.transAxes)


def _colours(plt, labels: Sequence[str]) -> dict[str, str]:
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    unique = list(dict.fromkeys(labels))
    return {label: cycle[i % len(cycle)] for i, label in enumerate(unique)}


def _save(figure, path: str, plt) -> str:
    figure.tight_layout()
    figure.savefig(path, dpi=PLOT_DPI)
    plt.close(figure)
    return path


def machine_line() -> str:
    """The CPUs, JAX and Python the runs used (without importing JAX here)."""
    cpus = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    cpu_text = f"{cpus} CPUs" + (f" ({usable} usable here)" if usable != cpus else "")
    return (
        f"{cpu_text}, JAX {importlib.metadata.version('jax')}, "
        f"Python {platform.python_version()}, {platform.system()} {platform.machine()}"
    )


def write_markdown(
    path: str,
    *,
    title: str,
    intro: Sequence[str],
    ours: str,
    paper: str,
    plots: Sequence[str],
    notes: Sequence[str],
) -> str:
    """The experiment's page: what ran, our table, the paper's, the plots, the notes."""
    lines = [f"# {title}", "", *intro, "", "## Ours", "", ours, "", "## The paper's", "", paper]
    for plot in plots:
        lines += ["", f"![{os.path.basename(plot)}]({os.path.basename(plot)})"]
    if notes:
        lines += ["", "## Notes", "", *(f"- {note}" for note in notes)]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path
