r"""Trains a policy with TBA (or a sync baseline) from a config file.

    python experiments/train.py --config=configs/arithmetic.py --workdir=/tmp/tba_demo
    python experiments/train.py --config=configs/arithmetic.py:mode=sync,method=rloo \
        --workdir=/tmp/tba_sync --config.learner_steps=100

Running again on the same workdir resumes from its latest checkpoint.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from tba_jax import cli
from tba_jax.checkpoint import CheckpointMismatchError
from tba_jax.config_lib import ConfigError
from tba_jax.train import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (path[:variant]).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, logs and summary.json go.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    logging.set_verbosity(logging.INFO)
    try:
        train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except (ConfigError, CheckpointMismatchError) as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
