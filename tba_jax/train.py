"""`train_and_evaluate(config, workdir)`: one TBA (or sync baseline) run, start to end.

It reads top to bottom in three parts:

1. `setup(config, workdir)` checks everything that can be checked (`check_run`: every
   config value, the Hugging Face folders, the workdir's experiment) before it writes a
   byte, then builds the task, model, meshes, shardings, optimiser and train step. A run
   that already finished gives its summary back after the checks, before any building.
2. The start: `resume` from the newest checkpoint that restores (a corrupt one is set
   aside; one of another train-state structure is refused), naming the settings that
   differ from the last segment's, or a `fresh_start` (going on from a saved, unfinished
   warm start of the same settings). config.json is written once the start is known.
3. The loop over a `sources.BatchSource` (async: searcher threads + replay buffer;
   sync: fresh on-policy samples each step): draw a batch, take a train step, publish
   every `source.publish_every` steps, log, evaluate, checkpoint. The loop has no mode
   branches; the source is the mode. With `record_learner_batches` every step's batch is
   recorded (`tba_jax.batch_log`), so `tba_jax.batch_replay` can re-run the learner.

Then the final evaluation and `workdir/summary.json`, whose figures cover the whole run
across resumed segments. SIGTERM and Ctrl-C stop at the next safe point (between steps
or evaluation batches) and save what exists (during setup, with nothing to save yet, a
SIGTERM stops at once); a step whose loss or gradient is not finite
is skipped, and `max_nonfinite_steps` of them in a row stop the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np
from absl import logging

from tba_jax import (
    batch_log,
    by_process,
    compile_cache,
    config_keys,
    config_lib,
    distributed,
    evaluation,
    exchange,
    learner,
    losses,
    ppo,
    run_totals,
    runs,
    runtime,
    sources,
    tasks,
    vineppo,
)
from tba_jax import mesh as mesh_lib
from tba_jax import topology as topology_lib
from tba_jax.checkpoint import (
    Checkpointer,
    RunStopped,
    StopSignal,
    WorkdirLock,
    check_experiment,
    claimed_workdir,
    held_experiment,
    latest_saved_step,
    newest_restorable,
    restore_failure,
    set_aside,
    sigterm_stops_at_once,
    stop_on_signals,
)
from tba_jax.config_lib import ConfigError
from tba_jax.metrics import EVAL_SECONDS, RL_SECONDS, MetricsWriter, write_json_atomically
from tba_jax.models import Model, Params, abstract_model, compute_dtype_cast, init_model
from tba_jax.models.tokenizers import tokenizer_mismatch
from tba_jax.placement import RolePlacement
from tba_jax.run_totals import WALL_SECONDS, WARM_START_SECONDS
from tba_jax.runs import SUMMARY_FILENAME, WARM_START_SUBDIR
from tba_jax.sampling.engine import make_generator
from tba_jax.trajectories import SampledBatch, collate
from tba_jax.warmstart import (
    WarmStartCheckpoint,
    WarmStartConfig,
    WarmStartProgress,
    check_warm_start_data,
    warm_start,
    warm_start_optimizer,
)

# The policy's held-out score before any RL, kept when a run stops before its first learner
# step (its step-0 checkpoint, saved before the evaluation, is never rewritten).
START_EVALUATION_FILENAME = "start_evaluation.json"
WARM_START_NOTICES = 5  # console lines over a warm start
# In-training evaluation with the slot engine: eval.batch_size × this many prompts per
# engine call (a stop is honoured between calls).
SLOT_EVAL_BATCHES_PER_CALL = 4
VALUE_STAGE_STREAM = 0x7649  # folded into the run's seed: VinePPO's rollout randomness


class NonFiniteError(ConfigError):
    """Too many learner steps in a row had a non-finite loss or gradient."""


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything a run is built from, made and checked before any long work."""

    config: ml_collections.ConfigDict
    workdir: str
    task: tasks.Task
    model: Model
    abstract_params: Params  # ShapeDtypeStructs
    meshes: mesh_lib.RoleMeshes
    learner_shardings: Any
    sampler_shardings: Any
    optimizer: Any
    state_sharding: Any  # of the TrainState (its critic's included)
    critic: runs.CriticParts | None  # PPO's value model; None for critic-free methods
    train_step: Callable  # (TrainState, batch) -> (TrainState, metrics)
    checkpointer: Checkpointer | None  # None on a searcher-only process
    topology: topology_lib.Topology
    group: topology_lib.LearnerGroup
    reference_shardings: Any  # where the checkpoint keeps π_ref
    # VinePPO's bool [vocab_size]: the task's token ids that end a step; None for the others
    step_boundaries: np.ndarray | None = None

    @property
    def learner_parts(self) -> LearnerParts:
        return LearnerParts(self.optimizer, self.state_sharding, self.critic, self.train_step)


class Start(NamedTuple):
    """Where the loop starts: the train state, π_ref, the run's history so far and (when
    resuming) the batch source's saved state."""

    state: learner.TrainState
    reference: Params
    history: dict
    source_state: sources.SourceState | None


# The config sections whose settings shape the saved train state (optimiser state, critic).
STATE_SECTIONS = ("optim.", "loss.")
# Keys a resumed run changes as a matter of course: more steps extend it; the variant string
# records how the config was spelt.
EXPECTED_TO_CHANGE = ("learner_steps", "variant")

# ------------------------------------------------------------------------------- setup


def check_policy_architecture(config: ml_collections.ConfigDict) -> None:
    """ConfigError for a policy the model refuses to build: its preset's or checkpoint's
    shape with the config's dtypes and execution knobs (e.g. the Pallas decode kernel on
    heads no power of two wide), or a checkpoint whose learned positions (GPT-2's) cannot
    hold a prompt and its response (its position lookups would be NaN from the warm start
    on). Reads config files only; the vocabulary plays no part."""
    try:
        model_cfg = runs.model_config(config, vocab_size=1)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    needed = config.max_prompt_len + config.max_response_len
    if model_cfg.position_embedding == "learned" and model_cfg.max_seq_len < needed:
        raise ConfigError(
            f"model.hf_path={config.model.hf_path!r} has {model_cfg.max_seq_len} learned "
            f"positions, fewer than a prompt + response (max_prompt_len={config.max_prompt_len}"
            f" + max_response_len={config.max_response_len}); lower them or use a checkpoint "
            "with more positions."
        )


def check_policy_shardings(config: ml_collections.ConfigDict, meshes: mesh_lib.RoleMeshes) -> None:
    """ConfigError for `mesh.<role>_rules` that split a policy parameter unevenly on that
    role's mesh, or PPO's critic's on the learner's, before the task is built (for a paper
    task, minutes of data and role models, its data written into the workdir). A preset's
    vocabulary is its task tokenizer's, unknown until then: a size every mesh axis divides
    stands in for it, and `setup` checks the real one (`role_shardings`). Reads config
    files only."""
    vocab_known = config.model.get("vocab_size", 0) or config.model.hf_path
    axis_sizes = [*meshes.sampler.shape.values(), *meshes.learner.shape.values()]
    # (check_policy_architecture has built this config; only its vocabulary differs)
    model_cfg = runs.model_config(config, 1 if vocab_known else math.lcm(*axis_sizes))
    model, abstract_params = abstract_model(model_cfg)
    role_shardings(config, model, abstract_params, meshes)
    runs.critic_parts(config, model, meshes.learner, config.mesh.learner_rules)  # PPO's


