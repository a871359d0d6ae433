"""cosub costs: efficient vs masked stochastic depth, and a cosub step vs a plain step.

  python benchmarks/cosub.py                    # ViT-S/16 at 112 px, batch 64, tau 0.5
  python benchmarks/cosub.py --model=vit_b16 --image_size=224 --batch_size=32

Builds three real train steps of configs/cosub_in1k.py (LAMB, mixup/cutmix, binarised BCE) for
the same ViT, batch and tau, side by side in one process:
  masked  stochastic_depth='mask', num_submodels=1
  plain   stochastic_depth='esd',  num_submodels=1   (ESD; the cosub baseline)
  cosub   stochastic_depth='esd',  num_submodels=2
Memory is each compiled step's `memory_analysis()` (temp + output bytes), so the variants
cannot be mixed up. Time: in each round the variants run back to back; a ratio is the median
over rounds of that round's ratio, so drifts in machine load cancel out. Prints one JSON line:
esd_memory_ratio and esd_time_ratio (ESD / masked), cosub_time_ratio (cosub / plain), and the
usual fields (images_per_sec, step_time_ms, peak_rss_mb) for the plain step. For scale,
supplement Table C gives ViT-L at batch 2048 on 32 V100s: 15.1 GB peak with ESD vs 22.5 GB
masked.
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
from absl import logging

from benchmarks import common
from bigpretrain.models import layers
from bigpretrain.runtime import distributed
from configs import cosub_in1k


def define_flags() -> None:
  """The command's flags, defined only when it runs (other benchmarks import this module)."""
  flags.DEFINE_string("model", "vit_s16", "Registry ViT name.")
  flags.DEFINE_integer("image_size", 112, "Image side.")
  flags.DEFINE_integer("batch_size", 64, "Global batch (images, before cosub's copies).")
  flags.DEFINE_float("tau", 0.5, "Stochastic depth rate.")
  flags.DEFINE_integer("steps", 1, "Steps per timed round.")
  flags.DEFINE_integer("rounds", 7, "Alternated rounds per variant.")


# name -> (stochastic_depth, num_submodels)
VARIANTS = {"masked": ("mask", 1), "plain": ("esd", 1), "cosub": ("esd", 2)}


def variant_config(mode: str, submodels: int, model: str, image_size: int, batch_size: int,
                   tau: float):
  config = cosub_in1k.get_config(f"model={model},tau={tau},submodels={submodels}")
  config.model.stochastic_depth = mode
  config.data.image_size = config.model.image_size = image_size
  config.batch_size = batch_size
  config.data.repeated_augment = 1  # Unused (synthetic batch); frees the batch from x3.
  config.compute_dtype = "float32"
  return config


def memory_bytes(runner) -> tuple[int, int]:
  """(temp, output) bytes of the compiled step."""
  mem = runner.step.memory_analysis()
  return int(mem.temp_size_in_bytes), int(mem.output_size_in_bytes)


def measure(model: str, image_size: int, batch_size: int, tau: float, steps: int,
            rounds: int, cosub: bool = True, dataset=None) -> dict:
  """The benchmark's line (see the module docstring) for `model` at `image_size`, global
  `batch_size` and stochastic depth rate `tau`: `rounds` alternated rounds of `steps` steps
  (without `cosub`: ESD vs masked only, no cosub step built). `dataset` replaces the recipe's
  (common.Runner: a stand-in with its info, so no records need be prepared)."""
  names = list(VARIANTS) if cosub else ["masked", "plain"]
  runners = {name: common.Runner(variant_config(*VARIANTS[name], model, image_size,
                                                batch_size, tau), dataset)
             for name in names}
  times = {k: [] for k in runners}
  for _ in range(rounds):
    for name, runner in runners.items():
      times[name].append(runner.run(steps))
  step_s = {k: statistics.median(v) for k, v in times.items()}
  # Ratios within each round (variants run back to back), then their median: a load change
  # between rounds cancels out.
  per_round = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))
  mem = {k: memory_bytes(r) for k, r in runners.items()}
  total = {k: sum(v) for k, v in mem.items()}
  plain = runners["plain"]
  mesh = plain.exp.mesh
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  out = common.report(plain.config, step_s["plain"], plain.compile_s)
  out.update({
      "tau": tau,
      "esd_memory_ratio": total["plain"] / total["masked"],
      "esd_temp_memory_ratio": mem["plain"][0] / mem["masked"][0],
      "esd_time_ratio": per_round("plain", "masked"),
      "step_time_ms_by_variant": {k: 1e3 * v for k, v in step_s.items()},
      "memory_mb_by_variant": {k: v / 2**20 for k, v in total.items()},
      "esd_effective_drop": {k: layers.esd_effective_rate(tau, n * batch_size // shards)
                             for k, n in (("plain", 1), ("cosub", 2)) if k in runners},
  })
  if cosub:
    out.update({
        "cosub_time_ratio": per_round("cosub", "plain"),
        "cosub_memory_ratio": total["cosub"] / total["plain"],
        "cosub_time_ratio_rounds": [c / p for c, p in zip(times["cosub"], times["plain"])],
    })
  return out


def main(argv):
  del argv
  distributed.select_platforms()  # No plugin errors on a host without their devices.
  logging.set_verbosity(logging.WARNING)  # The per-parameter sharding log, three times over.
  f = flags.FLAGS
  out = measure(f.model, f.image_size, f.batch_size, f.tau, f.steps, f.rounds)
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  define_flags()
  sys.exit(app.run(main))
