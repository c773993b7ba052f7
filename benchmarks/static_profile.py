r"""What a compiled decode step or learner step moves and computes, against what the
hardware allows: a static profile made from the optimized program, without running it.

    python benchmarks/static_profile.py                          # this machine's backend
    python benchmarks/static_profile.py --target=h100            # an H100 program, no GPU
    python benchmarks/static_profile.py --target=h100 --program=train --attention=cudnn
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python benchmarks/static_profile.py \
        --target=h100 --program=reward_model --shape=pythia-2.8b --microbatches=8

`--target=h100` (or `h200`) compiles for an H100 (H200) without one (XLA's deviceless GPU
compilation, from `benchmarks/targets/h100_sxm.txtpb`, `h200_sxm.txtpb`); it needs JAX's
CUDA plugin at the installed JAX's version (`pip install jax-cuda12-plugin==<jax
version>`, about 180 MB), from JAX 0.11 on CUDA's libdevice (`pip install
nvidia-cuda-nvcc-cu12`), and no GPU; Pallas' GPU kernels lower for the target too.
`--hbm_tb_s` and `--peak_tflops` default to the target device's datasheet figures
(`roofline.device_peaks`). XLA does not autotune its matmuls there, so their tiling
(split-K partial sums included) is the compiler's default, which a GPU's autotuner may
change.

Random-weight shapes of a preset (`--shape`), as `benchmarks/gpu_throughput.py` measures
them. The program is read with `tba_jax.hlo_traffic`: per kernel, the bytes it reads and
writes in device memory and its matmul FLOPs; a kernel's roofline time is the longer of
its bytes at `--hbm_tb_s` and its FLOPs at `--peak_tflops`.

Decode and scoring take params in `--param_dtype` (default: the compute dtype, `--dtype`);
a run's searchers and π_ref hold the learner's float32 params, which `--param_dtype=float32`
profiles (a decode loop casts the weights once, before it: `Model.for_decoding`).

- `--program=decode`: `generate` on `--batch` rows of `--prompt` + `--new` tokens. One
  decode step's bytes (the mean over the response's steps, segment by segment with
  `--decode_segments`) against `roofline.decode_step_bytes`: `static_step_bytes`,
  `roofline_step_bytes`, `static_over_roofline`, and `static_ceiling_percent`, the share of
  the memory roofline a decode moving these bytes at full bandwidth reaches. The program
  gives the decode-attention kernel (`--decode_attention=pallas`) the whole cache, and it
  reads each row's only up to its last visible slot: its cache and mask are counted at
  each step's length (XLA's attention reads them whole):
  `attention_read_share`, the share of them it reads over the response's steps (1 where
  the program has no such kernel: XLA's attention, or Pallas' interpreter on a CPU).
- `--program=slot_decode`: one step of the slot engine's decode chunk
  (`sampling.engine.decode_program`) over `--batch` slots of `--prompt` + `--new` cache
  positions, against the same roofline: the same figures, its one loop's step.
- `--program=score`: π_ref scoring (one forward pass and the log-probs) of `--batch`
  rows: its bytes, matmul FLOPs, roofline time, the tokens/s
  that allows (`roofline_tokens_per_s`) and its MFU ceiling against the forward FLOPs
  (`roofline.forward_flops_per_token`).
- `--program=train`: one TB learner step on `--train_prompts` × `--train_k` sequences of
  prompt + new tokens in `--microbatches`, float32 params and Adam state, the execution
  knobs `--scan_layers`, `--remat`, `--attention`, `--logprob_chunk`. The step's bytes
  (`bytes`), its matmul FLOPs (`matmul_flops`), the model FLOPs MFU counts
  (`roofline.train_flops_per_token`), the sum of its kernels' roofline times
  (`roofline_seconds`) and `mfu_ceiling_percent`: the MFU of a step whose every kernel
  ran at its roofline (cuDNN's attention kernel is counted by its bytes only).
- `--program=reward_model`: one step of `experiments/train_reward_model.py` (the
  Bradley–Terry loss, `train_reward_model.make_train_step`): the shape with a scalar score
  head, `--pairs` preference pairs (2 rows each) of prompt + new tokens in
  `--microbatches`, float32 params and Adam state, `--remat` and `--attention`; the same
  figures as `train`. Its `device_gib` says whether a reward model trains on one device
  (e.g. pythia-2.8b at the TL;DR lengths, 512 + 54). At such row counts XLA's default
  Triton matmuls may fail to compile for the H100 target ("Couldn't find output tile
  sizes"); `XLA_FLAGS=--xla_gpu_enable_triton_gemm=false` uses cuBLAS's.

Each prints the largest kernels (grouped by kind and output shape), and one JSON object as
the last line, with `by_kind`, `largest` and XLA's memory plan: `argument_bytes` (params,
state, inputs), `temp_bytes` (scratch), `new_output_bytes` (outputs that reuse no donated
argument) and their sum, `device_gib`, what the program needs on the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from tba_jax import cli, hlo_traffic, learner, roofline, train_reward_model
from tba_jax import mesh as mesh_lib
from tba_jax.models import abstract_model, decode_attention, preset
from tba_jax.models.config import ATTENTIONS, REMAT_POLICIES
from tba_jax.sampling import engine
from tba_jax.sampling.generate import SamplingConfig, make_generate_fn
from tba_jax.sampling.scoring import make_score_fn

TEMPERATURE = 0.7
BETA = 0.05  # the TB loss's β, held constant
LEARNING_RATE = 1e-6
LEARNER_PROGRAMS = ("train", "reward_model")  # float32 params and Adam state
TARGET_DIR = Path(__file__).resolve().parent / "targets"
TARGETS = {"h100": TARGET_DIR / "h100_sxm.txtpb", "h200": TARGET_DIR / "h200_sxm.txtpb"}
PLUGIN_HINT = (
    "compiling for {target} without its GPU needs JAX's CUDA plugin at JAX's version: "
    "pip install jax-cuda12-plugin=={version} (no GPU needed)"
)
# JAX's CUDA plugin loaded as a backend on a machine without a GPU fails to start, and then
# offers no compile-only topology either
BACKEND_HINT = (
    "compiling for {target} without its GPU needs JAX's backends kept to the CPU: JAX's "
    "CUDA plugin is installed, and JAX started it as a backend (jax_platforms={platforms!r}), "
    "which fails without a GPU; set JAX_PLATFORMS=cpu (or "
    "jax.config.update('jax_platforms', 'cpu')) before JAX's first use, as this script does"
)
LIBDEVICE = Path("nvvm", "libdevice", "libdevice.10.bc")  # under a CUDA root
LIBDEVICE_SINCE = (0, 11)  # the first JAX whose compile-only GPU programs link it
LIBDEVICE_HINT = (
    "compiling for {target} with JAX {version} needs CUDA's libdevice, which XLA finds "
    "in $CUDA_ROOT or in the nvidia-cuda-nvcc-cu12 package (without it XLA crashes): "
    "pip install nvidia-cuda-nvcc-cu12, beside jax-cuda12-plugin=={version}"
)

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags, defined only when run as a script (tba_jax.cli's rule)."""
    flags.DEFINE_enum(
        "program",
        "decode",
        ["decode", "slot_decode", "score", "train", "reward_model"],
        "Program to profile.",
    )
    flags.DEFINE_enum("target", "local", ["local", *TARGETS], "Device to compile for.")
    flags.DEFINE_string("shape", "qwen2.5-0.5b", "Model preset.")
    flags.DEFINE_integer("batch", 256, "Decode: rows decoded at once.", lower_bound=1)
    flags.DEFINE_integer("prompt", 256, "Prompt tokens per row.", lower_bound=1)
    flags.DEFINE_integer("new", 256, "New (response) tokens per row.", lower_bound=1)
    flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Compute dtype.")
    flags.DEFINE_enum(
        "param_dtype",
        None,
        ["bfloat16", "float32"],
        "Decode and score: the params' dtype (unset: --dtype; a run's searchers and π_ref hold "
        "float32 params, which a decode loop casts once to --dtype).",
    )
    flags.DEFINE_integer("layers", None, "The preset's depth if unset.", lower_bound=1)
    flags.DEFINE_integer("vocab", None, "For presets without a vocabulary size.", lower_bound=2)
    flags.DEFINE_bool("scan_layers", False, "model.scan_layers.")
    flags.DEFINE_bool("scan_decode", False, "model.scan_decode (and scan_layers).")
    flags.DEFINE_integer("decode_segments", 1, "sampling.decode_segments.", lower_bound=1)
    flags.DEFINE_integer("train_prompts", 8, "Train: B.", lower_bound=1)
    flags.DEFINE_integer("train_k", 20, "Train: K samples per prompt.", lower_bound=1)
    flags.DEFINE_integer("microbatches", 8, "Train and reward_model: micro-batches.", lower_bound=1)
    flags.DEFINE_integer(
        "pairs", 64, "reward_model: preference pairs a step (2 rows each).", lower_bound=1
    )
    flags.DEFINE_enum("remat", "none", list(REMAT_POLICIES), "model.remat.")
    flags.DEFINE_enum("attention", "einsum", list(ATTENTIONS), "model.attention.")
    cli.define_decode_kernel_flags()
    flags.DEFINE_integer("logprob_chunk", 0, "model.logprob_chunk.", lower_bound=0)
    flags.DEFINE_float("hbm_tb_s", None, "HBM TB/s (unset: the target device's).")
    flags.DEFINE_float("peak_tflops", None, "Dense bf16 TFLOP/s (unset: the target device's).")
    flags.DEFINE_integer("top", 12, "Largest kernel groups to list.", lower_bound=0)
    flags.adopt_module_key_flags(cli)


