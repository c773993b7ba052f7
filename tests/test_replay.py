"""Tests for tba_jax.replay: sampling distributions, capacity, padding, state, threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tba_jax import replay
from tba_jax.replay import ReplayBuffer
from tba_jax.trajectories import SampledBatch, Trajectory

MAX_PROMPT_LEN = 6
MAX_RESPONSE_LEN = 5
PAD_ID = -1
NUM_STANDARD_ERRORS = 4.0  # tolerance of the statistical checks (fixed seeds: deterministic)


def make_trajectory(
    prompt_id: int,
    response: tuple[int, ...] | list[int],
    *,
    reward: float = 0.0,
    policy_version: int = 0,
    created_at: float = 0.0,
    prompt: tuple[int, ...] | None = None,
    policy_version_last: int | None = None,
) -> Trajectory:
    """A trajectory whose per-token log-probs are distinct, recognisable numbers."""
    response_tokens = np.asarray(response, dtype=np.int32)
    prompt_tokens = np.asarray(prompt if prompt is not None else (prompt_id, 7), dtype=np.int32)
    token_logp_behaviour = -0.1 * (np.arange(len(response_tokens), dtype=np.float32) + 1)
    token_logp_ref = 2 * token_logp_behaviour
    return Trajectory.sampled(
        prompt_id=prompt_id,
        prompt_tokens=prompt_tokens,
        response_tokens=response_tokens,
        token_logp_behaviour=token_logp_behaviour,
        token_logp_ref=token_logp_ref,
        reward=reward,
        policy_version=policy_version,
        created_at=created_at,
        policy_version_last=policy_version_last,
    )


def make_buffer(**overrides) -> ReplayBuffer:
    config = dict(
        max_prompt_len=MAX_PROMPT_LEN,
        max_response_len=MAX_RESPONSE_LEN,
        pad_id=PAD_ID,
        capacity=1000,
        capacity_per_prompt=100,
        recency_prob=0.0,
        priority="uniform",
        priority_inverse_temperature=1.0,
    )
    config.update(overrides)
    return ReplayBuffer(**config)


def stored_responses(buffer: ReplayBuffer) -> list[tuple[int, tuple[int, ...]]]:
    """(prompt_id, response) of every stored trajectory, oldest first, via state_dict."""
    state = buffer.state_dict()
    offsets = state["traj_response_offsets"]
    tokens = state["traj_response_tokens"]
    return [
        (int(pid), tuple(int(t) for t in tokens[offsets[i] : offsets[i + 1]]))
        for i, pid in enumerate(state["traj_prompt_id"])
    ]


def assert_frequencies_match(counts: np.ndarray, expected_probs: np.ndarray) -> None:
    """Each empirical frequency lies within NUM_STANDARD_ERRORS binomial errors of p."""
    total = counts.sum()
    frequencies = counts / total
    standard_errors = np.sqrt(expected_probs * (1 - expected_probs) / total)
    np.testing.assert_array_less(
        np.abs(frequencies - expected_probs), NUM_STANDARD_ERRORS * standard_errors + 1e-12
    )


# ---------------------------------------------------------------------------------------
# Construction and validation
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"recency_prob": -0.1}, "recency_prob"),
        ({"recency_prob": 1.5}, "recency_prob"),
        ({"priority": "boltzmann"}, "priority"),
        ({"capacity": 5, "capacity_per_prompt": 10}, "capacity"),
        ({"capacity_per_prompt": 0}, "capacity_per_prompt"),
        ({"capacity": 0, "capacity_per_prompt": 0}, "capacity"),
        ({"max_prompt_len": 0}, "max_prompt_len"),
        ({"max_response_len": -3}, "max_response_len"),
        ({"priority_inverse_temperature": -1.0}, "priority_inverse_temperature"),
        ({"priority_inverse_temperature": float("nan")}, "priority_inverse_temperature"),
    ],
)
def test_bad_constructor_args_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_buffer(**overrides)


def test_response_length_property():
    assert make_trajectory(0, (4, 5, 6)).response_length == 3


def test_too_long_prompt_or_response_raises_naming_lengths_and_stores_nothing():
    buffer = make_buffer()
    too_long_response = make_trajectory(0, tuple(range(MAX_RESPONSE_LEN + 1)))
    with pytest.raises(ValueError, match=rf"{MAX_RESPONSE_LEN + 1}.*{MAX_RESPONSE_LEN}"):
        buffer.add([make_trajectory(0, (1,)), too_long_response])
    assert len(buffer) == 0  # validated before storing anything
    too_long_prompt = make_trajectory(0, (1,), prompt=tuple(range(MAX_PROMPT_LEN + 2)))
    with pytest.raises(ValueError, match=rf"{MAX_PROMPT_LEN + 2}.*{MAX_PROMPT_LEN}"):
        buffer.add([too_long_prompt])


def test_mismatched_token_logp_length_raises():
    trajectory = make_trajectory(0, (1, 2, 3))
    trajectory.token_logp_ref = trajectory.token_logp_ref[:2]
    with pytest.raises(ValueError, match="token_logp_ref"):
        make_buffer().add([trajectory])


def test_sample_from_empty_buffer_or_bad_sizes_raises():
    buffer = make_buffer()
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="empty"):
        buffer.sample(2, 2, rng)
    buffer.add([make_trajectory(0, (1,))])
    with pytest.raises(ValueError, match="positive"):
        buffer.sample(0, 2, rng)
    with pytest.raises(ValueError, match="positive"):
        buffer.sample(2, 0, rng)


# ---------------------------------------------------------------------------------------
# Duplicates and capacity
# ---------------------------------------------------------------------------------------


def test_duplicate_refreshes_instead_of_adding():
    buffer = make_buffer()
    assert buffer.add([make_trajectory(0, (1, 2), reward=0.0, policy_version=0)]) == 1
    assert buffer.add([make_trajectory(0, (1, 2), reward=5.0, policy_version=3)]) == 0
    assert len(buffer) == 1
    assert buffer.num_prompts == 1
    batch = buffer.sample(1, 1, np.random.default_rng(0))
    assert batch.reward[0] == 5.0
    assert batch.policy_version[0] == 3
    # Same response under another prompt id is not a duplicate.
    assert buffer.add([make_trajectory(1, (1, 2))]) == 1
    assert len(buffer) == 2


def test_per_prompt_capacity_evicts_oldest_and_refresh_counts_as_newest():
    buffer = make_buffer(capacity_per_prompt=2)
    buffer.add([make_trajectory(0, (1,)), make_trajectory(0, (2,))])
    buffer.add([make_trajectory(0, (1,))])  # refresh: (2,) is now the oldest
    buffer.add([make_trajectory(0, (3,)), make_trajectory(5, (9,))])
    assert stored_responses(buffer) == [(0, (1,)), (0, (3,)), (5, (9,))]


def test_total_capacity_evicts_oldest_globally_and_drops_empty_groups():
    buffer = make_buffer(capacity=3, capacity_per_prompt=2)
    buffer.add([make_trajectory(0, (1,)), make_trajectory(1, (1,)), make_trajectory(1, (2,))])
    assert buffer.num_prompts == 2
    buffer.add([make_trajectory(2, (1,))])
    assert stored_responses(buffer) == [(1, (1,)), (1, (2,)), (2, (1,))]
    assert buffer.num_prompts == 2  # prompt 0 lost its only trajectory
    assert 0 not in buffer.sample(5, 1, np.random.default_rng(0)).prompt_ids


# ---------------------------------------------------------------------------------------
# Batch layout
# ---------------------------------------------------------------------------------------


def test_padding_layout_masks_shapes_and_dtypes():
    buffer = make_buffer()
    trajectory = make_trajectory(3, (11, 12, 2), prompt=(5, 6), reward=1.5, policy_version=4)
    buffer.add([trajectory])
    batch = buffer.sample(num_prompts=2, k=3, rng=np.random.default_rng(0))
    n = 2 * 3
    assert (batch.num_prompts, batch.k) == (2, 3)
    expected = {
        "prompt_tokens": ((n, MAX_PROMPT_LEN), np.int32),
        "prompt_mask": ((n, MAX_PROMPT_LEN), np.bool_),
        "response_tokens": ((n, MAX_RESPONSE_LEN), np.int32),
        "response_mask": ((n, MAX_RESPONSE_LEN), np.float32),
        "reward": ((n,), np.float32),
        "logp_behaviour": ((n,), np.float32),
        "logp_ref": ((n,), np.float32),
        "token_logp_behaviour": ((n, MAX_RESPONSE_LEN), np.float32),
        "token_logp_ref": ((n, MAX_RESPONSE_LEN), np.float32),
        "policy_version": ((n,), np.int32),
        "created_at": ((n,), np.float64),
        "prompt_ids": ((2,), np.int64),
        "from_recency": ((2,), np.bool_),
        "policy_version_last": ((n,), np.int32),
    }
    arrays = batch.as_dict()
    assert set(arrays) == set(expected)
    for name, (shape, dtype) in expected.items():
        assert arrays[name].shape == shape, name
        assert arrays[name].dtype == dtype, name

    np.testing.assert_array_equal(batch.prompt_tokens[0], [PAD_ID] * 4 + [5, 6])
    np.testing.assert_array_equal(batch.prompt_mask[0], [False] * 4 + [True] * 2)
    np.testing.assert_array_equal(batch.response_tokens[0], [11, 12, 2, PAD_ID, PAD_ID])
    np.testing.assert_array_equal(batch.response_mask[0], [1, 1, 1, 0, 0])
    np.testing.assert_allclose(batch.token_logp_behaviour[0], [-0.1, -0.2, -0.3, 0, 0])
    np.testing.assert_allclose(batch.token_logp_ref[0], [-0.2, -0.4, -0.6, 0, 0])
    np.testing.assert_allclose(batch.logp_behaviour[0], -0.6, rtol=1e-6)
    assert batch.reward[0] == 1.5
    assert batch.policy_version[0] == 4
    # One prompt, two slots: the prompt repeats and every row is filled.
    np.testing.assert_array_equal(batch.prompt_ids, [3, 3])
    np.testing.assert_array_equal(batch.response_tokens, np.tile(batch.response_tokens[0], (n, 1)))


def test_rows_are_prompt_major():
    buffer = make_buffer()
    buffer.add([make_trajectory(p, (p, r)) for p in range(4) for r in range(3)])
    batch = buffer.sample(num_prompts=4, k=3, rng=np.random.default_rng(1))
    prompt_of_row = batch.response_tokens[:, 0].reshape(4, 3)
    np.testing.assert_array_equal(prompt_of_row, np.repeat(batch.prompt_ids[:, None], 3, axis=1))
    assert sorted(batch.prompt_ids.tolist()) == [0, 1, 2, 3]  # distinct when possible


# ---------------------------------------------------------------------------------------
# Recency draws
# ---------------------------------------------------------------------------------------


def test_recency_fraction_matches_recency_prob():
    recency_prob = 0.3
    buffer = make_buffer(recency_prob=recency_prob)
    buffer.add([make_trajectory(p, (1,), policy_version=p % 2) for p in range(8)])
    rng = np.random.default_rng(0)
    num_slots_per_batch, num_batches = 40, 500
    flags = np.concatenate(
        [buffer.sample(num_slots_per_batch, 1, rng).from_recency for _ in range(num_batches)]
    )
    standard_error = np.sqrt(recency_prob * (1 - recency_prob) / len(flags))
    assert abs(flags.mean() - recency_prob) < 3 * standard_error


def test_recency_draws_return_newest_k_of_latest_version_prompts():
    buffer = make_buffer(recency_prob=1.0)
    buffer.add([make_trajectory(p, (r,), policy_version=1) for p in range(4) for r in range(4)])
    # Prompts 1 and 3 get samples from version 2; their newest K=2 are (5,) then (6,) ...
    buffer.add([make_trajectory(p, (r,), policy_version=2) for p in (1, 3) for r in (5, 6)])
    rng = np.random.default_rng(0)
    for _ in range(50):
        batch = buffer.sample(num_prompts=2, k=3, rng=rng)
        assert batch.from_recency.all()
        assert sorted(batch.prompt_ids.tolist()) == [1, 3]
        # ... newest first: (6,), (5,), then the newest of version 1, (3,).
        np.testing.assert_array_equal(batch.response_tokens[:, 0], [6, 5, 3, 6, 5, 3])
        np.testing.assert_array_equal(batch.policy_version, [2, 2, 1, 2, 2, 1])


def test_recency_candidates_extend_with_most_recently_refreshed_prompts():
    buffer = make_buffer(recency_prob=1.0)
    for prompt_id in (0, 1, 2, 3):  # refresh order 0 < 1 < 2 < 3
        buffer.add([make_trajectory(prompt_id, (1,), policy_version=0)])
    buffer.add([make_trajectory(1, (2,), policy_version=1)])  # refresh order 0 < 2 < 3 < 1
    rng = np.random.default_rng(0)
    for _ in range(20):
        batch = buffer.sample(num_prompts=3, k=1, rng=rng)
        assert sorted(batch.prompt_ids.tolist()) == [1, 2, 3]
    single = buffer.sample(num_prompts=1, k=1, rng=rng)
    assert single.prompt_ids.tolist() == [1]


def test_recency_uses_only_the_newest_trajectory_version_of_each_prompt():
    buffer = make_buffer(recency_prob=1.0)
    buffer.add([make_trajectory(0, (1,), policy_version=5)])
    buffer.add([make_trajectory(1, (1,), policy_version=5)])
    buffer.add([make_trajectory(0, (2,), policy_version=4)])  # prompt 0's newest is stale
    batch = buffer.sample(num_prompts=1, k=1, rng=np.random.default_rng(0))
    assert batch.prompt_ids.tolist() == [1]


# ---------------------------------------------------------------------------------------
# Priority draws
# ---------------------------------------------------------------------------------------

REWARDS = np.array([0.0, 1.0, 2.0, 0.5, -1.0])


@pytest.mark.parametrize(
    ("priority", "inverse_temperature", "expected_unnormalised"),
    [
        ("softmax", 1.5, np.exp(1.5 * REWARDS)),
        ("rank", 2.0, np.array([4.0, 2.0, 1.0, 3.0, 5.0]) ** -2.0),
        ("uniform", 3.0, np.ones(len(REWARDS))),
        ("softmax", 0.0, np.ones(len(REWARDS))),
    ],
)
def test_priority_frequencies_with_k1_match_priority_distribution(
    priority, inverse_temperature, expected_unnormalised
):
    expected = expected_unnormalised / expected_unnormalised.sum()
    np.testing.assert_allclose(
        replay.priority_probabilities(REWARDS, priority, inverse_temperature), expected
    )
    buffer = make_buffer(priority=priority, priority_inverse_temperature=inverse_temperature)
    buffer.add([make_trajectory(0, (i,), reward=r) for i, r in enumerate(REWARDS)])
    rng = np.random.default_rng(0)
    drawn = np.concatenate([buffer.sample(1000, 1, rng).response_tokens[:, 0] for _ in range(20)])
    counts = np.bincount(drawn, minlength=len(REWARDS))
    assert_frequencies_match(counts, expected)


def test_rank_ties_share_their_mean_rank():
    np.testing.assert_allclose(replay.fractional_ranks([1.0, 0.0, 1.0, 3.0]), [2.5, 4.0, 2.5, 1.0])


def test_priority_draws_without_replacement_then_fill_short_groups():
    buffer = make_buffer(priority="softmax", priority_inverse_temperature=2.0)
    buffer.add([make_trajectory(0, (i,), reward=float(i)) for i in range(4)])
    buffer.add([make_trajectory(1, (i,), reward=float(i)) for i in range(2)])
    rng = np.random.default_rng(0)
    for _ in range(30):
        batch = buffer.sample(num_prompts=2, k=4, rng=rng)
        for slot, prompt_id in enumerate(batch.prompt_ids):
            responses = batch.response_tokens[slot * 4 : slot * 4 + 4, 0].tolist()
            if prompt_id == 0:
                assert sorted(responses) == [0, 1, 2, 3]  # K = group size: each once
            else:
                assert set(responses) == {0, 1}  # both once, then two repeats


def test_priority_prompts_are_uniform_and_distinct():
    num_prompts = 6
    buffer = make_buffer()
    buffer.add([make_trajectory(p, (1,)) for p in range(num_prompts)])
    rng = np.random.default_rng(0)
    batches = [buffer.sample(2, 1, rng).prompt_ids for _ in range(3000)]
    assert all(ids[0] != ids[1] for ids in batches)
    counts = np.bincount(np.concatenate(batches), minlength=num_prompts)
    assert_frequencies_match(counts, np.full(num_prompts, 1 / num_prompts))


# ---------------------------------------------------------------------------------------
# Stats, state, threads
# ---------------------------------------------------------------------------------------


def test_drop_older_than_removes_exactly_the_older_versions():
    buffer = make_buffer()
    # versions out of insertion order, and a refresh that moves a sample to a newer version
    buffer.add([make_trajectory(p, (p, v), policy_version=v) for p, v in [(0, 2), (1, 0), (2, 1)]])
    buffer.add([make_trajectory(1, (1, 0), policy_version=3)])  # refreshed at version 3
    buffer.add([make_trajectory(3, (3,), policy_version=0)])
    assert buffer.drop_older_than(0) == 0
    assert buffer.drop_older_than(2) == 2  # (2, v1) and (3, v0); (1, ...) is now version 3
    assert stored_responses(buffer) == [(0, (0, 2)), (1, (1, 0))]
    assert buffer.num_prompts == 2 and buffer.stats()["max_policy_version"] == 3
    # a sample started on an older version and finished later is refused, and counted
    assert buffer.add([make_trajectory(4, (4,), policy_version=1, policy_version_last=3)]) == 0
    assert buffer.refused_stale == 1 and len(buffer) == 2
    assert buffer.drop_older_than(10) == 2 and len(buffer) == 0
    buffer.add([make_trajectory(5, (1,), policy_version=10)])  # usable again after emptying
    assert buffer.sample(1, 1, np.random.default_rng(0)).prompt_ids.tolist() == [5]


def test_num_prompts_since_counts_what_drop_older_than_would_leave():
    buffer = make_buffer()
    # prompt 0 has an old and a new sample; prompt 1 only old ones; prompt 2 only new
    buffer.add(
        [
            make_trajectory(0, (1,), policy_version=0),
            make_trajectory(0, (2,), policy_version=3),
            make_trajectory(1, (1,), policy_version=1),
            make_trajectory(1, (2,), policy_version=2),
            make_trajectory(2, (1,), policy_version=4),
        ]
    )
    counts = {version: buffer.num_prompts_since(version) for version in range(6)}
    assert counts == {0: 3, 1: 3, 2: 3, 3: 2, 4: 1, 5: 0}
    assert len(buffer) == 5  # nothing dropped
    for version in range(6):  # the count is what the drop leaves
        dropped = make_buffer()
        dropped.load_state_dict(buffer.state_dict())
        dropped.drop_older_than(version)
        assert dropped.num_prompts == counts[version], version


def test_stats():
    buffer = make_buffer()
    assert buffer.stats()["num_trajectories"] == 0
    buffer.add(
        [
            make_trajectory(0, (1, 2), reward=1.0, policy_version=3),
            make_trajectory(1, (1, 2, 3, 4), reward=3.0, policy_version=5),
        ]
    )
    stats = buffer.stats(current_version=6)
    assert stats["num_trajectories"] == 2
    assert stats["num_prompts"] == 2
    assert stats["reward_mean"] == 2.0
    assert stats["reward_max"] == 3.0
    assert stats["response_length_mean"] == 3.0
    assert stats["age_mean"] == 2.0
    assert stats["age_max"] == 3.0
    assert "age_mean" not in buffer.stats()


def test_state_dict_round_trip_through_npz(tmp_path):
    config = dict(capacity=12, capacity_per_prompt=4, recency_prob=0.5, priority="rank")
    buffer = make_buffer(**config)
    data_rng = np.random.default_rng(0)
    for version in range(4):
        buffer.add(
            [
                make_trajectory(
                    int(data_rng.integers(6)),
                    tuple(data_rng.integers(0, 50, size=int(data_rng.integers(1, 6)))),
                    reward=float(data_rng.normal()),
                    policy_version=version,
                    created_at=100.0 + version,
                )
                for _ in range(5)
            ]
        )
    state = buffer.state_dict()
    assert all(isinstance(v, np.ndarray) and v.dtype != object for v in state.values())
    path = tmp_path / "replay.npz"
    np.savez(path, **state)
    restored = make_buffer(**config)
    with np.load(path, allow_pickle=False) as loaded:
        restored.load_state_dict(loaded)

    assert stored_responses(restored) == stored_responses(buffer)
    assert restored.stats(4) == buffer.stats(4)
    for original_batch, restored_batch in zip(
        [buffer.sample(3, 4, np.random.default_rng(s)) for s in range(5)],
        [restored.sample(3, 4, np.random.default_rng(s)) for s in range(5)],
        strict=True,
    ):
        for name, array in original_batch.as_dict().items():
            np.testing.assert_array_equal(getattr(restored_batch, name), array, err_msg=name)
    # Order survives: further adds evict the same trajectories.
    more = [make_trajectory(p, (99,), policy_version=9) for p in range(6)]
    buffer.add(more)
    restored.add(more)
    assert stored_responses(restored) == stored_responses(buffer)


def test_first_and_last_policy_versions_survive_the_buffer_and_its_state():
    buffer = make_buffer()
    buffer.add(
        [
            make_trajectory(0, (1, 2), policy_version=3, policy_version_last=5),
            make_trajectory(1, (4,), policy_version=4),  # no in-flight update: last = first
        ]
    )
    batch = buffer.sample(2, 1, np.random.default_rng(0))
    versions = zip(batch.policy_version, batch.policy_version_last, strict=True)
    by_prompt = dict(zip(batch.prompt_ids, versions, strict=True))  # K = 1: a row per prompt
    assert by_prompt == {0: (3, 5), 1: (4, 4)}

    def stored_versions(state: dict[str, np.ndarray]) -> list[tuple[int, int]]:
        pairs = zip(state["traj_policy_version"], state["traj_policy_version_last"], strict=True)
        return sorted((int(first), int(last)) for first, last in pairs)

    restored = make_buffer()
    restored.load_state_dict(buffer.state_dict())
    assert stored_versions(restored.state_dict()) == [(3, 5), (4, 4)]
    # A state saved before last versions existed restores with last = first.
    old_state = {k: v for k, v in buffer.state_dict().items() if k != "traj_policy_version_last"}
    restored_old = make_buffer()
    restored_old.load_state_dict(old_state)
    assert stored_versions(restored_old.state_dict()) == [(3, 3), (4, 4)]


def test_a_last_policy_version_older_than_the_first_is_refused():
    with pytest.raises(ValueError, match="policy_version_last=2 is older than policy_version=3"):
        make_buffer().add([make_trajectory(0, (1,), policy_version=3, policy_version_last=2)])


def test_load_state_dict_rejects_other_padding_layout():
    buffer = make_buffer()
    buffer.add([make_trajectory(0, (1,))])
    state = buffer.state_dict()
    with pytest.raises(ValueError, match="max_response_len"):
        make_buffer(max_response_len=MAX_RESPONSE_LEN + 1).load_state_dict(state)
    with pytest.raises(ValueError, match="pad_id"):
        make_buffer(pad_id=0).load_state_dict(state)
    del state["traj_reward"]
    with pytest.raises(ValueError, match="missing"):
        make_buffer().load_state_dict(state)


@pytest.mark.parametrize("draw_rule", ["newest", "authors"])
def test_capacity_evicts_what_a_sorted_reference_evicts_over_many_scans(draw_rule, monkeypatch):
    """The oldest-first queue (a partial scan, refilled when it runs out, entries gone stale
    when a duplicate replaced their sample, dropped when an older version arrives) evicts
    exactly the smallest keys: insertion order, or by the authors' rule version first."""
    monkeypatch.setattr(replay, "EVICTION_SCAN_MIN", 2)
    monkeypatch.setattr(replay, "EVICTION_SCAN_SHARE", 0.1)  # a scan queues 4 of 40
    buffer = make_buffer(capacity=40, capacity_per_prompt=40, draw_rule=draw_rule)  # 30 responses
    rng = np.random.default_rng(0)
    stored: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}  # sample: (version, seq)
    seq = 0
    for call in range(300):
        trajectories = []
        for _ in range(rng.integers(1, 13)):
            sample = (int(rng.integers(10)), (int(rng.integers(30)),))  # duplicates recur
            version = max(0, call // 10 - int(rng.integers(4)))  # some samples lag behind
            trajectories.append(make_trajectory(*sample, policy_version=version))
            stored[sample] = (version, seq)  # a duplicate replaces the stored one
            seq += 1
        buffer.add(trajectories)
        by_age = sorted(stored, key=lambda s: stored[s] if draw_rule == "authors" else stored[s][1])
        for sample in by_age[: max(0, len(stored) - 40)]:
            del stored[sample]
        assert stored_responses(buffer) == sorted(stored, key=lambda s: stored[s][1])


def test_load_state_dict_into_smaller_buffer_evicts_oldest():
    buffer = make_buffer()
    buffer.add([make_trajectory(p, (1,)) for p in range(5)])
    smaller = make_buffer(capacity=2, capacity_per_prompt=1)
    smaller.load_state_dict(buffer.state_dict())
    assert stored_responses(smaller) == [(3, (1,)), (4, (1,))]


def test_concurrent_add_and_sample_keep_counts_consistent():
    buffer = make_buffer(capacity=10_000, capacity_per_prompt=1000, recency_prob=0.5)
    num_writers, adds_per_writer, batch_size = 4, 50, 5
    errors: list[BaseException] = []
    writers_done = threading.Event()

    def write(writer: int) -> None:
        try:
            for step in range(adds_per_writer):
                buffer.add(
                    [
                        make_trajectory(step % 7, (writer, step, i), policy_version=step)
                        for i in range(batch_size)
                    ]
                )
        except BaseException as error:  # re-raised in the main thread
            errors.append(error)

    def read(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            while not writers_done.is_set():
                if len(buffer):
                    batch = buffer.sample(3, 2, rng)
                    assert isinstance(batch, SampledBatch)
                    assert batch.reward.shape == (6,)
                    buffer.stats(current_version=adds_per_writer)
                    buffer.state_dict()
        except BaseException as error:  # re-raised in the main thread
            errors.append(error)

    writers = [threading.Thread(target=write, args=(w,)) for w in range(num_writers)]
    readers = [threading.Thread(target=read, args=(s,)) for s in range(2)]
    for thread in writers + readers:
        thread.start()
    for thread in writers:
        thread.join()
    writers_done.set()
    for thread in readers:
        thread.join()
    assert not errors, errors
    expected = num_writers * adds_per_writer * batch_size
    assert len(buffer) == expected
    assert buffer.stats()["num_trajectories"] == expected
    assert len(stored_responses(buffer)) == expected
    assert buffer.num_prompts == 7


# ---------------------------------------------------------------------------------------
# The TBA authors' draw rules (draw_rule="authors")
# ---------------------------------------------------------------------------------------


def make_authors_buffer(**overrides) -> ReplayBuffer:
    return make_buffer(draw_rule="authors", **overrides)


def online_prompts(buffer: ReplayBuffer, num_batches: int, rng, num_prompts: int = 2):
    """Prompt ids of `num_batches` all-online batches (K = 1), in draw order."""
    batches = [buffer.sample(num_prompts, 1, rng) for _ in range(num_batches)]
    assert all(batch.from_recency.all() for batch in batches)
    return np.concatenate([batch.prompt_ids for batch in batches]).tolist()


def test_unknown_draw_rule_raises():
    with pytest.raises(ValueError, match="draw_rule"):
        make_buffer(draw_rule="oldest")


def test_online_prompts_are_drawn_without_replacement_across_batches_then_refilled():
    buffer = make_authors_buffer(recency_prob=1.0)
    buffer.add([make_trajectory(p, (1,)) for p in range(6)])
    rng = np.random.default_rng(0)
    first_pass = online_prompts(buffer, 3, rng)
    assert sorted(first_pass) == list(range(6))  # no repeat until the pool is used up
    second_pass = online_prompts(buffer, 3, rng)  # refilled with the drawn ones
    assert sorted(second_pass) == list(range(6))
    assert first_pass != second_pass  # drawn at random, not replayed in order


def test_the_online_pool_is_this_windows_refreshed_prompts_and_refills_with_the_drawn():
    buffer = make_authors_buffer(recency_prob=1.0)
    buffer.add([make_trajectory(p, (1,)) for p in range(6)])
    buffer.mark_sync(1)
    buffer.add([make_trajectory(p, (2,), policy_version=1) for p in (0, 1, 2)])  # new window
    rng = np.random.default_rng(0)
    [drawn] = online_prompts(buffer, 1, rng, num_prompts=1)
    buffer.add([make_trajectory(drawn, (3,), policy_version=1)])  # refreshed after its draw
    rest = online_prompts(buffer, 2, rng, num_prompts=1)
    assert sorted([drawn, *rest]) == [0, 1, 2]  # drawn once: it does not rejoin the pool
    refilled = online_prompts(buffer, 3, rng, num_prompts=1)
    assert sorted(refilled) == [0, 1, 2]  # the refill: this window's drawn prompts only


def test_online_samples_are_those_added_since_the_latest_sync():
    buffer = make_authors_buffer(recency_prob=1.0)
    buffer.add([make_trajectory(0, (1,)), make_trajectory(0, (2,))])
    buffer.mark_sync(1)
    rng = np.random.default_rng(0)
    # Until the first add after the sync, the previous window's samples stay online.
    assert sorted(set(buffer.sample(1, 8, rng).response_tokens[:, 0])) == [1, 2]
    buffer.add([make_trajectory(0, (3,), policy_version=1)])
    batch = buffer.sample(1, 4, rng)  # one online sample: drawn with replacement
    assert batch.from_recency.all() and (batch.response_tokens[:, 0] == 3).all()
    buffer.add([make_trajectory(0, (1,), policy_version=1)])  # a duplicate, added again
    assert sorted(set(buffer.sample(1, 8, rng).response_tokens[:, 0])) == [1, 3]
    buffer.mark_sync(1)  # not newer than the latest sync: ignored
    buffer.add([make_trajectory(0, (4,), policy_version=1)])
    assert sorted(set(buffer.sample(1, 8, rng).response_tokens[:, 0])) == [1, 3, 4]
    buffer.mark_sync(2)
    buffer.add([make_trajectory(1, (5,), policy_version=2)])  # prompt 0 has none online now
    for _ in range(5):
        batch = buffer.sample(1, 2, rng)
        assert batch.prompt_ids.tolist() == [1] and (batch.response_tokens[:, 0] == 5).all()


def test_online_rows_are_uniform_without_replacement_unless_fewer_than_k():
    buffer = make_authors_buffer(recency_prob=1.0)
    rewards = [5.0, 0.0, -5.0, 1.0, 2.0]  # rewards play no part in online draws
    buffer.add([make_trajectory(0, (i,), reward=r) for i, r in enumerate(rewards)])
    rng = np.random.default_rng(0)
    pairs = [buffer.sample(1, 2, rng).response_tokens[:, 0] for _ in range(2000)]
    assert all(a != b for a, b in pairs)  # K ≤ online samples: distinct
    assert_frequencies_match(np.bincount(np.concatenate(pairs), minlength=5), np.full(5, 0.2))
    rows = np.concatenate([buffer.sample(1, 8, rng).response_tokens[:, 0] for _ in range(500)])
    assert_frequencies_match(np.bincount(rows, minlength=5), np.full(5, 0.2))  # K > 5: repeats


def test_an_online_slot_without_online_samples_falls_back_to_an_offline_draw():
    buffer = make_authors_buffer(recency_prob=1.0)
    buffer.add([make_trajectory(0, (1,), policy_version=0)])
    buffer.mark_sync(1)
    buffer.add([make_trajectory(1, (1,), policy_version=1)])  # window 1: prompt 1 online
    buffer.drop_older_than(1)  # prompt 0 goes; prompt 1 stays online
    batch = buffer.sample(1, 1, np.random.default_rng(0))
    assert batch.prompt_ids.tolist() == [1] and batch.from_recency.tolist() == [True]
    buffer.min_policy_version = None
    buffer.add([make_trajectory(2, (1,), policy_version=0)])  # window 1 too: online
    buffer.drop_older_than(1)  # prompt 2's only sample goes: prompt 1 is online again
    buffer.min_policy_version = None
    buffer.mark_sync(2)
    buffer.add([make_trajectory(3, (1,), policy_version=0)])  # window 2: prompt 3 online
    buffer.drop_older_than(1)  # window 2 has no stored sample left
    batch = buffer.sample(2, 1, np.random.default_rng(0))
    assert batch.prompt_ids.tolist() == [1, 1] and not batch.from_recency.any()


def test_eviction_keeps_each_prompts_newest_versions():
    buffer = make_authors_buffer(capacity_per_prompt=2)
    buffer.add([make_trajectory(0, (1,), policy_version=5)])
    buffer.add([make_trajectory(0, (2,), policy_version=3)])
    buffer.add([make_trajectory(0, (3,), policy_version=4)])  # evicts version 3, not (1,)
    assert sorted(stored_responses(buffer)) == [(0, (1,)), (0, (3,))]
    buffer.add([make_trajectory(0, (4,), policy_version=4)])  # ties: the later added stays
    assert sorted(stored_responses(buffer)) == [(0, (1,)), (0, (4,))]
    buffer.add([make_trajectory(0, (1,), policy_version=2)])  # the duplicate is replaced ...
    assert sorted(stored_responses(buffer)) == [(0, (1,)), (0, (4,))]  # ... by the newest add
    newest = make_buffer(capacity_per_prompt=2)  # the newest rule evicts by insertion
    for response, version in (((1,), 5), ((2,), 3), ((3,), 4)):
        newest.add([make_trajectory(0, response, policy_version=version)])
    assert sorted(stored_responses(newest)) == [(0, (2,)), (0, (3,))]


def test_capacity_evicts_the_oldest_version_across_prompts():
    buffer = make_authors_buffer(capacity=3, capacity_per_prompt=3)
    buffer.add(
        [make_trajectory(0, (1,), policy_version=7), make_trajectory(1, (1,), policy_version=2)]
    )
    buffer.add(
        [make_trajectory(2, (1,), policy_version=5), make_trajectory(3, (1,), policy_version=6)]
    )
    assert sorted(stored_responses(buffer)) == [(0, (1,)), (2, (1,)), (3, (1,))]
    buffer.add([make_trajectory(4, (1,), policy_version=1)])  # older than all: evicted itself
    assert sorted(stored_responses(buffer)) == [(0, (1,)), (2, (1,)), (3, (1,))]
    assert buffer.num_prompts == 3


def test_offline_prompts_come_in_epochs_of_every_stored_prompt():
    buffer = make_authors_buffer(recency_prob=0.0)
    buffer.add([make_trajectory(p, (1,)) for p in range(5)])
    rng = np.random.default_rng(0)
    drawn = np.concatenate([buffer.sample(2, 1, rng).prompt_ids for _ in range(5)]).tolist()
    assert sorted(drawn[:5]) == sorted(drawn[5:]) == list(range(5))  # two whole epochs
    drawn = [buffer.sample(1, 1, rng).prompt_ids[0] for _ in range(3)]
    buffer.add([make_trajectory(9, (1,))])  # first seen mid-epoch: joins the next one
    drawn += [buffer.sample(1, 1, rng).prompt_ids[0] for _ in range(8)]
    assert sorted(drawn[:5]) == list(range(5)) and sorted(drawn[5:]) == [0, 1, 2, 3, 4, 9]


def test_offline_rows_follow_the_priority():
    buffer = make_authors_buffer(priority="softmax", priority_inverse_temperature=1.5)
    buffer.add([make_trajectory(0, (i,), reward=r) for i, r in enumerate(REWARDS)])
    rng = np.random.default_rng(0)
    drawn = np.concatenate([buffer.sample(500, 1, rng).response_tokens[:, 0] for _ in range(10)])
    expected = np.exp(1.5 * REWARDS) / np.exp(1.5 * REWARDS).sum()
    assert_frequencies_match(np.bincount(drawn, minlength=len(REWARDS)), expected)


def authors_buffer_with_history() -> ReplayBuffer:
    """Three sync windows, partly drawn pools, an eviction by version."""
    buffer = make_authors_buffer(capacity=40, capacity_per_prompt=3, recency_prob=0.5)
    data_rng, draw_rng = np.random.default_rng(0), np.random.default_rng(1)
    for version in range(3):
        buffer.add(
            [
                make_trajectory(
                    int(data_rng.integers(8)),
                    tuple(data_rng.integers(0, 50, size=int(data_rng.integers(1, 6)))),
                    reward=float(data_rng.normal()),
                    policy_version=int(data_rng.integers(version + 1)),
                )
                for _ in range(9)
            ]
        )
        buffer.sample(3, 2, draw_rng)
        buffer.mark_sync(version + 1)
    return buffer


def test_authors_pools_and_windows_survive_the_state(tmp_path):
    buffer = authors_buffer_with_history()
    path = tmp_path / "replay.npz"
    np.savez(path, **buffer.state_dict())
    restored = make_authors_buffer(capacity=40, capacity_per_prompt=3, recency_prob=0.5)
    with np.load(path, allow_pickle=False) as loaded:
        restored.load_state_dict(loaded)
    assert stored_responses(restored) == stored_responses(buffer)

    def draws(b: ReplayBuffer) -> list[dict[str, np.ndarray]]:
        rng = np.random.default_rng(7)
        batches = [b.sample(3, 2, rng) for _ in range(6)]  # past the pools' refills
        b.add([make_trajectory(p, (60 + p,), policy_version=3) for p in (1, 2)])  # window 4
        batches += [b.sample(3, 2, rng) for _ in range(4)]
        return [batch.as_dict() for batch in batches]

    for original, again in zip(draws(buffer), draws(restored), strict=True):
        for name, array in original.items():
            np.testing.assert_array_equal(again[name], array, err_msg=name)


def test_an_older_state_without_pools_loads_with_every_sample_online():
    buffer = authors_buffer_with_history()
    state = buffer.state_dict()
    newer_keys = set(replay._OPTIONAL_STATE_KEYS) - {"traj_policy_version_last"}
    old_state = {k: v for k, v in state.items() if k not in newer_keys}
    restored = make_authors_buffer(capacity=40, capacity_per_prompt=3, recency_prob=1.0)
    restored.load_state_dict(old_state)
    assert stored_responses(restored) == stored_responses(buffer)
    rng = np.random.default_rng(0)
    drawn = online_prompts(restored, restored.num_prompts, rng, num_prompts=1)
    assert sorted(drawn) == sorted({p for p, _ in stored_responses(buffer)})


def test_the_async_source_marks_a_sync_when_it_publishes():
    from types import SimpleNamespace

    from tba_jax.sources import AsyncSource

    published = []
    buffer = make_authors_buffer(recency_prob=1.0)
    buffer.add([make_trajectory(0, (1,))])
    source = SimpleNamespace(
        store=SimpleNamespace(publish=lambda params, version: published.append(version)),
        buffer=buffer,
    )
    AsyncSource.publish(source, params=None, version=4)
    buffer.add([make_trajectory(1, (1,), policy_version=4)])  # starts the new window
    assert published == [4]
    assert buffer.sample(1, 1, np.random.default_rng(0)).prompt_ids.tolist() == [1]
