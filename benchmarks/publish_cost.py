r"""What a colocated publish costs the host: `mesh.publish` against leaf-by-leaf `device_put`.

    python benchmarks/publish_cost.py                        # qwen2.5-0.5b's tree, micro widths
    python benchmarks/publish_cost.py --scan_layers          # its scanned tree (14 leaves)
    python benchmarks/publish_cost.py --full_width           # the real widths (an accelerator)
    python benchmarks/publish_cost.py --compute_dtype=bfloat16  # cast as a bfloat16 run's is

A publish copies the learner's params into new buffers for the searchers
(`mesh.publish`). On one device most of its cost is host work per leaf, so this builds a
preset's parameter tree (its depth, its leaves; by default its widths shrunk to micro's
so that it runs in seconds on a CPU), float32, on the default device, and times after a
warm-up, as medians over `--repeats` calls:

With `--compute_dtype=bfloat16` the publish casts the weights in its copy
(`models.compute_dtype_cast`), as a run with `model.dtype=bfloat16` publishes to its
searchers.

- publish_host_ms: until `mesh.publish` returns (what the learner's loop waits for:
  the copy itself runs asynchronously);
- publish_ms: until the copy is done;
- device_put_ms: the same copy as `jax.device_put(params, shardings, may_alias=False)`,
  one transfer per leaf (the path `mesh.publish` takes when the roles' shardings differ).

The last stdout line is JSON: {"benchmark": "publish_cost", "leaves", "param_mib", ...}.
"""

from __future__ import annotations

import json
import platform
import statistics
import time

import jax
from absl import flags

from tba_jax import cli
from tba_jax import mesh as mesh_lib
from tba_jax.models import compute_dtype_cast, init_model, preset

# Widths of the shrunk tree (micro's): the leaf count and the per-leaf work stay the preset's.
SHRUNK = dict(vocab_size=512, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128)

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags, defined only when run as a script (tba_jax.cli's rule)."""
    flags.DEFINE_string("shape", "qwen2.5-0.5b", "Model preset whose tree is published.")
    flags.DEFINE_bool("full_width", False, "Keep the preset's own widths.")
    flags.DEFINE_bool("scan_layers", False, "Stacked layers (one leaf per kind).")
    flags.DEFINE_integer("repeats", 50, "Timed calls of each (medians).", lower_bound=1)
    flags.DEFINE_enum(
        "compute_dtype", None, ["bfloat16"], "Publish through the cast to this compute dtype."
    )


def timed_ms(copy, repeats: int) -> tuple[float, float]:
    """Median (ms until `copy()` returns, ms until its result is ready), after a warm-up."""
    jax.block_until_ready(copy())
    returned, ready = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        out = copy()
        returned.append(time.perf_counter() - start)
        jax.block_until_ready(out)
        ready.append(time.perf_counter() - start)
    return 1e3 * statistics.median(returned), 1e3 * statistics.median(ready)


def main(argv: list[str]) -> None:
    del argv
    widths = {} if FLAGS.full_width else SHRUNK
    cli.check_preset_flags(FLAGS.shape, widths.get("vocab_size"))
    dtype = dict(dtype=FLAGS.compute_dtype) if FLAGS.compute_dtype else {}
    config = preset(FLAGS.shape, scan_layers=FLAGS.scan_layers, **widths, **dtype)
    cast = compute_dtype_cast(config) if FLAGS.compute_dtype else None
    _, params = init_model(config, 0)
    params = jax.device_put(params, jax.devices()[0])
    shardings = jax.tree.map(lambda leaf: leaf.sharding, params)
    publish_host_ms, publish_ms = timed_ms(
        lambda: mesh_lib.publish(params, shardings, cast), FLAGS.repeats
    )
    _, device_put_ms = timed_ms(
        lambda: jax.device_put(params, shardings, may_alias=False), FLAGS.repeats
    )
    leaves = jax.tree.leaves(params)
    result = {
        "benchmark": "publish_cost",
        "shape": FLAGS.shape,
        "full_width": FLAGS.full_width,
        "scan_layers": FLAGS.scan_layers,
        "compute_dtype": FLAGS.compute_dtype,
        "leaves": len(leaves),
        "param_mib": round(sum(leaf.nbytes for leaf in leaves) / 2**20, 2),
        "publish_host_ms": round(publish_host_ms, 3),
        "publish_ms": round(publish_ms, 3),
        "device_put_ms": round(device_put_ms, 3),
        "device": f"{jax.devices()[0].device_kind} ({platform.machine()})",
    }
    print(
        f"{result['leaves']} leaves, {result['param_mib']} MiB: publish returns in "
        f"{publish_host_ms:.2f} ms, done in {publish_ms:.2f} ms; leaf-by-leaf device_put "
        f"{device_put_ms:.2f} ms"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