def target_device(target: str) -> jax.Device:
    """The device to compile for: this process's first, or a compile-only GPU."""
    if target == "local":
        return jax.devices()[0]
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            target, "cuda", target_config=TARGETS[target].read_text(), topology="1x1x1"
        )
    except (NotImplementedError, RuntimeError) as error:
        platforms = jax.config.jax_platforms
        if cuda_plugin_installed() and platforms != "cpu":
            hint = BACKEND_HINT.format(target=target, platforms=platforms)
        else:
            hint = PLUGIN_HINT.format(target=target, version=jax.__version__)
        raise cli.UsageError(f"{hint} ({cli.one_line(str(error))})") from error
    if jax.__version_info__ >= LIBDEVICE_SINCE and not cuda_roots_with_libdevice():
        raise cli.UsageError(LIBDEVICE_HINT.format(target=target, version=jax.__version__))
    return topology.devices[0]


def cuda_plugin_installed() -> bool:
    """Whether a JAX CUDA plugin (jax-cuda12-plugin or jax-cuda13-plugin) is importable."""
    if importlib.util.find_spec("jax_plugins") is None:
        return False
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))


def cuda_roots_with_libdevice() -> list[Path]:
    """The CUDA roots JAX hands XLA (`$CUDA_ROOT`, the nvidia-cuda-nvcc package) that hold
    libdevice."""
    roots = [os.environ["CUDA_ROOT"]] if os.environ.get("CUDA_ROOT") else []
    for module in ("nvidia.cu13", "nvidia.cuda_nvcc"):
        try:
            roots.extend(importlib.import_module(module).__path__)
        except ImportError:
            continue
    return [Path(root) for root in roots if (Path(root) / LIBDEVICE).is_file()]


