"""tba_jax.sizing (the split of N devices predicted from a profile) and
benchmarks/profile_roles.py (the profile, measured): the formulas against hand arithmetic,
the lag model against a simulation around the real ReplayBuffer, best_split on clear cases,
the CLI as a user runs it, and a real profile of the smoke config end to end."""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from support import run_repo_script

from benchmarks import sizing_check
from configs import arithmetic
from tba_jax import runs, sizing
from tba_jax.replay import ReplayBuffer
from tba_jax.trajectories import Trajectory

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(REPO_ROOT, "configs", "arithmetic.py") + ":smoke"
CLI_SECONDS = 60
PROFILE_SECONDS = 120  # the smoke profile takes ~12 s on 2 cores, most of it imports
LINEAR = sizing.Assumptions(sampler_efficiency=1.0, learner_efficiency=1.0)

# B=4 prompts × K=4 (16 samples a step), S=8, k=4, 2 prompts (16 samples) per 0.5 s call:
# one sampler device makes 32 samples/s; a learner step is 0.4 s on one device, plus a
# 0.02 s batch draw and a 0.08 s publish every 4 steps.
PROFILE = {
    "prompts_per_batch": 4,
    "samples_per_prompt": 4,
    "samples_generated_per_prompt": 8,
    "sync_period": 4,
    "prompts_per_call": 2,
    "recency_prob": 0.5,
    "replay_capacity": 1000,
    "learner_steps": 10_000,
    "num_microbatches": 1,
    "sampler_devices": 1,
    "learner_devices": 1,
    "samples_per_call": 16,
    "search_call_seconds": 0.5,
    "learner_step_seconds": 0.4,
    "batch_draw_seconds": 0.02,
    "publish_seconds": 0.08,
    "config": "hand-made",
    "platform": "cpu",
}

# For best_split: B·K = 840 rows divide over 1..8 learner devices; a step is 0.7 s on one
# device (linear scaling) + 0.01 s draw + 0.04 s publish every 4 steps.
SPLIT_PROFILE = {
    **PROFILE,
    "prompts_per_batch": 105,
    "samples_per_prompt": 8,
    "prompts_per_call": 105,
    "learner_step_seconds": 0.7,
    "batch_draw_seconds": 0.01,
    "publish_seconds": 0.04,
    "samples_per_call": 840,
}


def split_profile(samples_per_s_one_device: float) -> dict:
    """SPLIT_PROFILE with a sampler device making this many samples/s."""
    return {**SPLIT_PROFILE, "search_call_seconds": 840 / samples_per_s_one_device}


# SPLIT_PROFILE's B·K as 210 × 4: B divides over 2 hosts' learner processes
HOSTS_PROFILE = {**split_profile(12_000), "prompts_per_batch": 210, "samples_per_prompt": 4}


# ------------------------------------------------------------------------- formulas


def run_mean(lag: float, run_steps: float) -> float:
    """The mean of min(t, lag) over steps t in [0, run_steps] (run_steps >= lag)."""
    return lag - lag**2 / (2 * run_steps)


def test_one_sampler_and_one_learner_device_by_hand():
    got = sizing.predict(PROFILE, 1, 1, assumptions=LINEAR)
    assert got.step_seconds == pytest.approx(0.02 + 0.4 + 0.08 / 4)  # 0.44 s
    assert got.learner_steps_per_s == pytest.approx(1 / 0.44)
    assert got.samples_per_s == pytest.approx(32)
    assert got.samples_per_learner_step == pytest.approx(32 * 0.44)  # 14.08
    assert got.fresh_fraction == pytest.approx(14.08 / 16)
    assert not got.keeps_up() and got.bottleneck() == "sampler"
    # Recency: the newest version was read 0.5 s × (1 + 1/2) ago; m·B = 2 prompts come
    # from the newest call (2 prompts), so nothing reaches further back.
    recency = run_mean(0.75 / 0.44 + 4 / 2, 10_000)
    # Priority: the buffer holds 1000 / 14.08 steps' worth; over 10,000 steps the mean
    # time in it is H/2 − H²/(4L); plus the call (0.5 s) and half a publish period.
    horizon = 1000 / 14.08
    residence = horizon / 2 - horizon**2 / (4 * 10_000)
    priority = residence + run_mean(0.5 / 0.44 + 4 / 2, 10_000)
    assert got.policy_lag_recency == pytest.approx(recency)
    assert got.policy_lag_priority == pytest.approx(priority)
    assert got.policy_lag_mean == pytest.approx(0.5 * recency + 0.5 * priority)
    assert got.policy_lag_mean == pytest.approx(21.11, abs=0.01)


def test_efficiencies_scale_each_role():
    halves = sizing.Assumptions(sampler_efficiency=0.5, learner_efficiency=0.5)
    got = sizing.predict(PROFILE, 3, 3, assumptions=halves)
    # 3 devices at efficiency 0.5 do the work of 1 + 0.5·2 = 2.
    assert got.samples_per_s == pytest.approx(64)
    assert got.step_seconds == pytest.approx(0.02 + 0.2 + 0.02)
    assert got.samples_per_learner_step == pytest.approx(64 * 0.24)
    assert got.call_seconds == pytest.approx(0.5)  # a searcher's call does not speed up


