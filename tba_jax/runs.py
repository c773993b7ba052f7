"""A training run's workdir, read by every tool: its config, identity and checkpoints.

`train.py` writes a run; everything that reads one (evaluate, export, notebooks, the
training loop when it resumes) goes through this module, which never imports the
training loop:

- `load_config(workdir)` / `write_config(workdir, config)`: `workdir/config.json`;
  `holds_a_run(folder)` / `enclosing_run(path)`: where a run's files are;
- `model_config(config, vocab_size)`, `policy_tokenizer(config)`: the policy's
  architecture and (for Hugging Face runs) its tokenizer; `run_tokenizer(config, workdir)`:
  the tokenizer of any run;
- `experiment_identity(config, model_cfg)`: what a workdir's checkpoints must match to be
  resumed; `reading_identity(config, workdir)`: to be read (by any process layout), and
  `reading_checkpointer(config, workdir)` checking it;
- `checkpoint_template(...)`: the abstract pytree a checkpoint restores into;
- `restore_run(config, workdir, step)`: the trained policy and π_ref on one device (or a
  given mesh), computing with the run's execution knobs as this platform runs them
  (`runnable_execution_fields`);
- `read_checkpoint(workdir, step, read)`: any read of a checkpoint, tried again while a
  run in progress saves and removes checkpoints around it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar

import jax
import ml_collections

from tba_jax import config_lib, learner, sources, tasks
from tba_jax import mesh as mesh_lib
from tba_jax.checkpoint import (
    CHECKPOINTS_SUBDIR,
    EXPERIMENT_FILENAME,
    Checkpointer,
    CheckpointUnreadableError,
    restore_failure,
)
from tba_jax.errors import ConfigError
from tba_jax.models import (
    Model,
    ModelConfig,
    Params,
    abstract_model,
    preset,
    stack_layers,
    unstack_layers,
)
from tba_jax.models.config import EXECUTION_FIELDS, off_platform
from tba_jax.tasks.base import task_identity
from tba_jax.warmstart import WarmStartCheckpoint

T = TypeVar("T")
CONFIG_FILENAME = "config.json"
PROCESSES_KEY = "processes"  # a multi-process run's layout in the experiment identity
# Keys every run's config.json has (config_lib.base_config's); a config.json without them
# is another file of that name, e.g. an exported model's.
RUN_CONFIG_KEYS = ("name", "mode", "method", "seed", "task", "model", "eval")
# What train.py writes into a run's workdir besides config.json: the summary when it ends,
# an unfinished warm start's progress (train.py takes these names from here).
SUMMARY_FILENAME = "summary.json"
WARM_START_SUBDIR = "warm_start"

# A checkpoint read of a run in progress is tried this many times, this far apart, while
# the run saves and removes checkpoints around it (`keep_checkpoints`).
READ_ATTEMPTS = 5
READ_RETRY_S = 0.5
# orbax's warning for a step whose save is still being finalized, when a reader lists the
# checkpoints of a run in progress
STEP_IN_FLIGHT_NOTICE = "Metadata file does not exist"


def write_config(workdir: str, config: ml_collections.ConfigDict) -> None:
    """Saves the run's full config as JSON, so tools can rebuild the run from its workdir."""
    path = os.path.join(workdir, CONFIG_FILENAME)
    with open(path + ".tmp", "w") as f:
        f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    os.replace(path + ".tmp", path)


def load_config(workdir: str) -> ml_collections.ConfigDict:
    """The config a run was started with (`workdir/config.json`, written at its start).
    FileNotFoundError when there is none, or the file there is not a run's config."""
    path = os.path.join(workdir, CONFIG_FILENAME)
    if config_lib.is_url(workdir):
        raise FileNotFoundError(
            f"{workdir} is a URL: runs are read through the filesystem; mount the bucket "
            "(e.g. with gcsfuse) and pass the run's folder there."
        )
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} is missing: {workdir} is not the workdir of a tba_jax training run."
        )
    stored = read_json_object(path)
    missing = [key for key in RUN_CONFIG_KEYS if key not in (stored or {})]
    if missing:
        raise FileNotFoundError(
            f"{path} is not a training run's config (it lacks {', '.join(missing)}; an "
            f"exported model's config.json?): {workdir} is not the workdir of a tba_jax "
            "training run."
        )
    return ml_collections.ConfigDict(stored)


