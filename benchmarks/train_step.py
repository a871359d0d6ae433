"""Train-step speed for any config: one JSON line with images/s, step and compile time, memory.

  python benchmarks/train_step.py --config=configs/semantic_softmax.py --steps=20

Uses the real train step (objective, optimizer, shardings) on a fixed synthetic batch, so it
measures compute, not the input pipeline (see benchmarks/input_pipeline.py for that).
"""
import os
import sys

# Run as a script, Python puts benchmarks/ first on sys.path, where input_pipeline.py would
# shadow the input_pipeline package: put the repository root there instead.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import json

from absl import app
from absl import flags
from ml_collections import config_flags

from benchmarks import common

_CONFIG = config_flags.DEFINE_config_file("config", None, "Recipe config.", lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps (after one warm-up step).")


def measure(config, steps: int) -> dict:
  runner = common.Runner(config)
  return common.report(config, runner.run(steps), runner.compile_s)


def main(argv):
  del argv
  print(json.dumps(measure(_CONFIG.value, _STEPS.value)), flush=True)


if __name__ == "__main__":
  sys.exit(app.run(main))
