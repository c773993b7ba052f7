"""benchmarks/publish_cost.py: it publishes the preset's whole tree and reports on it."""

from __future__ import annotations

import json

import jax
from support import run_repo_script

from tba_jax.models import PRESETS, abstract_model, preset

RUN_SECONDS = 120


def test_publish_cost_reports_the_tree_it_published():
    done = run_repo_script(
        "benchmarks/publish_cost.py",
        "--shape=qwen2.5-0.5b",
        "--repeats=2",
        "--compute_dtype=bfloat16",  # through the cast a bfloat16 run's publish makes
        timeout=RUN_SECONDS,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["compute_dtype"] == "bfloat16"
    _, tree = abstract_model(
        preset("qwen2.5-0.5b", vocab_size=512, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128)
    )
    assert result["leaves"] == len(jax.tree.leaves(tree)) == 290
    assert result["param_mib"] == round(sum(x.size * 4 for x in jax.tree.leaves(tree)) / 2**20, 2)
    for figure in ("publish_host_ms", "publish_ms", "device_put_ms"):
        assert result[figure] > 0
    assert result["publish_host_ms"] <= result["publish_ms"]


def test_a_shape_that_is_no_preset_is_one_error_line():
    done = run_repo_script("benchmarks/publish_cost.py", "--shape=nope", timeout=RUN_SECONDS)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: --shape=nope: choose one of " + str(sorted(PRESETS)) + "."
    ]
