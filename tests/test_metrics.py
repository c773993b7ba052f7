"""Tests for tba_jax.metrics: TensorBoard round trip, the console line, progress, timers,
rates."""

from __future__ import annotations

import importlib.util
import io
import logging as std_logging
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from tba_jax.metrics import (
    EVAL_SECONDS,
    RL_SECONDS,
    TENSORBOARD_SUBDIR,
    MetricsWriter,
    RateMeter,
    StepPace,
    TimeSplit,
    evaluation_curve,
    format_console_line,
    format_duration,
    progress_enabled,
    read_scalars,
)

THREADS = 8
ADDS_PER_THREAD = 500


class FakeClock:
    def __init__(self, start: float = 100.0):
        self.now = start

    def __call__(self) -> float:
        return self.now


class TtyStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def make_writer(tmp_path, **overrides) -> MetricsWriter:
    options = {"log_every": 2, "total_steps": 6, "show_progress": False}
    options.update(overrides)
    return MetricsWriter(str(tmp_path), **options)


def steps_metrics(step: int) -> dict:
    # float32-exact values: TensorBoard stores scalars as float32.
    return {"loss": 1.5 / step, "reward": np.float32(0.25 * step), "kl": np.array(step * 2.0)}


def test_written_scalars_read_back_with_same_values(tmp_path):
    with make_writer(tmp_path) as writer:
        for step in range(1, 5):
            writer.write(step, steps_metrics(step))

    scalars = read_scalars(os.path.join(tmp_path, TENSORBOARD_SUBDIR))

    assert set(scalars) == {"loss", "reward", "kl"}
    for name in scalars:
        steps = [step for step, _ in scalars[name]]
        values = [value for _, value in scalars[name]]
        assert steps == [1, 2, 3, 4]
        expected = [float(np.float32(steps_metrics(step)[name])) for step in steps]
        assert values == pytest.approx(expected)


def test_resumed_run_overrides_repeated_steps(tmp_path):
    with make_writer(tmp_path) as writer:
        for step in (1, 2, 3):
            writer.write(step, {"loss": float(step)})
    with make_writer(tmp_path, initial_step=2) as resumed:
        for step in (3, 4):
            resumed.write(step, {"loss": 10.0 * step})

    event_dir = os.path.join(tmp_path, TENSORBOARD_SUBDIR)
    assert len([name for name in os.listdir(event_dir) if "tfevents" in name]) == 2
    assert read_scalars(event_dir)["loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_read_scalars_stops_at_partially_written_record(tmp_path):
    with make_writer(tmp_path) as writer:
        for step in (1, 2):
            writer.write(step, {"loss": float(step)})
    event_dir = os.path.join(tmp_path, TENSORBOARD_SUBDIR)
    (event_file,) = os.listdir(event_dir)
    path = os.path.join(event_dir, event_file)
    with open(path, "rb") as file:
        content = file.read()
    with open(path, "wb") as file:
        file.write(content[:-3])  # the last record is cut short, as while writing

    assert read_scalars(event_dir)["loss"] == [(1, 1.0)]


def test_read_scalars_names_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="tensorboard"):
        read_scalars(str(tmp_path / "no_such_run"))


def test_non_scalar_metric_is_refused(tmp_path):
    with make_writer(tmp_path) as writer, pytest.raises(ValueError, match=r"'loss'.*scalar"):
        writer.write(1, {"loss": np.ones(3)})


def test_console_line_is_concise_and_in_a_fixed_order():
    metrics = {
        "kl_mean": 1e-5,
        "samples_per_second": 1428.4,
        "policy_lag_max": 3.0,
        "loss": 1.23456,
        "eval_accuracy": 0.75,
        "policy_lag_mean": 1.5,
        "reward_mean": 0.51234,
        "buffer_num_trajectories": 3200.0,
    }
    line = format_console_line(40, 200, metrics, eta_seconds=130)
    assert line == (
        "step 40/200 | reward 0.5123 | loss 1.235 | lag 1.5 | max lag 3 | 1,428 samples/s | "
        "eval_accuracy 0.75 | ETA 2m10s"
    )
    assert format_console_line(7, None, {"loss": 2.0}) == "step 7 | loss 2"


