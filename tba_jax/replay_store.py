"""The replay buffer's storage: samples in preallocated NumPy arrays, no Python object each.

A stored sample lives in a *slot*, a row of per-sample columns (`SLOT_COLUMNS`: reward,
log-probs, versions, its insertion number `seq`, ...). Its tokens live elsewhere:

- the prompt in a row of the prompt table, shared by every sample of the same prompt id
  and tokens (reference-counted), left-padded to max_prompt_len as a batch wants it;
- the response and its two per-token log-prob rows in a *width class*: responses of
  length ≤ w are kept in [rows, w] arrays, w a multiple of `RESPONSE_WIDTH_STEP` (the
  last class is max_response_len wide), so a sample costs its own length rounded up, not
  max_response_len.

Every table grows by doubling and hands out freed rows first (`_RowTable`). The store
knows nothing of prompts' groups, eviction or draws (`tba_jax.replay` does); it puts,
frees, gathers a batch and packs samples for a checkpoint. Not thread-safe: the replay
buffer's lock guards it.
"""

from __future__ import annotations

import numpy as np

from tba_jax.trajectories import SampledBatch

RESPONSE_WIDTH_STEP = 16
"""Response width classes are multiples of this many tokens (waste < this per sample)."""

INITIAL_ROWS = 1024
MAX_PREALLOCATED_SLOTS = 2**21  # slot columns made this long up front, at most (virtual memory)

SLOT_COLUMNS = {
    "prompt_id": np.int64,
    "reward": np.float64,
    "logp_behaviour": np.float64,
    "logp_ref": np.float64,
    "policy_version": np.int64,
    "policy_version_last": np.int64,
    "created_at": np.float64,
    "seq": np.int64,  # insertion number, increasing; FREE_SEQ on a free slot
    "sync_window": np.int64,  # the buffer's sync window when the sample was added
    "response_hash": np.int64,  # `response_hashes`, for duplicate detection
    "response_length": np.int32,
    "response_class": np.int32,
    "response_row": np.int32,
    "prompt_row": np.int32,
}
FREE_SEQ = -1

_HASH_SEED = 20250325


class _RowTable:
    """Arrays sharing a first axis of rows; freed rows are handed out again first, and the
    arrays double when every row is taken.

    Args:
      columns: name -> (dtype, shape of one row). A row's contents are whatever the caller
        writes when it is handed out.
    """

    def __init__(
        self, columns: dict[str, tuple[type, tuple[int, ...]]], initial_rows: int = INITIAL_ROWS
    ):
        self._columns = columns
        self.arrays = {
            name: np.empty((initial_rows, *shape), dtype=dtype)
            for name, (dtype, shape) in columns.items()
        }
        self.used = 0  # rows ever handed out (the high-water mark)
        self._free = np.empty(INITIAL_ROWS, dtype=np.int64)  # a stack of freed rows
        self._num_free = 0

    @property
    def num_live(self) -> int:
        return self.used - self._num_free

    def allocate(self, n: int) -> np.ndarray:
        """int64 [n] rows for new entries: freed rows first (newest freed first)."""
        reused = min(n, self._num_free)
        rows = np.empty(n, dtype=np.int64)
        rows[:reused] = self._free[self._num_free - reused : self._num_free][::-1]
        self._num_free -= reused
        fresh = n - reused
        self._grow_to(self.used + fresh)
        rows[reused:] = np.arange(self.used, self.used + fresh)
        self.used += fresh
        return rows

    def release(self, rows: np.ndarray) -> None:
        """Hands `rows` back (their contents stay until reused)."""
        needed = self._num_free + len(rows)
        if needed > len(self._free):
            self._free = _grown(self._free, needed)
        self._free[self._num_free : needed] = rows
        self._num_free = needed

    def _grow_to(self, rows: int) -> None:
        current = len(next(iter(self.arrays.values())))
        if rows <= current:
            return
        for name in self._columns:
            self.arrays[name] = _grown(self.arrays[name], rows)

    def nbytes(self) -> int:
        """Bytes of the rows handed out (the arrays' untouched tails are not counted)."""
        per_row = sum(a[:1].nbytes for a in self.arrays.values())
        return per_row * self.used + self._free[: self._num_free].nbytes


def _grown(array: np.ndarray, rows: int) -> np.ndarray:
    """`array` copied into one of at least `rows` rows (doubling). The new rows are left
    unwritten (so untouched memory stays unmapped): every row is written when handed out."""
    new_rows = max(rows, 2 * len(array))
    grown = np.empty((new_rows, *array.shape[1:]), dtype=array.dtype)
    grown[: len(array)] = array
    return grown


def response_width_classes(max_response_len: int) -> list[int]:
    """Widths of the response classes: multiples of RESPONSE_WIDTH_STEP, then the limit."""
    widths = list(range(RESPONSE_WIDTH_STEP, max_response_len, RESPONSE_WIDTH_STEP))
    return [*widths, max_response_len]


