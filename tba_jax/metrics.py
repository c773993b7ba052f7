"""Run metrics: TensorBoard scalars, a concise console line or progress bar, phase timers, rates,
and the JSON results files (summary.json, eval.json, ...), written atomically.

TensorBoard files are written with tensorboardX and read back by a small
TFRecord reader here, so neither TensorFlow nor the tensorboard package is
needed. In a multi-process run, construct `MetricsWriter` on process 0 only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TextIO

import numpy as np
import tqdm
from absl import logging


def import_without_torch(name: str) -> Any:
    """Imports module `name` with `import torch` failing meanwhile (unless torch is already
    imported). tensorboardX's writer imports torch when it is installed, only to accept
    torch tensors, which this code never passes: over a second, most of a launcher's start
    (torch comes with the `hf` and `test` extras). A later `import torch` works as usual."""
    if "torch" in sys.modules:
        return importlib.import_module(name)
    sys.modules["torch"] = None  # `import torch` raises ImportError, which the module catches
    try:
        return importlib.import_module(name)
    finally:
        del sys.modules["torch"]


tensorboardX = import_without_torch("tensorboardX")
event_pb2 = importlib.import_module("tensorboardX.proto.event_pb2")
masked_crc32c = importlib.import_module("tensorboardX.record_writer").masked_crc32c

TENSORBOARD_SUBDIR = "tensorboard"
# The train loop's clock scalars: RL seconds of the run so far (this segment's), and the
# seconds each in-loop evaluation took.
RL_SECONDS, EVAL_SECONDS = "rl_seconds", "evaluation_seconds"
FLUSH_SECONDS = 10
LOG_VALUE_FORMAT = ".4g"
EVAL_METRIC_PREFIX = "eval_"
SECONDS_PER_MINUTE = 60
MINUTES_PER_HOUR = 60
SECONDS_PER_HOUR = SECONDS_PER_MINUTE * MINUTES_PER_HOUR
LOG_FIELD_SEPARATOR = " | "
UNIQUE_SUFFIX_CHARS = 12

EVENT_FILE_MARKER = "tfevents"
RECORD_LENGTH_FORMAT = "<Q"
RECORD_CRC_FORMAT = "<I"
RECORD_LENGTH_BYTES = struct.calcsize(RECORD_LENGTH_FORMAT)
RECORD_CRC_BYTES = struct.calcsize(RECORD_CRC_FORMAT)

Clock = Callable[[], float]


def write_json_atomically(path: str, value: Any) -> str:
    """Writes `value` as indented, key-sorted JSON to `path` through a temporary file and a
    rename, so a reader never sees half a file; makes the folder if needed. Returns path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)
    return path


# --------------------------------------------------------------------------------------
# Scalars and the console line.
# --------------------------------------------------------------------------------------


def as_scalar(name: str, value: Any) -> float:
    """`value` (Python, NumPy or JAX scalar) as a float; refuses arrays of other sizes."""
    array = np.asarray(value)
    if array.size != 1:
        raise ValueError(
            f"Metric {name!r} must be a scalar, got shape {array.shape}; reduce it (e.g. mean) "
            "before writing."
        )
    return float(array.reshape(()))


@dataclasses.dataclass(frozen=True)
class ConsoleField:
    """One figure of the console line: the metric it shows, its label and number format."""

    metric: str
    label: str
    number_format: str = LOG_VALUE_FORMAT
    label_after: bool = False  # "1,428 samples/s" rather than "samples/s 1428"

    def text(self, value: float) -> str:
        number = f"{value:{self.number_format}}"
        return f"{number} {self.label}" if self.label_after else f"{self.label} {number}"


# What the console line shows, in this order, of the metrics a step writes (TensorBoard
# gets them all), then any in-training evaluation (EVAL_METRIC_PREFIX).
CONSOLE_FIELDS = (
    ConsoleField("reward_mean", "reward"),
    ConsoleField("loss", "loss"),
    ConsoleField("accuracy", "accuracy"),  # the reward-model trainer's pairwise accuracy
    ConsoleField("policy_lag_mean", "lag"),
    ConsoleField("policy_lag_max", "max lag", ".0f"),
    ConsoleField("samples_per_second", "samples/s", ",.0f", label_after=True),
)