def test_a_searcher_that_splits_its_calls_over_its_devices_finishes_them_sooner():
    halves = sizing.Assumptions(sampler_efficiency=0.5, learner_efficiency=0.5)
    apart = sizing.predict(PROFILE, 3, 3, assumptions=halves)  # 3 searchers of one device
    together = sizing.predict(PROFILE, 3, 3, assumptions=halves, searcher_devices=3)
    assert together.samples_per_s == pytest.approx(apart.samples_per_s)  # the same work
    assert together.call_seconds == pytest.approx(0.5 / 2)  # 3 devices do the work of 2
    # one searcher: the newest version was read a call × (1 + 1/2) ago (3: × (1 + 1/4))
    recency = 0.25 * 1.5 / together.step_seconds + 4 / 2
    assert together.policy_lag_recency == pytest.approx(run_mean(recency, 10_000))
    assert together.policy_lag_mean < apart.policy_lag_mean
    assert (together.searcher_devices, apart.searcher_devices) == (3, 1)
    assert sizing.predict(PROFILE, 2, 2, searcher_devices=8).searcher_devices == 2  # ≤ all
    with pytest.raises(ValueError, match="searcher_devices=0 must be >= 1"):
        sizing.predict(PROFILE, 2, 2, searcher_devices=0)


def test_a_searcher_spans_a_hosts_sampler_devices_unless_told():
    hosts = sizing.Topology(hosts=2, devices_per_host=4)
    groups = {
        layout.label: (layout.searchers, layout.searcher_devices)
        for layout in sizing.all_layouts(PROFILE, 8, topology=hosts)
    }
    assert groups["colocated 8 within host"] == (2, 4)  # a process per host
    assert groups["2 + 6 within host"] == (2, 1) and groups["4 + 4 within host"] == (2, 2)
    assert groups["4 + 4 by process"] == (1, 3)  # a host's 3 working devices
    one_host = sizing.all_layouts(PROFILE, 8)
    assert [layout.searcher_devices for layout in one_host] == [8, 1, 2, 3, 4, 5, 6, 7]
    per_device = sizing.all_layouts(PROFILE, 8, searcher_devices=1, topology=hosts)
    assert {layout.searcher_devices for layout in per_device} == {1}


def test_colocated_roles_share_the_devices_time():
    quarter = dataclasses.replace(LINEAR, colocated_sampler_share=0.25)
    got = sizing.predict(PROFILE, 2, 2, colocated=True, assumptions=quarter)
    assert got.samples_per_s == pytest.approx(0.25 * 2 * 32)
    assert got.step_seconds == pytest.approx((0.02 + 0.2 + 0.02) / 0.75)
    assert got.call_seconds == pytest.approx(0.5 / 0.25)
    recency = (2 * (1 + 1 / 3)) / got.step_seconds + 4 / 2
    assert got.policy_lag_recency == pytest.approx(run_mean(recency, 10_000))
    assert got.label == "colocated 2" and got.devices == 2
    with pytest.raises(ValueError, match="colocated roles share the same devices"):
        sizing.predict(PROFILE, 2, 3, colocated=True)


def test_a_profile_of_several_devices_is_brought_to_one():
    measured_on_two = {
        **PROFILE,
        "sampler_devices": 2,
        "learner_devices": 2,
        "search_call_seconds": 0.25,  # 64 samples/s on 2 devices
        "learner_step_seconds": 0.2,
    }
    on_one = sizing.predict(PROFILE, 1, 1, assumptions=LINEAR)
    from_two = sizing.predict(measured_on_two, 1, 1, assumptions=LINEAR)
    assert from_two.learner_steps_per_s == pytest.approx(on_one.learner_steps_per_s)
    assert from_two.samples_per_learner_step == pytest.approx(on_one.samples_per_learner_step)
    assert from_two.policy_lag_mean == pytest.approx(on_one.policy_lag_mean)


def test_recency_draws_reach_back_when_they_need_more_prompts_than_one_call():
    wide = {**PROFILE, "prompts_per_batch": 16, "samples_per_prompt": 1}  # m·B = 8 prompts
    got = sizing.predict(wide, 1, 1, assumptions=LINEAR)
    window = (8 - 2) * 8 / got.samples_per_learner_step  # 6 prompts beyond the newest call
    expected = run_mean(0.75 / 0.44 + 4 / 2 + window / 2, 10_000)
    assert got.policy_lag_recency == pytest.approx(expected)


@pytest.mark.parametrize(
    ("horizon", "run_steps", "expected"),
    [(100, 50, 12.5), (100, 100, 25.0), (100, 400, 50 - 10_000 / 1600), (100, math.inf, 50)],
)
def test_mean_buffer_residence(horizon, run_steps, expected):
    assert sizing.mean_buffer_residence(horizon, run_steps) == pytest.approx(expected)


