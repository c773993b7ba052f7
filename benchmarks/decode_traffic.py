r"""The device-memory traffic of one compiled decode step, against the bytes the memory
roofline counts: a static profile of `generate`, made without running it.

    python benchmarks/decode_traffic.py                    # this machine's backend
    python benchmarks/decode_traffic.py --target=h100      # an H100 program, no GPU needed

`--target=h100` compiles for an H100 without one (XLA's deviceless GPU compilation, from
`benchmarks/targets/h100_sxm.txtpb`); it needs JAX's CUDA plugin at the installed JAX's
version (`pip install jax-cuda12-plugin==<jax version>`, about 180 MB, no CUDA libraries),
and no GPU. XLA does not autotune its matmuls there, so their tiling (split-K partial sums
included) is the compiler's default, which a GPU's autotuner may change.

Random-weight shapes of a preset (`--shape`), `--batch` rows of `--prompt` + `--new`
tokens, as `benchmarks/gpu_throughput.py` measures them. The decode loop's body is read
from the optimized HLO (`tba_jax.hlo_traffic`): per step, the bytes each kernel reads and
writes, summed by what the kernels do, the kernels per step, and the largest kernels. The
last line is one JSON object: `static_step_bytes` (the mean over the response's steps,
segment by segment with `--decode_segments`), `roofline_step_bytes`
(`roofline.decode_step_bytes`) and their ratio, `static_ceiling_percent` (the share of the
memory roofline a decode that moves these bytes at full bandwidth reaches), `by_kind` and
`largest` (kernels grouped by kind and output shape).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
from absl import flags

from tba_jax import cli, hlo_traffic, roofline
from tba_jax.models import abstract_model, preset
from tba_jax.sampling.generate import SamplingConfig, make_generate_fn

TEMPERATURE = 0.7
TARGETS = {"h100": Path(__file__).resolve().parent / "targets" / "h100_sxm.txtpb"}
PLUGIN_HINT = (
    "compiling for {target} without its GPU needs JAX's CUDA plugin at JAX's version: "
    "pip install jax-cuda12-plugin=={version} (no GPU or CUDA libraries needed)"
)

_TARGET = flags.DEFINE_enum("target", "local", ["local", *TARGETS], "Device to compile for.")
_SHAPE = flags.DEFINE_string("shape", "qwen2.5-0.5b", "Model preset.")
_BATCH = flags.DEFINE_integer("batch", 256, "Rows decoded at once.", lower_bound=1)
_PROMPT = flags.DEFINE_integer("prompt", 256, "Prompt tokens per row.", lower_bound=1)
_NEW = flags.DEFINE_integer("new", 256, "New tokens per row.", lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Params and compute.")
_LAYERS = flags.DEFINE_integer("layers", None, "The preset's depth if unset.", lower_bound=1)
_VOCAB = flags.DEFINE_integer("vocab", None, "For presets without a vocabulary size.")
_SCAN_DECODE = flags.DEFINE_bool("scan_decode", False, "model.scan_decode.")
_SEGMENTS = flags.DEFINE_integer("decode_segments", 1, "sampling.decode_segments.", lower_bound=1)
_TOP = flags.DEFINE_integer("top", 12, "Largest kernels to list.", lower_bound=0)
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
        hint = PLUGIN_HINT.format(target=target, version=jax.__version__)
        raise cli.UsageError(f"{hint} ({cli.one_line(str(error))})") from error
    return topology.devices[0]


def compile_decode(device: jax.Device):
    """generate() compiled for `device` on abstract params and prompts; (text, model cfg)."""
    sizes = dict(max_seq_len=_PROMPT.value + _NEW.value, vocab_size=_VOCAB.value)
    if _LAYERS.value:
        sizes["num_layers"] = _LAYERS.value
    scan = _SCAN_DECODE.value
    decoder = preset(
        _SHAPE.value,
        dtype=_DTYPE.value,
        param_dtype=_DTYPE.value,
        scan_layers=scan,
        scan_decode=scan,
        **sizes,
    )
    model, abstract = abstract_model(decoder)
    placed = jax.sharding.SingleDeviceSharding(device)

    def on_device(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placed)

    params = jax.tree.map(lambda leaf: on_device(leaf.shape, leaf.dtype), abstract)
    vocab = decoder.vocab_size
    sampling = SamplingConfig(
        max_new_tokens=_NEW.value,
        temperature=TEMPERATURE,
        vocab_limit=vocab - 1,  # EOS (the last id) is never drawn: every row runs --new steps
        decode_segments=_SEGMENTS.value,
    )
    generate = make_generate_fn(model, sampling, eos_id=vocab - 1, pad_id=0)
    rows = (_BATCH.value, _PROMPT.value)
    lowered = generate.trace(
        params,
        on_device(rows, jnp.int32),
        on_device(rows, jnp.bool_),
        on_device((), jax.random.key(0).dtype),
    ).lower(lowering_platforms=("cuda",) if _TARGET.value in TARGETS else None)
    return lowered.compile().as_text(), decoder, sampling


def readable(size: float) -> str:
    """Bytes in the largest decimal unit that keeps the figure at 1 or more."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size:.0f} B"