def read_json_object(path: str) -> dict | None:
    """The JSON object in the file `path`; None when it holds anything else."""
    try:
        with open(path) as f:
            stored = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return stored if isinstance(stored, dict) else None


def is_run_config(path: str) -> bool:
    """Whether the file `path` is a training run's config.json (not, e.g., an export's)."""
    stored = read_json_object(path)
    return stored is not None and all(key in stored for key in RUN_CONFIG_KEYS)


def run_files_in(folder: str) -> list[str]:
    """The files in `folder` that only a training run's workdir holds: its checkpoints'
    experiment.json, its saved warm start, or a config.json that is a run's config (names
    such as checkpoints/ or summary.json alone may be anything's)."""
    marks = [
        path
        for path in (
            os.path.join(CHECKPOINTS_SUBDIR, EXPERIMENT_FILENAME),
            os.path.join(WARM_START_SUBDIR, WarmStartCheckpoint.PROGRESS_FILENAME),
        )
        if os.path.isfile(os.path.join(folder, path))
    ]
    config = os.path.join(folder, CONFIG_FILENAME)
    if os.path.isfile(config) and is_run_config(config):
        marks.append(CONFIG_FILENAME)
    return marks


def holds_a_run(folder: str) -> bool:
    """Whether `folder` is a training run's workdir (`run_files_in`)."""
    return os.path.isdir(folder) and bool(run_files_in(folder))


def enclosing_run(path: str) -> str | None:
    """The workdir of the training run that `path` is, or lies inside (links resolved; a
    path that does not exist yet by its real path); None when it is in no run."""
    folder = os.path.realpath(path)
    while True:
        if holds_a_run(folder):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


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


# config.model keys that set how the policy is computed (`ModelConfig`'s execution fields,
# and its params' layout, which a resume converts).
EXECUTION_KEYS = ("scan_layers", *EXECUTION_FIELDS)


def execution_fields(config: ml_collections.ConfigDict) -> dict:
    """`config.model`'s execution knobs as `ModelConfig` fields (those the config has).
    They are not part of a checkpoint's identity (`ModelConfig.to_dict`), so a model
    rebuilt from `stored_model_config` computes as its run did only with these applied."""
    return {key: config.model[key] for key in EXECUTION_KEYS if key in config.model}


def runnable_execution_fields(
    config: ml_collections.ConfigDict, backend: str | None = None
) -> dict:
    """`execution_fields` for reading a run on this process's platform (`backend`, default
    JAX's): a kernel of another platform (cuDNN's attention or the Pallas decode kernels
    off a GPU, splash attention off a TPU) becomes the kernel that computes the same here,
    with a warning, so a run's checkpoint is evaluated, exported or viewed on any
    machine."""
    fields = execution_fields(config)
    backend = backend or jax.default_backend()
    for key, value in list(fields.items()):
        found = off_platform(key, value, backend)
        if found is not None:
            platform, instead = found
            fields[key] = instead
            logging.warning(
                "The run set model.%s=%s, which needs a %s; reading it on %s with "
                "model.%s=%s (the same computation, another kernel).",
                key,
                value,
                platform.upper(),
                backend,
                key,
                instead,
            )
    return fields


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
    """The policy's architecture: from `model.hf_path`'s config.json, else a named preset
    with `vocab_size` embeddings (the tokenizer's ids; `model.vocab_size` when it is set,
    a real checkpoint's row count for a random policy of its shape); with the config's
    dtypes and execution knobs (`EXECUTION_KEYS`)."""
    execution = execution_fields(config)
    rows = config.model.get("vocab_size", 0)  # absent from older runs' config.json
    if rows and config.model.hf_path:
        raise ValueError(
            f"model.vocab_size={rows} is for a preset's random policy; "
            f"the model in model.hf_path={config.model.hf_path!r} has its own (config.json). "
            "Leave model.vocab_size at 0."
        )
    if rows:
        if rows < vocab_size:
            raise ValueError(
                f"model.vocab_size={rows} is smaller than the tokenizer's "
                f"{vocab_size} ids; set it to at least {vocab_size}, or 0 for the tokenizer's."
            )
        vocab_size = rows
    if config.model.hf_path:
        from tba_jax.models import hf  # optional: needs safetensors/tokenizers

        loaded = hf.config_from_hf(config.model.hf_path)
        if vocab_size > loaded.vocab_size:
            raise ValueError(
                f"The tokenizer has {vocab_size} ids but the model in {config.model.hf_path} "
                f"has {loaded.vocab_size} embeddings; use the tokenizer that came with it."
            )
        return dataclasses.replace(
            loaded, dtype=config.model.dtype, param_dtype=config.model.param_dtype, **execution
        )
    return preset(
        config.model.preset,
        vocab_size=vocab_size,
        max_seq_len=config.max_prompt_len + config.max_response_len,
        dtype=config.model.dtype,
        param_dtype=config.model.param_dtype,
        **execution,
    )


