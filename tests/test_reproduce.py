"""experiments/reproduce.py (tba_jax/reproduce): the grids, the paper-scale commands when
checkpoints are missing, the report's statistics and files, and a real one-run grid that
a rerun reads back instead of training again."""

import csv
import dataclasses
import os
import signal
import sys
import warnings

import numpy as np
import pytest

from tba_jax.reproduce import paper, report, runner
from tba_jax.reproduce.cells import Cell, CellResult, with_variant
from tba_jax.reproduce.grids import EXPERIMENTS, Experiment
from tba_jax.reproduce.report import Column


def test_every_experiment_has_a_grid_at_both_scales_and_the_papers_numbers():
    for experiment in EXPERIMENTS.values():
        for scale in ("tiny", "paper"):
            cells = experiment.cells(scale)
            assert cells, (experiment.name, scale)
            names = [cell.name for cell in cells]
            assert len(set(names)) == len(names)  # one workdir per run
            assert all((cell.x is None) == (experiment.x_name is None) for cell in cells)
            runner.load_config(cells[0].config_with_seed)  # the configs exist and load
        assert "Source:" in experiment.paper.markdown()


def test_seeds_repeat_the_grid_and_items_reach_every_run():
    experiment = EXPERIMENTS["ablation_k"]
    cells = runner.grid(experiment, "tiny", seeds=2, items="steps=7")
    base = experiment.cells("tiny")
    assert len(cells) == 2 * len(base)
    assert [cell.seed for cell in cells] == [0] * len(base) + [1] * len(base)
    config = runner.load_config(cells[-1].config_with_seed)
    assert config.learner_steps == 7 and config.seed == 1
    assert config.batch.samples_per_prompt == base[-1].x
    with pytest.raises(ValueError, match="--seeds=0"):
        runner.grid(experiment, "tiny", seeds=0)