def compiling_for(device: jax.Device):
    """A context in which Pallas' GPU kernels lower for `device`, a compile-only GPU on a
    machine whose default device is the CPU (since JAX 0.11 Pallas asks the abstract mesh
    for the GPU it targets): a one-device abstract mesh over `device`. Nothing for one of
    this process's own devices (`--target=local`)."""
    if device in jax.devices():
        return contextlib.nullcontext()
    mesh = jax.sharding.Mesh(np.array([device]), ("target",))
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def device_peaks(device: jax.Device) -> tuple[float, float]:
    """(HBM bytes/s, dense bf16 FLOP/s): --hbm_tb_s and --peak_tflops, or where unset the
    device's datasheet figures (`roofline.peaks_for`)."""
    peaks = roofline.peaks_for(device.device_kind, FLAGS.hbm_tb_s, FLAGS.peak_tflops)
    return peaks.hbm_bytes_per_s, peaks.dense_bf16_flops


def check_model() -> None:
    """UsageError, before anything is compiled, for a --shape that is no preset or has no
    vocabulary size without --vocab, for knobs the model refuses (e.g. cuDNN's attention
    in float32), and for cuDNN's attention on this machine's backend without a GPU."""
    cli.check_preset_flags(FLAGS.shape, FLAGS.vocab)
    try:
        model_config(FLAGS.dtype)
    except ValueError as error:
        raise cli.UsageError(str(error)) from error
    if FLAGS.attention == "cudnn" and FLAGS.target == "local":
        cli.check_cudnn_backend(
            "--attention=cudnn", "pass --target=h100 to compile for one, or another --attention."
        )


