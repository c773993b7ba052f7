"""PPO with a critic (Schulman et al. 2017), as the RLHF recipes run it (Huang et al.
2024, "The N+ implementation details of RLHF with PPO"), and RLHFuse's fused actor–critic
step.

One learner step on a batch of N responses:

1. **Prepare** (no gradients): the critic's values V_old [N, T] before this step;
   per-token rewards r_t = −β (log π_behaviour(y_t) − log π_ref(y_t)), plus the task's
   reward on the last response token; GAE advantages and returns (γ, λ); advantages
   whitened over the batch's tokens.
2. **Update**: `epochs` passes over the batch in a fresh random order, each split into
   `minibatches` optimiser updates (each averaged over `batch.num_microbatches`
   micro-batches). The actor minimises the clipped surrogate with the ratio to the
   behaviour policy (the policy that sampled the batch: the old policy of PPO; older
   params in async mode, bounded by the clip); the critic minimises the clipped value
   loss ½ max((V − R)², (V_old + clip(V − V_old, ±c) − R)²).

Actor and critic read the same precomputed advantages and returns, so their updates are
independent. The **fused** step (`loss.ppo.fused_step`, RLHFuse's intra-stage fusion)
runs preparation and both models' updates for each mini-batch as one compiled program on
the learner's devices; the unfused step runs preparation, the actor's updates and the
critic's updates as three programs back to back. They compute the same thing
(tests/test_ppo.py). The shared-trunk critic is one model, so its step is always fused
(the loss is pg + vf_coef · vf).

The math is in pure functions (`kl_penalised_rewards`, `generalised_advantages`,
`whiten`, `clipped_policy_loss`, `clipped_value_loss`); `make_train_step` builds the
jitted step with the learner's shardings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax

from tba_jax import learner
from tba_jax import mesh as mesh_lib
from tba_jax.critic import Critic
from tba_jax.losses import clipped_policy_loss, masked_mean
from tba_jax.models import Params
from tba_jax.sampling.scoring import batch_token_logprobs

Array = jax.Array
_WHITEN_EPS = 1e-8  # variance floor of advantage whitening
_SHUFFLE_SEED = 0x9E37  # folded with the learner step: each step's mini-batch order

# Batch fields a PPO step reads, [N, ...]: the learner's plus the per-token ones.
PPO_FIELDS = learner.BATCH_FIELDS + learner.TOKEN_FIELDS
# What preparation adds for the updates: [N, T] each.
_PREPARED_FIELDS = ("advantages", "returns", "values_old")


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """`config.loss.ppo`. Defaults: Huang et al. 2024's TL;DR settings (TRL's PPOv2)."""

    critic: str = "separate"  # separate | shared (see tba_jax.critic)
    critic_init: str = "policy"  # a separate critic starts as: policy | reward_model
    gamma: float = 1.0  # discount γ
    lam: float = 0.95  # GAE λ
    clip_epsilon: float = 0.2  # policy ratio clip ε
    value_clip: float = 0.2  # value clip c around V_old
    vf_coef: float = 0.1  # shared trunk: weight of the value loss in the joint loss
    epochs: int = 4  # passes over each batch
    minibatches: int = 1  # optimiser updates per pass
    whiten_advantages: bool = True
    fused_step: bool = True  # one program for actor and critic (RLHFuse)
    critic_learning_rate: float = 0.0  # 0: the policy's optim.learning_rate

    @property
    def updates_per_step(self) -> int:
        return self.epochs * self.minibatches


# --------------------------------------------------------------------------- the math


def last_token_one_hot(response_mask: Array, dtype=jnp.float32) -> Array:
    """1.0 at each row's last response token (EOS or the length cap), [N, T]; a row with
    no response tokens is all 0. response_mask: [N, T], 1 on a prefix of each row."""
    lengths = jnp.sum(response_mask > 0, axis=-1)
    one_hot = jax.nn.one_hot(lengths - 1, response_mask.shape[-1], dtype=dtype)
    return one_hot * (lengths > 0)[:, None]


def kl_penalised_rewards(
    reward: Array, token_logp_behaviour: Array, token_logp_ref: Array, response_mask: Array, beta
) -> Array:
    """r_t = −β (log π_behaviour(y_t) − log π_ref(y_t)), plus `reward` on the last token.

    reward: [N]; the rest [N, T]. Returns [N, T] float32, 0 on padding."""
    mask = response_mask.astype(token_logp_behaviour.dtype)
    kl = (token_logp_behaviour - token_logp_ref) * mask
    return -beta * kl + last_token_one_hot(response_mask, kl.dtype) * reward[:, None]


def generalised_advantages(
    rewards: Array, values: Array, response_mask: Array, gamma: float, lam: float
) -> tuple[Array, Array]:
    """GAE (Schulman et al. 2016) over each response, terminal after its last token.

    δ_t = r_t + γ V_{t+1} − V_t,  A_t = δ_t + γ λ A_{t+1}  (V and A are 0 past the end).
    rewards, values, response_mask: [N, T]. Returns (advantages, returns = A + V), each
    [N, T] in the rewards' and values' dtype and 0 on padding."""
    dtype = jnp.result_type(rewards, values)
    mask = response_mask.astype(dtype)
    values = values * mask
    next_mask = jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1)
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    deltas = (rewards + gamma * next_values - values) * mask

    def backwards(advantage_next, step):
        delta, has_next = step
        advantage = delta + gamma * lam * has_next * advantage_next
        return advantage, advantage

    _, advantages = jax.lax.scan(
        backwards, jnp.zeros(rewards.shape[0], dtype), (deltas.T, next_mask.T), reverse=True
    )
    advantages = advantages.T * mask
    return advantages, (advantages + values) * mask


def whiten(x: Array, mask: Array) -> Array:
    """(x − mean) / std over the masked tokens; 0 on padding."""
    mean = masked_mean(x, mask)
    variance = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * jax.lax.rsqrt(variance + _WHITEN_EPS) * mask


def clipped_value_loss(
    values: Array, values_old: Array, returns: Array, mask: Array, value_clip: float
) -> tuple[Array, dict[str, Array]]:
    """½ max((V − R)², (V_old + clip(V − V_old, −c, c) − R)²), mean over tokens. All
    [N, T]. Returns (loss, metrics)."""
    clipped_values = values_old + jnp.clip(values - values_old, -value_clip, value_clip)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(jnp.maximum(unclipped_error, clipped_error), mask)
    metrics = {
        "vf_loss": loss,
        "value_clip_fraction": masked_mean(
            (clipped_error > unclipped_error).astype(jnp.float32), mask
        ),
    }
    return loss, jax.lax.stop_gradient(metrics)


def prepare(
    critic: Critic,
    policy_params: Params,
    critic_params: Params,
    batch: Mapping[str, Array],
    beta,
    options: PPOConfig,
    temperature: float,
) -> tuple[dict[str, Array], dict[str, Array]]:
    """Step 1 (no gradients): the batch with `advantages`, `returns` and `values_old`
    added, and the batch's metrics."""
    if critic.kind == "separate":
        values_old = critic.values(critic_params, batch)
    else:
        _, values_old = critic.policy_logp_and_values(
            policy_params, critic_params, batch, temperature
        )
    values_old = jax.lax.stop_gradient(values_old)
    mask = batch["response_mask"]
    rewards = kl_penalised_rewards(
        batch["reward"], batch["token_logp_behaviour"], batch["token_logp_ref"], mask, beta
    )
    advantages, returns = generalised_advantages(
        rewards, values_old, mask, options.gamma, options.lam
    )
    residual_variance = masked_mean(
        (returns - values_old - masked_mean(advantages, mask)) ** 2, mask
    )
    returns_variance = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    metrics = {
        "reward_mean": jnp.mean(batch["reward"]),
        "kl_mean": masked_mean(batch["token_logp_behaviour"] - batch["token_logp_ref"], mask),
        "advantage_mean": masked_mean(advantages, mask),
        "returns_mean": masked_mean(returns, mask),
        "value_mean": masked_mean(values_old, mask),
        "explained_variance": 1.0 - residual_variance / jnp.maximum(returns_variance, 1e-8),
    }
    if options.whiten_advantages:
        advantages = whiten(advantages, mask)
    prepared = {**batch, "advantages": advantages, "returns": returns, "values_old": values_old}
    return prepared, metrics