def optim_config(config: ml_collections.ConfigDict) -> learner.OptimConfig:
    """The policy's optimiser. Its schedule counts optimiser updates: PPO makes
    `ppo_config(config).updates_per_step` of them per learner step, the others one."""
    updates = ppo_config(config).updates_per_step if uses_critic(config) else 1
    optim = config.optim.to_dict()
    optim["warmup_steps"] = optim["warmup_steps"] * updates
    return learner.OptimConfig(total_steps=config.learner_steps * updates, **optim)


def uses_critic(config: ml_collections.ConfigDict) -> bool:
    """Whether `config.method` trains a value model beside the policy (PPO)."""
    from tba_jax import losses

    return losses.get_loss(config.method).needs_critic


def ppo_config(config: ml_collections.ConfigDict):
    """`config.loss.ppo` as a `tba_jax.ppo.PPOConfig`."""
    from tba_jax import ppo

    return ppo.PPOConfig(**config.loss.ppo.to_dict())


class CriticParts(NamedTuple):
    """What a run with a critic builds it from: the layout, its optimiser, the shardings of
    its TrainState on the learner mesh, and that state's abstract shape (a restore target)."""

    critic: Any  # tba_jax.critic.Critic
    optimizer: Any
    state_sharding: learner.TrainState
    abstract_state: learner.TrainState


def critic_parts(
    config: ml_collections.ConfigDict, policy: Model, mesh: jax.sharding.Mesh, rules
) -> CriticParts | None:
    """PPO's critic for `config` on the learner `mesh` with the sharding `rules`; None for
    a method without one."""
    if not uses_critic(config):
        return None
    from tba_jax import ppo
    from tba_jax.critic import Critic

    value_config = critic_start_config(config, policy.config)  # None: the policy's
    critic = Critic.build(config.loss.ppo.critic, policy, value_config)
    optim = optim_config(config)
    if config.loss.ppo.critic_learning_rate:
        optim = dataclasses.replace(optim, learning_rate=config.loss.ppo.critic_learning_rate)
    optimizer = learner.make_optimizer(optim)
    try:
        state_sharding = ppo.critic_state_shardings(critic, optimizer, mesh, rules)
    except ConfigError as error:
        raise ConfigError(
            f"PPO's critic on the learner mesh: {error} (mesh.learner_rules, "
            "mesh.learner_axes; loss.ppo.critic_init)"
        ) from None
    abstract_state = learner.abstract_train_state(
        optimizer, critic.abstract_params(), state_sharding
    )
    return CriticParts(critic, optimizer, state_sharding, abstract_state)


def starts_from_reward_model(config: ml_collections.ConfigDict) -> bool:
    """Whether PPO's critic starts as the task's reward model (`loss.ppo.critic_init`)."""
    return uses_critic(config) and config.loss.ppo.critic_init == "reward_model"


def critic_role_config(config: ml_collections.ConfigDict, policy_cfg: ModelConfig) -> ModelConfig:
    """The task's reward model's architecture (config files only), as loaded by
    `critic_start_params` for a critic of `policy_cfg`'s vocabulary."""
    from tba_jax.models.frozen import frozen_model_config

    role = config.task.reward_model
    vocab_size = None  # a checkpoint's config.json has its own
    if not role.hf_path:  # a random stand-in covers the policy tokenizer's ids
        tokenizer = policy_tokenizer(config)
        vocab_size = policy_cfg.vocab_size if tokenizer is None else tokenizer.vocab_size
    return frozen_model_config(
        role,
        role_name="task.reward_model",
        vocab_size=vocab_size,
        max_seq_len=role.max_len,
        head="score",
    )