def test_a_steady_state_lag_and_the_profiles_run_length():
    steady = dataclasses.replace(LINEAR, run_steps=sizing.STEADY_STATE)
    got = sizing.predict(PROFILE, 1, 1, assumptions=steady)
    horizon = 1000 / 14.08
    assert got.policy_lag_priority == pytest.approx(horizon / 2 + 0.5 / 0.44 + 2)
    short = sizing.predict({**PROFILE, "learner_steps": 40}, 1, 1, assumptions=LINEAR)
    assert short.policy_lag_priority == pytest.approx(40 / 4 + run_mean(0.5 / 0.44 + 2, 40))
    # A run shorter than the lag: every sample is as old as the run allows, L/2 on average.
    tiny = sizing.predict({**PROFILE, "learner_steps": 2}, 1, 1, assumptions=LINEAR)
    assert tiny.policy_lag_recency == pytest.approx(2 / 2)


def test_an_exchange_is_charged_to_every_learner_step():
    # 0.06 s blocked in exchanges per step: 0.02 + 0.4 + 0.08 / 4 + 0.06 = 0.5 s a step.
    got = sizing.predict({**PROFILE, "exchange_seconds": 0.06}, 1, 1, assumptions=LINEAR)
    assert got.step_seconds == pytest.approx(0.5)
    assert got.learner_steps_per_s == pytest.approx(2.0)
    assert got.samples_per_s == pytest.approx(32)  # the sampler is not slowed
    assert got.samples_per_learner_step == pytest.approx(16)  # 32 samples/s × 0.5 s
    assert got.fresh_fraction == pytest.approx(1.0)
    # Recency: 0.75 s of delay is 1.5 steps, + k/2 = 2. Priority: the buffer holds
    # 1000 / 16 = 62.5 steps' worth; the call (0.5 s) is 1 step, + k/2 = 2.
    assert got.policy_lag_recency == pytest.approx(run_mean(3.5, 10_000))
    residence = 62.5 / 2 - 62.5**2 / (4 * 10_000)
    assert got.policy_lag_priority == pytest.approx(residence + run_mean(3.0, 10_000))
    # Colocated, the learner's share of the time stretches the whole step, exchange too.
    colocated = sizing.predict(
        {**PROFILE, "exchange_seconds": 0.06}, 1, 1, colocated=True, assumptions=LINEAR
    )
    assert colocated.step_seconds == pytest.approx(0.5 / 0.5)
    # No exchange: the profile as it was, and with_exchange sets or refuses one.
    assert sizing.predict({**PROFILE, "exchange_seconds": 0.0}, 2, 3) == sizing.predict(
        PROFILE, 2, 3
    )
    profile = sizing.Profile.from_dict(PROFILE)
    assert profile.exchange_seconds == 0.0
    assert sizing.with_exchange(profile, 0.06) == sizing.Profile.from_dict(
        {**PROFILE, "exchange_seconds": 0.06}
    )
    with pytest.raises(ValueError, match=r"exchange_seconds=-0\.1 must be a number >= 0"):
        sizing.with_exchange(profile, -0.1)
    with pytest.raises(ValueError, match=r"exchange_seconds=-1 must be a number >= 0"):
        sizing.Profile.from_dict({**PROFILE, "exchange_seconds": -1})


def test_a_profile_missing_or_with_bad_figures_is_refused():
    with pytest.raises(ValueError, match="the profile lacks publish_seconds"):
        sizing.Profile.from_dict({k: v for k, v in PROFILE.items() if k != "publish_seconds"})
    with pytest.raises(ValueError, match="search_call_seconds=0 must be a positive number"):
        sizing.Profile.from_dict({**PROFILE, "search_call_seconds": 0})
    with pytest.raises(ValueError, match=r"recency_prob=1\.5 must be in"):
        sizing.Profile.from_dict({**PROFILE, "recency_prob": 1.5})
    with pytest.raises(ValueError, match=r"learner_efficiency=1\.2 must be in"):
        sizing.Assumptions(learner_efficiency=1.2)


def test_the_model_needs_no_jax():
    code = "import sys, tba_jax.sizing; print('jax' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True
    )
    assert result.stdout.strip() == "False"


# ------------------------------------------------- the lag model against a simulation


