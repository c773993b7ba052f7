r"""Checks `tba_jax.sizing` against finished runs: measured figures beside the predictions.

    python benchmarks/profile_roles.py --config=configs/arithmetic.py --out=profile.json
    python -m tba_jax.launch --num_processes=2 --pin_cpus -- experiments/train.py \
        --config=configs/arithmetic.py --workdir=runs/by_process \
        --config.distributed.topology=roles_by_process
    python benchmarks/sizing_check.py --profile=profile.json runs/by_process [WORKDIR ...]

For each WORKDIR (a finished run: its `summary.json` and `config.json`), it predicts with
`sizing.predict` the run's layout and compares three figures with what the run measured:
learner steps/s (`learner_steps_per_second`), new samples per learner step
(`samples_per_second / learner_steps_per_second`) and the mean policy lag
(`mean_policy_lag`). Each run is predicted twice: by the model as it is ("model"), and
with the learner charged the run's own measured `exchange_seconds_per_step` on every step
("model + exchange", `Profile.exchange_seconds`; the same as "model" for a single-process
run, which exchanges nothing). The second is not an independent prediction of the step
rate: it shows how much of the gap the exchanges explain.

The layout: roles_by_process makes the searcher processes' devices the sampler and the
learner processes' devices the learner (one device each when every process is pinned to
one core); a single-process run (or roles_within_host) with colocated roles is the
colocated layout of its devices, else every process's split of its devices
(`mesh.sampler_devices`). Each process's sampler devices are one searcher's, which splits
its calls over them (`sizing.predict`'s `searcher_devices`).

The profile's config settings are replaced by the run's: k (`sync_period`), m
(`replay.recency_prob`), the replay capacity and the learner steps the run made (over which
the lag is averaged). Those that shape the profile's timings (B, K, S, prompts_per_call,
num_microbatches and, when the profile records them, the prompt and response lengths) must
be the run's: a run of other shapes needs a profile of its own config.

It prints the profile, then a markdown table (per run and figure: measured, each
prediction and its relative error, (predicted − measured) / measured), and last one JSON
line with every figure and error and the mean absolute relative errors over the runs. A
mistake (a workdir that is not a finished run, a profile that is not one or does not fit a
run) is one `error: ...` line on stderr and exit status 1.

What a run measures that the model leaves out: its rates are over `rl_seconds`, which also
holds the first `replay.min_prompts` fill, the first steps' compiles, checkpoints and every
evaluation (the final one too), so short runs measure fewer steps/s than they train at; and
`exchange_seconds_per_step` holds the learner's wait in the first fill's rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from tba_jax import mesh as mesh_lib
from tba_jax import runs, sizing

SUMMARY_FILENAME = "summary.json"  # what experiments/train.py writes at a run's end
ROLES_BY_PROCESS = "roles_by_process"  # tba_jax.topology.ROLES_BY_PROCESS
SUMMARY_KEYS = (
    "learner_steps",
    "learner_steps_per_second",
    "samples_per_second",
    "mean_policy_lag",
    "num_devices",
    "colocated",
    "topology",
    "num_processes",
)
# The profile's settings that shape its timings: the run's must be the same (profile key:
# config key). The lengths are compared only when the profile records them.
TIMED_SETTINGS = {
    "prompts_per_batch": "batch.prompts_per_batch",
    "samples_per_prompt": "batch.samples_per_prompt",
    "samples_generated_per_prompt": "batch.samples_generated_per_prompt",
    "prompts_per_call": "search.prompts_per_call",
    "num_microbatches": "batch.num_microbatches",
    "max_prompt_len": "max_prompt_len",
    "max_response_len": "max_response_len",
}
# The model's inputs that the run sets and the timings do not depend on: the run's replace
# the profile's (learner_steps: the steps the run made, from summary.json).
RUN_SETTINGS = {
    "sync_period": "sync_period",
    "recency_prob": "replay.recency_prob",
    "replay_capacity": "replay.capacity",
}
# (key, label, format): the compared figures, under Prediction's names.
QUANTITIES = (
    ("learner_steps_per_s", "learner steps/s", "{:.3g}"),
    ("samples_per_learner_step", "samples / learner step", "{:.3g}"),
    ("policy_lag_mean", "mean policy lag", "{:.3g}"),
)
MODELS = (("model", "model"), ("with_exchange", "model + exchange"))
MISSING = "n/a"


@dataclasses.dataclass(frozen=True)
class Run:
    """A finished run: its workdir, its config (config.json) and its summary.json."""

    workdir: str
    config: ml_collections.ConfigDict
    summary: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Layout:
    """The run's devices per role (both all of them when colocated), and the devices each
    searcher splits its calls over (its process's sampler devices)."""

    sampler_devices: int
    learner_devices: int
    colocated: bool
    searcher_devices: int

    @property
    def label(self) -> str:
        if self.colocated:
            return f"colocated {self.sampler_devices}"
        return f"{self.sampler_devices} + {self.learner_devices}"


# ------------------------------------------------------------------------------ reading


def load_run(workdir: str) -> Run:
    """The finished run in `workdir`; ValueError / FileNotFoundError saying what is amiss."""
    if not os.path.isdir(workdir):
        raise FileNotFoundError(f"{workdir} is not a folder; pass the --workdir of a run.")
    path = os.path.join(workdir, SUMMARY_FILENAME)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} is missing: {workdir} is not a finished run (experiments/train.py writes "
            f"{SUMMARY_FILENAME} when a run ends)."
        )
    summary = sizing.read_json_object(path, "a run's summary")
    needed = SUMMARY_KEYS
    if summary.get("topology") == ROLES_BY_PROCESS:
        needed += ("learner_processes", "searcher_processes")
    missing = [key for key in needed if key not in summary]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}; is it a tba_jax run's summary?")
    try:
        config = runs.load_config(workdir)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{os.path.join(workdir, runs.CONFIG_FILENAME)} is not a run's config (not JSON: "
            f"{error})."
        ) from None
    if config.get("mode") != "async":
        raise ValueError(
            f"{workdir} is a {config.get('mode')} run; tba_jax.sizing models async (TBA) runs."
        )
    if not summary["learner_steps"] or not summary["learner_steps_per_second"] > 0:
        raise ValueError(f"{path}: the run made no learner step; nothing to compare.")
    return Run(workdir, config, summary)


