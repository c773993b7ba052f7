"""Rewards: task-specific checkers, and scoring many (response, answer) pairs at once."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


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
