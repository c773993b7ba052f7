r"""Starts a multi-process JAX run on this machine: N copies of a program, joined by
`tba_jax.distributed` (each gets `--coordinator_address`, `--num_processes`, `--process_id`).

    # 2 CPU processes with 2 devices each (4 devices in all), each pinned to its own cores:
    python -m tba_jax.launch --num_processes=2 --devices_per_process=2 --pin_cpus -- \
        experiments/train.py --config=configs/arithmetic.py:smoke --workdir=/tmp/tba_2proc

    # One node with 8 GPUs as 8 processes of 1 GPU each (process i sees GPU i):
    python -m tba_jax.launch --num_processes=8 --gpus_per_process=1 -- \
        experiments/train.py --config=configs/arithmetic.py --workdir=/tmp/tba_8gpu

Everything after `--` is the program and its arguments; process i runs
`python <program> <arguments> --coordinator_address=localhost:<port> --num_processes=N
--process_id=i` with:
- CPU runs (no `--gpus_per_process`): `--xla_force_host_platform_device_count` in XLA_FLAGS
  (replacing one already there) and JAX_PLATFORMS=cpu unless it is set;
- `--gpus_per_process=G`: CUDA_VISIBLE_DEVICES set to GPUs i*G .. i*G+G-1 (counted within
  the launcher's own CUDA_VISIBLE_DEVICES when that is set);
- `--pin_cpus`: the process bound to its own share of the launcher's CPU cores (XLA sizes
  its thread pools to the cores a process may use) and the OpenMP/BLAS thread counts set to
  that share.

Each line a process prints comes out prefixed `[p<i>] ` on the launcher's stdout or stderr.
SIGTERM and SIGINT (a preemption, Ctrl-C) are passed on to every process, which save and
exit on their own (status 130 or 143, which is not a failure). When a process fails, the
others get `--grace_s` seconds to end (they normally do, as tba_jax.distributed spreads the
failure) before they are killed; the launcher exits with the first failing process's
status, else a stopped one's, 0 when every process succeeds.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import BinaryIO

from absl import flags

from tba_jax import cli
from tba_jax.checkpoint import SIGNAL_EXIT_BASE, STOPPED_STATUSES

LOCALHOST = "localhost"
ANY_FREE_PORT = 0
DEFAULT_GRACE_S = 15.0
WAIT_POLL_S = 0.1
READER_JOIN_S = 5.0  # how long the last lines may take once every process has ended
PREFIX_FORMAT = "[p{index}] "
MESSAGE_PREFIX = "launch: "
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT)

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# Single-threaded Eigen in XLA's CPU kernels that use it. (The often-quoted companion
# `intra_op_parallelism_threads=1` is no XLA flag: jax 0.10.2 ignores it after a `--` flag
# and aborts on it alone. What bounds XLA's CPU thread pools is the process's CPU affinity.)
PINNED_XLA_FLAGS = ("--xla_cpu_multi_thread_eigen=false",)
THREAD_COUNT_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def define_flags() -> None:
    """The launcher's flags (defined only when run as a script: `--num_processes` is also the
    children's flag, defined by tba_jax.distributed)."""
    flags.DEFINE_integer("num_processes", None, "How many processes to start (>= 1).")
    flags.DEFINE_integer("devices_per_process", 1, "CPU devices per process (CPU runs).")
    flags.DEFINE_integer(
        "gpus_per_process", None, "GPUs per process on this node; unset: a CPU run."
    )
    flags.DEFINE_bool("pin_cpus", False, "Bind each process to its own share of the CPU cores.")
    flags.DEFINE_integer("port", None, "The coordinator's port; unset: a free one.")
    flags.DEFINE_float(
        "grace_s",
        DEFAULT_GRACE_S,
        "After a process fails, how long the others may take to end before they are killed.",
    )
    flags.adopt_module_key_flags(cli)


# --------------------------------------------------------------------------------------
# The processes' command lines and environments.
# --------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOCALHOST, ANY_FREE_PORT))
        return probe.getsockname()[1]