def lowering_platforms() -> tuple[str, ...] | None:
    return ("cuda",) if FLAGS.target in TARGETS else None


def model_config(param_dtype: str):
    sizes = dict(max_seq_len=FLAGS.prompt + FLAGS.new, vocab_size=FLAGS.vocab)
    if FLAGS.layers:
        sizes["num_layers"] = FLAGS.layers
    return preset(
        FLAGS.shape,
        dtype=FLAGS.dtype,
        param_dtype=param_dtype,
        **cli.execution_flags(lambda name: FLAGS[name].value),
        **sizes,
    )


def inference_param_dtype() -> str:
    """The params' dtype of decode and scoring: --param_dtype, else the compute dtype."""
    return FLAGS.param_dtype or FLAGS.dtype


def on_device(device: jax.Device, shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))


def compile_decode(device: jax.Device):
    """generate() compiled for `device` on abstract params and prompts."""
    decoder = model_config(inference_param_dtype())
    model, abstract = abstract_model(decoder)
    params = jax.tree.map(lambda leaf: on_device(device, leaf.shape, leaf.dtype), abstract)
    vocab = decoder.vocab_size
    sampling = SamplingConfig(
        max_new_tokens=FLAGS.new,
        temperature=TEMPERATURE,
        vocab_limit=vocab - 1,  # EOS (the last id) is never drawn: every row runs --new steps
        decode_segments=FLAGS.decode_segments,
    )
    generate = make_generate_fn(model, sampling, eos_id=vocab - 1, pad_id=0)
    rows = (FLAGS.batch, FLAGS.prompt)
    lowered = generate.trace(
        params,
        on_device(device, rows, jnp.int32),
        on_device(device, rows, jnp.bool_),
        on_device(device, (), jax.random.key(0).dtype),
    ).lower(lowering_platforms=lowering_platforms())
    return lowered.compile(), decoder, sampling


def compile_slot_decode(device: jax.Device):
    """The slot engine's decode chunk (`engine.decode_program`) compiled for `device` on
    abstract params and --batch slots of --prompt + --new cache positions."""
    decoder = model_config(inference_param_dtype())
    model, abstract = abstract_model(decoder)
    params = jax.tree.map(lambda leaf: on_device(device, leaf.shape, leaf.dtype), abstract)
    vocab = decoder.vocab_size
    sampling = SamplingConfig(max_new_tokens=FLAGS.new, temperature=TEMPERATURE)
    decode = engine.decode_program(model, sampling, eos_id=vocab - 1, pad_id=0)
    slots = jax.eval_shape(lambda: engine.init_slots(model, FLAGS.batch, FLAGS.prompt, FLAGS.new))
    slots = jax.tree.map(lambda leaf: on_device(device, leaf.shape, leaf.dtype), slots)
    count = on_device(device, (), jnp.int32)
    lowered = decode.trace(
        params, slots, on_device(device, (), jax.random.key(0).dtype), count, count, count, count
    ).lower(lowering_platforms=lowering_platforms())
    return lowered.compile(), decoder


def compile_score(device: jax.Device):
    """π_ref scoring (`make_score_fn`) of --batch rows compiled for `device`."""
    scorer = model_config(inference_param_dtype())
    model, abstract = abstract_model(scorer)
    params = jax.tree.map(lambda leaf: on_device(device, leaf.shape, leaf.dtype), abstract)
    score = make_score_fn(model, temperature=TEMPERATURE)
    prompts, responses = (FLAGS.batch, FLAGS.prompt), (FLAGS.batch, FLAGS.new)
    lowered = score.trace(
        params,
        on_device(device, prompts, jnp.int32),
        on_device(device, prompts, jnp.bool_),
        on_device(device, responses, jnp.int32),
        on_device(device, responses, jnp.float32),
    ).lower(lowering_platforms=lowering_platforms())
    return lowered.compile(), scorer


