"""Post-training losses, registered by name, and β (KL-coefficient) schedules.

Every loss has the signature

    fn(logp, batch, beta) -> (loss, metrics)

- ``logp: [B, K]`` — the *current* policy's log π_θ(y_j|x) summed over response
  tokens (differentiable; everything after the first EOS already masked out).
- ``batch`` — a mapping of arrays, all ``[B, K]`` and summed over response tokens:
  ``logp_ref`` (reference policy), ``reward``, ``logp_behaviour`` (the policy
  that sampled y_j). B prompts, K responses per prompt.
- ``beta`` — the KL coefficient β > 0; a Python float or a traced scalar.
- ``loss`` is a scalar; ``metrics`` maps names to scalars.

Token-level losses (``token_level=True``, e.g. GRPO's clipped per-token ratio) take
``token_logp: [B, K, T]`` instead (0 on padding), and their batch adds
``token_logp_ref``, ``token_logp_behaviour`` and ``response_mask``, each [B, K, T].
A loss's options (e.g. GRPO's clip range) are keyword arguments, set from
``config.loss.<method>``.

All losses are pure ``jnp`` and jit-compatible. See DESIGN.md, "The algorithm".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from numbers import Real
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
Metrics = dict[str, Array]
LossFn = Callable[[Array, Mapping[str, Array], Any], tuple[Array, Metrics]]

# Minimum responses per prompt for a leave-one-out baseline.
_MIN_SAMPLES_FOR_LEAVE_ONE_OUT = 2
_RESPONSE_AXIS = -1

BETA_SCHEDULE_KINDS = ("constant", "linear")


# --------------------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """A registered loss.

    Attributes:
      name: the name the loss is registered under (e.g. ``"tb"``).
      fn: ``fn(logp [B, K], batch, beta) -> (loss scalar, metrics dict of scalars)``.
      on_policy: True if the loss assumes samples from the current policy (e.g. RLOO),
        so an asynchronous / off-policy runtime must not feed it stale samples.
      token_level: True if ``fn`` takes per-token log-probs [B, K, T] (see the module
        docstring) rather than sums [B, K].
      needs_critic: True if the loss reads advantages from a value model (PPO): the
        learner step is `tba_jax.ppo.make_train_step`, which trains the critic too.
      extra_fields: per-token batch fields [B, K, T] the loss reads beyond the usual ones
        (VinePPO's ``token_advantage``, attached to the batch before the learner step).
    """

    name: str
    fn: LossFn
    on_policy: bool
    token_level: bool = False
    needs_critic: bool = False
    extra_fields: tuple[str, ...] = ()


_REGISTRY: dict[str, LossSpec] = {}


def register_loss(
    name: str,
    *,
    on_policy: bool,
    token_level: bool = False,
    needs_critic: bool = False,
    extra_fields: tuple[str, ...] = (),
) -> Callable[[LossFn], LossFn]:
    """Decorator registering a loss function under ``name``; returns the function unchanged."""

    def decorator(fn: LossFn) -> LossFn:
        if name in _REGISTRY:
            raise ValueError(
                f"A loss named {name!r} is already registered; pick another name "
                f"(registered: {registered_losses()})."
            )
        _REGISTRY[name] = LossSpec(name, fn, on_policy, token_level, needs_critic, extra_fields)
        return fn

    return decorator


def get_loss(name: str) -> LossSpec:
    """The ``LossSpec`` registered under ``name``; ValueError listing known names if none."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"Unknown loss {name!r}; registered losses are {registered_losses()}."
        ) from None


def registered_losses() -> list[str]:
    """Names of all registered losses, sorted."""
    return sorted(_REGISTRY)


# --------------------------------------------------------------------------- helpers


