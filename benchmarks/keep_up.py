"""Does the input pipeline keep up with the train step? One JSON line.

  python benchmarks/keep_up.py --config=configs/semantic_softmax.py [--batches=100]

Times the config's own train pipeline (its dataset, augmentations, data.num_workers and
batch size; batches pulled as fast as possible, after --warmup) and, separately, its compiled
train step on a fixed batch (benchmarks/train_step.py). `ratio` = pipeline records/s / train
images/s: at or above 1 the pipeline can feed the accelerator; the host's cores are shared
when both run, so on a CPU-only host the ratio says little about a real run.
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import json  # pylint: disable=g-import-not-at-top
import time

from absl import app
from absl import flags
import jax
from ml_collections import config_flags

from benchmarks import common
from bigpretrain import train


def define_flags() -> None:
  """The command's flags, defined only when it runs (other benchmarks import this module)."""
  config_flags.DEFINE_config_file("config", None, "Recipe config.", lock_config=True)
  flags.DEFINE_integer("batches", 100, "Timed pipeline batches.")
  flags.DEFINE_integer("warmup", 5, "Untimed pipeline batches first.")
  flags.DEFINE_integer("steps", 20, "Timed train steps.")


def pipeline_rate(config, batches: int, warmup: int) -> float:
  """Records/s of this host's train pipeline for `config` over `batches` batches, after
  `warmup` untimed ones."""
  it = train.make_train_iterator(train.build(config))
  try:
    for _ in range(warmup):
      next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
      next(it)
    elapsed = time.perf_counter() - t0
  finally:
    if hasattr(it, "close"):
      it.close()
  return batches * config.batch_size // jax.process_count() / elapsed


def main(argv):
  del argv
  f = flags.FLAGS
  config = f.config
  records = pipeline_rate(config, f.batches, f.warmup)
  runner = common.Runner(config)
  step = common.report(config, runner.run(f.steps), runner.compile_s)
  print(json.dumps({
      "benchmark": "keep_up", "config": step["config"], "model": step["model"],
      "dataset": config.data.name, "augment": config.data.train_augment,
      "workers": config.data.num_workers, "batch_size": config.batch_size,
      "platform": step["platform"], "devices": step["devices"],
      "pipeline_records_per_sec": round(records, 1),
      "train_images_per_sec": round(step["images_per_sec"], 1),
      "ratio": round(records / step["images_per_sec"], 3)}), flush=True)


if __name__ == "__main__":
  define_flags()
  sys.exit(app.run(main))
