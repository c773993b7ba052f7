"""Tests for tba_jax.losses: TB and RLOO against NumPy, gradient identities, β schedules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tba_jax import losses

SHAPES_AND_BETAS = [(1, 2, 0.012), (3, 4, 0.5), (7, 5, 1.0), (2, 20, 0.004)]
FLOAT32_RTOL = 2e-5
FLOAT64_RTOL = 1e-10
TOY_SEQUENCE_LENGTH = 3
TOY_VOCAB_SIZE = 4


@pytest.fixture
def x64():
    """Enable float64 for one test only, restoring the previous setting afterwards."""
    with jax.enable_x64(True):
        yield


def random_inputs(rng, num_prompts, num_samples):
    """Random logp, logp_ref, reward, logp_behaviour, each [B, K] float64 NumPy."""
    shape = (num_prompts, num_samples)
    return {
        "logp": rng.normal(-20.0, 5.0, shape),
        "logp_ref": rng.normal(-20.0, 5.0, shape),
        "reward": rng.uniform(0.0, 1.0, shape),
        "logp_behaviour": rng.normal(-20.0, 5.0, shape),
    }


def to_jax_batch(inputs):
    return {key: jnp.asarray(inputs[key]) for key in ("logp_ref", "reward", "logp_behaviour")}


# --------------------------------------------------------------------------- NumPy references


def numpy_tb(logp, logp_ref, reward, logp_behaviour, beta):
    """Independent TB loss and metrics. All inputs [B, K]."""
    log_z = np.mean(reward / beta - logp + logp_ref, axis=1, keepdims=True)
    loss = np.mean((log_z + logp - logp_ref - reward / beta) ** 2)
    return loss, {
        "loss": loss,
        "logZ_mean": log_z.mean(),
        "kl_mean": (logp - logp_ref).mean(),
        "reward_mean": reward.mean(),
        "off_policy_gap": (logp - logp_behaviour).mean(),
    }


def numpy_rloo_advantage(logp, logp_ref, reward, beta):
    """A_j = R_j − mean_{i≠j} R_i with R = r − β(logp − logp_ref), by explicit loops."""
    penalised = reward - beta * (logp - logp_ref)
    num_prompts, num_samples = penalised.shape
    advantage = np.empty_like(penalised)
    for b in range(num_prompts):
        for j in range(num_samples):
            others = [penalised[b, i] for i in range(num_samples) if i != j]
            advantage[b, j] = penalised[b, j] - np.mean(others)
    return advantage


def numpy_tb_advantage(logp, logp_ref, reward, beta):
    """A_j = (r_j − r̄) − β(KL_j − KL̄), bars = per-prompt means. All [B, K]."""
    kl = logp - logp_ref
    return (reward - reward.mean(1, keepdims=True)) - beta * (kl - kl.mean(1, keepdims=True))


# --------------------------------------------------------------------------- toy policy


def make_toy_policy(rng, num_prompts, num_samples):
    """Per-prompt, per-position categorical policy over a tiny vocabulary.

    Returns (theta [B, T, V], responses [B, K, T] int): logp_bj(θ) = Σ_t log softmax(θ_bt)[y_bjt].
    """
    theta = rng.normal(0.0, 1.0, (num_prompts, TOY_SEQUENCE_LENGTH, TOY_VOCAB_SIZE))
    responses = rng.integers(0, TOY_VOCAB_SIZE, (num_prompts, num_samples, TOY_SEQUENCE_LENGTH))
    return theta, responses


def toy_logp(theta, responses):
    """JAX: theta [B, T, V], responses [B, K, T] -> summed log-probs [B, K]."""
    log_probs = jax.nn.log_softmax(theta, axis=-1)[:, None]  # [B, 1, T, V]
    picked = jnp.take_along_axis(log_probs, responses[..., None], axis=-1)[..., 0]
    return picked.sum(-1)


def numpy_toy_logp(theta, responses):
    log_probs = theta - np.log(np.exp(theta).sum(-1, keepdims=True))
    num_prompts, num_samples, length = responses.shape
    out = np.zeros((num_prompts, num_samples))
    for b in range(num_prompts):
        for j in range(num_samples):
            out[b, j] = sum(log_probs[b, t, responses[b, j, t]] for t in range(length))
    return out


def numpy_weighted_score(theta, responses, weights):
    """Σ_{b,j} w_bj ∇_θ logπ(y_bj), analytically: ∂/∂θ_btv = 1[y_bjt = v] − p_btv."""
    probs = np.exp(theta) / np.exp(theta).sum(-1, keepdims=True)  # [B, T, V]
    one_hot = np.eye(theta.shape[-1])[responses]  # [B, K, T, V]
    score = one_hot - probs[:, None]  # [B, K, T, V]
    return np.einsum("bk,bktv->btv", weights, score)


# --------------------------------------------------------------------------- TB


@pytest.mark.parametrize("num_prompts,num_samples,beta", SHAPES_AND_BETAS)
def test_tb_loss_and_metrics_match_numpy(num_prompts, num_samples, beta):
    inputs = random_inputs(
        np.random.default_rng(num_prompts * 100 + num_samples), num_prompts, num_samples
    )
    expected_loss, expected_metrics = numpy_tb(**inputs, beta=beta)
    loss, metrics = jax.jit(losses.get_loss("tb").fn)(
        jnp.asarray(inputs["logp"]), to_jax_batch(inputs), beta
    )
    np.testing.assert_allclose(loss, expected_loss, rtol=FLOAT32_RTOL)
    assert set(metrics) == set(expected_metrics)
    for name, expected in expected_metrics.items():
        np.testing.assert_allclose(
            metrics[name], expected, rtol=FLOAT32_RTOL, atol=1e-4, err_msg=name
        )


def test_tb_is_jittable_with_traced_beta():
    inputs = random_inputs(np.random.default_rng(0), 3, 4)
    logp, batch = jnp.asarray(inputs["logp"]), to_jax_batch(inputs)
    eager_loss, eager_metrics = losses.trajectory_balance_loss(logp, batch, 0.3)
    jit_loss, jit_metrics = jax.jit(losses.trajectory_balance_loss)(logp, batch, jnp.float32(0.3))
    np.testing.assert_allclose(jit_loss, eager_loss, rtol=FLOAT32_RTOL)
    for name in eager_metrics:
        np.testing.assert_allclose(jit_metrics[name], eager_metrics[name], rtol=FLOAT32_RTOL)


def test_tb_is_zero_at_the_optimum():
    """π ∝ π_ref·exp(r/β) per prompt (up to a constant logZ) gives zero loss."""
    rng = np.random.default_rng(1)
    beta = 0.25
    logp_ref = rng.normal(-10.0, 2.0, (3, 5))
    reward = rng.uniform(0.0, 1.0, (3, 5))
    log_z = rng.normal(0.0, 1.0, (3, 1))
    logp = logp_ref + reward / beta - log_z
    batch = {"logp_ref": logp_ref, "reward": reward, "logp_behaviour": logp}
    loss, metrics = losses.trajectory_balance_loss(jnp.asarray(logp), batch, beta)
    np.testing.assert_allclose(loss, 0.0, atol=1e-4)
    np.testing.assert_allclose(metrics["logZ_mean"], log_z.mean(), rtol=1e-4)


@pytest.mark.parametrize("num_prompts,num_samples,beta", SHAPES_AND_BETAS)
def test_tb_on_policy_gradient_is_centred_reinforce(x64, num_prompts, num_samples, beta):
    """∇_θ L_TB = −(2/(B·K·β)) Σ_{b,j} A_bj ∇logπ(y_bj), A = (r − r̄) − β(KL − KL̄)."""
    rng = np.random.default_rng(num_prompts + 10 * num_samples)
    theta, responses = make_toy_policy(rng, num_prompts, num_samples)
    logp = numpy_toy_logp(theta, responses)
    logp_ref = logp + rng.normal(0.0, 1.0, logp.shape)
    reward = rng.uniform(0.0, 1.0, logp.shape)
    batch = {
        "logp_ref": jnp.asarray(logp_ref),
        "reward": jnp.asarray(reward),
        "logp_behaviour": jnp.asarray(logp),
    }

    def loss_of_theta(params):
        return losses.trajectory_balance_loss(toy_logp(params, responses), batch, beta)[0]

    grad = jax.jit(jax.grad(loss_of_theta))(jnp.asarray(theta))
    advantage = numpy_tb_advantage(logp, logp_ref, reward, beta)
    expected = (
        -2.0
        / (num_prompts * num_samples * beta)
        * numpy_weighted_score(theta, responses, advantage)
    )
    assert grad.dtype == jnp.float64
    np.testing.assert_allclose(grad, expected, rtol=FLOAT64_RTOL, atol=1e-12)


def test_tb_gradient_ignores_behaviour_log_probs(x64):
    """No importance weights: the behaviour policy only enters a metric."""
    rng = np.random.default_rng(2)
    theta, responses = make_toy_policy(rng, 2, 4)
    logp = numpy_toy_logp(theta, responses)
    base = {"logp_ref": logp + 0.5, "reward": rng.uniform(size=logp.shape)}

    @jax.jit
    def grad_for(logp_behaviour):
        batch = {**base, "logp_behaviour": logp_behaviour}
        return jax.grad(
            lambda p: losses.trajectory_balance_loss(toy_logp(p, responses), batch, 0.1)[0]
        )(jnp.asarray(theta))

    on_policy = grad_for(logp)
    stale = grad_for(logp + rng.normal(0.0, 3.0, logp.shape))
    np.testing.assert_allclose(stale, on_policy, rtol=FLOAT64_RTOL)


def test_tb_log_partition_is_detached(x64):
    """logZ is a stop-gradient of the current θ's log-probs.

    The first-order gradient cannot tell detached from attached logZ (Σ_j residual_j = 0
    per prompt, so the term through logZ vanishes), so detachment is checked where it
    shows: logZ itself has zero gradient, and the Hessian of L in logp is (2/(B·K))·I
    rather than the attached version's (2/(B·K))·(I − 11ᵀ/K) per prompt.
    """
    rng = np.random.default_rng(3)
    num_prompts, num_samples, beta = 2, 3, 0.2
    inputs = random_inputs(rng, num_prompts, num_samples)
    logp, batch = jnp.asarray(inputs["logp"]), to_jax_batch(inputs)

    log_z_grad = jax.grad(
        lambda lp: losses.log_partition_estimate(lp, batch["logp_ref"], batch["reward"], beta).sum()
    )(logp)
    np.testing.assert_array_equal(log_z_grad, np.zeros_like(log_z_grad))

    def attached_tb(lp):
        delta = lp - batch["logp_ref"] - batch["reward"] / beta
        return jnp.mean((delta - delta.mean(1, keepdims=True)) ** 2)

    def detached_tb(lp):
        return losses.trajectory_balance_loss(lp, batch, beta)[0]

    size = num_prompts * num_samples
    identity = np.eye(size).reshape(num_prompts, num_samples, num_prompts, num_samples)
    hessian = jax.jit(jax.hessian(detached_tb))(logp)
    np.testing.assert_allclose(hessian, 2.0 / size * identity, rtol=FLOAT64_RTOL, atol=1e-12)
    attached_hessian = jax.jit(jax.hessian(attached_tb))(logp)
    assert not np.allclose(attached_hessian, hessian)
    np.testing.assert_allclose(
        jax.jit(jax.grad(attached_tb))(logp), jax.jit(jax.grad(detached_tb))(logp), rtol=1e-8
    )


def test_tb_rejects_bad_batches():
    logp = jnp.zeros((2, 3))
    full = {
        "logp_ref": jnp.zeros((2, 3)),
        "reward": jnp.zeros((2, 3)),
        "logp_behaviour": jnp.zeros((2, 3)),
    }
    with pytest.raises(ValueError, match=r"missing.*reward"):
        losses.trajectory_balance_loss(
            logp, {"logp_ref": full["logp_ref"], "logp_behaviour": logp}, 1.0
        )
    with pytest.raises(ValueError, match=r"batch\['reward'\] has shape \(3, 2\)"):
        losses.trajectory_balance_loss(logp, {**full, "reward": jnp.zeros((3, 2))}, 1.0)
    with pytest.raises(ValueError, match=r"\[B, K\]"):
        losses.trajectory_balance_loss(jnp.zeros(6), full, 1.0)
    with pytest.raises(ValueError, match=r"beta must be > 0, got 0\.0"):
        losses.trajectory_balance_loss(logp, full, 0.0)


# --------------------------------------------------------------------------- RLOO


@pytest.mark.parametrize("num_prompts,num_samples,beta", SHAPES_AND_BETAS)
def test_rloo_loss_metrics_and_gradient_match_numpy(num_prompts, num_samples, beta):
    inputs = random_inputs(np.random.default_rng(num_samples), num_prompts, num_samples)
    advantage = numpy_rloo_advantage(inputs["logp"], inputs["logp_ref"], inputs["reward"], beta)
    expected_loss = -np.mean(advantage * inputs["logp"])
    logp, batch = jnp.asarray(inputs["logp"]), to_jax_batch(inputs)

    loss_and_grad = jax.jit(jax.value_and_grad(losses.rloo_loss, has_aux=True))
    (loss, metrics), grad = loss_and_grad(logp, batch, beta)

    np.testing.assert_allclose(loss, expected_loss, rtol=FLOAT32_RTOL, atol=1e-5)
    np.testing.assert_allclose(metrics["loss"], expected_loss, rtol=FLOAT32_RTOL, atol=1e-5)
    np.testing.assert_allclose(
        metrics["kl_mean"],
        (inputs["logp"] - inputs["logp_ref"]).mean(),
        rtol=FLOAT32_RTOL,
        atol=1e-5,
    )
    np.testing.assert_allclose(metrics["reward_mean"], inputs["reward"].mean(), rtol=FLOAT32_RTOL)
    np.testing.assert_allclose(metrics["advantage_std"], advantage.std(), rtol=1e-4, atol=1e-6)
    assert set(metrics) == {"loss", "kl_mean", "reward_mean", "advantage_std"}
    # Both A and the KL penalty inside R are detached: ∂L/∂logp = −A/(B·K) exactly.
    np.testing.assert_allclose(grad, -advantage / advantage.size, rtol=1e-4, atol=1e-7)


def test_rloo_policy_gradient_matches_numpy(x64):
    rng = np.random.default_rng(4)
    num_prompts, num_samples, beta = 3, 4, 0.1
    theta, responses = make_toy_policy(rng, num_prompts, num_samples)
    logp = numpy_toy_logp(theta, responses)
    logp_ref = logp + rng.normal(0.0, 1.0, logp.shape)
    reward = rng.uniform(0.0, 1.0, logp.shape)
    batch = {"logp_ref": jnp.asarray(logp_ref), "reward": jnp.asarray(reward)}

    grad = jax.jit(jax.grad(lambda p: losses.rloo_loss(toy_logp(p, responses), batch, beta)[0]))(
        jnp.asarray(theta)
    )
    advantage = numpy_rloo_advantage(logp, logp_ref, reward, beta)
    expected = -numpy_weighted_score(theta, responses, advantage) / advantage.size
    np.testing.assert_allclose(grad, expected, rtol=FLOAT64_RTOL, atol=1e-12)


def test_rloo_needs_two_samples_per_prompt():
    batch = {"logp_ref": jnp.zeros((3, 1)), "reward": jnp.zeros((3, 1))}
    with pytest.raises(ValueError, match=r"K ≥ 2.*K=1"):
        losses.rloo_loss(jnp.zeros((3, 1)), batch, 0.1)
    with pytest.raises(ValueError, match="K=1"):
        jax.jit(losses.rloo_loss)(jnp.zeros((3, 1)), batch, 0.1)


# --------------------------------------------------------------------------- online DPO


def numpy_online_dpo(logp, logp_ref, reward, beta):
    """Loss and ∂L/∂logp by a loop over prompts: best vs worst response by reward."""
    pairs, grad = [], np.zeros_like(logp)
    for b in range(len(reward)):
        win, lose = int(np.argmax(reward[b])), int(np.argmin(reward[b]))
        if reward[b, win] > reward[b, lose]:
            margin = beta * (
                (logp[b, win] - logp_ref[b, win]) - (logp[b, lose] - logp_ref[b, lose])
            )
            pairs.append((b, win, lose, margin))
    for b, win, lose, margin in pairs:
        sigmoid_of_minus = 1.0 / (1.0 + np.exp(margin))  # −d log σ(m)/dm
        grad[b, win] -= beta * sigmoid_of_minus / len(pairs)
        grad[b, lose] += beta * sigmoid_of_minus / len(pairs)
    losses_ = [np.log1p(np.exp(-margin)) for *_, margin in pairs]
    return (np.mean(losses_) if pairs else 0.0), grad, len(pairs)


@pytest.mark.parametrize("num_prompts,num_samples,beta", SHAPES_AND_BETAS)
def test_online_dpo_loss_and_gradient_match_numpy(num_prompts, num_samples, beta, x64):
    inputs = random_inputs(np.random.default_rng(num_samples + 7), num_prompts, num_samples)
    inputs["logp"] = inputs["logp"] * 0.05  # margins β·Δh of order 1: both σ tails matter
    reward = np.round(inputs["reward"] * 2) / 2  # ties, and prompts with no pair
    reward[0] = 0.5
    inputs["reward"] = reward
    expected_loss, expected_grad, num_pairs = numpy_online_dpo(
        inputs["logp"], inputs["logp_ref"], reward, beta
    )
    logp, batch = jnp.asarray(inputs["logp"]), to_jax_batch(inputs)
    (loss, metrics), grad = jax.jit(jax.value_and_grad(losses.online_dpo_loss, has_aux=True))(
        logp, batch, beta
    )
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-10, atol=1e-12)
    assert grad[0].tolist() == [0.0] * num_samples  # all rewards equal: no pair, no gradient
    assert metrics["pair_fraction"] == pytest.approx(num_pairs / num_prompts)


def test_online_dpo_prefers_the_rewarded_response():
    batch = {"logp_ref": jnp.zeros((1, 3)), "reward": jnp.asarray([[0.0, 1.0, 0.5]])}
    grad = jax.grad(lambda logp: losses.online_dpo_loss(logp, batch, 0.1)[0])(jnp.zeros((1, 3)))
    assert grad[0, 1] < 0 < grad[0, 0] and grad[0, 2] == 0  # descent raises the best's logp
    with pytest.raises(ValueError, match="K=1"):
        losses.online_dpo_loss(
            jnp.zeros((3, 1)), {"logp_ref": jnp.zeros((3, 1)), "reward": jnp.zeros((3, 1))}, 0.1
        )


def test_rloo_is_jittable_with_traced_beta():
    inputs = random_inputs(np.random.default_rng(5), 2, 3)
    logp, batch = jnp.asarray(inputs["logp"]), to_jax_batch(inputs)
    eager_loss, _ = losses.rloo_loss(logp, batch, 0.3)
    jit_loss, _ = jax.jit(losses.rloo_loss)(logp, batch, jnp.float32(0.3))
    np.testing.assert_allclose(jit_loss, eager_loss, rtol=FLOAT32_RTOL)


# --------------------------------------------------------------------------- β schedules


def test_linear_beta_schedule_values():
    schedule = losses.make_beta_schedule("linear", 0.012, 0.004, 100)
    for step, expected in [
        (0, 0.012),
        (50, 0.008),
        (25, 0.010),
        (100, 0.004),
        (1000, 0.004),
        (-5, 0.012),
    ]:
        np.testing.assert_allclose(schedule(step), expected, rtol=1e-6, err_msg=f"step {step}")


def test_linear_beta_schedule_can_increase():
    schedule = losses.make_beta_schedule("linear", 0.05, 1.0, 10)
    np.testing.assert_allclose(schedule(5), 0.525, rtol=1e-6)
    np.testing.assert_allclose(schedule(20), 1.0, rtol=1e-6)


def authors_beta(update: int, beta0: float, beta1: float, target: int, stop: int) -> float:
    """The TBA authors' rule for update u = 1, 2, ... (../shared/reference)."""
    if update < stop:
        return beta1 * (update - 1) / target + beta0 * (1 - (update - 1) / target)
    return beta1


