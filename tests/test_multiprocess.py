"""Runs over several JAX processes, as the README's "Multi-host" section launches them:
`python -m tba_jax.launch --num_processes=N -- experiments/train.py ...` on local CPU
processes (gloo collectives). Both topologies train and write summary.json with the
layout; a multi-process learner step equals the single-process one; SIGTERM saves and a
rerun resumes; another process count is refused in one line; a process that dies ends
the others. Unit tests of the exchange's and the topology's pure parts come first.

The multi-process runs are few and small (CI has 2 cores): each starts N Python
processes that import JAX and compile the smoke model.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import ml_collections
import numpy as np
import pytest

from configs.arithmetic import get_config
from experiments import evaluate
from tba_jax import distributed, exchange, runs, topology
from tba_jax.checkpoint import RunStopped
from tba_jax.config_lib import ConfigError
from tba_jax.metrics import read_scalars
from tba_jax.trajectories import Trajectory

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_SECONDS = 300  # stops a hung test; every run here takes well under a minute alone
DEAD_PROCESS_SECONDS = 30  # the bound: one process killed ends the others by then
# A quick smoke run: 4 learner steps, a short warm start, few held-out prompts.
SMOKE = "configs/arithmetic.py:smoke,warm_start.steps=1,eval.num_examples=4,eval.batch_size=4"
STEP_CHECK = os.path.join(REPO_ROOT, "tests", "multiprocess_step_check.py")
EXIT_CHECK = os.path.join(REPO_ROOT, "tests", "multiprocess_exit_check.py")


# ------------------------------------------------------------------------ pure parts


def trajectory(prompt_id: int, prompt_len: int, response_len: int, version: int) -> Trajectory:
    rng = np.random.default_rng(prompt_id)
    behaviour = rng.normal(size=response_len).astype(np.float32)
    reference = rng.normal(size=response_len).astype(np.float32)
    return Trajectory(
        prompt_id=prompt_id,
        prompt_tokens=rng.integers(1, 50, prompt_len).astype(np.int32),
        response_tokens=rng.integers(1, 50, response_len).astype(np.int32),
        reward=float(rng.normal()),
        logp_behaviour=float(behaviour.sum()),
        logp_ref=float(reference.sum()),
        token_logp_behaviour=behaviour,
        token_logp_ref=reference,
        policy_version=version,
        created_at=time.time() - 10.0 - prompt_id,
        policy_version_last=version + prompt_id % 2,  # some finished on newer params
    )


def test_a_block_gives_back_the_trajectories_packed_into_it():
    sent = [trajectory(3, 4, 6, version=2), trajectory(9, 7, 1, version=5)]
    block = exchange.pack_block(sent, rows=4, max_prompt_len=8, max_response_len=6)
    assert all(len(value) == 4 for value in block.values())
    received = exchange.unpack_block(block)
    assert len(received) == 2
    for got, want in zip(received, sent, strict=True):
        assert got.prompt_id == want.prompt_id and got.policy_version == want.policy_version
        assert got.policy_version_last == want.policy_version_last
        np.testing.assert_array_equal(got.prompt_tokens, want.prompt_tokens)
        np.testing.assert_array_equal(got.response_tokens, want.response_tokens)
        np.testing.assert_array_equal(got.token_logp_ref, want.token_logp_ref)
        assert got.reward == pytest.approx(want.reward)
        assert got.logp_behaviour == pytest.approx(want.logp_behaviour, rel=1e-6)
        assert got.created_at == pytest.approx(want.created_at, abs=0.5)  # sent as an age


def test_a_block_refuses_more_trajectories_than_rows():
    with pytest.raises(ValueError, match="do not fit a block of 1 rows"):
        exchange.pack_block([trajectory(1, 2, 2, 0)] * 2, 1, 4, 4)


def test_blocks_of_takes_only_the_named_processes_in_order():
    blocks = [
        exchange.pack_block([trajectory(p, 2, 2, p)], 2, 4, 4) for p in range(3)
    ]  # process p sent prompt p
    gathered = {name: np.stack([b[name] for b in blocks]) for name in exchange.BLOCK_FIELDS}
    assert [t.prompt_id for t in exchange.blocks_of(gathered, [2, 1])] == [2, 1]


def test_the_outbox_sends_its_newest_samples_and_drops_its_oldest_when_full():
    outbox = exchange.Outbox(capacity=3)
    outbox.add([trajectory(i, 2, 2, 0) for i in range(5)])
    assert outbox.dropped == 2 and len(outbox) == 3
    assert [t.prompt_id for t in outbox.take(2)] == [3, 4]  # the newest, oldest first
    assert [t.prompt_id for t in outbox.take(5)] == [2]


def test_each_learner_is_fed_by_every_lth_searcher():
    assert exchange.searchers_of(0, 2, [2, 3, 4, 5]) == [2, 4]
    assert exchange.searchers_of(1, 2, [2, 3, 4, 5]) == [3, 5]


def layout_config(**changes) -> ml_collections.ConfigDict:
    config = get_config("smoke")
    for key, value in changes.items():
        section, name = key.split("__")
        config[section][name] = value
    return config


def test_roles_by_process_makes_the_first_processes_learners():
    config = layout_config(
        distributed__topology="roles_by_process", distributed__learner_processes=2
    )
    layout = topology.make_topology(config, num_processes=4, process_index=3)
    assert layout.learner_processes == (0, 1) and layout.searcher_processes == (2, 3)
    assert layout.is_searcher and not layout.is_learner and layout.searcher_rank == 1
    assert layout.describe() == {
        "topology": "roles_by_process",
        "num_processes": 4,
        "learner_processes": 2,
        "searcher_processes": 2,
    }


class ScriptedRounds:
    """exchange.exchange_round for learner process 0 of 4 (learners 0 and 1, searchers 2
    and 3; 2 feeds 0): each round answers with the next scripted (learner 1's ready, its
    prompts, searcher 2 asks to stop, the trajectories searcher 2 sends), and keeps what
    process 0 sent."""

    def __init__(self, config, script):
        self.config, self.script, self.sent = config, list(script), []

    def __call__(self, mesh, flags, block):
        self.sent.append(flags.copy())
        ready, prompts, stop, fresh = self.script.pop(0)
        all_flags = np.zeros((4, exchange.NUM_FLAGS), np.int64)
        all_flags[0] = flags
        all_flags[1, exchange.FLAG_READY], all_flags[1, exchange.FLAG_PROMPTS] = ready, prompts
        all_flags[2, exchange.FLAG_STOP] = stop
        searcher = exchange.pack_block(
            fresh, len(block["prompt_id"]), self.config.max_prompt_len, self.config.max_response_len
        )
        sent_by = [block, block, searcher, block]  # the learners' and searcher 3's are empty
        blocks = {name: np.stack([sent[name] for sent in sent_by]) for name in block}
        return all_flags, blocks

    def sent_flags(self, flag: int) -> list[int]:
        return [int(flags[flag]) for flags in self.sent]


def remote_source_with_stale_prompts(monkeypatch, script):
    """Learner process 0's RemoteSource (max_policy_lag 1, min_prompts 2, 10 steps) whose
    buffer holds prompts 0 and 1 of version 0 and prompt 2 of version 4, rounds scripted."""
    from tba_jax.by_process import RemoteSource
    from tba_jax.run_totals import Meters
    from tba_jax.sources import make_replay_buffer

    config = layout_config(
        distributed__topology="roles_by_process",
        distributed__learner_processes=2,
        replay__max_policy_lag=1,
        replay__min_prompts=2,
    )
    config.learner_steps = 10
    layout = topology.make_topology(config, num_processes=4, process_index=0)
    buffer = make_replay_buffer(config, pad_id=0)
    buffer.add([trajectory(p, 3, 4, version) for p, version in [(0, 0), (1, 0), (2, 4)]])
    rounds = ScriptedRounds(config, script)
    monkeypatch.setattr(exchange, "exchange_round", rounds)
    source = RemoteSource(
        config, layout, None, exchange_mesh=None, params=None, reference=None, version=0,
        buffer=buffer, meters=Meters(), pad_id=0,
    )  # fmt: skip
    return source, buffer, rounds


def test_a_learner_takes_rounds_until_every_learner_holds_fresh_prompts(monkeypatch):
    fresh = [trajectory(5, 3, 4, version=4)]
    script = [(1, 2, 0, []), (1, 2, 0, fresh)] + [(1, 2, 0, [])] * 3
    source, buffer, rounds = remote_source_with_stale_prompts(monkeypatch, script)
    source.next_batch(4)  # versions below 3 are stale: prompt 2 alone is left
    assert source.dropped_stale == 2 and buffer.num_prompts == 2  # prompt 5 came meanwhile
    # rounds until it held 2 fresh prompts before one (that round ends the wait), then the
    # step's own, which says whether it holds enough for the next step (versions 3 and 4:
    # both fresh for step 5)
    assert rounds.sent_flags(exchange.FLAG_READY) == [0, 0, 1, 1]
    assert rounds.sent_flags(exchange.FLAG_PROMPTS) == [1, 1, 2, 2]
    assert rounds.sent_flags(exchange.FLAG_NEXT) == [exchange.NEXT_ROUND] * 4
    source.next_batch(5)  # every learner said so: the step's round alone, nothing dropped
    assert len(rounds.sent) == 5 and source.dropped_stale == 2


@pytest.mark.parametrize("other_prompts", [0, 1])
def test_a_stop_while_learners_wait_trains_only_if_each_holds_a_prompt(monkeypatch, other_prompts):
    source, _, rounds = remote_source_with_stale_prompts(monkeypatch, [(0, other_prompts, 1, [])])
    if other_prompts:  # both hold a prompt: the step trains on what they have
        assert source.next_batch(4).prompt_ids.tolist() == [2, 2]  # the one fresh prompt
    else:
        with pytest.raises(RunStopped, match="waited for fresh samples"):
            source.next_batch(4)
    assert len(rounds.sent) == 1  # the searcher processes are gone after a stop: no more


def test_roles_within_host_gives_every_process_both_roles():
    layout = topology.make_topology(layout_config(), num_processes=2, process_index=1)
    assert layout.is_learner and layout.is_searcher and not layout.is_primary
    single = topology.make_topology(layout_config(), num_processes=1, process_index=0)
    assert single.name == topology.SINGLE_PROCESS and not single.multi_process


@pytest.mark.parametrize(
    ("changes", "processes", "message"),
    [
        (
            {"distributed__topology": "roles_by_process", "distributed__learner_processes": 2},
            2,
            "must leave at least one of the 2 processes to search",
        ),
        (
            {"distributed__topology": "roles_by_process", "distributed__learner_processes": 2},
            3,
            "at least as many searcher processes as learner processes",
        ),
        ({"batch__prompts_per_batch": 6}, 4, "does not split over 4 processes"),
    ],
)
def test_a_layout_that_cannot_work_is_a_config_error(changes, processes, message):
    with pytest.raises(ConfigError, match=message):
        topology.make_topology(layout_config(**changes), num_processes=processes, process_index=0)


def test_a_pod_or_a_slurm_job_is_detected_from_its_environment():
    assert distributed.cluster_detected({"TPU_WORKER_HOSTNAMES": "a,b,c"}) == "TPU pod"
    assert distributed.cluster_detected({"TPU_WORKER_HOSTNAMES": "a"}) is None
    assert distributed.cluster_detected({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "4"}) == "SLURM"
    assert distributed.cluster_detected({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "1"}) is None
    assert distributed.cluster_detected({}) is None


def test_the_process_flags_go_together():
    distributed.check_flags(None, None, None)
    distributed.check_flags("localhost:1234", 2, 1)
    with pytest.raises(ValueError, match="go together"):
        distributed.check_flags("localhost:1234", 2, None)
    with pytest.raises(ValueError, match=r"must be in 0\.\.1"):
        distributed.check_flags("localhost:1234", 2, 2)


def test_a_host_name_that_does_not_resolve_is_named_before_gloo_fails(monkeypatch):
    distributed.check_host_name_resolves()  # this machine's does
    monkeypatch.setattr(socket, "gethostname", lambda: "no-such-host.invalid")
    with pytest.raises(ValueError, match=r"'127\.0\.0\.1 no-such-host\.invalid' to /etc/hosts"):
        distributed.check_host_name_resolves()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # as the launcher's CPU processes have it
    with pytest.raises(ValueError, match="does not resolve"):  # before jax.distributed
        distributed.initialize("localhost:1234", 2, 0)


# ------------------------------------------------------------------- several processes


def launch(num_processes: int, *program: str, devices: int = 1, grace_s: int = 15, **popen):
    """`python -m tba_jax.launch --num_processes=N -- <program>` from the repo root."""
    command = [
        sys.executable,
        "-m",
        "tba_jax.launch",
        f"--num_processes={num_processes}",
        f"--devices_per_process={devices}",
        f"--grace_s={grace_s}",
        "--",
        *program,
    ]
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    return subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, text=True, stdout=subprocess.PIPE, **popen
    )


def train_command(workdir, *overrides: str, config: str = SMOKE) -> list[str]:
    return ["experiments/train.py", f"--config={config}", f"--workdir={workdir}", *overrides]


def pids_matching(pattern: str) -> list[int]:
    """The processes whose command line matches `pattern` (as `pgrep -f` finds them, read
    from /proc, so the test needs no procps)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):  # not a process, or one that has just ended
            continue
        if re.search(pattern, command):
            found.append(int(entry))
    return found