def abstract_learner(cfg, device: jax.Device):
    """(model, optimizer, train state, its shardings, mesh): float32 params and Adam state
    of `cfg` on a one-device mesh over `device`, abstract (nothing allocated)."""
    model, abstract = abstract_model(cfg)
    optimizer = learner.make_optimizer(learner.OptimConfig(learning_rate=LEARNING_RATE))
    state_sharding, mesh = learner.one_device_shardings(model, abstract, optimizer, device)
    state = learner.abstract_train_state(optimizer, abstract, state_sharding)
    return model, optimizer, state, state_sharding, mesh


def abstract_batch(shapes: dict, mesh: jax.sharding.Mesh) -> dict:
    """{name: (shape, dtype)} as abstract arrays with the learner's batch sharding."""
    batch_sharding = mesh_lib.batch_sharding(mesh)
    return {
        name: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding)
        for name, (shape, dtype) in shapes.items()
    }


def compile_train_step(device: jax.Device):
    """A TB learner step compiled for `device` on an abstract train state and batch."""
    mixed = model_config("float32")
    model, optimizer, state, state_sharding, mesh = abstract_learner(mixed, device)
    step = learner.constant_beta_tb_step(
        model,
        optimizer,
        state_sharding,
        mesh,
        beta=BETA,
        samples_per_prompt=FLAGS.train_k,
        num_microbatches=FLAGS.microbatches,
        temperature=TEMPERATURE,
    )
    rows = FLAGS.train_prompts * FLAGS.train_k
    batch = abstract_batch(
        {
            "prompt_tokens": ((rows, FLAGS.prompt), np.int32),
            "prompt_mask": ((rows, FLAGS.prompt), np.bool_),
            "response_tokens": ((rows, FLAGS.new), np.int32),
            "response_mask": ((rows, FLAGS.new), np.float32),
            "reward": ((rows,), np.float32),
            "logp_ref": ((rows,), np.float32),
            "logp_behaviour": ((rows,), np.float32),
        },
        mesh,
    )
    lowered = step.trace(state, batch).lower(lowering_platforms=lowering_platforms())
    return lowered.compile(), mixed, rows


def compile_reward_model_step(device: jax.Device):
    """A reward-model (Bradley–Terry) step compiled for `device` on an abstract train state
    and `--pairs` pairs of prompt + new tokens."""
    scorer = train_reward_model.scalar_score_config(model_config("float32"))
    model, optimizer, state, state_sharding, mesh = abstract_learner(scorer, device)
    step = train_reward_model.make_train_step(
        model,
        optimizer,
        num_microbatches=FLAGS.microbatches,
        state_sharding=state_sharding,
        mesh=mesh,
    )
    shape = (FLAGS.pairs, FLAGS.prompt + FLAGS.new)
    batch = abstract_batch(
        {
            name: (shape, np.bool_ if name.endswith("mask") else np.int32)
            for name in train_reward_model.PAIR_ARRAYS
        },
        mesh,
    )
    lowered = step.trace(state, batch).lower(lowering_platforms=lowering_platforms())
    return lowered.compile(), scorer


def readable(size: float, units=(("GB", 1e9), ("MB", 1e6), ("kB", 1e3)), base: str = "B") -> str:
    """A size in the largest decimal unit that keeps the figure at 1 or more."""
    for unit, scale in units:
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size:.0f} {base}"


def print_kernels(loop: hlo_traffic.Loop, title: str) -> list[hlo_traffic.AccessGroup]:
    """The loop's bytes by kind and its largest kernel groups, on the console."""
    print(title)
    for kind, moved in hlo_traffic.bytes_by_kind(loop).items():
        print(f"  {readable(moved):>10s}  {kind}")
    largest = hlo_traffic.largest_groups(loop, FLAGS.top)
    for group in largest:
        print(f"  {readable(group.bytes):>10s}  {group.count:4d} × {group.kind:16s} {group.shape}")
    return largest


def segment_steps(sampling: SamplingConfig) -> list[range]:
    """The decode steps each of generate's loops runs when every row runs to the limit."""
    ends = sampling.segment_ends()
    return [range(start, end) for start, end in zip([0, *ends[:-1]], ends, strict=True)]


