"""python -m tba_jax.launch as a user runs it: small plain-Python programs (no JAX) show the
prefixed output, the command lines and environments, failure handling, signal forwarding and
CPU pinning; two real JAX processes join through tba_jax.distributed, gather, and end
together when one fails. Unit tests of the launcher's pure helpers follow."""

from __future__ import annotations

import io
import json
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tba_jax import cli, launch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_SECONDS = 60  # every launch here ends in seconds; this only stops a hung test
READY_SECONDS = 30
SHORT_GRACE_S = 1.0
# A failure ends the run within the grace period plus the launcher's own start and polling
# (generous: a loaded CI machine starts Python slowly), far below the survivor's sleep.
FAILURE_SECONDS = SHORT_GRACE_S + 20
# One failing JAX process ends the other through tba_jax.distributed's watcher.
JAX_FAILURE_SECONDS = 20
LINE_PREFIX = re.compile(r"^\[p(\d+)\] (.*)$")

# Prints its arguments and the environment the launcher gave it, as one JSON line.
REPORT_PROGRAM = """
import json, os, sys
names = ("XLA_FLAGS", "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
print(json.dumps({
    "argv": sys.argv[1:],
    "env": {name: os.environ.get(name) for name in names},
    "cores": sorted(os.sched_getaffinity(0)),
}))
"""
# Many long lines on stdout and a few on stderr, the last without a newline.
CHATTY_PROGRAM = """
import sys
for i in range(1000):
    print(f"line {i} " + "x" * 300)
print("to stderr", file=sys.stderr)
sys.stdout.write("last line without newline")
"""
# Process 1 fails at once; process 0 would sleep for a minute.
FAILING_PROGRAM = """
import sys, time
if sys.argv[-1] == "--process_id=1":
    sys.exit(3)
print("sleeping", flush=True)
time.sleep(120)
"""
# Says it is ready, then waits for a signal; on SIGTERM or SIGINT it "saves" and exits 0.
# Saves and exits 128 + the signal, as a stopped training run does; process 1 takes longer
# than the launcher's grace, which a stop (unlike a failure) must leave it.
TRAPPING_PROGRAM = """
import signal, sys, time
def stop(signum, frame):
    if "--process_id=1" in sys.argv:
        time.sleep(3)
    print("saved on", signal.Signals(signum).name, flush=True)
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
print("ready", flush=True)
time.sleep(60)
"""
# Joins the run from the launcher's flags and gathers every process's index; with --fail,
# process 1 raises after joining and process 0 sleeps (ended by the failure's broadcast);
# with --fail_first, process 0 (the coordination service's host) raises at once and
# process 1 a second later, as a config error that every process finds does.
JAX_PROGRAM = """
import sys, time
import jax
import numpy as np
from absl import flags
from tba_jax import distributed

flags.DEFINE_bool("fail", False, "Process 1 raises after joining.")
flags.DEFINE_bool("fail_first", False, "Process 0 raises at once, process 1 a second later.")
distributed.define_flags()
flags.FLAGS(sys.argv)
distributed.initialize_from_flags()
if flags.FLAGS.fail_first:
    time.sleep(jax.process_index())
    distributed.fail_all("ValueError: a bad config")
if flags.FLAGS.fail:
    if jax.process_index() == 1:
        try:
            1 / 0
        except ZeroDivisionError as error:  # as tba_jax.cli.run reports a failure
            distributed.fail_all(f"{type(error).__name__}: {error}")
    time.sleep(60)
gathered = distributed.allgather(np.asarray(jax.process_index()))
sys.stdout.write(f"gathered {gathered.tolist()} devices {jax.device_count()}\\n")  # one write
"""


def write_program(tmp_path, text: str) -> str:
    path = tmp_path / "program.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


def launcher_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tba_jax.launch", *args]


