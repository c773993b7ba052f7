"""Fixed-size batches over a list of items, so a jitted function compiles once.

Used by evaluation, rewards (victims, judges, reward models) and tasks alike: every
batch has exactly `batch_size` rows, the last one filled by repeating row 0, and
callers keep only the first `real` rows of its outputs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np


def fixed_size_batches(num_items: int, batch_size: int) -> list[np.ndarray]:
    """Index batches of exactly `batch_size` (the last one padded by repeating index 0),
    so a jitted generate function compiles once."""
    batches = []
    for start in range(0, num_items, batch_size):
        rows = np.arange(start, min(start + batch_size, num_items))
        batches.append(np.pad(rows, (0, batch_size - len(rows))))
    return batches


def fixed_batches(num_items: int, batch_size: int) -> Iterator[tuple[np.ndarray, int]]:
    """(row indices [batch_size], number of real rows) per batch of `fixed_size_batches`:
    the last batch is filled by repeating row 0, so every call has the same shape."""
    for index, rows in enumerate(fixed_size_batches(num_items, batch_size)):
        yield rows, min(batch_size, num_items - index * batch_size)


def pad_rows(arrays: Sequence[np.ndarray], multiple: int) -> tuple[np.ndarray, ...]:
    """`arrays` (same leading dimension: rows) with the last row repeated until their rows
    are a multiple of `multiple`; callers keep the first rows of what they compute."""
    extra = -len(arrays[0]) % multiple
    if not extra:
        return tuple(arrays)
    return tuple(np.concatenate([a, np.repeat(a[-1:], extra, axis=0)]) for a in arrays)