def simulated_lags(
    profile: dict, steps_per_s: float, call_seconds: float, searchers: int, seed: int
) -> tuple[float, float]:
    """(mean lag, mean lag of recency draws) of a discrete-event run around the real
    ReplayBuffer: `searchers` loops of back-to-back calls of `call_seconds`, each reading
    the version current when it starts and adding prompts_per_call × S distinct samples
    when it ends; a learner that, every 1/steps_per_s seconds from the buffer's first
    B prompts, finishes a step (publishing every k) and draws the next batch."""
    rng = np.random.default_rng(seed)
    p = sizing.Profile.from_dict(profile)
    buffer = ReplayBuffer(
        max_prompt_len=1,
        max_response_len=8,
        pad_id=0,
        capacity=p.replay_capacity,
        capacity_per_prompt=p.samples_generated_per_prompt,
        recency_prob=p.recency_prob,
        priority="uniform",
    )
    events = [(rng.uniform(0, call_seconds), "call", 0) for _ in range(searchers)]
    heapq.heapify(events)
    version, step, next_prompt, started = 0, 0, 0, False
    lags, recency_lags = [], []
    while step < p.learner_steps:
        now, kind, read_version = heapq.heappop(events)
        if kind == "call":
            samples = []
            for prompt in range(next_prompt, next_prompt + p.prompts_per_call):
                samples += [
                    Trajectory(prompt, np.ones(1, np.int32), rng.integers(1, 99, 8), 0.0, 0.0,
                               0.0, np.zeros(8), np.zeros(8), read_version, now)
                    for _ in range(p.samples_generated_per_prompt)
                ]  # fmt: skip
            next_prompt += p.prompts_per_call
            buffer.add(samples)
            heapq.heappush(events, (now + call_seconds, "call", version))
            if not started and buffer.num_prompts >= p.prompts_per_batch:
                started = True
                heapq.heappush(events, (now, "first step", 0))
            continue
        if kind == "step":
            step += 1
            version = step if step % p.sync_period == 0 else version
        batch = buffer.sample(p.prompts_per_batch, p.samples_per_prompt, rng)
        per_prompt = (step - batch.policy_version).reshape(p.prompts_per_batch, -1).mean(1)
        lags.append(per_prompt.mean())
        recency_lags += per_prompt[batch.from_recency].tolist()
        heapq.heappush(events, (now + 1 / steps_per_s, "step", 0))
    return float(np.mean(lags)), float(np.mean(recency_lags))


@pytest.mark.parametrize(
    ("changes", "sampler_devices", "searcher_devices"),
    [
        ({}, 1, 1),  # the sampler keeps up: a short buffer horizon
        ({"search_call_seconds": 2.0, "sync_period": 2}, 3, 1),  # a slow sampler, 3 searchers
        ({"search_call_seconds": 2.0, "sync_period": 2}, 3, 3),  # one, over all 3 devices
    ],
)
def test_the_lag_model_agrees_with_a_simulated_run(changes, sampler_devices, searcher_devices):
    profile = {
        **PROFILE,
        "prompts_per_batch": 16,
        "samples_per_prompt": 8,
        "prompts_per_call": 16,
        "samples_per_call": 128,
        "recency_prob": 0.8,
        "replay_capacity": 2000,
        "learner_steps": 150,
        "search_call_seconds": 0.5,
        "learner_step_seconds": 0.1,
        "batch_draw_seconds": 0.0,
        "publish_seconds": 0.0,
        **changes,
    }
    predicted = sizing.predict(
        profile, sampler_devices, 1, assumptions=LINEAR, searcher_devices=searcher_devices
    )
    searchers = sampler_devices // searcher_devices
    steps_per_s, call_seconds = predicted.learner_steps_per_s, predicted.call_seconds
    runs = [
        simulated_lags(profile, steps_per_s, call_seconds, searchers, seed) for seed in range(2)
    ]
    lag, recency = np.mean(runs, axis=0)
    assert predicted.policy_lag_mean == pytest.approx(lag, rel=0.1, abs=0.5)
    assert predicted.policy_lag_recency == pytest.approx(recency, rel=0.1, abs=0.5)


# ----------------------------------------------------------------------- best_split


@pytest.mark.parametrize(
    ("samples_per_s_one_device", "best"),
    [
        # 1 device makes 12,000 samples/s, over the 840 × 7.0 steps/s of 7 learners.
        (12_000, "1 + 7"),
        # 2,400/s: 2 devices make 4,800 < 840 × 7.3 steps/s of 6; 3 make 7,200 ≥ 840 × 6.25.
        (2_400, "3 + 5"),
        # 600/s: 5 devices make 3,000 < 840 × 3.95 steps/s of 3; 6 make 3,600 ≥ 840 × 2.7.
        (600, "6 + 2"),
    ],
)
def test_best_split_gives_a_slower_sampler_more_devices(samples_per_s_one_device, best):
    profile = split_profile(samples_per_s_one_device)
    got = sizing.best_split(profile, 8, assumptions=LINEAR)
    assert got.label == best
    assert got.keeps_up()
    if got.sampler_devices > 1:  # one device fewer would not keep up
        one_fewer = sizing.predict(
            profile, got.sampler_devices - 1, got.learner_devices + 1, assumptions=LINEAR
        )
        assert not one_fewer.keeps_up()


def test_best_split_moves_devices_to_the_sampler_as_it_slows():
    rates = [20_000, 8_000, 4_000, 2_000, 1_000, 500, 200]
    chosen = []
    for rate in rates:
        splits = [p for p in sizing.all_layouts(split_profile(rate), 8) if not p.colocated]
        chosen.append(sizing.choose(splits, sizing.DEFAULT_MIN_FRESH_FRACTION).sampler_devices)
    assert chosen == sorted(chosen) and chosen[0] == 1 and chosen[-1] == 7


