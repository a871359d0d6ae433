r"""Evaluates a trained model on several test sets, whole or with residual blocks removed.

  python -m bigpretrain.tools.evaluate --workdir=DIR [--datasets=NAME[:SPLIT],...] [--json]
  python -m bigpretrain.tools.evaluate --checkpoint=PATH \
      --datasets=tfds:imagenet2012,tfds:imagenet_v2,tfds:imagenet2012_real --data_dir=/data/tfds
  python -m bigpretrain.tools.evaluate --workdir=DIR --drop_blocks=3,7     # that submodel
  python -m bigpretrain.tools.evaluate --workdir=DIR --drop_blocks=sweep   # each block removed

What it computes and why: bigpretrain/evaluators/evaluate.py.
"""

import json

from absl import app
from absl import flags

from bigpretrain.evaluators import evaluate
from bigpretrain.runtime import distributed
from bigpretrain.evaluators import mapped
from bigpretrain.tools import cli


def define_flags() -> None:
  """The command's flags, defined only when it runs (no clash with other commands' flags)."""
  flags.DEFINE_string("workdir", None, "A bigpretrain run folder (uses its config.json).")
  flags.DEFINE_string("checkpoint", None, "A checkpoint dir or a bigpretrain.tools.convert output.")
  flags.DEFINE_string("datasets", "", "NAME[:SPLIT],... (default: the run's dataset).")
  flags.DEFINE_string("data_dir", None, "Where the datasets are prepared (default: the run's "
                      "data.dir).")
  flags.DEFINE_string("class_map", None, "JSON {dataset class: model class(es)} for a dataset "
                      "with other classes than the model.")
  flags.DEFINE_string("drop_blocks", "", "Residual blocks to remove, e.g. 3,7; or 'sweep'.")
  flags.DEFINE_integer("batch_size", 0, "Global eval batch (default: the run's batch size, or "
                       "8 per device).", lower_bound=0)
  flags.DEFINE_bool("json", False, "Print only the JSON line.")


def main(argv):
  cli.check_usage(argv)
  cli.quiet_logs()
  distributed.select_platforms()
  f = flags.FLAGS
  if bool(f.workdir) == bool(f.checkpoint):
    cli.usage_error("Give exactly one of --workdir and --checkpoint.")
  with cli.user_errors():
    run_config = evaluate.read_run_config(f.workdir) if f.workdir else None
    result = evaluate.evaluate(
        f.workdir or f.checkpoint, evaluate.parse_datasets(f.datasets), run_config=run_config,
        data_dir=f.data_dir,
        class_map=mapped.load_class_map(f.class_map) if f.class_map else None,
        drop_blocks=evaluate.parse_drop_blocks(f.drop_blocks), batch_size=f.batch_size)
  if not f.json:
    if "full" in result:
      print(evaluate.sweep_table(result), flush=True)
    elif f.drop_blocks:
      print(f"Blocks removed: {f.drop_blocks}", flush=True)
  print(json.dumps(result, sort_keys=True), flush=True)


if __name__ == "__main__":
  define_flags()
  app.run(main)
