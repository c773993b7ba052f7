"""A training run's workdir, read by every tool: its config, identity and checkpoints.

`train.py` writes a run; everything that reads one (evaluate, export, notebooks, the
training loop when it resumes) goes through this module, which never imports the
training loop:

- `load_config(workdir)` / `write_config(workdir, config)`: `workdir/config.json`;
- `model_config(config, vocab_size)`, `policy_tokenizer(config)`: the policy's
  architecture and (for Hugging Face runs) its tokenizer; `run_tokenizer(config, workdir)`:
  the tokenizer of any run;
- `experiment_identity(config, model_cfg)`: what a workdir's checkpoints must match;
- `checkpoint_template(...)`: the abstract pytree a checkpoint restores into;
- `restore_run(config, workdir, step)`: the trained policy and π_ref on one device.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import NamedTuple

import jax
import ml_collections

from tba_jax import learner, tasks
from tba_jax import mesh as mesh_lib
from tba_jax.checkpoint import CHECKPOINTS_SUBDIR, EXPERIMENT_FILENAME, Checkpointer
from tba_jax.models import Model, ModelConfig, Params, abstract_model, preset
from tba_jax.tasks.base import task_identity

CONFIG_FILENAME = "config.json"
PROCESSES_KEY = "processes"  # a multi-process run's layout in the experiment identity


def write_config(workdir: str, config: ml_collections.ConfigDict) -> None:
    """Saves the run's full config as JSON, so tools can rebuild the run from its workdir."""
    path = os.path.join(workdir, CONFIG_FILENAME)
    with open(path + ".tmp", "w") as f:
        f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    os.replace(path + ".tmp", path)


def load_config(workdir: str) -> ml_collections.ConfigDict:
    """The config a run was started with (`workdir/config.json`, written at its start)."""
    path = os.path.join(workdir, CONFIG_FILENAME)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} is missing: {workdir} is not the workdir of a tba_jax training run."
        )
    with open(path) as f:
        return ml_collections.ConfigDict(json.load(f))


def policy_tokenizer(config: ml_collections.ConfigDict):
    """The tokenizer of `model.hf_path`'s checkpoint, or None to use the task's own."""
    if not config.model.hf_path:
        return None
    from tba_jax.models.hf_tokenizer import HFTokenizer  # optional: needs safetensors/tokenizers

    return HFTokenizer.from_pretrained(config.model.hf_path)


def run_tokenizer(config: ml_collections.ConfigDict, workdir: str):
    """The tokenizer the run `config` in `workdir` trains with: `model.hf_path`'s, else its
    task's own (e.g. the arithmetic task's CharTokenizer), built as the run builds it."""
    return policy_tokenizer(config) or tasks.build_task(config.task, workdir).tokenizer


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
    """The policy's architecture: from `model.hf_path`'s config.json, else a named preset."""
    if config.model.hf_path:
        from tba_jax.models import hf  # optional: needs safetensors/tokenizers

        loaded = hf.config_from_hf(config.model.hf_path)
        if vocab_size > loaded.vocab_size:
            raise ValueError(
                f"The tokenizer has {vocab_size} ids but the model in {config.model.hf_path} "
                f"has {loaded.vocab_size} embeddings; use the tokenizer that came with it."
            )
        return dataclasses.replace(
            loaded, dtype=config.model.dtype, param_dtype=config.model.param_dtype
        )
    return preset(
        config.model.preset,
        vocab_size=vocab_size,
        max_seq_len=config.max_prompt_len + config.max_response_len,
        dtype=config.model.dtype,
        param_dtype=config.model.param_dtype,
    )


def optim_config(config: ml_collections.ConfigDict) -> learner.OptimConfig:
    return learner.OptimConfig(total_steps=config.learner_steps, **config.optim.to_dict())


