"""Zero-shot top-1 of a hashtag model on a WordNet-labelled dataset (SWAG section 4.4).

  python -m bigpretrain.tools.zero_shot --workdir=DIR --dataset=NAME [--data_dir=...]
      [--split=validation] [--aggregation=sum|mean|max_split] [--platt=on|off|both] [--json]
      [--eval_resize=shorter_center_crop|center_crop|squish|center_crop(F[, bicubic])]

What it computes and why: bigpretrain/swag/zero_shot.py.
"""
import json

from absl import app
from absl import flags
import jax

from bigpretrain.runtime import distributed
from bigpretrain.swag import zero_shot
from bigpretrain.tools import cli


def define_flags() -> None:
  """The command's flags; defined only when it runs (no duplicate flags next to other CLIs)."""
  flags.DEFINE_string("workdir", None, "The hashtag model: a run folder or checkpoint dir.")
  flags.DEFINE_string("dataset", None, "WordNet-labelled dataset, as config.data.name.")
  flags.DEFINE_string("data_dir", "", "As config.data.dir ('' = the default cache).")
  flags.DEFINE_string("split", "validation", "The split to evaluate on.")
  flags.DEFINE_enum("aggregation", "", ("",) + zero_shot.AGGREGATIONS,
                    "Hashtag -> class aggregation; '' = the paper's per model and Platt mode.")
  flags.DEFINE_enum("platt", "both", zero_shot.PLATT_MODES,
                    "Top-1 with Platt scaling, without, or both.")
  flags.DEFINE_string("eval_resize", zero_shot.EVAL_RESIZE,
                      "Image resize at the checkpoint's size (as data.eval_resize, e.g. "
                      "center_crop(0.9, bicubic); input_pipeline.augment_spec.eval_resize_op); "
                      "default the paper's shorter side + centre crop.")
  flags.DEFINE_bool("json", False, "Print one JSON line instead of text.")
  flags.DEFINE_integer("batch_size", 256, "Global batch size, over all hosts.")
  flags.DEFINE_integer("num_workers", 0, "grain decode worker processes per host.")
  distributed.define_flags()


def main(argv):
  f = flags.FLAGS
  cli.check_usage(argv, "workdir", "dataset")
  cli.quiet_logs()
  distributed.initialize_from_flags()
  with cli.user_errors():
    result = zero_shot.run(f.workdir, f.dataset, data_dir=f.data_dir, split=f.split,
                           aggregation=f.aggregation, platt=f.platt,
                           batch_size=f.batch_size, num_workers=f.num_workers,
                           eval_resize=f.eval_resize)
  if jax.process_index() != 0:
    return
  if f.json:
    print(json.dumps(result, sort_keys=True))
    return
  saved = f"; class map in {result['class_map']}" if result["class_map"] else ""
  print(f"Zero-shot on {f.dataset}:{f.split} ({result['num_examples']} images, "
        f"{result['num_classes']} classes, {result['num_hashtags']} hashtags{saved}):")
  for key, agg in (("top1_platt", "aggregation_platt"),
                   ("top1_no_platt", "aggregation_no_platt")):
    if result[key] is not None:
      label = "with Platt scaling" if key == "top1_platt" else "without Platt scaling"
      print(f"  top-1 {label}: {100 * result[key]:.2f}% ({result[agg]} aggregation)")
      if f"real_{key}" in result:
        print(f"  ReaL top-1 {label}: {100 * result[f'real_{key}']:.2f}% "
              f"({result['num_real_examples']} images with real labels)")


if __name__ == "__main__":
  define_flags()
  app.run(main)