def critic_start_config(
    config: ml_collections.ConfigDict, policy_cfg: ModelConfig
) -> ModelConfig | None:
    """The separate critic's architecture when it starts as the task's reward model, in the
    policy's dtypes; None when it starts from the policy (`Critic.build`'s default)."""
    if not starts_from_reward_model(config):
        return None
    return dataclasses.replace(
        critic_role_config(config, policy_cfg),
        dtype=policy_cfg.dtype,
        param_dtype=policy_cfg.param_dtype,
    )


def critic_start_params(config: ml_collections.ConfigDict, tokenizer) -> Params | None:
    """The task's reward model's weights in the critic's param dtype (what it starts as),
    loaded as the task loads them (a random stand-in shares `tokenizer`); None when the
    critic starts from the policy."""
    if not starts_from_reward_model(config):
        return None
    from tba_jax.models.frozen import DEFAULT_ATTENTION, load_frozen_model

    role = config.task.reward_model.copy_and_resolve_references()
    with role.unlocked():  # a run's config from before roles had `attention` lacks the key
        role.dtype = config.model.param_dtype  # the critic trains in the policy's param dtype
        role.attention = DEFAULT_ATTENTION  # only its weights are read
    frozen = load_frozen_model(
        role,
        role_name="task.reward_model",
        fallback_tokenizer=tokenizer,
        max_seq_len=role.max_len,
        head="score",
    )
    return frozen.params


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


def checkpoint_template(
    optimizer, abstract_params, state_sharding, sampler_shardings, critic: CriticParts | None
) -> dict:
    """The abstract pytree a run's checkpoint restores into (allocates nothing)."""
    train = learner.abstract_train_state(optimizer, abstract_params, state_sharding)
    template = {
        "train": learner.state_items(train),
        "reference": mesh_lib.abstract_on(abstract_params, sampler_shardings),
    }
    if critic is not None:
        template["critic"] = learner.state_items(critic.abstract_state)
    return template


def checkpoint_items(state: learner.TrainState, reference: Params) -> dict:
    """What a checkpoint holds of the learner: the policy's TrainState, π_ref and (PPO)
    the critic's TrainState; the layout of `checkpoint_template`."""
    items = {"train": learner.state_items(state), "reference": reference}
    if state.critic is not None:
        items["critic"] = learner.state_items(state.critic)
    return items


# Checkpoint metadata: whether the checkpoint's params are stacked (`model.scan_layers`).
PARAMS_STACKED_KEY = "params_stacked"


def checkpoint_stacked(metadata: dict, workdir: str) -> bool:
    """Whether a checkpoint's params are in the stacked (`scan_layers`) layout: its
    metadata says; one written before it did has the layout its experiment.json names."""
    if PARAMS_STACKED_KEY in metadata:
        return bool(metadata[PARAMS_STACKED_KEY])
    return bool(stored_experiment(workdir).get("model", {}).get("scan_layers", False))


