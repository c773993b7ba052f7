"""Joins a run of several processes, polls for failures as fast as it can, and exits.

    python -m tba_jax.launch --num_processes=2 -- tests/multiprocess_exit_check.py

A failure watcher still inside a coordination-client call when the interpreter finalizes
aborts the process ("FATAL: exception not rethrown"); polling without pause makes that
near certain unless the watcher is stopped before exit. tests/test_multiprocess.py runs it.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app

from tba_jax import distributed

distributed.define_flags()


def main(argv: list[str]) -> None:
    del argv
    distributed.initialize_from_flags()
    distributed.watch_for_failures(poll_s=0.0)
    distributed.barrier("exit_check")


if __name__ == "__main__":
    app.run(main)