def config_value(config: ml_collections.ConfigDict, dotted: str) -> Any:
    """config's value at a dotted path; ValueError when config.json lacks it."""
    value = config
    for key in dotted.split("."):
        if not isinstance(value, ml_collections.ConfigDict) or key not in value:
            raise ValueError(f"the run's config.json lacks {dotted}; is it a tba_jax run's?")
        value = value[key]
    return value


def run_layout(run: Run) -> Layout:
    """The devices of each role in `run` (see the module docstring)."""
    summary = run.summary
    processes = summary["num_processes"]
    devices = summary["num_devices"]
    if devices % processes:
        raise ValueError(
            f"{run.workdir}: {devices} devices over {processes} processes; the model needs the "
            "same number of devices in every process."
        )
    per_process = devices // processes
    if summary["topology"] == ROLES_BY_PROCESS:
        # with two or more devices, a process's last one only runs the exchanges
        working = sizing.Topology(processes, per_process).working_devices_per_host
        return Layout(
            summary["searcher_processes"] * working,
            summary["learner_processes"] * working,
            colocated=False,
            searcher_devices=working,
        )
    if summary["colocated"]:
        return Layout(devices, devices, colocated=True, searcher_devices=per_process)
    mesh = run.config.mesh
    sampler, learner = mesh_lib.split_devices(
        range(per_process), mesh.sampler_devices, mesh.colocate
    )
    return Layout(
        len(sampler) * processes,
        len(learner) * processes,
        colocated=False,
        searcher_devices=len(sampler),
    )


def profile_for_run(profile_values: Mapping[str, Any], run: Run) -> sizing.Profile:
    """The profile with the run's settings (see the module docstring); ValueError when the
    run's shapes are not the profile's."""
    profile = sizing.Profile.from_dict(profile_values)
    timed = {key: path for key, path in TIMED_SETTINGS.items() if key in profile_values}
    ran = {key: config_value(run.config, path) for key, path in timed.items()}
    differ = [
        f"{path}={ran[key]} (the profile's {profile_values[key]})"
        for key, path in timed.items()
        if ran[key] != profile_values[key]
    ]
    if differ:
        raise ValueError(
            f"{run.workdir} ran {', '.join(differ)}: the profile timed other shapes; profile "
            "the run's config (benchmarks/profile_roles.py)."
        )
    settings = {key: config_value(run.config, path) for key, path in RUN_SETTINGS.items()}
    replaced = dataclasses.replace(
        profile, **settings, learner_steps=run.summary["learner_steps"], exchange_seconds=0.0
    )
    sizing.check_figures(replaced)
    return replaced


# ---------------------------------------------------------------------------- comparing


def measured_figures(summary: Mapping[str, Any]) -> dict[str, float]:
    steps_per_s = summary["learner_steps_per_second"]
    return {
        "learner_steps_per_s": steps_per_s,
        "samples_per_learner_step": summary["samples_per_second"] / steps_per_s,
        "policy_lag_mean": summary["mean_policy_lag"],
    }


def relative_error(predicted: float, measured: float) -> float | None:
    """(predicted − measured) / measured; None when nothing was measured (0)."""
    return None if measured == 0 else (predicted - measured) / measured