def console_figures(
    metrics: Mapping[str, float], fields: Sequence[ConsoleField] = CONSOLE_FIELDS
) -> list[str]:
    """The texts of `fields` present in `metrics`, then of the evaluation metrics."""
    figures = [field.text(metrics[field.metric]) for field in fields if field.metric in metrics]
    evaluations = sorted(name for name in metrics if name.startswith(EVAL_METRIC_PREFIX))
    return figures + [ConsoleField(name, name).text(metrics[name]) for name in evaluations]


def format_duration(seconds: float) -> str:
    """45 -> "45s", 185 -> "3m05s", 7300 -> "2h01m"."""
    seconds = round(seconds)
    if seconds < SECONDS_PER_MINUTE:
        return f"{seconds}s"
    if seconds < SECONDS_PER_HOUR:
        return f"{seconds // SECONDS_PER_MINUTE}m{seconds % SECONDS_PER_MINUTE:02d}s"
    minutes = seconds // SECONDS_PER_MINUTE
    return f"{minutes // MINUTES_PER_HOUR}h{minutes % MINUTES_PER_HOUR:02d}m"


def format_console_line(
    step: int,
    total_steps: int | None,
    metrics: Mapping[str, float],
    eta_seconds: float | None = None,
    fields: Sequence[ConsoleField] = CONSOLE_FIELDS,
) -> str:
    """``step 40/300 | reward 0.51 | loss 1.23 | lag 1.5 | max lag 4 | 1,399 samples/s |
    ETA 2m10s``: the figures of `fields` that `metrics` holds, in their order."""
    progress = f"step {step}" if total_steps is None else f"step {step}/{total_steps}"
    eta = [] if eta_seconds is None else [f"ETA {format_duration(eta_seconds)}"]
    return LOG_FIELD_SEPARATOR.join([progress, *console_figures(metrics, fields), *eta])


class StepPace:
    """The time left to `total_steps`, at the pace since the first step it was told of (so
    the first step's compilation does not count)."""

    def __init__(self, total_steps: int | None, clock: Clock = time.monotonic):
        self.total_steps = total_steps
        self._clock = clock
        self._first: tuple[int, float] | None = None

    def eta_seconds(self, step: int) -> float | None:
        """Seconds left after `step` (call at every step); None before a pace is known."""
        now = self._clock()
        if self._first is None:
            self._first = (step, now)
        first_step, first_time = self._first
        if self.total_steps is None or step <= first_step:
            return None
        seconds_per_step = (now - first_time) / (step - first_step)
        return seconds_per_step * max(self.total_steps - step, 0)


def _unique_filename_suffix() -> str:
    """tensorboardX names files by the second and host only; two writers in one second
    on one host would write the same file, so each writer gets its own suffix."""
    return f".{uuid.uuid4().hex[:UNIQUE_SUFFIX_CHARS]}"


def progress_enabled(show_progress: bool, force_progress: bool, stream: TextIO) -> bool:
    """A bar is drawn when asked for and the stream is a terminal (or when forced)."""
    if not show_progress:
        return False
    return force_progress or (hasattr(stream, "isatty") and stream.isatty())


# --------------------------------------------------------------------------------------
# The writer.
# --------------------------------------------------------------------------------------


