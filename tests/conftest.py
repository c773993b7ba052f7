"""Test-session setup: one persistent XLA compilation cache for the whole session, and
LLVM's optimisation off.

Many tests train the same smoke configs more than once (straight and resumed, one
method after another), and every run builds its jitted functions anew, so XLA would
compile the same programs again. JAX's persistent cache (keyed by the program, the
compile options, the XLA flags and the versions) lets a later run, another xdist
worker or a test's subprocess load them instead. Each session gets its own empty
directory (named after the pytest process, which xdist workers see as their parent),
removed at the end; a JAX_COMPILATION_CACHE_DIR already set is used and left alone.

Most of the suite's time is XLA compiling small programs, and most of that is LLVM
optimising the CPU code it emits. The tests' programs are tiny and run briefly, so they
compile with LLVM's optimisation off (`--xla_backend_optimization_level=0`; XLA's own HLO
passes, fusion included, run as always). That takes about a third off the suite's time.
An XLA_FLAGS that already names the level is left as it is.
"""

from __future__ import annotations

import os
import shutil
import tempfile

CACHE_READ_WARNING = "Error reading persistent compilation cache entry"
_WORKER = "PYTEST_XDIST_WORKER" in os.environ
_SESSION_CACHE = os.path.join(
    tempfile.gettempdir(), f"tba_jax_tests_xla_cache_{os.getppid() if _WORKER else os.getpid()}"
)
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    # set before anything imports jax; test subprocesses inherit it
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAG}".strip()
if _OWN_CACHE:  # set before anything imports jax; test subprocesses inherit it
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _SESSION_CACHE
    # every program, however quick to compile: the smoke runs' programs are small
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    # JAX writes an entry in place, so a process may read one another is still writing;
    # it then warns and compiles the program itself. That is no test's business: quiet it
    # in the subprocesses (whose consoles some tests read) as pyproject.toml does here.
    os.environ["PYTHONWARNINGS"] = ",".join(
        filter(None, [os.environ.get("PYTHONWARNINGS"), f"ignore:{CACHE_READ_WARNING}"])
    )


def pytest_sessionfinish(session, exitstatus):
    del session, exitstatus
    if _OWN_CACHE and not _WORKER:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)