@pytest.mark.parametrize(
    "beta0, beta1, target, stop", [(1.0, 0.05, 128, 32), (0.014, 0.004, 500, 500)]
)
def test_a_cut_linear_beta_schedule_is_the_tba_authors_rule(beta0, beta1, target, stop):
    schedule = losses.make_beta_schedule("linear", beta0, beta1, target, cut_steps=stop)
    for update in range(1, 2 * target):
        # the learner's step counts updates from 0
        np.testing.assert_allclose(
            schedule(update - 1), authors_beta(update, beta0, beta1, target, stop), rtol=1e-6
        )
    if stop == 32:  # TL;DR: ≈ 0.778 at update 31, 0.05 from update 32 on
        np.testing.assert_allclose(schedule(30), 0.7773, atol=1e-3)
        np.testing.assert_allclose(schedule(31), 0.05, rtol=1e-6)


def test_constant_beta_schedule_values():
    schedule = losses.make_beta_schedule("constant", 0.3, 0.01, 100)
    for step in (0, 50, 100, 10_000):
        np.testing.assert_allclose(schedule(step), 0.3, rtol=1e-6)


@pytest.mark.parametrize("kind", ["constant", "linear"])
def test_beta_schedules_are_jittable(kind):
    schedule = losses.make_beta_schedule(kind, 1.0, 0.05, 10)
    jitted = jax.jit(schedule)
    steps = jnp.arange(-2, 15, dtype=jnp.int32)
    np.testing.assert_allclose(jitted(steps), schedule(steps), rtol=1e-6)
    np.testing.assert_allclose(jitted(jnp.int32(5)), schedule(5), rtol=1e-6)
    assert jitted(steps).shape == steps.shape


