r"""Whether a config's programs fit a TPU slice, checked without one: its learner step and
its search call compiled for the slice (JAX's deviceless TPU compilation through
`libtpu`), split over the slice's chips as the run would split them, with XLA's memory
plan per chip beside the chip's HBM.

    pip install "jax[tpu]==$(python -c 'import jax; print(jax.__version__)')"  # no TPU needed
    python benchmarks/tpu_plan.py --config=configs/gsm8k_rho1b.py --slice=v5e-4 \
        --config.model.vocab_size=32000 --config.model.attention=splash \
        --config.model.scan_layers=True \
        --config.model.remat=dots_with_no_batch_dims_saveable --config.mesh.colocate=True

The chips are split between the roles as a run splits its devices (`mesh.sampler_devices`,
`mesh.colocate`; `mesh.make_role_meshes`), each role's mesh shaped by
`mesh.<role>_axes` and its params split by `mesh.<role>_rules`:

- the learner step: the config's method on B × K rows of `max_prompt_len` +
  `max_response_len` tokens in `batch.num_microbatches`, float32 (`model.param_dtype`)
  params and Adam state; the step a run compiles (`train.make_learner`, `train.batch_spec`).
- a search call: `generate` on `config_lib.samples_per_search_call` rows (padded to the
  sampler mesh's row shards, as a run pads them) with the weights in the compute dtype, as
  a publish leaves them. π_ref's params, which the sampler's chips hold beside them for
  scoring (in `model.param_dtype`), are counted apart (`reference_bytes`); the scoring
  pass and the task's reward are not compiled, and the task's role models (reward
  models, a red-team victim and judge) are not counted. One searcher: each more searcher
  thread keeps its own KV cache.

Each prints XLA's plan for one chip: arguments (params, state, inputs), scratch and new
outputs (bytes), and their sum `device_gib`; `chip_gib` adds π_ref to a search call's, and
`fits` compares it with the chip's HBM. `pallas_kernels` counts the Pallas TPU kernels
(splash attention, `tpu_custom_call`) the program runs. Colocated roles share chips, and
an async run's searcher decodes while the learner steps, so `colocated_gib` is the two
`chip_gib`s together. One JSON line per program, then one with both.

Each program compiles in a child process of its own (`--isolate`, the default): libtpu's
compiler ends the process on some meshes (JAX 0.10.2, libtpu 0.0.42: a 6-chip search mesh
of a v5e-8, the GSM8K config's `mesh.sampler_devices=0.7`, aborted with a RET_CHECK,
"total_device_count % num_participants_per_group == 0"). Such a program is reported
`compiled: false` with the compiler's fatal line, and the plan goes on.

The policy is a random one of the config's shape: `model.hf_path`'s config.json, or
`model.preset` with `model.vocab_size` rows (nothing is loaded). Another TPU generation
or size: `--slice` (`SLICES`: slices of one host). `--slice=local` plans for this
process's own devices (e.g. fake CPU devices:
`XLA_FLAGS=--xla_force_host_platform_device_count=4`), without an HBM figure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import NamedTuple

import jax
import ml_collections
import numpy as np
from absl import flags
from ml_collections import config_flags

from tba_jax import cli, config_lib, hlo_traffic, learner, runs, sources, train
from tba_jax import mesh as mesh_lib
from tba_jax.models import abstract_model
from tba_jax.sampling.generate import make_generate_fn


class Slice(NamedTuple):
    topology: str  # jax.experimental.topologies' name for it
    accelerator_type: str  # Cloud TPU's name, which libtpu asks a TPU VM for
    hbm_gib: float  # per chip (Cloud TPU's system architecture pages)
    chips_per_host: tuple[int, int, int]  # the host's chips, as the topology's bounds


# Slices of one host: a run over several hosts splits each host's chips between the roles
# (`topology.py`), which this plan's one split of all the chips does not model. libtpu
# takes a "2x4" topology for two hosts of 2x2 chips unless told the host's bounds; a v5e-8
# or v6e-8 is one host of 8 chips (until 2026-11-28 the plans modelled two).
SLICES = {
    "v5e-4": Slice("v5e:2x2", "v5litepod-4", 16, (2, 2, 1)),
    "v5e-8": Slice("v5e:2x4", "v5litepod-8", 16, (2, 4, 1)),
    "v5p-8": Slice("v5p:2x2x1", "v5p-8", 95, (2, 2, 1)),
    "v6e-4": Slice("v6e:2x2", "v6e-4", 32, (2, 2, 1)),
    "v6e-8": Slice("v6e:2x4", "v6e-8", 32, (2, 4, 1)),
}
LIBTPU_HINT = (
    "compiling for a TPU slice without one needs libtpu at JAX's version: "
    'pip install "jax[tpu]=={version}" (no TPU needed)'
)
PROGRAMS = ("learner", "search")
OUT_OF_MEMORY = "RESOURCE_EXHAUSTED"  # XLA's status when a program's plan exceeds the HBM

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags, defined only when run as a script (tba_jax.cli's rule)."""
    config_flags.DEFINE_config_file("config", None, "Config file (path[:variant]).")
    flags.DEFINE_enum("slice", "v5e-4", [*SLICES, "local"], "The TPU slice to plan for.")
    flags.DEFINE_list("programs", list(PROGRAMS), "Which programs: learner, search.")
    flags.DEFINE_boolean(
        "isolate",
        True,
        "Compile each program in a child process, so a compiler that ends its process is "
        "reported (compiled: false) instead of ending the plan.",
    )
    flags.mark_flag_as_required("config")
    flags.adopt_module_key_flags(cli)