def check_hf_folders(config: ml_collections.ConfigDict, policy_tokenizer) -> None:
    """ConfigError for a `model.hf_path` / `reference.hf_path` that cannot serve: an
    unsupported or unreadable config.json, a `policy_tokenizer` (`model.hf_path`'s) larger
    than the model, or a reference of another architecture than the policy. Reads config
    files only."""
    if not (config.model.hf_path or config.reference.hf_path):
        return
    from tba_jax.models import hf  # optional: needs safetensors/tokenizers

    architectures = {}
    for key, path in (("model", config.model.hf_path), ("reference", config.reference.hf_path)):
        if path:
            try:
                architectures[key] = hf.config_from_hf(path)
            except ValueError as error:
                raise ConfigError(f"{key}.hf_path={path!r}: {error}") from None
    if len(architectures) == 2:
        policy, reference = architectures["model"], architectures["reference"]
        if dataclasses.replace(reference, dtype=policy.dtype, param_dtype=policy.param_dtype) != (
            policy
        ):
            raise ConfigError(
                f"reference.hf_path={config.reference.hf_path!r} has another architecture "
                f"than model.hf_path={config.model.hf_path!r}; TB needs log π_ref of the same "
                "tokens, so use a checkpoint of the policy's family, size and vocabulary."
            )
    if "model" in architectures:
        vocab_size = policy_tokenizer.vocab_size
        if vocab_size > architectures["model"].vocab_size:
            raise ConfigError(
                f"The tokenizer in model.hf_path={config.model.hf_path!r} has {vocab_size} ids "
                f"but its model has {architectures['model'].vocab_size} embeddings; use the "
                "tokenizer that came with the checkpoint."
            )


def check_critic_reward_model(config: ml_collections.ConfigDict, policy_tokenizer) -> None:
    """ConfigError for a `task.reward_model` checkpoint PPO's critic cannot start as
    (`loss.ppo.critic_init=reward_model`): the critic reads the policy's token ids, so the
    reward model needs one label, the policy's tokenizer (`policy_tokenizer`, from
    `model.hf_path`) and positions for a whole prompt + response. Reads config and
    tokenizer files only; a random stand-in (empty hf_path) shares the policy's tokens."""
    role = config.task.get("reward_model")
    if not (runs.starts_from_reward_model(config) and role.hf_path):
        return
    from tba_jax.models import hf  # optional: needs safetensors/tokenizers
    from tba_jax.models.hf_tokenizer import HFTokenizer

    where = f"task.reward_model.hf_path={role.hf_path!r}"
    if policy_tokenizer is None:
        raise ConfigError(
            f"loss.ppo.critic_init=reward_model with {where} needs the policy from "
            "model.hf_path, with the reward model's tokenizer (the critic reads the policy's "
            "token ids); set model.hf_path or use critic_init=policy."
        )
    try:
        reward_cfg = hf.config_from_hf(role.hf_path)
    except ValueError as error:
        raise ConfigError(f"{where}: {error}") from None
    if reward_cfg.head != "score" or reward_cfg.num_labels != 1:
        raise ConfigError(
            f"{where} is not a one-label *ForSequenceClassification checkpoint "
            f"(head={reward_cfg.head!r}, num_labels={reward_cfg.num_labels}); PPO's critic "
            "starts as a scalar reward model."
        )
    mismatch = tokenizer_mismatch(HFTokenizer.from_pretrained(role.hf_path), policy_tokenizer)
    if mismatch:
        raise ConfigError(
            f"The tokenizer in {where} is not the policy's (model.hf_path="
            f"{config.model.hf_path!r}): {mismatch}. loss.ppo.critic_init=reward_model needs "
            "a reward model trained on the policy's tokenizer; use critic_init=policy."
        )
    if reward_cfg.vocab_size < policy_tokenizer.vocab_size:
        raise ConfigError(
            f"{where} has {reward_cfg.vocab_size} embeddings, fewer than the policy "
            f"tokenizer's {policy_tokenizer.vocab_size} ids; use critic_init=policy."
        )
    needed = config.max_prompt_len + config.max_response_len
    if reward_cfg.position_embedding == "learned" and reward_cfg.max_seq_len < needed:
        raise ConfigError(
            f"{where} has {reward_cfg.max_seq_len} learned positions, fewer than a prompt + "
            f"response ({needed} tokens); lower max_prompt_len/max_response_len or use "
            "critic_init=policy."
        )


class LearnerParts(NamedTuple):
    """What a run's learner is built from its config: the policy's optimiser, the shardings
    of the TrainState (the critic's included), PPO's critic (None without one) and the
    jitted `(TrainState, batch) -> (TrainState, metrics)`."""

    optimizer: Any
    state_sharding: learner.TrainState
    critic: runs.CriticParts | None
    train_step: Callable


def role_shardings(
    config: ml_collections.ConfigDict,
    model: Model,
    abstract_params: Params,
    meshes: mesh_lib.RoleMeshes,
) -> tuple[Any, Any]:
    """The policy params' shardings on the learner mesh and on the sampler mesh; a
    ConfigError when a rule splits a parameter unevenly."""
    shardings = []
    for role, mesh in (("learner", meshes.learner), ("sampler", meshes.sampler)):
        try:
            shardings.append(
                mesh_lib.param_shardings(
                    model.logical_axes, abstract_params, mesh, config.mesh[f"{role}_rules"]
                )
            )
        except ValueError as error:
            raise ConfigError(
                f"The policy on the {role} mesh: {error} (mesh.{role}_rules, mesh.{role}_axes)"
            ) from None
    return tuple(shardings)


def make_learner(
    config: ml_collections.ConfigDict,
    model: Model,
    abstract_params: Params,
    learner_shardings: Any,
    mesh: jax.sharding.Mesh,
) -> LearnerParts:
    """The learner of `config` on the learner `mesh` (the run's, and a replay's of it)."""
    optimizer = learner.make_optimizer(runs.optim_config(config))
    state_sharding = learner.train_state_shardings(
        optimizer, abstract_params, learner_shardings, mesh
    )
    beta_schedule = losses.make_beta_schedule(
        config.loss.beta_schedule,
        config.loss.beta_start,
        config.loss.beta_end,
        config.loss.beta_anneal_steps,
        config.loss.beta_cut_steps,
    )
    critic = runs.critic_parts(config, model, mesh, config.mesh.learner_rules)
    if critic is None:
        train_step = learner.make_train_step(
            model,
            losses.get_loss(config.method),
            optimizer,
            beta_schedule,
            samples_per_prompt=config.batch.samples_per_prompt,
            num_microbatches=config.batch.num_microbatches,
            temperature=config.sampling.temperature,
            state_sharding=state_sharding,
            mesh=mesh,
            loss_options=runs.loss_options(config),
        )
        return LearnerParts(optimizer, state_sharding, None, train_step)
    state_sharding = state_sharding._replace(critic=critic.state_sharding)
    train_step = ppo.make_train_step(
        critic.critic,
        optimizer,
        critic.optimizer,
        beta_schedule,
        options=runs.ppo_config(config),
        num_microbatches=config.batch.num_microbatches,
        temperature=config.sampling.temperature,
        state_sharding=state_sharding,
        mesh=mesh,
    )
    return LearnerParts(optimizer, state_sharding, critic, train_step)


