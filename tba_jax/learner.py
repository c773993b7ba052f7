"""Learner: train state, optimiser and schedules, the jitted sharded train step.

The train step takes a batch of B prompts × K responses (rows prompt-major,
as `trajectories.SampledBatch` lays them out), recomputes the current policy's
log-probs, and applies a registered loss (`tba_jax.losses`). Micro-batches
hold whole prompt groups, since TB's logZ is a per-prompt quantity; their
gradients are averaged with a `lax.scan`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from tba_jax import losses
from tba_jax import mesh as mesh_lib
from tba_jax.losses import LossSpec
from tba_jax.models import Model, Params, params_in_compute_dtype
from tba_jax.sampling.scoring import batch_token_logprobs

# Fields of a sampled batch the train step reads. [N, ...] with N = B*K.
BATCH_FIELDS = (
    "prompt_tokens",
    "prompt_mask",
    "response_tokens",
    "response_mask",
    "reward",
    "logp_ref",
    "logp_behaviour",
)
# What a token-level loss (GRPO) reads besides: [N, T] each.
TOKEN_FIELDS = ("token_logp_ref", "token_logp_behaviour")


def batch_fields(loss: LossSpec) -> tuple[str, ...]:
    """The fields of a sampled batch the train step of `loss` reads."""
    if not loss.token_level:
        return BATCH_FIELDS + loss.extra_fields
    return BATCH_FIELDS + TOKEN_FIELDS + loss.extra_fields


class TrainState(NamedTuple):
    """The learner's state: the policy's params, its optimiser state, the learner step,
    and (PPO, `tba_jax.ppo`) the critic's own TrainState; None for critic-free methods."""

    params: Params
    opt_state: Any
    step: jax.Array
    critic: TrainState | None = None


def state_items(state: TrainState) -> dict[str, Any]:
    """The policy's part of `state` as the checkpoint's "train" item (the critic is an
    item of its own, so critic-free runs keep the layout they always had)."""
    return {"params": state.params, "opt_state": state.opt_state, "step": state.step}


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float
    schedule: str = "constant"  # constant | linear | wsd
    warmup_steps: int = 0
    total_steps: int = 1
    decay_fraction: float = 0.1  # wsd: the final fraction of steps spent decaying
    end_lr_fraction: float = 0.0  # linear / wsd: final lr as a fraction of the peak
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip_norm: float = 0.0  # 0: no clipping


