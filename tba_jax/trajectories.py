"""Scored trajectories and the padded batches the learner trains on.

A `Trajectory` is one scored response to one prompt, as a searcher makes it; a
`SampledBatch` is B prompts × K responses padded to fixed lengths, as the learner
takes it. `collate` turns the one into the other (for the replay buffer's `sample`
and for the sync loop, which trains on fresh samples without a buffer);
`pack_trajectories` / `unpack_trajectories` flatten ragged trajectories into
NumPy arrays for checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass
class Trajectory:
    """One scored response to one prompt.

    Attributes:
      prompt_id: id of the prompt in the dataset.
      prompt_tokens: int32 [P_i], unpadded.
      response_tokens: int32 [T_i], unpadded; includes the EOS token if one was emitted.
      reward: scalar reward of the response.
      logp_behaviour: log π_behaviour(response | prompt), summed over response tokens.
      logp_ref: log π_ref(response | prompt), summed over response tokens.
      token_logp_behaviour: float32 [T_i], per-token behaviour log-probs.
      token_logp_ref: float32 [T_i], per-token reference log-probs.
      policy_version: version of the params it was generated with first (the version
        it was started with; its lag is counted from this one).
      created_at: `time.time()` when it was made.
      policy_version_last: version of the params that generated its last token; newer
        than `policy_version` only when the searcher took in-flight updates. Defaults
        to `policy_version`.
    """

    prompt_id: int
    prompt_tokens: np.ndarray
    response_tokens: np.ndarray
    reward: float
    logp_behaviour: float
    logp_ref: float
    token_logp_behaviour: np.ndarray
    token_logp_ref: np.ndarray
    policy_version: int
    created_at: float
    policy_version_last: int | None = None

    def __post_init__(self):
        if self.policy_version_last is None:
            self.policy_version_last = self.policy_version

    @classmethod
    def sampled(
        cls,
        *,
        prompt_id: int,
        prompt_tokens: np.ndarray,
        response_tokens: np.ndarray,
        token_logp_behaviour: np.ndarray,
        token_logp_ref: np.ndarray,
        reward: float,
        policy_version: int,
        created_at: float,
        policy_version_last: int | None = None,
    ) -> Trajectory:
        """A searcher's sample: its sequence log-probs are the sums of the per-token ones
        (all [T_i], the response's length)."""
        return cls(
            prompt_id=int(prompt_id),
            prompt_tokens=prompt_tokens,
            response_tokens=response_tokens,
            reward=float(reward),
            logp_behaviour=float(token_logp_behaviour.sum()),
            logp_ref=float(token_logp_ref.sum()),
            token_logp_behaviour=token_logp_behaviour,
            token_logp_ref=token_logp_ref,
            policy_version=policy_version,
            created_at=created_at,
            policy_version_last=policy_version_last,
        )

    @property
    def response_length(self) -> int:
        """Number of response tokens T_i (EOS included when emitted)."""
        return len(self.response_tokens)


@dataclasses.dataclass
class SampledBatch:
    """A training batch of B prompts × K responses, padded to the buffer's max lengths.

    Rows are prompt-major: rows b*K .. b*K+K-1 belong to prompt slot b; N = B*K.

    Attributes:
      prompt_tokens: int32 [N, max_prompt_len], LEFT-padded with pad_id.
      prompt_mask: bool [N, max_prompt_len], True on prompt tokens.
      response_tokens: int32 [N, max_response_len], RIGHT-padded with pad_id.
      response_mask: float32 [N, max_response_len], 1 on response tokens (EOS included).
      reward: float32 [N].
      logp_behaviour: float32 [N], summed behaviour log-probs.
      logp_ref: float32 [N], summed reference log-probs.
      token_logp_behaviour: float32 [N, max_response_len], 0 on padding.
      token_logp_ref: float32 [N, max_response_len], 0 on padding.
      policy_version: int32 [N], version of the params each row was started with.
      created_at: float64 [N], creation time of each row.
      prompt_ids: int64 [B], prompt id of each slot.
      from_recency: bool [B], True where the slot was a recency draw.
      policy_version_last: int32 [N], version of the params that generated each
        row's last token (equal to `policy_version` without in-flight updates).
      token_advantage: float32 [N, max_response_len] or None: per-token advantages a
        value stage attaches before the learner step (VinePPO, `tba_jax.vineppo`).
    """

    prompt_tokens: np.ndarray
    prompt_mask: np.ndarray
    response_tokens: np.ndarray
    response_mask: np.ndarray
    reward: np.ndarray
    logp_behaviour: np.ndarray
    logp_ref: np.ndarray
    token_logp_behaviour: np.ndarray
    token_logp_ref: np.ndarray
    policy_version: np.ndarray
    created_at: np.ndarray
    prompt_ids: np.ndarray
    from_recency: np.ndarray
    policy_version_last: np.ndarray
    token_advantage: np.ndarray | None = None

    @property
    def num_prompts(self) -> int:
        """B, the number of prompt slots."""
        return len(self.prompt_ids)

    @property
    def k(self) -> int:
        """K, the number of responses per prompt slot."""
        return len(self.reward) // max(len(self.prompt_ids), 1)

    def as_dict(self) -> dict[str, np.ndarray]:
        """The fields as a {name: array} dict (shallow; arrays are not copied), without
        the optional ones still unset (None)."""
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return {name: value for name, value in fields.items() if value is not None}


def normalised_trajectory(
    trajectory: Trajectory, max_prompt_len: int, max_response_len: int
) -> Trajectory:
    """A private, dtype-normalised copy of `trajectory`; ValueError if it does not fit."""
    prompt_tokens = np.array(trajectory.prompt_tokens, dtype=np.int32, copy=True)
    response_tokens = np.array(trajectory.response_tokens, dtype=np.int32, copy=True)
    token_logp_behaviour = np.array(trajectory.token_logp_behaviour, dtype=np.float32, copy=True)
    token_logp_ref = np.array(trajectory.token_logp_ref, dtype=np.float32, copy=True)
    where = f"trajectory for prompt_id={trajectory.prompt_id}"
    for name, array in (
        ("prompt_tokens", prompt_tokens),
        ("response_tokens", response_tokens),
        ("token_logp_behaviour", token_logp_behaviour),
        ("token_logp_ref", token_logp_ref),
    ):
        if array.ndim != 1:
            raise ValueError(f"{where}: {name} must be 1-D (unpadded), got shape {array.shape}")
    if len(prompt_tokens) > max_prompt_len:
        raise ValueError(
            f"{where}: prompt length {len(prompt_tokens)} exceeds max_prompt_len="
            f"{max_prompt_len}; truncate the prompt or raise max_prompt_len"
        )
    if len(response_tokens) > max_response_len:
        raise ValueError(
            f"{where}: response length {len(response_tokens)} exceeds max_response_len="
            f"{max_response_len}; cap generation length or raise max_response_len"
        )
    for name, array in (
        ("token_logp_behaviour", token_logp_behaviour),
        ("token_logp_ref", token_logp_ref),
    ):
        if len(array) != len(response_tokens):
            raise ValueError(
                f"{where}: {name} has length {len(array)} but the response has "
                f"{len(response_tokens)} tokens; they must match"
            )
    if trajectory.policy_version_last < trajectory.policy_version:
        raise ValueError(
            f"{where}: policy_version_last={trajectory.policy_version_last} is older than "
            f"policy_version={trajectory.policy_version}; the first version comes first"
        )
    if not math.isfinite(trajectory.reward):
        raise ValueError(f"{where}: reward={trajectory.reward} must be finite")
    for name in ("logp_behaviour", "logp_ref"):
        if math.isnan(getattr(trajectory, name)):
            raise ValueError(f"{where}: {name} is NaN; check the scorer")
    return Trajectory(
        prompt_id=int(trajectory.prompt_id),
        prompt_tokens=prompt_tokens,
        response_tokens=response_tokens,
        reward=float(trajectory.reward),
        logp_behaviour=float(trajectory.logp_behaviour),
        logp_ref=float(trajectory.logp_ref),
        token_logp_behaviour=token_logp_behaviour,
        token_logp_ref=token_logp_ref,
        policy_version=int(trajectory.policy_version),
        created_at=float(trajectory.created_at),
        policy_version_last=int(trajectory.policy_version_last),
    )


def collate(
    rows: Sequence[Trajectory],
    *,
    max_prompt_len: int,
    max_response_len: int,
    pad_id: int,
    prompt_ids: np.ndarray,
    from_recency: np.ndarray,
) -> SampledBatch:
    """Pads trajectories (N rows, prompt-major: K consecutive rows per prompt) into a batch.

    Used by the buffer's `sample` and by the sync loop, which trains on fresh
    samples without a buffer.
    """
    n = len(rows)
    prompt_tokens = np.full((n, max_prompt_len), pad_id, dtype=np.int32)
    prompt_mask = np.zeros((n, max_prompt_len), dtype=bool)
    response_tokens = np.full((n, max_response_len), pad_id, dtype=np.int32)
    response_mask = np.zeros((n, max_response_len), dtype=np.float32)
    token_logp_behaviour = np.zeros((n, max_response_len), dtype=np.float32)
    token_logp_ref = np.zeros((n, max_response_len), dtype=np.float32)
    for row, trajectory in enumerate(rows):
        prompt_start = max_prompt_len - len(trajectory.prompt_tokens)
        prompt_tokens[row, prompt_start:] = trajectory.prompt_tokens
        prompt_mask[row, prompt_start:] = True
        length = trajectory.response_length
        response_tokens[row, :length] = trajectory.response_tokens
        response_mask[row, :length] = 1.0
        token_logp_behaviour[row, :length] = trajectory.token_logp_behaviour
        token_logp_ref[row, :length] = trajectory.token_logp_ref
    return SampledBatch(
        prompt_tokens=prompt_tokens,
        prompt_mask=prompt_mask,
        response_tokens=response_tokens,
        response_mask=response_mask,
        reward=np.array([t.reward for t in rows], dtype=np.float32),
        logp_behaviour=np.array([t.logp_behaviour for t in rows], dtype=np.float32),
        logp_ref=np.array([t.logp_ref for t in rows], dtype=np.float32),
        token_logp_behaviour=token_logp_behaviour,
        token_logp_ref=token_logp_ref,
        policy_version=np.array([t.policy_version for t in rows], dtype=np.int32),
        created_at=np.array([t.created_at for t in rows], dtype=np.float64),
        prompt_ids=np.asarray(prompt_ids, dtype=np.int64),
        from_recency=np.asarray(from_recency, dtype=bool),
        policy_version_last=np.array([t.policy_version_last for t in rows], dtype=np.int32),
    )


def _offsets(lengths: list[int]) -> np.ndarray:
    """int64 [N+1] start offsets of N ragged pieces with the given lengths."""
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)


