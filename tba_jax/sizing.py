r"""Sizing a multi-device TBA run from a short measured profile: how to split N devices.

    python benchmarks/profile_roles.py --config=configs/arithmetic.py --out=profile.json
    python -m tba_jax.sizing --profile=profile.json --devices=8 [--topology=2x4] \
        [--exchange_s=0.05]
    python benchmarks/sizing_check.py --profile=profile.json WORKDIR ...   # against runs

`benchmarks/profile_roles.py` times, on one device group, a search call (prompts_per_call
× S responses generated and scored), a learner step on B×K samples, the host's batch draw
from the replay buffer and a publish of the params. From such a profile this module
predicts, for every split of N devices into s sampler devices and N − s learner devices
(and for the colocated layout, where both roles share all N), the learner's steps per
second, the new samples the searchers make per learner step, the mean policy lag of the
samples trained on, and which role is the bottleneck. Pure arithmetic: no JAX.

Scaling assumptions (each one a field of `Assumptions`):

- Sampler: samples/s = r₁ · (1 + e_s·(s − 1)) on s sampler devices, with r₁ one device's
  rate and e_s = `sampler_efficiency` (1: linear). They run s/g independent searchers,
  each splitting its calls' rows over g devices (its process's sampler mesh:
  `searcher_devices`), so a call takes c_g = c₁ / (1 + e_s·(g − 1)), c₁ one device's time
  for one call. By default a process per host: with `--topology`, a host's sampler
  devices (`all_layouts`: s/H under roles_within_host, a host's working devices under
  roles_by_process, which leaves one a host to the exchanges), else all s (one process);
  g = 1 is a searcher process per device (`tba_jax.launch --devices_per_process=1`, as
  benchmarks/sizing_check.py's runs).
- Learner: a step's device time on n devices is t₁ / (1 + e_l·(n − 1)), with t₁ one
  device's time and e_l = `learner_efficiency` (each added device adds e_l of a device:
  1 is linear, 0 no gain). The host's batch draw (t_draw) does not scale.
- Publish: the copy of the params to the sampler (t_pub) takes constant time, charged to
  the learner once every k steps (an upper bound: `mesh.publish` is asynchronous and may
  overlap the next step). It does not slow the sampler.
- Exchange (optional; 0 by default): t_x = `exchange_seconds`, the seconds per learner
  step the learner is blocked exchanging trajectories and params with searcher processes
  (roles_by_process pays one every step; summary.json's `exchange_seconds_per_step`
  measures it, or `--exchange_s` sets it). Charged in full to every learner step, whatever
  n is; it does not slow the sampler. (In roles_by_process the params travel inside the
  exchange, so a measured t_x already holds the publish that t_pub/k also charges.)
- Colocated: both roles time-share all N devices; the sampler gets `colocated_sampler_share`
  (f) of their time and the learner the rest, so samples/s = f·r(N), a searcher's call
  takes c_g/f, and a learner step takes (t_draw + t(N) + t_pub/k + t_x) / (1 − f).
- Profiles taken on several devices are first brought to one device by the same laws.
- The learner never waits for the searchers (it samples the replay buffer), so ρ does not
  depend on the sampler; a slow sampler shows as few new samples per step (`fresh`) and a
  longer lag. `search.num_searchers` is not modelled: one searcher per sampler mesh.

So, with ρ = learner steps/s = 1 / (t_draw + t(n) + t_pub/k + t_x) and R = samples/s:

    samples per learner step   G = R / ρ
    fresh fraction             G / (B·K)   (≥ 1: the sampler makes a whole batch per step)

Policy lag (in learner steps: the step a sample is trained at minus the version of the
params that generated it; see `tba_jax.runtime`). A searcher reads the newest published
params when a call starts; the version published every k steps is on average k/2 steps
old when it is read (the continuous-time average over the phase; exactly, for a fixed
delay, between (k − 1)/2 and (k + 1)/2). A batch's B prompt slots are:

- with probability m (`recency_prob`), a recency draw: the prompts whose samples carry the
  newest version in the buffer. That version is the one read by the last *finished* call,
  which started about d = c·(1 + 1/(n_s + 1)) ago (a call takes c, and the newest of n_s
  searchers' calls started, on average, c/(n_s + 1) before the last one finished). The
  newest call brings prompts_per_call prompts at once; when the m·B recency draws need
  more, the rest reach back W = max(0, m·B − prompts_per_call)·S/G steps over older
  calls (and versions). So

      lag_recency ≈ ρ·d + k/2 + W/2;

- otherwise a priority draw: a prompt uniformly from the whole buffer (K of its samples by
  reward priority, which the model treats as uniform in age). The buffer keeps the newest
  `replay_capacity` samples, H = capacity/G steps' worth, so a sample's time in the buffer
  is uniform on [0, min(t, H)] at learner step t; over a run of L steps its mean is
  A = L/4 when L ≤ H, else H/2 − H²/(4L) (H/2 for L → ∞). So

      lag_priority ≈ A + ρ·c + k/2.

No sample is older than the run: the lag at step t is at most t, so a lag of x steps holds
only from step x on. Averaged over the run, x becomes x − x²/(2L) (L/2 when L ≤ x); this
cap is applied to lag_recency and to the ρ·c + k/2 of lag_priority. Then

    policy_lag_mean = m·lag_recency + (1 − m)·lag_priority

Honest limits: duplicate collapse (a response made again refreshes the stored one rather
than adding a copy) lets the buffer hold more prompts than capacity/S once the policy
repeats itself, and a prompt revisited in a later epoch keeps older samples beside new ones:
both make the measured lag *longer* than predicted on a task the policy has learnt. The
first `replay.min_prompts` fill, warm-up compiles and evaluations are left out, and so is
contention between the roles for the host (a CPU "device" that is one core of a shared
machine). Against a discrete-event simulation of searchers and a learner around the real
`ReplayBuffer` (tests/test_sizing.py), the lag comes within about half a step plus 10%.

`best_split(profile, N)` picks, among the splits whose learner batch divides over the
learner's devices (and, over several hosts, as a topology that can run them: each host
split alike, or hosts kept whole; see `all_layouts`), the
one with the most learner steps/s among those whose fresh fraction is at least
`min_fresh_fraction` (default 1: the sampler keeps up, making a batch's worth of new
samples every learner step). When none is, it picks the one that trains the most fresh
batches per second, min(ρ, R / (min_fresh_fraction·B·K)).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_SAMPLER_EFFICIENCY = 1.0
DEFAULT_LEARNER_EFFICIENCY = 0.9
DEFAULT_COLOCATED_SAMPLER_SHARE = 0.5
DEFAULT_MIN_FRESH_FRACTION = 1.0
STEADY_STATE = math.inf  # Assumptions.run_steps: lag with a full buffer, for ever
ERROR_PREFIX = "error: "
USER_ERROR_EXIT_STATUS = 1
TOPOLOGY_SEPARATOR = "x"
BY_PROCESS, WITHIN_HOST = "by process", "within host"  # the multi-host layouts' names
# Profile figures that may be 0 (every other number must be positive).
MAY_BE_ZERO = ("batch_draw_seconds", "publish_seconds", "exchange_seconds", "recency_prob")


@dataclasses.dataclass(frozen=True)
class Profile:
    """What the model reads of a profile (benchmarks/profile_roles.py writes these keys).

    The config's settings: B = prompts_per_batch, K = samples_per_prompt, S =
    samples_generated_per_prompt, k = sync_period, prompts_per_call (prompts per search
    call), m = recency_prob, replay_capacity (samples), learner_steps, num_microbatches.
    The devices each role used while measured (both all of them when colocated). Seconds
    are medians: one search call, which made `samples_per_call` samples; one learner step
    (device work, batch placed and metrics fetched); the host's batch draw from the replay
    buffer; one publish of the params. `exchange_seconds` (optional, 0 when absent): the
    seconds per learner step the learner is blocked exchanging with searcher processes.
    """

    prompts_per_batch: int
    samples_per_prompt: int
    samples_generated_per_prompt: int
    sync_period: int
    prompts_per_call: int
    recency_prob: float
    replay_capacity: int
    learner_steps: int
    num_microbatches: int
    sampler_devices: int
    learner_devices: int
    samples_per_call: float
    search_call_seconds: float
    learner_step_seconds: float
    batch_draw_seconds: float
    publish_seconds: float
    exchange_seconds: float = 0.0
    config: str = ""
    platform: str = ""

    @property
    def batch_samples(self) -> int:
        """B·K, the samples one learner step trains on."""
        return self.prompts_per_batch * self.samples_per_prompt

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Profile:
        """The model's fields of a profile dict (other keys are ignored); ValueError names
        the missing ones and any that is not a positive number where one is needed."""
        fields = {field.name: field for field in dataclasses.fields(cls)}
        required = [name for name, field in fields.items() if field.default is dataclasses.MISSING]
        missing = [name for name in required if name not in values]
        if missing:
            raise ValueError(
                f"the profile lacks {', '.join(missing)}; make it with benchmarks/profile_roles.py."
            )
        profile = cls(**{name: values[name] for name in fields if name in values})
        check_figures(profile)
        return profile


def check_figures(profile: Profile) -> None:
    """ValueError for a profile figure that is not a finite number > 0 (>= 0 for those in
    MAY_BE_ZERO), or a recency_prob above 1."""
    for field in dataclasses.fields(profile):
        value = getattr(profile, field.name)
        if isinstance(value, str):
            continue
        is_number = isinstance(value, (int, float)) and math.isfinite(value)
        if field.name in MAY_BE_ZERO:
            if not (is_number and value >= 0):
                raise ValueError(f"the profile's {field.name}={value!r} must be a number >= 0.")
        elif not (is_number and value > 0):
            raise ValueError(f"the profile's {field.name}={value!r} must be a positive number.")
    if profile.recency_prob > 1:
        raise ValueError(f"the profile's recency_prob={profile.recency_prob} must be in [0, 1].")


def read_json_object(path: str, what: str) -> dict:
    """The JSON object in `path`; ValueError saying what `what` is when it is not one."""
    with open(path) as f:
        try:
            values = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not {what} (not JSON: {error}).") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} is not {what} (not a JSON object).")
    return values


def read_profile_values(path: str) -> dict:
    """The JSON object of the profile file at `path` (its figures unchecked; `Profile`
    checks them); FileNotFoundError or ValueError saying to make one."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"--profile={path} is not a file; make one with benchmarks/profile_roles.py."
        )
    return read_json_object(path, "a profile")


