"""Verifiable reward for the built-in multi-step arithmetic task.

A response is a worked solution such as ``"68,61>61"``: running totals, then
``ANSWER_MARKER`` and the final answer. The reward is 1.0 when the text after
the *last* marker, stripped of surrounding whitespace, is a well-formed integer
equal to the reference answer, and 0.0 otherwise. A well-formed integer is an
optional minus sign followed by decimal digits without leading zeros, so
``"061"``, ``"6 1"``, ``"61abc"`` and ``"61,62"`` all score 0.0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from tba_jax.rewards import score_pairs

ANSWER_MARKER = ">"
CORRECT_REWARD = 1.0
INCORRECT_REWARD = 0.0

_WELL_FORMED_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")


def is_well_formed_integer(text: str) -> bool:
    """True iff `text` is exactly an integer in canonical decimal form."""
    return _WELL_FORMED_INTEGER.fullmatch(text) is not None


def extract_final_answer(response: str) -> str | None:
    """The whitespace-stripped text after the last answer marker, or None without one."""
    marker_position = response.rfind(ANSWER_MARKER)
    if marker_position < 0:
        return None
    return response[marker_position + len(ANSWER_MARKER) :].strip()


def reward(response: str, answer: str) -> float:
    """1.0 if the response's final answer equals the integer `answer`, else 0.0."""
    reference = answer.strip()
    if not is_well_formed_integer(reference):
        raise ValueError(
            f"Reference answer {answer!r} is not a well-formed integer; "
            "the arithmetic reward needs answers like '61' or '-3'."
        )
    final_answer = extract_final_answer(response)
    if final_answer is None or not is_well_formed_integer(final_answer):
        return INCORRECT_REWARD
    return CORRECT_REWARD if int(final_answer) == int(reference) else INCORRECT_REWARD


def batch_rewards(responses: Sequence[str], answers: Sequence[str]) -> np.ndarray:
    """Rewards for paired responses and answers, as a float32 array of shape [N]."""
    return score_pairs(reward, responses, answers)
