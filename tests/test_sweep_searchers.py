"""experiments/sweep_searchers.py's bookkeeping with training and evaluation stood in for
(no model runs, seconds): the rows of earlier calls kept, a refused workdir's advice, and
SIGTERM between runs, after a run's last safe point and while the evaluation runs."""

import json
import os
import signal
import textwrap
import threading
import time

import pytest

from configs import redteam_gpt2
from experiments import sweep_searchers
from tba_jax import checkpoint
from tba_jax.checkpoint import CheckpointMismatchError, RunStopped, WorkdirInUseError

CHILD_WAIT_S = 10  # how long the stand-in evaluation waits for a signal before failing


@pytest.fixture
def config():
    return redteam_gpt2.get_config("tiny")


@pytest.fixture
def sigterm_ignored():
    """SIGTERM does nothing where the sweep does not handle it (the code before the fix let
    it end pytest); the handler before is back afterwards. Yields the handler."""

    def ignore(signum, frame):
        del signum, frame

    previous = signal.signal(signal.SIGTERM, ignore)
    yield ignore
    signal.signal(signal.SIGTERM, previous)


class StandIns:
    """`train_and_evaluate` and `evaluate_in_subprocess` of the sweep stood in for: each run
    returns a summary at once (its count as wall_seconds), each evaluation `toxic_percent`
    (its count times `score`); hooks run inside them."""

    def __init__(self, monkeypatch):
        self.trained, self.evaluated, self.score = [], [], 1.0
        self.handlers_in_training = []  # SIGTERM's, before the run installs its own
        self.fail_on: dict[int, Exception] = {}
        self.in_training_tail: dict[int, object] = {}  # count -> hook, after the last check
        self.in_evaluation: dict[int, object] = {}
        monkeypatch.setattr(sweep_searchers, "train_and_evaluate", self.train)
        monkeypatch.setattr(sweep_searchers, "evaluate_in_subprocess", self.evaluate)

    def train(self, config, workdir):
        num_searchers = config.search.num_searchers
        if num_searchers in self.fail_on:
            raise self.fail_on[num_searchers]
        os.makedirs(workdir, exist_ok=True)
        self.trained.append(num_searchers)
        self.handlers_in_training.append(signal.getsignal(signal.SIGTERM))
        with checkpoint.stop_on_signals():  # as train_and_evaluate holds its own
            if num_searchers in self.in_training_tail:
                self.in_training_tail[num_searchers]()
        return {"wall_seconds": float(num_searchers), "learner_steps": 4}

    def evaluate(self, workdir, eval_flags, stop_signal=None):
        num_searchers = int(workdir.rsplit("_", 1)[1])
        self.evaluated.append(num_searchers)
        if num_searchers in self.in_evaluation:
            self.in_evaluation[num_searchers]()
        return {"toxic_percent": self.score * num_searchers, "num_attacks": 32}


def sigterm_to_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def written_runs(root) -> list[tuple[int, float]]:
    sweep = json.loads((root / sweep_searchers.SWEEP_FILENAME).read_text())
    return [(run["num_searchers"], run["toxic_percent"]) for run in sweep["runs"]]


def test_reruns_merge_their_rows_and_a_failed_one_keeps_them(config, tmp_path, monkeypatch):
    runs = StandIns(monkeypatch)
    sweep_searchers.run_sweep(config, str(tmp_path), [1, 2], eval_flags=[])
    assert written_runs(tmp_path) == [(1, 1.0), (2, 2.0)]

    runs.score = 10.0  # a rerun of a subset replaces its rows only; sorted by count
    sweep = sweep_searchers.run_sweep(config, str(tmp_path), [4, 2], eval_flags=[])
    assert written_runs(tmp_path) == [(1, 1.0), (2, 20.0), (4, 40.0)]
    assert [run["num_searchers"] for run in sweep["runs"]] == [1, 2, 4]

    before = (tmp_path / sweep_searchers.SWEEP_FILENAME).read_text()
    runs.fail_on[1] = ValueError("/tmp/nope is not a folder")  # e.g. a bad judge path
    with pytest.raises(ValueError, match="nope"):
        sweep_searchers.run_sweep(config, str(tmp_path), [1, 8], eval_flags=[])
    assert (tmp_path / sweep_searchers.SWEEP_FILENAME).read_text() == before

    del runs.fail_on[1]  # a failure after a finished run: that run's row is written
    runs.fail_on[8] = RuntimeError("out of memory")
    with pytest.raises(RuntimeError):
        sweep_searchers.run_sweep(config, str(tmp_path), [1, 8], eval_flags=[])
    assert written_runs(tmp_path) == [(1, 10.0), (2, 20.0), (4, 40.0)]