def test_when_no_split_keeps_up_the_most_fresh_batches_win():
    got = sizing.best_split(split_profile(10), 8, assumptions=LINEAR)
    assert got.label == "7 + 1" and not got.keeps_up() and got.bottleneck() == "sampler"
    # Without the constraint, the fastest learner wins whatever its samples' age.
    relaxed = dataclasses.replace(LINEAR, min_fresh_fraction=0.0)
    assert sizing.best_split(split_profile(10), 8, assumptions=relaxed).label == "1 + 7"


def test_best_split_skips_learners_the_batch_does_not_divide_over():
    fast = {**split_profile(12_000), "prompts_per_batch": 2}  # 16 rows: 1, 2, 4 or 8 learners
    layouts = {p.label: p for p in sizing.all_layouts(fast, 8, assumptions=LINEAR)}
    assert [label for label, p in layouts.items() if not p.batch_divides] == [
        "1 + 7",
        "2 + 6",
        "3 + 5",
        "5 + 3",
    ]
    assert sizing.best_split(fast, 8, assumptions=LINEAR).label == "4 + 4"


def test_a_multi_host_topology_runs_the_splits_its_layouts_can_hold():
    topology = sizing.parse_topology("2x4")
    layouts = sizing.all_layouts(HOSTS_PROFILE, 8, assumptions=LINEAR, topology=topology)
    by_label = {layout.label: layout for layout in layouts}
    # s = 2, 4, 6 divide over the 2 hosts (roles_within_host); s = 4 also keeps hosts
    # whole (roles_by_process); 1, 3, 5, 7 neither
    assert [layout.label for layout in layouts] == [
        "colocated 8 within host", "1 + 7", "2 + 6 within host", "3 + 5",
        "4 + 4 within host", "4 + 4 by process", "5 + 3", "6 + 2 within host", "7 + 1",
    ]  # fmt: skip
    usable = [layout.label for layout in layouts if sizing.allowed(layout, topology)]
    assert "1 + 7" not in usable and "4 + 4 by process" in usable
    # by process, a device a host only exchanges: 3 + 3 working devices, a slower learner
    by_process, within = by_label["4 + 4 by process"], by_label["4 + 4 within host"]
    assert by_process.exchange_devices == 2 and within.exchange_devices == 0
    assert by_process.step_seconds == pytest.approx(
        sizing.predict(HOSTS_PROFILE, 3, 3, assumptions=LINEAR).step_seconds
    )
    assert by_process.samples_per_s == pytest.approx(within.samples_per_s * 3 / 4)
    # the unconstrained best (1 + 7) is uneven over hosts: the next that keeps up wins
    got = sizing.best_split(HOSTS_PROFILE, 8, assumptions=LINEAR, topology=topology)
    assert got.label == "2 + 6 within host"
    # B = 105 does not divide over the two hosts' learner processes: within host is out
    odd = sizing.all_layouts(split_profile(12_000), 8, topology=topology)
    assert [p.label for p in odd if sizing.allowed(p, topology)] == ["4 + 4 by process"]
    # one device a host: every split keeps hosts whole, none loses a device
    one_device_per_host = sizing.parse_topology("8x1")
    alone = sizing.best_split(split_profile(12_000), 8)
    spread = sizing.best_split(split_profile(12_000), 8, topology=one_device_per_host)
    assert spread.label == alone.label + " by process" and spread.exchange_devices == 0
    assert spread.learner_steps_per_s == pytest.approx(alone.learner_steps_per_s)
    with pytest.raises(ValueError, match="HOSTSxDEVICES_PER_HOST"):
        sizing.parse_topology("8")


def test_one_device_is_colocated():
    (only,) = sizing.all_layouts(PROFILE, 1)
    assert only.colocated and sizing.best_split(PROFILE, 1) == only


# ---------------------------------------------------------------------------- the CLI


def run_sizing(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tba_jax.sizing", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=CLI_SECONDS,
    )


