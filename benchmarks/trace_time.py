"""Seconds to trace a recipe's train step (the abstract init and the step, as the plan does:
no compile, nothing allocated) with JAX's own Tracer.sharding and with the one
bigpretrain/runtime/tracer_sharding.py installs, in alternated rounds; one JSON line.

  python benchmarks/trace_time.py \
      --config=configs/semantic_softmax.py:dataset=imagenet21k_p,model=vit_b16 \
      --config.batch_size=8 --config.data.image_size=224 --config.compute_dtype=bfloat16
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from jax._src import core  # pylint: disable=g-import-not-at-top

JAX_SHARDING = core.Tracer.__dict__["sharding"]  # Before the models package replaces it.

import json  # pylint: disable=g-import-not-at-top,wrong-import-order
import resource
import statistics
import time

from absl import app
from absl import flags
from ml_collections import config_flags

from bigpretrain.plan import aot_plan
from bigpretrain.runtime import distributed

_CONFIG = config_flags.DEFINE_config_file("config", None, "Recipe config.", lock_config=True)
_NUM_CLASSES = flags.DEFINE_integer("num_classes", None, "Classes of a dataset without a "
                                    "class list in the package (as the plan's flag).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Alternated rounds per variant.")


def trace_seconds(config, prop) -> tuple[float, int]:
  """Seconds to trace `config`'s step with Tracer.sharding = `prop`, and its equations."""
  core.Tracer.sharding = prop
  t0 = time.perf_counter()
  _, _, traced = aot_plan.trace_step(config, _NUM_CLASSES.value)
  return time.perf_counter() - t0, len(traced.jaxpr.eqns)


def main(argv):
  del argv
  distributed.select_platforms()  # No plugin errors on a host without their devices.
  installed = core.Tracer.__dict__["sharding"]
  if installed is JAX_SHARDING:
    raise SystemExit("This JAX's Tracer.sharding walks no equations (tracer_sharding "
                     "installed nothing): nothing to compare.")
  variants = {"jax": JAX_SHARDING, "installed": installed}
  times = {k: [] for k in variants}
  eqns = None
  try:
    for _ in range(_ROUNDS.value):  # Alternate, so drifts in machine load hit both alike.
      for name, prop in variants.items():
        seconds, eqns = trace_seconds(_CONFIG.value, prop)
        times[name].append(seconds)
  finally:
    core.Tracer.sharding = installed
  median = {k: statistics.median(v) for k, v in times.items()}
  config = _CONFIG.value
  print(json.dumps({
      "model": config.model.name, "batch_size": config.batch_size,
      "image_size": config.data.image_size, "step_equations": eqns,
      "trace_s_jax_sharding": median["jax"], "trace_s_installed": median["installed"],
      "speedup": median["jax"] / median["installed"], "rounds_s": times,
      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)


if __name__ == "__main__":
  sys.exit(app.run(main))
