"""Teacher predictions over an unlabelled pool (stage 2 of the semi-supervised recipe).

  python -m bigpretrain.tools.infer --workdir=TEACHER --data=NAME --split=SPLIT --out=DIR \
      [--data_dir=...] [--top_p=10] [--batch_size=256] [--logits] [--shard_size=50000] \
      [--exclude=FILE]

What it writes, how it resumes and how hosts share the work: bigpretrain/semisup/pool_predictions.py.
"""

import time

from absl import app
from absl import flags
import jax

from bigpretrain.runtime import distributed
from bigpretrain.semisup import pool_predictions
from bigpretrain.tools import cli


def define_flags() -> None:
  """The command's flags; defined only when it runs, so that importing this module next to
  another command (tests, notebooks) defines no flag twice."""
  flags.DEFINE_string("workdir", None, "The teacher: a run folder or checkpoint dir.")
  flags.DEFINE_string("data", None, "Dataset name, as config.data.name (e.g. demo).")
  flags.DEFINE_string("split", None, "The split to score (e.g. unlabeled).")
  flags.DEFINE_string("out", None, "Predictions folder (created; resumed if started).")
  flags.DEFINE_string("data_dir", "", "As config.data.dir ('' = the default cache).")
  flags.DEFINE_integer("top_p", pool_predictions.DEFAULT_TOP_P, "Classes kept per image (P).")
  flags.DEFINE_integer("batch_size", 256, "Global batch size, over all hosts.")
  flags.DEFINE_bool("logits", False, "Write raw logits instead of softmax scores.")
  flags.DEFINE_integer("shard_size", pool_predictions.DEFAULT_SHARD_SIZE,
                       "Records per output shard.")
  flags.DEFINE_integer("fsdp", 1, "Devices on the mesh's fsdp axis (weight sharding).")
  flags.DEFINE_integer("num_workers", 0, "grain decode worker processes per host.")
  flags.DEFINE_enum("pool_classes", "teacher", ["teacher", "any"],
                    "'teacher': the data is labelled in the teacher's class list (checked); "
                    "'any': another class list (e.g. a hashtag pool), its labels never read.")
  flags.DEFINE_string("exclude", None, "Exclusion list (the dedup command's exclusions.tsv): "
                      "its records of --data:--split are not scored.")
  distributed.define_flags()


def main(argv):
  cli.check_usage(argv, "workdir", "data", "split", "out")
  cli.quiet_logs()
  f = flags.FLAGS
  distributed.initialize_from_flags()
  started = time.time()
  with cli.user_errors():
    info = pool_predictions.run(
        f.workdir, f.data, f.split, f.out, data_dir=f.data_dir, top_p=f.top_p,
        batch_size=f.batch_size, logits=f.logits, shard_size=f.shard_size, fsdp=f.fsdp,
        num_workers=f.num_workers, exclude=f.exclude,
        pool_classes=f.pool_classes)
  if jax.process_index() == 0:
    excluded = f", {info['num_excluded']} excluded" if "num_excluded" in info else ""
    print(f"{info['num_records']} predictions of {f.data}:{f.split} in {f.out}{excluded} "
          f"({time.time() - started:.0f} s).")


if __name__ == "__main__":
  define_flags()
  app.run(main)
