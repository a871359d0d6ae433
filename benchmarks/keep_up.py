"""Does the input pipeline keep up with the train step? One JSON line.

  python benchmarks/keep_up.py --config=configs/semantic_softmax.py [--min_seconds=15] [--steps=0]

Times the config's own train pipeline (its dataset, augmentations, data.num_workers and
batch size; batches pulled as fast as possible) in steady state (benchmarks/steady_state.py:
after two batches from every worker, whole rounds over the workers for at least
--min_seconds, or --batches_per_worker rounds), and, separately, its compiled train step on a
fixed batch (benchmarks/train_step.py). `ratio` = pipeline records/s / train images/s: at or
above 1 the pipeline can feed the accelerator; the host's cores are shared when both run, so
on a CPU-only host the ratio says little about a real run. --steps=0 times the pipeline only.
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import json  # pylint: disable=g-import-not-at-top

from absl import app
from absl import flags
import jax
from ml_collections import config_flags

from benchmarks import common
from benchmarks import steady_state
from bigpretrain import train
from bigpretrain.runtime import distributed


def define_flags() -> None:
  """The command's flags, defined only when it runs (other benchmarks import this module)."""
  config_flags.DEFINE_config_file("config", None, "Recipe config.", lock_config=True)
  flags.DEFINE_float("min_seconds", steady_state.MIN_SECONDS, "Least timed pipeline seconds.")
  flags.DEFINE_integer("batches_per_worker", None, "Timed pipeline batches per worker "
                       "instead of --min_seconds.")
  flags.DEFINE_integer("steps", 20, "Timed train steps (0: the pipeline only).")


def pipeline_rate(config, min_seconds: float = steady_state.MIN_SECONDS,
                  batches_per_worker: int | None = None) -> dict:
  """Steady-state figures (steady_state.measure) of this host's train pipeline for
  `config`."""
  it = train.make_train_iterator(train.build(config))
  try:
    return steady_state.measure(
        it, batch_size=config.batch_size // jax.process_count(),
        workers=config.data.num_workers, min_seconds=min_seconds,
        batches_per_worker=batches_per_worker)
  finally:
    if hasattr(it, "close"):
      it.close()


def main(argv):
  del argv
  distributed.select_platforms()  # No plugin errors on a host without their devices.
  f = flags.FLAGS
  config = f.config
  pipe = pipeline_rate(config, f.min_seconds, f.batches_per_worker)
  out = {"benchmark": "keep_up", "config": config.objective.name,
         "dataset": config.data.name, "augment": config.data.train_augment,
         "host_cpus": os.cpu_count(), **steady_state.report(pipe)}
  if f.steps:
    runner = common.Runner(config)
    step = common.report(config, runner.run(f.steps), runner.compile_s)
    train_rate = step["images_per_sec"] / jax.process_count()  # This host's share.
    out.update(model=step["model"], platform=step["platform"], devices=step["devices"],
               train_images_per_sec=round(train_rate, 1),
               ratio=round(pipe["records_per_sec"] / train_rate, 3))
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  define_flags()
  sys.exit(app.run(main))