class CheckedRun(NamedTuple):
    """What `check_run` found out on the way: the process's place in the run, its role
    meshes and the policy's Hugging Face tokenizer (None: the task's own)."""

    topology: topology_lib.Topology
    meshes: mesh_lib.RoleMeshes
    policy_tokenizer: Any


def role_placement(
    config: ml_collections.ConfigDict,
    topology: topology_lib.Topology,
    meshes: mesh_lib.RoleMeshes,
) -> RolePlacement | None:
    """Where the task's frozen role models (reward models, victim, judge) go: where the
    sampler is. A learner-only process (roles_by_process) uses them to evaluate only:
    None, whole on its default device, not a copy on each of its learner devices."""
    if not topology.is_searcher:
        return None
    return RolePlacement(meshes.sampler, config.mesh.sampler_rules)


def check_run(config: ml_collections.ConfigDict, workdir: str) -> CheckedRun:
    """Checks `config` against everything it can be checked against without building
    anything: every config value, the role meshes and how they split the policy (and
    PPO's critic), the Hugging Face folders, the task's cheap checks (`tasks.check_task`:
    its role models' layouts on the sampler mesh, their templates), the workdir's
    experiment."""
    config_lib.check_config_kind(config)
    topology = topology_lib.make_topology(config)
    meshes = topology_lib.role_meshes(topology, config)  # axes the devices cannot take
    config_lib.validate(
        config,
        jax.device_count(),
        learner_devices=meshes.learner.devices.size,
        num_processes=topology.num_processes,
    )
    policy_tokenizer = runs.policy_tokenizer(config)  # None: the task's own
    check_hf_folders(config, policy_tokenizer)
    check_policy_architecture(config)
    check_policy_shardings(config, meshes)
    check_critic_reward_model(config, policy_tokenizer)
    tasks.check_task(config.task, policy_tokenizer, role_placement(config, topology, meshes))
    layout = topology.describe() if topology.multi_process else None
    check_experiment(
        workdir, runs.experiment_identity(config, None, layout), ignored_keys=("model",)
    )
    return CheckedRun(topology, meshes, policy_tokenizer)


def setup(
    config: ml_collections.ConfigDict,
    workdir: str,
    held: contextlib.ExitStack | None = None,
    checked: CheckedRun | None = None,
) -> Setup:
    """Checks `config` against everything it can be checked against (`check_run`, unless
    `checked` is what it found), then builds the run.

    Nothing is written to `workdir` until the config, the Hugging Face folders and the
    workdir's experiment are known to be right: a refused run leaves it as it was. Over
    several processes, process 0 writes the shared files and the others wait for it.
    With `held`, process 0 locks the workdir (`WorkdirLock`) until `held` closes: a second
    run of it is refused.
    """
    topology, meshes, policy_tokenizer = checked or check_run(config, workdir)
    layout = topology.describe() if topology.multi_process else None
    compile_cache.use(config)
    warn_if_slots_repeat_rows(config, meshes.sampler)
    # The task's role models go where the sampler is; those that generate (the victim)
    # use the run's engine, as its evaluation does.
    engine = sources.evaluation_engine_config(config)
    roles = dict(placement=role_placement(config, topology, meshes), engine=engine)
    warm_start = WarmStartConfig(**config.warm_start.to_dict())

    def checked_task() -> tuple[tasks.Task, np.ndarray | None]:
        # check_run made the task's cheap checks with these arguments
        task = tasks.build_task(config.task, workdir, policy_tokenizer, **roles, checked=True)
        check_warm_start_data(task.train, warm_start)
        return task, step_boundaries(config, task.tokenizer)

    if topology.is_primary:
        with claimed_workdir(workdir, held):  # a workdir it made goes again if refused
            task, boundaries = checked_task()
    distributed.barrier("tba_jax:task_built")  # the others read what process 0 prepared
    if not topology.is_primary:
        task, boundaries = checked_task()
    model_cfg = runs.model_config(config, task.tokenizer.vocab_size)
    model, abstract_params = abstract_model(model_cfg)
    learner_shardings, sampler_shardings = role_shardings(config, model, abstract_params, meshes)
    checkpointer = None
    if topology.is_learner:
        checkpointer = Checkpointer(
            workdir,
            experiment=runs.experiment_identity(config, model_cfg, layout),
            max_to_keep=config.keep_checkpoints,
            active_processes=topology.learner_processes if topology.multi_process else None,
            keep_steps=(0,) if records_learner_batches(config, workdir) else (),  # a replay's start
        )
    optimizer, state_sharding, critic, train_step = make_learner(
        config, model, abstract_params, learner_shardings, meshes.learner
    )
    return Setup(
        config=config,
        workdir=workdir,
        task=task,
        model=model,
        abstract_params=abstract_params,
        meshes=meshes,
        learner_shardings=learner_shardings,
        sampler_shardings=sampler_shardings,
        optimizer=optimizer,
        state_sharding=state_sharding,
        critic=critic,
        train_step=train_step,
        checkpointer=checkpointer,
        topology=topology,
        group=topology_lib.LearnerGroup(meshes.learner),
        reference_shardings=learner_shardings if topology.multi_process else sampler_shardings,
        step_boundaries=boundaries,
    )


def step_boundaries(config: ml_collections.ConfigDict, tokenizer) -> np.ndarray | None:
    """VinePPO's step ends, bool [vocab_size]: the ids of the task's `tokenizer` that hold
    one of `loss.vineppo.step_delimiters` (None for the other methods). A ConfigError when
    none does (no response could be split into steps): found once the task is built,
    before the warm start, not at the first value stage."""
    if config.method != "vineppo":
        return None
    try:
        return vineppo.boundary_tokens(tokenizer, config.loss.vineppo.step_delimiters)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def warn_if_slots_repeat_rows(config: ml_collections.ConfigDict, sampler: jax.sharding.Mesh):
    """A warning when the slot engine's slots do not divide over the sampler mesh's data
    shards: then they sit whole on each shard (each computes every row), where otherwise
    each shard decodes its share of them."""
    shards = mesh_lib.row_shards(sampler)
    slots = config.search.slots or config_lib.samples_per_search_call(config)
    if config.search.engine == "slots" and slots % shards:
        logging.warning(
            "search.slots=%d does not divide over the sampler mesh's %d data shards, so "
            "each shard runs every slot; pick a multiple of %d.",
            slots,
            shards,
            shards,
        )


