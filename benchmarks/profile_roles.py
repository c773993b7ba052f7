r"""Measures a TBA run's two roles on the current device(s): a profile for `tba_jax.sizing`.

    python benchmarks/profile_roles.py --config=configs/arithmetic.py --out=profile.json
    python benchmarks/profile_roles.py --config=configs/arithmetic.py:smoke --out=/tmp/p.json \
        --steps=3
    python -m tba_jax.sizing --profile=profile.json --devices=8     # then size a run from it

For the config's own shapes (B prompts × K samples per batch, S samples generated per
prompt, `search.prompts_per_call`, `max_response_len`, the model) it times, after an
untimed compiling warm-up, `--steps` repetitions of:

- a search call, as a `runtime.Searcher` makes it: the next prompts_per_call prompts, their
  prompts_per_call × S responses generated with the policy, scored (log π_ref and the task's
  reward) by `sources.make_search_worker`'s `SearchWorker`, and added to a replay buffer.
  Its `time_split` meters give the "generating" and "scoring" shares of each call;
- a learner step: the jitted TB step of `train.setup` on a B×K batch drawn from that replay
  buffer (real searcher samples), put on the learner mesh and its metrics fetched, as the
  training loop does; the host's batch draw (`ReplayBuffer.sample`) is timed on its own;
- a publish: `mesh.publish` of the learner's params onto the sampler's shardings, blocked
  until the copy is done.

It writes the medians (seconds), a publish as a share of a learner step
(`publish_share_of_step`), the samples per call and their mean response tokens, the
config's B, K, S, k, prompts_per_call and replay settings, and the devices each role used
to `--out` as JSON, and prints the same object as one JSON line on stdout.

The policy is the config's starting policy (`model.hf_path`'s weights, else a random
init), not a warm-started one: every shape is the run's, but a trained policy may end its
responses sooner (generation stops when every row of a call has ended).

The run is set up in a temporary folder, removed afterwards; the task's data is prepared
there too unless `--config.task.data_dir` names a folder to keep it in. The devices are
split between the roles as `train.setup` splits them (`mesh.sampler_devices`,
`mesh.colocate`); `tba_jax.sizing` scales per-device figures from the counts recorded here,
so profile on one device (`CUDA_VISIBLE_DEVICES=0`, or a CPU process pinned to one core with
`taskset -c 0`) for the plainest numbers. Run it on a quiet machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
from absl import flags, logging
from ml_collections import config_flags

from tba_jax import cli, config_lib, learner, runtime, sources, train
from tba_jax import mesh as mesh_lib
from tba_jax.checkpoint import CheckpointMismatchError
from tba_jax.config_lib import ConfigError
from tba_jax.data.pipeline import PromptStream
from tba_jax.metrics import write_json_atomically
from tba_jax.replay import ReplayBuffer
from tba_jax.run_totals import Meters

PROFILE_FORMAT_VERSION = 1
DEFAULT_REPEATS = 10
ROUND_DIGITS = 6  # seconds kept to the microsecond

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags, defined only when run as a script (tba_jax.cli's rule)."""
    config_flags.DEFINE_config_file("config", None, "Config file (path[:variant]).")
    flags.DEFINE_string("out", None, "Where the profile goes (a JSON file).")
    flags.DEFINE_integer(
        "steps",
        DEFAULT_REPEATS,
        "Timed repetitions of each measurement (medians are reported).",
        lower_bound=1,
    )
    cli.define_print_config_flag()
    flags.adopt_module_key_flags(cli)
    flags.mark_flag_as_required("config")


USER_ERRORS = (ConfigError, CheckpointMismatchError, FileNotFoundError)


@dataclasses.dataclass
class Roles:
    """What the measurements run: the run's setup, the learner's state and one searcher's
    parts (its worker, prompt stream and replay buffer)."""

    run: train.Setup
    state: learner.TrainState
    worker: runtime.SearchWorker
    stream: PromptStream
    buffer: ReplayBuffer
    meters: Meters


# ------------------------------------------------------------------------------- timing


