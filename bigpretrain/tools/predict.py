"""Predictions of a trained run, in the paper's semantic view (ImageNet-21K paper, Figure 1).

  python -m bigpretrain.predict --workdir=DIR image1.jpg [image2.png ...] [--json]

For each image: the model's answer (one class, by the training objective's `answer` rule:
hierarchical for semantic and multi-label models) and, on WordNet-labelled classes, each
hierarchy level whose top probability exceeds --threshold, with WordNet names: a per-level
softmax (semantic objectives) or the per-class sigmoid (multi-label). Datasets whose classes
are not WordNet synsets print the top-5 classes.
"""
import json
import sys

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from bigpretrain import preprocess
from bigpretrain import objectives
from bigpretrain.models import pretrained
from bigpretrain.objectives import base
from bigpretrain.semantic import wordnet
from input_pipeline import augment_spec
from input_pipeline import datasets
from input_pipeline import decoding

_WORKDIR = flags.DEFINE_string("workdir", None, "A bigpretrain run folder or checkpoint dir.",
                                required=True)
_JSON = flags.DEFINE_bool("json", False, "One JSON object per image instead of text.")
_THRESHOLD = flags.DEFINE_float("threshold", 0.5, "Show levels whose top probability exceeds it.")


def load_images(paths, data_cfg) -> np.ndarray:
  """Decodes and resizes like the eval pipeline; uint8 [N, S, S, 3]. `data_cfg` has
  eval_resize and image_size (a checkpoint's meta['data'])."""
  images = []
  for p in paths:
    with open(p, "rb") as f:
      image = decoding.open_image(f.read())
    images.append(np.asarray(
        augment_spec.EVAL_RESIZES[data_cfg["eval_resize"]](image, data_cfg["image_size"])))
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
  loaded = pretrained.load(workdir)
  meta, model_def, variables = loaded.meta, loaded.model_def, loaded.variables
  normalize = meta["data"]["normalize"]
  forward = jax.jit(lambda p, e, x: model_def.merge(p, e)(
      preprocess.normalize(x, normalize), train=False))
  logits = np.asarray(forward(variables["params"], variables["extra"],
                              jnp.asarray(load_images(paths, meta["data"]))))
  names = meta["class_names"] or [str(c) for c in range(meta["num_classes"])]
  tree = base.class_tree(names)
  sigmoid = meta["objective"].get("name") == "multi_label"
  info = datasets.DatasetInfo(meta["dataset"], meta["num_classes"], names, {}, None, ())
  objective = objectives.get_objective(ml_collections.ConfigDict(meta["objective"]), info)
  answers = np.asarray(objective.answer(jnp.asarray(logits)))
  results = []
  for path, row, answer in zip(paths, logits, answers):
    if tree is not None:
      c = int(np.argmax(answer))
      results.append({"image": path,
                      "answer": {"class": c, "wnid": tree.wnids[c], "name": _name(tree.wnids[c]),
                                 "prob": float(answer[c])},
                      "levels": semantic_view(row, tree, sigmoid, threshold)})
    else:
      top = np.argsort(-row)[:5]
      results.append({"image": path, "top5": [{"class": int(c), "name": names[c]}
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
    if "answer" in r:
      a = r["answer"]
      print(f"  answer: {a['name']} ({a['wnid']}) p={a['prob']:.2f}")
    for lv in r.get("levels", []):
      print(f"  level {lv['level']}: {lv['name']} ({lv['wnid']}) p={lv['prob']:.2f}")
    for c in r.get("top5", []):
      print(f"  {c['name']}")


if __name__ == "__main__":
  app.run(main)
