"""Evaluation: the unbiased pass@k estimator, sampled pass@k, greedy accuracy, evaluate_policy."""

import logging
import math

import jax
import numpy as np
import pytest

from tba_jax import evaluation
from tba_jax.models import abstract_model, init_model, preset
from tba_jax.models.tokenizers import CharTokenizer
from tba_jax.sampling.generate import Generation
from tba_jax.tasks import EvalSettings, Task


def comb_pass_at_k(n: int, c: int, k: int) -> float:
    """The definition, with exact integers: 1 − C(n−c, k) / C(n, k)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# ------------------------------------------------------------------------------ pass_at_k


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 1, 0.4),  # pass@1 is the fraction correct
        (5, 2, 2, 0.7),  # 1 − C(3,2)/C(5,2) = 1 − 3/10
        (10, 3, 4, 1 - 35 / 210),  # 1 − C(7,4)/C(10,4)
        (4, 0, 2, 0.0),  # nothing correct
        (4, 3, 2, 1.0),  # n − c < k: every k-subset holds a correct sample
        (3, 1, 3, 1.0),  # k = n: any correct sample passes
        (3, 0, 3, 0.0),
        (6, 6, 1, 1.0),
    ],
)
def test_pass_at_k_matches_hand_computed_values(n, c, k, expected):
    assert float(evaluation.pass_at_k(n, c, k)) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_vectorised_and_equals_the_binomial_definition():
    rng = np.random.default_rng(0)
    n = rng.integers(16, 200, size=64)
    c = rng.integers(0, n + 1)
    for k in (1, 2, 5, 16):
        got = evaluation.pass_at_k(n, c, k)
        assert got.shape == (64,)
        expected = [comb_pass_at_k(int(a), int(b), k) for a, b in zip(n, c, strict=True)]
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)


def test_pass_at_k_broadcasts_one_sample_count_over_problems():
    got = evaluation.pass_at_k(8, np.array([0, 1, 4, 8]), 3)
    np.testing.assert_allclose(got, [comb_pass_at_k(8, c, 3) for c in (0, 1, 4, 8)], atol=1e-12)


@pytest.mark.parametrize(
    "n, c, k, message",
    [
        (3, 1, 4, "at least 4 samples"),
        (5, 6, 1, r"in \[0, num_samples\]"),
        (5, -1, 1, r"in \[0, num_samples\]"),
        (5, 1, 0, "must be >= 1"),
    ],
)
def test_pass_at_k_rejects_impossible_inputs(n, c, k, message):
    with pytest.raises(ValueError, match=message):
        evaluation.pass_at_k(n, c, k)


# ---------------------------------------------------------------------- sampled_pass_at_k

ALPHABET = "01"
TOKENIZER = CharTokenizer(ALPHABET)


def scripted_generate_fn(outcomes: list[str], batch_size: int, keys: list):
    """A fake generate function: row r of all calls together answers `outcomes[r]` ("1"
    right, "0" wrong); padding rows past the end answer "0". Records each call's key."""
    calls = []

    def generate_fn(params, prompt_tokens, prompt_mask, rng):
        assert prompt_tokens.shape[0] == batch_size
        keys.append(jax.random.key_data(rng))
        start = len(calls) * batch_size
        calls.append(start)
        answers = [
            outcomes[i] if i < len(outcomes) else "0" for i in range(start, start + batch_size)
        ]
        tokens = np.array([TOKENIZER.encode(a, add_eos=True) for a in answers], np.int32)
        lengths = np.full(batch_size, tokens.shape[1], np.int32)
        return Generation(
            tokens, np.ones(tokens.shape, np.float32), lengths, np.zeros(tokens.shape)
        )

    return generate_fn


def right_answer_rewards(examples, responses):
    return np.array([1.0 if text == "1" else 0.0 for text in responses], np.float32)


def test_sampled_pass_at_k_groups_samples_by_problem_and_averages_the_estimator():
    num_samples = 4
    correct_per_problem = [0, 1, 3, 4, 2]
    outcomes = []
    for correct in correct_per_problem:  # rows are problem-major: problem i owns 4 rows
        outcomes += ["1"] * correct + ["0"] * (num_samples - correct)
    examples = [{"id": i, "prompt": "0"} for i in range(len(correct_per_problem))]
    keys = []
    batch_size = 6  # 20 rows in 4 calls, the last one padded
    result = evaluation.sampled_pass_at_k(
        scripted_generate_fn(outcomes, batch_size, keys),
        None,
        examples,
        TOKENIZER,
        right_answer_rewards,
        num_samples=num_samples,
        ks=(1, 2, 4),
        max_prompt_len=2,
        batch_size=batch_size,
        rng=jax.random.key(7),
    )
    for k in (1, 2, 4):
        expected = np.mean([comb_pass_at_k(num_samples, c, k) for c in correct_per_problem])
        assert result[f"pass@{k}"] == pytest.approx(expected, abs=1e-12)
    assert result["pass@1"] == pytest.approx(10 / 20)
    assert result["mean_reward"] == pytest.approx(10 / 20)
    assert result["response_length"] == 2.0  # one character and EOS
    assert result["num_samples"] == num_samples
    assert len(keys) == 4 and len({bytes(np.asarray(key)) for key in keys}) == 4  # fresh draws