def slice_devices(name: str) -> list:
    """The slice's devices: compile-only TPU devices, or this process's own (`local`)."""
    if name == "local":
        return jax.devices()
    from jax.experimental import topologies

    # what libtpu would ask a TPU VM's metadata for (without them it logs an error for each)
    chosen = SLICES[name]
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", chosen.accelerator_type)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    try:
        description = topologies.get_topology_desc(
            chosen.topology, "tpu", chips_per_host_bounds=chosen.chips_per_host
        )
    except Exception as error:  # libtpu missing or too old: one line that says what to install
        hint = LIBTPU_HINT.format(version=jax.__version__)
        raise cli.UsageError(f"{hint} ({cli.one_line(str(error))})") from error
    return list(description.devices)


def policy_model(config: ml_collections.ConfigDict):
    """The config's policy, abstract: `model.hf_path`'s shape or the preset's."""
    if not config.model.hf_path and not config.model.get("vocab_size", 0):
        raise cli.UsageError(
            "a plan needs the policy's vocabulary size: --config.model.vocab_size=N (the "
            "checkpoint's embedding rows), or --config.model.hf_path=<folder with config.json>"
        )
    return abstract_model(runs.model_config(config, vocab_size=0))


def param_count(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def compile_learner(config, model, abstract, mesh) -> tuple:
    """The run's learner step on `mesh`, compiled for its devices."""
    shardings = mesh_lib.param_shardings(
        model.logical_axes, abstract, mesh, config.mesh.learner_rules
    )
    parts = train.make_learner(config, model, abstract, shardings, mesh)
    if parts.critic is not None:
        raise cli.UsageError(
            "a plan of PPO's learner (its critic) is not built; use --programs=search"
        )
    state = learner.abstract_train_state(parts.optimizer, abstract, parts.state_sharding)
    batch = train.batch_spec(config, mesh_lib.batch_sharding(mesh))
    if batch is None:
        raise cli.UsageError(f"the {config.method} step reads fields made after sampling")
    rows = config.batch.prompts_per_batch * config.batch.samples_per_prompt
    lowered = parts.train_step.trace(state, batch).lower(lowering_platforms=platforms(mesh))
    shape = {"rows": rows, "microbatches": config.batch.num_microbatches}
    return lowered.compile(), shape


def compile_search(config, model, abstract, mesh) -> tuple:
    """`generate` of one search call on `mesh`, the weights in the compute dtype; and
    π_ref's params beside them, held as the run holds them (`model.param_dtype`, split by
    the sampler's rules)."""
    compute = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, model.config.compute_dtype), abstract
    )
    rules = config.mesh.sampler_rules
    shardings = mesh_lib.param_shardings(model.logical_axes, compute, mesh, rules)
    shards = mesh_lib.row_shards(mesh)
    rows = -(-config_lib.samples_per_search_call(config) // shards) * shards
    sampling = sources.sampling_config(config, model.config.vocab_size)
    generate = make_generate_fn(model, sampling, eos_id=1, pad_id=0)
    row_sharding = mesh_lib.batch_sharding(mesh)
    prompts = (rows, config.max_prompt_len)
    key = jax.eval_shape(lambda: jax.random.key(0))
    lowered = generate.trace(
        mesh_lib.abstract_on(compute, shardings),
        jax.ShapeDtypeStruct(prompts, np.int32, sharding=row_sharding),
        jax.ShapeDtypeStruct(prompts, np.bool_, sharding=row_sharding),
        jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=mesh_lib.replicated(mesh)),
    ).lower(lowering_platforms=platforms(mesh))
    reference = mesh_lib.abstract_on(
        abstract, mesh_lib.param_shardings(model.logical_axes, abstract, mesh, rules)
    )
    shape = {
        "rows": rows,
        "new_tokens": sampling.max_new_tokens,
        "reference_bytes": bytes_per_device(reference),
    }
    return lowered.compile(), shape


def bytes_per_device(tree) -> int:
    """What one device holds of `tree`'s abstract arrays (each split by its sharding)."""
    return sum(
        int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(tree)
    )


def platforms(mesh) -> tuple[str, ...]:
    return (mesh.devices.flat[0].platform,)