def publish_policy(run: Setup, params: Params) -> Params:
    """The learner's policy `params` copied onto the sampler (`LearnerGroup.publish`), its
    weights in the compute dtype, as the searchers' policy store holds them."""
    return run.group.publish(params, run.sampler_shardings, compute_dtype_cast(run.model.config))


def make_evaluate(run: Setup, stop_signal: StopSignal) -> Callable[[Params], float]:
    """The in-training evaluation: mean reward of greedy responses to the first
    `eval.num_examples` test prompts (0: all), on the sampler mesh, `eval.batch_size` at a
    time; raises RunStopped between batches once a stop is requested."""
    config, task, tokenizer = run.config, run.task, run.task.tokenizer
    batch_size = config.eval.batch_size
    greedy_fn = make_generator(
        run.model,
        sources.sampling_config(config, tokenizer.vocab_size, greedy=True),
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        max_prompt_len=config.max_prompt_len,
        engine=sources.evaluation_engine_config(config),
    )
    topology = run.topology
    examples = task.test[: config.eval.num_examples or None]
    if topology.multi_process:  # each learner process scores its own share
        examples = topology_lib.shard_of(examples, topology.learner_rank, topology.num_learners)

    # A stop is honoured between calls; the slot engine streams several batches per call,
    # so its slots are refilled instead of ending with each batch.
    per_call = batch_size * (SLOT_EVAL_BATCHES_PER_CALL if config.search.engine == "slots" else 1)

    def evaluate(params: Params) -> float:
        params = publish_policy(run, params)
        rewards = [np.zeros(0, np.float32)]
        for start in range(0, len(examples), per_call):
            if not topology.multi_process:  # stops between batches (several: agreed stops only)
                stop_signal.raise_if_requested()
            batch_rewards, _ = evaluation.generate_and_score(
                greedy_fn,
                params,
                examples[start : start + per_call],
                tokenizer,
                task.rewards,
                max_prompt_len=config.max_prompt_len,
                batch_size=batch_size,
                rng=jax.random.key(evaluation.GREEDY_RNG_SEED),
            )
            rewards.append(batch_rewards)
        rewards = np.concatenate(rewards)
        total, count = run.group.gather(np.asarray([rewards.sum(), len(rewards)])).sum(axis=0)
        return float(total / count)

    return evaluate


def eval_key(run: Setup) -> str:
    """The in-training evaluation's metric name, e.g. `eval_accuracy` (see `Task.eval_metric`)."""
    return f"eval_{run.task.eval_metric}"


# ------------------------------------------------------------------------------- start


def initial_policy_params(config: ml_collections.ConfigDict, model, shardings) -> Params:
    """The policy before the warm start: `model.hf_path`'s weights, else a random init."""
    if config.model.hf_path:
        from tba_jax.models import hf  # optional: needs safetensors/tokenizers

        return hf.load_params(config.model.hf_path, model, shardings=shardings)
    _, params = init_model(model.config, config.seed)
    return jax.device_put(params, shardings)


def reference_params(config: ml_collections.ConfigDict, model, start_params, shardings) -> Params:
    """π_ref on the sampler: `reference.hf_path`'s weights (its architecture was checked
    in `check_hf_folders`), else the warm-started policy."""
    if not config.reference.hf_path:
        return mesh_lib.publish(start_params, shardings)
    from tba_jax.models import hf  # optional: needs safetensors/tokenizers

    return hf.load_params(config.reference.hf_path, model, shardings=shardings)


