"""benchmarks/tpu_plan.py: a config's learner step and search call compiled for a slice's
chips, split as a run splits them, with XLA's memory plan per chip. Here the slice is this
process's own fake CPU devices (`--slice=local`); a TPU slice needs libtpu."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
from support import REPO_ROOT, fake_cpu_devices_env

SCRIPT = str(REPO_ROOT / "benchmarks/tpu_plan.py")
CONFIG = ("--config=configs/arithmetic.py", "--config.model.vocab_size=32")


def run_plan(*args: str, devices: int = 1, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**fake_cpu_devices_env(devices), "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(
        [sys.executable, SCRIPT, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=timeout,
    )


def json_lines(done: subprocess.CompletedProcess) -> list[dict]:
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_each_program_is_planned_on_its_role_mesh_of_the_slice():
    """4 devices split 2 + 2: the learner's step over fsdp 2 (the demo's B × K = 16 × 8
    rows), the search call over data 2 (prompts_per_call × S rows), each with XLA's plan
    per device; no HBM figure for local devices; no colocated sum for split roles."""
    done = run_plan(*CONFIG, "--slice=local", "--config.mesh.sampler_devices=2", devices=4)
    learner_plan, search_plan, summary = json_lines(done)
    assert learner_plan["plan"] == "learner" and learner_plan["mesh"] == {"fsdp": 2}
    assert learner_plan["rows"] == 16 * 8
    assert search_plan["plan"] == "search" and search_plan["mesh"] == {"data": 2}
    for figures in (learner_plan, search_plan):
        parts = figures["argument_bytes"] + figures["temp_bytes"] + figures["new_output_bytes"]
        assert figures["argument_bytes"] > 0 and figures["temp_bytes"] > 0
        assert figures["device_gib"] == round(parts / 2**30, 2)
        assert figures["fits"] is None and figures["pallas_kernels"] == 0
    # π_ref (float32) beside the search call, whose weights are in the compute dtype (float32
    # in the demo too): the same bytes, the call's inputs on top
    reference = search_plan["reference_bytes"]
    assert 0.9 * search_plan["argument_bytes"] < reference < search_plan["argument_bytes"]
    needed = sum(search_plan[part] for part in ("argument_bytes", "temp_bytes", "new_output_bytes"))
    assert search_plan["chip_gib"] == round((needed + reference) / 2**30, 2)
    assert summary["bench"] == "tpu_plan" and summary["chips"] == 4 and summary["hosts"] == 1
    assert summary["plans"] == [learner_plan, search_plan] and "colocated_gib" not in summary


def test_colocated_roles_sum_both_programs_on_each_chip():
    done = run_plan(*CONFIG, "--slice=local", "--config.mesh.colocate=True", devices=2)
    learner_plan, search_plan, summary = json_lines(done)
    assert learner_plan["mesh"] == {"fsdp": 2} and search_plan["mesh"] == {"data": 2}
    assert summary["colocated_gib"] == pytest.approx(
        learner_plan["chip_gib"] + search_plan["chip_gib"], abs=0.02
    )


def test_a_plan_without_the_vocabulary_size_is_one_error_line():
    done = run_plan("--config=configs/arithmetic.py", "--slice=local", timeout=120)
    assert done.returncode == 1 and done.stdout.strip().splitlines()[-1:] != ["{"]
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("error: a plan needs the policy's vocabulary size: --config.model.vocab_size=N")
    ), done.stderr


def test_a_program_a_plan_does_not_build_is_one_error_line_from_its_child_too():
    """Each program compiles in a child process (`--isolate`): a user's error there ends
    the plan with its one line, as it does compiled in the plan's own process."""
    for isolate in ("--isolate", "--noisolate"):
        done = run_plan(*CONFIG, "--slice=local", "--config.method=ppo", isolate, timeout=120)
        assert done.returncode == 1, (isolate, done.stdout[-2000:])
        assert done.stderr.strip().splitlines()[-1] == (
            "error: a plan of PPO's learner (its critic) is not built; use --programs=search"
        ), (isolate, done.stderr)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="libtpu is here")
def test_a_tpu_slice_without_libtpu_says_what_to_install():
    done = run_plan(*CONFIG, "--slice=v5e-4", timeout=120)
    assert done.returncode == 1
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "error: compiling for a TPU slice without one needs libtpu at JAX's version: "
            'pip install "jax[tpu]=='
        )
    ), done.stderr


def test_every_slice_is_planned_as_the_one_host_it_is():
    """libtpu takes a "2x4" topology for two hosts of 2x2 chips unless given the host's
    bounds; a v5e-8 or v6e-8 is one host of 8 chips, and which chips a role gets decides
    whether libtpu compiles its collectives (README: "Planning a TPU slice")."""
    listing = subprocess.run(
        [sys.executable, "-c", "import json, tpu_plan; print(json.dumps(tpu_plan.SLICES))"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT / "benchmarks",
        env={**fake_cpu_devices_env(1), "PYTHONPATH": str(REPO_ROOT)},
        timeout=120,
    )
    assert listing.returncode == 0, listing.stderr[-2000:]
    for name, (topology, _, _, chips_per_host) in json.loads(listing.stdout).items():
        chips = [int(size) for size in topology.split(":")[1].split("x")]
        assert int(np.prod(chips)) == int(np.prod(chips_per_host)), name
        cores_per_chip = 2 if name.startswith("v5p") else 1  # v5p's names count TensorCores
        assert int(name.split("-")[1]) == cores_per_chip * int(np.prod(chips)), name
