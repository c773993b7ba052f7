"""roles_by_process: searcher processes send trajectories, learner processes send params.

Every exchange is a collective of JAX's multi-controller runtime that all processes call
at the same point (`jax.experimental.multihost_utils`); there is no other channel.

- A *round* (`exchange_round`) all-gathers, from every process, a vector of flags and a
  fixed-size block of trajectories (`pack_block`; learners send empty blocks). Learners
  keep the blocks of their own searchers (searcher rank j feeds learner rank j mod L).
  The flags carry each process's stop request, what the learners do next (another round,
  a params broadcast first, or the end), and each searcher's prompt-stream position and
  sample counts, so learner process 0 can checkpoint the searchers' state.
- A *broadcast* (`broadcast_tree`) copies learner process 0's params to every process.

The protocol, identical on every process: one START broadcast (params, π_ref, the
searchers' stream positions), then rounds; after a round whose learner flags say
`NEXT_PUBLISH`, a params broadcast comes before the next round; after a round where any
process asked to stop or the learners said `NEXT_FINISH`, nothing more is exchanged.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from tba_jax.trajectories import Trajectory

# the round's flag vector (int64), one per process
FLAG_STOP = 0  # this process asks the run to stop (SIGTERM, Ctrl-C)
FLAG_NEXT = 1  # learners: what follows this round (NEXT_*)
FLAG_READY = 2  # learners: the buffer holds enough prompts to train
FLAG_STREAM_EPOCH = 3  # searchers: prompt-stream position
FLAG_STREAM_INDEX = 4
FLAG_SAMPLES = 5  # searchers: samples generated so far (this segment)
FLAG_TOKENS = 6  # searchers: response tokens generated so far
FLAG_DROPPED = 7  # searchers: samples dropped from a full outbox so far
NUM_FLAGS = 8

NEXT_ROUND = 0
NEXT_PUBLISH = 1
NEXT_FINISH = 2

BLOCK_FIELDS = (
    "prompt_tokens",
    "prompt_len",
    "response_tokens",
    "response_len",
    "token_logp_behaviour",
    "token_logp_ref",
    "reward",
    "prompt_id",
    "policy_version",
    "created_at",
)


def empty_block(rows: int, max_prompt_len: int, max_response_len: int) -> dict[str, np.ndarray]:
    """A block of `rows` empty trajectory slots (lengths 0 mark them empty)."""
    return {
        "prompt_tokens": np.zeros((rows, max_prompt_len), np.int32),
        "prompt_len": np.zeros(rows, np.int32),
        "response_tokens": np.zeros((rows, max_response_len), np.int32),
        "response_len": np.zeros(rows, np.int32),
        "token_logp_behaviour": np.zeros((rows, max_response_len), np.float32),
        "token_logp_ref": np.zeros((rows, max_response_len), np.float32),
        "reward": np.zeros(rows, np.float32),
        "prompt_id": np.full(rows, -1, np.int64),
        "policy_version": np.zeros(rows, np.int64),
        "created_at": np.zeros(rows, np.float64),
    }


def pack_block(
    trajectories: Sequence[Trajectory], rows: int, max_prompt_len: int, max_response_len: int
) -> dict[str, np.ndarray]:
    """Up to `rows` trajectories in a fixed-size block (the rest of it empty)."""
    if len(trajectories) > rows:
        raise ValueError(f"{len(trajectories)} trajectories do not fit a block of {rows} rows.")
    block = empty_block(rows, max_prompt_len, max_response_len)
    for row, t in enumerate(trajectories):
        prompt_len, response_len = len(t.prompt_tokens), len(t.response_tokens)
        block["prompt_tokens"][row, :prompt_len] = t.prompt_tokens
        block["prompt_len"][row] = prompt_len
        block["response_tokens"][row, :response_len] = t.response_tokens
        block["response_len"][row] = response_len
        block["token_logp_behaviour"][row, :response_len] = t.token_logp_behaviour
        block["token_logp_ref"][row, :response_len] = t.token_logp_ref
        block["reward"][row] = t.reward
        block["prompt_id"][row] = t.prompt_id
        block["policy_version"][row] = t.policy_version
        block["created_at"][row] = t.created_at
    return block


def unpack_block(block: dict[str, np.ndarray]) -> list[Trajectory]:
    """The trajectories of a block, in order (empty slots left out)."""
    trajectories = []
    for row in np.flatnonzero(block["prompt_id"] >= 0):
        prompt_len, response_len = int(block["prompt_len"][row]), int(block["response_len"][row])
        behaviour = block["token_logp_behaviour"][row, :response_len].copy()
        reference = block["token_logp_ref"][row, :response_len].copy()
        trajectories.append(
            Trajectory(
                prompt_id=int(block["prompt_id"][row]),
                prompt_tokens=block["prompt_tokens"][row, :prompt_len].copy(),
                response_tokens=block["response_tokens"][row, :response_len].copy(),
                reward=float(block["reward"][row]),
                logp_behaviour=float(behaviour.sum()),
                logp_ref=float(reference.sum()),
                token_logp_behaviour=behaviour,
                token_logp_ref=reference,
                policy_version=int(block["policy_version"][row]),
                created_at=float(block["created_at"][row]),
            )
        )
    return trajectories


class Outbox:
    """Trajectories a searcher process made since the last round (thread-safe). Holds at
    most `capacity`; when full, the oldest are dropped (and counted)."""

    def __init__(self, capacity: int):
        self._items: collections.deque[Trajectory] = collections.deque()
        self._capacity = capacity
        self._lock = threading.Lock()
        self.dropped = 0

    def add(self, trajectories: Sequence[Trajectory]) -> int:
        """Same signature as `ReplayBuffer.add`, so a `runtime.Searcher` can fill it."""
        with self._lock:
            self._items.extend(trajectories)
            while len(self._items) > self._capacity:
                self._items.popleft()
                self.dropped += 1
        return len(trajectories)

    def take(self, n: int) -> list[Trajectory]:
        """The oldest `n` trajectories held (fewer if it holds fewer)."""
        with self._lock:
            return [self._items.popleft() for _ in range(min(n, len(self._items)))]

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


def exchange_round(
    flags: np.ndarray, block: dict[str, np.ndarray]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Every process's flags [P, NUM_FLAGS] and blocks ({field: [P, rows, ...]})."""
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather({"flags": flags, **block}, tiled=False)
    gathered = jax.tree.map(np.asarray, gathered)
    return gathered.pop("flags"), gathered


def broadcast_tree(tree: Any, is_source: bool) -> Any:
    """The source process's `tree` (host NumPy arrays) on every process, as NumPy. Every
    other process passes a tree of the same shapes and dtypes (its values are ignored)."""
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree, is_source))


def zeros_like_abstract(abstract: Any) -> Any:
    """Host zeros shaped like a pytree of ShapeDtypeStructs (a broadcast's receive side)."""
    return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract)


def blocks_of(gathered: dict[str, np.ndarray], processes: Sequence[int]) -> list[Trajectory]:
    """The trajectories the given processes sent in a round, in process order."""
    trajectories = []
    for process in processes:
        trajectories += unpack_block({name: gathered[name][process] for name in BLOCK_FIELDS})
    return trajectories


def searchers_of(learner_rank: int, num_learners: int, searcher_processes: Sequence[int]):
    """The searcher processes whose blocks feed learner `learner_rank` (rank j mod L)."""
    return [p for j, p in enumerate(searcher_processes) if j % num_learners == learner_rank]
