"""The learner's train step, optimiser schedules and micro-batching on the real model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support import rewarded_preference, sampled_micro_batch

from tba_jax import learner, losses
from tba_jax.models import abstract_model, params_in_compute_dtype

B, K, P, T = 3, 4, 5, 6
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def setup():
    """A micro policy and a batch of its own K samples for each of B prompts."""
    rng = np.random.default_rng(0)
    prompt_tokens = np.repeat(rng.integers(3, 12, size=(B, P)).astype(np.int32), K, axis=0)
    prompt_tokens[::2, :2] = 0  # some left padding
    return sampled_micro_batch(prompt_tokens, max_new_tokens=T, temperature=TEMPERATURE)


def _train_step(model, params, optimizer, num_microbatches, beta=0.3, method="tb"):
    """(initial state, jitted step) on a one-device learner mesh."""
    state, state_sharding, mesh = learner.one_device_train_state(model, params, optimizer)
    step = learner.make_train_step(
        model,
        losses.get_loss(method),
        optimizer,
        losses.make_beta_schedule("constant", beta, beta, 1),
        samples_per_prompt=K,
        num_microbatches=num_microbatches,
        temperature=TEMPERATURE,
        state_sharding=state_sharding,
        mesh=mesh,
    )
    return state, step


def _one_step_update(model, params, batch, optimizer, num_microbatches, beta=0.3):
    state, step = _train_step(model, params, optimizer, num_microbatches, beta)
    return step(state, batch)


def test_on_policy_tb_gradient_equals_advantage_weighted_score(setup):
    """∇L_TB = −(2/(B·K·β)) Σ_j A_j ∇log π(y_j), A_j = (r_j − r̄) − β(KL_j − KL̄)."""
    model, params, batch = setup
    beta = 0.3
    # Plain SGD with lr 1: the update is exactly −grad.
    new_state, _ = _one_step_update(model, params, batch, optax.sgd(1.0), 1, beta)
    tb_grad = jax.tree.map(lambda new, old: old - new, new_state.params, params)

    def logp_of(p):
        return learner.sequence_logp(model, p, batch, TEMPERATURE)

    logp = np.asarray(jax.jit(logp_of)(params)).reshape(B, K)
    np.testing.assert_allclose(logp.ravel(), batch["logp_behaviour"], atol=1e-4)
    kl = logp - batch["logp_ref"].reshape(B, K)
    reward = batch["reward"].reshape(B, K)
    advantage = (reward - reward.mean(1, keepdims=True)) - beta * (kl - kl.mean(1, keepdims=True))
    weights = jnp.asarray(advantage.ravel() * (-2.0 / (B * K * beta)))
    expected = jax.jit(jax.grad(lambda p: jnp.sum(weights * logp_of(p))))(params)
    for got, want in zip(jax.tree.leaves(tb_grad), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-5)


def test_microbatches_give_the_same_update(setup):
    model, params, batch = setup
    batch = {name: np.concatenate([x, x[::-1]]) for name, x in batch.items()}
    whole, metrics_whole = _one_step_update(model, params, batch, optax.sgd(0.1), 1)
    split, metrics_split = _one_step_update(model, params, batch, optax.sgd(0.1), 2)
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(split.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(metrics_whole["loss"], metrics_split["loss"], rtol=1e-5)


@pytest.mark.parametrize("logprob_chunk", [0, 2])
def test_weights_cast_once_before_the_micro_batches_give_the_same_update_bit_for_bit(
    setup, logprob_chunk
):
    """float32 params under bfloat16 compute: the gradient through weights cast once
    before the micro-batch scan (`params_for_grad`, as the train step does) is the
    float32 params' exactly, so the update is the same to the bit; with chunked log-probs
    too, where the LM head, used by every chunk, stays float32 (its chunks' gradients
    summed in bfloat16 moved the update in the last bit)."""
    model, params, batch = setup
    mixed_config = dataclasses.replace(model.config, dtype="bfloat16", logprob_chunk=logprob_chunk)
    mixed, _ = abstract_model(mixed_config)
    optimizer = optax.adam(1e-2)
    state = learner.TrainState(params, optimizer.init(params), jnp.int32(0))
    micro = {name: jnp.asarray(x).reshape(2, -1, *x.shape[1:]) for name, x in batch.items()}

    def weighted_logp(p, m):
        logp = learner.sequence_logp(mixed, p, m, TEMPERATURE)
        return jnp.sum(logp * m["reward"]), {}

    grad_fn = jax.value_and_grad(weighted_logp, has_aux=True)

    def update(params_for_grad):
        step = jax.jit(
            lambda s, m: learner.accumulated_update(
                s, m, grad_fn, optimizer, 2, params_for_grad=params_for_grad
            )
        )
        return step(state, micro)[0].params

    cast = update(lambda p: params_in_compute_dtype(mixed.config, p, for_gradients=True))
    plain = update(None)
    for_gradients = params_in_compute_dtype(mixed.config, params, for_gradients=True)
    head_dtype = jnp.float32 if logprob_chunk else jnp.bfloat16
    assert for_gradients["lm_head"].dtype == head_dtype
    assert for_gradients["blocks"][0]["mlp"]["w_up"].dtype == jnp.bfloat16
    moved = jax.tree.leaves(jax.tree.map(lambda new, old: jnp.any(new != old), plain, params))
    assert all(moved)
    for a, b in zip(jax.tree.leaves(cast), jax.tree.leaves(plain), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_train_step_lowers_the_tb_loss_on_a_fixed_batch(setup):
    model, params, batch = setup
    state, step = _train_step(model, params, optax.adam(1e-2), 1)
    state, first = step(state, batch)
    for _ in range(15):
        state, metrics = step(state, batch)
    assert metrics["loss"] < 0.5 * first["loss"]


def test_online_dpo_steps_learn_the_preferred_responses_of_a_fixed_batch(setup):
    model, params, batch = setup
    state, step = _train_step(model, params, optax.adam(1e-2), 1, beta=0.1, method="online_dpo")
    state, first = step(state, batch)
    assert first["pair_fraction"] > 0 and first["reward_margin"] == 1.0
    for _ in range(15):
        state, metrics = step(state, batch)
    assert metrics["loss"] < 0.5 * first["loss"]
    assert metrics["preference_accuracy"] == 1.0


def test_grpo_steps_raise_the_rewarded_responses_over_the_others(setup):
    model, params, batch = setup
    state, step = _train_step(model, params, optax.adam(3e-3), 1, beta=0.01, method="grpo")
    before = rewarded_preference(model, params, batch, TEMPERATURE)
    state, first = step(state, batch)
    np.testing.assert_allclose(first["ratio_mean"], 1.0, atol=1e-4)  # π_behaviour = π_θ
    for _ in range(5):
        state, metrics = step(state, batch)
    assert rewarded_preference(model, state.params, batch, TEMPERATURE) > before + 1.0
    assert metrics["clip_fraction"] > 0  # later steps are off-policy: the clip bites


@pytest.mark.parametrize(
    "field, bad_value",
    [("reward", np.nan), ("logp_ref", -np.inf), ("logp_behaviour", np.nan)],
)
def test_a_non_finite_loss_skips_the_update_and_is_counted(setup, field, bad_value):
    model, params, batch = setup
    state, step = _train_step(model, params, optax.adam(1e-2), 1)
    state, good = step(state, batch)
    assert float(good["skipped_nonfinite"]) == 0.0
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    poisoned = {**batch, field: batch[field].copy()}
    poisoned[field][0] = bad_value
    if field == "logp_behaviour":  # TB does not read it: poison the reward too
        poisoned["reward"] = np.full_like(batch["reward"], np.inf)
    state, skipped = step(state, poisoned)
    assert float(skipped["skipped_nonfinite"]) == 1.0
    assert int(state.step) == 2  # the step still counts
    after = jax.tree.map(np.asarray, (state.params, state.opt_state))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)
    state, again = step(state, batch)  # and training goes on from there
    assert float(again["skipped_nonfinite"]) == 0.0
    assert bool(learner.all_finite(state.params))


def test_all_finite_sees_every_leaf():
    tree = {"a": jnp.ones(3), "b": {"c": jnp.array([1.0, jnp.inf])}}
    assert not bool(learner.all_finite(tree))
    assert bool(learner.all_finite({"a": jnp.ones(3)}))


@pytest.mark.parametrize(
    "schedule, step, expected",
    [
        ("constant", 0, 0.0),  # warmup starts at 0
        ("constant", 10, 1.0),
        ("constant", 95, 1.0),
        ("linear", 10, 1.0),
        ("linear", 55, 0.5),
        ("linear", 100, 0.0),
        ("wsd", 50, 1.0),  # stable
        ("wsd", 80, 1.0),  # decay starts at 100 - 20
        ("wsd", 90, 0.5),
        ("wsd", 100, 0.0),
    ],
)
def test_lr_schedules(schedule, step, expected):
    cfg = learner.OptimConfig(
        learning_rate=1.0, schedule=schedule, warmup_steps=10, total_steps=100, decay_fraction=0.2
    )
    assert float(learner.make_lr_schedule(cfg)(step)) == pytest.approx(expected, abs=1e-6)


def test_unknown_schedule_is_a_clear_error():
    with pytest.raises(ValueError, match=r"optim\.schedule"):
        learner.make_lr_schedule(learner.OptimConfig(learning_rate=1.0, schedule="cosine"))
