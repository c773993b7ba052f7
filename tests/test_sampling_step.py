"""benchmarks/sampling_step.py at a tiny vocabulary: one JSON line per sampling rule, and a
clear error for an unknown rule (the figures themselves are wall-clock times, unchecked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "sampling_step.py")


def run_benchmark(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, "--rows=2", "--vocab=50", "--repeats=1", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        cwd=REPO_ROOT,
        timeout=120,
    )


def test_every_rule_prints_its_line():
    done = run_benchmark()
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["rule"] for line in lines] == ["greedy", "temperature", "top_k", "top_p"]
    assert all(line["median_ms"] > 0 and line["vocab"] == 50 for line in lines)


def test_an_unknown_rule_is_a_one_line_error():
    done = run_benchmark("--rules=top_p,nucleus")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "--rules names ['nucleus']" in done.stderr.strip().splitlines()[-1]
