"""Verifiable reward for GSM8K: the last number of a response against the gold answer.

A GSM8K answer field is a worked solution ending in ``#### <number>``. The
reward is 1.0 when the *last* number written in a response equals that number
as a float, and 0.0 otherwise (also when the response has no number).

A number is an optional minus sign, an optional ``$``, then digits: either
comma-grouped thousands (``1,000`` or ``1,000.50``) or plain digits, with an
optional decimal part (``.5`` alone is 0.5). Commas and ``$`` are dropped; a
trailing full stop is not part of the number. A ``-`` right after a letter,
digit or ``.`` is a hyphen or a subtraction, not a sign (``5-3`` holds 5 and 3),
and digits glued to a preceding letter (``x2``) are not a number.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from tba_jax.rewards import score_pairs

ANSWER_MARKER = "####"
CORRECT_REWARD = 1.0
INCORRECT_REWARD = 0.0

_NUMBER = re.compile(
    r"(?<![\w.])"  # Not glued to a word, a number or a decimal point.
    r"(?P<sign>-)?(?:\$\s?)?"
    r"(?P<magnitude>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)
_IGNORED_IN_NUMBERS = str.maketrans("", "", ",$ ")


def normalize_number(text: str) -> str:
    """``"$1,000.50"`` -> ``"1000.50"``: drops commas, ``$`` and spaces."""
    return text.translate(_IGNORED_IN_NUMBERS)


def extract_last_number(text: str) -> str | None:
    """The last number in `text`, normalised (``"-1000.5"``), or None when there is none."""
    matches = list(_NUMBER.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    return (last.group("sign") or "") + normalize_number(last.group("magnitude"))


def extract_final_answer(answer_field: str) -> str:
    """The number after the last ``####`` of a GSM8K answer, commas removed.

    A field without the marker is taken to be the number itself, so both
    ``"...\\n#### 1,080"`` and ``"1080"`` give ``"1080"``.
    """
    final_answer = answer_field.rpartition(ANSWER_MARKER)[2]
    return normalize_number(final_answer.strip())


def parse_reference(answer: str) -> float:
    """The gold answer as a float; ValueError when it is not a number."""
    final_answer = extract_final_answer(answer)
    try:
        return float(final_answer)
    except ValueError:
        raise ValueError(
            f"Reference answer {answer!r} has final answer {final_answer!r}, which is not a "
            "number; pass a GSM8K answer field ending in '#### <number>' or the number itself."
        ) from None


def reward(response: str, answer: str) -> float:
    """1.0 if the response's last number equals the gold answer's final number, else 0.0."""
    reference = parse_reference(answer)
    last_number = extract_last_number(response)
    if last_number is None:
        return INCORRECT_REWARD
    return CORRECT_REWARD if float(last_number) == reference else INCORRECT_REWARD


def batch_rewards(responses: Sequence[str], answers: Sequence[str]) -> np.ndarray:
    """Rewards for paired responses and answers, as a float32 array of shape [N]."""
    return score_pairs(reward, responses, answers)
