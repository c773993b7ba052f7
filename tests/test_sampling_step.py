"""benchmarks/sampling_step.py at a tiny vocabulary: one JSON line per sampling rule, and a
clear error for an unknown rule (the figures themselves are wall-clock times, unchecked)."""

from __future__ import annotations

import json
import subprocess

from support import run_repo_script

TINY = ("--rows=2", "--vocab=50", "--repeats=1")


def run_benchmark(*args: str) -> subprocess.CompletedProcess:
    return run_repo_script("benchmarks/sampling_step.py", *TINY, *args, timeout=120)


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
