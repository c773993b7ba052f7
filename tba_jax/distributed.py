"""Several JAX processes (TPU pod hosts, GPU nodes, local CPU processes) as one run.

Every process runs the same program (JAX's multi-controller model). `initialize` joins
them with `jax.distributed.initialize`: from explicit flags (`--coordinator_address`,
`--num_processes`, `--process_id`, as `python -m tba_jax.launch` passes them), or with no
flags on a TPU pod slice or in a SLURM job with several tasks, where JAX finds the other
processes itself. A single process needs nothing.

Failures end every process, never a hang in a collective:
- a process that raises calls `fail_all` (`tba_jax.cli.run` does), which posts its error in the
  coordination service's key-value store and exits; a watcher thread in every other
  process sees the post within `FAILURE_POLL_S` and exits with the same message;
- a process that dies without a word stops sending heartbeats, and JAX's coordination
  service ends the others after `--heartbeat_timeout_s`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
from absl import flags, logging

FAILURE_KEY = "tba_jax/failure"
FAILURE_POLL_S = 0.5
FAILURE_EXIT_STATUS = 1
# A failure posted by one process, as the others print it.
FAILURE_FORMAT = "process {process_index} failed: {message}"
# Each process posts this as it exits after a failure. Process 0 hosts the coordination
# service and exits last: a process still connected when the service goes away is ended by
# JAX's error poller with a C++ stack dump instead of its one-line error.
LEFT_KEY_FORMAT = "tba_jax/left/{process_index}"
LEAVE_WAIT_S = 5.0  # how long process 0 waits for the others to leave (a dead one never does)
LEAVE_GRACE_S = 0.2  # after the last one posted: its own exit
_leaving = threading.Event()  # set when this process fails: it is on its way out
DEFAULT_HEARTBEAT_TIMEOUT_S = 20
DEFAULT_INIT_TIMEOUT_S = 300
DEFAULT_SHUTDOWN_TIMEOUT_S = 3600


def define_flags() -> None:
    """Defines this module's flags (a launcher that runs over several processes calls it
    at import: `experiments/train.py`, `experiments/evaluate.py`)."""
    if "coordinator_address" in flags.FLAGS:
        return
    flags.DEFINE_string(
        "coordinator_address",
        None,
        "host:port of process 0, for a run over several processes (with --num_processes "
        "and --process_id). Unset on a TPU pod or in a SLURM job: JAX finds the processes.",
    )
    flags.DEFINE_integer(
        "num_processes", None, "How many processes the run spans (with --coordinator_address)."
    )
    flags.DEFINE_integer(
        "process_id", None, "This process's index in 0..num_processes-1 (with the above)."
    )
    flags.DEFINE_integer(
        "heartbeat_timeout_s",
        DEFAULT_HEARTBEAT_TIMEOUT_S,
        "A process silent this long (dead) ends the others (JAX's coordination service).",
    )
    flags.DEFINE_integer(
        "distributed_init_timeout_s",
        DEFAULT_INIT_TIMEOUT_S,
        "How long a process waits for the others to join before giving up.",
    )
    flags.DEFINE_integer(
        "distributed_shutdown_timeout_s",
        DEFAULT_SHUTDOWN_TIMEOUT_S,
        "How long a finished process waits for the others at exit (searcher processes wait "
        "for the learners' final evaluation).",
    )


_initialized = False


def cluster_detected(environ: dict[str, str] | None = None) -> str | None:
    """The cluster JAX can join without flags ("TPU pod" or "SLURM"), else None."""
    environ = os.environ if environ is None else environ
    hosts = environ.get("TPU_WORKER_HOSTNAMES", "")
    if len([host for host in hosts.split(",") if host.strip()]) > 1:
        return "TPU pod"
    tasks = environ.get("SLURM_NTASKS") or environ.get("SLURM_NPROCS") or "1"
    if environ.get("SLURM_JOB_ID") and tasks.isdigit() and int(tasks) > 1:
        return "SLURM"
    return None


def check_flags(coordinator_address: str | None, num_processes: int | None, process_id) -> None:
    """ValueError (a usage error) for an incomplete or inconsistent set of process flags."""
    given = [v is not None for v in (coordinator_address, num_processes, process_id)]
    if any(given) and not all(given):
        raise ValueError(
            "--coordinator_address, --num_processes and --process_id go together; pass all "
            "three (python -m tba_jax.launch does) or none."
        )
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"--num_processes={num_processes} must be >= 1.")
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(
            f"--process_id={process_id} must be in 0..{num_processes - 1} (--num_processes)."
        )


def check_host_name_resolves() -> None:
    """ValueError unless this machine's host name resolves to an address: gloo, which
    carries the CPU devices' collectives between processes, binds to it, and where it
    does not (a container whose /etc/hosts lacks its own name) the CPU backend fails to
    start with only "[enforce fail at gloo/transport/tcp/device.cc] rv == 0. -2 vs 0"."""
    host = socket.gethostname()
    try:
        socket.getaddrinfo(host, None)
    except OSError as error:
        raise ValueError(
            f"this machine's host name {host!r} does not resolve ({error}); the CPU "
            "collectives between processes (gloo) bind to it: add a line "
            f"'127.0.0.1 {host}' to /etc/hosts, or run where the name resolves."
        ) from error


def initialize_from_flags() -> None:
    """`initialize` with the flags of `define_flags`."""
    values = flags.FLAGS
    initialize(
        values.coordinator_address,
        values.num_processes,
        values.process_id,
        heartbeat_timeout_s=values.heartbeat_timeout_s,
        init_timeout_s=values.distributed_init_timeout_s,
        shutdown_timeout_s=values.distributed_shutdown_timeout_s,
    )


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
    init_timeout_s: int = DEFAULT_INIT_TIMEOUT_S,
    shutdown_timeout_s: int = DEFAULT_SHUTDOWN_TIMEOUT_S,
) -> None:
    """Joins the run's processes (see the module docstring); a no-op for one process.
    Call before anything touches a JAX device."""
    global _initialized
    check_flags(coordinator_address, num_processes, process_id)
    explicit = num_processes is not None and num_processes > 1
    cluster = None if explicit else cluster_detected()
    if _initialized or not (explicit or cluster):
        return
    cpu_asked = "cpu" in (jax.config.jax_platforms, os.environ.get("JAX_PLATFORMS"))
    if cpu_asked or jax.config.jax_platforms in (None, ""):
        # CPU devices of several processes talk over gloo (no-op where another backend runs)
        if cpu_asked:  # (the launcher's CPU processes: surely gloo's)
            check_host_name_resolves()
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = dict(
        heartbeat_timeout_seconds=heartbeat_timeout_s,
        initialization_timeout=init_timeout_s,
        shutdown_timeout_seconds=shutdown_timeout_s,
    )
    if explicit:
        kwargs.update(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
        )
    jax.distributed.initialize(**kwargs)
    _initialized = True
    if jax.process_index() != 0:  # process 0 reports progress; the others only warnings
        logging.set_verbosity(logging.WARNING)
    logging.info(
        "Process %d of %d joined (%s); %d local and %d global devices.",
        jax.process_index(),
        jax.process_count(),
        cluster or coordinator_address,
        jax.local_device_count(),
        jax.device_count(),
    )
    watch_for_failures()


def _client():
    from jax._src import distributed as jax_distributed  # the coordination service client

    return jax_distributed.global_state.client


def watch_for_failures(poll_s: float = FAILURE_POLL_S) -> threading.Thread:
    """A daemon thread that ends this process when another posts a failure.

    It is stopped and joined at exit, before JAX's own exit handler shuts the coordination
    client down: a daemon thread still inside a client call when the interpreter finalizes
    is unwound through C++ frames and aborts the process ("exception not rethrown")."""
    stop = threading.Event()

    def watch() -> None:
        client = _client()
        while not stop.wait(poll_s) and not _leaving.is_set():  # (its own failure is said)
            try:
                posted = client.key_value_try_get(FAILURE_KEY)
            except Exception:  # not posted yet (NOT_FOUND), or the service went away
                continue
            print(f"error: {posted}", file=sys.stderr, flush=True)
            _leave(FAILURE_EXIT_STATUS)

    thread = threading.Thread(target=watch, name="failure-watcher", daemon=True)
    thread.start()

    def stop_watching() -> None:
        stop.set()
        thread.join()

    # atexit runs handlers last-registered first: this one before JAX's (registered on import)
    atexit.register(stop_watching)
    return thread


def fail_all(message: str, exit_status: int = FAILURE_EXIT_STATUS) -> None:
    """Posts `message` for every process to see, prints it and exits at once (no shutdown
    barrier: the others may be inside a collective that will never complete)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    if _initialized:
        _leaving.set()
        text = FAILURE_FORMAT.format(process_index=jax.process_index(), message=message)
        # another process may have posted first: its message stands
        with contextlib.suppress(Exception):
            _client().key_value_set(FAILURE_KEY, text)
        _leave(exit_status)
    sys.stdout.flush()
    os._exit(exit_status)