def test_a_first_run_that_fails_in_a_new_root_writes_an_empty_sweep(config, tmp_path, monkeypatch):
    StandIns(monkeypatch).fail_on[1] = ValueError("bad knob")
    with pytest.raises(ValueError):
        sweep_searchers.run_sweep(config, str(tmp_path), [1], eval_flags=[])
    assert written_runs(tmp_path) == []


def test_a_config_its_runs_would_refuse_is_refused_before_the_sweep_writes(
    config, tmp_path, monkeypatch
):
    """Every run's config is checked as train.py checks it before the first trains: the
    victim's template alone overruns its max_prompt_len (found in the task's checks, which
    until 2026-11-29 came as the first run built its task, after the sweep's folder and an
    empty sweep were written)."""
    runs = StandIns(monkeypatch)
    config.task.victim.max_prompt_len = 10
    root = tmp_path / "root"
    with pytest.raises(sweep_searchers.ConfigError, match=r"raise task\.victim\.max_prompt_len"):
        sweep_searchers.run_sweep(config, str(root), [1, 2], eval_flags=[])
    assert not root.exists() and runs.trained == []


def test_a_workdir_of_another_experiment_is_refused_with_the_sweeps_flag(
    config, tmp_path, monkeypatch
):
    runs = StandIns(monkeypatch)
    sweep_searchers.run_sweep(config, str(tmp_path), [1], eval_flags=[])
    directory = tmp_path / "searchers_2" / "checkpoints"
    runs.fail_on[2] = CheckpointMismatchError(  # what checkpoint.py says to train.py
        f"Workdir {directory.parent} holds checkpoints of another experiment (held vs "
        f"asked: seed: 0 vs 1); pass another --workdir, or delete {directory.parent} to start "
        "over (the whole folder: its warm start and logs are the other experiment's too)."
    )
    with pytest.raises(CheckpointMismatchError) as refused:
        sweep_searchers.run_sweep(config, str(tmp_path), [2], eval_flags=[])
    assert "pass another --workdir_root, or delete" in str(refused.value)
    assert "--workdir " not in str(refused.value)
    assert written_runs(tmp_path) == [(1, 1.0)]

    runs.fail_on[2] = WorkdirInUseError(  # what checkpoint.WorkdirLock says to train.py
        f"--workdir={directory.parent} is in use by another run on this machine (one still "
        "training in it); wait for it to end, or pass another --workdir."
    )
    with pytest.raises(WorkdirInUseError) as refused:
        sweep_searchers.run_sweep(config, str(tmp_path), [2], eval_flags=[])
    assert str(refused.value) == (
        f"workdir {directory.parent} is in use by another run on this machine (one still "
        "training in it); wait for it to end, or pass another --workdir_root."
    )


def test_sigterm_between_runs_stops_the_sweep_with_the_rows_so_far(
    config, tmp_path, monkeypatch, sigterm_ignored
):
    runs = StandIns(monkeypatch)
    runs.in_evaluation[1] = sigterm_to_self  # the sweep's own time, not a run's
    with pytest.raises(RunStopped) as stopped:
        sweep_searchers.run_sweep(config, str(tmp_path), [1, 2], eval_flags=[])
    assert stopped.value.exit_status == 128 + signal.SIGTERM
    assert runs.trained == [1] and written_runs(tmp_path) == [(1, 1.0)]
    # a run's training, until it installs its own: the sweep's (whose stop the SIGTERM set);
    # after the sweep: the one before
    (in_training,) = runs.handlers_in_training
    assert in_training.stop_signal.reason == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is sigterm_ignored