# --------------------------------------------------------------------------- the step


def pair_optimizer(
    first: optax.GradientTransformation, second: optax.GradientTransformation
) -> optax.GradientTransformation:
    """Applies `first` to params[0] and `second` to params[1] of a pair of param trees."""

    def init(params):
        return first.init(params[0]), second.init(params[1])

    def update(updates, state, params=None):
        params = (None, None) if params is None else params
        first_updates, first_state = first.update(updates[0], state[0], params[0])
        second_updates, second_state = second.update(updates[1], state[1], params[1])
        return (first_updates, second_updates), (first_state, second_state)

    return optax.GradientTransformation(init, update)


def train_state_shardings(
    critic: Critic,
    optimizer: optax.GradientTransformation,
    critic_optimizer: optax.GradientTransformation,
    abstract_params: Params,
    mesh: jax.sharding.Mesh,
    rules,
) -> learner.TrainState:
    """Shardings of a PPO TrainState on the learner `mesh` (sharding `rules`): the policy's
    and, under `critic`, the critic's (its params by their logical axes, Adam's moments
    with them)."""
    shardings = mesh_lib.param_shardings(critic.policy.logical_axes, abstract_params, mesh, rules)
    state = learner.train_state_shardings(optimizer, abstract_params, shardings, mesh)
    return state._replace(critic=critic_state_shardings(critic, critic_optimizer, mesh, rules))


