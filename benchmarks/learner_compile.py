r"""The TB learner step's compile time, step time and memory against the model's execution
knobs (`ModelConfig.scan_layers`, `remat`, `attention`, `logprob_chunk`).

    python benchmarks/learner_compile.py                  # every sweep, CPU-sized
    python benchmarks/learner_compile.py --sweeps=depth --layers=2,4,8,16,32
    python benchmarks/learner_compile.py --smoke          # seconds: it runs, no more

Each case is `learner.make_train_step` with the TB loss (one optimiser step on a batch of
`--rows` random responses of `--response_len` tokens after `--prompt_len`-token prompts,
K = `--samples_per_prompt`) on a random-weight llama-family model of `--d_model` width on
one device. The step is lowered and compiled explicitly (`lower_s`, `compile_s` wall
seconds; `compile_cpu_s` the process's CPU seconds while compiling, which a busy machine
inflates less), then run `--warmup` times untimed and `--repeats` times timed (`step_ms`:
the median, wall time until the new params are ready). `temp_mib` is XLA's own accounting
of the compiled step's scratch memory (`Compiled.memory_analysis()`: every buffer beside
its arguments and outputs — activations kept for the backward pass, logits, gradients),
and `total_mib` adds the arguments and outputs (the train state counted once: it is
donated). Both are the same on every run of a program, so they compare memory without a
device allocator's statistics (the CPU has none).

Sweeps (`--sweeps`):

- `depth`: `--layers` depths × scan_layers off / on (`--depth_vocab` ids): compile time
  grows with depth unscanned and stays flat scanned.
- `logprob_chunk`: `--chunks` (0: the head on all response slots at once) at `--chunk_layers`
  layers and a `--chunk_vocab`-id vocabulary, where the [rows, length, vocab] float32
  logits dominate the step's memory.
- `remat`: each `REMAT_POLICIES` entry at `--remat_layers` layers, scan_layers off / on.
- `attention` (scanned): the einsum attention against `jax.nn.dot_product_attention`
  ("dot_product": XLA's kernel on CPU; "cudnn" needs a GPU and bfloat16, `--attentions`
  adds it there).

Every case prints one JSON line {"benchmark": "learner_compile", "sweep", the knobs,
"lower_s", "compile_s", "compile_cpu_s", "step_ms", "temp_mib", "total_mib", the shapes,
the device}. Run it on a quiet machine.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from typing import Any

import jax
import numpy as np
import optax
from absl import flags

from tba_jax import cli, learner
from tba_jax.models import ModelConfig, init_model
from tba_jax.models.config import ATTENTIONS, HALF_DTYPES, REMAT_POLICIES

SWEEPS = ("depth", "logprob_chunk", "remat", "attention")
SMOKE = dict(
    layers="1,2",
    d_model=32,
    rows=4,
    samples_per_prompt=2,
    prompt_len=4,
    response_len=8,
    depth_vocab=64,
    chunk_vocab=64,
    chunks="0,4",
    chunk_layers=1,
    remat_layers=2,
    repeats=1,
    warmup=0,
)
FIRST_TOKEN = 3  # random token ids start here (ids below are pad / bos / eos by convention)
HEAD_DIM = 32  # d_model / num_heads
KV_GROUPS = 2  # query heads per key/value head
FF_MULTIPLE = 3  # d_ff = FF_MULTIPLE × d_model
BETA = 0.05
LEARNING_RATE = 1e-5
TEMPERATURE = 1.0
MIB = 2**20

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags, defined only when run as a script (tba_jax.cli's rule)."""
    flags.DEFINE_list("sweeps", list(SWEEPS), f"Which sweeps to run, of {SWEEPS}.")
    flags.DEFINE_list("layers", ["2", "4", "8", "16"], "Depths of the depth sweep.")
    flags.DEFINE_integer("d_model", 128, "Model width.", lower_bound=1)
    flags.DEFINE_integer("rows", 8, "N: responses per learner step.", lower_bound=1)
    flags.DEFINE_integer("samples_per_prompt", 4, "K: responses per prompt.", lower_bound=2)
    flags.DEFINE_integer("prompt_len", 32, "P: prompt tokens.", lower_bound=1)
    flags.DEFINE_integer("response_len", 96, "T: response tokens.", lower_bound=1)
    flags.DEFINE_integer(
        "depth_vocab",
        1024,
        "Vocabulary of the depth, remat and attention sweeps.",
        lower_bound=FIRST_TOKEN + 1,
    )
    flags.DEFINE_integer(
        "chunk_vocab", 32_000, "Vocabulary of the logprob_chunk sweep.", lower_bound=FIRST_TOKEN + 1
    )
    flags.DEFINE_list("chunks", ["0", "32", "8"], "logprob_chunk values to compare.")
    flags.DEFINE_integer("chunk_layers", 2, "Depth of the chunk sweep.", lower_bound=1)
    flags.DEFINE_integer(
        "remat_layers", 8, "Depth of the remat and attention sweeps.", lower_bound=1
    )
    flags.DEFINE_list("attentions", ["einsum", "dot_product"], "Attention kernels.")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
    flags.DEFINE_integer("warmup", 1, "Untimed steps after compiling.", lower_bound=0)
    flags.DEFINE_integer("repeats", 5, "Timed steps per case.", lower_bound=1)
    flags.DEFINE_integer("seed", 0, "Model init and batch.")
    flags.DEFINE_boolean("smoke", False, f"Tiny sizes: {SMOKE}.")
    flags.adopt_module_key_flags(cli)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The batch and model sizes every case shares."""

    d_model: int
    rows: int
    samples_per_prompt: int
    prompt_len: int
    response_len: int
    dtype: str
    seed: int


@dataclasses.dataclass(frozen=True)
class Timing:
    warmup: int
    repeats: int


def flag_value(name: str) -> Any:
    """`--name`, or --smoke's size for a flag not given on the command line."""
    if FLAGS.smoke and name in SMOKE and not FLAGS[name].present:
        return SMOKE[name]
    return getattr(FLAGS, name)