def response_hashes(tokens: np.ndarray, lengths: np.ndarray, multipliers: np.ndarray) -> np.ndarray:
    """int64 [n] hashes of n right-padded responses tokens [n, w] of lengths [n]: a random
    linear form over Z/2^64 (equal responses hash equally; unequal ones almost never do,
    and the buffer compares tokens on a hash match)."""
    words = tokens.astype(np.uint64) * multipliers[: tokens.shape[1]]
    hashed = words.sum(axis=1, dtype=np.uint64) + lengths.astype(np.uint64) * multipliers[-1]
    return hashed.view(np.int64)


class SampleStore:
    """Columns, prompt table and response width classes of a replay buffer's samples.

    Args:
      max_prompt_len, max_response_len, pad_id: the padding layout of batches.
      capacity: the most samples it will hold; the slot columns are made that long up
        front (up to MAX_PREALLOCATED_SLOTS; pages are only mapped once written).
    """

    def __init__(self, max_prompt_len: int, max_response_len: int, pad_id: int, capacity: int):
        self.max_prompt_len, self.max_response_len, self.pad_id = (
            max_prompt_len,
            max_response_len,
            pad_id,
        )
        self.slots = _RowTable(
            {name: (dtype, ()) for name, dtype in SLOT_COLUMNS.items()},
            initial_rows=max(INITIAL_ROWS, min(capacity, MAX_PREALLOCATED_SLOTS)),
        )
        self.prompts = _RowTable(
            {
                "tokens": (np.int32, (max_prompt_len,)),
                "length": (np.int32, ()),
                "prompt_id": (np.int64, ()),
                "users": (np.int64, ()),
            }
        )
        self._prompt_rows: dict[tuple[int, bytes], int] = {}  # (prompt id, tokens) -> row
        self.widths = response_width_classes(max_response_len)
        self.responses = [
            _RowTable(
                {
                    "tokens": (np.int32, (width,)),
                    "logp_behaviour": (np.float32, (width,)),
                    "logp_ref": (np.float32, (width,)),
                }
            )
            for width in self.widths
        ]
        rng = np.random.default_rng(_HASH_SEED)
        self._hash_multipliers = rng.integers(
            1, 2**63, size=max_response_len + 1, dtype=np.uint64
        ) * np.uint64(2) + np.uint64(1)

    # -- columns ---------------------------------------------------------------------------

    def column(self, name: str) -> np.ndarray:
        """The `name` column of every slot handed out so far (a view; free slots included,
        with seq == FREE_SEQ)."""
        return self.slots.arrays[name][: self.slots.used]

    def live_slots(self) -> np.ndarray:
        """int64 [n] every stored sample's slot, in slot order."""
        return np.flatnonzero(self.column("seq") != FREE_SEQ)

    def nbytes(self) -> int:
        """Bytes of the rows in use by the columns, prompts and responses."""
        tables = [self.slots, self.prompts, *self.responses]
        return sum(table.nbytes() for table in tables)

    # -- put and free ----------------------------------------------------------------------

    def put(
        self, packed: dict[str, np.ndarray], seqs: np.ndarray, windows: np.ndarray
    ) -> np.ndarray:
        """Stores n packed samples (`trajectories.pack_trajectories`' layout, checked);
        returns their slots, int64 [n]. `seqs`, `windows`: int64 [n]."""
        n = len(packed["traj_prompt_id"])
        slots = self.slots.allocate(n)
        columns = self.slots.arrays
        for name in ("prompt_id", "reward", "logp_behaviour", "logp_ref", "policy_version"):
            columns[name][slots] = packed[f"traj_{name}"]
        columns["policy_version_last"][slots] = packed.get(
            "traj_policy_version_last", packed["traj_policy_version"]
        )
        columns["created_at"][slots] = packed["traj_created_at"]
        columns["seq"][slots] = seqs
        columns["sync_window"][slots] = windows
        columns["prompt_row"][slots] = self._put_prompts(packed)
        self._put_responses(packed, slots)
        return slots

    def _put_prompts(self, packed: dict[str, np.ndarray]) -> np.ndarray:
        """int64 [n] prompt-table rows of n samples, adding the prompts not stored yet."""
        prompt_ids = packed["traj_prompt_id"]
        offsets = packed["traj_prompt_offsets"]
        lengths = np.diff(offsets)
        padded = _padded(
            packed["traj_prompt_tokens"], offsets, self.max_prompt_len, self.pad_id, left=True
        )
        # A call's samples of one prompt come together: look up each run of equal prompts once.
        starts_run = np.ones(len(prompt_ids), dtype=bool)
        starts_run[1:] = (
            (prompt_ids[1:] != prompt_ids[:-1])
            | (lengths[1:] != lengths[:-1])
            | np.any(padded[1:] != padded[:-1], axis=1)
        )
        run_rows = []
        for i in np.flatnonzero(starts_run).tolist():
            key = (int(prompt_ids[i]), int(lengths[i]), padded[i].tobytes())
            row = self._prompt_rows.get(key)
            run_rows.append(self._new_prompt_row(key, padded[i]) if row is None else row)
        rows = np.asarray(run_rows, dtype=np.int64)[np.cumsum(starts_run) - 1]
        np.add.at(self.prompts.arrays["users"], rows, 1)
        return rows

    def _new_prompt_row(self, key: tuple[int, int, bytes], padded_tokens: np.ndarray) -> int:
        """A prompt-table row for key (prompt id, length, left-padded tokens' bytes)."""
        row = int(self.prompts.allocate(1)[0])
        table = self.prompts.arrays
        table["tokens"][row] = padded_tokens
        table["prompt_id"][row], table["length"][row] = key[0], key[1]
        table["users"][row] = 0
        self._prompt_rows[key] = row
        return row

    def _put_responses(self, packed: dict[str, np.ndarray], slots: np.ndarray) -> None:
        """Writes n responses into their width classes and their hashes into the columns."""
        offsets = packed["traj_response_offsets"]
        lengths = np.diff(offsets)
        width = self.max_response_len
        blocks = {
            "tokens": _padded(packed["traj_response_tokens"], offsets, width, self.pad_id),
            "logp_behaviour": _padded(packed["traj_token_logp_behaviour"], offsets, width, 0.0),
            "logp_ref": _padded(packed["traj_token_logp_ref"], offsets, width, 0.0),
        }
        columns = self.slots.arrays
        columns["response_length"][slots] = lengths
        columns["response_hash"][slots] = response_hashes(
            blocks["tokens"], lengths, self._hash_multipliers
        )
        classes = np.searchsorted(self.widths, lengths)  # the narrowest class that holds it
        columns["response_class"][slots] = classes
        # by class, so that each class's members are one slice of the sorted blocks
        order = np.argsort(classes, kind="stable")
        classes, slots = classes[order], slots[order]
        blocks = {name: block[order] for name, block in blocks.items()}
        present, starts = np.unique(classes, return_index=True)
        ends = [*starts[1:].tolist(), len(classes)]
        for cls, start, end in zip(present.tolist(), starts.tolist(), ends, strict=True):
            table, class_width = self.responses[cls], self.widths[cls]
            rows = table.allocate(end - start)
            columns["response_row"][slots[start:end]] = rows
            for name, block in blocks.items():
                table.arrays[name][rows] = block[start:end, :class_width]

    def free(self, slots: np.ndarray) -> None:
        """Frees the slots (already marked FREE_SEQ by the caller), their response rows
        and their share of their prompt rows."""
        if not len(slots):
            return
        columns = self.slots.arrays
        columns["seq"][slots] = FREE_SEQ
        classes = columns["response_class"][slots]
        rows = columns["response_row"][slots]
        for cls in np.unique(classes).tolist():
            self.responses[cls].release(rows[classes == cls])
        self._drop_prompt_users(columns["prompt_row"][slots].astype(np.int64))
        self.slots.release(slots)

    def _drop_prompt_users(self, prompt_rows: np.ndarray) -> None:
        users = self.prompts.arrays["users"]
        np.subtract.at(users, prompt_rows, 1)
        unused = np.unique(prompt_rows[users[prompt_rows] == 0])
        if not len(unused):
            return
        table = self.prompts.arrays
        for row in unused.tolist():
            key = (int(table["prompt_id"][row]), int(table["length"][row]))
            del self._prompt_rows[(*key, table["tokens"][row].tobytes())]
        self.prompts.release(unused)

    # -- reading ---------------------------------------------------------------------------

    def same_response(self, slot_a: int, slot_b: int) -> bool:
        """Whether two stored samples have the same response tokens."""
        columns = self.slots.arrays
        length = int(columns["response_length"][slot_a])
        if length != int(columns["response_length"][slot_b]):
            return False
        return bool(
            np.array_equal(self._response(slot_a)[:length], self._response(slot_b)[:length])
        )

    def _response(self, slot: int) -> np.ndarray:
        columns = self.slots.arrays
        table = self.responses[int(columns["response_class"][slot])]
        return table.arrays["tokens"][int(columns["response_row"][slot])]

    def gather(
        self, slots: np.ndarray, prompt_ids: np.ndarray, from_recency: np.ndarray
    ) -> SampledBatch:
        """The batch of rows `slots` [N] (prompt-major, K per prompt slot)."""
        columns = self.slots.arrays
        n, width = len(slots), self.max_response_len
        prompt_rows = columns["prompt_row"][slots]
        prompt_lengths = self.prompts.arrays["length"][prompt_rows]
        lengths = columns["response_length"][slots]
        response_tokens = np.full((n, width), self.pad_id, dtype=np.int32)
        token_logp_behaviour = np.zeros((n, width), dtype=np.float32)
        token_logp_ref = np.zeros((n, width), dtype=np.float32)
        classes = columns["response_class"][slots]
        rows = columns["response_row"][slots]
        for cls in np.unique(classes).tolist():
            members = np.flatnonzero(classes == cls)
            table, class_width = self.responses[cls].arrays, self.widths[cls]
            response_tokens[members, :class_width] = table["tokens"][rows[members]]
            token_logp_behaviour[members, :class_width] = table["logp_behaviour"][rows[members]]
            token_logp_ref[members, :class_width] = table["logp_ref"][rows[members]]
        prompt_start = self.max_prompt_len - prompt_lengths
        return SampledBatch(
            prompt_tokens=self.prompts.arrays["tokens"][prompt_rows],
            prompt_mask=np.arange(self.max_prompt_len) >= prompt_start[:, None],
            response_tokens=response_tokens,
            response_mask=(np.arange(width) < lengths[:, None]).astype(np.float32),
            reward=columns["reward"][slots].astype(np.float32),
            logp_behaviour=columns["logp_behaviour"][slots].astype(np.float32),
            logp_ref=columns["logp_ref"][slots].astype(np.float32),
            token_logp_behaviour=token_logp_behaviour,
            token_logp_ref=token_logp_ref,
            policy_version=columns["policy_version"][slots].astype(np.int32),
            created_at=columns["created_at"][slots].astype(np.float64),
            prompt_ids=np.asarray(prompt_ids, dtype=np.int64),
            from_recency=np.asarray(from_recency, dtype=bool),
            policy_version_last=columns["policy_version_last"][slots].astype(np.int32),
        )

    def pack(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        """`trajectories.pack_trajectories`' arrays of the samples in `slots` [N], in that
        order, plus `traj_sync_window`."""
        columns = self.slots.arrays
        packed = {
            f"traj_{name}": columns[name][slots].astype(dtype)
            for name, dtype in (
                ("prompt_id", np.int64),
                ("reward", np.float64),
                ("logp_behaviour", np.float64),
                ("logp_ref", np.float64),
                ("policy_version", np.int64),
                ("policy_version_last", np.int64),
                ("created_at", np.float64),
                ("sync_window", np.int64),
            )
        }
        packed.update(self._pack_prompts(columns["prompt_row"][slots]))
        packed.update(self._pack_responses(slots))
        return packed

    def _pack_prompts(self, prompt_rows: np.ndarray) -> dict[str, np.ndarray]:
        lengths = self.prompts.arrays["length"][prompt_rows]
        padded = self.prompts.arrays["tokens"][prompt_rows]
        inside = np.arange(self.max_prompt_len) >= (self.max_prompt_len - lengths)[:, None]
        return {
            "traj_prompt_offsets": _offsets(lengths),
            "traj_prompt_tokens": padded[inside],  # row-major: each prompt's tokens in turn
        }

    def _pack_responses(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        columns = self.slots.arrays
        lengths = columns["response_length"][slots]
        offsets = _offsets(lengths)
        total = int(offsets[-1])
        flat = {
            "tokens": np.empty(total, dtype=np.int32),
            "logp_behaviour": np.empty(total, dtype=np.float32),
            "logp_ref": np.empty(total, dtype=np.float32),
        }
        classes = columns["response_class"][slots]
        rows = columns["response_row"][slots]
        for cls in np.unique(classes).tolist():
            members = np.flatnonzero(classes == cls)
            width = self.widths[cls]
            inside = np.arange(width) < lengths[members][:, None]
            destination = (offsets[members][:, None] + np.arange(width))[inside]
            for name, values in flat.items():
                values[destination] = self.responses[cls].arrays[name][rows[members]][inside]
        return {
            "traj_response_offsets": offsets,
            "traj_response_tokens": flat["tokens"],
            "traj_token_logp_behaviour": flat["logp_behaviour"],
            "traj_token_logp_ref": flat["logp_ref"],
        }


def _padded(
    flat: np.ndarray, offsets: np.ndarray, width: int, fill: float, left: bool = False
) -> np.ndarray:
    """[n, width] rows of n ragged pieces (flat, offsets [n+1]), padded with `fill` on the
    right (or on the left). The pieces' positions, row by row, are exactly `flat` in order."""
    lengths = np.diff(offsets)
    if left:
        inside = np.arange(width) >= (width - lengths)[:, None]
    else:
        inside = np.arange(width) < lengths[:, None]
    rows = np.full(inside.shape, fill, dtype=flat.dtype)
    rows[inside] = flat
    return rows


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """int64 [N+1] start offsets of N ragged pieces of `lengths`."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets
