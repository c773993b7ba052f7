r"""The Pallas MLP kernel (`model.decode_mlp=pallas`) on this machine's backend: its output
against act(x W_gate) * (x W_up) in float64 NumPy, and its time beside XLA's, one decode
step's layer at a time. x is the block's stream normalised by its RMSNorm, which the
kernel applies itself as the model runs it (since 2026-11-29; `gated_mlp.gated_hidden`'s
`norm`), and XLA's path before its products.

    python benchmarks/gated_mlp_kernel.py                        # qwen2.5-0.5b's layer, 256 rows
    python benchmarks/gated_mlp_kernel.py --shape=qwen2.5-1.5b --rows=64,256
    python benchmarks/gated_mlp_kernel.py --settings=64:64:64:4:3,128:64:64:4:3   # a grid

On a GPU the kernel is Triton's; elsewhere Pallas' interpreter runs it (slow: a check of
the script, not a timing). One JSON line per row count: `max_abs_error` (against float64,
on the inputs rounded to `--dtype`, the worst over `--settings`, with `xla_max_abs_error`
beside it: XLA's path rounds each product to `--dtype` first), `kernel_us` (one figure per
`--settings` entry `block_m:block_n:block_k:num_warps:num_stages`,
`models.config.MlpKernelSettings`, keyed so; `fastest`: the key of the least, a
`model.decode_mlp_kernel` value; `model_settings`: the kernel's defaults,
`gated_mlp.SETTINGS`) and `xla_us` (the model's own norm and gated hidden layer, as XLA
compiles them), each one call's time after a compiling one (`timing`: on an accelerator
the mean of its kernels' device time over `--repeats` traced calls, on a CPU the median
of `--repeats` timed calls; `decode_attention_kernel.call_us`). `bytes` is what the layer
must move (both weights, the rows in, the norm's float32 scale and the hidden layer out)
and `hbm_bound_us` its time at the HBM bandwidth of `peaks` (the device's datasheet
figure; `roofline.peaks_for`). Each is timed cold too, the calls cycling through copies
of the inputs that no cache holds (`kernel_cold_us`, `xla_cold_us`, `fastest_cold`,
`cold_copies`; `--cold_mb`, 0: not; `decode_attention_kernel.timed`): inside a decode
step a layer's weights are read once, from device memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from tba_jax import cli, roofline
from tba_jax.models import preset, transformer
from tba_jax.models.config import parse_mlp_kernel_settings
from tba_jax.models.gated_mlp import SETTINGS, gated_hidden

# The sibling benchmark is imported as `benchmarks.<name>`, so that this module imports
# from a notebook or a test too; run as a script, Python puts benchmarks/ on the path,
# not the repository root, so the root is added here.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from benchmarks.decode_attention_kernel import COLD_MB, parse_settings, timed  # noqa: E402

# block_m:block_n:block_k:num_warps:num_stages. The model's settings first, then wider
# and narrower tiles of hidden units, taller row tiles, longer walks, more warps/stages.
DEFAULT_SETTINGS = (
    "64:64:64:4:3,64:128:64:4:3,64:32:64:4:3,128:64:64:4:3,128:128:64:8:3,"
    "32:64:128:4:3,64:64:128:4:4,256:32:64:8:3,64:64:32:4:4,128:32:128:4:3"
)


def reference(x, w_gate, w_up, activation, norm=None) -> np.ndarray:
    """act(x W_gate) * (x W_up) in float64 (`activation` applied through JAX in float64
    would need x64: silu and the gelus are written out here); with `norm` (scale,
    epsilon), of x normalised by that RMSNorm."""
    x, w_gate, w_up = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, w_gate, w_up))
    if norm is not None:
        scale, eps = norm
        x = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * np.asarray(scale)
    gate, up = x @ w_gate, x @ w_up
    if activation == "silu":
        return gate / (1.0 + np.exp(-gate)) * up
    from scipy.special import erf

    if activation == "gelu":
        return 0.5 * gate * (1.0 + erf(gate / np.sqrt(2.0))) * up
    inner = np.sqrt(2.0 / np.pi) * (gate + 0.044715 * gate**3)  # gelu_new (tanh)
    return 0.5 * gate * (1.0 + np.tanh(inner)) * up


def xla_hidden(activation, eps: float):
    """The model's norm and gated hidden layer as `transformer.Norm` and `transformer.MLP`
    compute them outside the kernel: the rows normalised in float32 and rounded
    (`transformer.normalise`), each
    product rounded to the compute dtype, then act(gate) * up."""
    act = transformer.ACTIVATION_FNS[activation]

    def hidden(x, w_gate, w_up, scale):
        x = transformer.normalise(x, scale, eps)
        return act(transformer.dense(x, w_gate)) * transformer.dense(x, w_up)

    return jax.jit(hidden)


def kernel_with_norm(activation, eps: float, settings):
    """The kernel as the model calls it: the norm folded in."""

    def hidden(x, w_gate, w_up, scale):
        return gated_hidden(x, w_gate, w_up, activation, norm=(scale, eps), settings=settings)

    return jax.jit(hidden)


def measured(kernels: dict, xla, inputs, expected: np.ndarray, args, moved: int, model_settings):
    """The fields a row-kernel benchmark prints after its own: each kernel's and XLA's
    worst error against `expected` (float64), their times warm and cold (`timed`, by
    `args.repeats` and `args.cold_mb`), the `fastest` kernel, and the `moved` bytes with
    their time at this device's HBM bandwidth."""
    outs = [np.asarray(kernel(*inputs).astype(jnp.float32)) for kernel in kernels.values()]
    xla_out = np.asarray(xla(*inputs).astype(jnp.float32))
    peaks = roofline.peaks_for(jax.devices()[0].device_kind)
    fields = {
        "max_abs_error": max(float(np.abs(out - expected).max()) for out in outs),
        "xla_max_abs_error": float(np.abs(xla_out - expected).max()),
        "model_settings": model_settings.spec(),
        **timed(kernels, xla, inputs, args.repeats, args.cold_mb, "xla"),
        "bytes": moved,
        "peaks": peaks.name,
        "hbm_bound_us": round(1e6 * moved / peaks.hbm_bytes_per_s, 1),
    }
    return fields


