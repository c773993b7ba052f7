r"""Evaluates a training run's policy on its task's test split and writes the metrics as JSON.

    python experiments/evaluate.py --workdir=/ckpt/tba_gsm8k
    python experiments/evaluate.py --workdir=/tmp/tba_demo --num_samples=8 --ks=1,4,8 \
        --checkpoint_step=100
    # the same, naming the checkpoint folder itself (its run's workdir is two levels up)
    python experiments/evaluate.py --config=configs/arithmetic.py \
        --checkpoint=/tmp/tba_demo/checkpoints/100

The run's config comes from `<workdir>/config.json` (written when training started);
`--config=path[:variant]` replaces it (it must describe the same experiment; settings
that only change evaluation, such as TL;DR's gold reward model, may differ). The task's
metrics: for verifiable tasks (arithmetic, GSM8K) greedy pass@1 and pass@k from
`--num_samples` sampled responses per problem at the config's sampling temperature; for
TL;DR the win rate under the gold reward model, reference perplexity and KL; for
red-teaming % toxic and diversity of `--num_samples` attacks. Defaults
of the flags come from the config's `eval` section (`max_new_tokens`, `num_samples`,
`ks`, `num_examples`, `batch_size`); configs without them (the built-in arithmetic
task) use the run's `max_response_len` and this file's fallbacks.

Evaluations never replace one another. Each goes to its own file in the run's workdir:

    evals/step_<step>.json        the default evaluation of a checkpoint step: the run's
                                  config.json and no flags (flags equal to it count as none)
    evals/step_<step>_<id>.json   the same step with other settings (flags, or a --config
                                  that differs); <id>: 8 hex digits of the settings' hash
    eval.json                     a copy of the default evaluation of the run's latest
                                  step; an older step's evaluation never replaces it

Every file holds its `step`, `settings_id` ("default" or the <id>) and `settings`: the
evaluation settings and `config_changes` (each key where --config differs from the run's
config.json, with the value used). Running the same evaluation again rewrites its own
file. `--out=path` writes the result there instead, and refuses a file that holds an
evaluation of another step or settings. The last line on stdout is JSON naming the
files written.
"""

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Callable

from absl import flags, logging
from ml_collections import config_flags

from tba_jax import cli, compile_cache, config_lib, distributed, evaluation, runs, tasks
from tba_jax.checkpoint import (
    CheckpointMismatchError,
    CheckpointUnreadableError,
)
from tba_jax.config_lib import ConfigError
from tba_jax.metrics import write_json_atomically
from tba_jax.placement import over_all_devices