def process_command(program: Sequence[str], address: str, count: int, index: int) -> list[str]:
    return [
        sys.executable,
        *program,
        f"--coordinator_address={address}",
        f"--num_processes={count}",
        f"--process_id={index}",
    ]


def with_xla_flags(existing: str, added: Sequence[str]) -> str:
    """`existing` XLA_FLAGS with `added` appended, replacing flags of the same names."""
    names = {flag.split("=", 1)[0] for flag in added}
    kept = [flag for flag in existing.split() if flag.split("=", 1)[0] not in names]
    return " ".join([*kept, *added])


def cpu_shares(cores: Sequence[int], count: int) -> list[list[int]]:
    """`cores` split into `count` contiguous shares as even as can be; with fewer cores than
    processes, one core each, round-robin."""
    cores = sorted(cores)
    if len(cores) < count:
        return [[cores[index % len(cores)]] for index in range(count)]
    size, extra = divmod(len(cores), count)
    shares, start = [], 0
    for index in range(count):
        end = start + size + (index < extra)
        shares.append(cores[start:end])
        start = end
    return shares


def visible_gpus(environ: Mapping[str, str]) -> list[str] | None:
    """The GPUs named by the launcher's CUDA_VISIBLE_DEVICES, None when it is unset."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    return [gpu.strip() for gpu in visible.split(",") if gpu.strip()] if visible else None


def gpu_ids(environ: Mapping[str, str], gpus_per_process: int, index: int) -> str:
    """CUDA_VISIBLE_DEVICES of process `index`: its GPUs among those the launcher sees."""
    first = index * gpus_per_process
    ids = visible_gpus(environ) or [str(gpu) for gpu in range(first + gpus_per_process)]
    return ",".join(ids[first : first + gpus_per_process])


def process_environment(
    environ: Mapping[str, str],
    index: int,
    *,
    devices_per_process: int,
    gpus_per_process: int | None,
    cores: Sequence[int] | None,
) -> dict[str, str]:
    """The environment of process `index` (see the module docstring); `cores` is its CPU
    share under --pin_cpus, else None."""
    env = dict(environ)
    env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the launcher as they are printed
    xla_flags = []
    if gpus_per_process is None:
        xla_flags.append(f"{DEVICE_COUNT_FLAG}={devices_per_process}")
        env.setdefault("JAX_PLATFORMS", "cpu")
    else:
        env["CUDA_VISIBLE_DEVICES"] = gpu_ids(environ, gpus_per_process, index)
    if cores is not None:
        xla_flags.extend(PINNED_XLA_FLAGS)
        env.update(dict.fromkeys(THREAD_COUNT_VARIABLES, str(len(cores))))
    if xla_flags:
        env["XLA_FLAGS"] = with_xla_flags(environ.get("XLA_FLAGS", ""), xla_flags)
    return env


# --------------------------------------------------------------------------------------
# Running the processes.
# --------------------------------------------------------------------------------------


def start_process(command: list[str], env: dict[str, str], cores: Sequence[int] | None):
    """Starts one process in a session of its own (a Ctrl-C at the terminal reaches it once,
    through the launcher), bound to `cores` when given."""
    pin = None if cores is None else (lambda: os.sched_setaffinity(0, cores))
    return subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=pin,  # safe: every process is started before the reader threads
    )


# The launcher's own lines and its processes' lines are written whole, one at a time
# (reentrant: a signal handler may write while the main thread holds it).
_OUTPUT_LOCK = threading.RLock()


# What Gloo prints to stdout as its CPU collectives connect ("[Gloo] Rank 0 is connected to
# 1 peer ranks. Expected number of connected peer ranks is : 1"), possibly inside a line
# of the program's.
GLOO_NOTICE = re.compile(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\.[^\n]*: \d+\n?")
# The pieces C++ writes one at a time for each notice: two threads' notices can interleave,
# piece by piece, into lines no whole-notice pattern matches.
GLOO_NOTICE_PIECES = re.compile(
    rb"\[Gloo\] Rank | is connected to | peer ranks\. "
    rb"|Expected number of connected peer ranks is : "
)


def is_gloo_fragment(line: bytes) -> bool:
    """Whether `line` holds nothing but pieces of Gloo's notices and their numbers."""
    rest, pieces = GLOO_NOTICE_PIECES.subn(b"", line)
    return pieces > 0 and not rest.strip(b"0123456789 \t\r\n")