def _check_batch(logp: Array, batch: Mapping[str, Array], required: tuple[str, ...]) -> None:
    """Raise ValueError if ``batch`` lacks a required key or a shape differs from ``logp``."""
    if jnp.ndim(logp) != 2:
        raise ValueError(
            f"logp must be [B, K] (prompts × responses per prompt), got shape {jnp.shape(logp)}."
        )
    missing = [key for key in required if key not in batch]
    if missing:
        raise ValueError(
            f"Batch is missing {missing}; this loss needs {list(required)}, "
            f"got keys {sorted(batch)}."
        )
    for key in required:
        if jnp.shape(batch[key]) != jnp.shape(logp):
            raise ValueError(
                f"batch[{key!r}] has shape {jnp.shape(batch[key])} but logp has shape "
                f"{jnp.shape(logp)}; all per-response quantities must be [B, K]."
            )


def _check_beta(beta: Any) -> None:
    """Raise ValueError for a concrete β ≤ 0 (traced β cannot be checked at trace time)."""
    if isinstance(beta, Real) and beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}.")


def _per_prompt_mean(x: Array) -> Array:
    """Mean over the K responses of each prompt. x: [B, K] -> [B, 1]."""
    return jnp.mean(x, axis=_RESPONSE_AXIS, keepdims=True)


def masked_mean(x: Array, mask: Array) -> Array:
    """Mean of `x` over the tokens where `mask` is 1 (0 if there are none)."""
    mask = mask.astype(x.dtype)
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def log_partition_estimate(logp: Array, logp_ref: Array, reward: Array, beta: Any) -> Array:
    """VarGrad estimate of log Z(x), detached from the graph.

    logZ(x) = stopgrad(mean_j [r_j/β − logp_j + logp_ref_j]).

    Args:
      logp, logp_ref, reward: [B, K].
      beta: scalar β > 0.

    Returns:
      logZ: [B, 1].
    """
    return jax.lax.stop_gradient(_per_prompt_mean(reward / beta - logp + logp_ref))


def leave_one_out_baseline(x: Array) -> Array:
    """For each j, the mean of x over the other K−1 responses of its prompt.

    Args:
      x: [B, K] with K ≥ 2.

    Returns:
      baseline: [B, K], baseline[b, j] = mean_{i≠j} x[b, i].
    """
    num_samples = jnp.shape(x)[_RESPONSE_AXIS]
    if num_samples < _MIN_SAMPLES_FOR_LEAVE_ONE_OUT:
        raise ValueError(
            f"A leave-one-out baseline needs K ≥ {_MIN_SAMPLES_FOR_LEAVE_ONE_OUT} responses "
            f"per prompt, got K={num_samples}; sample more responses per prompt."
        )
    total = jnp.sum(x, axis=_RESPONSE_AXIS, keepdims=True)
    return (total - x) / (num_samples - 1)


# --------------------------------------------------------------------------- losses


@register_loss("tb", on_policy=False)
def trajectory_balance_loss(
    logp: Array, batch: Mapping[str, Array], beta: Any
) -> tuple[Array, Metrics]:
    """VarGrad trajectory balance (valid off-policy; no importance weights).

    logZ(x) = stopgrad(mean_j [r_j/β − logp_j + logp_ref_j])
    L       = mean_{x,j} (logZ(x) + logp_j − logp_ref_j − r_j/β)²

    Args:
      logp: [B, K] current-policy summed log-probs (differentiable).
      batch: ``logp_ref``, ``reward``, ``logp_behaviour``, each [B, K].
      beta: scalar β > 0.

    Returns:
      (loss, metrics) with metrics ``loss``, ``logZ_mean``, ``kl_mean`` (mean of
      logp − logp_ref), ``reward_mean``, ``off_policy_gap`` (mean of logp − logp_behaviour).
    """
    _check_batch(logp, batch, ("logp_ref", "reward", "logp_behaviour"))
    _check_beta(beta)
    logp_ref, reward = batch["logp_ref"], batch["reward"]
    log_z = log_partition_estimate(logp, logp_ref, reward, beta)
    residual = log_z + logp - logp_ref - reward / beta
    loss = jnp.mean(jnp.square(residual))
    metrics = {
        "loss": loss,
        "logZ_mean": jnp.mean(log_z),
        "kl_mean": jnp.mean(logp - logp_ref),
        "reward_mean": jnp.mean(reward),
        "off_policy_gap": jnp.mean(logp - batch["logp_behaviour"]),
    }
    return loss, jax.lax.stop_gradient(metrics)