OUT_FILENAME = "eval.json"  # the default evaluation of the run's latest step
EVALS_SUBDIR = "evals"  # every evaluation: one file per step and settings
DEFAULT_SETTINGS_ID = "default"
SETTINGS_ID_HEX_DIGITS = 8
# For configs whose `eval` section does not say (e.g. configs/arithmetic.py).
# Config keys that name a config rather than set anything (each value a variant sets shows
# in its own key): left out of an evaluation's config_changes.
LABEL_KEYS = ("variant",)

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags, defined only when run as a script (tba_jax.cli's rule)."""
    cli.define_checkpoint_flags()
    config_flags.DEFINE_config_file(
        "config", None, "Optional config (path[:variant]) replacing <workdir>/config.json."
    )
    flags.DEFINE_integer(
        "num_samples", None, "Sampled responses per problem for pass@k (0: greedy only)."
    )
    flags.DEFINE_list("ks", None, "The k of pass@k, e.g. 1,4,16 (each <= num_samples).")
    flags.DEFINE_integer("max_new_tokens", None, "Response length limit.")
    flags.DEFINE_integer("num_examples", None, "First N test problems; 0: all.")
    flags.DEFINE_string(
        "out",
        None,
        f"Output JSON instead of <workdir>/{EVALS_SUBDIR}/step_<step>[_<id>].json (and "
        f"<workdir>/{OUT_FILENAME}).",
    )
    flags.adopt_module_key_flags(cli)  # -v / --verbosity in --help
    distributed.define_flags()
    flags.adopt_module_key_flags(distributed)


class OutputConflictError(Exception):
    """The output file holds another evaluation, which must not be replaced."""


@dataclasses.dataclass(frozen=True)
class EvalIdentity:
    """What an evaluation's result depends on: the checkpoint step and the settings."""

    step: int
    settings_id: str  # DEFAULT_SETTINGS_ID or a hash of `settings`
    settings: dict  # settings_record(...)

    def as_dict(self) -> dict:
        return {"step": self.step, "settings_id": self.settings_id, "settings": self.settings}

    def matches(self, stored: dict) -> bool:
        """Whether `stored` (an evaluation's JSON) is an evaluation of this step and settings."""
        return stored.get("step") == self.step and stored.get("settings") == self.settings


# ------------------------------------------------------------------------ settings


def parse_ks(values: list[str]) -> tuple[int, ...]:
    """['1', '4'] -> (1, 4); ConfigError for anything that is not an integer."""
    try:
        return tuple(int(value) for value in values)
    except ValueError:
        raise ConfigError(f"--ks={','.join(values)} must be integers, e.g. 1,4,16.") from None


def flag_overrides() -> dict:
    """The evaluation settings given as flags, by their EvalSettings field name."""
    given = {
        "max_new_tokens": FLAGS.max_new_tokens,
        "num_examples": FLAGS.num_examples,
        "num_samples": FLAGS.num_samples,
        "ks": parse_ks(FLAGS.ks) if FLAGS.ks else None,
    }
    return {name: value for name, value in given.items() if value is not None}


def flat_config(config) -> dict:
    """The config as {dotted key: JSON value} (tuples become lists, as in config.json)."""

    def leaves(value, prefix: str):
        if not isinstance(value, dict):
            yield prefix, value
            return
        for key, item in value.items():
            yield from leaves(item, f"{prefix}.{key}" if prefix else key)

    return dict(leaves(json.loads(config.to_json_best_effort()), ""))


def config_changes(run_config, eval_config) -> dict:
    """{dotted key: the evaluation's value} for each key but LABEL_KEYS where `eval_config`
    differs from the run's config (None: a key the evaluation's config lacks)."""
    run, used = flat_config(run_config), flat_config(eval_config)
    keys = (run.keys() | used.keys()) - set(LABEL_KEYS)
    differing = (key for key in keys if run.get(key) != used.get(key))
    return {key: used.get(key) for key in sorted(differing)}


def settings_record(settings: tasks.EvalSettings, changes: dict) -> dict:
    """Everything besides the step that an evaluation's result depends on, as JSON values."""
    return {**dataclasses.asdict(settings), "ks": list(settings.ks), "config_changes": changes}


def settings_id(record: dict, default_record: dict) -> str:
    """DEFAULT_SETTINGS_ID for the default settings, else a short hash of `record`."""
    if record == default_record:
        return DEFAULT_SETTINGS_ID
    digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()
    return digest[:SETTINGS_ID_HEX_DIGITS]


def eval_identity(run_config, eval_config, settings, step: int) -> EvalIdentity:
    """The identity of evaluating `step` with `settings` and `eval_config` (which may be
    --config), against the default: the run's own config and no flags."""
    record = settings_record(settings, config_changes(run_config, eval_config))
    default_record = settings_record(runs.eval_settings(run_config), {})
    return EvalIdentity(step, settings_id(record, default_record), record)


# ------------------------------------------------------------------------ output files


def eval_path(workdir: str, identity: EvalIdentity) -> str:
    """<workdir>/evals/step_<step>.json, or step_<step>_<settings id>.json."""
    suffix = "" if identity.settings_id == DEFAULT_SETTINGS_ID else f"_{identity.settings_id}"
    return os.path.join(workdir, EVALS_SUBDIR, f"step_{identity.step}{suffix}.json")


def stored_evaluation(path: str) -> dict | None:
    """The JSON object in `path`; None when there is no file or it holds something else."""
    try:
        with open(path) as f:
            stored = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return stored if isinstance(stored, dict) else None


def describe(stored: dict | None) -> str:
    """What a stored file holds, for error messages."""
    if stored is None or "step" not in stored:
        return "something other than an evaluation"
    settings_id = stored.get("settings_id", "not recorded")
    return f"the evaluation of step {stored.get('step')} (settings {settings_id})"


def check_replaceable(path: str, identity: EvalIdentity) -> None:
    """OutputConflictError when `path` exists and holds anything but an evaluation of the
    same step and settings (which re-running may rewrite)."""
    if not os.path.exists(path):
        return
    stored = stored_evaluation(path)
    if stored is None or not identity.matches(stored):
        raise OutputConflictError(
            f"{path} holds {describe(stored)}, not one of step {identity.step} with settings "
            f"{identity.settings_id}; pass another --out, or remove {path} to replace it."
        )


def is_latest_default(stored: dict | None) -> bool:
    """Whether `stored` is what eval.json holds in this layout: a default evaluation."""
    return stored is not None and stored.get("settings_id") == DEFAULT_SETTINGS_ID


def updates_latest_default(path: str, identity: EvalIdentity, latest_step: int) -> bool:
    """Whether `identity`'s result becomes <workdir>/eval.json: a default evaluation of the
    run's latest step, and `path` holds no default evaluation of a newer step."""
    if identity.settings_id != DEFAULT_SETTINGS_ID or identity.step != latest_step:
        return False
    stored = stored_evaluation(path)
    return not is_latest_default(stored) or stored.get("step", -1) <= identity.step


def set_aside_unrecorded(path: str, workdir: str) -> str | None:
    """Copies a file at `path` that is not a default evaluation in this layout (one written
    before it, without its settings) into evals/ as step_<step>_unrecorded_<hash>.json, so
    replacing `path` loses nothing; returns the copy's path (None: nothing to keep)."""
    stored = stored_evaluation(path)
    if not os.path.exists(path) or is_latest_default(stored):
        return None
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:SETTINGS_ID_HEX_DIGITS]
    step = (stored or {}).get("step", "unknown")
    copy = os.path.join(workdir, EVALS_SUBDIR, f"step_{step}_unrecorded_{digest}.json")
    os.makedirs(os.path.dirname(copy), exist_ok=True)
    shutil.copyfile(path, copy)
    return copy