def loss_options(config: ml_collections.ConfigDict) -> dict:
    """The keyword options of `config.method`'s loss: `config.loss.<method>` (none: {})."""
    options = config.loss.get(config.method)
    return options.to_dict() if isinstance(options, ml_collections.ConfigDict) else {}


def experiment_identity(
    config: ml_collections.ConfigDict, model_cfg: ModelConfig | None, layout: dict | None = None
) -> dict:
    """What a workdir's checkpoints must match to be resumed by this config (without the
    "model" entry when `model_cfg` is None: all that is known before the task is built).
    `layout`: a multi-process run's `Topology.describe()` (its checkpoints hold one buffer
    per process, so only the same layout resumes them)."""
    identity = {
        "config_name": config.name,
        "mode": config.mode,
        "method": config.method,
        "task": task_identity(config.task),
        "policy_init": config.model.hf_path,
        "reference": config.reference.hf_path,
    }
    if model_cfg is not None:
        identity["model"] = model_cfg.to_dict()
    if layout is not None:
        identity[PROCESSES_KEY] = layout
    return identity


def checkpoint_template(optimizer, abstract_params, state_sharding, sampler_shardings) -> dict:
    """The abstract pytree a run's checkpoint restores into (allocates nothing)."""
    return {
        "train": learner.abstract_train_state(optimizer, abstract_params, state_sharding)._asdict(),
        "reference": mesh_lib.abstract_on(abstract_params, sampler_shardings),
    }


def stored_experiment(workdir: str) -> dict:
    """The experiment identity a workdir's checkpoints were written for (experiment.json)."""
    path = os.path.join(workdir, CHECKPOINTS_SUBDIR, EXPERIMENT_FILENAME)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"No checkpoint in workdir {workdir} ({path} is missing); pass the --workdir of a "
            "run that saved one."
        )
    with open(path) as f:
        return json.load(f)


def stored_model_config(workdir: str) -> ModelConfig:
    """The model config a workdir's checkpoints were written for (from experiment.json)."""
    return ModelConfig(**stored_experiment(workdir)["model"])


class RestoredRun(NamedTuple):
    """A run's checkpoint on the default device: the trained policy and π_ref."""

    model: Model
    params: Params
    reference_params: Params
    metadata: dict


def restore_run(
    config: ml_collections.ConfigDict, workdir: str, step: int | None = None
) -> RestoredRun:
    """Loads the trained policy and reference of the run `config` in `workdir` (latest step
    by default), onto the default device. Raises a clear error if the workdir has no
    checkpoint or one of another experiment."""
    model_cfg = stored_model_config(workdir)
    layout = stored_experiment(workdir).get(PROCESSES_KEY)  # any run's policy loads here
    checkpointer = Checkpointer(workdir, experiment=experiment_identity(config, model_cfg, layout))
    model, abstract_params = abstract_model(model_cfg)
    mesh = mesh_lib.make_mesh(jax.devices()[:1], {})
    shardings = mesh_lib.param_shardings(model.logical_axes, abstract_params, mesh, [])
    optimizer = learner.make_optimizer(optim_config(config))
    state_sharding = learner.train_state_shardings(optimizer, abstract_params, shardings, mesh)
    template = checkpoint_template(optimizer, abstract_params, state_sharding, shardings)
    restored, _, metadata = checkpointer.restore(train_state_template=template, step=step)
    checkpointer.close()
    return RestoredRun(model, restored["train"]["params"], restored["reference"], metadata)


def restore_policy(config: ml_collections.ConfigDict, workdir: str, step: int | None = None):
    """(model, params, metadata) of the run `config` in `workdir`; see `restore_run`."""
    run = restore_run(config, workdir, step)
    return run.model, run.params, run.metadata


def load_trained_policy(workdir: str, step: int | None = None) -> tuple[ModelConfig, Params]:
    """The model config and trained params of the run in `workdir` (latest step by default)."""
    model, params, _ = restore_policy(load_config(workdir), workdir, step)
    return model.config, params