@register_loss("rloo", on_policy=True)
def rloo_loss(logp: Array, batch: Mapping[str, Array], beta: Any) -> tuple[Array, Metrics]:
    """REINFORCE with a leave-one-out baseline and a KL-penalised reward (on-policy).

    R_j = r_j − β·stopgrad(logp_j − logp_ref_j)
    A_j = R_j − mean_{i≠j} R_i
    L   = −mean_{x,j} stopgrad(A_j)·logp_j

    Args:
      logp: [B, K] current-policy summed log-probs (differentiable), K ≥ 2.
      batch: ``logp_ref``, ``reward``, each [B, K].
      beta: scalar β > 0.

    Returns:
      (loss, metrics) with metrics ``loss``, ``kl_mean``, ``reward_mean``,
      ``advantage_std`` (population std of A over all B·K responses).
    """
    _check_batch(logp, batch, ("logp_ref", "reward"))
    _check_beta(beta)
    logp_ref, reward = batch["logp_ref"], batch["reward"]
    kl = jax.lax.stop_gradient(logp - logp_ref)
    penalised_reward = reward - beta * kl
    advantage = jax.lax.stop_gradient(penalised_reward - leave_one_out_baseline(penalised_reward))
    loss = -jnp.mean(advantage * logp)
    metrics = {
        "loss": loss,
        "kl_mean": jnp.mean(kl),
        "reward_mean": jnp.mean(reward),
        "advantage_std": jnp.std(advantage),
    }
    return loss, jax.lax.stop_gradient(metrics)


@register_loss("online_dpo", on_policy=False)
def online_dpo_loss(logp: Array, batch: Mapping[str, Array], beta: Any) -> tuple[Array, Metrics]:
    """Online DPO: each prompt's best and worst response by reward form a preference pair.

    w = argmax_j r_j, l = argmin_j r_j (the first on ties), h_j = logp_j − logp_ref_j
    L = −mean over prompts with r_w > r_l of log σ(β·(h_w − h_l))

    Prompts whose K rewards are all equal give no pair and no gradient. It is valid on any
    pair's samples (the loss has no behaviour policy), so it runs in async mode as well:
    the asynchronous online DPO of Noukhovitch et al. (2024).

    Args:
      logp: [B, K] current-policy summed log-probs (differentiable), K ≥ 2.
      batch: ``logp_ref``, ``reward``, each [B, K].
      beta: scalar β > 0 (DPO's β: the strength of the pull towards π_ref).

    Returns:
      (loss, metrics) with metrics ``loss``, ``kl_mean``, ``reward_mean``,
      ``pair_fraction`` (the share of prompts that gave a pair), ``reward_margin`` (mean
      r_w − r_l over pairs), ``preference_accuracy`` (the share of pairs with h_w > h_l).
    """
    _check_batch(logp, batch, ("logp_ref", "reward"))
    _check_beta(beta)
    if jnp.shape(logp)[_RESPONSE_AXIS] < _MIN_SAMPLES_FOR_LEAVE_ONE_OUT:
        raise ValueError(
            f"Online DPO pairs two of a prompt's responses; got K={jnp.shape(logp)[-1]}. "
            "Sample at least 2 responses per prompt."
        )
    reward = batch["reward"]
    log_ratio = logp - batch["logp_ref"]

    def pick(x: Array, index: Array) -> Array:  # x[b, index[b]]: [B]
        return jnp.take_along_axis(x, index[:, None], axis=_RESPONSE_AXIS)[:, 0]

    best = jnp.argmax(reward, axis=_RESPONSE_AXIS)
    worst = jnp.argmin(reward, axis=_RESPONSE_AXIS)
    reward_margin = pick(reward, best) - pick(reward, worst)
    is_pair = (reward_margin > 0).astype(log_ratio.dtype)
    num_pairs = jnp.sum(is_pair)
    log_ratio_margin = pick(log_ratio, best) - pick(log_ratio, worst)
    pair_losses = -jax.nn.log_sigmoid(beta * log_ratio_margin)
    loss = jnp.sum(is_pair * pair_losses) / jnp.maximum(num_pairs, 1.0)

    def pair_mean(x: Array) -> Array:
        return jnp.sum(is_pair * x) / jnp.maximum(num_pairs, 1.0)

    metrics = {
        "loss": loss,
        "kl_mean": jnp.mean(jax.lax.stop_gradient(log_ratio)),
        "reward_mean": jnp.mean(reward),
        "pair_fraction": jnp.mean(is_pair),
        "reward_margin": pair_mean(reward_margin),
        "preference_accuracy": pair_mean((log_ratio_margin > 0).astype(log_ratio.dtype)),
    }
    return loss, jax.lax.stop_gradient(metrics)


