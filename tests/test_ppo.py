"""PPO (tba_jax.ppo, tba_jax.critic): its math against NumPy loops, the fused actor–critic
step against the unfused one, and the critic layouts on the real model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support import rewarded_preference, sampled_micro_batch

from tba_jax import losses, ppo
from tba_jax import mesh as mesh_lib
from tba_jax.critic import Critic
from tba_jax.models import abstract_model

N, P, T = 8, 5, 6
TEMPERATURE = 0.8


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def random_mask(rng, rows, length):
    """[rows, length] float masks on a prefix of each row, lengths 0..length."""
    lengths = rng.integers(0, length + 1, rows)
    lengths[0] = length  # one full row (no EOS: the length cap)
    return (np.arange(length) < lengths[:, None]).astype(np.float64)


# --------------------------------------------------------------------------- the math


def numpy_gae(rewards, values, mask, gamma, lam):
    """Advantages and returns by a loop over each row's time steps, back to front."""
    advantages = np.zeros_like(rewards)
    for row in range(rewards.shape[0]):
        length = int(mask[row].sum())
        next_advantage, next_value = 0.0, 0.0
        for t in reversed(range(length)):
            delta = rewards[row, t] + gamma * next_value - values[row, t]
            next_advantage = delta + gamma * lam * next_advantage
            advantages[row, t] = next_advantage
            next_value = values[row, t]
    return advantages, (advantages + values) * mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0)])
def test_gae_matches_a_loop_over_time_steps(gamma, lam, x64):
    rng = np.random.default_rng(0)
    mask = random_mask(rng, 7, 9)
    rewards, values = rng.normal(size=(2, 7, 9)) * mask
    advantages, returns = ppo.generalised_advantages(
        jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma, lam
    )
    want_advantages, want_returns = numpy_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(advantages, want_advantages, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(returns, want_returns, rtol=1e-12, atol=1e-12)


def test_rewards_are_the_kl_penalty_plus_the_reward_on_the_last_token(x64):
    rng = np.random.default_rng(1)
    mask = random_mask(rng, 6, 5)
    behaviour, ref = rng.normal(size=(2, 6, 5)) * mask
    reward = rng.normal(size=6)
    beta = 0.07
    got = ppo.kl_penalised_rewards(
        jnp.asarray(reward), jnp.asarray(behaviour), jnp.asarray(ref), jnp.asarray(mask), beta
    )
    want = -beta * (behaviour - ref) * mask
    for row in range(6):
        length = int(mask[row].sum())
        if length:
            want[row, length - 1] += reward[row]
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_whitening_is_over_the_masked_tokens(x64):
    rng = np.random.default_rng(2)
    mask = random_mask(rng, 5, 6)
    x = rng.normal(3.0, 2.0, (5, 6))
    valid = x[mask > 0]
    want = (x - valid.mean()) / np.sqrt(valid.var() + 1e-8) * mask
    np.testing.assert_allclose(ppo.whiten(jnp.asarray(x), jnp.asarray(mask)), want, rtol=1e-10)


def test_clipped_policy_loss_and_gradient_match_numpy(x64):
    rng = np.random.default_rng(3)
    mask = random_mask(rng, 6, 7)
    old = rng.normal(-2.0, 0.5, (6, 7)) * mask
    logp = (old + rng.normal(0.0, 0.3, (6, 7))) * mask  # ratios inside and outside the clip
    advantages = rng.normal(size=(6, 7)) * mask
    eps = 0.2
    ratio = np.exp(logp - old)
    clipped = np.clip(ratio, 1 - eps, 1 + eps)
    per_token = np.maximum(-advantages * ratio, -advantages * clipped)
    want_loss = (per_token * mask).sum() / mask.sum()
    unclipped_active = -advantages * ratio >= -advantages * clipped
    want_grad = np.where(unclipped_active, -advantages * ratio, 0.0) * mask / mask.sum()
    batch = {
        "token_logp_behaviour": jnp.asarray(old),
        "advantages": jnp.asarray(advantages),
        "response_mask": jnp.asarray(mask),
    }
    spec = losses.get_loss("ppo")
    assert spec.needs_critic and spec.token_level and not spec.on_policy
    (loss, metrics), grad = jax.value_and_grad(
        lambda x: spec.fn(x, batch, None, clip_epsilon=eps), has_aux=True
    )(jnp.asarray(logp))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-10)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-9, atol=1e-14)
    assert 0 < metrics["clip_fraction"] < 1  # both branches were exercised


