"""Replay buffer for TBA: host-memory store of scored trajectories, grouped per prompt.

Searcher threads `add` scored samples as they finish; the learner `sample`s batches of
B prompts × K responses, and the source tells the buffer when params are published
(`mark_sync(version)`, a *sync*). For each prompt slot, with probability `recency_prob`
(m) the slot is a recency draw, otherwise a priority draw (K of a prompt's samples
drawn without replacement while they last, by a priority over reward: `priority`). Two
draw rules (`draw_rule`, config `replay.draw_rule`) say which prompts and samples:

"authors", the TBA authors' rules (bbartoldson/TBA, src/buffer_utils.py; implemented
from their description in ../shared/reference):
  - a prompt's *online* samples are those added since the latest sync (the sync window
    starts at the first add after `mark_sync`, so a draw right after a publish still
    finds the previous window's samples);
  - a recency (online) draw takes a prompt WITHOUT replacement from the prompts refreshed
    in this window; when that pool runs out, it is refilled with the prompts already
    drawn in this window. Its K rows are drawn uniformly from the prompt's online samples,
    with replacement only when it has fewer than K. A slot finds no online prompt only
    when no sample of this window is stored: it is then a priority draw;
  - a priority (offline) draw takes a prompt without replacement from an epoch order of
    all stored prompts (a shuffle of them all when the order runs out; prompts first seen
    meanwhile join the next epoch);
  - eviction keeps each prompt's newest `capacity_per_prompt` samples by policy version
    (ties: the later added), and beyond `capacity` drops the oldest by version globally.
"newest", this code's earlier rule:
  - a recency draw takes distinct prompts whose newest sample has the buffer's highest
    policy version (extended with the most recently refreshed prompts when there are too
    few), and their newest K samples; the same prompts return batch after batch until
    newer samples arrive;
  - a priority draw takes prompts uniformly, distinct from each other and from the
    batch's recency prompts;
  - eviction is by insertion order (per prompt beyond `capacity_per_prompt`, globally
    beyond `capacity`).

Both rules collapse duplicates: a sample whose (prompt id, response tokens) is stored
replaces the stored one and counts as newly added. `drop_older_than(version)` removes
the samples of older policy versions and refuses any added later (a staleness bound;
the async source calls it with `replay.max_policy_lag`).

Samples live in NumPy arrays (`tba_jax.replay_store`); the indices the draws need are
kept as samples come and go, so a draw, an add and an eviction cost the same at a
million stored samples as at a thousand (benchmarks/replay_scale.py). All public
methods take one lock, so several searcher threads and the learner may call them at
once. `state_dict` / `load_state_dict` save and restore the whole buffer (contents,
insertion order, sync window and the draw rules' pools and orders) as a flat dict of
NumPy arrays for the checkpoint; a restored buffer draws the same batches.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from tba_jax.replay_store import FREE_SEQ, SampleStore
from tba_jax.trajectories import (
    SampledBatch,
    Trajectory,
    check_packed_layout,
    packed_for_storage,
)

PRIORITIES = ("uniform", "softmax", "rank")
"""Names accepted by `ReplayBuffer(priority=...)`."""

DRAW_RULES = ("authors", "newest")
"""Names accepted by `ReplayBuffer(draw_rule=...)`; see the module docstring."""

STATE_FORMAT_VERSION = 1
"""Version of the `state_dict` layout; bumped when the layout changes."""

_CONFIG_KEYS = (
    "max_prompt_len",
    "max_response_len",
    "pad_id",
    "capacity",
    "capacity_per_prompt",
    "recency_prob",
    "priority_index",
    "priority_inverse_temperature",
)
_TRAJECTORY_KEYS = (
    "prompt_id",
    "reward",
    "logp_behaviour",
    "logp_ref",
    "policy_version",
    "created_at",
    "prompt_offsets",
    "prompt_tokens",
    "response_offsets",
    "response_tokens",
    "token_logp_behaviour",
    "token_logp_ref",
)
# Read when present. Older states lack them: states saved before in-flight updates have
# no last versions, and states saved before the draw rules' pools have none of the rest
# (their samples then count as added in the current sync window, and the orders start
# afresh).
_OPTIONAL_STATE_KEYS = (
    "traj_policy_version_last",
    "traj_sync_window",  # [N] the sync window each sample was added in
    "sync_window",  # the current sync window (0 before the first sync)
    "sync_pending",  # 1: a sync was marked and the next add starts a new window
    "sync_version",  # the latest synced version (absent: none yet)
    "online_pool",  # authors: prompts refreshed this window and not drawn yet, draw order
    "online_drawn",  # authors: prompts drawn online this window, draw order
    "offline_order",  # authors: the rest of the epoch order (drawn from the end)
    "prompt_order",  # every stored prompt, in the order draws index them
    "newest_prompts",  # newest: prompts by the version of their newest sample, in order
    "newest_prompt_versions",  # newest: that version, per entry of newest_prompts
)
_PACKED_SCALAR_KEYS = (
    "traj_prompt_id",
    "traj_reward",
    "traj_logp_behaviour",
    "traj_logp_ref",
    "traj_policy_version",
    "traj_policy_version_last",
    "traj_created_at",
    "traj_sync_window",
)
LOAD_CHUNK = 65_536  # samples per step of load_state_dict (bounds its temporary arrays)
EVICTION_SCAN_MIN = 1024  # the oldest-first queue holds at least this many samples per scan
# ...and this share of the stored ones: a scan is a pass over every stored sample, so a
# larger share scans less often (an eviction at 300k samples: 1.5 µs with 1/64, 0.7 with 1/8)
EVICTION_SCAN_SHARE = 1 / 8
_VERSION_KEY_SHIFT = 40  # eviction key by version: (version − base) · 2^40 + seq


# ---------------------------------------------------------------------------------------
# Priority over rewards
# ---------------------------------------------------------------------------------------


def fractional_ranks(rewards: np.ndarray) -> np.ndarray:
    """Ranks of `rewards` [n] with rank 1 = highest reward; tied rewards share their mean rank.

    Returns float64 [n].
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    order = np.argsort(-rewards, kind="stable")
    ordinal = np.empty(len(rewards), dtype=np.float64)
    ordinal[order] = np.arange(1, len(rewards) + 1)
    _, group_of_row = np.unique(rewards, return_inverse=True)
    mean_rank_per_group = np.bincount(group_of_row, weights=ordinal) / np.bincount(group_of_row)
    return mean_rank_per_group[group_of_row]