def test_the_cli_prints_a_table_and_the_best_split_as_json(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(split_profile(2_400)))
    result = run_sizing(f"--profile={path}", "--devices=8", "--learner_efficiency=1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if "learner steps/s" in line)
    assert all(name in lines[header] for name in ("split", "samples/step", "lag", "bottleneck"))
    rows = lines[header + 1 : -1]
    assert [row[2:].split("  ")[0] for row in rows] == ["colocated 8"] + [
        f"{s} + {8 - s}" for s in range(1, 8)
    ]
    starred = [row for row in rows if row.startswith("* ")]
    assert len(starred) == 1 and starred[0].startswith("* 3 + 5")
    best = json.loads(lines[-1])
    assert best["best"]["split"] == "3 + 5" and best["keeps_up"] and best["devices"] == 8
    expected = sizing.best_split(split_profile(2_400), 8, assumptions=LINEAR)
    assert best["best"]["learner_steps_per_s"] == pytest.approx(expected.learner_steps_per_s)
    assert best["best"]["policy_lag_mean"] == pytest.approx(expected.policy_lag_mean)


def test_the_cli_charges_an_exchange_over_the_profiles(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**PROFILE, "exchange_seconds": 1.0}))
    result = run_sizing(f"--profile={path}", "--devices=2", "--exchange_s=0.06")
    assert result.returncode == 0, result.stderr
    assert "exchange 0.06 s per learner step" in result.stdout
    best = json.loads(result.stdout.strip().splitlines()[-1])
    assert best["best"]["split"] == "1 + 1"
    assert best["best"]["step_seconds"] == pytest.approx(0.5)  # 0.44 s + the 0.06 s given


def test_the_cli_takes_a_topology_and_a_steady_state(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(HOSTS_PROFILE))
    result = run_sizing(f"--profile={path}", "--topology=2x4", "--run_steps=inf")
    assert result.returncode == 0, result.stderr
    assert "(uneven over hosts)" in result.stdout and "lag over a full buffer" in result.stdout
    best = json.loads(result.stdout.strip().splitlines()[-1])
    assert best["best"]["split"] == "2 + 6 within host" and best["topology"] == {
        "hosts": 2,
        "devices_per_host": 4,
    }
    assert best["best"]["layout"] == "within host" and best["assumptions"]["run_steps"] == "inf"
    # a process per host: one sampler device a host, a searcher each; by process, one
    # searcher on a host's 3 working devices
    assert best["best"]["searcher_devices"] == 1 and "searchers" in result.stdout
    assert re.search(r"\* 2 \+ 6 within host +2×1 ", result.stdout)
    assert re.search(r"  4 \+ 4 by process +1×3 ", result.stdout)
    per_device = run_sizing(f"--profile={path}", "--topology=2x4", "--searcher_devices=1")
    assert re.search(r"  4 \+ 4 by process +3×1 ", per_device.stdout)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "pass --devices=N"),
        (("--devices=6", "--topology=2x4"), "--devices=6 but --topology=2x4 has 8"),
        (("--devices=4", "--colocated_sampler_share=1"), "colocated_sampler_share=1.0 must be"),
        (("--devices=2", "--exchange_s=-1"), "exchange_seconds=-1.0 must be a number >= 0"),
        (("--devices=2", "--searcher_devices=0"), "--searcher_devices=0 must be >= 1"),
    ],
)
def test_a_mistake_is_one_error_line(tmp_path, args, message):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    result = run_sizing(f"--profile={path}", *args)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("error: ") and message in result.stderr


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "is not a file; make one with benchmarks/profile_roles.py."),
        ("not json", "is not a profile (not JSON: Expecting value"),
        ("[1, 2]", "is not a profile (not a JSON object)."),
    ],
)
def test_a_profile_that_is_missing_or_no_json_object_is_one_error_line(tmp_path, text, message):
    path = tmp_path / "profile.json"
    if text is not None:
        path.write_text(text)
    result = run_sizing(f"--profile={path}", "--devices=2")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("error: ") and message in result.stderr


def test_a_profile_without_the_models_keys_is_one_error_line(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"config": "x"}))
    result = run_sizing(f"--profile={path}", "--devices=2")
    assert result.returncode == 1
    assert result.stderr.startswith("error: the profile lacks prompts_per_batch")


# ------------------------------------------------------------ benchmarks/sizing_check.py

# configs/arithmetic.py's shapes (B=16, K=8, S=8, 16 prompts per call), timed on one device:
# 128 samples per 0.5 s call (256 samples/s); a 0.2 s learner step + 0.01 s draw + a 0.04 s
# publish. Its k, m, capacity and steps are not the config's: the run's replace them.
CHECK_PROFILE = {
    **PROFILE,
    "prompts_per_batch": 16,
    "samples_per_prompt": 8,
    "samples_generated_per_prompt": 8,
    "prompts_per_call": 16,
    "max_prompt_len": 10,
    "max_response_len": 12,
    "sync_period": 4,
    "recency_prob": 0.5,
    "replay_capacity": 1000,
    "learner_steps": 10,
    "samples_per_call": 128,
    "search_call_seconds": 0.5,
    "learner_step_seconds": 0.2,
    "batch_draw_seconds": 0.01,
    "publish_seconds": 0.04,
}
# What the run's config sets (configs/arithmetic.py): k = 2, m = 0.8, capacity 8000.
AS_THE_RUN = {"sync_period": 2, "recency_prob": 0.8, "replay_capacity": 8000}


