"""Predictions of a trained run, in the paper's semantic view (ImageNet-21K paper, Figure 1).

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
import logging as std_logging
import os
import sys

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from bigpretrain import distributed
from bigpretrain import objectives
from bigpretrain import preprocess
from bigpretrain.models import pretrained
from bigpretrain.objectives import base
from bigpretrain.semantic import view
from input_pipeline import augment_spec
from input_pipeline import datasets
from input_pipeline import decoding

_WORKDIR = flags.DEFINE_string("workdir", None, "A bigpretrain run folder or checkpoint dir.",
                                required=True)
_JSON = flags.DEFINE_bool("json", False, "One JSON object per image instead of text.")
_THRESHOLD = flags.DEFINE_float("threshold", 0.5, "Show levels whose top probability exceeds it.")
_BATCH = 64  # Images per forward pass.


def expand_paths(args) -> list[str]:
  """Files as given; a folder -> its image files (recursive, sorted, non-image extensions
  and hidden entries left out)."""
  out = []
  for arg in args:
    if not os.path.isdir(arg):
      out.append(arg)
      continue
    for root, dirs, files in os.walk(arg):
      dirs[:] = sorted(d for d in dirs if not d.startswith("."))
      out += [os.path.join(root, f) for f in sorted(files)
              if not f.startswith(".") and not decoding.is_non_image(f)]
  return out


def load_image(path: str, data_cfg) -> np.ndarray:
  """Decodes and resizes like the eval pipeline; uint8 [S, S, 3]. `data_cfg` has eval_resize
  and image_size (a checkpoint's meta['data']). Errors: OSError, CorruptImageError."""
  with open(path, "rb") as f:
    image = decoding.open_image(f.read())
  return np.asarray(
      augment_spec.EVAL_RESIZES[data_cfg["eval_resize"]](image, data_cfg["image_size"]))


def predict(workdir: str, paths, threshold: float = 0.5) -> list[dict]:
  """One result per path, in order: {'image', 'answer', 'levels'} or {'image', 'top5'}, or
  {'image', 'error'} for a file that cannot be read or decoded."""
  loaded = pretrained.load(workdir)
  meta, model_def, variables = loaded.meta, loaded.model_def, loaded.variables
  normalize = meta["data"]["normalize"]
  forward = jax.jit(lambda p, e, x: model_def.merge(p, e)(
      preprocess.normalize(x, normalize), train=False))
  names = meta["class_names"] or [str(c) for c in range(meta["num_classes"])]
  tree = base.class_tree(names)
  sigmoid = meta["objective"].get("name") == "multi_label"
  info = datasets.DatasetInfo(meta["dataset"], meta["num_classes"], names, {}, None, ())
  objective = objectives.get_objective(ml_collections.ConfigDict(meta["objective"]), info)

  results, good, images = [], [], []
  for path in paths:
    try:
      images.append(load_image(path, meta["data"]))
    except (OSError, decoding.CorruptImageError) as e:
      reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
      results.append({"image": path, "error": reason})
      continue
    good.append(len(results))
    results.append(None)
  for start in range(0, len(images), _BATCH):
    batch = jnp.asarray(np.stack(images[start:start + _BATCH]))
    logits = np.asarray(forward(variables["params"], variables["extra"], batch))
    answers = np.asarray(objective.answer(jnp.asarray(logits)))
    for slot, row, answer in zip(good[start:start + _BATCH], logits, answers):
      path = paths[slot]
      if tree is not None:
        c = int(np.argmax(answer))
        results[slot] = {"image": path,
                         "answer": {"class": c, "wnid": tree.wnids[c],
                                    "name": view.synset_name(tree.wnids[c]),
                                    "prob": float(answer[c])},
                         "levels": view.semantic_view(row, tree, sigmoid, threshold)}
      else:
        top = np.argsort(-row)[:5]
        results[slot] = {"image": path, "top5": [{"class": int(c), "name": names[c]}
                                                 for c in top]}
  return results


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
  # Orbax and JAX log every restore step and platform probe at INFO: not for a user.
  logging.set_verbosity(logging.WARNING)
  std_logging.getLogger("jax._src.xla_bridge").setLevel(std_logging.WARNING)
  distributed.select_platforms()
  if len(argv) < 2:
    raise app.UsageError("Give one or more image files or folders holding images.")
  paths = expand_paths(argv[1:])
  if not paths:
    print(f"ERROR: no image files in {' '.join(argv[1:])}", file=sys.stderr)
    sys.exit(1)
  try:
    results = predict(_WORKDIR.value, paths, _THRESHOLD.value)
  except (FileNotFoundError, ValueError) as e:
    print(f"ERROR: {e}", file=sys.stderr)
    sys.exit(1)
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