def int_list(name: str, minimum: int) -> list[int]:
    """`--name`'s comma-separated integers; UsageError unless each is >= `minimum`."""
    value = flag_value(name)
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        numbers = [int(item) for item in items]
    except ValueError as error:
        raise cli.UsageError(
            f"--{name}={','.join(items)}: pass integers, comma-separated."
        ) from error
    if not numbers or min(numbers) < minimum:
        raise cli.UsageError(f"--{name}={','.join(items)}: pass integers >= {minimum}.")
    return numbers


def check_attentions(sweeps: list[str], dtype: str) -> None:
    """UsageError for an --attentions name that is no kernel, and for cuDNN's where the
    attention sweep cannot run it (float32, or no GPU)."""
    unknown = sorted(set(FLAGS.attentions) - set(ATTENTIONS))
    if unknown or not FLAGS.attentions:
        raise cli.UsageError(f"--attentions names {unknown}; choose from {list(ATTENTIONS)}.")
    if "attention" not in sweeps or "cudnn" not in FLAGS.attentions:
        return
    if dtype not in HALF_DTYPES:
        raise cli.UsageError(
            f"--attentions=cudnn needs a half-precision --dtype (cuDNN's attention takes "
            f"{list(HALF_DTYPES)}), got --dtype={dtype}; pass --dtype=bfloat16."
        )
    cli.check_cudnn_backend("--attentions=cudnn", "leave cudnn out of --attentions.")


