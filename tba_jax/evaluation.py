"""Held-out evaluation: greedy accuracy (pass@1) of a policy on a task's test split."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from tba_jax.models.tokenizers import Tokenizer

BatchRewardFn = Callable[[Sequence[dict], Sequence[str]], np.ndarray]


def fixed_size_batches(num_items: int, batch_size: int) -> list[np.ndarray]:
    """Index batches of exactly `batch_size` (the last one padded by repeating index 0),
    so a jitted generate function compiles once."""
    batches = []
    for start in range(0, num_items, batch_size):
        rows = np.arange(start, min(start + batch_size, num_items))
        batches.append(np.pad(rows, (0, batch_size - len(rows))))
    return batches


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
    rewards, lengths = [], []
    for rows in fixed_size_batches(len(examples), batch_size):
        prompts = tokenizer.encode_batch(
            [examples[i]["prompt"] for i in rows], max_prompt_len, left_pad=True
        )
        out = generate_fn(params, prompts, prompts != tokenizer.pad_id, jax.random.key(0))
        tokens, response_lengths = jax.device_get((out.tokens, out.lengths))
        real = min(len(rows), len(examples) - len(rewards))
        batch_examples = [examples[i] for i in rows[:real]]
        texts = [tokenizer.decode(tokens[row]) for row in range(real)]
        rewards.extend(rewards_fn(batch_examples, texts))
        lengths.extend(response_lengths[:real])
    return {"accuracy": float(np.mean(rewards)), "response_length": float(np.mean(lengths))}
