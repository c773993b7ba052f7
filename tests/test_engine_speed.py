"""benchmarks/engine_speed.py --smoke: both paths run on both length mixes and the JSON last
line carries every figure the benchmark reports (the figures themselves are not checked:
they are wall-clock times of tiny shapes)."""

from __future__ import annotations

import json
import subprocess

import pytest
from support import run_repo_script

SCRIPT = "benchmarks/engine_speed.py"
SMOKE_SECONDS = 120  # ~13 s on 2 CPU cores, most of it imports and compiling

PATH_FIELDS = {
    "seconds",
    "samples",
    "samples_per_s",
    "decode_steps",
    "slot_steps",
    "occupancy",
    "generating_s",
    "scoring_s",
    "mean_length",
    "max_length",
    "share_at_limit",
}
ENGINE_FIELDS = {"chunks", "prefills", "compactions"}


def run_benchmark(*args: str) -> subprocess.CompletedProcess:
    return run_repo_script(SCRIPT, *args, timeout=SMOKE_SECONDS)


def test_smoke_run_reports_both_paths_on_both_mixes():
    """In bfloat16, as a GPU measurement runs it: the EOS bias still sets the lengths."""
    result = run_benchmark("--smoke", "--dtype=bfloat16")
    assert result.returncode == 0, result.stderr[-3000:]
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["benchmark"] == "engine_speed"
    assert line["smoke"] is True and line["repeats"] == 1 and line["dtype"] == "bfloat16"
    samples = line["prompts"] * line["samples_per_prompt"]
    assert line["samples_per_measurement"] == samples
    assert list(line["mixes"]) == ["long_tailed", "uniform"]
    for mix, figures in line["mixes"].items():
        assert set(figures["batch"]) >= PATH_FIELDS, mix
        assert set(figures["fused"]) >= PATH_FIELDS | ENGINE_FIELDS, mix
        for path in ("batch", "fused"):
            assert figures[path]["samples"] == samples, (mix, path)
            assert figures[path]["samples_per_s"] > 0, (mix, path)
            assert 0 < figures[path]["occupancy"] <= 1, (mix, path)
        ratio = figures["fused"]["samples_per_s"] / figures["batch"]["samples_per_s"]
        assert abs(figures["fused_over_batch"] - ratio) < 1e-3 * ratio + 1e-4, mix
        assert isinstance(figures["compiles_while_timing"], int), mix
    uniform = line["mixes"]["uniform"]
    for path in ("batch", "fused"):  # EOS is never drawn: every response runs to the limit
        assert uniform[path]["share_at_limit"] == 1.0
        assert uniform[path]["occupancy"] == 1.0
    assert "mix          path" in result.stdout  # the table


def test_a_width_that_does_not_hold_whole_prompts_is_a_one_line_error():
    result = run_benchmark("--smoke", "--width=7", "--samples_per_prompt=2")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: --width=7")


@pytest.mark.parametrize(
    "flag, error",
    [
        ("--chunk_steps=0", "error: --chunk_steps=0 must be >= 1."),
        ("--refill_free=2", "error: --refill_free=2.0 must be in [0, 1]."),
        ("--compact_below=1", "error: --compact_below=1.0 must be in [0, 1)."),
    ],
)
def test_a_bad_engine_flag_is_one_error_line_naming_the_flag(flag, error):
    result = run_benchmark("--smoke", flag)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [error]