@pytest.mark.parametrize(
    "args,message",
    [
        (("cosine", 1.0, 0.1, 10), "cosine"),
        (("linear", 0.0, 0.1, 10), r"beta_start must be > 0, got 0\.0"),
        (("constant", -1.0, 0.1, 10), r"beta_start must be > 0, got -1\.0"),
        (("linear", 1.0, -0.1, 10), r"beta_end must be > 0.*got -0\.1"),
        (("linear", 1.0, 0.1, 0), r"anneal_steps must be > 0.*got 0"),
        (("linear", 1.0, 0.1, 10, -1), r"cut_steps must be >= 0"),
    ],
)
def test_beta_schedule_errors(args, message):
    with pytest.raises(ValueError, match=message):
        losses.make_beta_schedule(*args)


# --------------------------------------------------------------------------- registry


def test_registry_flags_and_names():
    assert losses.get_loss("tb").on_policy is False
    assert losses.get_loss("rloo").on_policy is True
    assert losses.get_loss("tb").name == "tb"
    assert losses.get_loss("tb").fn is losses.trajectory_balance_loss
    assert {"tb", "rloo"} <= set(losses.registered_losses())


def test_unknown_loss_lists_registered_names():
    with pytest.raises(ValueError, match="'sac'") as error:
        losses.get_loss("sac")
    assert "'tb'" in str(error.value)
    assert "'rloo'" in str(error.value)