def warm_start_logger(total_steps: int) -> Callable[[int, dict], None]:
    """Logs the warm start's loss `WARM_START_NOTICES` times over its steps."""
    every = max(total_steps // WARM_START_NOTICES, 1)

    def log(step: int, metrics: dict) -> None:
        if (step + 1) % every == 0 or step + 1 == total_steps:
            loss = float(metrics["warm_start_loss"])
            logging.info("Warm start step %d/%d | loss %.4g", step + 1, total_steps, loss)

    return log


def restore_warm_start(
    run: Setup, saved: WarmStartCheckpoint, cfg: WarmStartConfig
) -> WarmStartProgress | None:
    """The saved, unfinished warm start; None when it does not restore (a truncated file):
    it is moved to `SET_ASIDE_SUBDIR` with a one-line warning and the warm start starts over,
    which loses only its steps so far."""
    optimizer = warm_start_optimizer(cfg)
    shardings = learner.train_state_shardings(
        optimizer, run.abstract_params, run.learner_shardings, run.meshes.learner
    )
    template = learner.abstract_train_state(optimizer, run.abstract_params, shardings)
    try:
        return saved.restore(template.params, template.opt_state)
    except Exception as error:
        failure = restore_failure(error)
    where = "left in place (another process moves it)"
    if run.topology.is_primary:
        where = "moved it to " + set_aside(saved.directory, run.workdir, WARM_START_SUBDIR)
    logging.warning(
        "The saved warm start in %s does not restore (%s); %s and starting the warm start over.",
        saved.directory,
        failure,
        where,
    )
    return None


def warm_started_params(
    run: Setup, stop_signal: StopSignal, started_at: float, earlier: dict[str, float]
) -> Params:
    """The policy after `warm_start.steps` supervised steps, going on from a saved,
    unfinished warm start. When stopped part-way, saves the progress in
    `workdir/warm_start/`, with the run's warm-start and wall seconds so far (`earlier`,
    the saved ones, plus this segment's since `started_at`), and raises RunStopped."""
    config = run.config
    cfg = WarmStartConfig(**config.warm_start.to_dict())
    if cfg.steps == 0:
        return initial_policy_params(config, run.model, run.learner_shardings)
    saved = WarmStartCheckpoint(os.path.join(run.workdir, WARM_START_SUBDIR))
    begin = time.time()
    check_warm_start_settings(saved, config.warm_start.to_dict())
    progress = restore_warm_start(run, saved, cfg) if saved.exists() else None
    if progress is not None:
        params = progress.params
        logging.info("Warm start: going on from step %d of %d.", progress.steps_done, cfg.steps)
    else:
        params = initial_policy_params(config, run.model, run.learner_shardings)
        logging.info("Warm start: %d supervised steps.", cfg.steps)
    progress = warm_start(
        run.model,
        params,
        run.task.train,
        run.task.tokenizer,
        cfg,
        max_prompt_len=config.max_prompt_len,
        max_response_len=config.max_response_len,
        mesh=run.meshes.learner,
        seed=config.seed,
        progress=progress,
        # over several processes a stop is agreed once the loop starts, never mid-way here
        should_stop=lambda: stop_signal.requested and not run.topology.multi_process,
        log_fn=warm_start_logger(cfg.steps),
    )
    if progress.steps_done < cfg.steps:
        run.checkpointer.write_experiment()  # a rerun with another config is refused
        now = time.time()
        seconds = {
            WARM_START_SECONDS: earlier.get(WARM_START_SECONDS, 0.0) + now - begin,
            WALL_SECONDS: earlier.get(WALL_SECONDS, 0.0) + now - started_at,
        }
        saved.save(progress, seconds, settings=config.warm_start.to_dict())
        logging.info("Saved the warm start at step %d of %d.", progress.steps_done, cfg.steps)
        raise stop_signal.stopped()
    return progress.params


def check_warm_start_settings(saved: WarmStartCheckpoint, settings: dict) -> None:
    """ConfigError when the saved, unfinished warm start was made with other warm_start
    settings (its steps were taken on their schedule): going on would mix the two."""
    held = saved.saved_settings()
    if held is None or held == settings:
        return
    changed = ", ".join(
        f"warm_start.{key}: {held.get(key)!r} vs {settings.get(key)!r}"
        for key in sorted(set(held) | set(settings))
        if held.get(key) != settings.get(key)
    )
    raise ConfigError(
        f"The saved warm start in {saved.directory} was made with other settings (saved vs now: "
        f"{changed}); rerun with those to go on, or delete {saved.directory} to start the warm "
        "start over."
    )


def fresh_start(run: Setup, stop_signal: StopSignal, segment: run_totals.Segment) -> Start:
    """A new run's start: the warm-started policy (also π_ref unless `reference.hf_path`
    is set) with a fresh optimiser. The first evaluation comes after the first save. The
    history counts the segments a stop ended during the warm start."""
    begin = time.time()
    earlier = WarmStartCheckpoint(os.path.join(run.workdir, WARM_START_SUBDIR)).seconds_so_far()
    params = warm_started_params(run, stop_signal, segment.started_at, earlier)
    reference = reference_params(run.config, run.model, params, run.reference_shardings)
    if run.critic is None:
        state = learner.init_train_state(params, run.optimizer, run.state_sharding)
    else:
        state = ppo.init_train_state(
            params,
            run.critic.critic,
            run.optimizer,
            run.critic.optimizer,
            run.state_sharding,
            critic_start=runs.critic_start_params(run.config, run.task.tokenizer),
        )
    history = {
        **run_totals.empty_totals(),
        WARM_START_SECONDS: earlier.get(WARM_START_SECONDS, 0.0) + time.time() - begin,
        WALL_SECONDS: earlier.get(WALL_SECONDS, 0.0),  # this segment's is added when saving
    }
    return Start(state, reference, history, source_state=None)


def checkpoint_template(parts: LearnerParts, abstract_params: Params, reference_shardings) -> dict:
    """The abstract pytree a checkpoint of the learner `parts` restores into."""
    return runs.checkpoint_template(
        parts.optimizer,
        abstract_params,
        parts.state_sharding._replace(critic=None),
        reference_shardings,
        parts.critic,
    )


def layout_template(
    config: ml_collections.ConfigDict,
    model: Model,
    meshes: mesh_lib.RoleMeshes,
    *,
    multi_process: bool,
    stacked: bool,
) -> dict:
    """The checkpoint template of the run `config` of `model` with its params stacked
    (`scan_layers`) or not: the layout a checkpoint of another segment may have."""
    model, abstract_params = abstract_model(model.config.in_layout(stacked))
    learner_shardings, sampler_shardings = role_shardings(config, model, abstract_params, meshes)
    parts = make_learner(config, model, abstract_params, learner_shardings, meshes.learner)
    reference_shardings = learner_shardings if multi_process else sampler_shardings
    return checkpoint_template(parts, abstract_params, reference_shardings)


def restore_newest_good(run: Setup) -> tuple[dict, dict, dict]:
    """(train state + π_ref, buffer state, metadata) of the newest checkpoint that restores
    with finite params, in this run's params layout (a checkpoint of a segment with the
    other `model.scan_layers` is converted). A checkpoint that fails is moved to
    `checkpoints_set_aside/` (not deleted) with a warning, and the one before it is tried."""
    template = checkpoint_template(run.learner_parts, run.abstract_params, run.reference_shardings)
    stacked = run.model.config.scan_layers

    def other_layout_template() -> dict:
        return layout_template(
            run.config,
            run.model,
            run.meshes,
            multi_process=run.topology.multi_process,
            stacked=not stacked,
        )

    def restore(step: int) -> tuple[dict, dict, dict]:
        restored, buffer_state, metadata = runs.restore_in_layout(
            run.checkpointer, step, template, stacked, other_layout_template
        )
        if not bool(learner.all_finite(restored["train"]["params"])):
            raise ValueError("its params hold NaN or infinite values")
        return restored, buffer_state, metadata

    return newest_restorable(
        run.checkpointer, restore, other_structure_advice=lambda: changed_state_settings(run)
    )


def changed_settings(run: Setup, sections: tuple[str, ...] = ("",)) -> list[str]:
    """'key: saved vs now' for each key under `sections` whose value differs from the run's
    config.json (what its last segment ran with; [] when there is none to read)."""
    try:
        saved = dict(config_keys.leaf_items(runs.load_config(run.workdir)))
    except (OSError, ValueError):
        return []
    return [
        f"{key}: {saved[key]!r} vs {value!r}"
        for key, value in config_keys.leaf_items(run.config)
        if key.startswith(sections)
        and key not in EXPECTED_TO_CHANGE
        and key in saved
        and saved[key] != json.loads(json.dumps(value))  # tuples as config.json holds them
    ]


def changed_state_settings(run: Setup) -> str:
    """'; ... differ from ...' naming the optim.* and loss.* keys whose values differ from
    the run's config.json, or '' when none do."""
    changed = changed_settings(run, STATE_SECTIONS)
    if not changed:
        return ""
    return f"; these settings differ from its config.json (saved vs now): {', '.join(changed)}"


def note_changed_settings(run: Setup) -> None:
    """A warning naming the settings a resumed run goes on with that differ from those of
    its last segment (config.json, which is then rewritten): the run's record holds them."""
    changed = changed_settings(run)
    if changed and run.topology.is_primary:
        logging.warning(
            "Going on with settings that differ from the run's last segment (saved vs now): %s.",
            ", ".join(changed),
        )


def resume(run: Setup) -> Start:
    """The newest good checkpoint's train state, π_ref, history and batch-source state."""
    restored, buffer_state, metadata = restore_newest_good(run)
    state = runs.restored_state(restored)
    logging.info("Resuming from step %d in %s.", int(jax.device_get(state.step)), run.workdir)
    source_state = sources.SourceState(
        buffer_state, metadata["data_position"], metadata["policy_version"]
    )
    history = {**run_totals.empty_totals(), **metadata["history"]}
    return Start(state, restored["reference"], history, source_state)


# ------------------------------------------------------------------------- bookkeeping


def save_checkpoint(
    run: Setup,
    step: int,
    state: learner.TrainState,
    reference: Params,
    source: sources.BatchSource,
    history: dict,
    *,
    force: bool,
) -> None:
    """Saves at `step` if it is a save step (or `force`): train state, π_ref, the source's
    buffer and data position, and the run's history. Refuses non-finite params (the
    learner never applies a non-finite update, so this would be a bug)."""
    if not bool(learner.all_finite(state.params)):
        raise RuntimeError(f"The params of step {step} are not finite; not saving them.")
    source_state = source.state()
    saved = run.checkpointer.save(
        step,
        train_state=runs.checkpoint_items(state, reference),
        buffer_state=source_state.buffer,
        metadata={
            "policy_version": source_state.policy_version,
            "data_position": source_state.data_position,
            "seed": run.config.seed,
            "history": history,
            runs.PARAMS_STACKED_KEY: run.model.config.scan_layers,
        },
        force=force,
    )
    if saved:
        logging.info("Saved checkpoint %d.", step)


def batch_arrays(config: ml_collections.ConfigDict, batch: SampledBatch) -> dict[str, np.ndarray]:
    """The fields of `batch` the train step of `config.method` reads (host arrays, [N, ...])."""
    names = learner.batch_fields(losses.get_loss(config.method))
    return {name: getattr(batch, name) for name in names}


def device_batch(run: Setup, batch: SampledBatch, sharding) -> dict[str, jax.Array]:
    """The fields the train step reads, on the learner mesh split over its batch axes (over
    several processes, `batch` is this process's rows of the global batch)."""
    return run.group.global_batch(batch_arrays(run.config, batch), sharding)


def batch_spec(
    config: ml_collections.ConfigDict, sharding
) -> dict[str, jax.ShapeDtypeStruct] | None:
    """The global batch the train step reads (`device_batch` of B × K rows), as
    ShapeDtypeStructs on `sharding`, with `collate`'s dtypes and widths; None when the
    step reads a field a stage attaches after sampling (VinePPO's token advantages)."""
    rows = config.batch.prompts_per_batch * config.batch.samples_per_prompt
    empty = collate(
        [],
        max_prompt_len=config.max_prompt_len,
        max_response_len=config.max_response_len,
        pad_id=0,
        prompt_ids=np.zeros(0, np.int64),
        from_recency=np.zeros(0, bool),
    )
    fields = batch_arrays(config, empty)
    if any(field is None for field in fields.values()):
        return None
    return {
        name: jax.ShapeDtypeStruct((rows, *field.shape[1:]), field.dtype, sharding=sharding)
        for name, field in fields.items()
    }


def precompile_train_step(run: Setup, state, sharding) -> None:
    """Compiles the learner step for `state` and a batch on `sharding` ahead of its first
    call, which then finds it compiled: an async run does this while the searchers fill
    the buffer. Nothing is compiled (the first call compiles it) for a step that is not
    one jitted program (PPO's unfused step) or reads a field added after sampling."""
    lower = getattr(run.train_step, "lower", None)
    spec = batch_spec(run.config, sharding)
    if lower is None or spec is None:
        return
    began = time.time()
    lower(state, spec).compile()
    logging.info(
        "Compiled the learner step in %.1f s while the first samples were made.",
        time.time() - began,
    )


def records_learner_batches(config: ml_collections.ConfigDict, workdir: str) -> bool:
    """Whether this segment records its learner batches or an earlier one did (a replay
    starts from checkpoint 0 either way, so it is kept)."""
    recorded = batch_log.recorded_steps(batch_log.log_dir(workdir))
    return config.record_learner_batches or bool(recorded)


def open_batch_log(run: Setup, step: int) -> batch_log.BatchLogWriter | None:
    """The batch log of a run with `record_learner_batches` starting (or resuming) at
    `step`; None without. A run that does not record still forgets what an earlier segment
    recorded after `step` (it redoes those steps differently)."""
    directory = batch_log.log_dir(run.workdir)
    if not run.config.record_learner_batches:
        recorded = batch_log.recorded_steps(directory)
        if recorded and recorded[-1] >= step:
            logging.info(
                "Not recording learner batches from step %d (steps %s were): pass "
                "--config.record_learner_batches=True to go on recording.",
                step + 1,
                batch_log.describe_steps(recorded),
            )
        batch_log.truncate_after(directory, step)
        return None
    return batch_log.BatchLogWriter(
        directory,
        start_step=step,
        config=json.loads(run.config.to_json_best_effort()),
        env=batch_log.environment(run.meshes.learner.devices.size),
    )


def record_step(
    log: batch_log.BatchLogWriter,
    step: int,
    fields: dict[str, np.ndarray],
    batch: SampledBatch,
    state: learner.TrainState,
    metrics: dict,
) -> None:
    """Records learner step `step` (the update that produced `state`) into `log`."""
    rows = {name: getattr(batch, name) for name in batch_log.ROW_FIELDS}
    log.record(step, fields, rows, batch_log.trained_params(state), metrics)


def make_value_stage(run: Setup, meters) -> vineppo.MonteCarloValues | None:
    """VinePPO's rollout stage on the sampler mesh (None for the other methods)."""
    config, task = run.config, run.task
    if config.method != "vineppo":
        return None
    vine = config.loss.vineppo
    generate_fn = make_generator(
        run.model,
        sources.sampling_config(config, task.tokenizer.vocab_size),
        eos_id=task.tokenizer.eos_id,
        pad_id=task.tokenizer.pad_id,
        max_prompt_len=config.max_prompt_len + config.max_response_len,
        engine=None,
    )
    return vineppo.MonteCarloValues(
        generate_fn=generate_fn,
        tokenizer=task.tokenizer,
        rewards_fn=task.rewards,
        examples_by_id={example["id"]: example for example in task.train},
        max_prompt_len=config.max_prompt_len,
        max_response_len=config.max_response_len,
        is_boundary=run.step_boundaries,
        config=vineppo.VineConfig(
            rollouts=vine.rollouts,
            step_delimiters=vine.step_delimiters,
            max_steps=vine.max_steps,
            rows_per_call=vine.rows_per_call,
        ),
        time_split=meters.time_split,
        rates=meters.rates,
        non_eos_penalty=task.non_eos_penalty,
    )


def with_rollout_advantages(
    run: Setup,
    value_stage: vineppo.MonteCarloValues,
    source: sources.BatchSource,
    params: Params,
    batch,
    step: int,
) -> SampledBatch:
    """`batch` with VinePPO's per-token advantages from rollouts of `params`, the learner's
    newest after `step` steps: the sampler's copy when the source has published them (a sync
    source publishes after every step), else published to the sampler for the rollouts. A
    learner process of roles_by_process (no policy store: its searchers are other
    processes) rolls out on its own devices, its sampler mesh."""
    published, version = (None, None) if source.store is None else source.store.get()
    sampler_params = published if version == step else publish_policy(run, params)
    rng = jax.random.fold_in(
        jax.random.fold_in(jax.random.key(run.config.seed), VALUE_STAGE_STREAM), step
    )
    advantages = value_stage.advantages(sampler_params, batch, rng)
    return dataclasses.replace(batch, token_advantage=advantages)


def batch_row_facts(run: Setup, batch: SampledBatch) -> runtime.BatchRows:
    """Every row of the global batch's policy versions (first and last), prompt id, draw
    kind and response length, gathered from the learners in one call."""
    k = batch.k
    facts = np.stack(
        [
            batch.policy_version,
            batch.policy_version_last,
            np.repeat(batch.prompt_ids, k),
            np.repeat(batch.from_recency, k),
            batch.response_mask.sum(axis=1),
        ]
    ).astype(np.int64)
    if run.topology.multi_process:
        facts = np.concatenate(run.group.gather(facts), axis=1)
    return runtime.BatchRows(*facts)


def start_evaluation(
    run: Setup, evaluate: Callable[[Params], float], params: Params, key: str, resuming: bool
) -> float:
    """The held-out score of the policy before any RL: evaluated, and written to
    START_EVALUATION_FILENAME, or, `resuming` at step 0, read back from it when the last
    segment evaluated and then stopped before step 1 (one-process runs; over several,
    each segment evaluates)."""
    path = os.path.join(run.workdir, START_EVALUATION_FILENAME)
    if resuming and not run.topology.multi_process and os.path.exists(path):
        with open(path) as f:
            score, where = json.load(f)[key], f" (read back from {START_EVALUATION_FILENAME})"
    else:
        score, where = evaluate(params), ""
        if run.topology.is_primary:
            write_json_atomically(path, {key: score})
    logging.info("Held-out greedy %s at the start: %.3f%s", run.task.eval_metric, score, where)
    return score


def write_run_config(run: Setup) -> None:
    """config.json: the config this segment of the run trains with (process 0)."""
    if run.topology.is_primary:
        runs.write_config(run.workdir, run.config)


def finished_summary(
    config: ml_collections.ConfigDict, workdir: str, topology: topology_lib.Topology
) -> dict | None:
    """The summary of the run in `workdir` when it is `config`'s experiment and already
    reached `learner_steps` and wrote it, else None. Read from the files alone, before the
    run builds anything, while no other run is in the workdir (`WorkdirInUseError`);
    `CheckpointMismatchError` when they are another experiment's (its model compared with
    the held vocabulary: the task's is known once the task is built)."""
    path = os.path.join(workdir, SUMMARY_FILENAME)
    if not os.path.exists(path):
        return None
    with WorkdirLock(workdir):
        held = held_experiment(workdir)
        if not isinstance(held, dict) or "vocab_size" not in held.get("model", {}):
            return None
        try:
            model_cfg = runs.model_config(config, held["model"]["vocab_size"])
        except ValueError:
            return None  # not this model: the run's own checks say why
        layout = topology.describe() if topology.multi_process else None
        check_experiment(workdir, runs.experiment_identity(config, model_cfg, layout))
        latest = latest_saved_step(workdir)
        if latest is None or latest < config.learner_steps:
            return None
        with open(path) as f:
            summary = json.load(f)
    return summary if summary.get("learner_steps") == latest else None


def check_only(config: ml_collections.ConfigDict, workdir: str) -> list[str]:
    """Every check `train_and_evaluate` makes before it builds anything (`check_run`:
    config values, meshes, Hugging Face folders, the task's role models, the workdir's
    experiment), then what the run would start from, as console lines (`train.py
    --check_only`). Writes nothing: for a paper-scale config before a job is queued."""
    checked = check_run(config, workdir)
    meshes, topology = checked.meshes, checked.topology
    variant = config.get("variant") or "its defaults"
    processes = ""
    if topology.multi_process:
        processes = f" over {topology.num_processes} processes (the sampler's: this one's)"
    sharing = "colocated: the same devices" if meshes.colocated else "separate devices"
    lines = [
        f"{config.name} ({variant}): method={config.method}, mode={config.mode}, "
        f"{config.learner_steps} learner steps. Every check before the run's first write "
        "passed; nothing was written.",
        f"Meshes{processes}: the sampler's {dict(meshes.sampler.shape)}, the learner's "
        f"{dict(meshes.learner.shape)} ({sharing}).",
    ]
    summary = finished_summary(config, workdir, topology) if topology.is_primary else None
    latest = latest_saved_step(workdir) if os.path.isdir(workdir) else None
    if summary is not None:
        start = f"finished at step {summary['learner_steps']}: a run gives its summary back"
    elif latest is not None:
        start = f"resumes from its checkpoint of step {latest}"
    elif os.path.isdir(os.path.join(workdir, WARM_START_SUBDIR)):
        start = "goes on from its saved warm start"
    elif os.path.isdir(workdir):
        start = "starts in it with a warm start (no checkpoint there)"
    else:
        start = "makes it and starts with a warm start"
    lines.append(f"The run in {workdir} {start}.")
    return lines


# ------------------------------------------------------------------------------ the run


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Runs `config` in `workdir` (resuming if it holds a checkpoint); returns the summary
    of the whole run. When SIGTERM / Ctrl-C stops it, it saves and raises
    `checkpoint.RunStopped` (the launchers exit 128 + the signal). A searcher process of a
    roles_by_process run returns {} when the learners are done."""
    with contextlib.ExitStack() as held:  # the workdir, locked while this run is in it
        return _train_and_evaluate(config, workdir, held)


def _train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, held: contextlib.ExitStack
) -> dict:
    segment = run_totals.Segment(run_totals.Meters(), started_at=time.time())
    with sigterm_stops_at_once():  # nothing to save yet: a SIGTERM ends the run at once
        checked = check_run(config, workdir)
        # a finished run is given back before its task and models are built (minutes for
        # a paper task's reward model or victim)
        primary = checked.topology.is_primary
        summary = finished_summary(config, workdir, checked.topology) if primary else None
        if distributed.any_process(summary is not None):
            if summary is not None:
                logging.info("%s already finished at step %d.", workdir, summary["learner_steps"])
            return summary or {}  # its config.json stays the config it trained with
        run = setup(config, workdir, held, checked)
    with stop_on_signals() as stop_signal:
        if not run.topology.is_learner:
            search_only(run, segment, stop_signal)
            return {}
        try:
            return train_from_start(run, segment, stop_signal)
        finally:
            run.checkpointer.wait_until_finished()
            run.checkpointer.close()


def search_only(run: Setup, segment: run_totals.Segment, stop_signal: StopSignal) -> None:
    """A searcher process of a roles_by_process run (see `tba_jax.by_process`)."""
    config = run.config
    worker = sources.make_search_worker(
        config,
        run.task,
        run.model,
        reference_params=None,  # from the learners' start broadcast
        samples_per_prompt=config_lib.samples_per_search_prompt(config),
        meters=segment.meters,
        drop_nonfinite=config.mode == "async",
    )
    by_process.run_searcher_process(
        config,
        run.topology,
        worker=worker,
        stream=sources.prompt_stream(run.task, run.topology, config.seed),
        sampler_shardings=run.sampler_shardings,
        exchange_mesh=exchange.make_exchange_mesh(run.topology.num_processes),
        abstract_params=run.abstract_params,
        meters=segment.meters,
        stop_signal=stop_signal,
        params_cast=compute_dtype_cast(run.model.config),
    )


def make_batch_source(
    run: Setup, state: learner.TrainState, reference: Params, segment: run_totals.Segment
) -> sources.BatchSource:
    """The batch source of this process: local searchers (one process, or
    roles_within_host), or the searcher processes' exchange (roles_by_process)."""
    config, step = run.config, int(jax.device_get(state.step))
    if run.topology.name == topology_lib.ROLES_BY_PROCESS:
        buffer = None
        if config.mode == "async":
            buffer = sources.make_replay_buffer(config, run.task.tokenizer.pad_id)
        return by_process.RemoteSource(
            config,
            run.topology,
            run.group,
            exchange_mesh=exchange.make_exchange_mesh(run.topology.num_processes),
            params=state.params,
            reference=reference,
            version=step,
            buffer=buffer,
            meters=segment.meters,
            pad_id=run.task.tokenizer.pad_id,
        )
    return sources.make_source(
        config,
        task=run.task,
        model=run.model,
        sampler_shardings=run.sampler_shardings,
        params=state.params,
        version=step,
        reference_params=(
            run.group.publish(reference, run.sampler_shardings)
            if run.topology.multi_process
            else reference
        ),
        meters=segment.meters,
        topology=run.topology,
        group=run.group,
    )


def train_from_start(run: Setup, segment: run_totals.Segment, stop_signal: StopSignal) -> dict:
    """The start, the loop and the final evaluation (see `train_and_evaluate`)."""
    config, workdir, topology = run.config, run.workdir, run.topology
    resuming = run.checkpointer.latest_step() is not None
    if resuming:  # config.json changes only once the checkpoint is known to restore
        start = resume(run)
        note_changed_settings(run)
        write_run_config(run)
    else:
        write_run_config(run)
        start = fresh_start(run, stop_signal, segment)
    state, reference, history = start.state, start.reference, start.history
    step = int(jax.device_get(state.step))
    source = make_batch_source(run, state, reference, segment)
    if start.source_state is not None:
        source.restore(start.source_state)
    recorder = None  # the batch log (record_learner_batches), open while the loop runs

    def save(force: bool) -> None:
        if recorder is not None:
            recorder.flush()  # a checkpoint never gets ahead of the steps recorded before it
        segment.remote_counts = source.remote_counts
        history_now = run_totals.history_so_far(history, segment)
        save_checkpoint(run, step, state, reference, source, history_now, force=force)

    if not resuming:
        save(force=True)  # the warm start is never redone
        if topology.is_primary:
            WarmStartCheckpoint(os.path.join(workdir, WARM_START_SUBDIR)).clear()
    evaluate = make_evaluate(run, stop_signal)
    key = eval_key(run)
    if f"{key}_start" not in history and step == 0:
        history[f"{key}_start"] = start_evaluation(run, evaluate, state.params, key, resuming)
    writer = None
    if topology.is_primary:
        writer = MetricsWriter(
            workdir,
            log_every=config.log_every,
            total_steps=config.learner_steps,
            show_progress=config.progress_bar,
        )
    batch_sharding = mesh_lib.batch_sharding(run.meshes.learner)
    value_stage = make_value_stage(run, segment.meters)
    nonfinite_in_a_row = 0
    try:
        recorder = open_batch_log(run, step) if topology.is_primary else None
        segment.rl_started_at = time.time()
        source.start(
            stop_signal, meanwhile=lambda: precompile_train_step(run, state, batch_sharding)
        )
        while step < config.learner_steps and not source.agreed_stop(stop_signal.requested):
            batch = source.next_batch(step)
            if value_stage is not None:  # VinePPO: advantages from the current policy's rollouts
                batch = with_rollout_advantages(run, value_stage, source, state.params, batch, step)
            with segment.meters.time_split.measure("training"):
                fields = batch_arrays(config, batch)
                state, metrics = run.train_step(
                    state, run.group.global_batch(fields, batch_sharding)
                )
                metrics = jax.device_get(metrics)
            if recorder is not None:
                record_step(recorder, step + 1, fields, batch, state, metrics)
            rows = batch_row_facts(run, batch)
            batch_lags = runtime.policy_lags(step, rows.version_first)
            last_lags = runtime.policy_lags(step, rows.version_last)
            skipped = bool(metrics["skipped_nonfinite"])
            segment.add_batch(batch_lags, skipped)
            segment.remote_counts = source.remote_counts
            nonfinite_in_a_row = nonfinite_in_a_row + 1 if skipped else 0
            step += 1
            if step % source.publish_every == 0:
                source.publish(state.params, version=step)
            metrics.update(runtime.lag_metrics(batch_lags))
            metrics.update(runtime.draw_metrics(rows, batch.k))
            if config.mode == "async":  # a sync batch is all fresh: one kind, lag 0
                metrics.update(runtime.lag_by_draw_metrics(batch_lags, rows.from_recency))
            if config.search.in_flight_updates:
                metrics.update(runtime.lag_metrics(last_lags, prefix="policy_lag_last"))
            metrics.update(segment.rates_since_rl_start())
            metrics.update(source.metrics(step))
            stopped_in_evaluation = None
            if config.eval.every_steps and step % config.eval.every_steps == 0:
                eval_began = time.time()
                try:
                    metrics[key] = evaluate(state.params)
                    metrics[EVAL_SECONDS] = time.time() - eval_began
                except RunStopped as stopped:  # the step is saved below: log it first
                    stopped_in_evaluation = stopped
            metrics[RL_SECONDS] = time.time() - segment.rl_started_at  # this segment's
            if writer is not None:
                writer.write(step, metrics)
            if stopped_in_evaluation is not None:
                raise stopped_in_evaluation
            if nonfinite_in_a_row >= config.max_nonfinite_steps:
                save(force=True)
                raise NonFiniteError(
                    f"The loss or gradient was not finite for {nonfinite_in_a_row} learner "
                    f"steps in a row (to step {step}); those updates were skipped, so the "
                    f"checkpoint of step {step} holds the last finite params. Lower "
                    "optim.learning_rate (or check the rewards) and rerun to go on."
                )
            if step % config.checkpoint_every == 0 and step < config.learner_steps:
                save(force=False)  # the last step is saved after the searchers stop
    except RunStopped:
        pass  # stopped in an evaluation: the step is saved below
    finally:
        source.close()
        if writer is not None:
            writer.close()
        if recorder is not None:
            recorder.close()
    source.agreed_stop(False)  # over several processes: also a last count of their samples
    save(force=True)
    if step < config.learner_steps:  # stopped early: every process agreed to
        stop_signal.request(stop_signal.reason or "a stop request on another process")
    stop_signal.raise_if_requested()
    score_end = evaluate(state.params)
    summary = run_totals.run_summary(
        config,
        run_totals.history_so_far(history, segment),
        eval_key=key,
        score_end=score_end,
        learner_steps=step,
        colocated=run.meshes.colocated,
        layout=topology.describe(),
    )
    if not topology.is_primary:
        return summary
    summary_path = write_json_atomically(os.path.join(workdir, SUMMARY_FILENAME), summary)
    logging.info(
        "Finished %d learner steps in %.0f s (warm start %.0f s); %s %s → %.3f; %s",
        summary["learner_steps"],
        summary[WALL_SECONDS],
        summary[WARM_START_SECONDS],
        key,
        "?" if summary[f"{key}_start"] is None else f"{summary[f'{key}_start']:.3f}",
        score_end,
        summary_path,
    )
    return summary