def write_result(workdir: str, out: str | None, result: dict, latest_step: int) -> list[str]:
    """Writes `result` to `out`, or to its evals/ file and (for the default evaluation of
    the latest step) eval.json; returns the paths written."""
    identity = EvalIdentity(result["step"], result["settings_id"], result["settings"])
    if out is not None:
        return [write_json_atomically(out, result)]
    written = [write_json_atomically(eval_path(workdir, identity), result)]
    latest_default = os.path.join(workdir, OUT_FILENAME)
    if updates_latest_default(latest_default, identity, latest_step):
        kept = set_aside_unrecorded(latest_default, workdir)
        if kept is not None:
            logging.warning("Kept the earlier %s as %s.", latest_default, kept)
        written.append(write_json_atomically(latest_default, result))
    return written


# ------------------------------------------------------------------------ evaluation


def latest_checkpoint_step(config, workdir: str, step: int | None = None) -> int:
    """The workdir's latest checkpoint step (the checkpoints must be of `config`'s run);
    FileNotFoundError, before any data is read, when it has none or `step` is not saved."""
    with runs.reading_checkpointer(config, workdir):  # checks whose checkpoints they are
        saved = runs.saved_steps(workdir)
    runs.saved_step(workdir, step, saved)
    return saved[-1]


def note_if_unfinished(run_config, workdir: str, latest_step: int) -> None:
    """A warning when the run has not reached its learner_steps (stopped, or still going):
    its evaluation is of a policy part-way through training."""
    if latest_step < run_config.learner_steps:
        logging.warning(
            "%s is unfinished: its latest checkpoint is step %d of %d.",
            workdir,
            latest_step,
            run_config.learner_steps,
        )


