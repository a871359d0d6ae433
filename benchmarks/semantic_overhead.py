"""Semantic softmax vs single-label train step, same model and batch, timed side by side.

  python benchmarks/semantic_overhead.py --steps=10 --rounds=5 [--config.model.name=...]

The ImageNet-21K paper says the per-level softmaxes add negligible overhead; this prints one
JSON line with both step times (median over alternated rounds) and their ratio.
"""
import os
import sys

# Run as a script, Python puts benchmarks/ first on sys.path, where input_pipeline.py would
# shadow the input_pipeline package: put the repository root there instead.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import json
import statistics

from absl import app
from absl import flags
from ml_collections import config_flags

from benchmarks import common
from bigpretrain.runtime import distributed
from configs import single_label

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/semantic_softmax.py", "Semantic config; the single-label one copies it.")
_STEPS = flags.DEFINE_integer("steps", 10, "Steps per timed round.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Alternated rounds per variant.")


def main(argv):
  del argv
  distributed.select_platforms()  # No plugin errors on a host without their devices.
  semantic = _CONFIG.value
  single = semantic.copy_and_resolve_references()
  single.objective = single_label.get_config().objective
  runners = {"semantic": common.Runner(semantic), "single_label": common.Runner(single)}
  times = {k: [] for k in runners}
  for _ in range(_ROUNDS.value):  # Alternate, so drifts in machine load hit both alike.
    for name, runner in runners.items():
      times[name].append(runner.run(_STEPS.value))
  median = {k: statistics.median(v) for k, v in times.items()}
  out = common.report(semantic, median["semantic"], runners["semantic"].compile_s)
  out.update({"single_label_step_time_ms": 1e3 * median["single_label"],
              "semantic_over_single_ratio": median["semantic"] / median["single_label"]})
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  sys.exit(app.run(main))