def attention_read_share(steps: range) -> float:
    """The share of its cache (and mask) the decode-attention kernel reads, on average over
    decode steps `steps`: at step t a row sees its --prompt slots and t + 1 more, and the
    kernel reads the slots up to the last of them (`decode_attention.slots_read`), where
    the program gives it the whole --prompt + --new slots."""
    cache_len = FLAGS.prompt + FLAGS.new
    read = sum(decode_attention.slots_read(FLAGS.prompt + t + 1, cache_len) for t in steps)
    return read / (len(steps) * cache_len)


def attention_at_length(loop: hlo_traffic.Loop, steps: range) -> hlo_traffic.Loop:
    """`loop` (decode steps `steps`) with the decode-attention kernel's cache and mask
    counted at `attention_read_share`; other kernels (XLA's attention among them, which
    reads the whole cache) are left as they are."""
    return hlo_traffic.with_operand_reads_scaled(
        loop,
        decode_attention.KERNEL_NAME,
        decode_attention.LENGTH_BOUNDED_OPERANDS,
        attention_read_share(steps),
    )


def has_attention_kernel(loop: hlo_traffic.Loop) -> bool:
    """Whether `loop` runs the decode-attention kernel (not XLA's attention, nor the
    kernel in Pallas' interpreter, which leaves XLA's own ops)."""
    return any(access.kernel == decode_attention.KERNEL_NAME for access, _ in loop.all_accesses())


def decode_step_figures(compiled, decoder, step_bytes: float, loop, title: str) -> dict:
    """A decode step's bytes (`step_bytes`; `loop`: the step whose kernels are listed,
    under `title`) against `roofline.decode_step_bytes` at the flags' shape."""
    dtype_bytes = jnp.dtype(FLAGS.dtype).itemsize
    shape = (decoder, FLAGS.batch, FLAGS.prompt, FLAGS.new, dtype_bytes, dtype_bytes)
    ideal = roofline.decode_step_bytes(*shape)
    largest = print_kernels(
        loop,
        f"{title}: {readable(step_bytes)} moved, roofline {readable(ideal)}; "
        f"{loop.kernels_per_iteration()} kernels a step:",
    )
    return {
        "batch": FLAGS.batch,
        "scan_decode": FLAGS.scan_decode,
        "attention_read_share": (
            round(attention_read_share(range(FLAGS.new)), 4) if has_attention_kernel(loop) else 1.0
        ),
        "static_step_bytes": round(step_bytes),
        "roofline_step_bytes": round(ideal),
        "static_over_roofline": round(step_bytes / ideal, 3),
        "static_ceiling_percent": round(100 * ideal / step_bytes, 1),
        "kernels_per_step": loop.kernels_per_iteration(),
        "by_kind": hlo_traffic.bytes_by_kind(loop),
        "largest": [dataclasses.asdict(group) for group in largest],
        **hlo_traffic.memory_plan(compiled),
    }


def decode_profile(device: jax.Device) -> dict:
    compiled, decoder, sampling = compile_decode(device)
    loops = hlo_traffic.loops_without_trip_count(hlo_traffic.program_traffic(compiled.as_text()))
    steps = segment_steps(sampling)
    if len(loops) != len(steps):
        raise RuntimeError(
            f"expected {len(steps)} decode loops in the compiled program, found {len(loops)}"
        )
    loops = [attention_at_length(loop, n) for loop, n in zip(loops, steps, strict=True)]
    moved = sum(loop.bytes_per_iteration() * len(n) for loop, n in zip(loops, steps, strict=True))
    last = loops[-1]  # the last segment attends over the whole cache: its kernels are listed
    title = f"decode step on {device.device_kind} (kernels: the last segment's)"
    return {
        "decode_segments": FLAGS.decode_segments,
        "segment_step_bytes": [loop.bytes_per_iteration() for loop in loops],
        **decode_step_figures(compiled, decoder, moved / FLAGS.new, last, title),
    }


def slot_decode_profile(device: jax.Device) -> dict:
    """One step of the slot engine's decode chunk against the same roofline as `generate`'s
    step (the weights and each row's cache at its mean length); like `generate` with one
    segment, every slot's cache row is --prompt + --new slots long, and the
    decode-attention kernel's reads are counted at the lengths of `generate`'s rows."""
    compiled, decoder = compile_slot_decode(device)
    loops = hlo_traffic.loops_without_trip_count(hlo_traffic.program_traffic(compiled.as_text()))
    if len(loops) != 1:
        raise RuntimeError(f"expected 1 decode loop in the compiled chunk, found {len(loops)}")
    loop = attention_at_length(loops[0], range(FLAGS.new))
    title = f"slot decode step on {device.device_kind}"
    return decode_step_figures(compiled, decoder, loop.bytes_per_iteration(), loop, title)