class MetricsWriter:
    """Writes every scalar to ``workdir/tensorboard`` on every call; on the console, a
    progress bar (when `show_progress` and stderr is a terminal) or else one concise line
    every `log_every` steps (`format_console_line`: `console_fields` and an ETA)."""

    def __init__(
        self,
        workdir: str,
        *,
        log_every: int,
        total_steps: int | None,
        show_progress: bool,
        force_progress: bool = False,
        progress_stream: TextIO | None = None,
        initial_step: int = 0,
        console_fields: Sequence[ConsoleField] = CONSOLE_FIELDS,
        clock: Clock = time.monotonic,
    ):
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}.")
        self.event_dir = os.path.join(workdir, TENSORBOARD_SUBDIR)
        self.log_every = log_every
        self.total_steps = total_steps
        self.console_fields = tuple(console_fields)
        self._pace = StepPace(total_steps, clock)
        self._summary_writer = tensorboardX.SummaryWriter(
            logdir=self.event_dir,
            flush_secs=FLUSH_SECONDS,
            filename_suffix=_unique_filename_suffix(),
        )
        stream = progress_stream if progress_stream is not None else sys.stderr
        self._progress_bar = tqdm.tqdm(
            total=total_steps,
            initial=initial_step,
            file=stream,
            unit="step",
            dynamic_ncols=True,
            disable=not progress_enabled(show_progress, force_progress, stream),
        )

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        scalars = {name: as_scalar(name, value) for name, value in metrics.items()}
        for name, value in scalars.items():
            self._summary_writer.add_scalar(name, value, global_step=step)
        eta_seconds = self._pace.eta_seconds(step)
        if not self._progress_bar.disable:
            self._advance_progress(step, scalars)
        elif step % self.log_every == 0:
            line = format_console_line(
                step, self.total_steps, scalars, eta_seconds, self.console_fields
            )
            logging.info(line)

    def flush(self) -> None:
        self._summary_writer.flush()

    def close(self) -> None:
        self._progress_bar.close()
        self._summary_writer.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _advance_progress(self, step: int, scalars: Mapping[str, float]) -> None:
        bar = self._progress_bar
        postfix = console_figures(scalars, self.console_fields)
        if postfix:
            bar.set_postfix_str(LOG_FIELD_SEPARATOR.join(postfix), refresh=False)
        if step > bar.n:
            bar.update(step - bar.n)


# --------------------------------------------------------------------------------------
# Time by phase and rates.
# --------------------------------------------------------------------------------------


class TimeSplit:
    """Thread-safe wall seconds by phase name ("generating", "scoring", "training", …).

    Phases measured in different threads may overlap, so `fractions` are shares
    of the summed phase time, not of the wall time of the run.
    """

    def __init__(self, clock: Clock = time.perf_counter):
        self._clock = clock
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def measure(self, name: str) -> Iterator[None]:
        start = self._clock()
        try:
            yield
        finally:
            self.add(name, self._clock() - start)

    def add(self, name: str, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"Phase {name!r} got negative time {seconds}; pass elapsed seconds.")
        with self._lock:
            self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._seconds)

    def fractions(self) -> dict[str, float]:
        totals = self.totals()
        overall = sum(totals.values())
        if overall == 0:
            return dict.fromkeys(totals, 0.0)
        return {name: seconds / overall for name, seconds in totals.items()}