def plan(program: str, compile_program, config, model, abstract, mesh, hbm_gib) -> dict:
    """One program's figures (see the module's docstring). A program XLA refuses to
    compile for want of HBM does not fit: `fits` false and XLA's message."""
    began = time.time()
    figures = mesh_figures(program, mesh, config)
    try:
        compiled, shape = compile_program(config, model, abstract, mesh)
    except jax.errors.JaxRuntimeError as error:
        if OUT_OF_MEMORY not in str(error):
            raise
        return {**figures, "fits": False, "compile_error": cli.one_line(str(error))}
    figures.update(
        **shape,
        **hlo_traffic.memory_plan(compiled),
        pallas_kernels=compiled.as_text().count('custom_call_target="tpu_custom_call"'),
        compile_s=round(time.time() - began, 1),
    )
    # the chip's whole need: the program's plan, and π_ref beside a search call
    needed = sum(figures[part] for part in hlo_traffic.MEMORY_PLAN_PARTS)
    needed += figures.get("reference_bytes", 0)
    figures["chip_gib"] = round(needed / 2**30, 2)
    figures["fits"] = None if hbm_gib is None else figures["chip_gib"] <= hbm_gib
    return figures


def mesh_figures(program: str, mesh, config) -> dict:
    """The fields every program's line starts with."""
    return {
        "plan": program,
        "mesh": {axis: size for axis, size in mesh.shape.items() if size > 1} or {"devices": 1},
        "tokens": config.max_prompt_len + config.max_response_len,
    }


def child_command(program: str) -> list[str]:
    """This command again for one program, compiled in this process (the later flags
    override the earlier)."""
    return [sys.executable, sys.argv[0], *sys.argv[1:], f"--programs={program}", "--noisolate"]


def child_env() -> dict[str, str]:
    """This process's environment, with libtpu allowed in the child while this process
    holds it too (libtpu otherwise refuses a second process: its lockfile)."""
    return {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def child_result(program: str, done: subprocess.CompletedProcess, figures: dict) -> dict:
    """A child's line for `program`; where the child ended without one (a compiler that
    ended its process), `figures` with `compiled` false, how it ended and why
    (`cli.how_a_child_ended`). A child that refused the plan with a user's error (one
    `error: ...` line, status 1: a method whose step is not planned) is this plan's
    error, as it would be compiled in this process (`cli.UsageError`)."""
    for line in done.stdout.splitlines():
        if line.startswith("{") and json.loads(line).get("plan") == program:
            return json.loads(line)
    refusal = cli.child_user_error(done.returncode, done.stderr)
    if refusal is not None:
        raise cli.UsageError(refusal)
    ended, why = cli.how_a_child_ended(done.returncode, done.stderr)
    return {**figures, "compiled": False, "ended": ended, "compile_error": why}


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.slice != "local":
        # A compile-only slice needs no accelerator backend: keep JAX from looking for one.
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        jax.config.update("jax_platforms", "cpu")
    config = FLAGS.config
    config_lib.check_config_kind(config)
    unknown = set(FLAGS.programs) - set(PROGRAMS)
    if unknown:
        raise cli.UsageError(f"--programs takes {', '.join(PROGRAMS)}, not {sorted(unknown)}")
    config_lib.check_attention(config, backend="tpu" if FLAGS.slice != "local" else None)
    devices = slice_devices(FLAGS.slice)
    hbm_gib = None if FLAGS.slice == "local" else SLICES[FLAGS.slice].hbm_gib
    model, abstract = policy_model(config)
    meshes = mesh_lib.make_role_meshes(
        config.mesh.sampler_devices,
        config.mesh.colocate,
        config.mesh.sampler_axes,
        config.mesh.learner_axes,
        devices=devices,
    )
    hosts = len({device.process_index for device in devices})
    print(
        f"{FLAGS.slice}: {len(devices)} {devices[0].device_kind} chips on {hosts} "
        + ("host" if hosts == 1 else "hosts")
        + (f", {hbm_gib:g} GiB each" if hbm_gib else "")
        + f"; JAX {jax.__version__}; {param_count(model.config.num_params())} params",
        flush=True,
    )
    compilers = {
        "learner": (compile_learner, meshes.learner),
        "search": (compile_search, meshes.sampler),
    }
    results = []
    for program in FLAGS.programs:
        compile_program, mesh = compilers[program]
        if FLAGS.isolate:
            done = subprocess.run(
                child_command(program), capture_output=True, text=True, env=child_env()
            )
            figures = child_result(program, done, mesh_figures(program, mesh, config))
        else:
            figures = plan(program, compile_program, config, model, abstract, mesh, hbm_gib)
        results.append(figures)
        print(json.dumps(figures), flush=True)
    summary = {
        "bench": "tpu_plan",
        "slice": FLAGS.slice,
        "chips": len(devices),
        "hosts": hosts,
        "plans": results,
    }
    if meshes.colocated and len(results) == 2 and all("chip_gib" in r for r in results):
        learner_plan, search_plan = results
        summary["colocated_gib"] = round(learner_plan["chip_gib"] + search_plan["chip_gib"], 2)
        summary["colocated_fits"] = None if hbm_gib is None else summary["colocated_gib"] <= hbm_gib
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