def finish(process: subprocess.Popen) -> tuple[int, str, str]:
    stdout, stderr = process.communicate(timeout=RUN_SECONDS)
    return process.returncode, stdout, stderr or ""


def summary_of(workdir) -> dict:
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)


def test_processes_exit_cleanly_while_their_failure_watchers_poll(tmp_path):
    code, stdout, stderr = finish(launch(2, EXIT_CHECK, stderr=subprocess.PIPE))
    assert code == 0, (stdout + stderr)[-2000:]
    assert "not rethrown" not in stdout + stderr


def test_a_learner_step_over_two_processes_equals_the_single_process_step(tmp_path):
    one, two = tmp_path / "one.npz", tmp_path / "two.npz"
    single = subprocess.run(
        [sys.executable, STEP_CHECK, str(one)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_SECONDS,
    )
    assert single.returncode == 0, single.stderr[-2000:]
    code, _, stderr = finish(launch(2, STEP_CHECK, str(two), stderr=subprocess.PIPE))
    assert code == 0, stderr[-2000:]
    alone, spread = np.load(one), np.load(two)
    trained = [name for name in alone.files if not name.startswith("initial")]
    assert trained and set(alone.files) == set(spread.files)
    for name in trained:
        moved = np.abs(alone[name] - alone["initial" + name]).max()
        assert moved > 1e-6, f"{name} did not change: the check would prove nothing"
        np.testing.assert_allclose(spread[name], alone[name], rtol=0, atol=moved * 1e-3)


def test_roles_within_host_trains_over_two_processes_and_refuses_one(tmp_path):
    workdir = tmp_path / "run"
    code, _, stderr = finish(launch(2, *train_command(workdir), devices=2, stderr=subprocess.PIPE))
    assert code == 0, stderr[-3000:]
    summary = summary_of(workdir)
    assert summary["num_processes"] == 2 and summary["topology"] == "roles_within_host"
    assert summary["learner_steps"] == 4 and summary["num_devices"] == 4
    assert summary["learner_processes"] == 2 and summary["samples_generated"] > 0
    assert "[p0] Finished 4 learner steps" in stderr  # absl logs on stderr
    assert "[p1] Finished" not in stderr  # process 0 reports for the run
    # resuming with another process count: one line, before any work
    before = sorted(os.listdir(workdir / "checkpoints"))
    alone = subprocess.run(
        [sys.executable, *train_command(workdir, "--config.learner_steps=8")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_SECONDS,
    )
    assert alone.returncode == 1
    assert re.fullmatch(r"error: .*processes: \{.*num_processes.*'<absent>'.*\n", alone.stderr)
    assert sorted(os.listdir(workdir / "checkpoints")) == before
    # ...while the tools that only read it (evaluation, export) take it in one process
    assert evaluate.latest_checkpoint_step(runs.load_config(str(workdir)), str(workdir)) == 4


def test_roles_by_process_saves_on_sigterm_and_resumes(tmp_path):
    workdir = tmp_path / "run"
    command = train_command(
        workdir, "--config.distributed.topology=roles_by_process", "--config.learner_steps=400"
    )
    run = launch(2, *command, stderr=subprocess.STDOUT)
    for line in run.stdout:  # wait until training is under way
        if re.match(r"\[p0\] step \d+/400", line):
            break
    run.send_signal(signal.SIGTERM)  # a preemption: every process gets it
    code, rest, _ = finish(run)
    assert code == 128 + signal.SIGTERM, rest[-3000:]  # stopped, not finished
    assert "stopped and saved" in rest
    saved = max(int(name) for name in os.listdir(workdir / "checkpoints") if name.isdigit())
    assert 0 < saved < 400
    assert not os.path.exists(workdir / "summary.json")
    short = train_command(
        workdir,
        "--config.distributed.topology=roles_by_process",
        "--config.learner_steps=" + str(saved + 4),
    )
    code, _, stderr = finish(launch(2, *short, stderr=subprocess.PIPE))
    assert code == 0, stderr[-3000:]
    assert f"Resuming from step {saved}" in stderr
    # the learner process compiled its step between the start broadcast and the rounds
    assert re.search(r"\[p0\].*Compiled the learner step", stderr)
    summary = summary_of(workdir)
    assert summary["learner_steps"] == saved + 4
    assert summary["topology"] == "roles_by_process" and summary["searcher_processes"] == 1
    assert summary["exchange_seconds_per_step"] > 0 and summary["mean_policy_lag"] > 0


def test_roles_by_process_bounds_the_policy_lag(tmp_path):
    workdir = tmp_path / "run"
    command = train_command(
        workdir,
        "--config.distributed.topology=roles_by_process",
        "--config.learner_steps=12",
        "--config.replay.max_policy_lag=1",
    )
    code, _, stderr = finish(launch(2, *command, stderr=subprocess.PIPE))
    assert code == 0, stderr[-3000:]
    summary = summary_of(workdir)
    assert summary["learner_steps"] == 12 and summary["searcher_processes"] == 1
    assert summary["max_policy_lag"] <= 1
    dropped = dict(read_scalars(os.path.join(workdir, "tensorboard"))["samples_dropped_stale"])
    assert sorted(dropped)[-1] == 12 and dropped[12] > 0  # the bound took samples out


def test_roles_by_process_sync_over_four_processes(tmp_path):
    """Sync VinePPO: the searcher processes make each batch, the two learner processes
    roll out its step starts on their own devices."""
    workdir = tmp_path / "run"
    command = train_command(
        workdir,
        "--config.distributed.topology=roles_by_process",
        "--config.distributed.learner_processes=2",
        # 150 warm-start steps leave some first samples rewarded (3: nearly none)
        config=SMOKE + ",mode=sync,method=vineppo,warm_start.steps=150",
    )
    code, _, stderr = finish(launch(4, *command, stderr=subprocess.PIPE))
    assert code == 0, stderr[-3000:]
    summary = summary_of(workdir)
    assert summary["num_processes"] == 4 and summary["learner_processes"] == 2
    assert summary["mean_policy_lag"] == 0 and summary["max_policy_lag"] == 0
    # B=4 prompts × K=4 fresh samples per step from the two searcher processes
    assert summary["samples_generated"] == 4 * 4 * 4
    # (VinePPO's step reads the advantages added after sampling, so it is not compiled
    # ahead: the async test above checks that the learners compile while searchers work)
    scalars = read_scalars(os.path.join(workdir, "tensorboard"))
    assert any(value > 0 for _, value in scalars["advantage_std"])  # the rollouts ran


def test_a_killed_process_ends_the_others(tmp_path):
    workdir = tmp_path / "run"
    command = train_command(
        workdir, "--config.distributed.topology=roles_by_process", "--config.learner_steps=400"
    )
    # a long grace period: process 0 must end through JAX's heartbeats, not the launcher
    run = launch(2, *command, grace_s=RUN_SECONDS, stderr=subprocess.STDOUT)
    for line in run.stdout:
        if re.match(r"\[p0\] step \d+/400", line):
            break
    searcher = pids_matching(rf"workdir={re.escape(str(workdir))} .*--process_id=1")
    assert len(searcher) == 1
    killed_at = time.monotonic()
    os.kill(searcher[0], signal.SIGKILL)
    code, rest, _ = finish(run)
    assert time.monotonic() - killed_at < DEAD_PROCESS_SECONDS
    assert code != 0
    # process 0 ends on its own: its collective with the dead process fails (gloo), or
    # JAX's heartbeats report the process unhealthy; the launcher then reports both
    assert "launch: process" in rest and "[p0]" in rest
    assert any(cause in rest for cause in ("Connection reset", "unhealthy", "failed"))