def make_lr_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Warmup (linear from 0) followed by constant, linear decay, or warmup-stable-decay."""
    if cfg.warmup_steps < 0 or cfg.total_steps <= 0:
        raise ValueError(
            f"optim.warmup_steps={cfg.warmup_steps} must be >= 0 and "
            f"optim.total_steps={cfg.total_steps} > 0."
        )
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.end_lr_fraction
    warmup = optax.linear_schedule(0.0, peak, max(cfg.warmup_steps, 1))
    after_warmup = max(cfg.total_steps - cfg.warmup_steps, 1)
    if cfg.schedule == "constant":
        main = optax.constant_schedule(peak)
    elif cfg.schedule == "linear":
        main = optax.linear_schedule(peak, end, after_warmup)
    elif cfg.schedule == "wsd":
        if not 0.0 <= cfg.decay_fraction <= 1.0:
            raise ValueError(f"optim.decay_fraction={cfg.decay_fraction} must be in [0, 1].")
        decay_steps = max(round(cfg.decay_fraction * cfg.total_steps), 1)
        stable_steps = max(after_warmup - decay_steps, 0)
        main = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, end, decay_steps)],
            [stable_steps],
        )
    else:
        raise ValueError(
            f"optim.schedule={cfg.schedule!r} is not one of 'constant', 'linear', 'wsd'."
        )
    if cfg.warmup_steps == 0:
        return main
    return optax.join_schedules([warmup, main], [cfg.warmup_steps])


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """AdamW on the schedule, with optional global-norm clipping first."""
    adamw = optax.adamw(
        make_lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    if cfg.grad_clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw)
    return adamw


def train_state_shardings(
    optimizer: optax.GradientTransformation,
    abstract_params: Params,
    param_shardings: Any,
    mesh: jax.sharding.Mesh,
) -> TrainState:
    """Shardings of every train-state leaf: optimiser moments follow their params,
    scalars (step, counts) are replicated."""
    replicated = mesh_lib.replicated(mesh)
    abstract_opt_state = jax.eval_shape(optimizer.init, abstract_params)
    opt_shardings = optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        abstract_opt_state,
        param_shardings,
        transform_non_params=lambda _: replicated,
    )
    return TrainState(param_shardings, opt_shardings, replicated)


def abstract_train_state(
    optimizer: optax.GradientTransformation, abstract_params: Params, shardings: TrainState
) -> TrainState:
    """ShapeDtypeStructs with shardings: a restore target that allocates nothing."""
    shapes = TrainState(
        abstract_params,
        jax.eval_shape(optimizer.init, abstract_params),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    return mesh_lib.abstract_on(shapes, shardings)


def init_train_state(
    params: Params, optimizer: optax.GradientTransformation, shardings: TrainState
) -> TrainState:
    """Places (a copy of) params on the learner shardings and initialises the optimiser there."""
    params = jax.device_put(params, shardings.params, may_alias=False)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
    step = jax.jit(lambda: jnp.zeros((), jnp.int32), out_shardings=shardings.step)()
    return TrainState(params, opt_state, step)


def one_device_shardings(
    model: Model,
    abstract_params: Params,
    optimizer: optax.GradientTransformation,
    device: jax.Device | None = None,
) -> tuple[TrainState, jax.sharding.Mesh]:
    """(train-state shardings, the mesh) of a one-device learner mesh over `device` (the
    default device if None; a compile-only device works too)."""
    mesh = mesh_lib.make_mesh([device or jax.devices()[0]], {})
    shardings = mesh_lib.param_shardings(model.logical_axes, abstract_params, mesh, [])
    return train_state_shardings(optimizer, abstract_params, shardings, mesh), mesh


def one_device_train_state(
    model: Model, params: Params, optimizer: optax.GradientTransformation
) -> tuple[TrainState, TrainState, jax.sharding.Mesh]:
    """(train state, its shardings, the mesh) of `params` on a one-device learner mesh
    (the default device): what a test, a benchmark or a notebook trains with."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    state_sharding, mesh = one_device_shardings(model, abstract, optimizer)
    return init_train_state(params, optimizer, state_sharding), state_sharding, mesh


def constant_beta_tb_step(
    model: Model,
    optimizer: optax.GradientTransformation,
    state_sharding: TrainState,
    mesh: jax.sharding.Mesh,
    *,
    beta: float,
    samples_per_prompt: int,
    num_microbatches: int,
    temperature: float,
):
    """`make_train_step` with the TB loss at a constant β: the step benchmarks time,
    profile and compile."""
    return make_train_step(
        model,
        losses.get_loss("tb"),
        optimizer,
        losses.make_beta_schedule("constant", beta, beta, 1),
        samples_per_prompt=samples_per_prompt,
        num_microbatches=num_microbatches,
        temperature=temperature,
        state_sharding=state_sharding,
        mesh=mesh,
    )


def sequence_logp(
    model: Model, params: Params, batch: Mapping[str, jax.Array], temperature: float
) -> jax.Array:
    """Summed response log-probs under `params`. Returns [N]."""
    token_logp = batch_token_logprobs(model, params, batch, temperature=temperature)
    return token_logp.sum(axis=-1)


