r"""Re-runs a recorded run's learner from its batch log and checks it reproduces the run.

    python experiments/train.py --config=configs/arithmetic.py --workdir=/tmp/tba_rec \
        --config.record_learner_batches=True
    python experiments/replay_learner.py --workdir=/tmp/tba_rec
    python experiments/replay_learner.py --workdir=/tmp/tba_rec --from_step=250 --to_step=280

Restores the checkpoint of `--from_step` (default: the first one recorded steps follow,
step 0 for a run that recorded from its start), feeds every recorded batch up to
`--to_step` (default: the last recorded) through the run's jitted train step, and compares
the params' fingerprint after each step with the recorded one and every checkpoint in the
range leaf by leaf. Prints the report; exits 0 when the replay is bit-identical, 2 when it
diverged (the report names the first step that did), 1 on a usage error.
"""

from __future__ import annotations

import sys

from absl import flags

from tba_jax import batch_replay, cli
from tba_jax.checkpoint import CheckpointMismatchError
from tba_jax.config_lib import ConfigError

DIVERGED_EXIT_STATUS = 2


def define_flags() -> None:
    """The command line's flags, defined only when run as a script (tba_jax.cli's rule)."""
    flags.DEFINE_string("workdir", None, "The --workdir of a run with record_learner_batches.")
    flags.DEFINE_integer("from_step", None, "Checkpoint to start from; default the first.")
    flags.DEFINE_integer("to_step", None, "Last learner step to replay; default the last.")
    flags.adopt_module_key_flags(cli)


def main(argv):
    del argv
    values = flags.FLAGS
    workdir = cli.required(flags.FLAGS["workdir"])
    report = batch_replay.replay(workdir, values.from_step, values.to_step)
    print("\n".join(report.lines()))
    if not report.ok:
        sys.exit(DIVERGED_EXIT_STATUS)


if __name__ == "__main__":
    define_flags()
    cli.run(main, user_errors=(ConfigError, CheckpointMismatchError, FileNotFoundError))
