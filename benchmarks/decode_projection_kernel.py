r"""The Pallas projection kernel (`model.decode_projection=pallas`) on this machine's
backend: a decode step's two output projections (attention's W_o, the MLP's W_down) at a
model's widths, each added to the block's residual stream as the model adds it (since
2026-11-29: in the kernel where it computes the whole contraction in one part), against
residual + x W in float64 NumPy, and their time beside XLA's matmul and addition.

    python benchmarks/decode_projection_kernel.py                  # qwen2.5-0.5b, 256 rows
    python benchmarks/decode_projection_kernel.py --shape=qwen2.5-1.5b --rows=64,256
    python benchmarks/decode_projection_kernel.py --settings=64:64:64:4:4:3,64:32:64:8:4:3

On a GPU the kernel is Triton's; elsewhere Pallas' interpreter runs it (slow: a check of
the script, not a timing). One JSON line per row count and projection (`projection`:
"attention_out", [rows, heads x head width] x [.., d_model], or "mlp_down", [rows, d_ff]
x [d_ff, d_model]): `max_abs_error` (against float64, on the inputs rounded to
`--dtype`, the worst over `--settings`, with `xla_max_abs_error` beside it), `kernel_us`
(one figure per `--settings` entry
`block_m:block_n:block_k:k_splits:num_warps:num_stages`,
`models.config.ProjectionKernelSettings`, keyed so, the adding of the parts and the
cast included; `fastest`: the key of the least, a `model.decode_projection_kernel`
value; `model_settings`: the kernel's defaults, `decode_projection.SETTINGS`) and
`xla_us` (XLA's matmul and the addition, as the model computes them without the
kernel), each one call's time after a compiling one (`timing`: on an accelerator the
mean of its kernels' device time over `--repeats` traced calls, on a CPU the median of
`--repeats` timed calls; `decode_attention_kernel.call_us`). `bytes` is what the product
must move (the weight, the rows and the residual in, the outputs out) and
`hbm_bound_us` its time at the HBM bandwidth of `peaks` (the device's datasheet figure;
`roofline.peaks_for`). Each is timed cold too,
the calls cycling through copies of the inputs that no cache holds (`kernel_cold_us`,
`xla_cold_us`, `fastest_cold`, `cold_copies`; `--cold_mb`, 0: not): inside a decode
step a layer's weights are read once, from device memory.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from tba_jax.models import transformer
from tba_jax.models.config import MIN_MLP_BLOCK, parse_projection_kernel_settings
from tba_jax.models.decode_projection import SETTINGS, project

# The sibling benchmark is imported as `benchmarks.<name>`, so that this module imports
# from a notebook or a test too; run as a script, Python puts benchmarks/ on the path,
# not the repository root, so the root is added here.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from benchmarks.gated_mlp_kernel import measured, row_kernel_command_line  # noqa: E402

# block_m:block_n:block_k:k_splits:num_warps:num_stages. The model's settings first, then
# no split (the residual added in the kernel: one XLA kernel fewer) with tiles of 64, 32
# and 16 rows by 64 and 32 outputs (more programs, as the split gives), more parts,
# narrower output tiles, taller row tiles, shorter walks, more warps and stages.
DEFAULT_SETTINGS = (
    "64:64:64:4:4:3,64:64:64:1:4:3,32:32:64:1:4:3,16:64:64:1:2:3,64:64:64:2:4:3,"
    "64:64:64:8:4:3,64:32:64:8:4:3,128:64:64:4:8:3,64:64:32:8:4:4,32:64:64:8:4:3"
)


def xla_projection():
    """The product and the addition as the model computes them without the kernel
    (`transformer.dense`, then the residual stream plus its output)."""

    def projected(x, w, residual):
        return residual + transformer.dense(x, w)

    return jax.jit(projected)


def main() -> None:
    args, row_counts, settings, cfg = row_kernel_command_line(
        __doc__.splitlines()[0],
        DEFAULT_SETTINGS,
        parse_projection_kernel_settings,
        "decode_projection",
    )
    rng = np.random.default_rng(args.seed)
    xla = xla_projection()
    item_bytes = jnp.dtype(args.dtype).itemsize
    # name, contraction width, and the parts a mesh's tensor axis may cut it into
    projections = (
        ("attention_out", cfg.num_heads * cfg.resolved_head_dim, cfg.num_heads),
        ("mlp_down", cfg.d_ff, cfg.d_ff // MIN_MLP_BLOCK),
    )
    for name, width, split in projections:
        kernels = {
            each.spec(): jax.jit(
                lambda x, w, residual, each=each, split=split: project(
                    x, w, split=split, residual=residual, settings=each
                )
            )
            for each in settings
        }
        w = jnp.asarray(rng.normal(size=(width, cfg.d_model)) / np.sqrt(width), args.dtype)
        for rows in row_counts:
            x = jnp.asarray(rng.normal(size=(rows, width)), args.dtype)
            residual = jnp.asarray(rng.normal(size=(rows, cfg.d_model)), args.dtype)
            inputs = (x, w, residual)
            as_f64 = [np.asarray(a.astype(jnp.float32), np.float64) for a in inputs]
            expected = as_f64[2] + as_f64[0] @ as_f64[1]
            moved = item_bytes * (width * cfg.d_model + rows * (width + 2 * cfg.d_model))
            line = {
                "bench": "decode_projection_kernel",
                "backend": jax.default_backend(),
                "shape": args.shape,
                "projection": name,
                "rows": rows,
                "width": width,
                "d_model": cfg.d_model,
                "dtype": args.dtype,
                **measured(kernels, xla, inputs, expected, args, moved, SETTINGS),
            }
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