def fake_run(workdir, *, by_process: bool, overrides: dict | None = None) -> str:
    """A finished run's workdir as train.py leaves it: config.json (configs/arithmetic.py)
    and summary.json (300 steps at 3 steps/s, 600 samples/s, a mean lag of 5; by_process:
    one learner and one searcher process, 0.07 s per step in exchanges)."""
    workdir.mkdir()
    config = arithmetic.get_config()
    for dotted, value in (overrides or {}).items():
        *parents, key = dotted.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        node[key] = value
    summary = {
        "mode": "async",
        "learner_steps": 300,
        "rl_seconds": 100.0,
        "learner_steps_per_second": 3.0,
        "samples_per_second": 600.0,
        "mean_policy_lag": 5.0,
        "colocated": not by_process,
        "exchange_seconds_per_step": 0.07 if by_process else 0.0,
    }
    if by_process:
        config.distributed.topology = "roles_by_process"
        layout = {"topology": "roles_by_process", "num_processes": 2, "num_devices": 2}
        summary.update(layout, learner_processes=1, searcher_processes=1)
    else:
        summary.update(topology="single_process", num_processes=1, num_devices=1)
    runs.write_config(str(workdir), config)
    (workdir / "summary.json").write_text(json.dumps(summary))
    return str(workdir)


def run_check(capsys, *args: str) -> tuple[list[str], dict]:
    """sizing_check's stdout lines (the JSON line left out) and its JSON line, parsed."""
    sizing_check.main(list(args))
    lines = capsys.readouterr().out.strip().splitlines()
    return lines[:-1], json.loads(lines[-1])


def test_sizing_check_compares_runs_with_both_predictions(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(CHECK_PROFILE))
    by_process = fake_run(tmp_path / "by_process", by_process=True)
    single = fake_run(tmp_path / "single", by_process=False)
    lines, result = run_check(capsys, f"--profile={profile}", by_process, single)

    first, second = result["runs"]
    assert (first["layout"], first["topology"]) == ("1 + 1", "roles_by_process")
    assert (second["layout"], second["colocated"]) == ("colocated 1", True)
    assert first["measured"] == {
        "learner_steps_per_s": 3.0,
        "samples_per_learner_step": 200.0,  # 600 samples/s ÷ 3 steps/s
        "policy_lag_mean": 5.0,
    }
    # A step: 0.01 + 0.2 + 0.04 / 2 (the run's k) = 0.23 s, + 0.07 s of exchange = 0.3 s.
    model, exchanged = first["predicted"]["model"], first["predicted"]["with_exchange"]
    assert model["learner_steps_per_s"] == pytest.approx(1 / 0.23)
    assert exchanged["learner_steps_per_s"] == pytest.approx(1 / 0.3)
    assert model["samples_per_learner_step"] == pytest.approx(256 * 0.23)
    assert exchanged["samples_per_learner_step"] == pytest.approx(256 * 0.3)
    errors = first["relative_error"]
    assert errors["model"]["learner_steps_per_s"] == pytest.approx((1 / 0.23 - 3) / 3)
    assert errors["with_exchange"]["learner_steps_per_s"] == pytest.approx(1 / 9)
    assert errors["with_exchange"]["samples_per_learner_step"] == pytest.approx(-0.616)
    # The lag with the run's k, m, capacity and its 300 steps, not the profile's.
    as_run = {**CHECK_PROFILE, **AS_THE_RUN, "learner_steps": 300}
    for name, exchange in (("model", 0.0), ("with_exchange", 0.07)):
        expected = sizing.predict({**as_run, "exchange_seconds": exchange}, 1, 1)
        got = first["predicted"][name]["policy_lag_mean"]
        assert got == pytest.approx(expected.policy_lag_mean)
        assert first["relative_error"][name]["policy_lag_mean"] == pytest.approx((got - 5) / 5)
    # One process exchanges nothing: both predictions are the colocated layout's.
    assert second["predicted"]["model"] == second["predicted"]["with_exchange"]
    colocated = sizing.predict(as_run, 1, 1, colocated=True)
    assert second["predicted"]["model"]["learner_steps_per_s"] == pytest.approx(
        colocated.learner_steps_per_s
    )
    mean = result["mean_abs_relative_error"]["with_exchange"]["learner_steps_per_s"]
    second_error = second["relative_error"]["with_exchange"]["learner_steps_per_s"]
    assert mean == pytest.approx((1 / 9 + abs(second_error)) / 2)

    # The table: a header, then three rows per run, the run's cells on its first row.
    header = next(i for i, line in enumerate(lines) if line.startswith("| run |"))
    assert lines[0].startswith("profile: ")
    assert lines[header].split(" | ")[1:] == [
        "layout", "exchange s/step", "figure", "measured", "model", "error",
        "model + exchange", "error |",
    ]  # fmt: skip
    table = lines[header + 2 :]
    assert len(table) == 7 and table[-1] == ""  # a blank line before the JSON
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table[:-1]]
    assert rows[0][:5] == [by_process, "1 + 1 (roles_by_process)", "0.07", "learner steps/s", "3"]
    assert rows[0][5:] == [f"{1 / 0.23:.3g}", f"{(1 / 0.23 - 3) / 3:+.1%}", "3.33", "+11.1%"]
    assert rows[1][:5] == ["", "", "", "samples / learner step", "200"]
    assert rows[1][5:] == ["58.9", "-70.6%", "76.8", "-61.6%"]
    assert rows[2][3] == "mean policy lag"
    assert rows[3][:3] == [single, "colocated 1 (single_process)", "0"]


