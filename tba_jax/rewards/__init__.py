"""Rewards: task-specific checkers, scoring many (response, answer) pairs at once, and the
non-EOS penalty."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def response_rewards(
    rewards_fn: Callable,
    tokenizer,
    examples: Sequence[dict],
    tokens: np.ndarray,
    lengths: np.ndarray,
    non_eos_penalty: float | None,
) -> np.ndarray:
    """A task's rewards (`rewards_fn(examples, texts)`, see `tasks.Task.rewards`) of the
    responses tokens [N, T] with lengths [N] to `examples` [N], each response that did not
    end with EOS scored `non_eos_penalty` instead (`apply_non_eos_penalty`). float32 [N]."""
    texts = [tokenizer.decode(tokens[row, : lengths[row]]) for row in range(len(examples))]
    rewards = rewards_fn(examples, texts)
    ended = ended_with_eos(tokens, lengths, tokenizer.eos_id)
    return apply_non_eos_penalty(rewards, ended, non_eos_penalty)


def score_pairs(
    reward_fn: Callable[[str, str], float], responses: Sequence[str], answers: Sequence[str]
) -> np.ndarray:
    """`reward_fn(response, answer)` for each pair, as a float32 array of shape [N]."""
    if len(responses) != len(answers):
        raise ValueError(
            f"Got {len(responses)} responses but {len(answers)} answers; "
            "pass one reference answer per response."
        )
    return np.asarray(
        [reward_fn(response, answer) for response, answer in zip(responses, answers, strict=True)],
        dtype=np.float32,
    )


def apply_non_eos_penalty(
    rewards: np.ndarray, ended_with_eos: np.ndarray, penalty: float | None
) -> np.ndarray:
    """Rewards with each response that did not end with EOS scored `penalty` instead.

    The summarize-from-feedback recipe (Huang et al., 2024, "The N+ implementation
    details of RLHF with PPO") replaces a truncated summary's reward-model score with a
    fixed penalty, so the policy learns to finish. rewards, ended_with_eos: [N]; None:
    no penalty (rewards returned unchanged).
    """
    rewards = np.asarray(rewards, np.float32)
    if penalty is None:
        return rewards
    return np.where(np.asarray(ended_with_eos, bool), rewards, np.float32(penalty))


def ended_with_eos(tokens: np.ndarray, lengths: np.ndarray, eos_id: int) -> np.ndarray:
    """Whether each response's last token is EOS. tokens: [N, T]; lengths: [N] -> bool [N]."""
    last = tokens[np.arange(len(tokens)), np.maximum(lengths - 1, 0)]
    return (lengths > 0) & (last == eos_id)