def _concat(pieces: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(pieces).astype(dtype) if pieces else np.empty(0, dtype=dtype)


def pack_trajectories(trajectories: list[Trajectory]) -> dict[str, np.ndarray]:
    """Flat arrays for N trajectories: per-trajectory scalars [N], tokens flat + offsets."""

    def column(name: str, dtype: type) -> np.ndarray:
        return np.array([getattr(t, name) for t in trajectories], dtype=dtype)

    return {
        "traj_prompt_id": column("prompt_id", np.int64),
        "traj_reward": column("reward", np.float64),
        "traj_logp_behaviour": column("logp_behaviour", np.float64),
        "traj_logp_ref": column("logp_ref", np.float64),
        "traj_policy_version": column("policy_version", np.int64),
        "traj_policy_version_last": column("policy_version_last", np.int64),
        "traj_created_at": column("created_at", np.float64),
        "traj_prompt_offsets": _offsets([len(t.prompt_tokens) for t in trajectories]),
        "traj_prompt_tokens": _concat([t.prompt_tokens for t in trajectories], np.int32),
        "traj_response_offsets": _offsets([t.response_length for t in trajectories]),
        "traj_response_tokens": _concat([t.response_tokens for t in trajectories], np.int32),
        "traj_token_logp_behaviour": _concat(
            [t.token_logp_behaviour for t in trajectories], np.float32
        ),
        "traj_token_logp_ref": _concat([t.token_logp_ref for t in trajectories], np.float32),
    }


def packed_for_storage(
    trajectories: Sequence[Trajectory], max_prompt_len: int, max_response_len: int
) -> dict[str, np.ndarray]:
    """`pack_trajectories` of `trajectories`, checked as `normalised_trajectory` checks each
    one but on all of them at once (the replay buffer's fast path).

    Raises `normalised_trajectory`'s ValueError for the first trajectory that fails a check.
    """
    try:
        packed = pack_trajectories(list(trajectories))
        logp_lengths = [(len(t.token_logp_behaviour), len(t.token_logp_ref)) for t in trajectories]
        fits = _packed_fit(packed, logp_lengths, max_prompt_len, max_response_len)
    except (ValueError, TypeError):  # ragged dimensions that do not concatenate
        fits = False
    if not fits:
        for trajectory in trajectories:  # raises for the first that does not fit
            normalised_trajectory(trajectory, max_prompt_len, max_response_len)
        raise AssertionError("packed_for_storage's checks disagree with normalised_trajectory")
    return packed


def _packed_fit(
    packed: dict[str, np.ndarray],
    logp_lengths: list[tuple[int, int]],
    max_prompt_len: int,
    max_response_len: int,
) -> bool:
    """Whether every packed trajectory passes `normalised_trajectory`'s checks."""
    token_keys = ("prompt_tokens", "response_tokens", "token_logp_behaviour", "token_logp_ref")
    if any(packed[f"traj_{key}"].ndim != 1 for key in token_keys):
        return False
    prompt_lengths = np.diff(packed["traj_prompt_offsets"])
    response_lengths = np.diff(packed["traj_response_offsets"])
    logp_lengths_array = np.asarray(logp_lengths, dtype=np.int64).reshape(-1, 2)
    return bool(
        np.all(prompt_lengths <= max_prompt_len)
        and np.all(response_lengths <= max_response_len)
        and np.all(logp_lengths_array == response_lengths[:, None])
        and np.all(packed["traj_policy_version_last"] >= packed["traj_policy_version"])
        and np.all(np.isfinite(packed["traj_reward"]))
        and not np.any(np.isnan(packed["traj_logp_behaviour"]))
        and not np.any(np.isnan(packed["traj_logp_ref"]))
    )


def check_packed_layout(state: dict[str, np.ndarray]) -> None:
    """ValueError unless the packed arrays of `state` fit each other (as `pack_trajectories`
    makes them). A state without `traj_policy_version_last` (written before in-flight
    updates) is fine."""
    num = len(state["traj_prompt_id"])
    prompt_offsets = np.asarray(state["traj_prompt_offsets"])
    response_offsets = np.asarray(state["traj_response_offsets"])
    num_response_tokens = len(state["traj_response_tokens"])
    scalar_columns = ("reward", "logp_behaviour", "logp_ref", "policy_version", "created_at")
    versions_last = state.get("traj_policy_version_last", state["traj_policy_version"])
    consistent = (
        all(len(state[f"traj_{name}"]) == num for name in scalar_columns)
        and len(versions_last) == num
        and len(prompt_offsets) == num + 1
        and len(response_offsets) == num + 1
        and prompt_offsets[-1] == len(state["traj_prompt_tokens"])
        and response_offsets[-1] == num_response_tokens == len(state["traj_token_logp_behaviour"])
        and len(state["traj_token_logp_ref"]) == num_response_tokens
        and bool(np.all(np.diff(prompt_offsets) >= 0))
        and bool(np.all(np.diff(response_offsets) >= 0))
    )
    if not consistent:
        raise ValueError(
            "replay state is corrupt: token offsets do not match the packed token arrays; "
            "re-save it with ReplayBuffer.state_dict()"
        )


def unpack_trajectories(state: dict[str, np.ndarray]) -> list[Trajectory]:
    """Inverse of `pack_trajectories`; ValueError if the offsets do not fit the data."""
    check_packed_layout(state)
    prompt_ids = np.asarray(state["traj_prompt_id"])
    prompt_offsets = np.asarray(state["traj_prompt_offsets"])
    response_offsets = np.asarray(state["traj_response_offsets"])
    prompt_tokens = np.asarray(state["traj_prompt_tokens"])
    response_tokens = np.asarray(state["traj_response_tokens"])
    token_logp_behaviour = np.asarray(state["traj_token_logp_behaviour"])
    token_logp_ref = np.asarray(state["traj_token_logp_ref"])
    # Checkpoints written before in-flight updates have no last versions: the first ones.
    versions_last = np.asarray(state.get("traj_policy_version_last", state["traj_policy_version"]))
    trajectories = []
    for i in range(len(prompt_ids)):
        prompt_slice = slice(prompt_offsets[i], prompt_offsets[i + 1])
        response_slice = slice(response_offsets[i], response_offsets[i + 1])
        trajectories.append(
            Trajectory(
                prompt_id=int(prompt_ids[i]),
                prompt_tokens=prompt_tokens[prompt_slice],
                response_tokens=response_tokens[response_slice],
                reward=float(state["traj_reward"][i]),
                logp_behaviour=float(state["traj_logp_behaviour"][i]),
                logp_ref=float(state["traj_logp_ref"][i]),
                token_logp_behaviour=token_logp_behaviour[response_slice],
                token_logp_ref=token_logp_ref[response_slice],
                policy_version=int(state["traj_policy_version"][i]),
                created_at=float(state["traj_created_at"][i]),
                policy_version_last=int(versions_last[i]),
            )
        )
    return trajectories
