"""Supervised warm start: teacher-forced cross-entropy on worked solutions.

The warm-started model is the starting policy and the reference policy of
the RL run. It is trained on the learner mesh with the same scoring code the
TB loss uses (temperature 1).

It can stop between steps (`should_stop`) and go on later from a `WarmStartProgress`
(params, optimiser state, steps done and the batch sampler's state), which
`WarmStartCheckpoint` keeps in `workdir/warm_start/` until the run's first checkpoint
supersedes it, so a preempted warm start is never redone from scratch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from tba_jax import mesh as mesh_lib
from tba_jax.checkpoint import restore_pytree, save_pytree
from tba_jax.config_lib import ConfigError
from tba_jax.learner import OptimConfig, TrainState, make_optimizer, train_state_shardings
from tba_jax.metrics import write_json_atomically
from tba_jax.models import Model, Params
from tba_jax.models.tokenizers import Tokenizer
from tba_jax.sampling.scoring import batch_token_logprobs


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
    steps: int
    batch_size: int
    learning_rate: float
    warmup_steps: int


class WarmStartProgress(NamedTuple):
    """How far a warm start got: params and optimiser state after `steps_done` steps, and
    the state of the generator that draws its batches (`np.random.Generator` bit state)."""

    params: Params
    opt_state: Any
    steps_done: int
    rng_state: dict


def warm_start_optimizer(cfg: WarmStartConfig) -> optax.GradientTransformation:
    """AdamW with a linear warmup and a linear decay to 0 over `cfg.steps`."""
    return make_optimizer(
        OptimConfig(
            learning_rate=cfg.learning_rate,
            schedule="linear",
            warmup_steps=cfg.warmup_steps,
            total_steps=cfg.steps,
        )
    )


def encode_pairs(
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    responses: Sequence[str],
    max_prompt_len: int,
    max_response_len: int,
) -> dict[str, np.ndarray]:
    """Prompt/response texts → left-padded prompts and EOS-terminated right-padded responses."""
    prompt_tokens, prompt_mask = tokenizer.encode_prompts(prompts, max_prompt_len)
    response_tokens = np.full((len(responses), max_response_len), tokenizer.pad_id, np.int32)
    response_mask = np.zeros((len(responses), max_response_len), np.float32)
    for row, text in enumerate(responses):
        ids = [*tokenizer.encode(text), tokenizer.eos_id]
        if len(ids) > max_response_len:
            raise ValueError(
                f"Response {text!r} is {len(ids)} tokens with EOS, more than "
                f"max_response_len={max_response_len}; raise max_response_len."
            )
        response_tokens[row, : len(ids)] = ids
        response_mask[row, : len(ids)] = 1.0
    return {
        "prompt_tokens": prompt_tokens,
        "prompt_mask": prompt_mask,
        "response_tokens": response_tokens,
        "response_mask": response_mask,
    }


def warm_start_shardings(
    optimizer: optax.GradientTransformation, params: Params, mesh
) -> TrainState:
    """Where the warm start keeps its params and optimiser state on `mesh`: each param
    where the caller placed it on `mesh` (replicated there when it is elsewhere), its
    optimiser moments alike, scalars replicated (`learner.train_state_shardings`)."""

    def on_mesh(leaf) -> jax.sharding.Sharding:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh == mesh:
            return sharding
        return mesh_lib.replicated(mesh)

    abstract_params = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), params
    )
    return train_state_shardings(optimizer, abstract_params, jax.tree.map(on_mesh, params), mesh)


def make_supervised_step(
    model: Model, optimizer: optax.GradientTransformation, mesh, shardings: TrainState
):
    """Jitted `(params, opt_state, batch) -> (params, opt_state, loss)`: mean token NLL.
    Params and optimiser state come in and go out on `shardings`, so every step runs the
    one program (inputs placed otherwise than a step's outputs would compile another)."""

    def loss_fn(params, batch):
        logp = batch_token_logprobs(model, params, batch, temperature=1.0)
        return -logp.sum() / batch["response_mask"].sum()

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return mesh_lib.jit_on_mesh(
        step,
        in_shardings=(shardings.params, shardings.opt_state, mesh_lib.batch_sharding(mesh)),
        out_shardings=(shardings.params, shardings.opt_state, mesh_lib.replicated(mesh)),
        donate_argnums=(0, 1),
    )


def check_warm_start_data(examples: Sequence[dict], cfg: WarmStartConfig) -> None:
    """ConfigError when a warm start of `cfg.steps` > 0 cannot draw its batches: fewer
    examples than `cfg.batch_size` (each batch holds distinct examples), or examples
    without a `solution`. Cheap: run it before any long work."""
    if cfg.steps <= 0:
        return
    if len(examples) < cfg.batch_size:
        raise ConfigError(
            f"warm_start.batch_size={cfg.batch_size} is more than the {len(examples)} training "
            "examples (a batch holds distinct examples); lower warm_start.batch_size or give "
            "the task more data."
        )
    if any("solution" not in example for example in examples):
        raise ConfigError(
            "This task's examples have no `solution` to warm-start on; set warm_start.steps=0 "
            "(e.g. when model.hf_path is already a supervised checkpoint)."
        )


def warm_start(
    model: Model,
    params: Params,
    examples: Sequence[dict],
    tokenizer: Tokenizer,
    cfg: WarmStartConfig,
    *,
    max_prompt_len: int,
    max_response_len: int,
    mesh,
    seed: int,
    log_fn=None,
    progress: WarmStartProgress | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> WarmStartProgress:
    """Trains `params` on (prompt, solution) pairs up to `cfg.steps` steps, going on from
    `progress` when given; stops early (between steps) once `should_stop()` is true.
    Finished when the result's `steps_done == cfg.steps`."""
    check_warm_start_data(examples, cfg)
    optimizer = warm_start_optimizer(cfg)
    data = encode_pairs(
        tokenizer,
        [ex["prompt"] for ex in examples],
        [ex["solution"] for ex in examples],
        max_prompt_len,
        max_response_len,
    )
    rng = np.random.default_rng(seed)
    shardings = warm_start_shardings(optimizer, params, mesh)
    if progress is None:
        # a copy: the steps donate their inputs, and the caller keeps its own buffers
        params = jax.device_put(params, shardings.params, may_alias=False)
        opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
        first_step = 0
    else:
        params = jax.device_put(progress.params, shardings.params)
        opt_state = jax.device_put(progress.opt_state, shardings.opt_state)
        first_step = progress.steps_done
        rng.bit_generator.state = progress.rng_state
    step_fn = make_supervised_step(model, optimizer, mesh, shardings)
    step = first_step
    while step < cfg.steps and not should_stop():
        rows = rng.choice(len(examples), size=cfg.batch_size, replace=False)
        batch = {name: array[rows] for name, array in data.items()}
        batch = mesh_lib.from_identical_host_data(batch, mesh_lib.batch_sharding(mesh))
        params, opt_state, loss = step_fn(params, opt_state, batch)
        if log_fn is not None:
            log_fn(step, {"warm_start_loss": loss})
        step += 1
    return WarmStartProgress(params, opt_state, step, rng.bit_generator.state)


class WarmStartCheckpoint:
    """An unfinished warm start's progress in `directory`: each save is a new folder
    `<steps_done>` plus `progress.json` naming it (written last), so a save that dies
    half-way leaves the previous one readable."""

    PROGRESS_FILENAME = "progress.json"

    def __init__(self, directory: str):
        self.directory = directory

    def _progress_path(self) -> str:
        return os.path.join(self.directory, self.PROGRESS_FILENAME)

    def exists(self) -> bool:
        return os.path.exists(self._progress_path())

    def steps_saved(self) -> int | None:
        """The warm-start step the saved progress reached, or None when none is saved."""
        return self._record()["steps_done"] if self.exists() else None

    def _record(self) -> dict:
        with open(self._progress_path()) as f:
            return json.load(f)

    def save(
        self, progress: WarmStartProgress, seconds: dict[str, float], settings: dict[str, Any]
    ) -> None:
        """Saves `progress`, `seconds` (the run's times up to this stop, warm start and wall:
        `seconds_so_far` gives them back to the segment that goes on) and `settings` (the
        config's warm_start section it was made with: `saved_settings`)."""
        extras = {"seconds": seconds, "settings": settings}
        if self.steps_saved() == progress.steps_done:  # stopped again before another step
            write_json_atomically(self._progress_path(), {**self._record(), **extras})
            return
        state_dir = os.path.join(self.directory, str(progress.steps_done))
        if os.path.exists(state_dir):  # a stale, half-written folder no record names
            shutil.rmtree(state_dir)
        save_pytree(state_dir, {"params": progress.params, "opt_state": progress.opt_state})
        record = {"steps_done": progress.steps_done, "rng_state": progress.rng_state, **extras}
        write_json_atomically(self._progress_path(), record)
        for name in os.listdir(self.directory):  # older saves are superseded
            if name.isdigit() and int(name) != progress.steps_done:
                shutil.rmtree(os.path.join(self.directory, name))

    def seconds_so_far(self) -> dict[str, float]:
        """The times `save` was given (empty when nothing, or a save from before they were
        kept, is saved)."""
        return self._record().get("seconds", {}) if self.exists() else {}

    def saved_settings(self) -> dict[str, Any] | None:
        """The warm_start settings the saved progress was made with (None: nothing saved,
        or a save from before they were kept)."""
        return self._record().get("settings") if self.exists() else None

    def restore(self, params_template: Params, opt_state_template: Any) -> WarmStartProgress:
        """The saved progress, on the shardings of the templates (sharded ShapeDtypeStructs
        of the params and of the warm-start optimiser's state)."""
        record = self._record()
        template = {"params": params_template, "opt_state": opt_state_template}
        state_dir = os.path.join(self.directory, str(record["steps_done"]))
        restored = restore_pytree(state_dir, template)
        return WarmStartProgress(
            restored["params"], restored["opt_state"], record["steps_done"], record["rng_state"]
        )

    def clear(self) -> None:
        """Removes the progress once the run's first checkpoint holds the finished warm start."""
        shutil.rmtree(self.directory, ignore_errors=True)
