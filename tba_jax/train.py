"""`train_and_evaluate(config, workdir)`: one TBA (or sync baseline) run, start to end.

It reads top to bottom in three parts:

1. `setup`: checks the config and builds everything cheap (task, model, meshes,
   shardings, optimiser, train step, the checkpointer's experiment check) before any
   long work.
2. The start: `resume` from the latest checkpoint, or `warm_start_and_evaluate`.
3. The loop over a `sources.BatchSource` (async: searcher threads + replay buffer;
   sync: fresh on-policy samples each step): draw a batch, take a train step, publish
   every `source.publish_every` steps, log, evaluate, checkpoint. The loop has no mode
   branches; the source is the mode.

Then the final evaluation and `workdir/summary.json`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np
from absl import logging

from tba_jax import config_lib, evaluation, learner, losses, runs, runtime, sources, tasks
from tba_jax import mesh as mesh_lib
from tba_jax.checkpoint import Checkpointer, StopSignal, install_sigterm_handler
from tba_jax.metrics import MetricsWriter, write_json_atomically
from tba_jax.models import Model, Params, abstract_model, init_model
from tba_jax.sampling.generate import make_generate_fn
from tba_jax.trajectories import SampledBatch
from tba_jax.warmstart import WarmStartConfig, check_warm_start_data, warm_start

SUMMARY_FILENAME = "summary.json"


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
    state_sharding: Any
    train_step: Callable  # (TrainState, batch) -> (TrainState, metrics)
    evaluate: Callable[[Params], float]  # mean greedy reward on the test prompts
    checkpointer: Checkpointer


class Start(NamedTuple):
    """Where the loop starts: the train state, π_ref, the run's history so far and (when
    resuming) the batch source's saved state."""

    state: learner.TrainState
    reference: Params
    history: dict
    source_state: sources.SourceState | None


def setup(config: ml_collections.ConfigDict, workdir: str) -> Setup:
    """Validates `config` and builds the run; raises ConfigError / CheckpointMismatchError
    (one line each) before anything long runs."""
    config_lib.validate(config, jax.device_count())
    os.makedirs(workdir, exist_ok=True)
    task = tasks.build_task(config.task, workdir, tokenizer=runs.policy_tokenizer(config))
    check_warm_start_data(task.train, WarmStartConfig(**config.warm_start.to_dict()))
    model_cfg = runs.model_config(config, task.tokenizer.vocab_size)
    checkpointer = Checkpointer(
        workdir,
        experiment=runs.experiment_identity(config, model_cfg),
        max_to_keep=config.keep_checkpoints,
    )
    runs.write_config(workdir, config)
    meshes = mesh_lib.make_role_meshes(
        config.mesh.sampler_devices,
        config.mesh.colocate,
        config.mesh.sampler_axes,
        config.mesh.learner_axes,
    )
    model, abstract_params = abstract_model(model_cfg)
    learner_shardings = mesh_lib.param_shardings(
        model.logical_axes, abstract_params, meshes.learner, config.mesh.learner_rules
    )
    sampler_shardings = mesh_lib.param_shardings(
        model.logical_axes, abstract_params, meshes.sampler, config.mesh.sampler_rules
    )
    optimizer = learner.make_optimizer(runs.optim_config(config))
    state_sharding = learner.train_state_shardings(
        optimizer, abstract_params, learner_shardings, meshes.learner
    )
    train_step = learner.make_train_step(
        model,
        losses.get_loss(config.method),
        optimizer,
        losses.make_beta_schedule(
            config.loss.beta_schedule,
            config.loss.beta_start,
            config.loss.beta_end,
            config.loss.beta_anneal_steps,
        ),
        samples_per_prompt=config.batch.samples_per_prompt,
        num_microbatches=config.batch.num_microbatches,
        temperature=config.sampling.temperature,
        state_sharding=state_sharding,
        mesh=meshes.learner,
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
        train_step=train_step,
        evaluate=make_evaluate(config, task, model, sampler_shardings),
        checkpointer=checkpointer,
    )


def make_evaluate(
    config: ml_collections.ConfigDict, task: tasks.Task, model: Model, sampler_shardings
) -> Callable[[Params], float]:
    """The in-training evaluation: mean reward of greedy responses to the first
    `eval.num_examples` test prompts (0: all), on the sampler mesh."""
    tokenizer = task.tokenizer
    greedy_fn = make_generate_fn(
        model,
        sources.sampling_config(config, tokenizer.vocab_size, greedy=True),
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
    )

    def evaluate(params: Params) -> float:
        result = evaluation.greedy_accuracy(
            greedy_fn,
            mesh_lib.publish(params, sampler_shardings),
            task.test[: config.eval.num_examples or None],
            tokenizer,
            task.rewards,
            max_prompt_len=config.max_prompt_len,
            batch_size=config.eval.batch_size,
        )
        return result["accuracy"]

    return evaluate