def _group(x: jax.Array, k: int) -> jax.Array:
    """[N, ...] → [N/K, K, ...]: one row per prompt group."""
    return x.reshape((x.shape[0] // k, k, *x.shape[1:]))


def split_microbatches(
    batch: Mapping[str, jax.Array],
    fields: tuple[str, ...],
    num_microbatches: int,
    mesh: jax.sharding.Mesh,
) -> dict[str, jax.Array]:
    """`batch[name]` [N, ...] → [num_microbatches, N / num_microbatches, ...] for each field,
    each micro-batch split over the mesh's batch axes."""
    split = {
        name: batch[name].reshape((num_microbatches, -1, *batch[name].shape[1:])) for name in fields
    }
    return jax.lax.with_sharding_constraint(
        split, NamedSharding(mesh, PartitionSpec(None, mesh_lib.BATCH_AXES))
    )


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every leaf of `tree` is finite: a bool scalar."""
    leaves = [jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(tree)]
    return jnp.stack(leaves).all() if leaves else jnp.array(True)


def accumulated_update(
    state: TrainState,
    micro_batches: Mapping[str, jax.Array],
    grad_fn: Callable,
    optimizer: optax.GradientTransformation,
    num_microbatches: int,
    params_for_grad: Callable[[Params], Params] | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimiser step on the gradient averaged over micro-batches (a `lax.scan`).

    `grad_fn(params, micro) -> ((loss, metrics), grads)`, e.g. `jax.value_and_grad(...,
    has_aux=True)`. Returns the new state and the metrics averaged over micro-batches,
    plus `grad_norm` (of the averaged gradient) and `skipped_nonfinite`.

    With `params_for_grad`, `grad_fn` gets `params_for_grad(state.params)`, computed once
    before the scan (the weights cast to the compute dtype: `models.params_in_compute_dtype`
    with `for_gradients`, whose gradients, added to the float32 sum, are the float32
    params' exactly), where each micro-batch would otherwise convert them again.

    A step whose loss, gradient or updated params hold a NaN or an infinity is skipped:
    params and optimiser state stay as they were (the step counter still advances) and
    `skipped_nonfinite` is 1, so a bad batch never reaches the params or a checkpoint.
    """

    params = state.params if params_for_grad is None else params_for_grad(state.params)

    def accumulate(grads_sum, micro):
        (loss, metrics), grads = grad_fn(params, micro)
        return jax.tree.map(jnp.add, grads_sum, grads), (loss, metrics)

    zero_grads = jax.tree.map(jnp.zeros_like, state.params)
    grads_sum, (losses, metrics) = jax.lax.scan(accumulate, zero_grads, micro_batches)
    grads = jax.tree.map(lambda g: g / num_microbatches, grads_sum)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree_utils.tree_norm(grads)
    finite = jnp.isfinite(losses).all() & jnp.isfinite(grad_norm) & all_finite(params)
    params, opt_state = jax.lax.cond(
        finite,
        lambda: (params, opt_state),
        lambda: (state.params, state.opt_state),
    )
    metrics = jax.tree.map(jnp.mean, metrics)
    metrics["grad_norm"] = grad_norm
    metrics["skipped_nonfinite"] = 1.0 - finite.astype(jnp.float32)
    return TrainState(params, opt_state, state.step + 1), metrics


def make_train_step(
    model: Model,
    loss: LossSpec,
    optimizer: optax.GradientTransformation,
    beta_schedule: Callable[[jax.Array], jax.Array],
    *,
    samples_per_prompt: int,
    num_microbatches: int,
    temperature: float,
    state_sharding: Any,
    mesh: jax.sharding.Mesh,
    loss_options: Mapping[str, Any] | None = None,
):
    """Builds the jitted `(state, batch) -> (state, metrics)` for the learner mesh.

    batch: dict of `batch_fields(loss)` arrays with leading dim N = B*K, sharded over the
    mesh's batch axes. The state is donated. `loss_options` are the loss's keyword
    options (`config.loss.<method>`).
    """
    k = samples_per_prompt
    fields = batch_fields(loss)
    loss_fn = functools.partial(loss.fn, **(loss_options or {}))
    grouped_fields = ("reward", "logp_ref", "logp_behaviour")
    if loss.token_level:
        grouped_fields += ("response_mask", *TOKEN_FIELDS)
    grouped_fields += loss.extra_fields

    def microbatch_loss(params, micro, beta):
        token_logp = batch_token_logprobs(model, params, micro, temperature=temperature)
        logp = token_logp if loss.token_level else token_logp.sum(axis=-1)
        grouped = {name: _group(micro[name], k) for name in grouped_fields}
        return loss_fn(_group(logp, k), grouped, beta)

    grad_fn = jax.value_and_grad(microbatch_loss, has_aux=True)

    def train_step(state: TrainState, batch: Mapping[str, jax.Array]):
        beta = beta_schedule(state.step)
        micro_batches = split_microbatches(batch, fields, num_microbatches, mesh)
        state, metrics = accumulated_update(
            state,
            micro_batches,
            lambda params, micro: grad_fn(params, micro, beta),
            optimizer,
            num_microbatches,
            params_for_grad=functools.partial(
                params_in_compute_dtype, model.config, for_gradients=True
            ),
        )
        metrics["beta"] = beta
        return state, metrics

    return mesh_lib.jit_on_mesh(
        train_step,
        in_shardings=(state_sharding, mesh_lib.batch_sharding(mesh)),
        out_shardings=(state_sharding, mesh_lib.replicated(mesh)),
        donate_argnums=(0,),
    )