GRPO_AGGREGATIONS = ("token", "sequence")


def group_normalised_advantages(reward: Array, scale: bool, std_eps: float) -> Array:
    """GRPO's advantages: (r_j − mean_K r) / (std_K r + std_eps), or without the division
    when `scale` is False. reward: [B, K] → [B, K], detached."""
    centred = reward - _per_prompt_mean(reward)
    if scale:
        centred = centred / (jnp.std(reward, axis=_RESPONSE_AXIS, keepdims=True) + std_eps)
    return jax.lax.stop_gradient(centred)


@register_loss("grpo", on_policy=False, token_level=True)
def grpo_loss(
    token_logp: Array,
    batch: Mapping[str, Array],
    beta: Any,
    *,
    clip_epsilon: float = 0.2,
    scale_rewards: bool = True,
    aggregation: str = "token",
    std_eps: float = 1e-4,
) -> tuple[Array, Metrics]:
    """GRPO (Shao et al. 2024): group-normalised advantages, a clipped ratio to the
    behaviour policy and the k3 KL estimator to π_ref, per token.

    A_j   = (r_j − mean_K r) / (std_K r + std_eps)          (no division: scale_rewards=False)
    ρ_t   = exp(log π_θ(y_t) − log π_behaviour(y_t))
    KL_t  = exp(log π_ref(y_t) − log π_θ(y_t)) − (log π_ref(y_t) − log π_θ(y_t)) − 1
    ℓ_t   = −min(ρ_t A_j, clip(ρ_t, 1 − ε, 1 + ε) A_j) + β KL_t
    L     = Σ_t ℓ_t / (number of response tokens in the batch)    (aggregation="token")
          = mean_j [ Σ_t ℓ_t / |y_j| ]                            (aggregation="sequence")

    π_behaviour is the policy that sampled the batch: the old policy of PPO's ratio (sync:
    the params of this step, so ρ = 1 with its gradient; async: older params, and the clip
    bounds their update).

    Args:
      token_logp: [B, K, T] current-policy per-token log-probs, 0 on padding.
      batch: ``reward`` [B, K]; ``token_logp_ref``, ``token_logp_behaviour``,
        ``response_mask`` [B, K, T].
      beta: the KL coefficient β > 0.

    Returns:
      (loss, metrics) with ``loss``, ``kl_mean`` (the per-token k3 KL's mean),
      ``reward_mean``, ``clip_fraction`` (the share of tokens whose ratio was clipped),
      ``ratio_mean``, ``advantage_std``.
    """
    required = ("reward", "token_logp_ref", "token_logp_behaviour", "response_mask")
    missing = [key for key in required if key not in batch]
    if missing:
        raise ValueError(f"Batch is missing {missing}; GRPO needs {list(required)}.")
    if jnp.ndim(token_logp) != 3 or jnp.shape(batch["reward"]) != jnp.shape(token_logp)[:2]:
        raise ValueError(
            f"token_logp must be [B, K, T] and reward [B, K]; got {jnp.shape(token_logp)} "
            f"and {jnp.shape(batch['reward'])}."
        )
    advantage = group_normalised_advantages(batch["reward"], scale_rewards, std_eps)[..., None]
    return clipped_token_loss(token_logp, batch, beta, advantage, clip_epsilon, aggregation)