@pytest.mark.parametrize("ks", [(1, 8), (0,), ()])
def test_sampled_pass_at_k_rejects_ks_it_cannot_estimate(ks):
    with pytest.raises(ValueError, match="must be non-empty, each in"):
        evaluation.sampled_pass_at_k(
            None,
            None,
            [{"id": 0, "prompt": "0"}],
            TOKENIZER,
            right_answer_rewards,
            num_samples=4,
            ks=ks,
            max_prompt_len=2,
            batch_size=4,
            rng=jax.random.key(0),
        )


def test_greedy_accuracy_is_the_mean_reward_over_real_problems_only():
    outcomes = ["1", "0", "1"]
    examples = [{"id": i, "prompt": "0"} for i in range(3)]
    result = evaluation.greedy_accuracy(
        scripted_generate_fn(outcomes, 2, []),
        None,
        examples,
        TOKENIZER,
        right_answer_rewards,
        max_prompt_len=2,
        batch_size=2,  # the padding row of the second batch must not count
    )
    assert result == {"accuracy": pytest.approx(2 / 3), "response_length": 2.0}


# ------------------------------------------------------------------------ evaluate_policy


def toy_task(num_problems: int = 6) -> Task:
    tokenizer = CharTokenizer("0123456789+=")
    examples = [{"id": i, "prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(num_problems)]

    def rewards(batch, responses):  # any fixed rule with mixed outcomes
        return np.array([1.0 if text[:1] in "02468" else 0.0 for text in responses], np.float32)

    return Task("toy", examples, examples, tokenizer, rewards, {})


def settings(**overrides) -> EvalSettings:
    values = dict(
        max_prompt_len=4,
        max_new_tokens=5,
        num_examples=0,
        batch_size=8,
        num_samples=4,
        ks=(1, 2, 4),
        temperature=0.7,
        top_k=0,
        top_p=1.0,
        seed=0,
    )
    return EvalSettings(**{**values, **overrides})


@pytest.fixture(scope="module")
def micro_policy():
    task = toy_task()
    config = preset("micro", vocab_size=task.tokenizer.vocab_size, max_seq_len=16)
    model, _ = abstract_model(config)
    _, params = init_model(config, seed=0)  # greedy gets 2 of the 6 right
    return model, params, task


def test_evaluate_policy_with_top_k_one_sampling_equals_greedy(micro_policy):
    model, params, task = micro_policy
    result = evaluation.evaluate_policy(model, params, task, settings(top_k=1))
    assert 0.0 < result["greedy_pass@1"] < 1.0  # the check below is not trivially 0 == 0
    assert result["num_problems"] == 6 and result["num_samples"] == 4
    assert result["max_new_tokens"] == 5 and result["temperature"] == 0.7
    # Sampling from the top-1 token is greedy decoding: every k gives the greedy accuracy.
    for k in (1, 2, 4):
        assert result[f"pass@{k}"] == pytest.approx(result["greedy_pass@1"])
    assert result["sampled_response_length"] == pytest.approx(result["greedy_response_length"])


def test_evaluate_policy_greedy_only_and_first_n_problems(micro_policy):
    model, params, task = micro_policy
    result = evaluation.evaluate_policy(
        model, params, task, settings(num_samples=0, num_examples=4)
    )
    assert result["num_problems"] == 4
    assert not [key for key in result if key.startswith("pass@")]
    assert result["greedy_pass@1"] * 4 == pytest.approx(round(result["greedy_pass@1"] * 4))


def test_more_problems_than_the_test_split_holds_are_all_of_them_with_a_warning(
    micro_policy, caplog
):
    model, params, task = micro_policy
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # an in-training evaluation asks again: said once
            result = evaluation.evaluate_policy(
                model, params, task, settings(num_samples=0, num_examples=100)
            )
    assert result["num_problems"] == 6
    said = [r.getMessage() for r in caplog.records if "num_examples=100" in r.getMessage()]
    assert said == [
        "num_examples=100 is more than the 6 test examples of the toy task; evaluating all 6."
    ]


def test_evaluate_policy_refuses_more_tokens_than_learned_positions():
    task = toy_task()
    config = preset("micro", vocab_size=task.tokenizer.vocab_size, max_seq_len=8)
    config = type(config)(**{**config.to_dict(), "position_embedding": "learned"})
    model, params = abstract_model(config)
    with pytest.raises(ValueError, match="learned positions; lower max_new_tokens"):
        evaluation.evaluate_policy(model, params, task, settings(max_new_tokens=5))