def segment_steps(sampling: SamplingConfig) -> list[int]:
    """Decode steps each of generate's loops runs when every row runs to the limit."""
    ends = sampling.segment_ends()
    return [end - start for start, end in zip([0, *ends[:-1]], ends, strict=True)]


def main(argv: list[str]) -> None:
    del argv
    if _TARGET.value != "local":
        # A compile-only target needs no accelerator backend: keep JAX from looking for one.
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        jax.config.update("jax_platforms", "cpu")
    device = target_device(_TARGET.value)
    hlo_text, decoder, sampling = compile_decode(device)
    loops = hlo_traffic.loops_without_trip_count(hlo_traffic.program_traffic(hlo_text))
    steps = segment_steps(sampling)
    if len(loops) != len(steps):
        raise RuntimeError(
            f"expected {len(steps)} decode loops in the compiled program, found {len(loops)}"
        )
    static = sum(
        loop.bytes_per_iteration() * n for loop, n in zip(loops, steps, strict=True)
    ) / sum(steps)
    dtype_bytes = jnp.dtype(_DTYPE.value).itemsize
    shape = (decoder, _BATCH.value, _PROMPT.value, _NEW.value, dtype_bytes, dtype_bytes)
    ideal = roofline.decode_step_bytes(*shape)
    last = loops[-1]  # the last segment attends over the whole cache
    print(
        f"decode step on {device.device_kind}: {readable(static)} moved, roofline "
        f"{readable(ideal)}; the last segment's {last.kernels_per_iteration()} kernels:"
    )
    for kind, moved in hlo_traffic.bytes_by_kind(last).items():
        print(f"  {readable(moved):>10s}  {kind}")
    largest = hlo_traffic.largest_groups(last, _TOP.value)
    for group in largest:
        print(f"  {readable(group.bytes):>10s}  {group.count:4d} × {group.kind:16s} {group.shape}")
    line = {
        "benchmark": "decode_traffic",
        "target": _TARGET.value,
        "device_kind": device.device_kind,
        "shape": _SHAPE.value,
        "layers": decoder.num_layers,
        "dtype": _DTYPE.value,
        "batch": _BATCH.value,
        "prompt": _PROMPT.value,
        "new": _NEW.value,
        "scan_decode": _SCAN_DECODE.value,
        "decode_segments": _SEGMENTS.value,
        "static_step_bytes": round(static),
        "segment_step_bytes": [loop.bytes_per_iteration() for loop in loops],
        "roofline_step_bytes": round(ideal),
        "static_over_roofline": round(static / ideal, 3),
        "static_ceiling_percent": round(100 * ideal / static, 1),
        "kernels_per_step": last.kernels_per_iteration(),
        "by_kind": hlo_traffic.bytes_by_kind(last),
        "largest": [dataclasses.asdict(group) for group in largest],
    }
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    cli.run(main)