class RateMeter:
    """Thread-safe counters (samples, tokens, …) turned into per-second rates."""

    def __init__(self, clock: Clock = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._start_time = clock()
        self._last_time = self._start_time
        self._counts: dict[str, float] = {}
        self._counts_at_last: dict[str, float] = {}

    def add(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + amount

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counts)

    def rates_since_start(self) -> dict[str, float]:
        with self._lock:
            elapsed = self._clock() - self._start_time
            return _rates(self._counts, {}, elapsed)

    def rates_since_last(self) -> dict[str, float]:
        """Rates over the interval since the previous call (or the start)."""
        with self._lock:
            now = self._clock()
            rates = _rates(self._counts, self._counts_at_last, now - self._last_time)
            self._last_time = now
            self._counts_at_last = dict(self._counts)
            return rates


def _rates(
    counts: Mapping[str, float], counts_before: Mapping[str, float], elapsed: float
) -> dict[str, float]:
    if elapsed <= 0:
        return dict.fromkeys(counts, 0.0)
    return {name: (count - counts_before.get(name, 0)) / elapsed for name, count in counts.items()}


# --------------------------------------------------------------------------------------
# Reading event files back (no TensorFlow, no tensorboard package).
# --------------------------------------------------------------------------------------


def _event_files(event_dir: str) -> list[str]:
    if not os.path.isdir(event_dir):
        raise FileNotFoundError(
            f"No TensorBoard folder {event_dir}; pass <workdir>/{TENSORBOARD_SUBDIR} of a run "
            "that wrote metrics."
        )
    names = sorted(name for name in os.listdir(event_dir) if EVENT_FILE_MARKER in name)
    return [os.path.join(event_dir, name) for name in names]


def _check_crc(path: str, offset: int, payload: bytes, crc_bytes: bytes) -> None:
    (expected,) = struct.unpack(RECORD_CRC_FORMAT, crc_bytes)
    if masked_crc32c(payload) != expected:
        raise ValueError(
            f"Corrupt TensorBoard record in {path} at byte {offset}; delete or move that file."
        )


def _read_records(path: str) -> Iterator[bytes]:
    """TFRecord payloads of `path`; stops quietly at a record still being written."""
    with open(path, "rb") as file:
        content = file.read()
    offset = 0
    header_bytes = RECORD_LENGTH_BYTES + RECORD_CRC_BYTES
    while offset + header_bytes <= len(content):
        length_bytes = content[offset : offset + RECORD_LENGTH_BYTES]
        length_crc = content[offset + RECORD_LENGTH_BYTES : offset + header_bytes]
        _check_crc(path, offset, length_bytes, length_crc)
        (length,) = struct.unpack(RECORD_LENGTH_FORMAT, length_bytes)
        data_start = offset + header_bytes
        data_end = data_start + length
        if data_end + RECORD_CRC_BYTES > len(content):
            return
        payload = content[data_start:data_end]
        _check_crc(path, offset, payload, content[data_end : data_end + RECORD_CRC_BYTES])
        yield payload
        offset = data_end + RECORD_CRC_BYTES


def _scalar_of(value: Any) -> float | None:
    """The scalar in a Summary.Value, or None for images, histograms and the like."""
    kind = value.WhichOneof("value")
    if kind == "simple_value":
        return float(value.simple_value)
    if kind == "tensor":
        numbers = list(value.tensor.float_val) or list(value.tensor.double_val)
        if len(numbers) == 1:
            return float(numbers[0])
    return None


def read_scalars(event_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Scalars of every event file in `event_dir` as ``{tag: [(step, value), …]}`` by step.

    When a step was written more than once (a run resumed from an older checkpoint),
    the value written last (by wall time) wins. Subfolders are not read.
    """
    by_tag: dict[str, dict[int, tuple[float, float]]] = {}
    for path in _event_files(event_dir):
        for record in _read_records(path):
            event = event_pb2.Event.FromString(record)
            if event.WhichOneof("what") != "summary":
                continue
            for value in event.summary.value:
                scalar = _scalar_of(value)
                if scalar is None:
                    continue
                points = by_tag.setdefault(value.tag, {})
                step = int(event.step)
                if step not in points or points[step][0] <= event.wall_time:
                    points[step] = (event.wall_time, scalar)
    return {
        tag: [(step, value) for step, (_, value) in sorted(points.items())]
        for tag, points in by_tag.items()
    }


def evaluation_curve(
    scalars: Mapping[str, list[tuple[int, float]]], metric: str
) -> list[tuple[int, float, float]]:
    """(step, value, RL seconds without the evaluations themselves) at each logged point of
    `metric` (an in-loop evaluation's, or any per-step scalar), from `read_scalars`' output:
    accuracy against wall-clock. A resumed run's segments each start their clock at 0; the
    seconds of a segment go on from where the one before it ended."""
    rl_seconds = dict(scalars.get(RL_SECONDS, []))
    evaluation_seconds = dict(scalars.get(EVAL_SECONDS, []))
    clock, offset, previous, spent = {}, 0.0, 0.0, 0.0
    for step in sorted(rl_seconds):
        if rl_seconds[step] < previous:  # a resumed segment's clock starts again
            offset += previous
        previous = rl_seconds[step]
        spent += evaluation_seconds.get(step, 0.0)
        clock[step] = offset + previous - spent
    return [(step, value, clock[step]) for step, value in scalars.get(metric, [])]