def convert_layout(tree: Any, stacked: bool) -> Any:
    """`tree` with every params-like dict in it (one with a "blocks" entry: the policy's
    params, Adam's moments of them, π_ref, a separate critic's params) in the stacked
    (`stack_layers`) or per-layer (`unstack_layers`) layout."""
    if isinstance(tree, dict):
        if "blocks" in tree:
            return stack_layers(tree) if stacked else unstack_layers(tree)
        return {key: convert_layout(value, stacked) for key, value in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # optax states
        return type(tree)(*(convert_layout(value, stacked) for value in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(convert_layout(value, stacked) for value in tree)
    return tree


def restore_in_layout(
    checkpointer: Checkpointer,
    step: int,
    template: dict,
    stacked: bool,
    other_layout_template: Callable[[], dict],
) -> tuple[dict, dict, dict]:
    """(train state + π_ref, buffer state, metadata) of checkpoint `step` in `template`
    (a checkpoint template, as `checkpoint_template` makes, its params stacked or not:
    `stacked`), whatever layout the checkpoint was saved in: one of the other layout is
    restored into `other_layout_template()` and converted onto `template`'s shardings."""
    saved_stacked = checkpoint_stacked(checkpointer.read_metadata(step), checkpointer.workdir)
    if saved_stacked == stacked:
        return checkpointer.restore(train_state_template=template, step=step)
    restored, buffer_state, metadata = checkpointer.restore(
        train_state_template=other_layout_template(), step=step
    )
    shardings = jax.tree.map(lambda leaf: leaf.sharding, template)
    convert = jax.jit(lambda tree: convert_layout(tree, stacked), out_shardings=shardings)
    return convert(restored), buffer_state, metadata


def restored_state(restored: dict) -> learner.TrainState:
    """The TrainState (the critic's included) of a checkpoint restored from
    `checkpoint_template`."""
    state = learner.TrainState(**restored["train"])
    if "critic" in restored:
        state = state._replace(critic=learner.TrainState(**restored["critic"]))
    return state


def stored_experiment(workdir: str) -> dict:
    """The experiment identity a workdir's checkpoints were written for (experiment.json)."""
    path = os.path.join(workdir, CHECKPOINTS_SUBDIR, EXPERIMENT_FILENAME)
    if not os.path.exists(path):
        raise no_checkpoint_error(workdir, f"{path} is missing")
    with open(path) as f:
        return json.load(f)


def no_checkpoint_error(workdir: str, why: str | None = None) -> FileNotFoundError:
    """The error for a workdir without a checkpoint (`why`: what shows it): a run stopped
    during its warm start is told to go on, anything else to train first."""
    saved = WarmStartCheckpoint(os.path.join(workdir, WARM_START_SUBDIR)).steps_saved()
    if saved is not None:
        return FileNotFoundError(
            f"No checkpoint in workdir {workdir} yet: its run stopped during its warm start "
            f"(unfinished, {saved} warm-start steps saved); run its train command again on "
            "this workdir to go on."
        )
    where = f" ({why})" if why else ""
    return FileNotFoundError(
        f"No checkpoint in workdir {workdir}{where}; train first, or pass the workdir of a "
        "run that saved one."
    )


def reading_identity(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """The experiment identity a tool that only reads the workdir's checkpoints (evaluation,
    export, a notebook) checks them against: `config`'s, with the stored model config and
    process layout, since a run's policy loads in one process whatever layout wrote it."""
    stored = stored_experiment(workdir)
    return experiment_identity(config, ModelConfig(**stored["model"]), stored.get(PROCESSES_KEY))


def reading_checkpointer(config: ml_collections.ConfigDict, workdir: str) -> Checkpointer:
    """A Checkpointer of the workdir's checkpoints for a tool that only reads them, checked
    against `reading_identity`; a config other than the run's is told to leave --config out
    (never to delete anything)."""
    return Checkpointer(
        workdir,
        experiment=reading_identity(config, workdir),
        mismatch_advice=(
            "the config given is not the one the run trained with: leave --config out to read "
            f"the run with its own ({os.path.join(workdir, CONFIG_FILENAME)})."
        ),
    )


def stored_model_config(workdir: str) -> ModelConfig:
    """The model config a workdir's checkpoints were written for (from experiment.json)."""
    return ModelConfig(**stored_experiment(workdir)["model"])


class RestoredRun(NamedTuple):
    """A run's checkpoint on the default device: the trained policy and π_ref."""

    model: Model
    params: Params
    reference_params: Params
    metadata: dict
    step: int  # the checkpoint's
    critic: tuple | None = None  # PPO: (tba_jax.critic.Critic, the critic's params)


def restore_run(
    config: ml_collections.ConfigDict,
    workdir: str,
    step: int | None = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: mesh_lib.Rules = (),
    attempts: int = READ_ATTEMPTS,
) -> RestoredRun:
    """Loads the trained policy and reference of the run `config` in `workdir` (latest step
    by default), onto the default device, or straight onto `mesh` sharded by `rules`
    (`experiments/evaluate.py`: the sampler's rules, so a policy split over `tensor` never
    sits whole on one device). Raises a clear error if the workdir has no checkpoint or
    one of another experiment. The model has the checkpoint's params layout
    (`scan_layers` as that segment of the run had it). Reads the params alone: not the
    optimizer state (twice the policy's bytes with Adam) nor the replay buffer. A run
    still training is read as `read_checkpoint` reads it (`attempts`: its default)."""

    def read(chosen: int) -> RestoredRun:
        return restore_step(config, workdir, chosen, mesh=mesh, rules=rules)

    return read_checkpoint(workdir, step, read, attempts=attempts)


def restore_step(
    config: ml_collections.ConfigDict,
    workdir: str,
    step: int,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: mesh_lib.Rules = (),
) -> RestoredRun:
    """`restore_run` of the saved `step`, read once: CheckpointUnreadableError (one line,
    naming the other saved steps) when any part of it does not restore."""
    # the run's execution knobs (attention kernel, remat, chunked log-probs, ...), which
    # the checkpoint's identity leaves out, as this platform runs them
    model_cfg = dataclasses.replace(
        stored_model_config(workdir), **runnable_execution_fields(config)
    )
    if mesh is None:
        mesh, rules = mesh_lib.make_mesh(jax.devices()[:1], {}), ()
    with reading_checkpointer(config, workdir) as checkpointer:
        metadata = read_or_unreadable(checkpointer, step, checkpointer.read_metadata)
        stacked = checkpoint_stacked(metadata, workdir)
        model, abstract_params = abstract_model(model_cfg.in_layout(stacked))
        shardings = mesh_lib.param_shardings(model.logical_axes, abstract_params, mesh, rules)
        params = mesh_lib.abstract_on(abstract_params, shardings)
        template = {"train": {"params": params}, "reference": params}  # no Adam state, buffer
        critic = critic_parts(config, model, mesh, rules)
        if critic is not None:
            template["critic"] = {"params": critic.abstract_state.params}
        restored, metadata = read_or_unreadable(
            checkpointer,
            step,
            lambda saved: checkpointer.restore_subset(template=template, step=saved),
        )
    return RestoredRun(
        model,
        restored["train"]["params"],
        restored["reference"],
        metadata,
        step,
        critic=None if critic is None else (critic.critic, restored["critic"]["params"]),
    )


def read_or_unreadable(checkpointer: Checkpointer, step: int, read: Callable[[int], T]) -> T:
    """`read(step)` of `checkpointer`, or the one-line `checkpoint_unreadable` error when it
    fails (raised without orbax's chain of errors as its cause)."""
    try:
        return read(step)
    except Exception as error:
        unreadable = checkpoint_unreadable(checkpointer, step, error)
    raise unreadable


def checkpoint_unreadable(
    checkpointer: Checkpointer, step: int, error: Exception
) -> CheckpointUnreadableError:
    """The one-line error for checkpoint `step` failing to restore with `error`: orbax's
    cause in one line, the other saved steps, and how the caller picks another
    (`steps_picked_with`)."""
    others = [saved for saved in checkpointer.all_steps() if saved != step]
    return CheckpointUnreadableError(
        f"Checkpoint {step} in {checkpointer.workdir} does not restore "
        f"({restore_failure(error)}); a file of it is likely truncated or half-written. The "
        f"other saved steps: {sorted(others) or 'none'}; pass one as {STEP_OPTION.get()}."
    )


# How the caller of a checkpoint read picks another step (a launcher's flag, or Python's
# `step` argument), for the errors that tell to.
STEP_OPTION = contextvars.ContextVar("STEP_OPTION", default="`step`")


@contextlib.contextmanager
def steps_picked_with(option: str) -> Iterator[None]:
    """Within the block, checkpoint errors tell to pass another step as `option` (e.g. a
    launcher's "--step")."""
    token = STEP_OPTION.set(option)
    try:
        yield
    finally:
        STEP_OPTION.reset(token)


class _StepInFlightFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(STEP_IN_FLIGHT_NOTICE)


@contextlib.contextmanager
def orbax_notices_of_steps_in_flight_hidden() -> Iterator[None]:
    """Leaves out orbax's warning about a step still being saved while the block reads the
    checkpoints of a run in progress (absl's logger, which orbax logs through)."""
    logger, quiet = logging.getLogger("absl"), _StepInFlightFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def saved_steps(workdir: str) -> list[int]:
    """The steps with a checkpoint in `workdir` (0: right after the warm start), oldest
    first, as they are now (a run in progress adds and removes them)."""
    experiment = stored_experiment(workdir)  # any run's checkpoints list here
    with (
        orbax_notices_of_steps_in_flight_hidden(),
        Checkpointer(workdir, experiment=experiment) as saved,
    ):
        return sorted(saved.all_steps())


def run_and_step(
    workdir: str | None, checkpoint: str | None, step: int | None
) -> tuple[str, int | None]:
    """(workdir, step or None for the latest) from a launcher's --workdir / --checkpoint_step
    or from its --checkpoint folder `<workdir>/checkpoints/<step>` (evaluate.py's and
    export_hf.py's); ConfigError when they disagree, FileNotFoundError when the folder
    does not exist."""
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


def saved_step(workdir: str, step: int | None, steps: list[int]) -> int:
    """`step` (None: the latest) of a workdir's saved `steps`; FileNotFoundError when it has
    none or `step` is not one of them."""
    if not steps:
        raise no_checkpoint_error(workdir)
    if step is None:
        return steps[-1]
    if step not in steps:
        raise FileNotFoundError(
            f"No checkpoint for step {step} in workdir {workdir}; available steps: {steps}; "
            f"pass one as {STEP_OPTION.get()}, or none for the latest."
        )
    return step


def read_checkpoint(
    workdir: str,
    step: int | None,
    read: Callable[[int], T],
    *,
    attempts: int = READ_ATTEMPTS,
) -> T:
    """`read(step)` of the checkpoint of `step` (None: the latest). A run in progress
    writes and removes checkpoints while they are read (`keep_checkpoints`): a read that
    fails is tried again (`attempts` reads in all, READ_RETRY_S apart),
    on the newest step when none was asked for; a step the run removed meanwhile is named
    as such (FileNotFoundError), not as a truncated file; a step still there that fails
    in a finished run raises `read`'s error (CheckpointUnreadableError) at once."""
    for attempt in range(attempts):
        chosen = saved_step(workdir, step, saved_steps(workdir))
        try:
            with orbax_notices_of_steps_in_flight_hidden():
                return read(chosen)
        except (CheckpointUnreadableError, OSError):
            steps_now = saved_steps(workdir)
            if step is not None and step not in steps_now:
                raise removed_while_read(workdir, step, steps_now) from None
            still_there = chosen in steps_now
            if attempt + 1 == attempts or (still_there and not in_progress(workdir)):
                raise
        time.sleep(READ_RETRY_S)
    raise AssertionError("unreachable")


def removed_while_read(workdir: str, step: int, steps_now: list[int]) -> FileNotFoundError:
    return FileNotFoundError(
        f"Checkpoint {step} in {workdir} was removed while it was read (the run keeps its "
        f"newest keep_checkpoints); its steps now: {steps_now}; pass one as "
        f"{STEP_OPTION.get()}, or none for the latest."
    )


def in_progress(workdir: str) -> bool:
    """Whether the run in `workdir` may still be writing checkpoints (no summary yet)."""
    return not os.path.isfile(os.path.join(workdir, SUMMARY_FILENAME))


# What experiments/evaluate.py (and RunView.evaluate) samples when the run's config has no
# eval.num_samples / eval.ks (a config saved before they existed).
FALLBACK_NUM_SAMPLES = 16
FALLBACK_KS = (1, 4, 16)


def eval_settings(
    config: ml_collections.ConfigDict, overrides: dict | None = None
) -> tasks.EvalSettings:
    """The evaluation settings of the run `config`: its eval section and sampling settings,
    with `overrides` (by EvalSettings field name: max_new_tokens, num_examples,
    num_samples, ks) in place of theirs."""
    eval_config = config.eval
    from_config = {
        "max_new_tokens": eval_config.get("max_new_tokens", config.max_response_len),
        "num_examples": eval_config.num_examples,
        "num_samples": eval_config.get("num_samples", FALLBACK_NUM_SAMPLES),
        "ks": tuple(int(k) for k in eval_config.get("ks", FALLBACK_KS)),
    }
    return tasks.EvalSettings(
        max_prompt_len=config.max_prompt_len,
        batch_size=eval_config.batch_size,
        temperature=config.sampling.temperature,
        top_k=config.sampling.top_k,
        top_p=config.sampling.top_p,
        seed=config.seed,
        engine=sources.evaluation_engine_config(config),
        **{**from_config, **(overrides or {})},
    )


def restore_policy(config: ml_collections.ConfigDict, workdir: str, step: int | None = None):
    """(model, params, metadata) of the run `config` in `workdir`; see `restore_run`."""
    run = restore_run(config, workdir, step)
    return run.model, run.params, run.metadata


def load_trained_policy(workdir: str, step: int | None = None) -> tuple[ModelConfig, Params]:
    """The model config and trained params of the run in `workdir` (latest step by default)."""
    model, params, _ = restore_policy(load_config(workdir), workdir, step)
    return model.config, params
