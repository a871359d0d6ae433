"""Goodput metrics ('perf/...') of the trainer: the formulas by hand, tiny runs that log them to
metrics.jsonl and TensorBoard, a slow input raising the data-wait share, a profiler trace, and
a straggler among two processes."""
import glob
import os
import struct
import subprocess
import sys
import time

import ml_collections
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from bigpretrain.plan import aot_plan
from bigpretrain import config_lib
from bigpretrain.runtime import goodput
from bigpretrain.runtime import metric_writers
from bigpretrain import train
from tests import helpers

PERF_KEYS = ("perf/step_time_ms", "perf/data_wait_frac", "perf/tflops_per_device", "perf/mfu",
             "perf/host_rss_mb")
FAKE_PEAK = 2e11  # FLOP/s the test pretends the CPU device has, so that MFU is logged.


def test_interval_metrics_by_hand():
  # 4 steps in 2 s, 0.5 s of it in next(): 500 ms/step; 3 TFLOP per step per device in 0.5 s
  # is 6 TFLOP/s, against a 12 TFLOP/s peak an MFU of 0.5.
  got = goodput.interval_metrics(wall_s=2.0, data_wait_s=0.5, steps=4, flops=3e12, peak=12e12)
  assert got == pytest.approx({"perf/step_time_ms": 500.0, "perf/data_wait_frac": 0.25,
                               "perf/tflops_per_device": 6.0, "perf/mfu": 0.5})
  unknown_peak = goodput.interval_metrics(wall_s=2.0, data_wait_s=0.5, steps=4, flops=3e12,
                                          peak=None)
  assert "perf/mfu" not in unknown_peak and unknown_peak["perf/tflops_per_device"] == 6.0
  no_flops = goodput.interval_metrics(wall_s=1.0, data_wait_s=0.0, steps=1, flops=0.0, peak=1e12)
  assert set(no_flops) == {"perf/step_time_ms", "perf/data_wait_frac"}
  with pytest.raises(ValueError, match="steps >= 1"):
    goodput.interval_metrics(wall_s=1.0, data_wait_s=0.0, steps=0, flops=0.0, peak=None)


def test_peak_flops_by_device_kind_and_dtype():
  # Vendors' dense figures: v5e 197 TFLOP/s bf16; H100 SXM TF32 989/2 (sparsity) for float32
  # at DEFAULT precision; A100 bf16 312; CPUs and unknown devices have no peak.
  assert goodput.peak_flops("TPU v5 lite", "bfloat16") == 197e12
  assert goodput.peak_flops("TPU v5 lite", "float32") == 197e12  # f32 matmuls run as bf16.
  assert goodput.peak_flops("NVIDIA H100 80GB HBM3", "float32") == 494.5e12
  assert goodput.peak_flops("NVIDIA A100-SXM4-80GB", "bfloat16") == 312e12
  assert goodput.peak_flops("cpu", "float32") is None
  assert goodput.peak_flops("TPU v9 imaginary", "bfloat16") is None


def test_straggler_is_the_process_the_others_wait_for():
  # 10 steps in 10 s on each process; processes 0 and 1 waited 8 s at the sync points,
  # process 2 only 2 s: it is the one they waited for. Own times: 10 - 6 = 4 s, 4 s, 10 s.
  step_s = goodput.process_step_times([10.0, 10.0, 10.0], [8.0, 8.0, 2.0], steps=10)
  np.testing.assert_allclose(step_s, [0.4, 0.4, 1.0])
  assert goodput.slowest(step_s) == (2, 1.0, 0.4, True)
  # Balanced processes (jitter only) and exactly 20% above the median are not stragglers.
  balanced = goodput.process_step_times([10.0, 10.01], [5.0, 5.02], steps=10)
  assert not goodput.slowest(balanced)[3]
  assert goodput.slowest([1.0, 1.0, 1.2]) == (2, 1.2, 1.0, False)


def test_profile_steps_and_slow_input_specs():
  assert goodput.parse_profile_steps("") is None
  assert goodput.parse_profile_steps("3,2") == (3, 2)
  for bad in ("3", "a,b", "0,1", "1,0", "1,2,3"):
    with pytest.raises(ValueError, match="config.profile_steps"):
      goodput.parse_profile_steps(bad)
  with pytest.raises(ValueError, match="config.profile_steps='5'"):
    config_lib.validate(helpers.tiny_config(profile_steps="5"))
  assert goodput.input_delay({}) == 0.0
  assert goodput.input_delay({goodput.SLOW_INPUT_ENV: "0.5"}) == 0.5
  assert goodput.input_delay({goodput.SLOW_INPUT_ENV: "0.5@0"}) == 0.5  # This is process 0.
  assert goodput.input_delay({goodput.SLOW_INPUT_ENV: "0.5@1"}) == 0.0
  with pytest.raises(ValueError, match=goodput.SLOW_INPUT_ENV):
    goodput.input_delay({goodput.SLOW_INPUT_ENV: "slow"})


class _Outputs:
  """Step outputs the device needs `seconds` more to compute."""

  def __init__(self, seconds: float):
    self.seconds = seconds

  def block_until_ready(self):
    time.sleep(self.seconds)
    return self