def test_sizing_check_gives_each_process_one_searcher_over_its_sampler_devices():
    config = arithmetic.get_config()
    config.mesh.sampler_devices = 2
    split = {"num_processes": 1, "num_devices": 4, "topology": "single_process"}
    layout = sizing_check.run_layout(sizing_check.Run("w", config, {**split, "colocated": False}))
    assert layout == sizing_check.Layout(2, 2, colocated=False, searcher_devices=2)
    by_process = {
        "num_processes": 3,
        "num_devices": 9,  # 3 a process, the last of each only exchanging
        "topology": "roles_by_process",
        "learner_processes": 1,
        "searcher_processes": 2,
    }
    layout = sizing_check.run_layout(sizing_check.Run("w", config, by_process))
    assert layout == sizing_check.Layout(4, 2, colocated=False, searcher_devices=2)


def test_sizing_check_needs_the_profile_of_the_runs_shapes(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(CHECK_PROFILE))
    wider = fake_run(tmp_path / "wider", by_process=True, overrides={"batch.prompts_per_batch": 32})
    with pytest.raises(SystemExit) as exit_info:
        sizing_check.main([f"--profile={profile}", wider])
    assert exit_info.value.code == sizing.USER_ERROR_EXIT_STATUS
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("error: ")
    assert "batch.prompts_per_batch=32 (the profile's 16)" in error


@pytest.mark.parametrize(
    ("remove", "message"),
    [
        ("the folder", "is not a folder"),
        ("summary.json", "is not a finished run"),
        ("config.json", "config.json is missing"),
    ],
)
def test_sizing_check_a_workdir_mistake_is_one_error_line(tmp_path, capsys, remove, message):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(CHECK_PROFILE))
    run = fake_run(tmp_path / "run", by_process=True)
    if remove == "the folder":
        run = str(tmp_path / "nowhere")
    else:
        os.remove(os.path.join(run, remove))
    with pytest.raises(SystemExit):
        sizing_check.main([f"--profile={profile}", run])
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("error: ") and message in error


def test_sizing_check_a_profile_mistake_is_one_error_line(tmp_path, capsys):
    run = fake_run(tmp_path / "run", by_process=True)
    with pytest.raises(SystemExit):
        sizing_check.main([f"--profile={tmp_path / 'missing.json'}", run])
    assert capsys.readouterr().err.startswith("error: --profile=")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"config": "x"}))
    with pytest.raises(SystemExit):
        sizing_check.main([f"--profile={bad}", run])
    assert capsys.readouterr().err.startswith("error: the profile lacks prompts_per_batch")


# ------------------------------------------------------------- profile_roles.py, for real


def run_profile(*args: str) -> subprocess.CompletedProcess:
    return run_repo_script("benchmarks/profile_roles.py", *args, timeout=PROFILE_SECONDS)


def test_profile_roles_measures_the_smoke_config_end_to_end(tmp_path):
    out = tmp_path / "profiles" / "smoke.json"
    result = run_profile(f"--config={SMOKE}", f"--out={out}", "--steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(result.stdout.strip().splitlines()) == 1  # only the JSON line on stdout
    printed = json.loads(result.stdout)
    written = json.loads(out.read_text())
    assert printed == written
    assert written["config"].endswith("arithmetic.py:smoke")
    assert written["platform"] == "cpu" and written["devices"] == 1 and written["colocated"]
    assert (written["prompts_per_batch"], written["samples_per_prompt"]) == (4, 4)
    assert (written["samples_generated_per_prompt"], written["sync_period"]) == (4, 2)
    assert written["prompts_per_call"] == 4 and written["repeats"] == 2
    assert written["samples_per_call"] == 16  # 4 prompts × S = 4, none dropped
    assert 0 < written["mean_response_tokens"] <= written["max_response_len"]
    for name in ("search_call", "generating", "scoring", "learner_step", "publish"):
        assert written[f"{name}_seconds"] > 0, name
    assert written["batch_draw_seconds"] >= 0
    share = written["publish_seconds"] / written["learner_step_seconds"]
    assert written["publish_share_of_step"] == pytest.approx(share)
    split = written["generating_seconds"] + written["scoring_seconds"]
    assert split <= written["search_call_seconds"] * 1.5  # medians of per-call parts
    profile = sizing.load_profile(str(out))
    prediction = sizing.predict(profile, 1, 1)
    assert math.isfinite(prediction.policy_lag_mean) and prediction.learner_steps_per_s > 0


def test_profile_roles_refuses_a_folder_as_its_output(tmp_path):
    result = run_profile(f"--config={SMOKE}", f"--out={tmp_path}")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: --out={tmp_path} is a")
