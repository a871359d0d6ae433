"""Predictions of a trained run, in the paper's semantic view (ImageNet-21K paper, Figure 1).

  python -m bigpretrain.predict --workdir=DIR image1.jpg [image2.png ...] [--json]

For each image, each hierarchy level whose top probability exceeds --threshold prints its
class with WordNet names: a per-level softmax (semantic objectives) or the per-class sigmoid
(multi-label). Datasets whose classes are not WordNet synsets print the top-5 classes.
"""
import json
import os
import sys

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from bigpretrain import checkpoint
from bigpretrain import models
from bigpretrain import preprocess
from bigpretrain.objectives import base
from bigpretrain.semantic import wordnet
from input_pipeline import augment
from input_pipeline import datasets

_WORKDIR = flags.DEFINE_string("workdir", None, "A bigpretrain run folder.", required=True)
_JSON = flags.DEFINE_bool("json", False, "One JSON object per image instead of text.")
_THRESHOLD = flags.DEFINE_float("threshold", 0.5, "Show levels whose top probability exceeds it.")


def load_run(workdir: str):
  """(config, dataset info, model_def, params, extra) of the run's latest checkpoint."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: is {workdir} a bigpretrain run folder?")
  with open(path) as f:
    config = ml_collections.ConfigDict(json.load(f))
  info = datasets.get_dataset(config.data).info
  model_def = models.ModelDef.from_config(config.model, info.num_classes, config.compute_dtype)
  state = checkpoint.load_params(
      os.path.join(workdir, "checkpoints"),
      {"params": model_def.abstract_pure_params(), "extra": model_def.abstract_pure_extra()})
  return config, info, model_def, state


def load_images(paths, data_cfg) -> np.ndarray:
  """Decodes and resizes like the eval pipeline; uint8 [N, S, S, 3]."""
  images = []
  for p in paths:
    with open(p, "rb") as f:
      image = augment.open_image(f.read())
    images.append(np.asarray(augment.EVAL_RESIZES[data_cfg.eval_resize](image, data_cfg.image_size)))
  return np.stack(images)


def _name(wnid: str) -> str:
  return wordnet.synset_from_wnid(wnid).lemma_names()[0].replace("_", " ")


def semantic_view(logits: np.ndarray, tree, sigmoid: bool, threshold: float) -> list[dict]:
  """Per level: the top class and its probability, kept where it exceeds `threshold`."""
  out = []
  for level, classes in enumerate(tree.level_classes):
    level_logits = logits[classes]
    if sigmoid:
      probs = 1 / (1 + np.exp(-level_logits))
    else:
      probs = np.exp(level_logits - level_logits.max())
      probs /= probs.sum()
    best = int(np.argmax(probs))
    if probs[best] > threshold:
      wnid = tree.wnids[classes[best]]
      out.append({"level": level, "class": int(classes[best]), "wnid": wnid,
                  "name": _name(wnid), "prob": float(probs[best])})
  return out


def predict(workdir: str, paths, threshold: float = 0.5) -> list[dict]:
  config, info, model_def, state = load_run(workdir)
  forward = jax.jit(lambda p, e, x: model_def.merge(p, e)(
      preprocess.normalize(x, config.data.normalize), train=False))
  logits = np.asarray(forward(state["params"], state["extra"],
                              jnp.asarray(load_images(paths, config.data))))
  tree = base.class_tree(info)
  results = []
  for path, row in zip(paths, logits):
    if tree is not None:
      levels = semantic_view(row, tree, config.objective.name == "multi_label", threshold)
      results.append({"image": path, "levels": levels})
    else:
      top = np.argsort(-row)[:5]
      results.append({"image": path, "top5": [
          {"class": int(c), "name": (info.class_names or [str(c)] * info.num_classes)[c]}
          for c in top]})
  return results


def main(argv):
  paths = argv[1:]
  if not paths:
    raise app.UsageError("Give one or more image files.")
  try:
    results = predict(_WORKDIR.value, paths, _THRESHOLD.value)
  except (FileNotFoundError, ValueError) as e:
    print(f"ERROR: {e}", file=sys.stderr)
    sys.exit(1)
  for r in results:
    if _JSON.value:
      print(json.dumps(r))
      continue
    print(r["image"])
    for lv in r.get("levels", []):
      print(f"  level {lv['level']}: {lv['name']} ({lv['wnid']}) p={lv['prob']:.2f}")
    for c in r.get("top5", []):
      print(f"  {c['name']}")


if __name__ == "__main__":
  app.run(main)
