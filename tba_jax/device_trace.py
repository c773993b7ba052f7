"""Where a program's device time goes, read from a `jax.profiler` trace.

`kernel_summary(trace_dir)` reads the `*.xplane.pb` a `jax.profiler.trace(trace_dir)`
wrote and sums, over the device planes (`/device:GPU:0`, ...), the time of every kernel
(or XLA op) event: by the HLO op it ran for (the event's `hlo_op` stat, else its own
name), with the span from the first kernel's start to the last one's end. Kernel time
over the span is how busy the device was; the rest is launch gaps and host waits.
`benchmarks/gpu_throughput.py --profile` prints it beside each timing.
"""

from __future__ import annotations

import collections
import pathlib
import re
from typing import Any

from jax.profiler import ProfileData

DEVICE_PLANE_PREFIX = "/device:"
# Lines of a GPU plane that hold the streams' kernels; others ("XLA Modules", "XLA Ops",
# "Steps") repeat the same time at a coarser grain.
STREAM_LINE_PREFIX = "Stream"
# An HLO op's numeric suffix: "gemm_fusion_dot.147" is of kind "gemm_fusion_dot".
KIND_SUFFIX = re.compile(r"\.\d+$")


def _stat(event: Any, name: str) -> Any:
    for stat_name, value in event.stats:
        if stat_name == name:
            return value
    return None


def summarize(profile: ProfileData, top: int = 15) -> dict[str, Any]:
    """Kernel time of the device planes of one profile (see the module docstring).

    Returns {"kernels", "kernel_ms", "span_ms", "busy_percent", "top": [{"op", "ms",
    "count", "percent"}...], "by_kind": [...]}; "top" holds the `top` ops with the most
    time, "percent" of all kernel time; "by_kind" the same for ops grouped by their name
    without its numeric suffix (every layer's `gemm_fusion_dot.N` together), all kinds.
    Empty (kernels 0) when the trace has no device plane (a CPU).
    """
    time_ns: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    first_start, last_end = float("inf"), 0.0
    for plane in profile.planes:
        if not plane.name.startswith(DEVICE_PLANE_PREFIX):
            continue
        for line in plane.lines:
            if not line.name.startswith(STREAM_LINE_PREFIX):
                continue
            for event in line.events:
                op = _stat(event, "hlo_op") or event.name
                time_ns[op] += event.duration_ns
                count[op] += 1
                first_start = min(first_start, event.start_ns)
                last_end = max(last_end, event.end_ns)
    kernel_ns = sum(time_ns.values())
    span_ns = max(last_end - first_start, 0.0)
    kind_ns: dict[str, float] = collections.defaultdict(float)
    kind_count: dict[str, int] = collections.defaultdict(int)
    for op in time_ns:
        kind = KIND_SUFFIX.sub("", op)
        kind_ns[kind] += time_ns[op]
        kind_count[kind] += count[op]
    return {
        "kernels": sum(count.values()),
        "kernel_ms": round(kernel_ns / 1e6, 3),
        "span_ms": round(span_ns / 1e6, 3),
        "busy_percent": round(100 * kernel_ns / span_ns, 1) if span_ns else 0.0,
        "top": _ranked(time_ns, count, kernel_ns, top),
        "by_kind": _ranked(kind_ns, kind_count, kernel_ns, len(kind_ns)),
    }


def _ranked(time_ns: dict, count: dict, kernel_ns: float, top: int) -> list[dict[str, Any]]:
    """The `top` names with the most time: their ms, event count and share of `kernel_ns`."""
    return [
        {
            "op": name,
            "ms": round(time_ns[name] / 1e6, 3),
            "count": count[name],
            "percent": round(100 * time_ns[name] / kernel_ns, 1),
        }
        for name in sorted(time_ns, key=time_ns.get, reverse=True)[:top]
    ]


def kernel_summary(trace_dir: str | pathlib.Path, top: int = 15) -> dict[str, Any]:
    """`summarize` of the newest `*.xplane.pb` under `trace_dir`."""
    files = sorted(pathlib.Path(trace_dir).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}: was jax.profiler.trace run?")
    return summarize(ProfileData.from_file(str(files[-1])), top)