def write_line(target: BinaryIO, line: bytes) -> None:
    with _OUTPUT_LOCK:
        target.write(line if line.endswith(b"\n") else line + b"\n")
        target.flush()


def notice(message: str) -> None:
    """One line of the launcher's own on stderr: `launch: <message>`."""
    write_line(sys.stderr.buffer, (MESSAGE_PREFIX + message).encode())


def copy_lines(source: BinaryIO, target: BinaryIO, prefix: bytes) -> None:
    """Copies `source` to `target` line by line, each line prefixed, without Gloo's notices
    (CPU collectives print one each time they connect, from C++, past Python's logging)."""
    follows_notice = False  # a lone number after a notice is the end of an interleaved one
    for line in iter(source.readline, b""):
        line, notices = GLOO_NOTICE.subn(b"", line)
        if is_gloo_fragment(line) or (follows_notice and line.strip().isdigit()):
            follows_notice = True
            continue
        follows_notice = notices > 0 and not line.strip()
        if line.strip():
            write_line(target, prefix + line)
    source.close()


def start_readers(processes: Sequence[subprocess.Popen]) -> list[threading.Thread]:
    """A thread per pipe copying each process's stdout and stderr to the launcher's."""
    readers = []
    for index, process in enumerate(processes):
        prefix = PREFIX_FORMAT.format(index=index).encode()
        for source, target in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
            reader = threading.Thread(
                target=copy_lines, args=(source, target.buffer, prefix), daemon=True
            )
            reader.start()
            readers.append(reader)
    return readers


def join_readers(readers: Sequence[threading.Thread]) -> None:
    """Waits for the last lines (cut after READER_JOIN_S: a process's own children may hold
    its pipes open after it ends)."""
    deadline = time.monotonic() + READER_JOIN_S
    for reader in readers:
        reader.join(max(0.0, deadline - time.monotonic()))


def forward_signals(processes: Sequence[subprocess.Popen]) -> None:
    """From now on, SIGTERM and SIGINT sent to the launcher go to every running process in
    `processes` (a list that may still grow)."""

    def forward(signum: int, frame) -> None:
        del frame
        notice(f"passing {signal.Signals(signum).name} on to the processes")
        for process in processes:
            if process.poll() is None:
                process.send_signal(signum)

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)


def exit_status(returncode: int) -> int:
    """A process's exit status as a shell reports it (128 + s when signal s ended it)."""
    return SIGNAL_EXIT_BASE - returncode if returncode < 0 else returncode


def describe_end(index: int, returncode: int) -> str:
    if returncode < 0:
        return f"process {index} was ended by {signal.Signals(-returncode).name}"
    return f"process {index} exited with status {returncode}"


def running(processes: Sequence[subprocess.Popen]) -> list[subprocess.Popen]:
    return [process for process in processes if process.poll() is None]


def first_failed(processes: Sequence[subprocess.Popen]) -> int | None:
    """The index of the first process (in order) that ended with an error, or None. A
    process that a stop request made save and exit (STOPPED_STATUSES, tba_jax.cli) has not
    failed: the others are left to save too, never killed."""
    return next(
        (
            i
            for i, process in enumerate(processes)
            if process.returncode not in (None, 0, *STOPPED_STATUSES)
        ),
        None,
    )


def stopped_status(processes: Sequence[subprocess.Popen]) -> int:
    """The status of the first process that a stop request made save and exit, else 0."""
    return next((p.returncode for p in processes if p.returncode in STOPPED_STATUSES), 0)


