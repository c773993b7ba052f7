r"""Exports a training run's policy as a Hugging Face folder transformers loads.

    python experiments/export_hf.py --workdir=/tmp/from_hf --out=/tmp/exported
    python experiments/export_hf.py --workdir=W --out=DIR --dtype=bfloat16 --checkpoint_step=100 \
        --hf_config_overrides='{"eos_token_id": 2}'
    python experiments/export_hf.py --checkpoint=W/checkpoints/100 --out=DIR  # one checkpoint
    python experiments/export_hf.py --workdir=W --out=DIR --critic   # a PPO run's critic
    python experiments/export_hf.py --workdir=W --out=DIR --overwrite  # replace an export

Writes config.json and the weights (sharded with an index past 5 GB) of the latest (or
`--checkpoint_step`'s) checkpoint in `--workdir` (or of the `--checkpoint` folder
`<workdir>/checkpoints/<step>`, as `evaluate.py` takes them), and the run's tokenizer with
its token ids in config.json, so the export is usable as it is (in transformers, or as
`model.hf_path` of a new run): a run started from a Hugging Face folder (`model.hf_path`)
gets that folder's tokenizer files; a run with the built-in char tokenizer (the arithmetic
demo) gets it as a tokenizer.json with the same ids. Prints one JSON line: workdir, the
step exported, out, family, num_params and the files written.

`--out` must be a new or empty folder, and never the run's workdir or a checkpoint folder
the run reads (`model.hf_path`, `reference.hf_path`, any other `hf_path` of its config),
nor any training run's workdir or a folder inside one (not even with `--overwrite`).
`--overwrite` writes into a non-empty folder: it first removes the files an export writes
or a loader would read with them (`*.safetensors`, `*.safetensors.index.json`,
config.json, the tokenizer files) and keeps the others.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from typing import Any

from absl import flags

from tba_jax import cli, config_lib, runs
from tba_jax.checkpoint import (
    CheckpointMismatchError,
    CheckpointUnreadableError,
)
from tba_jax.config_lib import ConfigError
from tba_jax.models import hf
from tba_jax.models.config import DTYPES

SHOWN_ENTRIES = 3  # entries of a non-empty --out named in its error


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
    overwrite: bool = False,
) -> dict[str, Any]:
    """Writes the latest (or `step`'s) policy of the training run in `workdir` to `out`, with
    the run's tokenizer and its token ids in config.json, so the export is usable as is.
    `critic`: write a PPO run's value model instead, as a one-label score-head model
    (`*ForSequenceClassification`; its per-token scores are the values). `out` must be a
    new or empty folder that is neither the workdir nor a checkpoint folder of the run
    (ConfigError, before any checkpoint is read); `overwrite` allows a non-empty one,
    whose earlier export files (`hf.export_files_in`) are removed first. Returns the
    summary the command line prints."""
    config = runs.load_config(workdir)
    check_out(config, workdir, out, overwrite=overwrite)
    if critic:
        check_trains_a_critic(config, workdir)
    restored = runs.restore_run(config, workdir, step)
    if critic:
        critic_model, critic_params = restored.critic
        model_cfg, params = critic_model.score_model(restored.params, critic_params)
    else:
        model_cfg, params = restored.model.config, restored.params
    tokenizer = ExportedTokenizer.of_run(config, workdir)
    if overwrite:
        hf.remove_export_files(out)
    overrides = {**tokenizer.token_ids, **(hf_config_overrides or {})}
    files = hf.save_hf(out, model_cfg, params, dtype=dtype, hf_config_overrides=overrides)
    files += tokenizer.write(out)
    return dict(
        workdir=workdir,
        step=restored.step,
        out=out,
        family=model_cfg.family,
        num_params=model_cfg.num_params(),
        files=[os.path.basename(path) for path in files],
    )


def check_out(config, workdir: str, out: str, *, overwrite: bool) -> None:
    """ConfigError when `out` is the run's workdir or one of its checkpoint folders (the
    export would overwrite what the run reads, e.g. its π_ref), any run's workdir or a
    folder inside one, a file, or a non-empty folder without `overwrite` (an earlier
    export's files would be left beside the new)."""
    check_not_read_by_the_run(config, workdir, out)
    check_in_no_run(out)
    check_empty_folder(out, overwrite=overwrite)


def check_not_read_by_the_run(config, workdir: str, out: str) -> None:
    """ConfigError when `out` is the run's workdir or a checkpoint folder of its config."""
    if same_folder(out, workdir):
        raise ConfigError(
            f"--out={out} is the run's workdir; pass another folder, e.g. "
            f"{beside_the_run(workdir)}."
        )
    for key, folder in config_lib.hf_folders(config.to_dict()):
        if same_folder(out, folder):
            raise ConfigError(
                f"--out={out} is the run's {key}={folder}, a checkpoint the run reads; "
                "exporting there would overwrite it. Pass another folder."
            )


def check_in_no_run(out: str) -> None:
    """ConfigError when `out` is a training run's workdir or lies inside one: an export
    (with --overwrite) would replace that run's config.json, or write into its checkpoints."""
    run = runs.enclosing_run(out)
    if run is None:
        return
    where = "is" if same_folder(out, run) else "lies inside"
    shown = ", ".join(runs.run_files_in(run))
    raise ConfigError(
        f"--out={out} {where} the workdir of a training run ({run} holds {shown}); an export "
        f"there would overwrite the run's files. Pass a folder outside any run, e.g. "
        f"{beside_the_run(run)}."
    )


def beside_the_run(workdir: str) -> str:
    """A folder to export `workdir`'s run to that is not inside it: <workdir>_hf."""
    return os.path.abspath(workdir).rstrip(os.sep) + "_hf"


def check_empty_folder(out: str, *, overwrite: bool) -> None:
    """ConfigError when `out` is a file, or a non-empty folder without `overwrite`."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out={out} is a file, not a folder; pass a new or empty folder.")
    entries = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if entries and not overwrite:
        shown = ", ".join(entries[:SHOWN_ENTRIES]) + (", ..." if entries[SHOWN_ENTRIES:] else "")
        raise ConfigError(
            f"--out={out} is not empty (it holds {shown}); pass a new or empty folder, or "
            "--overwrite to replace the export there "
            "(removes its *.safetensors, index, config.json and tokenizer files first)."
        )


def same_folder(a: str, b: str) -> bool:
    """Whether paths `a` and `b` name the same file or folder (links resolved; for a path
    that does not exist yet, by its absolute real path)."""
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


def check_trains_a_critic(config, workdir: str) -> None:
    """ConfigError for --critic on a run of a method without a critic (a value model)."""
    if not runs.uses_critic(config):
        raise ConfigError(
            f"{workdir} is a method={config.method} run, which trains no critic; --critic "
            "exports the value model of a method=ppo run."
        )


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
    """The command line's flags, defined only when run as a script (tba_jax.cli's rule)."""
    cli.define_checkpoint_flags()
    flags.DEFINE_alias("step", "checkpoint_step")  # its name before it matched evaluate.py's
    flags.DEFINE_string("out", None, "Output folder.")
    flags.DEFINE_enum("dtype", None, sorted(DTYPES), "Stored dtype; default the params'.")
    flags.DEFINE_string(
        "hf_config_overrides",
        None,
        "JSON object of extra config.json keys, e.g. '{\"eos_token_id\": 2}'.",
    )
    flags.DEFINE_bool(
        "critic", False, "Export a PPO run's value model (a one-label score-head model)."
    )
    flags.DEFINE_bool(
        "overwrite",
        False,
        "Write into a non-empty --out: first remove an earlier export's *.safetensors, "
        "index, config.json and tokenizer files there (other files stay).",
    )
    flags.adopt_module_key_flags(cli)
    flags.mark_flags_as_required(["out"])  # and --workdir or --checkpoint


def main(argv):
    del argv
    values = flags.FLAGS
    workdir, step = runs.run_and_step(values.workdir, values.checkpoint, values.checkpoint_step)
    overrides = parse_overrides(values.hf_config_overrides)
    cli.check_output_dir(values.out, "out")
    with runs.steps_picked_with("--checkpoint_step"):
        result = export_run(
            workdir,
            values.out,
            dtype=values.dtype,
            step=step,
            hf_config_overrides=overrides,
            critic=values.critic,
            overwrite=values.overwrite,
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