def load_profile(path: str) -> Profile:
    """The profile JSON file at `path` (as benchmarks/profile_roles.py writes it)."""
    return Profile.from_dict(read_profile_values(path))


def with_exchange(profile: Profile, exchange_seconds: float) -> Profile:
    """`profile` with its learner blocked `exchange_seconds` per step in exchanges with
    searcher processes (ValueError unless a number >= 0)."""
    if not (math.isfinite(exchange_seconds) and exchange_seconds >= 0):
        raise ValueError(f"exchange_seconds={exchange_seconds!r} must be a number >= 0.")
    return dataclasses.replace(profile, exchange_seconds=exchange_seconds)


def as_profile(profile: Profile | Mapping[str, Any]) -> Profile:
    return profile if isinstance(profile, Profile) else Profile.from_dict(profile)


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """The scaling laws' parameters (see the module docstring).

    sampler_efficiency: e_s, each added sampler device adds e_s of one device's samples/s.
    learner_efficiency: e_l, each added learner device adds e_l of one device's speed.
    colocated_sampler_share: f in (0, 1), the sampler's share of the devices' time when
      both roles share them.
    min_fresh_fraction: `best_split`'s constraint, new samples per learner step ÷ B·K.
    run_steps: the lag is averaged over a run of this many learner steps (None: the
      profile's learner_steps; STEADY_STATE: a full buffer).
    """

    sampler_efficiency: float = DEFAULT_SAMPLER_EFFICIENCY
    learner_efficiency: float = DEFAULT_LEARNER_EFFICIENCY
    colocated_sampler_share: float = DEFAULT_COLOCATED_SAMPLER_SHARE
    min_fresh_fraction: float = DEFAULT_MIN_FRESH_FRACTION
    run_steps: float | None = None

    def __post_init__(self):
        for name in ("sampler_efficiency", "learner_efficiency"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1].")
        if not 0 < self.colocated_sampler_share < 1:
            raise ValueError(
                f"colocated_sampler_share={self.colocated_sampler_share} must be in (0, 1)."
            )
        if not self.min_fresh_fraction >= 0:
            raise ValueError(f"min_fresh_fraction={self.min_fresh_fraction} must be >= 0.")
        if self.run_steps is not None and not self.run_steps > 0:
            raise ValueError(f"run_steps={self.run_steps} must be > 0 (or None, or inf).")