def initial_policy_params(config: ml_collections.ConfigDict, model, shardings) -> Params:
    """The policy before the warm start: `model.hf_path`'s weights, else a random init."""
    if config.model.hf_path:
        from tba_jax.models import hf  # optional: needs safetensors/tokenizers

        return hf.load_params(config.model.hf_path, model, shardings=shardings)
    _, params = init_model(model.config, config.seed)
    return jax.device_put(params, shardings)


def reference_params(config: ml_collections.ConfigDict, model, start_params, shardings) -> Params:
    """π_ref on the sampler: `reference.hf_path`'s weights, else the warm-started policy."""
    if not config.reference.hf_path:
        return mesh_lib.publish(start_params, shardings)
    from tba_jax.models import hf  # optional: needs safetensors/tokenizers

    reference_cfg = hf.config_from_hf(config.reference.hf_path)
    same_shape = dataclasses.replace(
        reference_cfg, dtype=model.config.dtype, param_dtype=model.config.param_dtype
    )
    if same_shape != model.config:
        raise ValueError(
            f"The reference model in {config.reference.hf_path} has another architecture than "
            "the policy; TB needs log π_ref of the same tokens, so use a checkpoint of the "
            "policy's family, size and vocabulary."
        )
    return hf.load_params(config.reference.hf_path, model, shardings=shardings)


def eval_key(run: Setup) -> str:
    """The in-training evaluation's metric name, e.g. `eval_accuracy` (see `Task.eval_metric`)."""
    return f"eval_{run.task.eval_metric}"


def warm_start_and_evaluate(run: Setup) -> Start:
    """A fresh run's start: the initial policy, `warm_start.steps` supervised steps (the
    warm-started policy is also π_ref unless `reference.hf_path` is set), and the first
    evaluation."""
    config = run.config
    logging.info("Warm start: %d supervised steps.", config.warm_start.steps)
    begin = time.time()
    params = initial_policy_params(config, run.model, run.learner_shardings)
    if config.warm_start.steps > 0:
        params = warm_start(
            run.model,
            params,
            run.task.train,
            run.task.tokenizer,
            WarmStartConfig(**config.warm_start.to_dict()),
            max_prompt_len=config.max_prompt_len,
            max_response_len=config.max_response_len,
            mesh=run.meshes.learner,
            seed=config.seed,
        )
    reference = reference_params(config, run.model, params, run.sampler_shardings)
    state = learner.init_train_state(params, run.optimizer, run.state_sharding)
    score_start = run.evaluate(state.params)
    logging.info("Held-out greedy %s after warm start: %.3f", run.task.eval_metric, score_start)
    history = {
        f"{eval_key(run)}_start": score_start,
        "warm_start_seconds": time.time() - begin,
        "samples_generated": 0,
        "tokens_generated": 0,
    }
    return Start(state, reference, history, source_state=None)


def resume(run: Setup) -> Start:
    """The latest checkpoint's train state, π_ref, history and batch-source state."""
    logging.info("Resuming from step %d in %s.", run.checkpointer.latest_step(), run.workdir)
    template = runs.checkpoint_template(
        run.optimizer, run.abstract_params, run.state_sharding, run.sampler_shardings
    )
    restored, buffer_state, metadata = run.checkpointer.restore(train_state_template=template)
    source_state = sources.SourceState(
        buffer_state, metadata["data_position"], metadata["policy_version"]
    )
    return Start(
        learner.TrainState(**restored["train"]),
        restored["reference"],
        metadata["history"],
        source_state,
    )


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
    buffer and data position, and the run's history for the summary."""
    source_state = source.state()
    run.checkpointer.save(
        step,
        train_state={"train": state._asdict(), "reference": reference},
        buffer_state=source_state.buffer,
        metadata={
            "policy_version": source_state.policy_version,
            "data_position": source_state.data_position,
            "seed": run.config.seed,
            "history": history,
        },
        force=force,
    )


def history_so_far(history: dict, meters: sources.Meters) -> dict:
    """The run's history with this segment's generated samples and tokens added."""
    totals = meters.rates.totals()
    return {
        **history,
        "samples_generated": history["samples_generated"] + totals.get("samples", 0),
        "tokens_generated": history["tokens_generated"] + totals.get("tokens", 0),
    }