def _leave(exit_status: int) -> None:
    """Exits at once after a failure, without JAX's shutdown barrier; process 0 (the
    coordination service's host) only once the others have left or `LEAVE_WAIT_S` passed."""
    client, index = _client(), jax.process_index()
    with contextlib.suppress(Exception):  # posted already, or the service is gone
        client.key_value_set(LEFT_KEY_FORMAT.format(process_index=index), "")
    if index == 0:
        waiting = set(range(1, jax.process_count()))
        deadline = time.monotonic() + LEAVE_WAIT_S
        while waiting and time.monotonic() < deadline:
            for other in list(waiting):
                with contextlib.suppress(Exception):  # NOT_FOUND until it posts
                    client.key_value_try_get(LEFT_KEY_FORMAT.format(process_index=other))
                    waiting.discard(other)
            time.sleep(LEAVE_GRACE_S)
        time.sleep(LEAVE_GRACE_S)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_status)


def is_initialized() -> bool:
    """Whether this process joined a run over several processes."""
    return _initialized


def is_multi_process() -> bool:
    return jax.process_count() > 1


def allgather(array: np.ndarray) -> np.ndarray:
    """`array` (same shape and dtype on every process) from every process: [P, *shape].
    Every process must call it at the same point."""
    if not is_multi_process():
        return np.asarray(array)[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(array), tiled=False))


def any_process(flag: bool) -> bool:
    """Whether `flag` is true on any process (a collective: every process calls it)."""
    return bool(allgather(np.asarray([flag], np.int32)).any())


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier `name` (no-op for one process)."""
    if is_multi_process():
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
