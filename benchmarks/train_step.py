"""Train-step speed for any config: one JSON line with images/s, step and compile time, memory.

  python benchmarks/train_step.py --config=configs/semantic_softmax.py --steps=20

Uses the real train step (objective, optimizer, shardings) on a fixed synthetic batch, so it
measures compute, not the input pipeline (see benchmarks/input_pipeline.py for that).
"""
import json
import resource
import sys
import time

from absl import app
from absl import flags
import jax
import numpy as np
from ml_collections import config_flags

from bigpretrain import sharding
from bigpretrain import train

_CONFIG = config_flags.DEFINE_config_file("config", None, "Recipe config.", lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps (after one warm-up step).")


def synthetic_batch(exp) -> dict:
  """A fixed batch of this process's rows, shaped like the pipeline's."""
  rows = exp.config.batch_size // jax.process_count()
  size = exp.config.data.image_size
  rng = np.random.default_rng(0)
  return {"image": rng.random((rows, size, size, 3), np.float32),
          "label": rng.integers(0, exp.dataset.info.num_classes, rows).astype(np.int32)}


def measure(config, steps: int) -> dict:
  exp = train.build(config)
  state = exp.init_state()
  batch = sharding.global_batch(synthetic_batch(exp), exp.mesh)
  step_fn = exp.train_step()
  t0 = time.perf_counter()
  with jax.set_mesh(exp.mesh):
    compiled = step_fn.lower(state, batch, exp.frozen).compile()
  compile_s = time.perf_counter() - t0
  state, m = compiled(state, batch, exp.frozen)  # Warm-up.
  jax.block_until_ready(m)
  t0 = time.perf_counter()
  for _ in range(steps):
    state, m = compiled(state, batch, exp.frozen)
  jax.block_until_ready(m)
  step_s = (time.perf_counter() - t0) / steps
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


def main(argv):
  del argv
  print(json.dumps(measure(_CONFIG.value, _STEPS.value)), flush=True)


if __name__ == "__main__":
  sys.exit(app.run(main))