def test_durations_read_as_seconds_minutes_or_hours():
    assert [format_duration(s) for s in (0, 45.4, 185, 7300)] == ["0s", "45s", "3m05s", "2h01m"]


def test_eta_is_the_pace_since_the_first_step_times_the_steps_left():
    clock = FakeClock()
    pace = StepPace(total_steps=10, clock=clock)
    assert pace.eta_seconds(1) is None  # the first step (compiling) sets the start
    clock.now += 4.0
    assert pace.eta_seconds(3) == pytest.approx(2.0 * 7)
    clock.now += 2.0
    assert pace.eta_seconds(4) == pytest.approx(2.0 * 6)
    assert StepPace(total_steps=None, clock=clock).eta_seconds(5) is None


def test_writer_logs_a_console_line_every_log_every_steps(tmp_path, caplog):
    caplog.set_level(std_logging.INFO)
    clock = FakeClock()
    with make_writer(tmp_path, log_every=2, total_steps=4, clock=clock) as writer:
        for step in range(1, 5):
            clock.now += 1.0
            writer.write(step, {"reward_mean": 0.5, "loss": 1.0, "beta": 0.1})
    lines = [record.getMessage() for record in caplog.records if "step " in record.getMessage()]
    assert lines == [
        "step 2/4 | reward 0.5 | loss 1 | ETA 2s",
        "step 4/4 | reward 0.5 | loss 1 | ETA 0s",
    ]
    scalars = read_scalars(os.path.join(tmp_path, TENSORBOARD_SUBDIR))
    assert set(scalars) == {"reward_mean", "loss", "beta"}  # TensorBoard keeps every name


def test_a_drawn_progress_bar_replaces_the_console_line(tmp_path, caplog):
    caplog.set_level(std_logging.INFO)
    stream = io.StringIO()
    options = dict(show_progress=True, force_progress=True, progress_stream=stream)
    with make_writer(tmp_path, log_every=1, **options) as writer:
        writer.write(1, {"loss": 0.5})
    assert not [record for record in caplog.records if "step " in record.getMessage()]
    assert "loss 0.5" in stream.getvalue()


def test_progress_bar_only_on_terminals_unless_forced():
    assert not progress_enabled(False, True, TtyStream())
    assert progress_enabled(True, False, TtyStream())
    assert not progress_enabled(True, False, io.StringIO())
    assert progress_enabled(True, True, io.StringIO())


def test_forced_progress_bar_tracks_steps(tmp_path):
    stream = io.StringIO()
    with make_writer(
        tmp_path, show_progress=True, force_progress=True, progress_stream=stream
    ) as writer:
        for step in range(1, 7):
            writer.write(step, {"loss": 0.5})
    output = stream.getvalue()
    assert "6/6" in output
    assert "loss 0.5" in output


def test_hidden_progress_bar_writes_nothing(tmp_path):
    stream = io.StringIO()
    with make_writer(tmp_path, show_progress=True, progress_stream=stream) as writer:
        writer.write(1, {"loss": 0.5})
    assert stream.getvalue() == ""


