"""benchmarks/demo_table.py: the README's demo table from measured runs, in the README's
format (checked on made-up summaries and on real runs of the smoke variant)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import demo_table

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "benchmarks" / "demo_table.py"
SUBPROCESS_TIMEOUT_S = 600
SMOKE_CONFIG = "configs/arithmetic.py:smoke"
ROW_PATTERN = re.compile(
    r"\| `(?P<config>[^`]+)` \((?P<label>\w+ \w+)\) \| (?P<wall>\d+) s \| \d+\.\d% → \d+\.\d% \| "
    r"(0|\d+\.\d) / \d+ \|"
)


def summary(mode: str, method: str, start: float, end: float, lags=(0.0, 0.0)) -> dict:
    """The summary.json keys the table reads."""
    return {
        "mode": mode,
        "method": method,
        "eval_accuracy_start": start,
        "eval_accuracy_end": end,
        "mean_policy_lag": lags[0],
        "max_policy_lag": lags[1],
        "samples_per_second": 1398.6,
        "warm_start_seconds": 29.6,
    }


README_RUNS = [
    demo_table.DemoRun(
        "configs/arithmetic.py", 101.2, summary("async", "tb", 0.281, 0.777, (17.2, 105.0))
    ),
    demo_table.DemoRun(
        "configs/arithmetic.py:mode=sync", 84.4, summary("sync", "tb", 0.281, 0.844)
    ),
    demo_table.DemoRun(
        "configs/arithmetic.py:mode=sync,method=rloo", 86.6, summary("sync", "rloo", 0.281, 0.844)
    ),
]


def readme_table() -> list[str]:
    """The lines of the README's demo table."""
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    start = lines.index(demo_table.TABLE_HEADER[0])
    end = lines.index("", start)
    return lines[start:end]


def test_the_table_has_the_readmes_format():
    assert demo_table.markdown_table(README_RUNS).splitlines() == [
        "| command | wall | held-out greedy accuracy, start → end | policy lag mean / max |",
        "|---|---|---|---|",
        "| `configs/arithmetic.py` (async TB) | 101 s | 28.1% → 77.7% | 17.2 / 105 |",
        "| `configs/arithmetic.py:mode=sync` (sync TB) | 84 s | 28.1% → 84.4% | 0 / 0 |",
        "| `configs/arithmetic.py:mode=sync,method=rloo` (sync RLOO) | 87 s | 28.1% → 84.4% "
        "| 0 / 0 |",
    ]


def test_the_readme_table_is_the_scripts_with_its_default_variants():
    lines = readme_table()
    assert tuple(lines[:2]) == demo_table.TABLE_HEADER
    rows = [ROW_PATTERN.fullmatch(line) for line in lines[2:]]
    assert all(rows), lines[2:]
    default_configs = [
        demo_table.with_variant(demo_table.DEFAULT_CONFIG, variant)
        for variant in demo_table.DEFAULT_VARIANTS
    ]
    assert [row["config"] for row in rows] == default_configs
    assert [row["label"] for row in rows] == [run.label for run in README_RUNS]
    assert "python benchmarks/demo_table.py" in (REPO_ROOT / "README.md").read_text()


def test_the_figures_below_the_table_and_the_machine():
    report = demo_table.report(README_RUNS).splitlines()
    assert report[-3] == (
        "Samples generated per second: async TB 1,399/s, sync TB 1,399/s, sync RLOO 1,399/s."
    )
    assert report[-2] == (
        "Warm start and its evaluation: async TB 30 s, sync TB 30 s, sync RLOO 30 s."
    )
    assert re.fullmatch(
        r"Machine: \d+ CPUs.*, JAX \d+(\.\d+){2,3}, Python 3\.\d+\.\d+, .+\.", report[-1]
    )


def test_variants_add_to_the_configs_items():
    assert demo_table.with_variant("configs/arithmetic.py", "") == "configs/arithmetic.py"
    assert demo_table.with_variant("configs/arithmetic.py", "mode=sync") == (
        "configs/arithmetic.py:mode=sync"
    )
    assert demo_table.with_variant(SMOKE_CONFIG, "mode=sync,method=rloo") == (
        "configs/arithmetic.py:smoke,mode=sync,method=rloo"
    )
    assert demo_table.workdir_name(0, "") == "1_default"
    assert demo_table.workdir_name(2, "mode=sync,method=rloo") == "3_mode=sync_method=rloo"


def test_config_paths_resolve_from_here_or_the_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    resolved = demo_table.runnable_config(SMOKE_CONFIG)
    assert resolved == str(REPO_ROOT / "configs" / "arithmetic.py") + ":smoke"
    with pytest.raises(demo_table.DemoTableError, match=r"no config file configs/nope\.py"):
        demo_table.runnable_config("configs/nope.py:smoke")


def test_a_used_workdir_is_refused_before_any_run(tmp_path):
    (tmp_path / "1_default").mkdir()
    (tmp_path / "1_default" / "summary.json").write_text("{}")
    with pytest.raises(demo_table.DemoTableError, match="1_default is not empty"):
        demo_table.measure(SMOKE_CONFIG, ["", "mode=sync"], str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["1_default"]  # nothing ran


def test_measures_a_smoke_run_into_a_table(tmp_path):
    """One async run of the smoke variant, from another folder (the config path resolves)."""
    command = [sys.executable, str(SCRIPT), f"--config={SMOKE_CONFIG}", "--variants", ""]
    command.append(f"--workdir_root={tmp_path / 'runs'}")
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert tuple(lines[:2]) == demo_table.TABLE_HEADER
    row = ROW_PATTERN.fullmatch(lines[2])
    assert row and (row["config"], row["label"]) == (SMOKE_CONFIG, "async TB"), lines
    summary = json.loads((tmp_path / "runs" / "1_default" / "summary.json").read_text())
    # The wall clock covers the whole process: more than the run's own wall_seconds.
    assert int(row["wall"]) >= int(summary["wall_seconds"])
    assert lines[-3].startswith("Samples generated per second: async TB ")
    assert lines[-2].startswith("Warm start and its evaluation: async TB ")
    assert lines[-1].startswith("Machine: ")
    assert (tmp_path / "runs" / "1_default.log").exists()