def clipped_token_loss(
    token_logp: Array,
    batch: Mapping[str, Array],
    beta: Any,
    advantage: Array,
    clip_epsilon: float,
    aggregation: str,
) -> tuple[Array, Metrics]:
    """The per-token clipped surrogate plus β times the k3 KL to π_ref, aggregated over
    tokens (GRPO's and VinePPO's loss; see `grpo_loss`). advantage: [B, K, 1] (one per
    response) or [B, K, T] (one per token)."""
    _check_beta(beta)
    if aggregation not in GRPO_AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r} is not one of {GRPO_AGGREGATIONS}.")
    if clip_epsilon <= 0:
        raise ValueError(f"clip_epsilon={clip_epsilon} must be > 0.")
    mask = batch["response_mask"].astype(token_logp.dtype)
    ratio = jnp.exp(token_logp - batch["token_logp_behaviour"])
    surrogate, _ = clipped_surrogate(ratio, advantage, clip_epsilon)
    ref_minus_policy = batch["token_logp_ref"] - token_logp
    kl = jnp.exp(ref_minus_policy) - ref_minus_policy - 1.0
    per_token = (beta * kl - surrogate) * mask
    if aggregation == "token":
        loss = masked_mean(per_token, mask)
    else:
        lengths = jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
        loss = jnp.mean(jnp.sum(per_token, axis=-1) / lengths)
    metrics = {
        "loss": loss,
        "kl_mean": masked_mean(kl, mask),
        "reward_mean": jnp.mean(batch["reward"]),
        "clip_fraction": masked_mean(
            (jnp.abs(ratio - 1.0) > clip_epsilon).astype(mask.dtype), mask
        ),
        "ratio_mean": masked_mean(ratio, mask),
        "advantage_std": (
            jnp.std(advantage)  # one per response
            if advantage.shape[-1] == 1
            else jnp.sqrt(masked_mean((advantage - masked_mean(advantage, mask)) ** 2, mask))
        ),
    }
    return loss, jax.lax.stop_gradient(metrics)


@register_loss("vineppo", on_policy=False, token_level=True, extra_fields=("token_advantage",))
def vineppo_loss(
    token_logp: Array,
    batch: Mapping[str, Array],
    beta: Any,
    *,
    clip_epsilon: float = 0.2,
    aggregation: str = "token",
    **rollout_options,
) -> tuple[Array, Metrics]:
    """VinePPO's loss (`tba_jax.vineppo`): `clipped_token_loss` with the per-token
    advantages ``token_advantage`` [B, K, T] from Monte Carlo values at step boundaries;
    the batch is otherwise GRPO's. `rollout_options` (config.loss.vineppo's rollout knobs)
    are read by the value stage, not here."""
    del rollout_options
    advantage = jax.lax.stop_gradient(batch["token_advantage"])
    return clipped_token_loss(token_logp, batch, beta, advantage, clip_epsilon, aggregation)


def clipped_surrogate(ratio: Array, advantage: Array, clip_epsilon: float) -> tuple[Array, Array]:
    """PPO's per-token objective min(ρ A, clip(ρ, 1 ± ε) A) (to maximise), and where the
    clipped term is the smaller (its gradient is then 0). Shapes broadcast."""
    unclipped = ratio * advantage
    clipped = jnp.clip(ratio, 1.0 - clip_epsilon, 1.0 + clip_epsilon) * advantage
    return jnp.minimum(unclipped, clipped), clipped < unclipped