def run_in_threads(target) -> None:
    threads = [threading.Thread(target=target) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_time_split_sums_from_threads_and_fractions():
    split = TimeSplit()

    def add_many():
        for _ in range(ADDS_PER_THREAD):
            split.add("generating", 0.5)
            split.add("training", 0.25)

    run_in_threads(add_many)

    totals = split.totals()
    assert totals["generating"] == pytest.approx(THREADS * ADDS_PER_THREAD * 0.5)
    assert totals["training"] == pytest.approx(THREADS * ADDS_PER_THREAD * 0.25)
    assert split.fractions() == pytest.approx({"generating": 2 / 3, "training": 1 / 3})


def test_time_split_measure_uses_clock_even_on_error():
    clock = FakeClock()
    split = TimeSplit(clock=clock)
    with split.measure("scoring"):
        clock.now += 2.0
    with pytest.raises(RuntimeError), split.measure("scoring"):
        clock.now += 1.0
        raise RuntimeError("boom")
    assert split.totals() == {"scoring": pytest.approx(3.0)}
    assert TimeSplit().fractions() == {}


def test_time_split_refuses_negative_time():
    with pytest.raises(ValueError, match="negative"):
        TimeSplit().add("waiting", -1.0)


def test_rate_meter_since_start_and_since_last():
    clock = FakeClock()
    meter = RateMeter(clock=clock)
    meter.add("samples", 10)
    meter.add("tokens", 400)
    clock.now += 2.0
    assert meter.rates_since_last() == {"samples": 5.0, "tokens": 200.0}

    meter.add("samples", 30)
    clock.now += 3.0
    assert meter.rates_since_last() == {"samples": 10.0, "tokens": 0.0}
    assert meter.rates_since_start() == {"samples": 8.0, "tokens": 80.0}
    assert meter.totals() == {"samples": 40, "tokens": 400}


def test_rate_meter_counts_from_threads():
    clock = FakeClock()
    meter = RateMeter(clock=clock)
    run_in_threads(lambda: [meter.add("samples") for _ in range(ADDS_PER_THREAD)])
    clock.now += 4.0
    assert meter.totals() == {"samples": THREADS * ADDS_PER_THREAD}
    assert meter.rates_since_start() == {"samples": THREADS * ADDS_PER_THREAD / 4.0}


def test_rate_meter_with_no_elapsed_time_reports_zero():
    meter = RateMeter(clock=FakeClock())
    meter.add("samples", 3)
    assert meter.rates_since_start() == {"samples": 0.0}


def test_evaluation_curve_leaves_evaluations_out_and_joins_resumed_segments():
    scalars = {
        RL_SECONDS: [(1, 5.0), (2, 7.0), (3, 10.0), (4, 1.0), (5, 3.0)],  # resumed at step 4
        EVAL_SECONDS: [(2, 1.0), (5, 0.5)],
        "eval_accuracy": [(2, 0.25), (5, 0.5)],
        "reward_mean": [(step, 0.1 * step) for step in range(1, 6)],
    }
    assert evaluation_curve(scalars, "eval_accuracy") == [(2, 0.25, 6.0), (5, 0.5, 11.5)]
    seconds = [seconds for _, _, seconds in evaluation_curve(scalars, "reward_mean")]
    assert seconds == [5.0, 6.0, 9.0, 10.0, 11.5]
    assert evaluation_curve(scalars, "absent") == []


TORCH_INSTALLED = importlib.util.find_spec("torch") is not None


def assert_python_prints_ok(script: str) -> None:
    """Runs `script` in a fresh interpreter (nothing imported yet); it must print 'ok'."""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


def test_the_launchers_start_without_importing_torch():
    """tensorboardX's writer imports torch when it is installed (seconds of every launcher's
    start); metrics imports it with torch hidden, and torch still imports afterwards."""
    assert_python_prints_ok(
        "import sys\n"
        "import tba_jax.train, tba_jax.cli\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        + ("import torch\nassert torch.ones(2).sum().item() == 2.0\n" if TORCH_INSTALLED else "")
        + "print('ok')\n"
    )


@pytest.mark.skipif(not TORCH_INSTALLED, reason="torch is not installed")
def test_tensorboardx_imported_beside_torch_accepts_its_tensors():
    """With torch imported first, tensorboardX is imported as usual (torch stays imported)."""
    assert_python_prints_ok(
        "import torch\n"
        "from tba_jax import metrics\n"
        "assert metrics.tensorboardX.writer.numpy_compatible is torch.Tensor\n"
        "import sys; assert sys.modules['torch'] is torch\n"
        "print('ok')\n"
    )