def test_a_paper_grid_without_checkpoints_writes_the_exact_commands_to_a_script(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(runner.MissingSettings) as error:
        runner.reproduce("tldr", "paper", str(out))
    message = str(error.value)
    assert "model.hf_path, task.reward_model.hf_path, task.gold_reward_model.hf_path" in message
    assert f"commands in {out / 'commands.sh'}" in message
    assert "\n" not in message and "experiments/train.py" not in message  # one short line
    assert os.listdir(out) == ["commands.sh"]  # no run before a valid grid
    commands = [line for line in read(out / "commands.sh").splitlines() if line[:1] != "#"]
    trains = [line for line in commands if "experiments/train.py" in line]
    evaluates = [line for line in commands if "experiments/evaluate.py --workdir=" in line]
    assert commands[0] == "set -euo pipefail" and len(trains) == len(evaluates) > 1
    assert len(commands) == 1 + len(trains) + len(evaluates)  # one command per line
    assert all("task.reward_model.hf_path=/path/to/reward_model" in line for line in trains)


@pytest.mark.parametrize(
    "items, message",
    [
        ("nosuchkey=1", r"^TBA \(async TB\) seed 0: unknown config key 'nosuchkey'"),
        ("optim.learning_rate=1e6", r"optim\.learning_rate=1000000\.0 must be a number"),
    ],
)
def test_a_set_item_no_run_can_take_is_refused_before_the_grid_starts(tmp_path, items, message):
    out = tmp_path / "out"
    with pytest.raises(runner.ConfigError, match=message):
        runner.reproduce("gsm8k", "tiny", str(out), items=items)
    assert not out.exists()  # no run, no folder


def test_a_cell_whose_task_would_refuse_it_is_refused_before_the_grid_starts(tmp_path):
    """train.py's checks (check_run) for every cell, the task's included: a victim template
    longer than its max_prompt_len alone (until 2026-11-29 the first cell's run failed on
    it, the grid's folder made)."""
    out = tmp_path / "out"
    with pytest.raises(runner.ConfigError, match=r"seed 0: .*raise task\.victim\.max_prompt"):
        runner.reproduce("redteam", "tiny", str(out), items="task.victim.max_prompt_len=10")
    assert not out.exists()


def test_the_commands_are_printed_one_per_line_where_out_cannot_be_written(tmp_path):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "out"
    lines = []
    with pytest.raises(runner.MissingSettings, match="printed above"):
        runner.reproduce("tldr", "paper", str(out), log=lines.append)
    assert sum("experiments/train.py" in line for line in lines) > 1
    assert all("\n" not in line for line in lines)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def fake_result(
    label: str, x: float | None, seed: int, accuracy: float, curve=(), start=None, steps=None
) -> CellResult:
    """A run whose in-loop evaluations are `curve` ((step, RL seconds, accuracy), every
    step's RL seconds logged as train.py logs them), ending at `accuracy` after `steps`
    learner steps (the curve's last step by default)."""
    cell = Cell(label, "configs/arithmetic.py", seed=seed, x=x)
    scalars = {
        "eval_accuracy": [(step, value) for step, _, value in curve],
        "rl_seconds": [(step, seconds) for step, seconds, _ in curve],
    }
    steps = steps if steps is not None else (curve[-1][0] if curve else 10)
    summary = {
        "eval_accuracy_start": start,
        "eval_accuracy_end": accuracy,
        "learner_steps": steps,
        "rl_seconds": 30.0 + seed,
        "wall_seconds": 10.0 + seed,
    }
    return CellResult(cell, f"/runs/{cell.name}", summary, None, scalars)


def test_the_table_shows_mean_and_sample_std_over_seeds():
    accuracies = [0.5, 0.7, 0.9]
    results = [fake_result("TBA", 4, seed, a) for seed, a in enumerate(accuracies)]
    results.append(fake_result("TBA", 8, 0, 0.25))
    columns = [Column("accuracy", "eval_accuracy_end", fmt="%"), Column("missing", "nope")]
    table = report.results_table(results, columns, "K").splitlines()
    std = np.sqrt(sum((a - 0.7) ** 2 for a in accuracies) / 2)  # n − 1 in the denominator
    assert table[2] == f"| TBA | 4 | 3 | 70.0% ± {100 * std:.1f}% | – |"
    assert table[3] == "| TBA | 8 | 1 | 25.0% | – |"


def test_the_curve_leaves_the_evaluations_time_out():
    result = fake_result("TBA", 1, 0, 0.5, curve=[(2, 10.0, 0.1), (4, 25.0, 0.4)])
    result.scalars["evaluation_seconds"] = [(2, 3.0), (4, 3.0)]
    assert result.curve("eval_accuracy") == [(7.0, 0.1), (19.0, 0.4)]


def test_a_run_without_in_loop_evaluations_has_its_summarys_start_and_end_as_its_curve():
    result = fake_result("TBA", None, 0, 0.8, start=0.3, steps=12)
    assert result.curve("eval_accuracy") == [(0.0, 0.3), (30.0, 0.8)]  # summary's rl_seconds


def test_the_summarys_start_and_end_join_the_in_loop_evaluations_once_per_step():
    result = fake_result("TBA", None, 0, 0.7, curve=[(2, 10.0, 0.4)], start=0.2, steps=4)
    result.scalars["rl_seconds"] = [(1, 5.0), (2, 10.0), (3, 15.0), (4, 20.0)]  # every step
    result.scalars["evaluation_seconds"] = [(2, 3.0)]
    # the end at step 4 on TensorBoard's clock, the evaluation's 3 s left out
    assert result.curve("eval_accuracy") == [(0.0, 0.2), (7.0, 0.4), (17.0, 0.7)]
    ends_on_an_evaluation = fake_result("TBA", None, 0, 0.9, curve=[(2, 10.0, 0.5)], start=0.1)
    assert ends_on_an_evaluation.curve("eval_accuracy") == [(0.0, 0.1), (10.0, 0.5)]


def test_plots_without_points_say_so_instead_of_warning_of_an_empty_legend(tmp_path):
    no_evaluations = [fake_result("TBA", None, 0, None)]
    summary_only = [fake_result("TBA", None, seed, 0.8, start=0.3) for seed in (0, 1)]
    column = Column("accuracy", "eval_accuracy_end", fmt="%")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name, results in (("none", no_evaluations), ("summary", summary_only)):
            report.plot_curves(str(tmp_path / f"{name}.png"), results, "eval_accuracy", "acc")
        report.plot_against_x(str(tmp_path / "x.png"), no_evaluations, column, "K")


def test_the_report_files(tmp_path):
    results = [
        fake_result("TBA", k, seed, 0.1 * k + 0.01 * seed, curve=[(1, 1.0, 0.1), (2, 2.0, 0.2)])
        for k in (2, 4)
        for seed in (0, 1)
    ]
    experiment = dataclasses.replace(
        EXPERIMENTS["ablation_k"], columns=(Column("accuracy", "eval_accuracy_end", fmt="%"),)
    )
    experiment = dataclasses.replace(experiment, plot_column=experiment.columns[0])
    command = runner.command_line("ablation_k", "tiny", 2, "smoke,steps=3")
    page, table, plot = runner.write_report(
        experiment, "tiny", results, str(tmp_path), command=command
    )
    with open(table) as f:
        rows = list(csv.DictReader(f))
    assert [(r["x"], r["seed"]) for r in rows] == [("2", "0"), ("2", "1"), ("4", "0"), ("4", "1")]
    accuracies = [float(r["eval_accuracy_end"]) for r in rows]
    assert accuracies == pytest.approx([0.2, 0.21, 0.4, 0.41])
    text = read(page)
    assert "| TBA | 2 | 2 | 20.5% ± 0.7% |" in text and "54.61%" in text  # ours, the paper's
    # a smoke run's page says so: every flag that changes the numbers
    written_by = "`python experiments/reproduce.py --experiment=ablation_k --scale=tiny --seeds=2"
    assert f"{written_by} --set=smoke,steps=3`" in text
    with open(plot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    curves = report.plot_curves(str(tmp_path / "curves.png"), results, "eval_accuracy", "acc")
    assert os.path.getsize(curves) > 0


def test_the_command_line_leaves_out_an_empty_set():
    command = runner.command_line("gsm8k", "tiny", 1, "")
    assert command == "python experiments/reproduce.py --experiment=gsm8k --scale=tiny --seeds=1"


def test_progress_lines_name_only_the_fields_a_cell_has(tmp_path, monkeypatch):
    cells = [Cell("TBA", "configs/arithmetic.py", x=4), Cell("sync TB", "configs/arithmetic.py")]
    monkeypatch.setattr(runner, "run_cell", lambda cell, workdir: None)
    lines = []
    runner.run_grid(EXPERIMENTS["gsm8k"], cells, str(tmp_path), lines.append)
    assert lines == ["[1/2] TBA x=4 seed 0: running", "[2/2] sync TB seed 0: running"]


def test_a_one_run_grid_trains_reports_and_is_read_back_on_a_rerun(tmp_path, monkeypatch):
    cell = Cell(
        "TB smoke", with_variant("configs/arithmetic.py:smoke", "steps=2,eval.every_steps=1")
    )
    experiment = Experiment(
        "smoke_grid", "A one-run grid", lambda scale: [cell], EXPERIMENTS["gsm8k"].columns
    )
    monkeypatch.setitem(runner.EXPERIMENTS, "smoke_grid", experiment)
    monkeypatch.setitem(paper.NUMBERS, "smoke_grid", paper.GSM8K)
    out = str(tmp_path / "out")
    lines = []
    runner.reproduce("smoke_grid", "tiny", out, log=lines.append)
    assert lines == ["[1/1] TB smoke seed 0: running"]
    text = read(os.path.join(out, "smoke_grid.md"))
    assert "| TB smoke | 1 |" in text
    workdir = runner.cell_workdir(out, experiment, cell)
    curve = runner.run_grid(experiment, [cell], out, lines.append)[0].curve("eval_accuracy")
    seconds = [seconds for seconds, _ in curve]  # the start (summary.json), steps 1 and 2
    assert len(seconds) == 3 and seconds[0] == 0.0 and seconds == sorted(seconds)
    assert lines[-1] == "[1/1] TB smoke seed 0: finished, read back"
    assert os.path.isfile(workdir + ".log")


def test_a_workdir_of_another_config_is_not_read_back_as_this_cell(tmp_path):
    from tba_jax.reproduce.cells import RunError, run_cell

    cell = Cell("TBA", "configs/arithmetic.py:K=4", x=4)
    workdir = tmp_path / cell.name
    workdir.mkdir()
    (workdir / "config.json").write_text('{"variant": "K=4,seed=0,steps=9"}')
    with pytest.raises(RunError, match="the grid changed since it ran"):
        run_cell(cell, str(workdir))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_run_stopped_by_a_signal_stops_the_grid_as_a_stop(tmp_path, signum):
    from tba_jax.checkpoint import RunStopped
    from tba_jax.reproduce.cells import run_logged

    exits_as_stopped = [sys.executable, "-c", f"import sys; sys.exit({128 + signum})"]
    with pytest.raises(RunStopped, match=signum.name) as stopped:
        run_logged(exits_as_stopped, str(tmp_path / "run.log"))
    assert stopped.value.exit_status == 128 + signum  # reproduce.py exits as the run did


# A cell's run that stops as train.py does: at a signal it saves (for a second), then exits
# 128 + the signal.
SAVING_CHILD = """
import pathlib, signal, sys, time
asked = []
for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, lambda signum, frame: asked.append(signum))
pathlib.Path(sys.argv[1]).write_text("ready")
while not asked:
    time.sleep(0.05)
time.sleep(1.0)
pathlib.Path(sys.argv[2]).write_text(str(len(asked)))
sys.exit(128 + asked[0])
"""
GRID_PARENT = """
import sys
from tba_jax.checkpoint import RunStopped
from tba_jax.reproduce.cells import run_logged
try:
    run_logged([sys.executable, "-c", sys.argv[1], *sys.argv[2:4]], sys.argv[4])
except RunStopped as stopped:
    sys.exit(stopped.exit_status)
"""


@pytest.mark.parametrize(
    "signum, to_group",
    [(signal.SIGINT, True), (signal.SIGTERM, False)],
    ids=["ctrl-c-in-a-terminal", "sigterm-to-the-grid"],
)
def test_a_stop_of_the_grid_waits_for_its_run_to_save(tmp_path, signum, to_group):
    import subprocess
    import time

    ready, saved = tmp_path / "ready", tmp_path / "saved"
    parent = subprocess.Popen(
        [sys.executable, "-c", GRID_PARENT, SAVING_CHILD, ready, saved, tmp_path / "run.log"],
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))},
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists()
    if to_group:
        os.killpg(parent.pid, signum)  # what a terminal's Ctrl-C does
    else:
        os.kill(parent.pid, signum)  # what a scheduler does
    assert parent.wait(timeout=60) == 128 + signum
    assert saved.read_text() == "1"  # its save finished, and it was asked once