def model_config(shapes: Shapes, num_layers: int, vocab_size: int, **execution) -> ModelConfig:
    """A llama-family model of `shapes.d_model` width with the given depth, vocabulary and
    execution knobs."""
    num_heads = max(shapes.d_model // HEAD_DIM, KV_GROUPS)
    return ModelConfig(
        vocab_size=vocab_size,
        d_model=shapes.d_model,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_heads // KV_GROUPS,
        d_ff=FF_MULTIPLE * shapes.d_model,
        max_seq_len=shapes.prompt_len + shapes.response_len,
        dtype=shapes.dtype,
        **execution,
    )


def make_batch(shapes: Shapes, vocab_size: int) -> dict[str, np.ndarray]:
    """Random full-length prompts and responses (every token counts) with random rewards
    and π_ref log-probs: the fields the TB step reads. [N, ...] each."""
    rng = np.random.default_rng(shapes.seed)
    n, p, t = shapes.rows, shapes.prompt_len, shapes.response_len
    return {
        "prompt_tokens": rng.integers(FIRST_TOKEN, vocab_size, (n, p)).astype(np.int32),
        "prompt_mask": np.ones((n, p), bool),
        "response_tokens": rng.integers(FIRST_TOKEN, vocab_size, (n, t)).astype(np.int32),
        "response_mask": np.ones((n, t), np.float32),
        "reward": rng.uniform(0.0, 1.0, n).astype(np.float32),
        "logp_ref": rng.normal(-t, 1.0, n).astype(np.float32),
        "logp_behaviour": rng.normal(-t, 1.0, n).astype(np.float32),
    }


def measure(cfg: ModelConfig, shapes: Shapes, timing: Timing) -> dict[str, float]:
    """Lower, compile and run the TB train step of `cfg`: seconds to lower and to compile,
    the median step in ms, and XLA's scratch and total memory of the step in MiB."""
    model, params = init_model(cfg, shapes.seed)
    optimizer = optax.adamw(LEARNING_RATE)
    state, state_sharding, mesh = learner.one_device_train_state(model, params, optimizer)
    step = learner.constant_beta_tb_step(
        model,
        optimizer,
        state_sharding,
        mesh,
        beta=BETA,
        samples_per_prompt=shapes.samples_per_prompt,
        num_microbatches=1,
        temperature=TEMPERATURE,
    )
    batch = make_batch(shapes, cfg.vocab_size)
    began = time.perf_counter()
    lowered = step.lower(state, batch)
    lowered_at, cpu_before = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    compiled_at, cpu_after = time.perf_counter(), time.process_time()
    seconds = []
    for index in range(timing.warmup + timing.repeats):
        started = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        if index >= timing.warmup:
            seconds.append(time.perf_counter() - started)
    memory = compiled.memory_analysis()
    return {
        "lower_s": round(lowered_at - began, 3),
        "compile_s": round(compiled_at - lowered_at, 3),
        "compile_cpu_s": round(cpu_after - cpu_before, 3),
        "step_ms": round(1e3 * statistics.median(seconds), 2),
        "temp_mib": round(memory.temp_size_in_bytes / MIB, 2),
        "total_mib": round(total_bytes(memory) / MIB, 2),
    }


def total_bytes(memory) -> int:
    """Arguments, outputs and scratch of a compiled program, donated (aliased) buffers once."""
    return (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes
    )


def cases(sweep: str, shapes: Shapes) -> list[ModelConfig]:
    """The model configs one sweep compares."""
    depth_vocab = flag_value("depth_vocab")
    if sweep == "depth":
        return [
            model_config(shapes, layers, depth_vocab, scan_layers=scan)
            for layers in int_list("layers", minimum=1)
            for scan in (False, True)
        ]
    if sweep == "logprob_chunk":
        layers, vocab = flag_value("chunk_layers"), flag_value("chunk_vocab")
        return [
            model_config(shapes, layers, vocab, scan_layers=True, logprob_chunk=chunk)
            for chunk in int_list("chunks", minimum=0)
        ]
    layers = flag_value("remat_layers")
    if sweep == "remat":
        return [
            model_config(shapes, layers, depth_vocab, scan_layers=scan, remat=policy)
            for policy in REMAT_POLICIES
            for scan in (False, True)
        ]
    return [
        model_config(shapes, layers, depth_vocab, scan_layers=True, attention=attention)
        for attention in FLAGS.attentions
    ]


def main(argv: list[str]) -> None:
    del argv
    unknown = sorted(set(FLAGS.sweeps) - set(SWEEPS))
    if unknown:
        raise cli.UsageError(f"--sweeps names {unknown}; choose from {list(SWEEPS)}.")
    shapes = Shapes(**{field.name: flag_value(field.name) for field in dataclasses.fields(Shapes)})
    if shapes.rows % shapes.samples_per_prompt:
        raise cli.UsageError(
            f"--rows={shapes.rows} is not a multiple of --samples_per_prompt="
            f"{shapes.samples_per_prompt} (whole prompt groups)."
        )
    check_attentions(FLAGS.sweeps, shapes.dtype)
    try:  # every case's config built (and so checked) before the first is measured
        planned = [(sweep, cfg) for sweep in FLAGS.sweeps for cfg in cases(sweep, shapes)]
    except ValueError as error:
        raise cli.UsageError(str(error)) from error
    timing = Timing(flag_value("warmup"), flag_value("repeats"))
    machine = cli.machine_fields()
    for sweep, cfg in planned:
        line = {
            "benchmark": "learner_compile",
            "sweep": sweep,
            "num_layers": cfg.num_layers,
            "vocab_size": cfg.vocab_size,
            "scan_layers": cfg.scan_layers,
            "remat": cfg.remat,
            "attention": cfg.attention,
            "logprob_chunk": cfg.logprob_chunk,
            **measure(cfg, shapes, timing),
            "num_params": cfg.num_params(),
            **dataclasses.asdict(shapes),
            **machine,
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
