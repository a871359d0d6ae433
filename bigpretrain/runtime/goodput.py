"""Where a run's time goes: the trainer's 'perf/...' metrics and its profiler window.

Per log interval (all host timers; the only sync is the one the log step already does):
  perf/step_time_ms        wall time per step, measured sync-to-sync: the log step's
                           device_get waits for every dispatched step, so an interval spans
                           exactly the work of its steps (compile, evals, checkpoints and the
                           profiler's start and stop excluded). Like PaLM's MFU and MaxText's
                           step time, it includes input stalls: a starved accelerator shows as
                           low MFU.
  perf/data_wait_frac      share of that wall time spent in next(train_iter). The loop runs
                           ahead of the device (async dispatch), so when the device is the
                           bottleneck this tends to 0; when the input is, to the device's idle
                           share.
  perf/tflops_per_device   the step's FLOPs per device (its matrix products and convolutions,
                           counted on the jaxpr by bigpretrain/plan/flops.py: XLA:GPU's cost
                           analysis leaves out cuBLAS and cuDNN calls; with
                           rematerialisation they include the recompute) over the step time.
  perf/mfu                 tflops_per_device over the device's peak (peak_flops); omitted on CPU
                           and on devices the table does not know.
  perf/host_rss_mb         this process's resident memory.
On several processes, at log steps only (one small all-gather), also perf/slowest_step_time_ms
and perf/slowest_process, with a warning when the slowest is > 20% above the median (issue 11).
"""
import contextlib
import os
import resource
import sys
import time

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

from bigpretrain.plan import accelerators

STRAGGLER_RATIO = 1.2  # Issue 11: warn when the slowest process is > 20% above the median.
# Test and rehearsal hook: 'SECONDS' or 'SECONDS@PROCESS' delays every train batch by SECONDS
# (on process PROCESS only), e.g. to rehearse a slow-input host on launch/local.sh.
SLOW_INPUT_ENV = "BIGPRETRAIN_SLOW_INPUT"


def peak_flops(device_kind: str, compute_dtype: str) -> float | None:
  """Peak dense FLOP/s of one device of `device_kind` at `compute_dtype`, or None if unknown:
  bigpretrain.plan.accelerators' table, the one the plan's fit reads too."""
  chip = accelerators.by_device_kind(device_kind)
  return chip.peak(compute_dtype) if chip else None


def host_rss_mb() -> float:
  """Resident memory of this process in MiB (Linux /proc; elsewhere the peak, from getrusage)."""
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
  except (OSError, ValueError, IndexError):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS.
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def interval_metrics(*, wall_s: float, data_wait_s: float, steps: int, flops: float,
                     peak: float | None) -> dict:
  """The per-interval 'perf/...' values from its wall time, time in next(), step count, the
  step's FLOPs per device (0 = unknown) and the device's peak FLOP/s (None = unknown)."""
  if steps < 1 or wall_s <= 0:
    raise ValueError(f"An interval needs steps >= 1 and wall time > 0; got {steps}, {wall_s}.")
  step_s = wall_s / steps
  out = {"perf/step_time_ms": 1e3 * step_s,
         "perf/data_wait_frac": min(max(data_wait_s / wall_s, 0.0), 1.0)}
  if flops > 0:
    out["perf/tflops_per_device"] = flops / step_s / 1e12
    if peak:
      out["perf/mfu"] = flops / step_s / peak
  return out


def process_step_times(wall_s, blocked_s, steps: int) -> np.ndarray:
  """Per-process seconds per step: each process's interval wall time minus the time it waited
  at the cross-process sync points beyond the least-waiting process's wait. The processes
  advance together, so their wall times agree; the straggler is the one the others wait for,
  and it keeps the full wall time. This sees host-side stragglers (slow input, a busy CPU); a
  slow accelerator holds every process alike inside the step's collectives (see the trace)."""
  wall_s, blocked_s = np.asarray(wall_s, np.float64), np.asarray(blocked_s, np.float64)
  return (wall_s - (blocked_s - blocked_s.min())) / steps


def slowest(step_s) -> tuple[int, float, float, bool]:
  """(process id, its step time, the median step time, whether it is a straggler)."""
  step_s = np.asarray(step_s, np.float64)
  index = int(np.argmax(step_s))
  median = float(np.median(step_s))
  return index, float(step_s[index]), median, bool(step_s[index] > STRAGGLER_RATIO * median)


def parse_profile_steps(spec: str) -> tuple[int, int] | None:
  """config.profile_steps 'START,COUNT' -> (START, COUNT); '' -> None (no trace)."""
  if not isinstance(spec, str):
    raise ValueError(f"config.profile_steps={spec!r} must be a str 'START,COUNT' ('' = off).")
  if not spec.strip():
    return None
  parts = spec.split(",")
  try:
    start, count = (int(p) for p in parts) if len(parts) == 2 else (None, None)
  except ValueError:
    start = count = None
  if start is None or start < 1 or count < 1:
    raise ValueError(f"config.profile_steps={spec!r} must be 'START,COUNT' with ints START >= 1 "
                     "(the first traced step) and COUNT >= 1 (steps traced); '' = off.")
  return start, count