@pytest.mark.usefixtures("sigterm_ignored")
def test_sigterm_after_a_runs_last_safe_point_is_not_swallowed(config, tmp_path, monkeypatch):
    runs = StandIns(monkeypatch)
    runs.in_training_tail[2] = sigterm_to_self  # e.g. while its final save is finishing
    with pytest.raises(RunStopped) as stopped:
        sweep_searchers.run_sweep(config, str(tmp_path), [1, 2, 3], eval_flags=[])
    assert stopped.value.exit_status == 128 + signal.SIGTERM
    # run 2 is trained (its rerun reads it back) but not evaluated; run 3 never starts
    assert runs.trained == [1, 2] and runs.evaluated == [1]
    assert written_runs(tmp_path) == [(1, 1.0)]


STAND_IN_EVALUATE = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    workdir = pathlib.Path(sys.argv[1].split("=", 1)[1])

    def stop(signum, frame):
        (workdir / "child_got").write_text(str(signum))
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    (workdir / "child_started").write_text(str(os.getpid()))
    time.sleep({wait})
    sys.exit(1)  # no signal came
    """
)


@pytest.mark.usefixtures("sigterm_ignored")
def test_sigterm_while_evaluating_is_passed_to_the_evaluation_then_stops(
    config, tmp_path, monkeypatch
):
    real_evaluate = sweep_searchers.evaluate_in_subprocess
    StandIns(monkeypatch)
    sweep_searchers.run_sweep(config, str(tmp_path), [1], eval_flags=[])
    # the real evaluate_in_subprocess, of a stand-in evaluate.py
    monkeypatch.setattr(sweep_searchers, "evaluate_in_subprocess", real_evaluate)
    script = tmp_path / "evaluate.py"
    script.write_text(STAND_IN_EVALUATE.format(wait=CHILD_WAIT_S))
    monkeypatch.setattr(sweep_searchers, "EVALUATE_SCRIPT", str(script))
    started = tmp_path / "searchers_2" / "child_started"

    def sigterm_once_the_child_runs():
        while not started.exists():
            time.sleep(0.05)
        sigterm_to_self()

    threading.Thread(target=sigterm_once_the_child_runs, daemon=True).start()
    began = time.monotonic()
    with pytest.raises(RunStopped) as stopped:
        sweep_searchers.run_sweep(config, str(tmp_path), [2], eval_flags=[])
    assert time.monotonic() - began < CHILD_WAIT_S  # the child did not wait it out
    assert stopped.value.exit_status == 128 + signal.SIGTERM
    assert (tmp_path / "searchers_2" / "child_got").read_text() == str(signal.SIGTERM)
    child = int(started.read_text())
    with pytest.raises(ProcessLookupError):  # ended and reaped, not left running
        os.kill(child, 0)
    assert written_runs(tmp_path) == [(1, 1.0)]


def test_an_evaluation_that_refuses_its_flags_is_one_line_that_keeps_the_runs(
    tmp_path, monkeypatch
):
    """evaluate.py ending with its one error line (a bad --eval_flags item) is the sweep's
    own one-line error, which says the trained runs are read back on the next try."""
    script = tmp_path / "evaluate.py"
    script.write_text(
        "import sys\nprint('error: num_examples=-1 must be >= 0 (0: all).', file=sys.stderr)\n"
        "sys.exit(1)\n"
    )
    monkeypatch.setattr(sweep_searchers, "EVALUATE_SCRIPT", str(script))
    with pytest.raises(sweep_searchers.ConfigError) as refused:
        sweep_searchers.evaluate_in_subprocess(str(tmp_path), ["--num_examples=-1"])
    message = str(refused.value)
    assert "refused the evaluation" in message and "num_examples=-1 must be >= 0" in message
    assert "read back, not trained again" in message and "\n" not in message
    script.write_text("import sys\nsys.exit(3)\n")  # anything else stays a failure
    with pytest.raises(RuntimeError, match="exit 3"):
        sweep_searchers.evaluate_in_subprocess(str(tmp_path), [])