def critic_state_shardings(
    critic: Critic, critic_optimizer: optax.GradientTransformation, mesh: jax.sharding.Mesh, rules
) -> learner.TrainState:
    """Shardings of the critic's own TrainState: its params by their logical axes under
    `rules`, Adam's moments with them, scalars replicated."""
    critic_params = critic.abstract_params()
    critic_shardings = mesh_lib.param_shardings(critic.logical_axes, critic_params, mesh, rules)
    return learner.train_state_shardings(critic_optimizer, critic_params, critic_shardings, mesh)


def init_train_state(
    policy_params: Params,
    critic: Critic,
    optimizer: optax.GradientTransformation,
    critic_optimizer: optax.GradientTransformation,
    state_sharding: learner.TrainState,
    critic_start: Params | None = None,
) -> learner.TrainState:
    """A fresh PPO TrainState: the policy's, and a new critic (`Critic.initial_params`;
    `critic_start`: its own starting weights, e.g. a reward model's) with its own optimiser
    state, placed on `state_sharding`."""
    state = learner.init_train_state(policy_params, optimizer, state_sharding._replace(critic=None))
    critic_state = learner.init_train_state(
        critic.initial_params(policy_params, critic_start), critic_optimizer, state_sharding.critic
    )
    return state._replace(critic=critic_state)


