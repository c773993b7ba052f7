"""`train_and_evaluate(config, workdir)`: one TBA (or sync baseline) run, start to end.

Setup → (resume, or warm start + initial evaluation) → the training loop →
final evaluation → `workdir/summary.json`. The loop is one function for both
modes: in `async` mode searcher threads fill the replay buffer and the
learner samples from it, publishing every `sync_period` steps; in `sync` mode
each step generates K fresh samples per prompt with the current params,
scores them and trains on them (publishing after every step).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import threading
import time

import jax
import ml_collections
import numpy as np
from absl import logging

from tba_jax import config_lib, evaluation, learner, losses, runs, runtime, tasks
from tba_jax import mesh as mesh_lib
from tba_jax.checkpoint import (
    Checkpointer,
    StopSignal,
    install_sigterm_handler,
)
from tba_jax.data.pipeline import PromptStream
from tba_jax.metrics import MetricsWriter, RateMeter, TimeSplit, write_json_atomically
from tba_jax.models import Params, abstract_model, init_model
from tba_jax.replay import ReplayBuffer
from tba_jax.sampling.generate import SamplingConfig, make_generate_fn
from tba_jax.sampling.scoring import make_score_fn
from tba_jax.trajectories import collate
from tba_jax.warmstart import WarmStartConfig, check_warm_start_data, warm_start

SEARCHER_JOIN_TIMEOUT_S = 60.0
BUFFER_POLL_S = 0.05


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


def sampler_config(
    config: ml_collections.ConfigDict, vocab_limit: int, greedy: bool = False
) -> SamplingConfig:
    """`vocab_limit`: the tokenizer's vocabulary size (ids past it are never drawn)."""
    if greedy:
        return SamplingConfig(
            max_new_tokens=config.max_response_len, greedy=True, vocab_limit=vocab_limit
        )
    return SamplingConfig(
        max_new_tokens=config.max_response_len, vocab_limit=vocab_limit, **config.sampling.to_dict()
    )