def kernel_profile(compiled, device: jax.Device, what: str, model_flops: float) -> dict:
    """Bytes, matmul FLOPs and roofline time of one run of a compiled program (scoring, a
    learner step), the MFU ceiling against `model_flops`, its largest kernels printed."""
    program = hlo_traffic.program_traffic(compiled.as_text())
    hbm, peak = device_peaks(device)
    seconds = program.seconds_at_least(hbm, peak)
    largest = print_kernels(
        program,
        f"{what} on {device.device_kind}: {readable(program.bytes_per_iteration())} "
        f"moved, {program.flops_per_iteration() / 1e12:.1f} TFLOP in matmuls, at least "
        f"{1e3 * seconds:.1f} ms; {program.kernels_per_iteration()} kernels:",
    )
    return {
        "bytes": program.bytes_per_iteration(),
        "matmul_flops": program.flops_per_iteration(),
        "model_flops": model_flops,
        "roofline_seconds": seconds,
        "mfu_ceiling_percent": round(100 * model_flops / seconds / peak, 1),
        "kernels": program.kernels_per_iteration(),
        "by_kind": hlo_traffic.bytes_by_kind(program),
        "seconds_by_kind": hlo_traffic.seconds_by_kind(program, hbm, peak),
        "largest": [dataclasses.asdict(group) for group in largest],
        **hlo_traffic.memory_plan(compiled),
    }


def score_profile(device: jax.Device) -> dict:
    compiled, scorer = compile_score(device)
    seq_len = FLAGS.prompt + FLAGS.new
    tokens = FLAGS.batch * seq_len
    model_flops = tokens * roofline.forward_flops_per_token(scorer, seq_len)
    profile = kernel_profile(compiled, device, "π_ref scoring", model_flops)
    return {
        "batch": FLAGS.batch,
        "attention": scorer.attention,
        "roofline_tokens_per_s": tokens / profile["roofline_seconds"],
        **profile,
    }


def train_profile(device: jax.Device) -> dict:
    compiled, mixed, rows = compile_train_step(device)
    seq_len = FLAGS.prompt + FLAGS.new
    model_flops = rows * seq_len * roofline.train_flops_per_token(mixed, seq_len)
    return {
        "sequences": rows,
        "seq_len": seq_len,
        "microbatches": FLAGS.microbatches,
        "scan_layers": mixed.scan_layers,
        "remat": mixed.remat,
        "attention": mixed.attention,
        "logprob_chunk": mixed.logprob_chunk,
        **kernel_profile(compiled, device, "learner step", model_flops),
    }


def reward_model_profile(device: jax.Device) -> dict:
    compiled, scorer = compile_reward_model_step(device)
    seq_len = FLAGS.prompt + FLAGS.new
    rows = 2 * FLAGS.pairs
    model_flops = rows * seq_len * roofline.train_flops_per_token(scorer, seq_len)
    return {
        "pairs": FLAGS.pairs,
        "seq_len": seq_len,
        "microbatches": FLAGS.microbatches,
        "remat": scorer.remat,
        "attention": scorer.attention,
        **kernel_profile(compiled, device, "reward-model step", model_flops),
    }


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.target != "local":
        # A compile-only target needs no accelerator backend: keep JAX from looking for one.
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        jax.config.update("jax_platforms", "cpu")
    check_model()
    device = target_device(FLAGS.target)
    profile = {
        "decode": decode_profile,
        "slot_decode": slot_decode_profile,
        "score": score_profile,
        "train": train_profile,
        "reward_model": reward_model_profile,
    }[FLAGS.program]
    line = {
        "benchmark": "static_profile",
        "program": FLAGS.program,
        "target": FLAGS.target,
        "device_kind": device.device_kind,
        "shape": FLAGS.shape,
        "dtype": FLAGS.dtype,
        "param_dtype": "float32" if FLAGS.program in LEARNER_PROGRAMS else inference_param_dtype(),
        "prompt": FLAGS.prompt,
        "new": FLAGS.new,
    }
    with compiling_for(device):
        line.update(profile(device))
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