def test_clipped_value_loss_and_gradient_match_numpy(x64):
    rng = np.random.default_rng(4)
    mask = random_mask(rng, 6, 7)
    values_old, returns = rng.normal(size=(2, 6, 7)) * mask
    values = (values_old + rng.normal(0.0, 0.4, (6, 7))) * mask
    clip = 0.2
    clipped_values = values_old + np.clip(values - values_old, -clip, clip)
    unclipped_error, clipped_error = (values - returns) ** 2, (clipped_values - returns) ** 2
    want_loss = 0.5 * (np.maximum(unclipped_error, clipped_error) * mask).sum() / mask.sum()
    # d/dV: the unclipped branch when it is the larger, else the clipped one (0 when clipped)
    inside = np.abs(values - values_old) < clip
    grad_clipped = np.where(inside, clipped_values - returns, 0.0)
    branch = np.where(unclipped_error >= clipped_error, values - returns, grad_clipped)
    want_grad = branch * mask / mask.sum()
    (loss, metrics), grad = jax.value_and_grad(
        lambda v: ppo.clipped_value_loss(
            v, jnp.asarray(values_old), jnp.asarray(returns), jnp.asarray(mask), clip
        ),
        has_aux=True,
    )(jnp.asarray(values))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-10)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-9, atol=1e-14)
    assert 0 < metrics["value_clip_fraction"] < 1


# --------------------------------------------------------------------------- on the model


@pytest.fixture(scope="module")
def setup():
    """A micro policy, a sampled batch of N rows scored by a second model as π_ref."""
    prompt_tokens = np.random.default_rng(0).integers(3, 12, size=(N, P)).astype(np.int32)
    prompt_tokens[::2, :2] = 0
    return sampled_micro_batch(prompt_tokens, max_new_tokens=T, temperature=TEMPERATURE)


def ppo_step(model, params, kind, *, fused, epochs=2, minibatches=2, num_microbatches=2):
    """(initial state with a fresh critic, the PPO step) on a one-device learner mesh."""
    mesh = mesh_lib.make_mesh(jax.devices()[:1], {})
    critic = Critic.build(kind, model)
    optimizer, critic_optimizer = optax.adam(3e-3), optax.adam(1e-2)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    state_sharding = ppo.train_state_shardings(
        critic, optimizer, critic_optimizer, abstract, mesh, []
    )
    state = ppo.init_train_state(params, critic, optimizer, critic_optimizer, state_sharding)
    options = ppo.PPOConfig(
        critic=kind, epochs=epochs, minibatches=minibatches, fused_step=fused, gamma=0.9
    )
    step = ppo.make_train_step(
        critic,
        optimizer,
        critic_optimizer,
        losses.make_beta_schedule("constant", 0.05, 0.05, 1),
        options=options,
        num_microbatches=num_microbatches,
        temperature=TEMPERATURE,
        state_sharding=state_sharding,
        mesh=mesh,
    )
    return state, step, critic


def test_the_fused_step_equals_the_unfused_one(setup):
    model, params, batch = setup
    results = []
    for fused in (True, False):
        state, step, _ = ppo_step(model, params, "separate", fused=fused)
        for _ in range(2):
            state, metrics = step(state, batch)
        results.append((jax.device_get(state), jax.device_get(metrics)))
    (fused_state, fused_metrics), (unfused_state, unfused_metrics) = results
    assert int(fused_state.step) == int(unfused_state.step) == 2  # learner steps, not updates
    for got, want in zip(jax.tree.leaves(fused_state), jax.tree.leaves(unfused_state), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)
    for name in ("pg_loss", "vf_loss", "clip_fraction", "explained_variance", "kl_mean"):
        np.testing.assert_allclose(fused_metrics[name], unfused_metrics[name], rtol=1e-4, atol=1e-6)


def test_a_separate_critic_starts_as_the_policy_trunk_with_zero_values(setup):
    model, params, batch = setup
    critic = Critic.build("separate", model)
    critic_params = critic.initial_params(params)
    for name in ("embedding", "blocks", "final_norm"):
        for a, b in zip(
            jax.tree.leaves(critic_params[name]), jax.tree.leaves(params[name]), strict=True
        ):
            np.testing.assert_array_equal(a, b)
    assert "lm_head" not in critic_params and critic_params["score"].shape == (
        model.config.d_model,
        1,
    )
    np.testing.assert_array_equal(critic.values(critic_params, batch), 0.0)