DEFAULT_ASSUMPTIONS = Assumptions()


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One layout's predicted figures.

    sampler_devices / learner_devices: the devices of each role (both N when colocated).
    learner_steps_per_s: ρ. samples_per_learner_step: G, new samples per learner step.
    policy_lag_mean: the mean lag of trained samples, in learner steps (its recency and
    priority parts beside it). samples_per_s: R. step_seconds: 1/ρ. fresh_fraction:
    G / (B·K). call_seconds: one searcher call's latency. batch_divides: the learner's
    B·K/num_microbatches rows divide over its devices (as config_lib.validate requires),
    and over several hosts B over the learner processes (as tba_jax.topology requires).
    searcher_devices: g, the devices each searcher's calls are split over; searchers: how
    many (the working sampler devices / g).
    exchange_devices: of the layout's devices, those that only exchange (roles_by_process
    keeps one a process when it has two or more). layout: the multi-host topology that
    runs it (BY_PROCESS, WITHIN_HOST; "" for one process, or for a split none can run).
    """

    sampler_devices: int
    learner_devices: int
    colocated: bool
    learner_steps_per_s: float
    samples_per_learner_step: float
    policy_lag_mean: float
    policy_lag_recency: float
    policy_lag_priority: float
    samples_per_s: float
    step_seconds: float
    fresh_fraction: float
    call_seconds: float
    batch_divides: bool
    searcher_devices: int = 1
    searchers: float = 1.0
    exchange_devices: int = 0
    layout: str = ""

    @property
    def devices(self) -> int:
        """N, the devices the layout uses."""
        if self.colocated:
            return self.sampler_devices
        return self.sampler_devices + self.learner_devices

    @property
    def label(self) -> str:
        """'3 + 5' (sampler + learner devices) or 'colocated 8', then the layout's name
        if it has one ('4 + 4 by process')."""
        name = (
            f"colocated {self.sampler_devices}"
            if self.colocated
            else f"{self.sampler_devices} + {self.learner_devices}"
        )
        return f"{name} {self.layout}" if self.layout else name

    def keeps_up(self, min_fresh_fraction: float = DEFAULT_MIN_FRESH_FRACTION) -> bool:
        """Whether the sampler makes at least min_fresh_fraction·B·K samples per step."""
        return self.fresh_fraction >= min_fresh_fraction

    def bottleneck(self, min_fresh_fraction: float = DEFAULT_MIN_FRESH_FRACTION) -> str:
        """'learner' when the sampler keeps up (the learner's speed sets the pace), else
        'sampler' (batches replay older samples for want of new ones)."""
        return "learner" if self.keeps_up(min_fresh_fraction) else "sampler"

    def fresh_batches_per_s(self, min_fresh_fraction: float = DEFAULT_MIN_FRESH_FRACTION) -> float:
        """ρ · min(1, fresh_fraction / min_fresh_fraction) = min(ρ, R / (min_fresh_fraction·B·K)):
        the batches per second that can each hold min_fresh_fraction of a batch in new
        samples."""
        if min_fresh_fraction == 0:
            return self.learner_steps_per_s
        return self.learner_steps_per_s * min(1.0, self.fresh_fraction / min_fresh_fraction)

    def as_dict(self) -> dict[str, Any]:
        return {"split": self.label, **dataclasses.asdict(self)}


# ---------------------------------------------------------------------- scaling laws


def speedup(devices: int, efficiency: float) -> float:
    """1 + efficiency·(devices − 1): the work rate of `devices` devices in one-device units."""
    return 1 + efficiency * (devices - 1)


def samples_per_s_one_device(profile: Profile, assumptions: Assumptions) -> float:
    """r₁: one sampler device's samples/s (the profile's rate over its sampler devices)."""
    measured = profile.samples_per_call / profile.search_call_seconds
    return measured / speedup(profile.sampler_devices, assumptions.sampler_efficiency)


def learner_seconds_one_device(profile: Profile, assumptions: Assumptions) -> float:
    """t₁: one learner device's step seconds (the profile's, brought to one device)."""
    gain = speedup(profile.learner_devices, assumptions.learner_efficiency)
    return profile.learner_step_seconds * gain


def step_seconds(profile: Profile, learner_devices: int, assumptions: Assumptions) -> float:
    """Seconds per learner step on `learner_devices` devices of its own: the host's batch
    draw + the step's device time + the publish every k steps + the exchange with searcher
    processes (0 unless the profile sets one)."""
    device_time = learner_seconds_one_device(profile, assumptions) / speedup(
        learner_devices, assumptions.learner_efficiency
    )
    publish = profile.publish_seconds / profile.sync_period
    return profile.batch_draw_seconds + device_time + publish + profile.exchange_seconds


def batch_divides(profile: Profile, learner_devices: int, learner_processes: int = 1) -> bool:
    """Whether a micro-batch's rows (B·K / num_microbatches) divide over the learner's
    devices (the learner's batch is split over all of them: no tensor axis), and B over
    its processes (each draws its share of the prompts)."""
    rows = profile.batch_samples // profile.num_microbatches
    return rows % learner_devices == 0 and profile.prompts_per_batch % learner_processes == 0


# ------------------------------------------------------------------------ policy lag


def searcher_delay_s(call_seconds: float, searchers: float) -> float:
    """d: how long before now the newest version in the buffer was read, on average:
    the last finished call took `call_seconds`, and the newest of `searchers`
    independent searchers' calls started call_seconds/(searchers + 1) before it ended."""
    return call_seconds * (1 + 1 / (searchers + 1))


def recency_lag(
    profile: Profile, steps_per_s: float, samples_per_step: float, delay_s: float
) -> float:
    """lag_recency = ρ·d + k/2 + W/2, W = max(0, m·B − prompts_per_call)·S / G: the steps
    the searchers take to make the recency draws' prompts beyond the newest call's."""
    prompts_needed = profile.recency_prob * profile.prompts_per_batch
    beyond_newest_call = max(0.0, prompts_needed - profile.prompts_per_call)
    window_steps = beyond_newest_call * profile.samples_generated_per_prompt / samples_per_step
    return steps_per_s * delay_s + (profile.sync_period + window_steps) / 2


def mean_buffer_residence(horizon_steps: float, run_steps: float) -> float:
    """A: a trained sample's mean time in the buffer (steps), averaged over a run of
    `run_steps` learner steps when the buffer holds `horizon_steps` steps' worth of samples
    once full: at step t the residence is uniform on [0, min(t, H)]."""
    if math.isinf(run_steps):
        return horizon_steps / 2
    if run_steps <= horizon_steps:
        return run_steps / 4
    return horizon_steps / 2 - horizon_steps**2 / (4 * run_steps)


def capped_by_step(lag_steps: float, run_steps: float) -> float:
    """The mean over a run of `run_steps` learner steps of min(t, lag_steps): no sample is
    older than the run (the lag at step t is at most t), so a lag of x steps holds only
    from step x on. x − x²/(2L) when L ≥ x, else L/2; x for L → ∞."""
    if math.isinf(run_steps):
        return lag_steps
    if run_steps <= lag_steps:
        return run_steps / 2
    return lag_steps - lag_steps**2 / (2 * run_steps)


def priority_lag(
    profile: Profile,
    steps_per_s: float,
    samples_per_step: float,
    call_seconds: float,
    run_steps: float,
) -> float:
    """lag_priority = A + ρ·c + k/2 (the last two capped by the run's steps), the buffer
    holding H = capacity / G steps' worth."""
    horizon_steps = profile.replay_capacity / samples_per_step
    residence = mean_buffer_residence(horizon_steps, run_steps)
    offset = steps_per_s * call_seconds + profile.sync_period / 2
    return residence + capped_by_step(offset, run_steps)


# ------------------------------------------------------------------------ predictions


def predict(
    profile: Profile | Mapping[str, Any],
    sampler_devices: int,
    learner_devices: int,
    *,
    colocated: bool = False,
    assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
    searcher_devices: int = 1,
    exchange_devices: tuple[int, int] = (0, 0),
    layout: str = "",
    learner_processes: int = 1,
) -> Prediction:
    """The figures of `sampler_devices` searcher devices beside `learner_devices` learner
    devices; with `colocated`, both roles share the same devices (the two counts must then
    be equal: N). Each searcher splits its calls over `searcher_devices` of them (at most
    all), so there are sampler_devices / searcher_devices searchers. `exchange_devices`:
    of each role's devices, those that only run roles_by_process's exchanges (left out of
    its work). `layout`: the run's multi-host topology (BY_PROCESS, WITHIN_HOST; "" for
    one process), named in the label; `learner_processes`: the processes its learner
    spans (B must divide over them)."""
    profile = as_profile(profile)
    if sampler_devices < 1 or learner_devices < 1:
        raise ValueError(
            f"sampler_devices={sampler_devices} and learner_devices={learner_devices} must "
            "both be >= 1."
        )
    if colocated and sampler_devices != learner_devices:
        raise ValueError(
            f"colocated roles share the same devices: sampler_devices={sampler_devices} "
            f"and learner_devices={learner_devices} must be equal."
        )
    if searcher_devices < 1:
        raise ValueError(f"searcher_devices={searcher_devices} must be >= 1.")
    split = sampler_devices, learner_devices
    sampler_devices -= exchange_devices[0]
    learner_devices -= exchange_devices[1]
    if sampler_devices < 1 or learner_devices < 1:
        raise ValueError(
            f"exchange_devices={exchange_devices} leave no working device of "
            f"{split[0]} + {split[1]}."
        )
    group = min(searcher_devices, sampler_devices)
    share = assumptions.colocated_sampler_share if colocated else 1.0
    learner_share = 1 - assumptions.colocated_sampler_share if colocated else 1.0
    one_device_rate = samples_per_s_one_device(profile, assumptions)
    samples_per_s = (
        share * one_device_rate * speedup(sampler_devices, assumptions.sampler_efficiency)
    )
    group_rate = one_device_rate * speedup(group, assumptions.sampler_efficiency)
    call_seconds = profile.samples_per_call / group_rate / share
    seconds = step_seconds(profile, learner_devices, assumptions) / learner_share
    steps_per_s = 1 / seconds
    samples_per_step = samples_per_s * seconds
    run_steps = profile.learner_steps if assumptions.run_steps is None else assumptions.run_steps
    searchers = sampler_devices / group
    delay = searcher_delay_s(call_seconds, searchers)
    lag_recency = capped_by_step(
        recency_lag(profile, steps_per_s, samples_per_step, delay), run_steps
    )
    lag_priority = priority_lag(profile, steps_per_s, samples_per_step, call_seconds, run_steps)
    m = profile.recency_prob
    return Prediction(
        sampler_devices=split[0],
        learner_devices=split[1],
        colocated=colocated,
        learner_steps_per_s=steps_per_s,
        samples_per_learner_step=samples_per_step,
        policy_lag_mean=m * lag_recency + (1 - m) * lag_priority,
        policy_lag_recency=lag_recency,
        policy_lag_priority=lag_priority,
        samples_per_s=samples_per_s,
        step_seconds=seconds,
        fresh_fraction=samples_per_step / profile.batch_samples,
        call_seconds=call_seconds,
        batch_divides=batch_divides(profile, learner_devices, learner_processes),
        searcher_devices=group,
        searchers=searchers,
        exchange_devices=sum(exchange_devices),
        layout=layout,
    )


@dataclasses.dataclass(frozen=True)
class Topology:
    """`hosts` machines of `devices_per_host` devices each (`--topology=2x4`)."""

    hosts: int
    devices_per_host: int

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host

    @property
    def multi_host(self) -> bool:
        return self.hosts > 1

    @property
    def working_devices_per_host(self) -> int:
        """A roles_by_process host's devices that work: with two or more, the last one
        only runs the exchanges (`tba_jax.topology.working_devices`)."""
        return self.devices_per_host - 1 if self.devices_per_host > 1 else 1


def parse_topology(text: str) -> Topology:
    """'2x4' → Topology(2, 4); ValueError for anything else."""
    parts = text.lower().split(TOPOLOGY_SEPARATOR)
    if len(parts) != 2 or not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise ValueError(
            f"--topology={text!r} must be HOSTSxDEVICES_PER_HOST with counts >= 1, e.g. 2x4."
        )
    return Topology(int(parts[0]), int(parts[1]))


def all_layouts(
    profile: Profile | Mapping[str, Any],
    devices: int,
    *,
    assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
    topology: Topology | None = None,
    searcher_devices: int | None = None,
) -> list[Prediction]:
    """The colocated layout on all `devices`, then every split s + (N − s), s = 1 … N − 1.

    One process (no topology, or one host): one searcher on all s sampler devices. Over
    several hosts, each split as every topology that can run it: WITHIN_HOST
    (`roles_within_host`) when s divides over the hosts (s/H sampler devices a host, one
    searcher on them; the learner spans the hosts), BY_PROCESS (`roles_by_process`) when
    it keeps hosts whole (a searcher per sampler host on its working devices: one a host
    is left to the exchanges); a split neither runs is listed without a layout (unusable).
    `searcher_devices` overrides the devices a searcher spans."""
    if devices < 1:
        raise ValueError(f"devices={devices} must be >= 1.")
    profile = as_profile(profile)

    def layout(sampler: int, learner: int, group: int, **kwargs) -> Prediction:
        group = group if searcher_devices is None else searcher_devices
        return predict(
            profile,
            sampler,
            learner,
            assumptions=assumptions,
            searcher_devices=max(1, min(group, sampler)),
            **kwargs,
        )

    if topology is None or not topology.multi_host:
        layouts = [layout(devices, devices, devices, colocated=True)]
        return layouts + [layout(s, devices - s, s) for s in range(1, devices)]
    hosts, per_host = topology.hosts, topology.devices_per_host
    working = topology.working_devices_per_host
    within_host = dict(layout=WITHIN_HOST, learner_processes=hosts)
    layouts = [layout(devices, devices, per_host, colocated=True, **within_host)]
    for s in range(1, devices):
        runs = []
        if s % hosts == 0:
            runs.append(layout(s, devices - s, s // hosts, **within_host))
        if s % per_host == 0:
            learner_hosts = (devices - s) // per_host
            by_process = dict(
                layout=BY_PROCESS,
                learner_processes=learner_hosts,
                exchange_devices=(s // per_host, learner_hosts) if per_host > 1 else (0, 0),
            )
            runs.append(layout(s, devices - s, working, **by_process))
        layouts += runs or [layout(s, devices - s, s)]
    return layouts


def allowed(prediction: Prediction, topology: Topology | None) -> bool:
    """A layout the run can use: its batch divides, and over several hosts a topology
    runs it (`all_layouts`)."""
    if not prediction.batch_divides:
        return False
    return topology is None or not topology.multi_host or bool(prediction.layout)


def choose(layouts: Sequence[Prediction], min_fresh_fraction: float) -> Prediction:
    """The most learner steps/s among layouts that keep up (ties: the lower lag); if none
    does, the most fresh batches per second (ties: more learner steps/s)."""
    keeping_up = [layout for layout in layouts if layout.keeps_up(min_fresh_fraction)]
    if keeping_up:
        return max(keeping_up, key=lambda p: (p.learner_steps_per_s, -p.policy_lag_mean))
    return max(
        layouts,
        key=lambda p: (p.fresh_batches_per_s(min_fresh_fraction), p.learner_steps_per_s),
    )


def best_split(
    profile: Profile | Mapping[str, Any],
    devices: int,
    *,
    assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
    topology: Topology | None = None,
    searcher_devices: int | None = None,
) -> Prediction:
    """The layout of `devices` devices with the most learner steps/s whose sampler makes at
    least `assumptions.min_fresh_fraction` of a batch in new samples per step (see the
    module docstring), among those the run can use (`allowed`)."""
    layouts = all_layouts(
        profile,
        devices,
        assumptions=assumptions,
        topology=topology,
        searcher_devices=searcher_devices,
    )
    return best_of(layouts, assumptions, topology)


def best_of(
    layouts: Sequence[Prediction], assumptions: Assumptions, topology: Topology | None
) -> Prediction:
    """`choose` among the `layouts` the run can use (`allowed`)."""
    usable = [layout for layout in layouts if allowed(layout, topology)]
    return choose(usable, assumptions.min_fresh_fraction)


# ------------------------------------------------------------------------------- table

TABLE_COLUMNS = (
    ("split", "{:<25}"),
    ("searchers", "{:>9}"),
    ("learner steps/s", "{:>15}"),
    ("samples/step", "{:>12}"),
    ("fresh", "{:>6}"),
    ("lag mean (recency / priority)", "{:>29}"),
    ("bottleneck", "{:<10}"),
)
UNUSABLE_NOTE = {"batch": "batch does not divide", "hosts": "uneven over hosts"}


def table_row(
    prediction: Prediction, assumptions: Assumptions, topology: Topology | None, best: bool
) -> str:
    """One line of the table; '*' marks the best split, unusable layouts say why."""
    lag = (
        f"{prediction.policy_lag_mean:.1f} ({prediction.policy_lag_recency:.1f} / "
        f"{prediction.policy_lag_priority:.1f})"
    )
    cells = (
        ("* " if best else "  ") + prediction.label,
        f"{prediction.searchers:.3g}×{prediction.searcher_devices}",
        f"{prediction.learner_steps_per_s:.2f}",
        f"{prediction.samples_per_learner_step:.0f}",
        f"{prediction.fresh_fraction:.2f}",
        lag,
        prediction.bottleneck(assumptions.min_fresh_fraction),
    )
    line = "  ".join(fmt.format(cell) for (_, fmt), cell in zip(TABLE_COLUMNS, cells, strict=True))
    if not prediction.batch_divides:
        line += f"  ({UNUSABLE_NOTE['batch']})"
    elif not allowed(prediction, topology):
        line += f"  ({UNUSABLE_NOTE['hosts']})"
    return line.rstrip()


def profile_line(profile: Profile) -> str:
    """What the profile measured, in one line."""
    where = f"{profile.config or 'a config'} on {profile.platform or 'a device'}"
    exchange = (
        f", exchange {profile.exchange_seconds:.2g} s per learner step"
        if profile.exchange_seconds
        else ""
    )
    return (
        f"profile: {where} (sampler {profile.sampler_devices} device(s), learner "
        f"{profile.learner_devices}): search call {profile.search_call_seconds:.4g} s for "
        f"{profile.samples_per_call:g} samples, learner step {profile.learner_step_seconds:.4g} "
        f"s + batch draw {profile.batch_draw_seconds:.2g} s, publish "
        f"{profile.publish_seconds:.2g} s; B×K = {profile.batch_samples}, "
        f"S = {profile.samples_generated_per_prompt}, k = {profile.sync_period}, "
        f"m = {profile.recency_prob}{exchange}"
    )


def assumptions_line(assumptions: Assumptions, run_steps: float) -> str:
    lag_over = "a full buffer" if math.isinf(run_steps) else f"a run of {run_steps:g} steps"
    return (
        f"assumptions: sampler efficiency {assumptions.sampler_efficiency:g}, learner "
        f"efficiency {assumptions.learner_efficiency:g}, colocated sampler share "
        f"{assumptions.colocated_sampler_share:g}; keeps up: fresh >= "
        f"{assumptions.min_fresh_fraction:g}; lag over {lag_over}"
    )


def format_table(
    profile: Profile,
    layouts: Sequence[Prediction],
    best: Prediction,
    assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
    topology: Topology | None = None,
) -> str:
    """The readable table of `layouts` (`all_layouts`), `best` starred ("searchers": how
    many, × the devices each splits its calls over)."""
    run_steps = profile.learner_steps if assumptions.run_steps is None else assumptions.run_steps
    header = "  ".join(fmt.format(name) for name, fmt in TABLE_COLUMNS).rstrip()
    lines = [profile_line(profile), assumptions_line(assumptions, run_steps), "", "  " + header]
    lines += [table_row(layout, assumptions, topology, layout == best) for layout in layouts]
    return "\n".join(lines)


def best_summary(
    best: Prediction,
    devices: int,
    assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
    topology: Topology | None = None,
) -> dict[str, Any]:
    """The JSON line's object: the best split's figures and whether it keeps up."""
    return {
        "devices": devices,
        "topology": None if topology is None else dataclasses.asdict(topology),
        "best": best.as_dict(),
        "keeps_up": best.keeps_up(assumptions.min_fresh_fraction),
        "bottleneck": best.bottleneck(assumptions.min_fresh_fraction),
        "assumptions": {
            name: "inf" if value == STEADY_STATE else value
            for name, value in dataclasses.asdict(assumptions).items()
        },
    }


# --------------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tba_jax.sizing",
        description="Predicts every sampler/learner split of N devices from a profile made "
        "by benchmarks/profile_roles.py; prints a table and, last, the best split as JSON.",
    )
    parser.add_argument("--profile", required=True, help="a profile JSON file")
    parser.add_argument("--devices", type=int, help="N (default: the topology's count)")
    parser.add_argument("--topology", help="HOSTSxDEVICES_PER_HOST, e.g. 2x4")
    parser.add_argument("--sampler_efficiency", type=float, default=DEFAULT_SAMPLER_EFFICIENCY)
    parser.add_argument("--learner_efficiency", type=float, default=DEFAULT_LEARNER_EFFICIENCY)
    parser.add_argument(
        "--colocated_sampler_share", type=float, default=DEFAULT_COLOCATED_SAMPLER_SHARE
    )
    parser.add_argument(
        "--min_fresh_fraction",
        type=float,
        default=DEFAULT_MIN_FRESH_FRACTION,
        help="new samples per learner step ÷ B·K the best split must reach",
    )
    parser.add_argument(
        "--exchange_s",
        type=float,
        help="seconds per learner step the learner is blocked exchanging with searcher "
        "processes (default: the profile's exchange_seconds, else 0)",
    )
    parser.add_argument(
        "--searcher_devices",
        type=int,
        help="devices each searcher splits its calls over (default: a process per host: "
        "a host's devices with --topology, else all the sampler devices; 1: a searcher "
        "process per device)",
    )
    parser.add_argument(
        "--run_steps",
        type=float,
        help="average the lag over this many learner steps (default: the profile's "
        "learner_steps; inf: a full buffer)",
    )
    return parser.parse_args(argv)


def device_count(devices: int | None, topology: Topology | None) -> int:
    """N from --devices and --topology (which must agree when both are given)."""
    if devices is None and topology is None:
        raise ValueError("pass --devices=N (or --topology=HOSTSxDEVICES_PER_HOST).")
    if topology is not None and devices is not None and devices != topology.devices:
        raise ValueError(
            f"--devices={devices} but --topology={topology.hosts}x{topology.devices_per_host} "
            f"has {topology.devices}; pass one of them or make them agree."
        )
    count = topology.devices if devices is None else devices
    if count < 1:
        raise ValueError(f"--devices={count} must be >= 1.")
    return count


def main(argv: Sequence[str] | None = None) -> None:
    """The CLI: the table on stdout, then the best split as one JSON line. A mistake is one
    `error: ...` line on stderr and exit status 1."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        profile = load_profile(args.profile)
        if args.exchange_s is not None:
            profile = with_exchange(profile, args.exchange_s)
        topology = parse_topology(args.topology) if args.topology else None
        devices = device_count(args.devices, topology)
        assumptions = Assumptions(
            sampler_efficiency=args.sampler_efficiency,
            learner_efficiency=args.learner_efficiency,
            colocated_sampler_share=args.colocated_sampler_share,
            min_fresh_fraction=args.min_fresh_fraction,
            run_steps=args.run_steps,
        )
        if args.searcher_devices is not None and args.searcher_devices < 1:
            raise ValueError(f"--searcher_devices={args.searcher_devices} must be >= 1.")
    except (OSError, ValueError) as error:
        print(ERROR_PREFIX + str(error), file=sys.stderr)
        sys.exit(USER_ERROR_EXIT_STATUS)
    layouts = all_layouts(
        profile,
        devices,
        assumptions=assumptions,
        topology=topology,
        searcher_devices=args.searcher_devices,
    )
    best = best_of(layouts, assumptions, topology)
    print(format_table(profile, layouts, best, assumptions, topology))
    print(json.dumps(best_summary(best, devices, assumptions, topology), allow_nan=False))


if __name__ == "__main__":
    main()