def wait_for(processes: Sequence[subprocess.Popen], grace_s: float) -> int:
    """Waits for every process; once one has failed, kills those still running `grace_s`
    later. Returns the first failure's exit status, else a stopped process's (130, 143),
    else 0."""
    failed, deadline = None, None
    while running(processes):
        if failed is None:
            failed = first_failed(processes)
            if failed is not None:
                ended = describe_end(failed, processes[failed].returncode)
                notice(f"{ended}; stopping the others")
                deadline = time.monotonic() + grace_s
        elif time.monotonic() >= deadline:
            kill_running(processes, grace_s)
        time.sleep(WAIT_POLL_S)
    if failed is None:  # a failure among the last processes to end
        failed = first_failed(processes)
        if failed is not None:
            notice(describe_end(failed, processes[failed].returncode))
    if failed is None:
        return stopped_status(processes)
    return exit_status(processes[failed].returncode)


def kill_running(processes: Sequence[subprocess.Popen], grace_s: float) -> None:
    for index, process in enumerate(processes):
        if process.poll() is None:
            notice(f"killing process {index} (still running {grace_s:g} s after the failure)")
            process.kill()
            process.wait()


def launch(
    program: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int = 1,
    gpus_per_process: int | None = None,
    pin_cpus: bool = False,
    port: int | None = None,
    grace_s: float = DEFAULT_GRACE_S,
) -> int:
    """Runs `num_processes` copies of `program` (a script and its arguments) as one run;
    returns the launcher's exit status."""
    address = f"{LOCALHOST}:{port or free_port()}"
    cores = (
        cpu_shares(os.sched_getaffinity(0), num_processes) if pin_cpus else [None] * num_processes
    )
    environments = [
        process_environment(
            os.environ,
            index,
            devices_per_process=devices_per_process,
            gpus_per_process=gpus_per_process,
            cores=cores[index],
        )
        for index in range(num_processes)
    ]
    processes: list[subprocess.Popen] = []
    forward_signals(processes)
    notice(f"starting {num_processes} processes (coordinator {address})")
    for index in range(num_processes):
        command = process_command(program, address, num_processes, index)
        processes.append(start_process(command, environments[index], cores[index]))
    readers = start_readers(processes)
    status = wait_for(processes, grace_s)
    join_readers(readers)
    return status


def check_gpus(environ: Mapping[str, str], num_processes: int, gpus_per_process: int) -> None:
    """UsageError when the launcher's CUDA_VISIBLE_DEVICES names too few GPUs for the run."""
    gpus = visible_gpus(environ)
    needed = num_processes * gpus_per_process
    if gpus is not None and needed > len(gpus):
        raise cli.UsageError(
            f"--num_processes={num_processes} x --gpus_per_process={gpus_per_process} needs "
            f"{needed} GPUs but CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']} names "
            f"{len(gpus)}."
        )


def check_arguments(program: Sequence[str], values: flags.FlagValues) -> None:
    """UsageError for a command line the launcher cannot run."""
    if not program:
        raise cli.UsageError("no program to run: put it after `--`, e.g. -- experiments/train.py")
    if cli.required(values["num_processes"]) < 1:
        raise cli.UsageError(f"--num_processes={values.num_processes} must be >= 1.")
    if values.devices_per_process < 1:
        raise cli.UsageError(f"--devices_per_process={values.devices_per_process} must be >= 1.")
    if values.gpus_per_process is not None and values.gpus_per_process < 1:
        raise cli.UsageError(f"--gpus_per_process={values.gpus_per_process} must be >= 1.")
    if values.gpus_per_process is not None and values["devices_per_process"].present:
        raise cli.UsageError(
            "--devices_per_process is for CPU runs; with --gpus_per_process each process "
            "uses its GPUs."
        )
    if values.gpus_per_process is not None:
        check_gpus(os.environ, values.num_processes, values.gpus_per_process)
    if values.grace_s < 0:
        raise cli.UsageError(f"--grace_s={values.grace_s} must be >= 0.")


def main(argv: list[str]) -> int:
    program, values = argv[1:], flags.FLAGS
    check_arguments(program, values)
    return launch(
        program,
        values.num_processes,
        devices_per_process=values.devices_per_process,
        gpus_per_process=values.gpus_per_process,
        pin_cpus=values.pin_cpus,
        port=values.port,
        grace_s=values.grace_s,
    )


if __name__ == "__main__":
    define_flags()
    cli.run(main)