def test_register_loss_adds_and_rejects_duplicates(monkeypatch):
    monkeypatch.setattr(losses, "_REGISTRY", dict(losses._REGISTRY))

    @losses.register_loss("toy", on_policy=True)
    def toy_loss(logp, batch, beta):
        return jnp.mean(logp), {}

    assert losses.get_loss("toy").fn is toy_loss
    assert "toy" in losses.registered_losses()
    with pytest.raises(ValueError, match="already registered"):
        losses.register_loss("tb", on_policy=False)(toy_loss)


# --------------------------------------------------------------------------- GRPO


def numpy_grpo(token_logp, behaviour, ref, mask, reward, beta, eps, scale, aggregation):
    """GRPO's loss and ∂L/∂token_logp by loops over prompts, responses and tokens."""
    num_prompts, num_samples, length = token_logp.shape
    per_token, grad = np.zeros_like(token_logp), np.zeros_like(token_logp)
    for b in range(num_prompts):
        mean, std = reward[b].mean(), reward[b].std()
        for j in range(num_samples):
            advantage = (reward[b, j] - mean) / ((std + 1e-4) if scale else 1.0)
            for t in range(length):
                if not mask[b, j, t]:
                    continue
                ratio = np.exp(token_logp[b, j, t] - behaviour[b, j, t])
                clipped = min(max(ratio, 1 - eps), 1 + eps)
                d = ref[b, j, t] - token_logp[b, j, t]
                per_token[b, j, t] = -min(ratio * advantage, clipped * advantage) + beta * (
                    np.exp(d) - d - 1
                )
                unclipped_active = ratio * advantage <= clipped * advantage
                grad[b, j, t] = beta * (1 - np.exp(d)) - (
                    ratio * advantage if unclipped_active else 0
                )
    if aggregation == "token":
        weights = np.full_like(token_logp, 1.0 / mask.sum())
    else:
        lengths = mask.sum(-1, keepdims=True)
        weights = np.broadcast_to(1.0 / (lengths * num_prompts * num_samples), mask.shape)
    return float(np.sum(per_token * weights)), grad * weights * mask


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("scale", [True, False])
def test_grpo_loss_and_gradient_match_numpy(aggregation, scale, x64):
    rng = np.random.default_rng(11)
    shape, beta, eps = (3, 4, 5), 0.04, 0.2
    behaviour = rng.normal(-2.0, 0.5, shape)
    token_logp = behaviour + rng.normal(0.0, 0.3, shape)  # ratios inside and outside the clip
    ref = token_logp + rng.normal(0.0, 0.5, shape)
    mask = (np.arange(5) < rng.integers(1, 6, shape[:2])[..., None]).astype(np.float64)
    token_logp, behaviour, ref = token_logp * mask, behaviour * mask, ref * mask
    reward = rng.integers(0, 3, shape[:2]).astype(np.float64)
    expected_loss, expected_grad = numpy_grpo(
        token_logp, behaviour, ref, mask, reward, beta, eps, scale, aggregation
    )
    batch = {
        "reward": jnp.asarray(reward),
        "token_logp_ref": jnp.asarray(ref),
        "token_logp_behaviour": jnp.asarray(behaviour),
        "response_mask": jnp.asarray(mask),
    }
    options = dict(clip_epsilon=eps, scale_rewards=scale, aggregation=aggregation)
    (loss, metrics), grad = jax.value_and_grad(
        lambda x: losses.grpo_loss(x, batch, beta, **options), has_aux=True
    )(jnp.asarray(token_logp))
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-10)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-9, atol=1e-14)
    assert 0 < metrics["clip_fraction"] < 1  # both branches were exercised


def test_grpo_advantages_are_group_normalised():
    reward = jnp.asarray([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    scaled = losses.group_normalised_advantages(reward, scale=True, std_eps=0.0)
    np.testing.assert_allclose(scaled[0], [1.0, -1.0, -1.0, 1.0])
    unscaled = losses.group_normalised_advantages(reward, scale=False, std_eps=0.0)
    np.testing.assert_allclose(unscaled, [[0.5, -0.5, -0.5, 0.5], [0.0] * 4])
    assert losses.get_loss("grpo").token_level and not losses.get_loss("tb").token_level