def input_delay(env=os.environ) -> float:
  """Seconds SLOW_INPUT_ENV adds to this process's every train batch (0.0 when unset)."""
  spec = env.get(SLOW_INPUT_ENV, "")
  if not spec:
    return 0.0
  seconds, _, process = spec.partition("@")
  try:
    delay, process = float(seconds), (int(process) if process else None)
  except ValueError:
    raise ValueError(f"{SLOW_INPUT_ENV}={spec!r} must be SECONDS or SECONDS@PROCESS.") from None
  return delay if process in (None, jax.process_index()) else 0.0


class IntervalTimer:
  """Host time of the current log interval: total (less excluded spans), in next(), and
  blocked at the points where processes wait for each other."""

  def __init__(self):
    self.reset()

  def reset(self) -> None:
    self._start = time.perf_counter()
    self.data_s = self.blocked_s = self.excluded_s = 0.0
    self.steps = 0

  @contextlib.contextmanager
  def _span(self, name: str):
    t0 = time.perf_counter()
    try:
      yield
    finally:
      setattr(self, name, getattr(self, name) + time.perf_counter() - t0)

  def data_wait(self):
    return self._span("data_s")

  def blocked(self):
    return self._span("blocked_s")

  def excluded(self):
    """Work outside the train steps (compile, evals, checkpoints, profiler start/stop)."""
    return self._span("excluded_s")

  @property
  def wall_s(self) -> float:
    return time.perf_counter() - self._start - self.excluded_s


class Goodput:
  """The trainer's goodput bookkeeping: time the loop with `timer`, give it the compiled step
  once, and call `metrics()` right after each log step's sync."""

  def __init__(self, compute_dtype: str):
    self.timer = IntervalTimer()
    self.flops = 0.0
    kind = jax.devices()[0].device_kind
    self.peak = peak_flops(kind, compute_dtype)
    if self.peak is None:
      logging.info("No peak FLOP/s known for device kind %r: perf/mfu is not logged.", kind)
    else:
      logging.info("perf/mfu against %.1f TFLOP/s per device (%s, %s).", self.peak / 1e12,
                   kind, compute_dtype)

  def set_flops(self, flops_per_device: float) -> None:
    """The step's FLOPs per device (bigpretrain/plan/flops.py)."""
    self.flops = flops_per_device

  def metrics(self) -> dict:
    """This interval's 'perf/...' values (the same on every process's return); warns about a
    straggler; starts the next interval. Every process must call it at the same steps."""
    t = self.timer
    out = interval_metrics(wall_s=t.wall_s, data_wait_s=t.data_s, steps=t.steps,
                           flops=self.flops, peak=self.peak)
    out["perf/host_rss_mb"] = host_rss_mb()
    if jax.process_count() > 1:
      mine = np.array([t.wall_s, t.blocked_s, t.data_s], np.float32)
      wall, blocked, data = multihost_utils.process_allgather(mine).T
      index, step_s, median, straggler = slowest(process_step_times(wall, blocked, t.steps))
      out["perf/slowest_step_time_ms"] = 1e3 * step_s
      out["perf/slowest_process"] = index
      if straggler and jax.process_index() == 0:
        message = (f"Straggler: process {index} takes {1e3 * step_s:.1f} ms/step, "
                   f"{100 * (step_s / median - 1):.0f}% above the median {1e3 * median:.1f} "
                   f"ms/step ({100 * data[index] / wall[index]:.0f}% of its time waiting for "
                   "input).")
        logging.warning(message)
        print(f"WARNING: {message}", flush=True)
    t.reset()
    return out


class Profiler:
  """A jax.profiler trace of steps START..START+COUNT-1 (config.profile_steps) into `logdir`,
  where TensorBoard's profile tab finds it (each process writes its own host's trace)."""

  def __init__(self, spec: str, logdir: str, last_step: int):
    window = parse_profile_steps(spec)
    self.start, self.stop = (None, None) if window is None else (
        window[0], min(window[0] + window[1] - 1, last_step))
    self.logdir, self.active = logdir, False

  def before_step(self, step: int) -> None:
    """Starts the trace before step START's batch is read (the input shows in the trace)."""
    if step == self.start:
      os.makedirs(self.logdir, exist_ok=True)
      jax.profiler.start_trace(self.logdir)
      self.active = True

  def after_step(self, step: int, outputs, timer: IntervalTimer) -> None:
    """Stops it once the last traced step's `outputs` are computed. The wait for them is the
    dispatched steps' own time: it stays in `timer`'s interval (as `blocked`, like the log
    step's sync it stands in for); only stopping the trace is excluded from it."""
    if self.active and step >= self.stop:
      with timer.blocked():
        jax.block_until_ready(outputs)
      with timer.excluded():
        jax.profiler.stop_trace()
      self.active = False
      print(f"Profiler trace of steps {self.start}-{step} written to {self.logdir}", flush=True)

  def close(self) -> None:
    """Stops a trace the run left open (e.g. preempted inside the window)."""
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