def launcher_env(**changes: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run_launcher(*args: str, env: dict[str, str] | None = None, timeout: float = RUN_SECONDS):
    return subprocess.run(
        launcher_command(*args),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env or launcher_env(),
        timeout=timeout,
    )


def lines_by_process(text: str) -> dict[int, list[str]]:
    """{process index: its lines} of the launcher's output (every line must be prefixed)."""
    lines: dict[int, list[str]] = {}
    for line in text.splitlines():
        found = LINE_PREFIX.match(line)
        assert found, f"a line without a process prefix: {line!r}"
        lines.setdefault(int(found.group(1)), []).append(found.group(2))
    return lines


def reports(result: subprocess.CompletedProcess) -> dict[int, dict]:
    """{process index: the JSON report REPORT_PROGRAM printed}."""
    assert result.returncode == 0, result.stderr
    return {index: json.loads(lines[0]) for index, lines in lines_by_process(result.stdout).items()}


# --------------------------------------------------------------------------------------
# The command line.
# --------------------------------------------------------------------------------------


def test_help_exits_0_and_names_the_flags():
    result = run_launcher("--help")
    assert result.returncode == 0, result.stderr
    for name in ("num_processes", "devices_per_process", "gpus_per_process", "pin_cpus"):
        assert f"--{name}" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num_processes=2"], "no program to run"),
        (["--num_processes=2", "--"], "no program to run"),
        (["--num_processes=0", "--", "program.py"], "--num_processes=0 must be >= 1"),
        (["--", "program.py"], "--num_processes is required"),
    ],
)
def test_a_mistake_is_one_error_line(args, message):
    result = run_launcher(*args)
    assert result.returncode == cli.USER_ERROR_EXIT_STATUS
    assert result.stdout == ""
    assert result.stderr.splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("error: ") and message in result.stderr


# --------------------------------------------------------------------------------------
# What each process gets and prints.
# --------------------------------------------------------------------------------------


def test_every_line_is_whole_and_prefixed_with_its_process(tmp_path):
    result = run_launcher("--num_processes=2", "--", write_program(tmp_path, CHATTY_PROGRAM))
    assert result.returncode == 0, result.stderr
    expected = [f"line {i} " + "x" * 300 for i in range(1000)] + ["last line without newline"]
    assert lines_by_process(result.stdout) == {0: expected, 1: expected}
    stderr = [line for line in result.stderr.splitlines() if not line.startswith("launch: ")]
    assert sorted(stderr) == ["[p0] to stderr", "[p1] to stderr"]


def test_cpu_processes_get_their_flags_and_device_count(tmp_path):
    env = launcher_env(
        XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/dump",
        JAX_PLATFORMS=None,
    )
    program = write_program(tmp_path, REPORT_PROGRAM)
    result = run_launcher(
        "--num_processes=2",
        "--devices_per_process=2",
        "--port=12345",
        "--",
        program,
        "--a=1",
        env=env,
    )
    for index, report in reports(result).items():
        assert report["argv"] == [
            "--a=1",
            "--coordinator_address=localhost:12345",
            "--num_processes=2",
            f"--process_id={index}",
        ]
        assert report["env"]["XLA_FLAGS"] == (
            "--xla_dump_to=/tmp/dump --xla_force_host_platform_device_count=2"
        )
        assert report["env"]["JAX_PLATFORMS"] == "cpu"
    assert sorted(reports(result)) == [0, 1]


def test_a_free_port_is_picked_and_a_set_platform_kept(tmp_path):
    env = launcher_env(JAX_PLATFORMS="cpu,cuda")
    result = run_launcher(
        "--num_processes=2", "--", write_program(tmp_path, REPORT_PROGRAM), env=env
    )
    addresses = {report["argv"][0] for report in reports(result).values()}
    assert len(addresses) == 1
    port = int(addresses.pop().removeprefix("--coordinator_address=localhost:"))
    assert port > 0
    assert {report["env"]["JAX_PLATFORMS"] for report in reports(result).values()} == {"cpu,cuda"}


