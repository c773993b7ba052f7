"""Replay buffer for TBA: host-memory store of scored trajectories, grouped per prompt.

Searcher threads `add` scored samples as they finish; the learner `sample`s batches of
B prompts × K responses. For each prompt slot, with probability `recency_prob` (m) the
slot is a *recency* draw (a prompt refreshed at the latest publish and its newest K
samples), otherwise a *priority* draw (a prompt uniformly from all prompts and K of its
samples drawn without replacement by a priority over reward).

`drop_older_than(version)` removes the samples of older policy versions and refuses
any added later (a staleness bound; the async source calls it with
`replay.max_policy_lag`).

All public methods take one lock, so several searcher threads and the learner may call
them at once. `state_dict` / `load_state_dict` save and restore the whole buffer
(contents and insertion order) as a flat dict of NumPy arrays for the checkpoint.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Sequence

import numpy as np

from tba_jax.trajectories import (
    SampledBatch,
    Trajectory,
    collate,
    normalised_trajectory,
    pack_trajectories,
    unpack_trajectories,
)

PRIORITIES = ("uniform", "softmax", "rank")
"""Names accepted by `ReplayBuffer(priority=...)`."""

STATE_FORMAT_VERSION = 1
"""Version of the `state_dict` layout; bumped when the layout changes."""

_TrajectoryKey = tuple[int, bytes]  # (prompt_id, response tokens as int32 bytes)

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
# Read when present: states saved before in-flight updates have no last versions.
_OPTIONAL_STATE_KEYS = ("traj_policy_version_last",)


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


def _trajectory_key(trajectory: Trajectory) -> _TrajectoryKey:
    return trajectory.prompt_id, trajectory.response_tokens.tobytes()


# ---------------------------------------------------------------------------------------
# The buffer
# ---------------------------------------------------------------------------------------


class ReplayBuffer:
    """Thread-safe replay buffer of trajectories grouped per prompt id.

    Order: every `add` (new or refreshed trajectory) makes that trajectory the newest,
    both in its prompt's group and globally, and makes its prompt the most recently
    refreshed. Eviction removes the oldest first: per prompt beyond `capacity_per_prompt`,
    globally beyond `capacity`.

    Args:
      max_prompt_len: prompts are left-padded to this length; longer ones are rejected.
      max_response_len: responses are right-padded to this length; longer ones are rejected.
      pad_id: token id used for padding.
      capacity: max trajectories in the whole buffer.
      capacity_per_prompt: max trajectories per prompt id.
      recency_prob: m, probability that a prompt slot is a recency draw.
      priority: "uniform" | "softmax" | "rank", the priority over rewards for priority draws.
      priority_inverse_temperature: a ≥ 0; softmax p ∝ exp(a·r), rank p ∝ rank^(−a) with
        rank 1 = highest reward (ties share their mean rank); a = 0 is uniform.
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
    ):
        _validate_config(
            max_prompt_len=max_prompt_len,
            max_response_len=max_response_len,
            capacity=capacity,
            capacity_per_prompt=capacity_per_prompt,
            recency_prob=recency_prob,
            priority=priority,
            priority_inverse_temperature=priority_inverse_temperature,
        )
        self.max_prompt_len = int(max_prompt_len)
        self.max_response_len = int(max_response_len)
        self.pad_id = int(pad_id)
        self.capacity = int(capacity)
        self.capacity_per_prompt = int(capacity_per_prompt)
        self.recency_prob = float(recency_prob)
        self.priority = priority
        self.priority_inverse_temperature = float(priority_inverse_temperature)
        self._lock = threading.Lock()
        self._clear()
        # Set by drop_older_than: samples of older versions are refused by `add` (counted).
        self.min_policy_version: int | None = None
        self.refused_stale = 0

    # -- storage primitives (caller holds the lock) -------------------------------------

    def _clear(self) -> None:
        # Global insertion/refresh order, oldest first.
        self._order: collections.OrderedDict[_TrajectoryKey, Trajectory] = collections.OrderedDict()
        # Per prompt: response bytes -> trajectory, oldest first.
        self._groups: dict[int, collections.OrderedDict[bytes, Trajectory]] = {}
        # Prompts by refresh order, least recently refreshed first.
        self._prompt_order: collections.OrderedDict[int, None] = collections.OrderedDict()
        # Stored keys per policy version (insertion order within a version).
        self._keys_by_version: dict[int, dict[_TrajectoryKey, None]] = {}

    def _insert(self, trajectory: Trajectory) -> bool:
        """Store or refresh one normalised trajectory, then evict; True if it was new."""
        key = _trajectory_key(trajectory)
        is_new = key not in self._order
        if not is_new:
            self._remove(key)
        self._order[key] = trajectory
        self._groups.setdefault(trajectory.prompt_id, collections.OrderedDict())[key[1]] = (
            trajectory
        )
        self._prompt_order[trajectory.prompt_id] = None
        self._prompt_order.move_to_end(trajectory.prompt_id)
        self._keys_by_version.setdefault(trajectory.policy_version, {})[key] = None
        self._evict(trajectory.prompt_id)
        return is_new

    def _remove(self, key: _TrajectoryKey) -> None:
        prompt_id, response_key = key
        trajectory = self._order.pop(key)
        group = self._groups[prompt_id]
        del group[response_key]
        if not group:
            del self._groups[prompt_id]
            del self._prompt_order[prompt_id]
        same_version = self._keys_by_version[trajectory.policy_version]
        del same_version[key]
        if not same_version:
            del self._keys_by_version[trajectory.policy_version]

    def _evict(self, prompt_id: int) -> None:
        """Drop the oldest trajectories of `prompt_id`, then globally, until within capacity."""
        group = self._groups[prompt_id]
        while len(group) > self.capacity_per_prompt:
            oldest_response_key = next(iter(group))
            self._remove((prompt_id, oldest_response_key))
        while len(self._order) > self.capacity:
            self._remove(next(iter(self._order)))

    # -- public API ---------------------------------------------------------------------

    def __len__(self) -> int:
        """Number of stored trajectories."""
        with self._lock:
            return len(self._order)

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
        normalised = [
            normalised_trajectory(t, self.max_prompt_len, self.max_response_len)
            for t in trajectories
        ]
        with self._lock:
            if self.min_policy_version is not None:
                fresh = [t for t in normalised if t.policy_version >= self.min_policy_version]
                self.refused_stale += len(normalised) - len(fresh)
                normalised = fresh
            return sum(self._insert(t) for t in normalised)

    def drop_older_than(self, version: int) -> int:
        """Removes every trajectory whose policy version is below `version`, and from now
        on refuses to add such trajectories (`refused_stale` counts them); returns how many
        were removed. Costs the number removed (plus the number of stored versions)."""
        with self._lock:
            if self.min_policy_version is None or version > self.min_policy_version:
                self.min_policy_version = version
            stale = [v for v in self._keys_by_version if v < version]
            keys = [key for v in stale for key in self._keys_by_version[v]]
            for key in keys:
                self._remove(key)
            return len(keys)

    def sample(self, num_prompts: int, k: int, rng: np.random.Generator) -> SampledBatch:
        """Draw B = num_prompts prompt slots × K responses each; see the module docstring.

        Prompts are distinct within the batch when the buffer holds enough; otherwise
        prompts repeat. A prompt with fewer than K trajectories repeats some of them so
        every slot has exactly K rows.
        """
        if num_prompts <= 0 or k <= 0:
            raise ValueError(f"num_prompts={num_prompts} and k={k} must both be positive")
        with self._lock:
            if not self._groups:
                raise ValueError(
                    "cannot sample from an empty replay buffer; add trajectories first"
                )
            from_recency = rng.random(num_prompts) < self.recency_prob
            prompt_ids = self._choose_prompts(from_recency, rng)
            groups = {p: list(self._groups[p].values()) for p in set(prompt_ids.tolist())}
            log_weights = {p: self._group_log_weights(group) for p, group in groups.items()}
            rows: list[Trajectory] = []
            for prompt_id, is_recency in zip(prompt_ids.tolist(), from_recency, strict=True):
                group = groups[prompt_id]
                if is_recency:
                    rows.extend(self._newest_rows(group, k))
                else:
                    rows.extend(group[i] for i in _draw_by_priority(log_weights[prompt_id], k, rng))
            return self._assemble_batch(rows, prompt_ids, from_recency)

    def stats(self, current_version: int | None = None) -> dict[str, float]:
        """Summary numbers for logging.

        Keys: num_trajectories, num_prompts, reward_mean, reward_max, response_length_mean,
        max_policy_version, and age_mean / age_max (in policy versions, current_version −
        policy_version) when current_version is given. Means/maxima are NaN when empty.
        """
        with self._lock:
            trajectories = list(self._order.values())
            num_prompts = len(self._groups)
        rewards = np.array([t.reward for t in trajectories], dtype=np.float64)
        lengths = np.array([t.response_length for t in trajectories], dtype=np.float64)
        versions = np.array([t.policy_version for t in trajectories], dtype=np.float64)
        stats = {
            "num_trajectories": float(len(trajectories)),
            "num_prompts": float(num_prompts),
            "reward_mean": _mean_or_nan(rewards),
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
        "config_*" keys. Safe for `np.savez` (no pickling) and orbax.
        """
        with self._lock:
            trajectories = list(self._order.values())
        state = {
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
        state.update(pack_trajectories(trajectories))
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Replace the contents with those saved by `state_dict` (order included).

        The padding layout (max_prompt_len, max_response_len, pad_id) must match this
        buffer's. Capacity, recency and priority settings are this buffer's own; if the
        restored contents exceed this buffer's capacity, the oldest are evicted.
        """
        state = _read_state_arrays(state)
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
        trajectories = [
            normalised_trajectory(t, self.max_prompt_len, self.max_response_len)
            for t in unpack_trajectories(state)
        ]
        with self._lock:
            self._clear()
            for trajectory in trajectories:
                self._insert(trajectory)

    # -- sampling helpers (caller holds the lock) ---------------------------------------

    def _choose_prompts(self, from_recency: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Prompt id per slot [B]: recency slots first pick, priority slots avoid them."""
        prompt_ids = np.empty(len(from_recency), dtype=np.int64)
        num_recency = int(from_recency.sum())
        recency_ids = self._choose_recency_prompts(num_recency, rng)
        prompt_ids[from_recency] = recency_ids
        prompt_ids[~from_recency] = self._choose_priority_prompts(
            len(from_recency) - num_recency, set(recency_ids.tolist()), rng
        )
        return prompt_ids

    def _recency_candidates(self, num_needed: int) -> list[int]:
        """Prompts whose newest trajectory has the buffer's highest policy version.

        If fewer than `num_needed`, extended with the next most recently refreshed prompts.
        """
        latest_version = max(self._keys_by_version)
        by_recent_refresh = list(reversed(self._prompt_order))
        is_latest = [
            self._newest_in_group(prompt_id).policy_version == latest_version
            for prompt_id in by_recent_refresh
        ]
        candidates = [p for p, latest in zip(by_recent_refresh, is_latest, strict=True) if latest]
        if len(candidates) < num_needed:
            older = [
                p for p, latest in zip(by_recent_refresh, is_latest, strict=True) if not latest
            ]
            candidates += older[: num_needed - len(candidates)]
        return candidates

    def _choose_recency_prompts(self, num_recency: int, rng: np.random.Generator) -> np.ndarray:
        if num_recency == 0:
            return np.empty(0, dtype=np.int64)
        candidates = np.asarray(self._recency_candidates(num_recency), dtype=np.int64)
        return candidates[_draw_distinct(len(candidates), num_recency, rng)]

    def _choose_priority_prompts(
        self, num_priority: int, taken: set[int], rng: np.random.Generator
    ) -> np.ndarray:
        """Uniform prompts, distinct from each other and from `taken` while possible."""
        all_prompts = np.asarray(list(self._prompt_order), dtype=np.int64)
        untaken = np.asarray([p for p in all_prompts if p not in taken], dtype=np.int64)
        if num_priority <= len(untaken):
            return untaken[_draw_distinct(len(untaken), num_priority, rng)]
        every_untaken = untaken[rng.permutation(len(untaken))]
        repeats = all_prompts[_draw_distinct(len(all_prompts), num_priority - len(untaken), rng)]
        return np.concatenate([every_untaken, repeats])

    def _newest_in_group(self, prompt_id: int) -> Trajectory:
        return next(reversed(self._groups[prompt_id].values()))

    @staticmethod
    def _newest_rows(group: list[Trajectory], k: int) -> list[Trajectory]:
        """The newest k of `group` (stored oldest first), newest first.

        A group shorter than k is cycled newest → oldest until k rows are filled.
        """
        newest_first = group[::-1]
        return [newest_first[i % len(newest_first)] for i in range(k)]

    def _group_log_weights(self, group: list[Trajectory]) -> np.ndarray:
        """Priority log-weights [n] of the n trajectories of one group."""
        rewards = np.array([t.reward for t in group], dtype=np.float64)
        return priority_log_weights(rewards, self.priority, self.priority_inverse_temperature)

    def _assemble_batch(
        self, rows: list[Trajectory], prompt_ids: np.ndarray, from_recency: np.ndarray
    ) -> SampledBatch:
        return collate(
            rows,
            max_prompt_len=self.max_prompt_len,
            max_response_len=self.max_response_len,
            pad_id=self.pad_id,
            prompt_ids=prompt_ids,
            from_recency=from_recency,
        )


def _mean_or_nan(values: np.ndarray) -> float:
    return float(values.mean()) if len(values) else math.nan


def _max_or_nan(values: np.ndarray) -> float:
    return float(values.max()) if len(values) else math.nan


# ---------------------------------------------------------------------------------------
# state_dict packing
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