def write_summary(workdir: str, summary: dict) -> None:
    write_json_atomically(os.path.join(workdir, "summary.json"), summary)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Runs `config` in `workdir` (resuming if it holds a checkpoint); returns the summary."""
    wall_start = time.time()
    config_lib.validate(config, jax.device_count())
    os.makedirs(workdir, exist_ok=True)
    runs.write_config(workdir, config)

    # --- Setup: everything cheap and checkable comes before any long work. ---
    task = tasks.build_task(config.task, workdir, tokenizer=runs.policy_tokenizer(config))
    check_warm_start_data(task.train, WarmStartConfig(**config.warm_start.to_dict()))
    tokenizer = task.tokenizer
    model_cfg = runs.model_config(config, tokenizer.vocab_size)
    checkpointer = Checkpointer(
        workdir,
        experiment=runs.experiment_identity(config, model_cfg),
        max_to_keep=config.keep_checkpoints,
    )
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
    loss = losses.get_loss(config.method)
    beta_schedule = losses.make_beta_schedule(
        config.loss.beta_schedule,
        config.loss.beta_start,
        config.loss.beta_end,
        config.loss.beta_anneal_steps,
    )
    batch_cfg = config.batch
    buffer = ReplayBuffer(
        max_prompt_len=config.max_prompt_len,
        max_response_len=config.max_response_len,
        pad_id=tokenizer.pad_id,
        capacity=config.replay.capacity,
        capacity_per_prompt=config.replay.capacity_per_prompt,
        recency_prob=config.replay.recency_prob,
        priority=config.replay.priority,
        priority_inverse_temperature=config.replay.priority_inverse_temperature,
    )
    stream = PromptStream(task.train, seed=config.seed)
    greedy_fn = make_generate_fn(
        model,
        sampler_config(config, tokenizer.vocab_size, greedy=True),
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
    )

    def evaluate(params) -> float:
        result = evaluation.greedy_accuracy(
            greedy_fn,
            mesh_lib.publish(params, sampler_shardings),
            task.test[: config.eval.num_examples or None],  # 0: all
            tokenizer,
            task.rewards,
            max_prompt_len=config.max_prompt_len,
            batch_size=config.eval.batch_size,
        )
        return result["accuracy"]

    writer = MetricsWriter(
        workdir,
        log_every=config.log_every,
        total_steps=config.learner_steps,
        show_progress=config.progress_bar,
    )

    # --- Resume, or warm start. ---
    resume_step = checkpointer.latest_step()
    if resume_step is None:
        logging.info("Warm start: %d supervised steps.", config.warm_start.steps)
        warm_start_begin = time.time()
        params = initial_policy_params(config, model, learner_shardings)
        if config.warm_start.steps > 0:
            params = warm_start(
                model,
                params,
                task.train,
                tokenizer,
                WarmStartConfig(**config.warm_start.to_dict()),
                max_prompt_len=config.max_prompt_len,
                max_response_len=config.max_response_len,
                mesh=meshes.learner,
                seed=config.seed,
            )
        reference = reference_params(config, model, params, sampler_shardings)
        state = learner.init_train_state(params, optimizer, state_sharding)
        accuracy_start = evaluate(state.params)
        history = {
            "eval_accuracy_start": accuracy_start,
            "warm_start_seconds": time.time() - warm_start_begin,
            "samples_generated": 0,
            "tokens_generated": 0,
        }
        logging.info("Held-out greedy accuracy after warm start: %.3f", accuracy_start)
    else:
        logging.info("Resuming from step %d in %s.", resume_step, workdir)
        template = runs.checkpoint_template(
            optimizer, abstract_params, state_sharding, sampler_shardings
        )
        restored, buffer_state, metadata = checkpointer.restore(train_state_template=template)
        state = learner.TrainState(**restored["train"])
        reference = restored["reference"]
        buffer.load_state_dict(buffer_state)
        stream.restore(metadata["data_position"])
        history = metadata["history"]

    step = int(jax.device_get(state.step))
    train_step = learner.make_train_step(
        model,
        loss,
        optimizer,
        beta_schedule,
        samples_per_prompt=batch_cfg.samples_per_prompt,
        num_microbatches=batch_cfg.num_microbatches,
        temperature=config.sampling.temperature,
        state_sharding=state_sharding,
        mesh=meshes.learner,
    )
    time_split = TimeSplit()
    rates = RateMeter()
    samples_per_prompt = (
        batch_cfg.samples_generated_per_prompt
        if config.mode == "async"
        else batch_cfg.samples_per_prompt
    )
    worker = runtime.SearchWorker(
        generate_fn=make_generate_fn(
            model,
            sampler_config(config, tokenizer.vocab_size),
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
        ),
        score_fn=make_score_fn(
            model,
            temperature=config.sampling.temperature,
            rows_per_chunk=config.search.score_rows_per_chunk,
        ),
        reference_params=reference,
        tokenizer=tokenizer,
        rewards_fn=task.rewards,
        max_prompt_len=config.max_prompt_len,
        samples_per_prompt=samples_per_prompt,
        time_split=time_split,
        rates=rates,
        non_eos_penalty=task.non_eos_penalty,
    )
    store = runtime.PolicyStore(sampler_shardings, state.params, version=step)
    batch_sharding = mesh_lib.batch_sharding(meshes.learner)

    def save(force: bool) -> None:
        metadata = {
            "policy_version": store.get()[1],
            "data_position": stream.position,
            "seed": config.seed,
            "history": {
                **history,
                "samples_generated": history["samples_generated"]
                + rates.totals().get("samples", 0),
                "tokens_generated": history["tokens_generated"] + rates.totals().get("tokens", 0),
            },
        }
        checkpointer.save(
            step,
            train_state={"train": state._asdict(), "reference": reference},
            buffer_state=buffer.state_dict(),
            metadata=metadata,
            force=force,
        )

    if resume_step is None:
        save(force=True)  # the warm start is never redone

    # --- The training loop. ---
    stop_signal = StopSignal()
    on_main_thread = threading.current_thread() is threading.main_thread()
    restore_sigterm = install_sigterm_handler(stop_signal.request) if on_main_thread else None
    stop, errors = threading.Event(), queue.Queue()
    pool = runtime.SearcherPool(
        [
            runtime.Searcher(
                index,
                worker,
                store,
                stream,
                buffer,
                prompts_per_call=config.search.prompts_per_call,
                seed=config.seed + step,
                stop=stop,
                errors=errors,
            )
            for index in range(config.search.num_searchers if config.mode == "async" else 0)
        ],
        stop,
        errors,
    )
    lags: list[np.ndarray] = []
    rl_start = time.time()
    interrupted = False
    try:
        pool.start()
        if config.mode == "async":
            with time_split.measure("waiting"):
                pool.wait_for_buffer(buffer, config.replay.min_prompts, BUFFER_POLL_S, stop_signal)
        while step < config.learner_steps and not stop_signal.requested:
            if config.mode == "async":
                pool.raise_if_failed()
                batch = buffer.sample(
                    batch_cfg.prompts_per_batch,
                    batch_cfg.samples_per_prompt,
                    np.random.default_rng([config.seed, step]),
                )
            else:
                params, version = store.get()
                examples = stream.next_batch(batch_cfg.prompts_per_batch)
                rng = jax.random.fold_in(jax.random.key(config.seed), step)
                trajectories = worker.search(params, version, examples, rng)
                batch = collate(
                    trajectories,
                    max_prompt_len=config.max_prompt_len,
                    max_response_len=config.max_response_len,
                    pad_id=tokenizer.pad_id,
                    prompt_ids=np.array([ex["id"] for ex in examples]),
                    from_recency=np.ones(len(examples), bool),
                )
            with time_split.measure("training"):
                device_batch = jax.device_put(
                    {name: getattr(batch, name) for name in learner.BATCH_FIELDS}, batch_sharding
                )
                state, metrics = train_step(state, device_batch)
                metrics = jax.device_get(metrics)
            batch_lags = runtime.policy_lags(step, batch.policy_version)
            lags.append(batch_lags)
            step += 1
            if config.mode == "sync" or step % config.sync_period == 0:
                store.publish(state.params, version=step)
            metrics.update(runtime.lag_metrics(batch_lags))
            metrics.update({f"{k}_per_second": v for k, v in rates.rates_since_start().items()})
            if config.mode == "async":
                metrics.update({f"buffer_{k}": v for k, v in buffer.stats(step).items()})
            if config.eval.every_steps and step % config.eval.every_steps == 0:
                metrics["eval_accuracy"] = evaluate(state.params)
            writer.write(step, metrics)
            if step % config.checkpoint_every == 0:
                save(force=False)
    except KeyboardInterrupt:
        interrupted = True
        logging.warning("Interrupted: saving a checkpoint at step %d and stopping.", step)
    finally:
        pool.close(SEARCHER_JOIN_TIMEOUT_S)
        if restore_sigterm is not None:
            restore_sigterm()
    rl_seconds = time.time() - rl_start
    save(force=True)
    checkpointer.wait_until_finished()
    if interrupted or stop_signal.requested:
        writer.close()
        checkpointer.close()
        if interrupted:
            raise KeyboardInterrupt
        logging.warning("SIGTERM: saved step %d and stopped.", step)
        return {}

    # --- Final evaluation and summary. ---
    accuracy_end = evaluate(state.params)
    all_lags = np.concatenate(lags) if lags else np.zeros(1)
    samples = rates.totals().get("samples", 0)
    summary = {
        "config_name": config.name,
        "variant": config.variant,
        "mode": config.mode,
        "method": config.method,
        "learner_steps": step,
        "samples_generated": history["samples_generated"] + samples,
        "tokens_generated": history["tokens_generated"] + rates.totals().get("tokens", 0),
        "wall_seconds": time.time() - wall_start,
        "warm_start_seconds": history.get("warm_start_seconds", 0.0),
        "rl_seconds": rl_seconds,
        "eval_accuracy_start": history["eval_accuracy_start"],
        "eval_accuracy_end": accuracy_end,
        "max_policy_lag": float(all_lags.max()),
        "mean_policy_lag": float(all_lags.mean()),
        "samples_per_second": samples / max(rl_seconds, 1e-9),
        "tokens_per_second": rates.totals().get("tokens", 0) / max(rl_seconds, 1e-9),
        "learner_steps_per_second": len(lags) / max(rl_seconds, 1e-9),
        "time_split_seconds": time_split.totals(),
        "num_devices": jax.device_count(),
        "colocated": meshes.colocated,
    }
    write_summary(workdir, summary)
    writer.close()
    checkpointer.close()
    logging.info("Summary: %s", json.dumps(summary, sort_keys=True))
    return summary