def clipped_policy_loss(
    token_logp: Array, token_logp_old: Array, advantages: Array, mask: Array, clip_epsilon: float
) -> tuple[Array, dict[str, Array]]:
    """PPO's clipped surrogate, mean over tokens: max(−A ρ, −A clip(ρ, 1 ± ε)) with
    ρ = exp(log π_θ − log π_old). All [N, T]. Returns (loss, metrics)."""
    log_ratio = token_logp - token_logp_old
    ratio = jnp.exp(log_ratio)
    surrogate, clipped = clipped_surrogate(ratio, advantages, clip_epsilon)
    loss = masked_mean(-surrogate, mask)
    metrics = {
        "pg_loss": loss,
        "clip_fraction": masked_mean(clipped.astype(jnp.float32), mask),
        "approx_kl": masked_mean(0.5 * log_ratio**2, mask),
        "ratio_mean": masked_mean(ratio, mask),
    }
    return loss, jax.lax.stop_gradient(metrics)


@register_loss("ppo", on_policy=False, token_level=True, needs_critic=True)
def ppo_actor_loss(
    token_logp: Array, batch: Mapping[str, Array], beta: Any, *, clip_epsilon: float = 0.2, **_
) -> tuple[Array, dict[str, Array]]:
    """The actor's loss in the registry's token-level form: `clipped_policy_loss` of
    `token_logp` [..., T] against batch ``token_logp_behaviour`` with batch ``advantages``
    (from the critic: `make_train_step` prepares them) and ``response_mask``. β enters
    PPO through the rewards, not here."""
    del beta
    return clipped_policy_loss(
        token_logp,
        batch["token_logp_behaviour"],
        batch["advantages"],
        batch["response_mask"],
        clip_epsilon,
    )


# --------------------------------------------------------------------------- β schedules


def make_beta_schedule(
    kind: str, beta_start: float, beta_end: float, anneal_steps: int, cut_steps: int = 0
) -> Callable[[Any], Array]:
    """A β schedule: a pure, jnp-traceable function of the (possibly traced) step.

    Args:
      kind: ``"constant"`` (β = beta_start always; beta_end and anneal_steps ignored) or
        ``"linear"`` (β_start at step 0 to β_end at step ``anneal_steps``, constant after;
        steps below 0 give β_start).
      beta_start: β at step 0, > 0.
      beta_end: β from step ``anneal_steps`` on, > 0 (used by ``"linear"`` only).
      anneal_steps: steps to anneal over, > 0 (used by ``"linear"`` only).
      cut_steps: ``"linear"`` only; > 0: β jumps to β_end at step ``cut_steps − 1`` (the
        ``cut_steps``-th update), wherever the anneal has got to: the TBA authors' rule
        (their "stop" iteration; TL;DR anneals as if over 128 updates but cuts at 32).
        0: no cut.

    Returns:
      schedule: step (int scalar or array) -> β (float array of the step's shape).
    """
    if kind not in BETA_SCHEDULE_KINDS:
        raise ValueError(f"Unknown beta schedule kind {kind!r}; use one of {BETA_SCHEDULE_KINDS}.")
    if beta_start <= 0:
        raise ValueError(f"beta_start must be > 0, got {beta_start}.")

    if kind == "constant":

        def constant_schedule(step: Any) -> Array:
            return jnp.full(jnp.shape(step), beta_start, dtype=jnp.result_type(float))

        return constant_schedule

    if beta_end <= 0:
        raise ValueError(f"beta_end must be > 0 for a linear beta schedule, got {beta_end}.")
    if anneal_steps <= 0:
        raise ValueError(
            f"anneal_steps must be > 0 for a linear beta schedule, got {anneal_steps}; "
            f"use kind='constant' for a fixed beta."
        )

    if cut_steps < 0:
        raise ValueError(f"cut_steps must be >= 0 (0: no cut), got {cut_steps}.")

    def linear_schedule(step: Any) -> Array:
        step = jnp.asarray(step)
        fraction = jnp.clip(step / anneal_steps, 0.0, 1.0)
        beta = beta_start + (beta_end - beta_start) * fraction
        if cut_steps:
            beta = jnp.where(step >= cut_steps - 1, beta_end, beta)
        return beta

    return linear_schedule