def seconds_of(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of `fn` (which blocks until its work is done)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    return round(statistics.median(values), ROUND_DIGITS)


# -------------------------------------------------------------------------------- setup


def build_roles(config: ml_collections.ConfigDict, workdir: str) -> Roles:
    """The run's setup (every check `train.setup` makes), the starting policy as the
    learner's state and as the searcher's params and π_ref, and one searcher's parts."""
    run = train.setup(config, workdir)
    params = train.initial_policy_params(config, run.model, run.learner_shardings)
    reference = mesh_lib.publish(params, run.sampler_shardings)
    state = learner.init_train_state(params, run.optimizer, run.state_sharding)
    meters = Meters()
    worker = sources.make_search_worker(
        config,
        run.task,
        run.model,
        reference,
        samples_per_prompt=config.batch.samples_generated_per_prompt,
        meters=meters,
        drop_nonfinite=True,
    )
    stream = PromptStream(run.task.train, seed=config.seed)
    buffer = sources.make_replay_buffer(config, run.task.tokenizer.pad_id)
    return Roles(run, state, worker, stream, buffer, meters)


# ------------------------------------------------------------------------ measurements


def search_call(roles: Roles, params, call: int) -> None:
    """One searcher call (`runtime.Searcher.run`'s body): prompts, search, buffer."""
    config = roles.run.config
    examples = roles.stream.next_batch(config.search.prompts_per_call)
    rng = jax.random.fold_in(jax.random.key(config.seed), call)
    roles.buffer.add(roles.worker.search(params, 0, examples, rng))


def time_search_calls(roles: Roles, repeats: int) -> dict[str, float]:
    """Medians over `repeats` calls after a compiling one: seconds per call in all, and
    its generating and scoring shares; samples per call and mean response tokens. Then
    untimed calls until the buffer holds `replay.min_prompts` prompts."""
    params = mesh_lib.publish(roles.state.params, roles.run.sampler_shardings)
    search_call(roles, params, call=0)  # compiles generate and score
    split, rates = roles.meters.time_split, roles.meters.rates
    before_rates = rates.totals()
    totals, generating, scoring = [], [], []
    for call in range(1, repeats + 1):
        before = split.totals()
        totals.append(seconds_of(lambda call=call: search_call(roles, params, call)))
        after = split.totals()
        generating.append(after["generating"] - before["generating"])
        scoring.append(after["scoring"] - before["scoring"])
    after_rates = rates.totals()
    samples = after_rates["samples"] - before_rates["samples"]
    tokens = after_rates["tokens"] - before_rates["tokens"]
    call = repeats + 1
    while roles.buffer.num_prompts < roles.run.config.replay.min_prompts:
        search_call(roles, params, call)
        call += 1
    return {
        "search_call_seconds": median(totals),
        "generating_seconds": median(generating),
        "scoring_seconds": median(scoring),
        "samples_per_call": samples / repeats,
        "mean_response_tokens": round(tokens / max(samples, 1), 3),
    }


def time_learner_steps(roles: Roles, repeats: int) -> dict[str, float]:
    """Medians over `repeats` learner steps after a compiling one: the host's batch draw
    from the replay buffer, and the step (batch onto the learner mesh, the jitted train
    step, its metrics fetched), as the training loop takes them."""
    config, run = roles.run.config, roles.run
    batch_sharding = mesh_lib.batch_sharding(run.meshes.learner)
    draws, steps = [], []
    for step in range(repeats + 1):
        rng = np.random.default_rng([config.seed, step])
        start = time.perf_counter()
        batch = roles.buffer.sample(
            config.batch.prompts_per_batch, config.batch.samples_per_prompt, rng
        )
        drawn = time.perf_counter()
        roles.state, metrics = run.train_step(
            roles.state, train.device_batch(run, batch, batch_sharding)
        )
        jax.device_get(metrics)
        done = time.perf_counter()
        if step:  # step 0 compiles
            draws.append(drawn - start)
            steps.append(done - drawn)
    return {"batch_draw_seconds": median(draws), "learner_step_seconds": median(steps)}


def time_publish(roles: Roles, repeats: int) -> dict[str, float]:
    """Median seconds of `mesh.publish` of the learner's params onto the sampler's
    shardings, blocked until the copy is done (after an untimed first one)."""
    shardings = roles.run.sampler_shardings
    publish = lambda: jax.block_until_ready(mesh_lib.publish(roles.state.params, shardings))
    publish()
    return {"publish_seconds": median([seconds_of(publish) for _ in range(repeats)])}


# ------------------------------------------------------------------------------ profile


def config_figures(config: ml_collections.ConfigDict) -> dict:
    """The config's settings the sizing model reads (B, K, S, k, ...), under their keys'
    last names."""
    return {
        "prompts_per_batch": config.batch.prompts_per_batch,  # B
        "samples_per_prompt": config.batch.samples_per_prompt,  # K
        "samples_generated_per_prompt": config.batch.samples_generated_per_prompt,  # S
        "sync_period": config.sync_period,  # k
        "prompts_per_call": config.search.prompts_per_call,
        "num_searchers": config.search.num_searchers,
        "num_microbatches": config.batch.num_microbatches,
        "recency_prob": config.replay.recency_prob,  # m
        "replay_capacity": config.replay.capacity,
        "capacity_per_prompt": config.replay.capacity_per_prompt,
        "learner_steps": config.learner_steps,
        "max_prompt_len": config.max_prompt_len,
        "max_response_len": config.max_response_len,
    }


def device_figures(roles: Roles) -> dict:
    """The platform and the devices each role used (both all of them when colocated)."""
    meshes = roles.run.meshes
    device = jax.devices()[0]
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
        "sampler_devices": int(meshes.sampler.devices.size),
        "learner_devices": int(meshes.learner.devices.size),
        "colocated": meshes.colocated,
        "host_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }


def library_prints() -> contextlib.AbstractContextManager:
    """Where libraries' own prints go while the roles are built and measured (TFDS prints
    its dataset preparation on stdout): nowhere, or stderr with `-v`. Stdout keeps only
    the profile's JSON line."""
    if FLAGS[cli.VERBOSITY_FLAG].present:
        return contextlib.redirect_stdout(sys.stderr)
    return contextlib.redirect_stdout(io.StringIO())


def measure_profile(
    config: ml_collections.ConfigDict, config_name: str, workdir: str, repeats: int
) -> dict:
    """The profile of `config` on this machine's devices (see the module docstring)."""
    logging.info("Profiling %s: %d repetitions of each measurement.", config_name, repeats)
    with library_prints():
        roles = build_roles(config, workdir)
        try:
            search = time_search_calls(roles, repeats)
            learning = time_learner_steps(roles, repeats)
            publishing = time_publish(roles, repeats)
        finally:
            if roles.run.checkpointer is not None:
                roles.run.checkpointer.close()
    return {
        "format_version": PROFILE_FORMAT_VERSION,
        "config": config_name,
        "repeats": repeats,
        **config_figures(config),
        **device_figures(roles),
        **search,
        **learning,
        **publishing,
        "publish_share_of_step": publishing["publish_seconds"] / learning["learner_step_seconds"],
        "jax_version": jax.__version__,
        "python_version": platform.python_version(),
    }


def check_out_path(path: str) -> None:
    """UsageError when `--out` cannot be written: a folder, or a parent that cannot be made."""
    if os.path.isdir(path):
        raise cli.UsageError(f"--out={path} is a folder; pass a file name, e.g. profile.json.")
    problem = config_lib.output_dir_problem(os.path.dirname(os.path.abspath(path)))
    if problem:
        raise cli.UsageError(f"--out={path}: its folder {problem}; pass a file you can write.")


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.print_config:
        cli.print_config(FLAGS.config, FLAGS["config"].config_filename)
        return
    out = cli.required(FLAGS["out"])
    check_out_path(out)
    name = cli.flag_argument(sys.argv, "config") or FLAGS["config"].config_filename
    workdir = tempfile.mkdtemp(prefix="profile_roles_")
    try:
        profile = measure_profile(FLAGS.config, name, workdir, FLAGS.steps)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    write_json_atomically(out, profile)
    print(json.dumps(profile, sort_keys=True), flush=True)


if __name__ == "__main__":
    define_flags()
    cli.run(main, user_errors=USER_ERRORS)