@pytest.mark.parametrize("logprob_chunk", [0, 2])
@pytest.mark.parametrize("kind", ["separate", "shared"])
def test_policy_log_probs_of_either_layout_are_the_scorers(setup, kind, logprob_chunk):
    model, params, batch = setup
    model = abstract_model(dataclasses.replace(model.config, logprob_chunk=logprob_chunk))[0]
    critic = Critic.build(kind, model)
    critic_params = jax.tree.map(lambda x: x + 0.1, critic.initial_params(params))
    logp, values = critic.policy_logp_and_values(params, critic_params, batch, TEMPERATURE)
    np.testing.assert_allclose(logp, batch["token_logp_behaviour"], rtol=1e-4, atol=1e-5)
    assert np.all(np.asarray(values)[batch["response_mask"] == 0] == 0)
    assert np.any(np.asarray(values)[batch["response_mask"] > 0] != 0)
    # the output head runs on the response slots only, `logprob_chunk` of them at a time
    jaxpr = jax.make_jaxpr(critic.policy_logp_and_values, static_argnums=3)(
        params, critic_params, batch, TEMPERATURE
    )
    vocab, rows, response_len = (
        model.config.vocab_size,
        *batch["response_tokens"].shape,
    )
    logits_lengths = {
        var.aval.shape[1]
        for eqn in _all_equations(jaxpr.jaxpr)
        for var in eqn.outvars
        if len(getattr(var.aval, "shape", ())) == 3
        and var.aval.shape[0] == rows
        and var.aval.shape[2] == vocab
    }
    assert logits_lengths == {logprob_chunk or response_len}


def _all_equations(jaxpr):
    """Every equation of `jaxpr`, those inside its sub-jaxprs (map, remat, …) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from _all_equations(inner)


def test_ppo_steps_with_a_shared_trunk_raise_the_rewarded_responses_and_fit_the_values(setup):
    model, params, batch = setup
    state, step, _ = ppo_step(model, params, "shared", fused=True, epochs=2, minibatches=1)
    before = rewarded_preference(model, params, batch, TEMPERATURE)
    state, first = step(state, batch)
    np.testing.assert_allclose(first["value_mean"], 0.0)  # a zero value head to start with
    for _ in range(6):
        state, metrics = step(state, batch)
    assert rewarded_preference(model, state.params, batch, TEMPERATURE) > before + 0.5
    assert metrics["vf_loss"] < 0.7 * first["vf_loss"]
    assert metrics["explained_variance"] > first["explained_variance"]


# --------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def ppo_runs(tmp_path_factory):
    """The same sync PPO smoke run (a shared-trunk critic) straight to step 4, and stopped
    at 2 then resumed. The separate critic's step is checked against the unfused one above."""
    from configs.arithmetic import get_config
    from tba_jax.train import train_and_evaluate

    variant = (
        "smoke,mode=sync,method=ppo,loss.ppo.critic=shared,loss.ppo.minibatches=2,"
        "optim.schedule=constant,optim.warmup_steps=0"
    )
    straight = str(tmp_path_factory.mktemp("straight"))
    interrupted = str(tmp_path_factory.mktemp("interrupted"))
    train_and_evaluate(get_config(variant + ",steps=4"), straight)
    train_and_evaluate(get_config(variant + ",steps=2"), interrupted)
    train_and_evaluate(get_config(variant + ",steps=4"), interrupted)
    return get_config(variant), straight, interrupted


def test_a_resumed_ppo_run_ends_with_the_same_policy_and_critic(ppo_runs):
    from tba_jax.runs import restore_run

    config, straight, interrupted = ppo_runs
    want, got = restore_run(config, straight), restore_run(config, interrupted)
    assert got.metadata["policy_version"] == 4
    assert want.critic[0].kind == "shared"
    for a, b in zip(
        jax.tree.leaves((want.params, want.critic[1])),
        jax.tree.leaves((got.params, got.critic[1])),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    assert np.any(np.asarray(got.critic[1]["value_head"]) != 0)  # the critic was trained


def test_the_exported_critic_gives_its_values_in_transformers(ppo_runs, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from experiments.export_hf import export_run
    from tba_jax.runs import restore_run

    config, straight, _ = ppo_runs
    summary = export_run(straight, str(tmp_path / "critic"), critic=True)
    assert "tokenizer.json" in summary["files"]
    restored = restore_run(config, straight)
    critic, critic_params = restored.critic
    rng = np.random.default_rng(5)
    batch = {
        "prompt_tokens": rng.integers(3, 12, (2, 4)).astype(np.int32),
        "prompt_mask": np.ones((2, 4), bool),
        "response_tokens": rng.integers(3, 12, (2, 3)).astype(np.int32),
        "response_mask": np.ones((2, 3), np.float32),
    }
    _, values = critic.policy_logp_and_values(restored.params, critic_params, batch, 1.0)
    ours = np.asarray(values)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(tmp_path / "critic"), attn_implementation="eager"
    ).eval()
    tokens = np.concatenate([batch["prompt_tokens"], batch["response_tokens"]], axis=1)
    with torch.no_grad():
        hidden = model.base_model(torch.tensor(tokens, dtype=torch.long)).last_hidden_state
        scores = model.score(hidden)[..., 0].numpy()
    np.testing.assert_allclose(ours, scores[:, 3:6], atol=1e-4)  # the slots before y_0..y_2
