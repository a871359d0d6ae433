"""What the train-step benchmarks share: a compiled step on a fixed batch, and the report."""
import resource
import time

import jax
import numpy as np

from bigpretrain import sharding
from bigpretrain import train


def synthetic_batch(exp) -> dict:
  """A fixed batch of this process's rows with the objective's fields, shaped like the
  pipeline's (input_pipeline.pipeline.record_fields)."""
  rows = exp.config.batch_size // jax.process_count()
  size = exp.config.data.image_size
  num_classes = exp.dataset.info.num_classes
  rng = np.random.default_rng(0)
  batch = {"image": rng.integers(0, 256, (rows, size, size, 3), np.uint8)}
  for name, length in exp.fields.items():
    if length == 0:
      batch[name] = rng.integers(0, num_classes, rows).astype(np.int32)
      continue
    ids = rng.integers(0, num_classes, (rows, length)).astype(np.int32)
    count = rng.integers(1, length + 1, rows).astype(np.int32)
    ids[np.arange(length)[None, :] >= count[:, None]] = -1
    batch[name], batch[f"num_{name}"] = ids, count
  return batch


class Runner:
  """A compiled train step on a fixed batch, ready to time."""

  def __init__(self, config, dataset=None):
    """`dataset` replaces config.data's (e.g. the plan's stand-in: a step needs only
    the dataset's info)."""
    self.config = config
    self.exp = train.build(config, dataset=dataset)
    self.state = self.exp.init_state()
    self.rows = synthetic_batch(self.exp)  # This process's, with the trainer's '_skipped'.
    self.rows["_skipped"] = np.zeros(len(self.rows["image"]), np.int32)
    self.batch = sharding.global_batch(self.rows, self.exp.mesh)
    t0 = time.perf_counter()
    with jax.set_mesh(self.exp.mesh):
      traced = self.exp.train_step().trace(self.state, self.batch, self.exp.frozen)
      self.step = traced.lower().compile()
    self.compile_s = time.perf_counter() - t0
    self.flops = self.exp.model_flops_per_device(self.state, self.batch, traced)
    self.run(1)  # Warm-up.

  def run(self, steps: int) -> float:
    """Seconds per step over `steps` steps."""
    return seconds_per_call(self._step, steps)

  def _step(self):
    self.state, metrics = self.step(self.state, self.batch, self.exp.frozen)
    return metrics


def seconds_per_call(fn, calls: int) -> float:
  """Seconds per call of `fn` over `calls` calls in a row, the last one's result waited for."""
  t0 = time.perf_counter()
  for _ in range(calls):
    out = fn()
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / calls


def report(config, step_s: float, compile_s: float) -> dict:
  """The benchmark contract's fields for one config."""
  out = {"config": config.objective.name, "model": config.model.name,
         "batch_size": config.batch_size, "image_size": config.data.image_size,
         "devices": jax.device_count(), "platform": jax.devices()[0].platform,
         "images_per_sec": config.batch_size / step_s, "step_time_ms": 1e3 * step_s,
         "compile_time_s": compile_s,
         "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    out["peak_device_mb"] = stats["peak_bytes_in_use"] / 2**20
  return out
