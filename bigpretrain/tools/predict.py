"""Predictions of a trained run on image files, in the paper's semantic view (ImageNet-21K paper,
Figure 1); the library is bigpretrain/predict.py.

  python -m bigpretrain.tools.predict --workdir=DIR image1.jpg [image2.png | FOLDER ...] [--json]

For each image: the model's answer (one class, by the training objective's `answer` rule:
hierarchical for semantic and multi-label models) and, on WordNet-labelled classes, each
hierarchy level whose top probability exceeds --threshold, with WordNet names (see
bigpretrain/semantic/view.py). Datasets whose classes are not WordNet synsets print the top-5
classes. A folder argument stands for its image files (recursively, sorted; files with a
non-image extension are left out). A file that cannot be read or decoded gets one
`ERROR: PATH: reason` line on stderr, the others their results, and the exit status is 1.
"""
import json
import sys

from absl import app
from absl import flags

from bigpretrain import predict
from bigpretrain.runtime import distributed
from bigpretrain.tools import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "A bigpretrain run folder or checkpoint dir.",
                                required=True)
_JSON = flags.DEFINE_bool("json", False, "One JSON object per image instead of text.")
_THRESHOLD = flags.DEFINE_float("threshold", 0.5, "Show levels whose top probability exceeds it.",
                                lower_bound=0.0, upper_bound=1.0)


def _print(r: dict) -> None:
  if _JSON.value:
    print(json.dumps(r))
    return
  print(r["image"])
  if "answer" in r:
    a = r["answer"]
    print(f"  answer: {a['name']} ({a['wnid']}) p={a['prob']:.2f}")
  for lv in r.get("levels", []):
    print(f"  level {lv['level']}: {lv['name']} ({lv['wnid']}) p={lv['prob']:.2f}")
  for c in r.get("top5", []):
    print(f"  {c['name']}")


def main(argv):
  cli.quiet_logs()
  distributed.select_platforms()
  if len(argv) < 2:
    cli.usage_error("Give one or more image files or folders holding images.")
  paths = predict.expand_paths(argv[1:])
  if not paths:
    print(f"ERROR: no image files in {' '.join(argv[1:])}", file=sys.stderr)
    sys.exit(1)
  with cli.user_errors():
    results = predict.predict(_WORKDIR.value, paths, _THRESHOLD.value)
  failed = 0
  for r in results:
    if "error" in r:
      failed += 1
      print(f"ERROR: {r['image']}: {r['error']}", file=sys.stderr, flush=True)
      if _JSON.value:
        print(json.dumps(r))
    else:
      _print(r)
  if failed:
    print(f"{failed} of {len(results)} images failed.", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