def minibatch_orders(key: Array, num_rows: int, options: PPOConfig) -> Array:
    """Row indices of every optimiser update of a step: a fresh permutation of the N rows
    per epoch, cut into mini-batches. Returns [epochs × minibatches, N / minibatches]."""
    keys = jax.random.split(key, options.epochs)
    orders = jax.vmap(lambda k: jax.random.permutation(k, num_rows))(keys)
    return orders.reshape(options.updates_per_step, num_rows // options.minibatches)


def make_train_step(
    critic: Critic,
    optimizer: optax.GradientTransformation,
    critic_optimizer: optax.GradientTransformation,
    beta_schedule: Callable[[Array], Array],
    *,
    options: PPOConfig,
    num_microbatches: int,
    temperature: float,
    state_sharding: learner.TrainState,
    mesh: jax.sharding.Mesh,
):
    """The PPO learner step `(state, batch) -> (state, metrics)`; `state.critic` holds the
    critic's own TrainState. batch: `PPO_FIELDS` arrays [N, ...] on the learner mesh's
    batch axes. Fused (`options.fused_step` or a shared critic): one jitted program;
    otherwise three (prepare, actor updates, critic updates), each donating its state."""
    fields = PPO_FIELDS + _PREPARED_FIELDS
    replicated = mesh_lib.replicated(mesh)
    batch_sharding = mesh_lib.batch_sharding(mesh)

    def actor_loss(policy_params, micro):
        logp = batch_token_logprobs(critic.policy, policy_params, micro, temperature=temperature)
        return clipped_policy_loss(
            logp,
            micro["token_logp_behaviour"],
            micro["advantages"],
            micro["response_mask"],
            options.clip_epsilon,
        )

    def value_loss(values, micro):
        return clipped_value_loss(
            values,
            micro["values_old"],
            micro["returns"],
            micro["response_mask"],
            options.value_clip,
        )

    def critic_loss(critic_params, micro):
        return value_loss(critic.values(critic_params, micro), micro)

    def joint_loss(params, micro):
        policy_params, critic_params = params
        if critic.kind == "separate":
            pg, pg_metrics = actor_loss(policy_params, micro)
            vf, vf_metrics = critic_loss(critic_params, micro)
            total = pg + vf  # disjoint params: each model gets its own loss's gradient
        else:
            logp, values = critic.policy_logp_and_values(
                policy_params, critic_params, micro, temperature
            )
            pg, pg_metrics = clipped_policy_loss(
                logp,
                micro["token_logp_behaviour"],
                micro["advantages"],
                micro["response_mask"],
                options.clip_epsilon,
            )
            vf, vf_metrics = value_loss(values, micro)
            total = pg + options.vf_coef * vf
        return total, {"loss": total, **pg_metrics, **vf_metrics}

    def updates(state: learner.TrainState, prepared, step, grad_fn, optimizer_):
        """Every mini-batch update of the step on `state` (a `lax.scan`); the state's step
        counts learner steps, so it advances by one."""
        orders = minibatch_orders(
            jax.random.fold_in(jax.random.key(_SHUFFLE_SEED), step),
            prepared["response_mask"].shape[0],
            options,
        )

        def one_update(state, rows):
            minibatch = {name: jnp.take(prepared[name], rows, axis=0) for name in fields}
            micro = learner.split_microbatches(minibatch, fields, num_microbatches, mesh)
            return learner.accumulated_update(state, micro, grad_fn, optimizer_, num_microbatches)

        updated, metrics = jax.lax.scan(one_update, state, orders)
        return updated._replace(step=state.step + 1), jax.tree.map(jnp.mean, metrics)

    def prepare_step(state: learner.TrainState, batch):
        beta = beta_schedule(state.step)
        prepared, metrics = prepare(
            critic, state.params, state.critic.params, batch, beta, options, temperature
        )
        return prepared, {**metrics, "beta": beta}

    def fused_step(state: learner.TrainState, batch):
        prepared, metrics = prepare_step(state, batch)
        pair = learner.TrainState(
            (state.params, state.critic.params),
            (state.opt_state, state.critic.opt_state),
            state.step,
        )
        pair, update_metrics = updates(
            pair,
            prepared,
            state.step,
            jax.value_and_grad(joint_loss, has_aux=True),
            pair_optimizer(optimizer, critic_optimizer),
        )
        new_critic = learner.TrainState(pair.params[1], pair.opt_state[1], pair.step)
        new_state = learner.TrainState(pair.params[0], pair.opt_state[0], pair.step, new_critic)
        return new_state, {**metrics, **update_metrics}

    if options.fused_step or critic.kind == "shared":
        return mesh_lib.jit_on_mesh(
            fused_step,
            in_shardings=(state_sharding, batch_sharding),
            out_shardings=(state_sharding, replicated),
            donate_argnums=(0,),
        )

    actor_sharding = state_sharding._replace(critic=None)
    prepared_sharding = {name: batch_sharding for name in fields}
    jit_prepare = mesh_lib.jit_on_mesh(
        prepare_step,
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=(prepared_sharding, replicated),
    )

    def actor_updates(actor: learner.TrainState, prepared):
        grad_fn = jax.value_and_grad(actor_loss, has_aux=True)
        return updates(actor, prepared, actor.step, grad_fn, optimizer)

    def critic_updates(critic_state: learner.TrainState, prepared, step):
        grad_fn = jax.value_and_grad(critic_loss, has_aux=True)
        return updates(critic_state, prepared, step, grad_fn, critic_optimizer)

    jit_actor = mesh_lib.jit_on_mesh(
        actor_updates,
        in_shardings=(actor_sharding, prepared_sharding),
        out_shardings=(actor_sharding, replicated),
        donate_argnums=(0,),
    )
    jit_critic = mesh_lib.jit_on_mesh(
        critic_updates,
        in_shardings=(state_sharding.critic, prepared_sharding, replicated),
        out_shardings=(state_sharding.critic, replicated),
        donate_argnums=(0,),
    )

    def unfused_step(state: learner.TrainState, batch):
        prepared, metrics = jit_prepare(state, batch)
        step = state.step
        critic_state, critic_metrics = jit_critic(state.critic, prepared, step)
        actor, actor_metrics = jit_actor(state._replace(critic=None), prepared)
        metrics = {**metrics, **critic_metrics, **actor_metrics}
        metrics["loss"] = actor_metrics["pg_loss"] + critic_metrics["vf_loss"]
        metrics["grad_norm"] = actor_metrics["grad_norm"]
        metrics["critic_grad_norm"] = critic_metrics["grad_norm"]
        skipped = jnp.maximum(
            actor_metrics["skipped_nonfinite"], critic_metrics["skipped_nonfinite"]
        )
        metrics["skipped_nonfinite"] = skipped
        return actor._replace(critic=critic_state), metrics

    return unfused_step
