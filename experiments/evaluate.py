r"""Evaluates a training run's policy on its task's test split and writes the metrics as JSON.

    python experiments/evaluate.py --workdir=/ckpt/tba_gsm8k
    python experiments/evaluate.py --workdir=/tmp/tba_demo --num_samples=8 --ks=1,4,8 \
        --checkpoint_step=100 --out=/tmp/tba_demo/eval_100.json
    # the same, naming the checkpoint folder itself (its run's workdir is two levels up)
    python experiments/evaluate.py --config=configs/arithmetic.py \
        --checkpoint=/tmp/tba_demo/checkpoints/100

The run's config comes from `<workdir>/config.json` (written when training started);
`--config=path[:variant]` replaces it (it must describe the same experiment; settings
that only change evaluation, such as TL;DR's gold reward model, may differ). The task's
metrics go to `--out` (default `<workdir>/eval.json`) with the config's name and the
checkpoint step: for verifiable tasks (arithmetic, GSM8K) greedy pass@1 and pass@k from
`--num_samples` sampled responses per problem at the config's sampling temperature; for
TL;DR the win rate under the gold reward model, reference perplexity and KL; for
red-teaming % toxic and diversity of `--num_samples` attacks. Defaults
of the flags come from the config's `eval` section (`max_new_tokens`, `num_samples`,
`ks`, `num_examples`, `batch_size`); configs without them (the built-in arithmetic
task) use the run's `max_response_len` and this file's fallbacks.
"""

import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from tba_jax import cli, evaluation, runs, tasks
from tba_jax.checkpoint import CHECKPOINTS_SUBDIR, Checkpointer, CheckpointMismatchError
from tba_jax.config_lib import ConfigError
from tba_jax.metrics import write_json_atomically

OUT_FILENAME = "eval.json"
# For configs whose `eval` section does not say (e.g. configs/arithmetic.py).
FALLBACK_NUM_SAMPLES = 16
FALLBACK_KS = (1, 4, 16)

_WORKDIR = flags.DEFINE_string("workdir", None, "The training run's workdir.")
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint",
    None,
    f"A checkpoint folder, <workdir>/{CHECKPOINTS_SUBDIR}/<step>: instead of --workdir and "
    "--checkpoint_step.",
)
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Optional config (path[:variant]) replacing <workdir>/config.json."
)
_CHECKPOINT_STEP = flags.DEFINE_integer("checkpoint_step", None, "Checkpoint; default: latest.")
_NUM_SAMPLES = flags.DEFINE_integer(
    "num_samples", None, "Sampled responses per problem for pass@k (0: greedy only)."
)
_KS = flags.DEFINE_list("ks", None, "The k of pass@k, e.g. 1,4,16 (each <= num_samples).")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", None, "Response length limit.")
_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", None, "First N test problems; 0: all.")
_OUT = flags.DEFINE_string("out", None, f"Output JSON; default: <workdir>/{OUT_FILENAME}.")


def run_and_step(workdir: str | None, checkpoint: str | None, step: int | None):
    """(workdir, step or None for the latest) from --workdir / --checkpoint_step or from a
    --checkpoint folder `<workdir>/checkpoints/<step>`; ConfigError when they disagree."""
    if checkpoint is None:
        if workdir is None:
            raise ConfigError("Pass --workdir (a training run's workdir) or --checkpoint.")
        return workdir, step
    folder = os.path.abspath(checkpoint.rstrip("/"))
    parent, name = os.path.split(folder)
    if not name.isdigit() or os.path.basename(parent) != CHECKPOINTS_SUBDIR:
        raise ConfigError(
            f"--checkpoint={checkpoint} is not a checkpoint folder <workdir>/"
            f"{CHECKPOINTS_SUBDIR}/<step>; pass one of those, or --workdir (and "
            "--checkpoint_step)."
        )
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"--checkpoint={checkpoint} does not exist.")
    derived_workdir, derived_step = os.path.dirname(parent), int(name)
    if workdir is not None and os.path.abspath(workdir) != derived_workdir:
        raise ConfigError(f"--checkpoint={checkpoint} is not in --workdir={workdir}.")
    if step is not None and step != derived_step:
        raise ConfigError(f"--checkpoint={checkpoint} is step {derived_step}, not {step}.")
    return derived_workdir, derived_step


def flag_or(flag, default):
    """The flag's value when given, else `default`."""
    return default if flag.value is None else flag.value


def eval_settings(config) -> tasks.EvalSettings:
    """The config's eval section and sampling settings, overridden by the flags."""
    eval_config = config.eval
    ks = _KS.value or eval_config.get("ks", FALLBACK_KS)
    return tasks.EvalSettings(
        max_prompt_len=config.max_prompt_len,
        max_new_tokens=flag_or(
            _MAX_NEW_TOKENS, eval_config.get("max_new_tokens", config.max_response_len)
        ),
        num_examples=flag_or(_NUM_EXAMPLES, eval_config.num_examples),
        batch_size=eval_config.batch_size,
        num_samples=flag_or(_NUM_SAMPLES, eval_config.get("num_samples", FALLBACK_NUM_SAMPLES)),
        ks=tuple(int(k) for k in ks),
        temperature=config.sampling.temperature,
        top_k=config.sampling.top_k,
        top_p=config.sampling.top_p,
        seed=config.seed,
    )


def check_settings(settings: tasks.EvalSettings) -> None:
    """ConfigError for settings that cannot work, before anything is loaded."""
    if settings.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={settings.max_new_tokens} must be >= 1.")
    if settings.num_samples < 0:
        raise ConfigError(f"num_samples={settings.num_samples} must be >= 0 (0: greedy only).")
    if settings.num_samples:
        try:
            evaluation.check_ks(settings.ks, settings.num_samples)
        except ValueError as error:
            raise ConfigError(str(error)) from None


def resolve_step(config, workdir: str, step: int | None) -> int:
    """`step`, or the workdir's latest checkpoint step when None."""
    if step is not None:
        return step
    identity = runs.experiment_identity(config, runs.stored_model_config(workdir))
    with Checkpointer(workdir, experiment=identity) as checkpointer:
        latest = checkpointer.latest_step()
    if latest is None:
        raise FileNotFoundError(f"No checkpoint in workdir {workdir}; train first.")
    return latest


def evaluate_run(config, workdir: str, step: int | None, settings) -> dict:
    """The metrics of the run's policy at `step` (latest: None) on its task's test split."""
    step = resolve_step(config, workdir, step)
    task = tasks.build_task(config.task, workdir, tokenizer=runs.policy_tokenizer(config))
    run = runs.restore_run(config, workdir, step)
    metrics = evaluation.evaluate_policy(
        run.model, run.params, task, settings, reference_params=run.reference_params
    )
    return {
        "config_name": config.name,
        "variant": config.get("variant", ""),
        "task": task.name,
        "step": step,
        "policy_version": int(run.metadata["policy_version"]),
        **metrics,
    }


def main(argv):
    del argv
    logging.set_verbosity(logging.INFO)
    try:
        workdir, step = run_and_step(_WORKDIR.value, _CHECKPOINT.value, _CHECKPOINT_STEP.value)
        config = _CONFIG.value or runs.load_config(workdir)
        settings = eval_settings(config)
        check_settings(settings)
        result = evaluate_run(config, workdir, step, settings)
    except (ConfigError, CheckpointMismatchError, FileNotFoundError) as error:
        sys.exit(f"error: {error}")
    out = _OUT.value or os.path.join(workdir, OUT_FILENAME)
    write_json_atomically(out, result)
    logging.info("Wrote %s: %s", out, json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