def check_run(
    profile_values: Mapping[str, Any], run: Run, assumptions: sizing.Assumptions
) -> dict[str, Any]:
    """The run's measured figures, both predictions and their relative errors."""
    profile = profile_for_run(profile_values, run)
    layout = run_layout(run)
    exchange = float(run.summary.get("exchange_seconds_per_step", 0.0))
    profiles = {"model": profile, "with_exchange": sizing.with_exchange(profile, exchange)}
    measured = measured_figures(run.summary)
    predicted = {}
    for name, each in profiles.items():
        prediction = sizing.predict(
            each,
            layout.sampler_devices,
            layout.learner_devices,
            colocated=layout.colocated,
            assumptions=assumptions,
            searcher_devices=layout.searcher_devices,
        )
        predicted[name] = {key: getattr(prediction, key) for key, _, _ in QUANTITIES}
    return {
        "workdir": run.workdir,
        "topology": run.summary["topology"],
        "layout": layout.label,
        "sampler_devices": layout.sampler_devices,
        "learner_devices": layout.learner_devices,
        "colocated": layout.colocated,
        "searcher_devices": layout.searcher_devices,
        "learner_steps": run.summary["learner_steps"],
        "exchange_seconds_per_step": exchange,
        "measured": measured,
        "predicted": predicted,
        "relative_error": {
            name: {key: relative_error(values[key], measured[key]) for key in measured}
            for name, values in predicted.items()
        },
    }


def mean_abs_errors(checks: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per model and figure, the mean |relative error| over the runs that measured it."""
    means = {}
    for name, _ in MODELS:
        means[name] = {}
        for key, _, _ in QUANTITIES:
            errors = [
                abs(check["relative_error"][name][key])
                for check in checks
                if check["relative_error"][name][key] is not None
            ]
            means[name][key] = sum(errors) / len(errors) if errors else None
    return means


# ------------------------------------------------------------------------------ output


def percent(error: float | None) -> str:
    return MISSING if error is None else f"{error:+.1%}"


def format_table(checks: Sequence[Mapping[str, Any]]) -> str:
    """The markdown table: a row per run and figure (the run's cells on its first row)."""
    header = ["run", "layout", "exchange s/step", "figure", "measured"]
    for _, label in MODELS:
        header += [label, "error"]
    align = ["---", "---", "---:", "---", "---:"] + ["---:", "---:"] * len(MODELS)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    for check in checks:
        for row, (key, label, fmt) in enumerate(QUANTITIES):
            first = row == 0
            cells = [
                check["workdir"] if first else "",
                f"{check['layout']} ({check['topology']})" if first else "",
                f"{check['exchange_seconds_per_step']:.3g}" if first else "",
                label,
                fmt.format(check["measured"][key]),
            ]
            for name, _ in MODELS:
                cells += [
                    fmt.format(check["predicted"][name][key]),
                    percent(check["relative_error"][name][key]),
                ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/sizing_check.py",
        description="Compares tba_jax.sizing's predictions with finished runs' summary.json: "
        "a markdown table, then the errors as one JSON line.",
    )
    parser.add_argument("--profile", required=True, help="a profile JSON file (profile_roles.py)")
    parser.add_argument("workdirs", nargs="+", metavar="WORKDIR", help="a finished run's workdir")
    parser.add_argument(
        "--sampler_efficiency", type=float, default=sizing.DEFAULT_SAMPLER_EFFICIENCY
    )
    parser.add_argument(
        "--learner_efficiency", type=float, default=sizing.DEFAULT_LEARNER_EFFICIENCY
    )
    parser.add_argument(
        "--colocated_sampler_share", type=float, default=sizing.DEFAULT_COLOCATED_SAMPLER_SHARE
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """The CLI (see the module docstring)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        assumptions = sizing.Assumptions(
            sampler_efficiency=args.sampler_efficiency,
            learner_efficiency=args.learner_efficiency,
            colocated_sampler_share=args.colocated_sampler_share,
        )
        profile_values = sizing.read_profile_values(args.profile)
        profile = sizing.Profile.from_dict(profile_values)
        checks = [check_run(profile_values, load_run(w), assumptions) for w in args.workdirs]
    except (OSError, ValueError) as error:
        print(sizing.ERROR_PREFIX + " ".join(str(error).split()), file=sys.stderr)
        sys.exit(sizing.USER_ERROR_EXIT_STATUS)
    print(sizing.profile_line(profile))
    print(
        f"assumptions: sampler efficiency {assumptions.sampler_efficiency:g}, learner "
        f"efficiency {assumptions.learner_efficiency:g}, colocated sampler share "
        f"{assumptions.colocated_sampler_share:g}; each run's k, m, replay capacity and "
        "learner steps replace the profile's"
    )
    print()
    print(format_table(checks))
    print()
    result = {
        "profile": args.profile,
        "runs": checks,
        "mean_abs_relative_error": mean_abs_errors(checks),
    }
    print(json.dumps(result, allow_nan=False))


if __name__ == "__main__":
    main()
