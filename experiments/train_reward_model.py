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
`<workdir>/tensorboard/`. The train state is saved every `checkpoint_every` steps and on
SIGTERM / Ctrl-C; rerunning the same command goes on from there. See
tba_jax/train_reward_model.py. `--print_config` lists every key of the resolved config.
"""

from absl import flags
from ml_collections import config_flags

from tba_jax import cli
from tba_jax.checkpoint import CheckpointMismatchError
from tba_jax.config_lib import ConfigError
from tba_jax.train_reward_model import train_reward_model

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags, defined only when run as a script (tba_jax.cli's rule)."""
    config_flags.DEFINE_config_file("config", None, "Config file (path[:variant]).")
    flags.DEFINE_string("workdir", None, "Where the model, logs and rm_summary.json go.")
    cli.define_print_config_flag()
    flags.adopt_module_key_flags(cli)
    flags.mark_flag_as_required("config")


USER_ERRORS = (ConfigError, FileNotFoundError, CheckpointMismatchError)


def main(argv):
    del argv
    if FLAGS.print_config:
        cli.print_config(FLAGS.config, FLAGS["config"].config_filename)
        return
    workdir = cli.required(FLAGS["workdir"])
    cli.check_output_dir(workdir, "workdir")
    train_reward_model(FLAGS.config, workdir)  # its check_config: the kind, out_dir, ...


if __name__ == "__main__":
    define_flags()
    cli.run(main, user_errors=USER_ERRORS)
