r"""Exports a training run's policy as a Hugging Face folder transformers loads.

    python experiments/export_hf.py --workdir=/tmp/from_hf --out=/tmp/exported
    python experiments/export_hf.py --workdir=W --out=DIR --dtype=bfloat16 --step=100 \
        --hf_config_overrides='{"eos_token_id": 2}'
    python experiments/export_hf.py --workdir=W --out=DIR --critic   # a PPO run's critic

Writes config.json and the weights (sharded with an index past 5 GB) of the latest (or
`--step`'s) checkpoint in `--workdir`, and the run's tokenizer with its token ids in
config.json, so the export is usable as it is (in transformers, or as `model.hf_path` of a
new run): a run started from a Hugging Face folder (`model.hf_path`) gets that folder's
tokenizer files; a run with the built-in char tokenizer (the arithmetic demo) gets it as a
tokenizer.json with the same ids. Prints one JSON line: workdir, out, family, num_params
and the files written.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from typing import Any

from absl import flags

from tba_jax import cli, runs
from tba_jax.checkpoint import CheckpointMismatchError, CheckpointUnreadableError
from tba_jax.config_lib import ConfigError
from tba_jax.models import hf
from tba_jax.models.config import DTYPES


@dataclasses.dataclass(frozen=True)
class ExportedTokenizer:
    """A run's tokenizer as an export carries it: the token ids config.json records
    (transformers reads them from there) and what writes its files into the export."""

    token_ids: dict[str, Any]
    write: Callable[[str], list[str]]  # (out folder) -> the paths written

    @classmethod
    def of_run(cls, config, workdir: str) -> ExportedTokenizer:
        source = config.model.hf_path
        if source:  # the checkpoint's own tokenizer files, as they are
            return cls(hf.token_ids_of(source), functools.partial(hf.copy_tokenizer_files, source))
        tokenizer = runs.run_tokenizer(config, workdir)  # the task's own, e.g. a CharTokenizer
        token_ids = {
            "bos_token_id": tokenizer.bos_id,
            "eos_token_id": tokenizer.eos_id,
            "pad_token_id": tokenizer.pad_id,
        }
        return cls(token_ids, tokenizer.save_pretrained)


def export_run(
    workdir: str,
    out: str,
    *,
    dtype: str | None = None,
    step: int | None = None,
    hf_config_overrides: dict[str, Any] | None = None,
    critic: bool = False,
) -> dict[str, Any]:
    """Writes the latest (or `step`'s) policy of the training run in `workdir` to `out`, with
    the run's tokenizer and its token ids in config.json, so the export is usable as is.
    `critic`: write a PPO run's value model instead, as a one-label score-head model
    (`*ForSequenceClassification`; its per-token scores are the values). Returns the
    summary the command line prints."""
    config = runs.load_config(workdir)
    if critic:
        model_cfg, params = trained_critic(config, workdir, step)
    else:
        model_cfg, params = runs.load_trained_policy(workdir, step)
    tokenizer = ExportedTokenizer.of_run(config, workdir)
    overrides = {**tokenizer.token_ids, **(hf_config_overrides or {})}
    files = hf.save_hf(out, model_cfg, params, dtype=dtype, hf_config_overrides=overrides)
    files += tokenizer.write(out)
    return dict(
        workdir=workdir,
        out=out,
        family=model_cfg.family,
        num_params=model_cfg.num_params(),
        files=[os.path.basename(path) for path in files],
    )


def trained_critic(config, workdir: str, step: int | None):
    """The score-head model (config, params) of a PPO run's critic; ConfigError for a run
    of a method without one."""
    if not runs.uses_critic(config):
        raise ConfigError(
            f"{workdir} is a method={config.method} run, which trains no critic; --critic "
            "exports the value model of a method=ppo run."
        )
    restored = runs.restore_run(config, workdir, step)
    critic, critic_params = restored.critic
    return critic.score_model(restored.params, critic_params)


def parse_overrides(text: str | None) -> dict[str, Any] | None:
    """--hf_config_overrides as a dict; ConfigError when it is not a JSON object."""
    if text is None:
        return None
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"--hf_config_overrides={text} is not JSON ({error}).") from None
    if not isinstance(overrides, dict):
        raise ConfigError(
            f"--hf_config_overrides={text} must be a JSON object, e.g. '{{\"eos_token_id\": 2}}'."
        )
    return overrides


def define_flags() -> None:
    """The command line's flags (defined only when run as a script, so importing this module
    for its functions registers nothing in absl's global flags)."""
    flags.DEFINE_string("workdir", None, "The training run's --workdir.")
    flags.DEFINE_string("out", None, "Output folder.")
    flags.DEFINE_enum("dtype", None, sorted(DTYPES), "Stored dtype; default the params'.")
    flags.DEFINE_integer("step", None, "Checkpoint step; default the latest.")
    flags.DEFINE_string(
        "hf_config_overrides",
        None,
        "JSON object of extra config.json keys, e.g. '{\"eos_token_id\": 2}'.",
    )
    flags.DEFINE_bool(
        "critic", False, "Export a PPO run's value model (a one-label score-head model)."
    )
    flags.adopt_module_key_flags(cli)
    flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
    del argv
    values = flags.FLAGS
    overrides = parse_overrides(values.hf_config_overrides)
    cli.check_output_dir(values.out, "out")
    result = export_run(
        values.workdir,
        values.out,
        dtype=values.dtype,
        step=values.step,
        hf_config_overrides=overrides,
        critic=values.critic,
    )
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    define_flags()
    cli.run(
        main,
        user_errors=(
            ConfigError,
            CheckpointMismatchError,
            CheckpointUnreadableError,
            FileNotFoundError,
        ),
    )