def evaluate_run(
    config, workdir: str, step: int | None, settings, identify: Callable[[int], EvalIdentity]
) -> dict:
    """The metrics of the run's policy at checkpoint `step` (None: the latest when it is
    read; a run still training may have saved a newer one meanwhile) on its task's test
    split, with the evaluation's identity: `identify(the step read)`."""
    # the policy, π_ref and the role models (reward models, victim, judge) sharded as the
    # trainer's sampler holds them, the batches' rows split over the other devices; the
    # victim generates with the evaluation's engine
    placement = over_all_devices(config)
    task = tasks.build_task(
        config.task, workdir, runs.policy_tokenizer(config), placement, settings.engine
    )
    mesh, rules = (None, ()) if placement is None else (placement.mesh, placement.rules)
    run = runs.restore_run(config, workdir, step, mesh=mesh, rules=rules)
    identity = identify(run.step)
    if mesh is not None and mesh.size > 1:
        logging.info("Evaluating on %d devices: %s.", mesh.size, dict(mesh.shape))
    metrics = evaluation.evaluate_policy(
        run.model, run.params, task, settings, reference_params=run.reference_params
    )
    return {
        "config_name": config.name,
        "variant": config.get("variant", ""),
        "task": task.name,
        **identity.as_dict(),
        "policy_version": int(run.metadata["policy_version"]),
        **metrics,
    }


# What a user's mistake raises: printed as one `error: ...` line by `cli.run`.
USER_ERRORS = (
    ConfigError,
    CheckpointMismatchError,
    CheckpointUnreadableError,
    FileNotFoundError,
    OutputConflictError,
)


def main(argv):
    del argv
    if (FLAGS.num_processes or 1) > 1 or distributed.cluster_detected():
        # a run of any layout is evaluated from its checkpoint by one process
        raise cli.UsageError(
            "experiments/evaluate.py runs as one process (it reads the checkpoint of a run "
            "made by any number of processes); start it without tba_jax.launch / srun, on "
            "one host."
        )
    workdir, step = runs.run_and_step(FLAGS.workdir, FLAGS.checkpoint, FLAGS.checkpoint_step)
    run_config = runs.load_config(workdir)
    config = FLAGS.config or run_config
    config_lib.check_config_kind(config)
    settings = runs.eval_settings(config, flag_overrides())
    evaluation.check_settings(settings)
    latest_step = latest_checkpoint_step(config, workdir, step)
    note_if_unfinished(run_config, workdir, latest_step)

    def identify(step_read: int) -> EvalIdentity:
        """The evaluation's identity, its output checked (before anything is evaluated)."""
        identity = eval_identity(run_config, config, settings, step_read)
        check_replaceable(FLAGS.out or eval_path(workdir, identity), identity)
        return identity

    identify(latest_step if step is None else step)  # before any data or checkpoint is read
    compile_cache.use(config)
    with runs.steps_picked_with("--checkpoint_step"):
        result = evaluate_run(config, workdir, step, settings, identify)
    identity = EvalIdentity(result["step"], result["settings_id"], result["settings"])
    written = write_result(workdir, FLAGS.out, result, max(latest_step, identity.step))
    logging.info("Wrote %s: %s", ", ".join(written), json.dumps(result, sort_keys=True))
    print(
        json.dumps({"step": identity.step, "settings_id": identity.settings_id, "files": written})
    )


if __name__ == "__main__":
    define_flags()
    cli.run(main, user_errors=USER_ERRORS)