def row_kernel_command_line(description: str, default_settings: str, parse, knob: str):
    """The command line of a benchmark of a kernel over decode rows (this one, and
    `decode_projection_kernel.py`): (args, row counts, settings parsed by `parse`, the
    preset's `ModelConfig` with `knob`="pallas", so with that kernel's checks). A bad
    value exits with one error line."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="model preset (its widths)")
    parser.add_argument("--rows", default="256", help="comma-separated decode batch sizes")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    fields = ":".join(parse(default_settings.split(",")[0])._fields)
    parser.add_argument("--settings", default=default_settings, help=f"{fields},...")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cold_mb", type=float, default=COLD_MB, help="0: no cold timing")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        row_counts = [int(item) for item in args.rows.split(",")]
        settings = parse_settings(args.settings, parse)
        # the preset's widths and activation, with the kernel's checks; no vocabulary needed
        cfg = preset(args.shape, vocab_size=16, dtype=args.dtype, **{knob: "pallas"})
        if args.repeats < 1 or min(row_counts) < 1 or args.cold_mb < 0:
            raise ValueError("--repeats and every --rows entry must be >= 1, --cold_mb >= 0.")
    except ValueError as error:
        cli.exit_with_error(str(error))
    return args, row_counts, settings, cfg


def main() -> None:
    args, row_counts, settings, cfg = row_kernel_command_line(
        __doc__.splitlines()[0], DEFAULT_SETTINGS, parse_mlp_kernel_settings, "decode_mlp"
    )
    rng = np.random.default_rng(args.seed)
    act = transformer.ACTIVATION_FNS[cfg.activation]
    eps = cfg.norm_eps
    kernels = {each.spec(): kernel_with_norm(act, eps, each) for each in settings}
    xla = xla_hidden(cfg.activation, eps)
    scale = 1.0 / np.sqrt(cfg.d_model)  # unit-variance products, as a trained layer's
    w_gate, w_up = (
        jnp.asarray(rng.normal(size=(cfg.d_model, cfg.d_ff)) * scale, args.dtype) for _ in "gu"
    )
    norm_scale = jnp.asarray(1 + 0.1 * rng.normal(size=cfg.d_model), jnp.float32)
    item_bytes = jnp.dtype(args.dtype).itemsize
    for rows in row_counts:
        x = jnp.asarray(3 * rng.normal(size=(rows, cfg.d_model)), args.dtype)
        inputs = (x, w_gate, w_up, norm_scale)
        expected = reference(x, w_gate, w_up, cfg.activation, norm=(norm_scale, eps))
        moved = (
            item_bytes * (2 * cfg.d_model * cfg.d_ff + rows * (cfg.d_model + cfg.d_ff))
            + norm_scale.nbytes
        )
        line = {
            "bench": "gated_mlp_kernel",
            "backend": jax.default_backend(),
            "shape": args.shape,
            "rows": rows,
            "d_model": cfg.d_model,
            "d_ff": cfg.d_ff,
            "dtype": args.dtype,
            **measured(kernels, xla, inputs, expected, args, moved, SETTINGS),
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
