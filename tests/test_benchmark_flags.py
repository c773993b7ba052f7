"""The benchmark scripts refuse a bad command line at once, before any work, with one
`error: ...` line on stderr and a non-zero exit status (no traceback, no hang)."""

from __future__ import annotations

import subprocess

import pytest
from support import REPO_ROOT

ERROR_SECONDS = 60  # imports only: a refusal comes before anything is built or compiled


def error_lines(done: subprocess.CompletedProcess) -> list[str]:
    return done.stderr.strip().splitlines()


@pytest.mark.parametrize(
    "args, problem",
    [
        ((), "error: name the part to run; usage: bash benchmarks/gpu_report.sh decode PEER"),
        (("foo",), "error: unknown part 'foo'; usage: "),
        (("decode",), "error: decode needs the peer script's path (PEER); usage: "),
        (("smoke_gsm8k",), "error: smoke_gsm8k needs a GSM8K folder (GSM8K_DIR); usage: "),
    ],
)
def test_gpu_report_without_its_arguments_prints_one_usage_line(args, problem):
    done = subprocess.run(
        ["bash", str(REPO_ROOT / "benchmarks/gpu_report.sh"), *args],
        capture_output=True,
        text=True,
        timeout=ERROR_SECONDS,
    )
    assert done.returncode == 2
    assert len(error_lines(done)) == 1 and error_lines(done)[0].startswith(problem), done.stderr
    assert done.stdout == ""
