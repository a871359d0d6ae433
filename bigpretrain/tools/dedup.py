r"""Near-duplicates of evaluation images in an unlabelled pool: an exclusion list and a report.

  python -m bigpretrain.tools.dedup --workdir=MODEL --pool=NAME:SPLIT --against=NAME:SPLIT[,...] \
      (--top_n=N | --max_distance=D) --out=DIR [--data_dir=...] [--batch_size=256] \
      [--ivf_threshold=1000000] [--nlist=0] [--nprobe=64] [--seed=0] [--fsdp=1]

What it computes and why: bigpretrain/semisup/dedup.py.
"""

from absl import app
from absl import flags
import jax

from bigpretrain.runtime import distributed
from bigpretrain.semisup import dedup
from bigpretrain.tools import cli


def define_flags() -> None:
  """The command's flags; defined only when it runs (see bigpretrain.tools.infer)."""
  flags.DEFINE_string("workdir", None, "The feature model: a run folder or checkpoint dir.")
  flags.DEFINE_string("pool", None, "The unlabelled pool, NAME:SPLIT (e.g. demo:unlabeled).")
  flags.DEFINE_string("against", None, "Evaluation sets, NAME:SPLIT[,NAME:SPLIT...].")
  flags.DEFINE_string("out", None, "Output folder: exclusions.tsv and dedup.json.")
  flags.DEFINE_integer("top_n", None, "Remove the N pool images closest to an evaluation "
                       "image (the paper: 5000).")
  flags.DEFINE_float("max_distance", None, "Remove the pool images within this Euclidean "
                     "distance (of unit vectors) of an evaluation image.")
  flags.DEFINE_string("data_dir", "", "As config.data.dir ('' = the default cache).")
  flags.DEFINE_integer("batch_size", 256, "Global batch size, over all hosts.")
  flags.DEFINE_integer("ivf_threshold", dedup.DEFAULT_IVF_THRESHOLD,
                       "Pools larger than this get an IVF index instead of the exact one.")
  flags.DEFINE_integer("nlist", 0, "IVF lists (0: 4 sqrt(pool size)).")
  flags.DEFINE_integer("nprobe", dedup.DEFAULT_NPROBE, "IVF lists searched per query.")
  flags.DEFINE_integer("seed", 0, "Seed of the IVF k-means training sample.")
  flags.DEFINE_integer("fsdp", 1, "Devices on the mesh's fsdp axis (weight sharding).")
  flags.DEFINE_integer("num_workers", 0, "grain decode worker processes per host.")
  distributed.define_flags()


def main(argv):
  cli.check_usage(argv, "workdir", "pool", "against", "out")
  cli.quiet_logs()
  f = flags.FLAGS
  with cli.user_errors():
    dedup.check_args(f.top_n, f.max_distance, f.batch_size, f.nprobe, f.nlist, f.ivf_threshold)
    distributed.initialize_from_flags()
    report = dedup.run(f.workdir, f.pool, f.against, f.out, top_n=f.top_n,
                 max_distance=f.max_distance, data_dir=f.data_dir, batch_size=f.batch_size,
                 ivf_threshold=f.ivf_threshold, nlist=f.nlist, nprobe=f.nprobe, seed=f.seed,
                 fsdp=f.fsdp, num_workers=f.num_workers)
  if jax.process_index() == 0:
    print(dedup.summary(report, f.out))


if __name__ == "__main__":
  define_flags()
  app.run(main)