def test_gpu_processes_each_see_their_own_gpus(tmp_path):
    env = launcher_env(CUDA_VISIBLE_DEVICES=None, XLA_FLAGS=None, JAX_PLATFORMS=None)
    program = write_program(tmp_path, REPORT_PROGRAM)
    result = run_launcher("--num_processes=2", "--gpus_per_process=2", "--", program, env=env)
    found = {index: report["env"] for index, report in reports(result).items()}
    assert found[0]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert found[1]["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert found[0]["XLA_FLAGS"] is None and found[0]["JAX_PLATFORMS"] is None


def test_pin_cpus_binds_each_process_to_its_share_of_the_cores(tmp_path):
    program = write_program(tmp_path, REPORT_PROGRAM)
    result = run_launcher("--num_processes=2", "--pin_cpus", "--", program)
    shares = launch.cpu_shares(os.sched_getaffinity(0), 2)
    for index, report in reports(result).items():
        assert report["cores"] == shares[index]
        assert report["env"]["OMP_NUM_THREADS"] == str(len(shares[index]))
        assert "--xla_cpu_multi_thread_eigen=false" in report["env"]["XLA_FLAGS"].split()
    if len(os.sched_getaffinity(0)) >= 2:
        assert not set(shares[0]) & set(shares[1])


# --------------------------------------------------------------------------------------
# Failures and signals.
# --------------------------------------------------------------------------------------


def test_a_failure_stops_the_others_and_is_the_exit_status(tmp_path):
    program = write_program(tmp_path, FAILING_PROGRAM)
    started = time.monotonic()
    result = run_launcher("--num_processes=2", f"--grace_s={SHORT_GRACE_S}", "--", program)
    assert time.monotonic() - started < FAILURE_SECONDS
    assert result.returncode == 3
    notices = [line for line in result.stderr.splitlines() if line.startswith("launch: ")]
    assert "launch: process 1 exited with status 3; stopping the others" in notices
    assert any(line.startswith("launch: killing process 0") for line in notices)


def start_launcher(*args: str) -> tuple[subprocess.Popen, queue.Queue]:
    """The launcher running, and a queue of its stdout lines."""
    process = subprocess.Popen(
        launcher_command(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env=launcher_env(),
    )
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        with process.stdout:  # closed once the launcher's stdout ends
            for line in process.stdout:
                lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    return process, lines


def wait_for_lines(lines: queue.Queue, wanted: set[str], seconds: float) -> list[str]:
    """Reads lines until every line of `wanted` has come (fails after `seconds`)."""
    seen: list[str] = []
    deadline = time.monotonic() + seconds
    while not wanted <= {line.rstrip("\n") for line in seen}:
        seen.append(lines.get(timeout=max(0.0, deadline - time.monotonic())))
    return seen


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_reaches_every_process_which_saves_and_exits(tmp_path, signum):
    program = write_program(tmp_path, TRAPPING_PROGRAM)
    launcher, lines = start_launcher(
        "--num_processes=2", f"--grace_s={SHORT_GRACE_S}", "--", program
    )
    try:
        wait_for_lines(lines, {"[p0] ready", "[p1] ready"}, READY_SECONDS)
        launcher.send_signal(signum)
        saved = {f"[p{index}] saved on {signum.name}" for index in range(2)}
        wait_for_lines(lines, saved, READY_SECONDS)  # process 1 too: not killed
        assert launcher.wait(READY_SECONDS) == 128 + signum  # stopped, as a shell reports it
    finally:
        launcher.kill()
        launcher.wait()
    with launcher.stderr:
        assert f"launch: passing {signum.name} on" in launcher.stderr.read()


# --------------------------------------------------------------------------------------
# Real JAX processes.
# --------------------------------------------------------------------------------------


def test_two_jax_processes_join_and_gather(tmp_path):
    program = write_program(tmp_path, JAX_PROGRAM)
    result = run_launcher("--num_processes=2", "--devices_per_process=2", "--", program)
    assert result.returncode == 0, result.stderr
    # one write each, so Gloo's C++ threads (printing to the same stdout) cannot split them
    assert result.stdout.count("gathered [0, 1] devices 4") == 2, result.stdout
    assert "[Gloo]" not in result.stdout  # its connection notices are left out
    assert any(line.startswith("[p0] ") for line in result.stdout.splitlines())
    assert any(line.startswith("[p1] ") for line in result.stdout.splitlines())


def test_a_jax_process_failing_ends_the_other(tmp_path):
    program = write_program(tmp_path, JAX_PROGRAM)
    started = time.monotonic()
    # The grace period is long: process 0 must end through tba_jax.distributed, not a kill.
    result = run_launcher("--num_processes=2", f"--grace_s={RUN_SECONDS}", "--", program, "--fail")
    assert time.monotonic() - started < JAX_FAILURE_SECONDS
    assert result.returncode == 1
    stderr = result.stderr.splitlines()
    assert "[p1] error: ZeroDivisionError: division by zero" in stderr
    assert "[p0] error: process 1 failed: ZeroDivisionError: division by zero" in stderr
    assert not any(line.startswith("launch: killing") for line in stderr)


def test_the_coordinators_process_failing_first_leaves_last(tmp_path):
    program = write_program(tmp_path, JAX_PROGRAM)
    result = run_launcher("--num_processes=2", "--", program, "--fail_first")
    assert result.returncode == 1
    stderr = result.stderr.splitlines()
    assert "[p0] error: ValueError: a bad config" in stderr
    # process 1 ends with the error in one line, not a C++ abort for the service gone away
    assert "[p1] error: process 0 failed: ValueError: a bad config" in stderr, result.stderr
    assert "Terminating process" not in result.stderr and "Fatal" not in result.stderr


# --------------------------------------------------------------------------------------
# The helpers.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "existing, added, expected",
    [
        ("", ["--a=1"], "--a=1"),
        ("--a=2 --b=3", ["--a=1"], "--b=3 --a=1"),
        ("--b=3", ["--a=1", "--c=false"], "--b=3 --a=1 --c=false"),
    ],
)
def test_with_xla_flags_appends_and_replaces(existing, added, expected):
    assert launch.with_xla_flags(existing, added) == expected


@pytest.mark.parametrize(
    "cores, count, expected",
    [
        ([0, 1, 2, 3], 2, [[0, 1], [2, 3]]),
        ([3, 1, 2, 0, 4], 2, [[0, 1, 2], [3, 4]]),
        ([0, 1], 3, [[0], [1], [0]]),
        ([5], 2, [[5], [5]]),
    ],
)
def test_cpu_shares(cores, count, expected):
    assert launch.cpu_shares(cores, count) == expected


def test_gpu_ids_count_within_the_visible_gpus():
    assert launch.gpu_ids({}, 1, 3) == "3"
    assert launch.gpu_ids({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 2, 1) == "6,7"
    with pytest.raises(cli.UsageError, match="needs 6 GPUs but CUDA_VISIBLE_DEVICES=4,5 names 2"):
        launch.check_gpus({"CUDA_VISIBLE_DEVICES": "4,5"}, 3, 2)
    launch.check_gpus({}, 8, 1)  # unset: the launcher cannot tell; each process gets ids


def test_gloo_notices_are_left_out_even_when_two_threads_interleave_them():
    """The lines the CI saw when two of Gloo's threads wrote their notices piece by piece."""
    notice = (
        b"[Gloo] Rank 1 is connected to 1 peer ranks. "
        b"Expected number of connected peer ranks is : 1"
    )
    lines = [
        b"step 1\n",
        notice + b"\n",
        b"[Gloo] Rank 1[Gloo] Rank 1 is connected to  is connected to 11 peer ranks. "
        b"Expected number of connected peer ranks is : 1\n",
        b" peer ranks. Expected number of connected peer ranks is : 1\n",
        notice[:-1] + b"\n",  # the last piece of one, another's number on the next line
        b"1\n",
        b"gathered " + notice + b"[0, 1]\n",
        b"2\n",  # a program's number, not after a notice
    ]
    read, write = os.pipe()
    with os.fdopen(write, "wb") as source:
        source.write(b"".join(lines))
    target = io.BytesIO()
    launch.copy_lines(os.fdopen(read, "rb"), target, b"[p1] ")
    assert target.getvalue() == b"[p1] step 1\n[p1] gathered [0, 1]\n[p1] 2\n"
