"""Train-step speed for any config: one JSON line with images/s, step and compile time, memory.

  python benchmarks/train_step.py --config=configs/semantic_softmax.py --steps=20

Uses the real train step (objective, optimizer, shardings) on a fixed synthetic batch, so it
measures compute, not the input pipeline (see benchmarks/input_pipeline.py for that).

With --models, the config's recipe runs once per named model (e.g. TResNet-M next to
ResNet-50, the ImageNet-21K paper's claim that TResNet-M trains as fast):

  python benchmarks/train_step.py --config=configs/semantic_softmax.py \
      --models=resnet50,tresnet_m --rounds=3 --steps=3 --config.data.image_size=64

The models' runs alternate round by round, so drifts in machine load hit all alike; the line
reports the first model's figures and, per model, the median step time and its ratio to the
first model's (median over rounds of each round's ratio).
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


def define_flags() -> None:
  """The command's flags, defined only when it runs (other benchmarks import this module)."""
  config_flags.DEFINE_config_file("config", None, "Recipe config.", lock_config=True)
  flags.DEFINE_integer("steps", 20, "Timed steps (after one warm-up step).")
  flags.DEFINE_list("models", [], "Registered model names to compare (the first is the "
                    "reference); empty: the config's model alone.")
  flags.DEFINE_integer("rounds", 3, "Alternated rounds per model with --models.")


def measure(config, steps: int) -> dict:
  runner = common.Runner(config)
  return common.report(config, runner.run(steps), runner.compile_s)


def with_model(config, name: str):
  """A copy of `config` training the registered model `name` with its default options."""
  out = config.copy_and_resolve_references()
  with out.unlocked():
    out.model = {"name": name}
  return out


def compare(config, names: list[str], steps: int, rounds: int, dataset=None) -> dict:
  """Step times of `names` under `config`'s recipe, timed in alternated rounds (`dataset`:
  see common.Runner)."""
  if len(set(names)) != len(names) or rounds < 1:
    raise ValueError(f"--models must name distinct models and --rounds be >= 1; got "
                     f"{names}, {rounds}")
  configs = {n: with_model(config, n) for n in names}
  runners = {n: common.Runner(c, dataset) for n, c in configs.items()}
  times = {n: [] for n in names}
  for _ in range(rounds):
    for name, runner in runners.items():
      times[name].append(runner.run(steps))
  ref = names[0]
  out = common.report(configs[ref], statistics.median(times[ref]), runners[ref].compile_s)
  out["models"] = {
      n: {"step_time_ms": 1e3 * statistics.median(times[n]),
          "images_per_sec": config.batch_size / statistics.median(times[n]),
          "compile_time_s": runners[n].compile_s,
          f"time_ratio_to_{ref}": statistics.median(
              [t / r for t, r in zip(times[n], times[ref])]),
          "step_time_ms_rounds": [1e3 * t for t in times[n]]}
      for n in names}
  return out


def main(argv):
  del argv
  distributed.select_platforms()  # No plugin errors on a host without their devices.
  f = flags.FLAGS
  if f.models:
    out = compare(f.config, f.models, f.steps, f.rounds)
  else:
    out = measure(f.config, f.steps)
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  define_flags()
  sys.exit(app.run(main))