def device_batch(batch: SampledBatch, sharding) -> dict[str, jax.Array]:
    """The fields the train step reads, on the learner mesh split over its batch axes."""
    return jax.device_put({name: getattr(batch, name) for name in learner.BATCH_FIELDS}, sharding)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Runs `config` in `workdir` (resuming if it holds a checkpoint); returns the summary
    ({} when stopped by SIGTERM)."""
    wall_start = time.time()
    run = setup(config, workdir)
    resuming = run.checkpointer.latest_step() is not None
    start = resume(run) if resuming else warm_start_and_evaluate(run)
    state, reference = start.state, start.reference
    step = int(jax.device_get(state.step))
    meters = sources.Meters()
    source = sources.make_source(
        config,
        task=run.task,
        model=run.model,
        sampler_shardings=run.sampler_shardings,
        params=state.params,
        version=step,
        reference_params=reference,
        meters=meters,
    )
    if start.source_state is not None:
        source.restore(start.source_state)

    def save(force: bool) -> None:
        history = history_so_far(start.history, meters)
        save_checkpoint(run, step, state, reference, source, history, force=force)

    if not resuming:
        save(force=True)  # the warm start is never redone
    writer = MetricsWriter(
        workdir,
        log_every=config.log_every,
        total_steps=config.learner_steps,
        show_progress=config.progress_bar,
    )
    batch_sharding = mesh_lib.batch_sharding(run.meshes.learner)
    stop_signal = StopSignal()
    on_main_thread = threading.current_thread() is threading.main_thread()
    restore_sigterm = install_sigterm_handler(stop_signal.request) if on_main_thread else None
    lags: list[np.ndarray] = []
    rl_start = time.time()
    interrupted = False
    try:
        source.start(stop_signal)
        while step < config.learner_steps and not stop_signal.requested:
            batch = source.next_batch(step)
            with meters.time_split.measure("training"):
                state, metrics = run.train_step(state, device_batch(batch, batch_sharding))
                metrics = jax.device_get(metrics)
            batch_lags = runtime.policy_lags(step, batch.policy_version)
            lags.append(batch_lags)
            step += 1
            if step % source.publish_every == 0:
                source.publish(state.params, version=step)
            metrics.update(runtime.lag_metrics(batch_lags))
            rates = meters.rates.rates_since_start()
            metrics.update({f"{name}_per_second": value for name, value in rates.items()})
            metrics.update(source.metrics(step))
            if config.eval.every_steps and step % config.eval.every_steps == 0:
                metrics[eval_key(run)] = run.evaluate(state.params)
            writer.write(step, metrics)
            if step % config.checkpoint_every == 0:
                save(force=False)
    except KeyboardInterrupt:
        interrupted = True
        logging.warning("Interrupted: saving a checkpoint at step %d and stopping.", step)
    finally:
        source.close()
        if restore_sigterm is not None:
            restore_sigterm()
    rl_seconds = time.time() - rl_start
    save(force=True)
    run.checkpointer.wait_until_finished()
    if interrupted or stop_signal.requested:
        writer.close()
        run.checkpointer.close()
        if interrupted:
            raise KeyboardInterrupt
        logging.warning("SIGTERM: saved step %d and stopped.", step)
        return {}

    score_end = run.evaluate(state.params)
    summary = run_summary(
        run,
        history_so_far(start.history, meters),
        meters,
        lags,
        score_end=score_end,
        learner_steps=step,
        wall_seconds=time.time() - wall_start,
        rl_seconds=rl_seconds,
    )
    write_json_atomically(os.path.join(workdir, SUMMARY_FILENAME), summary)
    writer.close()
    run.checkpointer.close()
    logging.info("Summary: %s", json.dumps(summary, sort_keys=True))
    return summary


def run_summary(
    run: Setup,
    history: dict,
    meters: sources.Meters,
    lags: list[np.ndarray],
    *,
    score_end: float,
    learner_steps: int,
    wall_seconds: float,
    rl_seconds: float,
) -> dict:
    """summary.json: what ran, how well (start/end evaluation), how fast, and how stale."""
    config, key = run.config, eval_key(run)
    all_lags = np.concatenate(lags) if lags else np.zeros(1)
    segment = meters.rates.totals()
    per_second = lambda amount: amount / max(rl_seconds, 1e-9)
    return {
        "config_name": config.name,
        "variant": config.variant,
        "mode": config.mode,
        "method": config.method,
        "learner_steps": learner_steps,
        "samples_generated": history["samples_generated"],
        "tokens_generated": history["tokens_generated"],
        "wall_seconds": wall_seconds,
        "warm_start_seconds": history.get("warm_start_seconds", 0.0),
        "rl_seconds": rl_seconds,
        f"{key}_start": history[f"{key}_start"],
        f"{key}_end": score_end,
        "max_policy_lag": float(all_lags.max()),
        "mean_policy_lag": float(all_lags.mean()),
        "samples_per_second": per_second(segment.get("samples", 0)),
        "tokens_per_second": per_second(segment.get("tokens", 0)),
        "learner_steps_per_second": per_second(len(lags)),
        "time_split_seconds": meters.time_split.totals(),
        "num_devices": jax.device_count(),
        "colocated": run.meshes.colocated,
    }
