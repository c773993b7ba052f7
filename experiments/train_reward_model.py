r"""Trains a scalar reward model on preference pairs (Bradley–Terry) and saves it as a
Hugging Face folder.

    python experiments/train_reward_model.py --config=configs/reward_model.py \
        --workdir=/ckpt/rm_1b --config.model.hf_path=/ckpt/pythia-1b-sft \
        --config.data.manual_dir=/data/tldr_preferences
    python experiments/train_reward_model.py --config=configs/reward_model.py:tiny \
        --workdir=/tmp/rm_tiny

Writes `<workdir>/hf` (the model, config.json and tokenizer files; loads in transformers as
*ForSequenceClassification and in configs/tldr_pythia.py as task.reward_model.hf_path),
`<workdir>/rm_summary.json` (held-out pairwise accuracy before and after training) and
`<workdir>/tensorboard/`. See tba_jax/train_reward_model.py.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from tba_jax import cli
from tba_jax.config_lib import ConfigError
from tba_jax.train_reward_model import train_reward_model

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (path[:variant]).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the model, logs and rm_summary.json go.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    logging.set_verbosity(logging.INFO)
    try:
        train_reward_model(_CONFIG.value, _WORKDIR.value)
    except (ConfigError, FileNotFoundError) as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
