"""VinePPO (tba_jax.vineppo): step splitting, Monte Carlo values from rollouts and the
advantages they give, against hand-worked cases and loops; its loss against GRPO's."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import hand_made_trajectory

from tba_jax import losses, vineppo
from tba_jax.metrics import RateMeter, TimeSplit
from tba_jax.models import compute_dtype_cast, preset
from tba_jax.models.tokenizers import CharTokenizer
from tba_jax.sampling.generate import Generation
from tba_jax.trajectories import collate

TOKENIZER = CharTokenizer.for_arithmetic("+-")
T = 10


def ids(text: str, eos: bool = False) -> np.ndarray:
    return np.asarray(TOKENIZER.encode(text, add_eos=eos), np.int32)


def padded(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.zeros((len(rows), T), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    return tokens, np.array([len(row) for row in rows])


def test_boundary_tokens_are_those_holding_a_delimiter():
    is_boundary = vineppo.boundary_tokens(TOKENIZER, ",>")
    assert sorted(TOKENIZER.decode([i]) for i in np.flatnonzero(is_boundary)) == [",", ">"]
    with pytest.raises(ValueError, match="no token of the tokenizer holds"):
        vineppo.boundary_tokens(TOKENIZER, "#")


def test_steps_start_after_each_delimiter_inside_the_response():
    is_boundary = vineppo.boundary_tokens(TOKENIZER, ",>")
    tokens, lengths = padded([ids("68,61>61", eos=True), ids("7>", eos=False), ids("")])
    starts = vineppo.step_starts(tokens, lengths, is_boundary, max_steps=4)
    np.testing.assert_array_equal(starts[0], [0, 3, 6, -1])  # "68," | "61>" | "61</s>"
    np.testing.assert_array_equal(starts[1], [0, -1, -1, -1])  # a final ">" starts nothing
    np.testing.assert_array_equal(starts[2], [-1, -1, -1, -1])
    capped = vineppo.step_starts(tokens, lengths, is_boundary, max_steps=2)
    np.testing.assert_array_equal(capped[0], [0, 3])  # the rest is the last step


def test_step_advantages_match_a_loop_over_tokens():
    rng = np.random.default_rng(0)
    lengths = np.array([9, 4, 0, 10])
    starts = np.array([[0, 2, 7], [0, 1, -1], [-1, -1, -1], [0, 5, 6]])
    values = rng.normal(size=(4, 3)).astype(np.float32)
    reward = rng.normal(size=4).astype(np.float32)
    got = vineppo.step_advantages(starts, values, reward, lengths, T)
    want = np.zeros((4, T), np.float32)
    for row in range(4):
        valid = [s for s in starts[row] if s >= 0]
        for t in range(lengths[row]):
            j = max(i for i, s in enumerate(valid) if s <= t)  # the step token t is in
            value_after = values[row, j + 1] if j + 1 < len(valid) else reward[row]
            want[row, t] = value_after - values[row, j]
    np.testing.assert_allclose(got, want, rtol=1e-6)


class ScriptedGenerate:
    """A generate_fn that continues every prefix with the same tokens (EOS-terminated or
    not) and records the prompts it was given."""

    def __init__(self, continuation: np.ndarray):
        self.continuation, self.prompts = continuation, []

    def __call__(self, params, prompt_tokens, prompt_mask, rng):
        del params, rng
        self.prompts += [row[mask] for row, mask in zip(prompt_tokens, prompt_mask, strict=True)]
        rows = len(prompt_tokens)
        tokens = np.zeros((rows, T), np.int32)
        tokens[:, : len(self.continuation)] = self.continuation
        lengths = np.full(rows, len(self.continuation), np.int32)
        mask = (np.arange(T) < lengths[:, None]).astype(np.float32)
        return Generation(tokens, mask, lengths, np.zeros((rows, T), np.float32))


def batch_of(responses: list[str], rewards: list[float], prompt: str = "3+4="):
    rows = [
        hand_made_trajectory(ids(prompt), ids(response, eos=True), reward, prompt_id=7)
        for response, reward in zip(responses, rewards, strict=True)
    ]
    return collate(
        rows,
        max_prompt_len=6,
        max_response_len=T,
        pad_id=TOKENIZER.pad_id,
        prompt_ids=np.array([7]),
        from_recency=np.array([True]),
    )


def value_stage(generate_fn, penalty=None, rows_per_call=0):
    def digit_sum(examples, texts):  # a reward that depends on the whole response text
        assert all(example["id"] == 7 for example in examples)
        return np.array([sum(int(c) for c in text if c.isdigit()) for text in texts], np.float32)

    return vineppo.MonteCarloValues(
        generate_fn=generate_fn,
        tokenizer=TOKENIZER,
        rewards_fn=digit_sum,
        examples_by_id={7: {"id": 7}},
        max_prompt_len=6,
        max_response_len=T,
        is_boundary=vineppo.boundary_tokens(TOKENIZER, ","),
        config=vineppo.VineConfig(rollouts=2, step_delimiters=",", rows_per_call=rows_per_call),
        time_split=TimeSplit(),
        rates=RateMeter(),
        non_eos_penalty=penalty,
    )


@pytest.mark.parametrize("rows_per_call", [0, 3])  # one call, or calls with a padded last one
def test_values_are_the_mean_reward_of_continuations_from_each_step(rows_per_call):
    generate = ScriptedGenerate(ids("1", eos=True))
    stage = value_stage(generate, rows_per_call=rows_per_call)
    batch = batch_of(["2,5", "9"], [7.0, 9.0])  # responses "2,5</s>" and "9</s>"
    advantages = stage.advantages(None, batch, jax.random.key(0))
    # "2,5": V(0) = reward("1") = 1, V(2) = reward("2,1") = 3, then the sample's 7
    np.testing.assert_allclose(advantages[0, :4], [2, 2, 4, 4])
    # "9": V(0) = 1, then its reward 9
    np.testing.assert_allclose(advantages[1, :2], [8, 8])
    assert not advantages[:, 4:].any() and not advantages[1, 2:].any()
    prefixes = sorted({TOKENIZER.decode(p) for p in generate.prompts})
    assert prefixes == ["3+4=", "3+4=2,"]  # each start's prefix: the prompt, then y_<s
    assert stage.rates.totals()[vineppo.ROLLOUT_SAMPLES] == 3 * 2  # starts × rollouts


def test_a_continuation_past_the_budget_is_cut_and_penalised():
    generate = ScriptedGenerate(ids("11111111"))  # 8 tokens, no EOS
    stage = value_stage(generate, penalty=-1.0)
    batch = batch_of(["2,5"], [7.0])
    advantages = stage.advantages(None, batch, jax.random.key(0))
    # both starts' continuations run out of budget without EOS: V = −1 at both
    np.testing.assert_allclose(advantages[0, :4], [0, 0, 8, 8])


def test_vineppo_loss_with_group_advantages_is_grpo():
    rng = np.random.default_rng(3)
    shape = (2, 4, 5)
    behaviour = rng.normal(-2.0, 0.5, shape)
    token_logp = behaviour + rng.normal(0.0, 0.3, shape)
    mask = (np.arange(5) < rng.integers(1, 6, shape[:2])[..., None]).astype(np.float32)
    reward = rng.integers(0, 3, shape[:2]).astype(np.float32)
    batch = {
        "reward": jnp.asarray(reward),
        "token_logp_ref": jnp.asarray(token_logp * mask + 0.1),
        "token_logp_behaviour": jnp.asarray(behaviour * mask),
        "response_mask": jnp.asarray(mask),
    }
    group = losses.group_normalised_advantages(batch["reward"], True, 1e-4)
    batch["token_advantage"] = jnp.broadcast_to(group[..., None], shape) * mask
    logp = jnp.asarray(token_logp * mask)
    for aggregation in ("token", "sequence"):
        want, _ = losses.grpo_loss(logp, batch, 0.05, aggregation=aggregation)
        got, _ = losses.vineppo_loss(logp, batch, 0.05, aggregation=aggregation)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        grad_vine = jax.grad(lambda x: losses.vineppo_loss(x, batch, 0.05)[0])(logp)
        grad_grpo = jax.grad(lambda x: losses.grpo_loss(x, batch, 0.05)[0])(logp)
        np.testing.assert_allclose(grad_vine, grad_grpo, rtol=1e-5, atol=1e-8)
    assert losses.get_loss("vineppo").extra_fields == ("token_advantage",)


def test_an_async_vineppo_run_trains_on_rollout_advantages(tmp_path):
    from configs.arithmetic import get_config
    from tba_jax.metrics import read_scalars
    from tba_jax.train import train_and_evaluate

    # 150 warm-start steps (about as fast as the smoke run's 3) leave ~10% of the first
    # samples rewarded; after 3 nearly every reward is 0, and so every advantage.
    config = get_config("smoke,method=vineppo,warm_start.steps=150")
    summary = train_and_evaluate(config, str(tmp_path))
    assert summary["mode"] == "async" and summary["learner_steps"] == 4
    assert "max_policy_lag" in summary
    scalars = read_scalars(str(tmp_path / "tensorboard"))
    assert {"advantage_std", "clip_fraction", "kl_mean"} <= set(scalars)
    assert any(value > 0 for _, value in scalars["advantage_std"])  # the stage ran


def test_step_delimiters_no_token_holds_are_refused_before_the_warm_start(tmp_path):
    """Found once the task (its tokenizer) is built, in one line, the workdir the run made
    gone again (until 2026-11-29 a traceback after the warm start and the first save)."""
    from configs.arithmetic import get_config
    from tba_jax.config_lib import ConfigError
    from tba_jax.train import train_and_evaluate

    config = get_config("smoke,method=vineppo,loss.vineppo.step_delimiters=@")
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"no token of the tokenizer holds any of .*'@'"):
        train_and_evaluate(config, str(workdir))
    assert not workdir.exists()


def test_rollouts_reuse_the_params_a_sync_source_just_published():
    """A sync source publishes after every step, so the value stage's rollouts take the
    sampler's copy (no second publish); params newer than the source's (async, k > 1) are
    published for them."""
    from tba_jax.train import with_rollout_advantages

    @dataclasses.dataclass
    class Batch:
        token_advantage: object = None

    published_copies, rolled_out_with = [], []
    model_config = preset("micro", vocab_size=16, dtype="bfloat16")

    def publish(params, shardings, cast):  # held in the compute dtype, as a store holds them
        assert cast is compute_dtype_cast(model_config)
        return published_copies.append(params) or "copy"

    run = types.SimpleNamespace(
        group=types.SimpleNamespace(publish=publish),
        sampler_shardings=None,
        config=types.SimpleNamespace(seed=0),
        model=types.SimpleNamespace(config=model_config),
    )
    value_stage = types.SimpleNamespace(
        advantages=lambda params, batch, rng: rolled_out_with.append(params) or "advantages"
    )
    source = types.SimpleNamespace(store=types.SimpleNamespace(get=lambda: ("on sampler", 6)))
    batch = with_rollout_advantages(run, value_stage, source, "learner's", Batch(), step=6)
    assert batch.token_advantage == "advantages"
    assert rolled_out_with == ["on sampler"] and published_copies == []
    with_rollout_advantages(run, value_stage, source, "learner's", Batch(), step=7)
    assert rolled_out_with[-1] == "copy" and published_copies == ["learner's"]
    # a learner process of roles_by_process has no policy store: it publishes for itself
    no_store = types.SimpleNamespace(store=None)
    with_rollout_advantages(run, value_stage, no_store, "newer", Batch(), step=8)
    assert rolled_out_with[-1] == "copy" and published_copies[-1] == "newer"
