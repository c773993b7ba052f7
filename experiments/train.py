r"""Trains a policy with TBA (or a sync baseline) from a config file.

    python experiments/train.py --config=configs/arithmetic.py --workdir=/tmp/tba_demo
    python experiments/train.py --config=configs/arithmetic.py:mode=sync,method=rloo \
        --workdir=/tmp/tba_sync --config.learner_steps=100
    python experiments/train.py --config=configs/arithmetic.py:smoke --print_config
    python experiments/train.py --config=configs/gsm8k_rho1b.py --workdir=/ckpt/gsm8k \
        --config.model.hf_path=/ckpt/rho-1b-sft --check_only   # every check, no run

Over several processes (README "Multi-host"):

    python -m tba_jax.launch --num_processes=2 -- experiments/train.py \
        --config=configs/arithmetic.py:smoke --workdir=/tmp/tba_2proc

Running again on the same workdir resumes from its latest checkpoint. `--print_config`
lists every key of the resolved config (change one with `--config.<key>=<value>`).
"""

import sys

import jax
from absl import flags
from ml_collections import config_flags

from tba_jax import cli, distributed
from tba_jax.checkpoint import CheckpointMismatchError
from tba_jax.config_lib import ConfigError
from tba_jax.train import check_only, train_and_evaluate

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags, defined only when run as a script (tba_jax.cli's rule)."""
    config_flags.DEFINE_config_file("config", None, "Config file (path[:variant]).")
    flags.DEFINE_string("workdir", None, "Where checkpoints, logs and summary.json go.")
    cli.define_print_config_flag()
    flags.DEFINE_bool(
        "check_only",
        False,
        "Make every check the run makes before its first write (config values, meshes, Hugging "
        "Face folders, the task's role models, the workdir), say what it would start from, and "
        "exit without writing anything.",
    )
    flags.adopt_module_key_flags(cli)
    distributed.define_flags()
    flags.adopt_module_key_flags(distributed)
    flags.mark_flag_as_required("config")


# A missing file here (e.g. a model.hf_path folder without tokenizer files) is a user's.
USER_ERRORS = (ConfigError, CheckpointMismatchError, FileNotFoundError)


def main(argv):
    del argv
    if FLAGS.print_config:
        cli.print_config(FLAGS.config, FLAGS["config"].config_filename)
        return
    workdir = cli.required(FLAGS["workdir"])
    cli.check_output_dir(workdir, "workdir")
    try:
        distributed.initialize_from_flags()
    except ValueError as error:
        raise cli.UsageError(str(error)) from None
    cli.note_unread_keys(sys.argv, "config")
    if FLAGS.check_only:
        lines = check_only(FLAGS.config, workdir)
        if jax.process_index() == 0:  # one report, not one a process
            print("\n".join(lines))
        return
    train_and_evaluate(FLAGS.config, workdir)


if __name__ == "__main__":
    define_flags()
    cli.run(main, user_errors=USER_ERRORS)
