"""What a run has done across its resumed segments, and its summary.json.

A checkpoint's history carries whole-run totals (samples and tokens generated, RL and
wall seconds, policy lags, skipped steps, time per activity); each process adds what
its own `Segment` did when it saves, so a summary written after a resume covers the
whole run, not only the last segment.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import ml_collections
import numpy as np

from tba_jax.metrics import RateMeter, TimeSplit

PER_SECOND = ("samples", "tokens")  # logged as <name>_per_second
EXCHANGING = "exchanging"  # a learner's time inside exchanges with searcher processes
MIN_SECONDS = 1e-9  # divides rates over an empty interval
WALL_SECONDS = "wall_seconds"  # the run's wall-clock seconds, every segment summed
WARM_START_SECONDS = "warm_start_seconds"  # ...of them in the warm start


@dataclasses.dataclass
class Meters:
    """Time per activity (generating / scoring / training / waiting) and sample counts."""

    time_split: TimeSplit = dataclasses.field(default_factory=TimeSplit)
    rates: RateMeter = dataclasses.field(default_factory=RateMeter)


def empty_totals() -> dict:
    """The whole-run totals a checkpoint's history carries from segment to segment."""
    return {
        "samples_generated": 0,
        "tokens_generated": 0,
        "rl_seconds": 0.0,
        WALL_SECONDS: 0.0,
        "learner_steps_trained": 0,
        "policy_lag_sum": 0.0,
        "policy_lag_count": 0,
        "policy_lag_max": 0.0,
        "skipped_nonfinite_steps": 0,
        "time_split_seconds": {},
    }


@dataclasses.dataclass
class Segment:
    """What this process has done since it started: added to the history when saving."""

    meters: Meters
    started_at: float
    rl_started_at: float | None = None
    lag_sum: float = 0.0
    lag_count: int = 0
    lag_max: float = 0.0
    steps_trained: int = 0
    skipped_steps: int = 0
    # samples / tokens other processes generated this segment (several processes)
    remote_counts: dict = dataclasses.field(default_factory=dict)

    def generated(self) -> dict[str, float]:
        """Samples and tokens generated this segment, by every process."""
        totals = self.meters.rates.totals()
        return {name: totals.get(name, 0) + self.remote_counts.get(name, 0) for name in PER_SECOND}

    def rates_since_rl_start(self) -> dict[str, float]:
        """`samples_per_second` and `tokens_per_second` since the RL phase began."""
        totals = self.generated()
        seconds = max(time.time() - self.rl_started_at, MIN_SECONDS)
        return {f"{name}_per_second": totals.get(name, 0) / seconds for name in PER_SECOND}

    def add_batch(self, lags: np.ndarray, skipped: bool) -> None:
        self.lag_sum += float(lags.sum())
        self.lag_count += len(lags)
        self.lag_max = max(self.lag_max, float(lags.max()))
        self.steps_trained += 1
        self.skipped_steps += int(skipped)


def history_so_far(history: dict, segment: Segment) -> dict:
    """The run's history (whole-run totals) with this segment's work added."""
    totals = segment.generated()
    now = time.time()
    rl_seconds = now - segment.rl_started_at if segment.rl_started_at is not None else 0.0
    time_split = dict(history["time_split_seconds"])
    for name, seconds in segment.meters.time_split.totals().items():
        time_split[name] = time_split.get(name, 0.0) + seconds
    return {
        **history,
        "samples_generated": history["samples_generated"] + totals.get("samples", 0),
        "tokens_generated": history["tokens_generated"] + totals.get("tokens", 0),
        "rl_seconds": history["rl_seconds"] + rl_seconds,
        WALL_SECONDS: history[WALL_SECONDS] + now - segment.started_at,
        "learner_steps_trained": history["learner_steps_trained"] + segment.steps_trained,
        "policy_lag_sum": history["policy_lag_sum"] + segment.lag_sum,
        "policy_lag_count": history["policy_lag_count"] + segment.lag_count,
        "policy_lag_max": max(history["policy_lag_max"], segment.lag_max),
        "skipped_nonfinite_steps": history["skipped_nonfinite_steps"] + segment.skipped_steps,
        "time_split_seconds": time_split,
    }


def peak_device_gib() -> float | None:
    """The most device memory any of this process's devices has held (GiB), as their
    allocators report it; None where they report none (a CPU)."""
    peaks = [
        (device.memory_stats() or {}).get("peak_bytes_in_use") for device in jax.local_devices()
    ]
    peaks = [peak for peak in peaks if peak is not None]
    return round(max(peaks) / 2**30, 2) if peaks else None


def run_summary(
    config: ml_collections.ConfigDict,
    history: dict,
    *,
    eval_key: str,
    score_end: float,
    learner_steps: int,
    colocated: bool,
    layout: dict | None = None,
) -> dict:
    """summary.json: what ran, how well (the start/end `eval_key` evaluation), how fast and
    how stale, over the whole run (every resumed segment)."""
    key = eval_key
    rl_seconds = max(history["rl_seconds"], MIN_SECONDS)
    lag_count = max(history["policy_lag_count"], 1)
    return {
        "config_name": config.name,
        "variant": config.variant,
        "mode": config.mode,
        "method": config.method,
        "learner_steps": learner_steps,
        "samples_generated": history["samples_generated"],
        "tokens_generated": history["tokens_generated"],
        WALL_SECONDS: history[WALL_SECONDS],
        WARM_START_SECONDS: history.get(WARM_START_SECONDS, 0.0),
        "rl_seconds": history["rl_seconds"],
        f"{key}_start": history.get(f"{key}_start"),
        f"{key}_end": score_end,
        "max_policy_lag": history["policy_lag_max"],
        "mean_policy_lag": history["policy_lag_sum"] / lag_count,
        "samples_per_second": history["samples_generated"] / rl_seconds,
        "tokens_per_second": history["tokens_generated"] / rl_seconds,
        "learner_steps_per_second": history["learner_steps_trained"] / rl_seconds,
        "skipped_nonfinite_steps": history["skipped_nonfinite_steps"],
        "time_split_seconds": history["time_split_seconds"],
        "num_devices": jax.device_count(),
        "peak_device_gib": peak_device_gib(),
        "colocated": colocated,
        # the processes' layout (tba_jax.topology) and the learner's time in exchanges
        **(layout or {"topology": "single_process", "num_processes": 1}),
        "exchange_seconds_per_step": history["time_split_seconds"].get(EXCHANGING, 0.0)
        / max(history["learner_steps_trained"], 1),
    }
