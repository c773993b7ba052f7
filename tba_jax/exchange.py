"""roles_by_process: searcher processes send trajectories, learner processes send params.

Every exchange is a collective of JAX's multi-controller runtime over a mesh of one
device per process (`ExchangeMesh`) that all processes call at the same point; there is
no other channel.

- A *round* (`exchange_round`) all-gathers, from every process, a vector of flags and a
  fixed-size block of trajectories (`pack_block`; learners send empty blocks). Learners
  keep the blocks of their own searchers (searcher rank j feeds learner rank j mod L).
  The flags carry each process's stop request, what the learners do next (another round,
  a params broadcast first, or the end), whether each learner holds enough prompts and
  how many, and each searcher's prompt-stream position and sample counts, so learner
  process 0 can checkpoint the searchers' state.
- A *broadcast* (`ExchangeMesh.broadcast`) copies learner process 0's params to every process.

The protocol, identical on every process: one START broadcast (params, π_ref, the
searchers' stream positions), then rounds; after a round whose learner flags say
`NEXT_PUBLISH`, a params broadcast comes before the next round; after a round where any
process asked to stop or the learners said `NEXT_FINISH`, nothing more is exchanged.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tba_jax.trajectories import Trajectory

EXCHANGE_AXIS = "processes"

# the round's flag vector (int64), one per process
FLAG_STOP = 0  # this process asks the run to stop (SIGTERM, Ctrl-C)
FLAG_NEXT = 1  # learners: what follows this round (NEXT_*)
FLAG_READY = 2  # learners: the buffer holds enough prompts to train
FLAG_STREAM_EPOCH = 3  # searchers: prompt-stream position
FLAG_STREAM_INDEX = 4
FLAG_SAMPLES = 5  # searchers: samples generated so far (this segment)
FLAG_TOKENS = 6  # searchers: response tokens generated so far
FLAG_DROPPED = 7  # searchers: samples dropped from a full outbox so far
FLAG_PROMPTS = 8  # learners: prompts their buffer holds (before this round's samples)
NUM_FLAGS = 9

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
    "policy_version_last",
    "created_ago",
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
        "prompt_id": np.full(rows, -1, np.int32),
        "policy_version": np.zeros(rows, np.int32),
        "policy_version_last": np.zeros(rows, np.int32),
        # seconds before packing (float32 keeps them exact; a time.time() would not)
        "created_ago": np.zeros(rows, np.float32),
    }


def pack_block(
    trajectories: Sequence[Trajectory], rows: int, max_prompt_len: int, max_response_len: int
) -> dict[str, np.ndarray]:
    """Up to `rows` trajectories in a fixed-size block (the rest of it empty)."""
    if len(trajectories) > rows:
        raise ValueError(f"{len(trajectories)} trajectories do not fit a block of {rows} rows.")
    block = empty_block(rows, max_prompt_len, max_response_len)
    now = time.time()
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
        block["policy_version_last"][row] = t.policy_version_last
        block["created_ago"][row] = now - t.created_at
    return block


def unpack_block(block: dict[str, np.ndarray]) -> list[Trajectory]:
    """The trajectories of a block, in order (empty slots left out)."""
    trajectories, now = [], time.time()
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
                created_at=now - float(block["created_ago"][row]),
                policy_version_last=int(block["policy_version_last"][row]),
            )
        )
    return trajectories


class Outbox:
    """Trajectories a searcher process made and has not sent yet (thread-safe). Holds at
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
        """The newest `n` trajectories held (fewer if it holds fewer), oldest first. When the
        searchers make more than a round carries, the learner gets the freshest; the rest
        wait for the next round or, once the outbox is full, are dropped."""
        with self._lock:
            taken = [self._items.pop() for _ in range(min(n, len(self._items)))]
        return taken[::-1]

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class ExchangeMesh:
    """One device per process (process order) on which every exchange runs.

    A searcher process with two or more devices keeps its last one for exchanges
    (`exchange_device`), so a round waiting for the learners never queues behind, or
    stalls, generation on its sampler devices. Over a mesh of these devices a round is
    an all-gather and a broadcast a sum in which only the source's row is non-zero.
    """

    def __init__(self, devices: Sequence[jax.Device]):
        self.mesh = Mesh(np.asarray(devices), (EXCHANGE_AXIS,))
        (self.local_device,) = [d for d in devices if d.process_index == jax.process_index()]
        self._rows = NamedSharding(self.mesh, PartitionSpec(EXCHANGE_AXIS))
        everywhere = NamedSharding(self.mesh, PartitionSpec())
        self._gather = jax.jit(lambda tree: tree, out_shardings=everywhere)
        self._sum = jax.jit(
            lambda tree: jax.tree.map(lambda x: x.sum(axis=0), tree), out_shardings=everywhere
        )

    def _stacked(self, tree: Any) -> Any:
        """This process's `tree` as its row of [processes, ...] arrays on the mesh."""

        def one(value):
            value = np.asarray(value)
            shard = jax.device_put(value[None], self.local_device)
            shape = (self.mesh.size, *value.shape)
            return jax.make_array_from_single_device_arrays(shape, self._rows, [shard])

        return jax.tree.map(one, tree)

    def allgather(self, tree: Any) -> Any:
        """Every process's `tree` (same shapes and dtypes), stacked: {..: [P, ...]}."""
        gathered = self._gather(self._stacked(tree))
        return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), gathered)

    def broadcast(self, tree: Any, is_source: bool) -> Any:
        """The source process's `tree` on every process; the others pass a tree of the
        same shapes and dtypes (its values are ignored)."""
        sent = tree if is_source else jax.tree.map(np.zeros_like, tree)
        summed = self._sum(self._stacked(sent))
        return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), summed)


def exchange_device(process_index: int) -> jax.Device:
    """The device a process runs exchanges on: its last (see `ExchangeMesh`)."""
    return max(jax.local_devices(process_index=process_index), key=lambda d: d.id)


def make_exchange_mesh(num_processes: int) -> ExchangeMesh:
    return ExchangeMesh([exchange_device(p) for p in range(num_processes)])


def exchange_round(
    mesh: ExchangeMesh, flags: np.ndarray, block: dict[str, np.ndarray]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Every process's flags [P, NUM_FLAGS] and blocks ({field: [P, rows, ...]})."""
    gathered = mesh.allgather({"flags": flags, **block})
    return gathered.pop("flags"), gathered


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
