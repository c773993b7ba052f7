"""`device_trace.summarize` against a hand-written profile with known kernel times: only
the device planes' stream lines count, grouped by their `hlo_op` stat, with the span
from the first kernel to the last."""

from __future__ import annotations

import pytest
from jax.profiler import ProfileData

from tba_jax import device_trace

# Times in picoseconds from each line's timestamp_ns = 1000 ns. Kernels: fusion.1 at
# 0-2 µs and 5-8 µs, a gemm at 3-4 µs; the "XLA Ops" line and the host plane repeat or
# hold other time and must not count.
XSPACE = """
planes {
  id: 1
  name: "/device:GPU:0"
  lines {
    id: 1
    name: "Stream #13(Compute)"
    timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 2000000
             stats { metadata_id: 10 str_value: "fusion.1" } }
    events { metadata_id: 2 offset_ps: 3000000 duration_ps: 1000000 }
    events { metadata_id: 1 offset_ps: 5000000 duration_ps: 3000000
             stats { metadata_id: 10 str_value: "fusion.1" } }
  }
  lines {
    id: 2
    name: "XLA Ops"
    timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 9000000 }
  }
  event_metadata { key: 1 value { id: 1 name: "loop_fusion_kernel" } }
  event_metadata { key: 2 value { id: 2 name: "gemm" } }
  stat_metadata { key: 10 value { id: 10 name: "hlo_op" } }
}
planes {
  id: 2
  name: "/host:CPU"
  lines {
    id: 1
    name: "python"
    timestamp_ns: 0
    events { metadata_id: 1 offset_ps: 0 duration_ps: 99000000 }
  }
  event_metadata { key: 1 value { id: 1 name: "x" } }
}
"""


def profile(text: str) -> ProfileData:
    return ProfileData.from_serialized_xspace(ProfileData.text_proto_to_serialized_xspace(text))


def test_kernel_time_by_hlo_op_and_busy_share():
    summary = device_trace.summarize(profile(XSPACE))
    assert summary["kernels"] == 3
    assert summary["kernel_ms"] == pytest.approx(0.006)
    assert summary["span_ms"] == pytest.approx(0.008)
    assert summary["busy_percent"] == 75.0
    assert summary["top"] == [
        {"op": "fusion.1", "ms": 0.005, "count": 2, "percent": 83.3},
        {"op": "gemm", "ms": 0.001, "count": 1, "percent": 16.7},
    ]
    assert [row["op"] for row in device_trace.summarize(profile(XSPACE), top=1)["top"]] == [
        "fusion.1"
    ]
    fusion_2 = XSPACE.replace('str_value: "fusion.1" } }\n  }', 'str_value: "fusion.2" } }\n  }')
    assert fusion_2 != XSPACE  # two ops of one kind
    by_kind = device_trace.summarize(profile(fusion_2), top=1)["by_kind"]
    assert by_kind == [
        {"op": "fusion", "ms": 0.005, "count": 2, "percent": 83.3},
        {"op": "gemm", "ms": 0.001, "count": 1, "percent": 16.7},
    ]


def test_a_trace_without_a_device_plane_has_no_kernels(tmp_path):
    host_only = XSPACE[XSPACE.index("planes {\n  id: 2") :]
    assert device_trace.summarize(profile(host_only))["kernels"] == 0
    with pytest.raises(FileNotFoundError, match=r"was jax\.profiler\.trace run"):
        device_trace.kernel_summary(tmp_path)