def priority_log_weights(
    rewards: np.ndarray, priority: str, inverse_temperature: float
) -> np.ndarray:
    """Unnormalised log sampling weights [n] of trajectories with rewards [n].

    "uniform": 0; "softmax": a·r; "rank": −a·log(rank), rank 1 = highest reward.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    if priority == "uniform":
        return np.zeros_like(rewards)
    if priority == "softmax":
        return inverse_temperature * rewards
    if priority == "rank":
        return -inverse_temperature * np.log(fractional_ranks(rewards))
    raise ValueError(f"unknown priority {priority!r}; use one of {PRIORITIES}")


def priority_probabilities(
    rewards: np.ndarray, priority: str, inverse_temperature: float
) -> np.ndarray:
    """Normalised single-draw probabilities [n] of trajectories with rewards [n]."""
    return _softmax(priority_log_weights(rewards, priority, inverse_temperature))


def _softmax(log_weights: np.ndarray) -> np.ndarray:
    shifted = np.exp(log_weights - np.max(log_weights))
    return shifted / shifted.sum()


def _gumbel_top_k(log_weights: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of k ≤ n draws without replacement from softmax(log_weights [n]), in draw order.

    Gumbel-top-k equals sequential sampling without replacement; with k=1 it is an exact
    draw from softmax(log_weights).
    """
    perturbed = log_weights + rng.gumbel(size=log_weights.shape)
    return np.argsort(-perturbed, kind="stable")[:k]