def test_the_wait_that_ends_a_trace_is_the_steps_time_its_stop_is_not(tmp_path):
  profiler = goodput.Profiler("1,1", str(tmp_path), last_step=10)
  profiler.before_step(1)
  timer = goodput.IntervalTimer()  # The interval starts after the trace did.
  wait = 0.3
  profiler.after_step(1, _Outputs(wait), timer)
  assert not profiler.active
  assert timer.blocked_s >= wait and timer.wall_s >= wait  # The steps' wait stays in.
  assert timer.excluded_s > 0  # The stop alone is left out.
  assert glob.glob(os.path.join(tmp_path, "plugins", "profile", "*", "*.xplane.pb"))


def _config(**overrides):
  """A tiny run without evaluators (their final eval is not what these tests time)."""
  config = helpers.tiny_config(**overrides)
  config.evals = ml_collections.ConfigDict()
  return config


def _train_rows(workdir) -> list[dict]:
  return [r for r in metric_writers.read_metrics(str(workdir)) if "train/loss" in r]


def _tensorboard_tags(workdir) -> set[str]:
  """Scalar tags in the TensorBoard event files (TFRecord framing: length, crc, data, crc)."""
  tags = set()
  for path in glob.glob(os.path.join(workdir, "events.out.tfevents*")):
    with open(path, "rb") as f:
      data = f.read()
    i = 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      tags.update(v.tag for v in event.summary.value)
      i += 12 + n + 4
  return tags


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
  """A tiny run with a fake CPU peak (so MFU is logged) and steps 3-4 profiled."""
  workdir = tmp_path_factory.mktemp("baseline")
  config = _config(total_steps=6, log_every_steps=2, profile_steps="3,2")
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(goodput, "peak_flops", lambda kind, dtype: FAKE_PEAK)
    train.train_and_evaluate(config, str(workdir))
  return workdir, config


def test_perf_metrics_in_metrics_jsonl_and_tensorboard(baseline):
  workdir, config = baseline
  rows = _train_rows(workdir)
  assert [r["step"] for r in rows] == [2, 4, 6]
  for row in rows:
    for key in PERF_KEYS:
      assert key in row, key
    assert 0.0 <= row["perf/data_wait_frac"] <= 1.0
    assert row["perf/step_time_ms"] > 0 and row["perf/host_rss_mb"] > 10
    # The same interval time gives images/s.
    assert row["train/images_per_sec"] == pytest.approx(
        config.batch_size / (row["perf/step_time_ms"] / 1e3), rel=0.02)
  assert "perf/compile_s" in rows[0] and "perf/compile_s" not in rows[1]
  assert "perf/slowest_process" not in rows[0]  # One process: no straggler fields.
  assert set(PERF_KEYS) <= _tensorboard_tags(str(workdir))


def test_mfu_is_step_flops_over_step_time_over_peak(baseline):
  workdir, config = baseline
  # The same step, traced apart from the run; the count itself: tests/test_flops.py.
  _, _, _, flops = aot_plan.compile_step(config)
  assert flops > 0
  for row in _train_rows(workdir):
    step_s = row["perf/step_time_ms"] / 1e3
    assert row["perf/tflops_per_device"] == pytest.approx(flops / step_s / 1e12, rel=1e-6)
    assert row["perf/mfu"] == pytest.approx(flops / step_s / FAKE_PEAK, rel=1e-6)


def test_profiler_trace_is_written(baseline):
  workdir, _ = baseline
  traces = glob.glob(os.path.join(workdir, "profile", "process_0", "plugins", "profile", "*",
                                  "*.xplane.pb"))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0


def test_a_run_that_stops_inside_the_window_writes_its_trace(tmp_path, monkeypatch):
  next_batch, calls = train._next_batch, []  # pylint: disable=protected-access

  def failing(*args):
    calls.append(1)
    if len(calls) == 4:  # Step 4's batch, inside the window of steps 3-4.
      raise RuntimeError("the input stopped")
    return next_batch(*args)

  monkeypatch.setattr(train, "_next_batch", failing)
  with pytest.raises(RuntimeError, match="the input stopped"):
    train.train_and_evaluate(_config(total_steps=6, log_every_steps=2, profile_steps="3,2"),
                             str(tmp_path))
  traces = glob.glob(os.path.join(tmp_path, "profile", "process_0", "plugins", "profile", "*",
                                  "*.xplane.pb"))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0


def test_slow_input_raises_data_wait(baseline, tmp_path, monkeypatch):
  delay = 0.5
  monkeypatch.setenv(goodput.SLOW_INPUT_ENV, str(delay))
  train.train_and_evaluate(_config(total_steps=4, log_every_steps=2), str(tmp_path))
  slow = _train_rows(tmp_path)
  for row in slow:
    assert 0.0 <= row["perf/data_wait_frac"] <= 1.0
    # Each step waited at least `delay` in next(): the data-wait share of the step time.
    assert row["perf/data_wait_frac"] * row["perf/step_time_ms"] >= 1e3 * delay * 0.99
  # Past the first interval (whose wait includes the input workers' start-up), the share rose.
  base = _train_rows(baseline[0])
  assert slow[-1]["perf/data_wait_frac"] > base[-1]["perf/data_wait_frac"]
