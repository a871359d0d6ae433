"""Teacher inference speed against the train step's forward-only cost. One JSON line.

  python benchmarks/infer.py [--config=configs/semi_supervised.py[:args]] [--stage=teacher] \
      [--batch_size=256] [--steps=10]

Both on the same fixed synthetic batch, the model, mesh and shardings of the config's --stage
section (a trainer config; the default is the demo teacher): `infer` is bigpretrain.tools.infer's
jitted step (eval-mode forward, softmax, top-P, replicated top-P rows back), `forward` is the
train step's loss without its gradient (train-mode forward: BatchNorm batch statistics,
dropout) and `train` the whole train step. Inference should cost about one train forward
(ratio_infer_over_forward near 1; softmax, top-P and the replicated [B, P] rows are its
extra) and a fraction of a train step (ratio_infer_over_train ~3 or more); much less means
its output transfer or top-P costs too much. Not timed: decoding and the input pipeline
(benchmarks/input_pipeline.py), and writing shards.

Fields: images_per_sec and step_time_ms (inference), forward_images_per_sec,
train_images_per_sec, ratio_infer_over_forward, ratio_infer_over_train, compile times,
peak_rss_mb (or peak_device_mb on an accelerator).
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import json  # pylint: disable=g-import-not-at-top

from absl import app
from absl import flags
import jax
import numpy as np
from ml_collections import config_flags

from benchmarks import common
from bigpretrain.semisup import pool_predictions
from bigpretrain import sharding
from bigpretrain import train
from bigpretrain.runtime import distributed

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "configs", "semi_supervised.py"), "Semi-supervised recipe config.")
_STAGE = flags.DEFINE_string("stage", "teacher", "The config section to time (teacher, student).")
_BATCH = flags.DEFINE_integer("batch_size", 256, "Global batch size of all three steps.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps of each kind (after one warm-up).")


def _time(fn, steps: int) -> tuple[float, float]:
  """(compile + first call seconds, seconds per call after it)."""
  first = common.seconds_per_call(fn, 1)
  return first, common.seconds_per_call(fn, steps)


def measure(config, stage: str, batch_size: int, steps: int) -> dict:
  if stage not in config:
    raise ValueError(f"--stage={stage!r} is not a section of the config; it has "
                     f"{sorted(config.keys())}.")
  section = config[stage].copy_and_resolve_references()
  section.batch_size = batch_size
  section.data.name, section.data.dir = config.data.name, config.data.dir
  exp = train.build(section)
  state = exp.init_state()
  host = common.synthetic_batch(exp)
  rows = len(host["image"])
  host_infer = {"image": host["image"], "index": np.arange(rows, dtype=np.int64),
                "mask": np.ones(rows, np.int32)}
  batch = sharding.global_batch(host, exp.mesh)
  batch_infer = sharding.global_batch(host_infer, exp.mesh)
  params, extra = state["params"], state["extra"]

  infer_step = pool_predictions.make_step(exp.model_def, exp.shardings, exp.mesh,
                                          section.data.normalize, config.infer.top_p,
                                          logits=False)
  rng = jax.random.key(0)

  def forward(params, extra, batch):  # The train step's loss, no gradient.
    from bigpretrain import preprocess  # pylint: disable=import-outside-toplevel
    batch = {**batch, "image": preprocess.normalize(batch["image"], section.data.normalize)}
    return exp.objective.loss(exp.model_def.merge(params, extra), batch, rng, exp.frozen)[0]

  forward = jax.jit(forward, in_shardings=(exp.shardings["params"], exp.shardings["extra"],
                                           sharding.batch_sharding(exp.mesh)))
  with jax.set_mesh(exp.mesh):
    infer_compile, infer_s = _time(lambda: infer_step(params, extra, batch_infer), steps)
    forward_compile, forward_s = _time(lambda: forward(params, extra, batch), steps)
  runner = common.Runner(section)  # Builds its own model: outside the mesh context.
  train_s = runner.run(steps)
  out = common.report(section, infer_s, infer_compile)
  out.update(stage=stage, top_p=config.infer.top_p,
             forward_images_per_sec=batch_size / forward_s, forward_compile_time_s=forward_compile,
             train_images_per_sec=batch_size / train_s, train_compile_time_s=runner.compile_s,
             ratio_infer_over_forward=forward_s / infer_s,
             ratio_infer_over_train=train_s / infer_s)
  return out


def main(argv):
  del argv
  distributed.select_platforms()  # No plugin errors on a host without their devices.
  print(json.dumps(measure(_CONFIG.value, _STAGE.value, _BATCH.value, _STEPS.value)),
        flush=True)


if __name__ == "__main__":
  sys.exit(app.run(main))