def _draw_by_priority(log_weights: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k row indices into a group of n = len(log_weights) trajectories.

    Without replacement while the group lasts; when n < k, the remaining k − n rows are
    drawn with replacement from the same distribution. Returns int64 [k].
    """
    n = len(log_weights)
    distinct = _gumbel_top_k(log_weights, min(k, n), rng)
    if k <= n:
        return distinct
    repeats = rng.choice(n, size=k - n, replace=True, p=_softmax(log_weights))
    return np.concatenate([distinct, repeats])


def _draw_distinct(pool_size: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """n indices into a pool of `pool_size` items, uniformly, distinct while possible.

    When n > pool_size, whole random permutations of the pool are concatenated, so every
    item is used ⌊n/pool_size⌋ or ⌈n/pool_size⌉ times. Returns int64 [n].
    """
    if n <= pool_size:
        return rng.choice(pool_size, size=n, replace=False)
    num_permutations = -(-n // pool_size)
    permutations = [rng.permutation(pool_size) for _ in range(num_permutations)]
    return np.concatenate(permutations)[:n]


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------


def _validate_config(
    *,
    max_prompt_len: int,
    max_response_len: int,
    capacity: int,
    capacity_per_prompt: int,
    recency_prob: float,
    priority: str,
    priority_inverse_temperature: float,
    draw_rule: str,
) -> None:
    if max_prompt_len <= 0 or max_response_len <= 0:
        raise ValueError(
            f"max_prompt_len={max_prompt_len} and max_response_len={max_response_len} "
            "must both be positive"
        )
    if capacity_per_prompt <= 0:
        raise ValueError(f"capacity_per_prompt={capacity_per_prompt} must be positive")
    if capacity < capacity_per_prompt:
        raise ValueError(
            f"capacity={capacity} is smaller than capacity_per_prompt={capacity_per_prompt}; "
            "raise capacity or lower capacity_per_prompt"
        )
    if not 0.0 <= recency_prob <= 1.0:
        raise ValueError(f"recency_prob={recency_prob} must be in [0, 1]")
    if priority not in PRIORITIES:
        raise ValueError(f"unknown priority {priority!r}; use one of {PRIORITIES}")
    if not (math.isfinite(priority_inverse_temperature) and priority_inverse_temperature >= 0):
        raise ValueError(
            f"priority_inverse_temperature={priority_inverse_temperature} must be finite and "
            ">= 0 (0 means uniform)"
        )
    if draw_rule not in DRAW_RULES:
        raise ValueError(f"unknown draw_rule {draw_rule!r}; use one of {DRAW_RULES}")


# ---------------------------------------------------------------------------------------
# Indices
# ---------------------------------------------------------------------------------------


class _IndexedSet:
    """A set of ids with O(1) add, discard and access by position (a list and each id's
    position in it; discarding moves the last id into the gap)."""

    def __init__(self, ids: Iterable[int] = ()):
        self.items: list[int] = []
        self._position: dict[int, int] = {}
        for id_ in ids:
            self.add(id_)

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, id_: int) -> bool:
        return id_ in self._position

    def add(self, id_: int) -> None:
        if id_ not in self._position:
            self._position[id_] = len(self.items)
            self.items.append(id_)

    def discard(self, id_: int) -> None:
        position = self._position.pop(id_, None)
        if position is None:
            return
        last = self.items.pop()
        if position < len(self.items):
            self.items[position] = last
            self._position[last] = position

    def take(self, position: int) -> int:
        """Removes and returns the id at `position`."""
        id_ = self.items[position]
        self.discard(id_)
        return id_


class _Group:
    """One prompt's stored samples: their slots in eviction order (oldest first) and an
    index of their responses by hash (a list where distinct responses share a hash)."""

    __slots__ = ("_by_hash", "slots")

    def __init__(self):
        self.slots: list[int] = []
        self._by_hash: dict[int, int | list[int]] = {}

    def twin_of(
        self, response_hash: int, slot: int, same: Callable[[int, int], bool]
    ) -> int | None:
        """The stored slot whose response equals `slot`'s, if any."""
        entry = self._by_hash.get(response_hash)
        if entry is None:
            return None
        for candidate in entry if isinstance(entry, list) else (entry,):
            if same(candidate, slot):
                return candidate
        return None

    def insert(self, slot: int, response_hash: int, position: int) -> None:
        self.slots.insert(position, slot)
        entry = self._by_hash.get(response_hash)
        if entry is None:
            self._by_hash[response_hash] = slot
        elif isinstance(entry, list):
            entry.append(slot)
        else:
            self._by_hash[response_hash] = [entry, slot]

    def remove(self, slot: int, response_hash: int) -> None:
        self.slots.remove(slot)
        entry = self._by_hash[response_hash]
        if not isinstance(entry, list):
            del self._by_hash[response_hash]
            return
        entry.remove(slot)
        if len(entry) == 1:
            self._by_hash[response_hash] = entry[0]


class _OldestFirst:
    """The stored samples in eviction order, oldest first, for the global capacity.

    Holds a queue of the slots with the smallest eviction keys (seq, or version then seq),
    found by one vectorised scan of the store's columns, and scans again when the queue
    runs out: O(1) amortised per eviction and nothing per added sample. A queued slot is
    still that sample while its seq is unchanged. Keys of samples added after a scan are
    larger than every queued key, except, by version, a sample of an older version:
    `note_added` then drops the queue.
    """

    def __init__(self, by_version: bool):
        self.by_version = by_version
        self._drop_queue()
        self._base_version = 0

    def _drop_queue(self) -> None:
        self._slots = np.empty(0, dtype=np.int64)
        self._seqs = np.empty(0, dtype=np.int64)
        self._next = 0
        self._largest_key: int | None = None

    def keys(self, versions: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        """int64 eviction keys of samples with these versions and seqs."""
        if not self.by_version:
            return seqs.astype(np.int64)
        return ((versions - self._base_version) << _VERSION_KEY_SHIFT) + seqs

    def note_added(self, versions: np.ndarray, seqs: np.ndarray) -> None:
        if not self.by_version or self._largest_key is None or not len(versions):
            return
        if (
            versions.min() < self._base_version
            or self.keys(versions, seqs).min() < self._largest_key
        ):
            self._drop_queue()

    def oldest(self, store: SampleStore, n: int) -> np.ndarray:
        """int64 [1..n] slots of the oldest stored samples, oldest first (the store must
        hold one): those still stored among the next n queued, or after a new scan. The
        caller removes them (a removed sample's seq is FREE_SEQ) before asking again."""
        while True:
            if self._next == len(self._slots):
                self._scan(store)
            end = min(len(self._slots), self._next + n)
            slots, seqs = self._slots[self._next : end], self._seqs[self._next : end]
            self._next = end
            still_stored = store.slots.arrays["seq"][slots] == seqs
            if still_stored.any():
                return slots[still_stored]

    def _scan(self, store: SampleStore) -> None:
        live = store.live_slots()
        if not len(live):
            raise RuntimeError("no stored sample to evict")
        seqs = store.slots.arrays["seq"][live]
        versions = store.slots.arrays["policy_version"][live]
        if self.by_version:
            self._base_version = int(versions.min())
        keys = self.keys(versions, seqs)
        take = min(len(live), max(EVICTION_SCAN_MIN, int(len(live) * EVICTION_SCAN_SHARE)))
        smallest = np.argpartition(keys, take - 1)[:take] if take < len(live) else np.arange(take)
        order = smallest[np.argsort(keys[smallest], kind="stable")]
        self._slots, self._seqs = live[order], seqs[order]
        self._next, self._largest_key = 0, int(keys[order[-1]])


@dataclasses.dataclass
class _Change:
    """What one add or removal pass did: slots to free, prompts touched and refreshed."""

    removed: list[int] = dataclasses.field(default_factory=list)
    touched: dict[int, None] = dataclasses.field(default_factory=dict)
    refreshed: dict[int, None] = dataclasses.field(default_factory=dict)
    replaced: int = 0  # added samples that replaced a stored duplicate


def _packed_subset(packed: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
    """The packed arrays (`pack_trajectories`' layout) of the samples `rows` [n]."""
    subset = {key: packed[key][rows] for key in _PACKED_SCALAR_KEYS if key in packed}
    ragged = (
        ("traj_prompt_offsets", ("traj_prompt_tokens",)),
        (
            "traj_response_offsets",
            ("traj_response_tokens", "traj_token_logp_behaviour", "traj_token_logp_ref"),
        ),
    )
    for offsets_key, token_keys in ragged:
        offsets = packed[offsets_key]
        starts, lengths = offsets[rows], offsets[rows + 1] - offsets[rows]
        new_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=new_offsets[1:])
        index = np.repeat(starts - new_offsets[:-1], lengths) + np.arange(new_offsets[-1])
        subset[offsets_key] = new_offsets
        for key in token_keys:
            subset[key] = packed[key][index]
    return subset


# ---------------------------------------------------------------------------------------
# The buffer
# ---------------------------------------------------------------------------------------


class ReplayBuffer:
    """Thread-safe replay buffer of trajectories grouped per prompt id.

    Args:
      max_prompt_len: prompts are left-padded to this length; longer ones are rejected.
      max_response_len: responses are right-padded to this length; longer ones are rejected.
      pad_id: token id used for padding.
      capacity: max trajectories in the whole buffer.
      capacity_per_prompt: max trajectories per prompt id.
      recency_prob: m, probability that a prompt slot is a recency (online) draw.
      priority: "uniform" | "softmax" | "rank", the priority over rewards for priority draws.
      priority_inverse_temperature: a ≥ 0; softmax p ∝ exp(a·r), rank p ∝ rank^(−a) with
        rank 1 = highest reward (ties share their mean rank); a = 0 is uniform.
      draw_rule: "authors" | "newest": which prompts and samples draws take and which
        samples eviction drops (module docstring).
    """

    def __init__(
        self,
        *,
        max_prompt_len: int,
        max_response_len: int,
        pad_id: int,
        capacity: int,
        capacity_per_prompt: int,
        recency_prob: float,
        priority: str = "softmax",
        priority_inverse_temperature: float = 1.0,
        draw_rule: str = "newest",
    ):
        _validate_config(
            max_prompt_len=max_prompt_len,
            max_response_len=max_response_len,
            capacity=capacity,
            capacity_per_prompt=capacity_per_prompt,
            recency_prob=recency_prob,
            priority=priority,
            priority_inverse_temperature=priority_inverse_temperature,
            draw_rule=draw_rule,
        )
        self.max_prompt_len = int(max_prompt_len)
        self.max_response_len = int(max_response_len)
        self.pad_id = int(pad_id)
        self.capacity = int(capacity)
        self.capacity_per_prompt = int(capacity_per_prompt)
        self.recency_prob = float(recency_prob)
        self.priority = priority
        self.priority_inverse_temperature = float(priority_inverse_temperature)
        self.draw_rule = draw_rule
        self._by_version = draw_rule == "authors"
        self._lock = threading.Lock()
        self._clear()
        # Set by drop_older_than: samples of older versions are refused by `add` (counted).
        self.min_policy_version: int | None = None
        self.refused_stale = 0

    def _clear(self) -> None:
        self._store = SampleStore(
            self.max_prompt_len, self.max_response_len, self.pad_id, self.capacity
        )
        self._groups: dict[int, _Group] = {}
        self._num_stored = 0
        self._next_seq = 0
        self._count_by_version: dict[int, int] = {}
        self._oldest_first = _OldestFirst(by_version=self._by_version)
        self._prompt_order = _IndexedSet()  # every stored prompt, as draws index them
        # The sync window (both rules keep it; the authors' draws read it).
        self._sync_window = 0
        self._sync_pending = False
        self._sync_version: int | None = None
        # authors: the online pool of this window and the offline epoch order.
        self._online_pool = _IndexedSet()
        self._online_drawn = _IndexedSet()
        self._offline_order: list[int] = []
        # newest: refresh order (least recent first) and prompts by their newest version.
        self._refresh_order: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._newest_version: dict[int, int] = {}
        self._prompts_by_newest_version: dict[int, _IndexedSet] = {}

    # -- public API ---------------------------------------------------------------------

    def __len__(self) -> int:
        """Number of stored trajectories."""
        with self._lock:
            return self._num_stored

    @property
    def num_prompts(self) -> int:
        """Number of prompt ids with at least one stored trajectory."""
        with self._lock:
            return len(self._groups)

    def add(self, trajectories: Sequence[Trajectory]) -> int:
        """Store `trajectories`; returns how many were new (not refreshes of stored ones).

        All trajectories are validated before any is stored, so a ValueError leaves the
        buffer unchanged. A trajectory whose (prompt_id, response_tokens) is already
        stored replaces the stored one and becomes the newest. New trajectories count in
        the return value even if capacity evicts them again within the same call.
        """
        packed = packed_for_storage(trajectories, self.max_prompt_len, self.max_response_len)
        with self._lock:
            packed = self._without_stale(packed)
            num = len(packed["traj_prompt_id"])
            if not num:
                return 0
            if self._sync_pending:
                self._start_sync_window()
            windows = np.full(num, self._sync_window, dtype=np.int64)
            return self._store_packed(packed, windows)

    def mark_sync(self, version: int) -> None:
        """Params of `version` were just published to the searchers: the next add starts
        a new sync window (the authors' online samples are those of the current window).
        A version not newer than the latest marked one is ignored."""
        with self._lock:
            if self._sync_version is not None and version <= self._sync_version:
                return
            self._sync_version = int(version)
            self._sync_pending = True

    def drop_older_than(self, version: int) -> int:
        """Removes every trajectory whose policy version is below `version`, and from now
        on refuses to add such trajectories (`refused_stale` counts them); returns how many
        were removed. Costs the number of stored versions when none is older, else one
        vectorised pass over the stored samples plus the number removed."""
        with self._lock:
            if self.min_policy_version is None or version > self.min_policy_version:
                self.min_policy_version = version
            if not any(v < version for v in self._count_by_version):
                return 0
            live = self._store.live_slots()
            stale = live[self._store.column("policy_version")[live] < version]
            change = _Change()
            for slot in stale.tolist():
                self._remove(slot, change)
            self._finish(change)
            return len(stale)

    def num_prompts_since(self, version: int) -> int:
        """Number of prompt ids with a stored trajectory of policy version `version` or
        newer: what `num_prompts` would be after `drop_older_than(version)`, nothing
        dropped. Costs the number of stored versions when none is older, else one
        vectorised pass over the stored samples."""
        with self._lock:
            if not any(v < version for v in self._count_by_version):
                return len(self._groups)
            live = self._store.live_slots()
            fresh = live[self._store.column("policy_version")[live] >= version]
            return len(np.unique(self._store.column("prompt_id")[fresh]))

    def sample(self, num_prompts: int, k: int, rng: np.random.Generator) -> SampledBatch:
        """Draw B = num_prompts prompt slots × K responses each; see the module docstring.

        "newest": prompts are distinct within the batch when the buffer holds enough;
        otherwise prompts repeat. "authors": prompts repeat only when a pool runs out
        within the batch, or as one online and one offline draw. A prompt with fewer than
        K trajectories repeats some of them so every slot has exactly K rows.
        """
        if num_prompts <= 0 or k <= 0:
            raise ValueError(f"num_prompts={num_prompts} and k={k} must both be positive")
        with self._lock:
            if not self._groups:
                raise ValueError(
                    "cannot sample from an empty replay buffer; add trajectories first"
                )
            from_recency = rng.random(num_prompts) < self.recency_prob
            if self.draw_rule == "authors":
                prompt_ids, from_recency, slots = self._draw_authors(from_recency, k, rng)
            else:
                prompt_ids, slots = self._draw_newest(from_recency, k, rng)
            return self._store.gather(slots, prompt_ids, from_recency)

    def stats(self, current_version: int | None = None) -> dict[str, float]:
        """Summary numbers for logging.

        Keys: num_trajectories, num_prompts, reward_mean, reward_max, response_length_mean,
        max_policy_version, and age_mean / age_max (in policy versions, current_version −
        policy_version) when current_version is given. Means/maxima are NaN when empty.
        """
        with self._lock:
            live = self._store.live_slots()
            rewards = self._store.column("reward")[live]
            lengths = self._store.column("response_length")[live].astype(np.float64)
            versions = self._store.column("policy_version")[live].astype(np.float64)
            num_prompts = len(self._groups)
        stats = {
            "num_trajectories": float(len(live)),
            "num_prompts": float(num_prompts),
            # fsum: exact, so the same samples in another slot order give the same mean
            "reward_mean": math.fsum(rewards.tolist()) / len(rewards) if len(rewards) else math.nan,
            "reward_max": _max_or_nan(rewards),
            "response_length_mean": _mean_or_nan(lengths),
            "max_policy_version": _max_or_nan(versions),
        }
        if current_version is not None:
            ages = current_version - versions
            stats["age_mean"] = _mean_or_nan(ages)
            stats["age_max"] = _max_or_nan(ages)
        return stats

    def state_dict(self) -> dict[str, np.ndarray]:
        """The whole buffer as a flat dict of numeric NumPy arrays.

        Trajectories are stored oldest first (global insertion/refresh order), with ragged
        token arrays packed flat plus offsets [N+1]; config values are stored under
        "config_*" keys; the sync window and the draw rules' pools and orders under the
        keys of `_OPTIONAL_STATE_KEYS`. Safe for `np.savez` (no pickling) and orbax.
        """
        with self._lock:
            live = self._store.live_slots()
            oldest_first = live[np.argsort(self._store.column("seq")[live], kind="stable")]
            state = self._config_state()
            state.update(self._store.pack(oldest_first))
            state.update(self._draw_state())
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Replace the contents with those saved by `state_dict` (order included).

        The padding layout (max_prompt_len, max_response_len, pad_id) must match this
        buffer's. Capacity, recency, priority and draw-rule settings are this buffer's
        own; if the restored contents exceed this buffer's capacity, the oldest are
        evicted.
        """
        state = _read_state_arrays(state)
        self._check_state_layout(state)
        packed = {key: state[key] for key in state if key.startswith("traj_")}
        num = len(packed["traj_prompt_id"])
        window = int(state.get("sync_window", 0))
        windows = packed.pop("traj_sync_window", np.full(num, window, dtype=np.int64))
        with self._lock:
            self._clear()
            self._sync_window = window
            self._sync_pending = bool(state.get("sync_pending", False))
            if "sync_version" in state:
                self._sync_version = int(state["sync_version"])
            for start in range(0, num, LOAD_CHUNK):
                rows = np.arange(start, min(num, start + LOAD_CHUNK))
                self._store_packed(_packed_subset(packed, rows), windows[rows])
            self._restore_draw_orders(state)

    # -- adding and removing (caller holds the lock) ------------------------------------

    def _without_stale(self, packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`packed` without the samples older than `min_policy_version` (counted)."""
        if self.min_policy_version is None:
            return packed
        fresh = packed["traj_policy_version"] >= self.min_policy_version
        if fresh.all():
            return packed
        self.refused_stale += int((~fresh).sum())
        return _packed_subset(packed, np.flatnonzero(fresh))

    def _start_sync_window(self) -> None:
        """The first add after a sync: a new window, with empty online pools."""
        self._sync_window += 1
        self._sync_pending = False
        self._online_pool, self._online_drawn = _IndexedSet(), _IndexedSet()

    def _store_packed(self, packed: dict[str, np.ndarray], windows: np.ndarray) -> int:
        """Stores packed samples added in `windows`, then evicts; returns how many were new."""
        num = len(packed["traj_prompt_id"])
        seqs = np.arange(self._next_seq, self._next_seq + num, dtype=np.int64)
        self._next_seq += num
        slots = self._store.put(packed, seqs, windows)
        versions = packed["traj_policy_version"]
        self._oldest_first.note_added(versions, seqs)
        self._num_stored += num
        for version, count in zip(*np.unique(versions, return_counts=True), strict=True):
            version = int(version)
            self._count_by_version[version] = self._count_by_version.get(version, 0) + int(count)
        change = _Change()
        hashes = self._store.column("response_hash")[slots].tolist()
        for slot, prompt_id, response_hash, version in zip(
            slots.tolist(),
            packed["traj_prompt_id"].tolist(),
            hashes,
            versions.tolist(),
            strict=True,
        ):
            self._insert(slot, prompt_id, response_hash, version, change)
        while self._num_stored > self.capacity:
            oldest = self._oldest_first.oldest(self._store, self._num_stored - self.capacity)
            self._remove_many(oldest, change)
        self._finish(change)
        return num - change.replaced

    def _insert(
        self, slot: int, prompt_id: int, response_hash: int, version: int, change: _Change
    ) -> None:
        """Files a stored sample under its prompt: replaces its duplicate, evicts beyond
        capacity_per_prompt."""
        group = self._groups.get(prompt_id)
        if group is None:
            group = self._groups[prompt_id] = _Group()
        twin = group.twin_of(response_hash, slot, self._store.same_response)
        if twin is not None:
            self._remove(twin, change)
            change.replaced += 1
        group.insert(slot, response_hash, self._position_in_group(group, version))
        while len(group.slots) > self.capacity_per_prompt:
            self._remove(group.slots[0], change)
        if not self._by_version:
            self._refresh_order[prompt_id] = None
            self._refresh_order.move_to_end(prompt_id)
        change.touched[prompt_id] = None
        change.refreshed[prompt_id] = None

    def _position_in_group(self, group: _Group, version: int) -> int:
        """Where a newly added sample goes in its group's eviction order: last by insertion;
        by version, after every sample of a version ≤ its own."""
        position = len(group.slots)
        if self._by_version:
            versions = self._store.slots.arrays["policy_version"]
            while position and versions[group.slots[position - 1]] > version:
                position -= 1
        return position

    def _remove(self, slot: int, change: _Change) -> None:
        """Takes a stored sample out of every index; its storage is freed by `_finish`."""
        columns = self._store.slots.arrays
        prompt_id = int(columns["prompt_id"][slot])
        self._groups[prompt_id].remove(slot, int(columns["response_hash"][slot]))
        self._uncount_version(int(columns["policy_version"][slot]), 1)
        columns["seq"][slot] = FREE_SEQ
        self._num_stored -= 1
        change.removed.append(slot)
        change.touched[prompt_id] = None

    def _remove_many(self, slots: np.ndarray, change: _Change) -> None:
        """`_remove` of each of `slots` (int64 [n]), their columns read at once."""
        columns = self._store.slots.arrays
        groups, touched = self._groups, change.touched
        prompt_ids = columns["prompt_id"][slots].tolist()
        hashes = columns["response_hash"][slots].tolist()
        for slot, prompt_id, response_hash in zip(slots.tolist(), prompt_ids, hashes, strict=True):
            groups[prompt_id].remove(slot, response_hash)
            touched[prompt_id] = None
        versions, counts = np.unique(columns["policy_version"][slots], return_counts=True)
        for version, count in zip(versions.tolist(), counts.tolist(), strict=True):
            self._uncount_version(version, count)
        columns["seq"][slots] = FREE_SEQ
        self._num_stored -= len(slots)
        change.removed.extend(slots.tolist())

    def _uncount_version(self, version: int, count: int) -> None:
        left = self._count_by_version[version] - count
        if left:
            self._count_by_version[version] = left
        else:
            del self._count_by_version[version]

    def _finish(self, change: _Change) -> None:
        """Frees the removed samples' storage and brings the prompt indices up to date."""
        self._store.free(np.asarray(change.removed, dtype=np.int64))
        for prompt_id in change.touched:
            if self._groups[prompt_id].slots:
                self._prompt_order.add(prompt_id)
            else:
                self._forget_prompt(prompt_id)
            if not self._by_version:
                self._index_newest_version(prompt_id)
        if self._by_version:
            for prompt_id in change.refreshed:
                if prompt_id in self._groups and prompt_id not in self._online_drawn:
                    self._online_pool.add(prompt_id)

    def _forget_prompt(self, prompt_id: int) -> None:
        del self._groups[prompt_id]
        self._prompt_order.discard(prompt_id)
        self._refresh_order.pop(prompt_id, None)

    def _index_newest_version(self, prompt_id: int) -> None:
        """newest: files the prompt under the version of its newest sample (or nowhere)."""
        group = self._groups.get(prompt_id)
        version = None
        if group is not None:
            version = int(self._store.slots.arrays["policy_version"][group.slots[-1]])
        previous = self._newest_version.get(prompt_id)
        if previous == version:
            return
        if previous is not None:
            prompts = self._prompts_by_newest_version[previous]
            prompts.discard(prompt_id)
            if not prompts:
                del self._prompts_by_newest_version[previous]
            del self._newest_version[prompt_id]
        if version is not None:
            self._newest_version[prompt_id] = version
            self._prompts_by_newest_version.setdefault(version, _IndexedSet()).add(prompt_id)

    # -- draws (caller holds the lock) --------------------------------------------------

    def _group_slots(self, prompt_id: int) -> np.ndarray:
        """int64 [n] the prompt's stored slots in eviction order."""
        return np.asarray(self._groups[prompt_id].slots, dtype=np.int64)

    def _priority_rows(self, prompt_id: int, k: int, rng: np.random.Generator) -> np.ndarray:
        """K slots of the prompt by priority over reward, without replacement while they last."""
        slots = self._group_slots(prompt_id)
        rewards = self._store.slots.arrays["reward"][slots]
        log_weights = priority_log_weights(
            rewards, self.priority, self.priority_inverse_temperature
        )
        return slots[_draw_by_priority(log_weights, k, rng)]

    def _draw_newest(
        self, from_recency: np.ndarray, k: int, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """newest: prompt ids [B] and slots [B·K], prompt-major."""
        prompt_ids = self._choose_newest_rule_prompts(from_recency, rng)
        rows = []
        for prompt_id, is_recency in zip(prompt_ids.tolist(), from_recency, strict=True):
            if is_recency:
                newest_first = self._group_slots(prompt_id)[::-1]
                rows.append(newest_first[np.arange(k) % len(newest_first)])
            else:
                rows.append(self._priority_rows(prompt_id, k, rng))
        return prompt_ids, np.concatenate(rows)

    def _choose_newest_rule_prompts(
        self, from_recency: np.ndarray, rng: np.random.Generator
    ) -> np.ndarray:
        """Prompt id per slot [B]: recency slots first pick, priority slots avoid them."""
        prompt_ids = np.empty(len(from_recency), dtype=np.int64)
        num_recency = int(from_recency.sum())
        recency_ids = self._choose_recency_prompts(num_recency, rng)
        prompt_ids[from_recency] = recency_ids
        prompt_ids[~from_recency] = self._choose_uniform_prompts(
            len(from_recency) - num_recency, set(recency_ids.tolist()), rng
        )
        return prompt_ids

    def _choose_recency_prompts(self, num_recency: int, rng: np.random.Generator) -> np.ndarray:
        """Distinct prompts whose newest sample has the highest stored version, extended
        with the most recently refreshed others when there are fewer than `num_recency`."""
        if num_recency == 0:
            return np.empty(0, dtype=np.int64)
        latest = self._prompts_by_newest_version.get(max(self._count_by_version), _IndexedSet())
        if len(latest) >= num_recency:
            positions = _draw_distinct(len(latest), num_recency, rng)
            return np.asarray([latest.items[p] for p in positions.tolist()], dtype=np.int64)
        candidates = list(latest.items)
        for prompt_id in reversed(self._refresh_order):
            if len(candidates) >= num_recency:
                break
            if prompt_id not in latest:
                candidates.append(prompt_id)
        candidates = np.asarray(candidates, dtype=np.int64)
        return candidates[_draw_distinct(len(candidates), num_recency, rng)]

    def _choose_uniform_prompts(
        self, num: int, taken: set[int], rng: np.random.Generator
    ) -> np.ndarray:
        """Uniform prompts, distinct from each other and from `taken` while possible."""
        prompts = self._prompt_order.items
        if num + len(taken) <= len(prompts) // 2:  # sparse: draw and reject repeats
            chosen: list[int] = []
            seen = set(taken)
            while len(chosen) < num:
                for position in rng.integers(len(prompts), size=num - len(chosen)).tolist():
                    if prompts[position] not in seen:
                        seen.add(prompts[position])
                        chosen.append(prompts[position])
            return np.asarray(chosen, dtype=np.int64)
        all_prompts = np.asarray(prompts, dtype=np.int64)
        untaken = np.asarray([p for p in prompts if p not in taken], dtype=np.int64)
        if num <= len(untaken):
            return untaken[_draw_distinct(len(untaken), num, rng)]
        every_untaken = untaken[rng.permutation(len(untaken))]
        repeats = all_prompts[_draw_distinct(len(all_prompts), num - len(untaken), rng)]
        return np.concatenate([every_untaken, repeats])

    def _draw_authors(
        self, from_recency: np.ndarray, k: int, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """authors: prompt ids [B], whether each slot was an online draw [B], slots [B·K]."""
        prompt_ids = np.empty(len(from_recency), dtype=np.int64)
        online = np.zeros(len(from_recency), dtype=bool)
        rows = []
        for index, wants_online in enumerate(from_recency.tolist()):
            drawn = self._take_online_prompt(rng) if wants_online else None
            if drawn is not None:
                prompt_ids[index], online_slots = drawn
                online[index] = True
                picks = rng.choice(len(online_slots), size=k, replace=len(online_slots) < k)
                rows.append(online_slots[picks])
            else:
                prompt_ids[index] = self._take_offline_prompt(rng)
                rows.append(self._priority_rows(int(prompt_ids[index]), k, rng))
        return prompt_ids, online, np.concatenate(rows)

    def _online_slots(self, prompt_id: int) -> np.ndarray:
        """int64 [n] the prompt's samples added in the current sync window."""
        slots = self._group_slots(prompt_id)
        return slots[self._store.slots.arrays["sync_window"][slots] == self._sync_window]

    def _take_online_prompt(self, rng: np.random.Generator) -> tuple[int, np.ndarray] | None:
        """A prompt refreshed this window, without replacement (the pool refilled with
        this window's drawn prompts when it runs out), and its online slots; None when no
        stored prompt has a sample of this window."""
        while True:
            if not self._online_pool:
                if not self._online_drawn:
                    return None
                self._online_pool, self._online_drawn = self._online_drawn, _IndexedSet()
            prompt_id = self._online_pool.take(int(rng.integers(len(self._online_pool))))
            if prompt_id not in self._groups:
                continue  # its samples were all evicted or dropped
            online_slots = self._online_slots(prompt_id)
            if len(online_slots):
                self._online_drawn.add(prompt_id)
                return prompt_id, online_slots

    def _take_offline_prompt(self, rng: np.random.Generator) -> int:
        """The next stored prompt of the epoch order; a new epoch (a shuffle of every
        stored prompt) when it runs out."""
        while True:
            if not self._offline_order:
                prompts = self._prompt_order.items
                self._offline_order = [prompts[p] for p in rng.permutation(len(prompts)).tolist()]
            prompt_id = self._offline_order.pop()
            if prompt_id in self._groups:
                return prompt_id

    # -- state (caller holds the lock) --------------------------------------------------

    def _config_state(self) -> dict[str, np.ndarray]:
        return {
            "format_version": np.asarray(STATE_FORMAT_VERSION, dtype=np.int64),
            "config_max_prompt_len": np.asarray(self.max_prompt_len, dtype=np.int64),
            "config_max_response_len": np.asarray(self.max_response_len, dtype=np.int64),
            "config_pad_id": np.asarray(self.pad_id, dtype=np.int64),
            "config_capacity": np.asarray(self.capacity, dtype=np.int64),
            "config_capacity_per_prompt": np.asarray(self.capacity_per_prompt, dtype=np.int64),
            "config_recency_prob": np.asarray(self.recency_prob, dtype=np.float64),
            "config_priority_index": np.asarray(PRIORITIES.index(self.priority), dtype=np.int64),
            "config_priority_inverse_temperature": np.asarray(
                self.priority_inverse_temperature, dtype=np.float64
            ),
        }

    def _draw_state(self) -> dict[str, np.ndarray]:
        """The sync window and the draw rules' pools and orders, as int64 arrays."""
        newest = [(p, v) for v, ps in self._prompts_by_newest_version.items() for p in ps.items]
        state = {
            "sync_window": np.asarray(self._sync_window, dtype=np.int64),
            "sync_pending": np.asarray(self._sync_pending, dtype=np.int64),
            "online_pool": _ids(self._online_pool.items),
            "online_drawn": _ids(self._online_drawn.items),
            "offline_order": _ids(self._offline_order),
            "prompt_order": _ids(self._prompt_order.items),
            "newest_prompts": _ids([p for p, _ in newest]),
            "newest_prompt_versions": _ids([v for _, v in newest]),
        }
        if self._sync_version is not None:
            state["sync_version"] = np.asarray(self._sync_version, dtype=np.int64)
        return state

    def _restore_draw_orders(self, state: dict[str, np.ndarray]) -> None:
        """Adopts the saved pools and orders (a state without them keeps those rebuilt by
        re-adding its samples). Saved orders replace rebuilt ones only where they hold
        the same prompts."""
        if "online_pool" in state:
            self._online_pool = _IndexedSet(state["online_pool"].tolist())
            self._online_drawn = _IndexedSet(state["online_drawn"].tolist())
            self._offline_order = state["offline_order"].tolist()
        if "prompt_order" in state:
            saved = state["prompt_order"].tolist()
            if set(saved) == set(self._prompt_order.items):
                self._prompt_order = _IndexedSet(saved)
        if "newest_prompts" in state:
            self._restore_newest_orders(
                state["newest_prompts"].tolist(), state["newest_prompt_versions"].tolist()
            )

    def _restore_newest_orders(self, prompts: list[int], versions: list[int]) -> None:
        saved: dict[int, list[int]] = {}
        for prompt_id, version in zip(prompts, versions, strict=True):
            saved.setdefault(version, []).append(prompt_id)
        for version, ordered in saved.items():
            rebuilt = self._prompts_by_newest_version.get(version)
            if rebuilt is not None and set(ordered) == set(rebuilt.items):
                self._prompts_by_newest_version[version] = _IndexedSet(ordered)

    def _check_state_layout(self, state: dict[str, np.ndarray]) -> None:
        if int(state["format_version"]) != STATE_FORMAT_VERSION:
            raise ValueError(
                f"replay state has format_version={int(state['format_version'])}, this code "
                f"reads {STATE_FORMAT_VERSION}; load it with the matching tba_jax version"
            )
        for name in ("max_prompt_len", "max_response_len", "pad_id"):
            saved, ours = int(state[f"config_{name}"]), getattr(self, name)
            if saved != ours:
                raise ValueError(
                    f"replay state was saved with {name}={saved} but this buffer has "
                    f"{name}={ours}; construct the buffer with {name}={saved}"
                )
        check_packed_layout(state)
        longest_prompt = _longest(state["traj_prompt_offsets"])
        longest_response = _longest(state["traj_response_offsets"])
        if longest_prompt > self.max_prompt_len or longest_response > self.max_response_len:
            raise ValueError(
                f"replay state holds a prompt of {longest_prompt} or a response of "
                f"{longest_response} tokens, beyond max_prompt_len={self.max_prompt_len} or "
                f"max_response_len={self.max_response_len}; it is corrupt"
            )


def _ids(ids: Sequence[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64).reshape(-1)


def _longest(offsets: np.ndarray) -> int:
    return int(np.diff(offsets).max()) if len(offsets) > 1 else 0


def _mean_or_nan(values: np.ndarray) -> float:
    return float(values.mean()) if len(values) else math.nan


def _max_or_nan(values: np.ndarray) -> float:
    return float(values.max()) if len(values) else math.nan


# ---------------------------------------------------------------------------------------
# state_dict reading
# ---------------------------------------------------------------------------------------


def _read_state_arrays(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The required entries of `state` as in-memory arrays (reads an NpzFile only once)."""
    required = (
        ["format_version"]
        + [f"config_{name}" for name in _CONFIG_KEYS]
        + [f"traj_{name}" for name in _TRAJECTORY_KEYS]
    )
    missing = [key for key in required if key not in state]
    if missing:
        raise ValueError(
            f"replay state is missing keys {missing}; pass a dict made by ReplayBuffer.state_dict()"
        )
    optional = [key for key in _OPTIONAL_STATE_KEYS if key in state]
    return {key: np.asarray(state[key]) for key in required + optional}
