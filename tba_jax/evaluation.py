"""Held-out evaluation: greedy accuracy (pass@1) and sampled pass@k of a policy on a task.

- `greedy_accuracy`: mean reward of one greedy response per problem.
- `pass_at_k`: the unbiased estimator 1 − C(n−c, k)/C(n, k) of Chen et al. (2021,
  "Evaluating Large Language Models Trained on Code"), per problem, from n samples of
  which c are correct.
- `sampled_pass_at_k`: draws n responses per problem and reports pass@k for each k.
- `evaluate_policy`: both, for a task's test split, as one JSON-able dict (what
  `experiments/evaluate.py` writes).

A sampled response is *correct* when its reward is at least `CORRECT_REWARD` (the
verifiable rewards of the built-in tasks and GSM8K give 1.0 for a right answer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from tba_jax.errors import ConfigError
from tba_jax.models.tokenizers import Tokenizer
from tba_jax.sampling.generate import generated_batches
from tba_jax.tasks.base import (
    EvalSettings,
    check_sequence_fits,
    evaluation_generate_fns,
    first_test_examples,
)

if TYPE_CHECKING:
    from tba_jax.models import Model, Params
    from tba_jax.tasks.base import Task

BatchRewardFn = Callable[[Sequence[dict], Sequence[str]], np.ndarray]
CORRECT_REWARD = 1.0
GREEDY_RNG_SEED = 0  # greedy decoding ignores the key; one fixed key keeps calls identical


def generate_and_score(
    generate_fn,
    params,
    examples: Sequence[dict],
    tokenizer: Tokenizer,
    rewards_fn: BatchRewardFn,
    *,
    max_prompt_len: int,
    batch_size: int,
    rng: jax.Array,
) -> tuple[np.ndarray, np.ndarray]:
    """One response per example (batch i drawn with `fold_in(rng, i)`): (rewards, lengths),
    float32 and int32 arrays of len(examples)."""
    rewards, lengths = [], []
    for batch_examples, texts, response_lengths in generated_responses(
        generate_fn,
        params,
        examples,
        tokenizer,
        max_prompt_len=max_prompt_len,
        batch_size=batch_size,
        rng=rng,
    ):
        rewards.extend(rewards_fn(batch_examples, texts))
        lengths.extend(response_lengths)
    return np.asarray(rewards, np.float32), np.asarray(lengths, np.int32)


def generated_responses(
    generate_fn,
    params,
    examples: Sequence[dict],
    tokenizer: Tokenizer,
    *,
    max_prompt_len: int,
    batch_size: int,
    rng: jax.Array,
) -> Iterator[tuple[list[dict], list[str], np.ndarray]]:
    """One decoded response per example, batch by batch (`generated_batches`): yields
    (the batch's examples, their responses' texts, their lengths in tokens, int32)."""
    for batch_examples, _, _, out in generated_batches(
        generate_fn,
        params,
        examples,
        tokenizer,
        max_prompt_len=max_prompt_len,
        batch_size=batch_size,
        rng=rng,
    ):
        tokens, response_lengths = jax.device_get((out.tokens, out.lengths))
        real = len(batch_examples)
        texts = [tokenizer.decode(tokens[row]) for row in range(real)]
        yield batch_examples, texts, np.asarray(response_lengths[:real], np.int32)


def greedy_accuracy(
    generate_fn,
    params,
    examples: Sequence[dict],
    tokenizer: Tokenizer,
    rewards_fn: BatchRewardFn,
    *,
    max_prompt_len: int,
    batch_size: int,
) -> dict[str, float]:
    """Mean reward of greedy responses. `generate_fn` is a greedy `make_generate_fn` result."""
    rewards, lengths = generate_and_score(
        generate_fn,
        params,
        examples,
        tokenizer,
        rewards_fn,
        max_prompt_len=max_prompt_len,
        batch_size=batch_size,
        rng=jax.random.key(GREEDY_RNG_SEED),
    )
    return {"accuracy": float(np.mean(rewards)), "response_length": float(np.mean(lengths))}


def pass_at_k(num_samples, num_correct, k: int) -> np.ndarray:
    """Unbiased pass@k per problem: 1 − C(n−c, k) / C(n, k), for n samples with c correct.

    `num_samples` and `num_correct` are ints or arrays (one entry per problem; they
    broadcast). Computed as 1 − Π_{i=n−c+1..n} (1 − k/i), which is exact for c = 0
    (0.0) and n − c < k (1.0) and never forms the large binomials. Needs n >= k.
    """
    n = np.asarray(num_samples, np.int64)
    c = np.asarray(num_correct, np.int64)
    n, c = np.broadcast_arrays(n, c)
    if k < 1:
        raise ValueError(f"k={k} must be >= 1.")
    if np.any(c < 0) or np.any(c > n):
        raise ValueError("Every num_correct must be in [0, num_samples] of its problem.")
    if np.any(n < k):
        raise ValueError(
            f"pass@{k} needs at least {k} samples per problem but some have "
            f"{int(n.min())}; draw more samples or lower k."
        )
    if n.size == 0:
        return np.zeros(n.shape)
    i = np.arange(1, int(n.max()) + 1)  # [I]
    in_product = (i > (n - c)[..., None]) & (i <= n[..., None])  # [..., I]
    factors = np.where(in_product, 1.0 - k / i, 1.0)
    return 1.0 - np.prod(factors, axis=-1)


def check_settings(settings: EvalSettings) -> None:
    """ConfigError for evaluation settings that cannot work, before anything is loaded
    (`experiments/evaluate.py`'s flags, `RunView.evaluate`'s arguments)."""
    if settings.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={settings.max_new_tokens} must be >= 1.")
    if settings.num_samples < 0:
        raise ConfigError(f"num_samples={settings.num_samples} must be >= 0 (0: greedy only).")
    if settings.num_examples < 0:  # as a slice's end, -1 would leave out the last problem
        raise ConfigError(f"num_examples={settings.num_examples} must be >= 0 (0: all).")
    if settings.num_samples:
        try:
            check_ks(settings.ks, settings.num_samples)
        except ValueError as error:
            raise ConfigError(str(error)) from None


def check_ks(ks: Sequence[int], num_samples: int) -> None:
    """ValueError unless every k is in [1, num_samples]."""
    bad = [k for k in ks if not 1 <= k <= num_samples]
    if bad or not ks:
        raise ValueError(
            f"ks={list(ks)} must be non-empty, each in [1, num_samples={num_samples}]; "
            "draw more samples or lower k."
        )


def sampled_pass_at_k(
    generate_fn,
    params,
    examples: Sequence[dict],
    tokenizer: Tokenizer,
    rewards_fn: BatchRewardFn,
    *,
    num_samples: int,
    ks: Sequence[int],
    max_prompt_len: int,
    batch_size: int,
    rng: jax.Array,
    correct_reward: float = CORRECT_REWARD,
) -> dict[str, float]:
    """pass@k (mean over problems) for each k, from `num_samples` sampled responses per problem.

    `generate_fn` is a sampling `make_generate_fn` result; `batch_size` counts response
    rows. Returns `pass@{k}` for each k, plus `mean_reward`, `response_length` (mean
    over all samples) and `num_samples`.
    """
    check_ks(ks, num_samples)
    repeated = [example for example in examples for _ in range(num_samples)]
    rewards, lengths = generate_and_score(
        generate_fn,
        params,
        repeated,
        tokenizer,
        rewards_fn,
        max_prompt_len=max_prompt_len,
        batch_size=batch_size,
        rng=rng,
    )
    num_correct = (rewards.reshape(len(examples), num_samples) >= correct_reward).sum(axis=1)
    result = {f"pass@{k}": float(pass_at_k(num_samples, num_correct, k).mean()) for k in ks}
    result.update(
        mean_reward=float(rewards.mean()),
        response_length=float(lengths.mean()),
        num_samples=num_samples,
    )
    return result


def evaluate_policy(
    model: Model,
    params: Params,
    task: Task,
    settings: EvalSettings,
    reference_params: Params | None = None,
) -> dict:
    """The task's held-out metrics for `params`, JSON-able.

    A task with its own `evaluate` (e.g. TL;DR's win rate) gets `reference_params`
    (π_ref, from the run's checkpoint; None: the task's fallback). Otherwise: greedy
    pass@1 and sampled pass@k on the test split.

    Keys: `greedy_pass@1` (= greedy accuracy), `greedy_response_length`, `num_problems`,
    `max_new_tokens`, and with `num_samples > 0` also `pass@{k}` for each k,
    `sampled_mean_reward`, `sampled_response_length`, `num_samples`, `temperature`.
    """
    check_sequence_fits(model, settings)
    if task.evaluate is not None:
        return task.evaluate(model, params, settings, reference_params)
    examples = first_test_examples(task.name, task.test, settings.num_examples)
    if not examples:
        raise ValueError(f"The {task.name} task has no test problems to evaluate.")
    greedy_fn, sampling_fn = evaluation_generate_fns(model, task.tokenizer, settings)
    common = dict(max_prompt_len=settings.max_prompt_len, batch_size=settings.batch_size)
    greedy = greedy_accuracy(greedy_fn, params, examples, task.tokenizer, task.rewards, **common)
    result = {
        "greedy_pass@1": greedy["accuracy"],
        "greedy_response_length": greedy["response_length"],
        "num_problems": len(examples),
        "max_new_tokens": settings.max_new_tokens,
    }
    if settings.num_samples == 0:
        return result
    sampled = sampled_pass_at_k(
        sampling_fn,
        params,
        examples,
        task.tokenizer,
        task.rewards,
        num_samples=settings.num_samples,
        ks=settings.ks,
        rng=jax.random.key(settings.seed),
        **common,
    )
    result.update({key: value for key, value in sampled.items() if key.startswith("pass@")})
    result.update(
        sampled_mean_reward=sampled["mean_reward"],
        sampled_response_length=sampled["response_length"],
        num_samples=settings.num_samples,
        temperature=settings.temperature,
    )
    return result
