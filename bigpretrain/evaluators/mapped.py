"""Evaluation on a dataset whose classes map onto the model's: a subset of its class names
(ImageNet-1k wnids under an ImageNet-21K model, ImageNet-v2), or any classes through a class
map (ObjectNet: each class scored by the best of its model classes), with ReaL top-1 when the
dataset carries ReaL labels.

A model class scores the probability that the image's label is that class or lies under it in
the model's class tree (objective.membership), less what the mapped classes under it take: an
ImageNet-1k class that has subclasses among ImageNet-21K's (266 of the 991 in
ImageNet-21K-P) is credited with the images the model places in them, and a dataset class
nested in another is still ranked by itself (a class map listing a class and one under it
for one dataset class scores that subtree). With every model class mapped this is
objective.answer, the probability of being exactly that class."""
import json

import jax.numpy as jnp
import numpy as np

from bigpretrain import inference
from bigpretrain.evaluators import base
from bigpretrain.evaluators import classification
from bigpretrain.objectives import base as objective_base

REAL_LABEL = "real_label"


def real_accuracy(scores, real_labels, mask):
  """ReaL top-1 (Beyer et al. 2020) summed over the batch: (hits, images with a real label).

  scores [B, C]; real_labels int [B, K], each row the image's set of real labels padded with
  -1; mask [B] (0 = padding row). An image counts when its set is not empty, and is a hit
  when the argmax of its scores is in its set.
  """
  pred = jnp.argmax(scores, axis=-1)
  valid = jnp.any(real_labels >= 0, axis=-1) * mask
  hit = jnp.any(real_labels == pred[:, None], axis=-1) * valid
  return jnp.sum(hit), jnp.sum(valid)


def load_class_map(path: str) -> dict[str, list[str]]:
  """{dataset class: [model classes]} from a JSON object whose values are names or lists."""
  try:
    with open(path, encoding="utf-8") as f:
      raw = json.load(f)
  except FileNotFoundError:
    raise FileNotFoundError(f"--class_map={path}: no such file.") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"--class_map={path} is not valid JSON: {e}.") from None
  if not isinstance(raw, dict):
    raise ValueError(f"--class_map={path}: expected a JSON object {{dataset class: model "
                     "class or [model classes]}.")
  out = {}
  for k, v in raw.items():
    names = [v] if isinstance(v, str) else v
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
      raise ValueError(f"--class_map={path}: entry {k!r} must map to a class name or a "
                       f"non-empty list of names, got {v!r}.")
    out[str(k)] = names
  return out


def class_columns(model_names, dataset_names, dataset: str, class_map=None) -> np.ndarray:
  """int32 [D, M]: the model classes scoring each dataset class (rows padded by repeating
  their first entry, which leaves the max unchanged)."""
  index = {n: i for i, n in enumerate(model_names)}
  if class_map is None:
    missing = [n for n in dataset_names if n not in index]
    if missing or not dataset_names:
      raise ValueError(
          f"Dataset {dataset!r} has other classes than the model ({len(model_names)} classes) "
          f"and {len(missing) or 'all its'} of its {len(dataset_names)} class names are not "
          f"model classes (e.g. {missing[:3]}); give --class_map=FILE, a JSON object "
          "{dataset class: model class or [model classes]} (for ObjectNet, built from its "
          "mappings/objectnet_to_imagenet_1k.json).")
    rows = [[index[n]] for n in dataset_names]
  else:
    class_map = {k: [v] if isinstance(v, str) else list(v) for k, v in class_map.items()}
    unmapped = [n for n in dataset_names if n not in class_map]
    if unmapped:
      raise ValueError(f"--class_map has no entry for {len(unmapped)} classes of dataset "
                       f"{dataset!r}, e.g. {unmapped[:3]}.")
    unknown = sorted({m for n in dataset_names for m in class_map[n] if m not in index})
    if unknown:
      raise ValueError(f"--class_map names {len(unknown)} classes the model does not have, "
                       f"e.g. {unknown[:3]}.")
    rows = [[index[m] for m in class_map[n]] for n in dataset_names]
  width = max(len(r) for r in rows)
  return np.array([r + r[:1] * (width - len(r)) for r in rows], np.int32)


def nested_pairs(tree, columns) -> tuple[np.ndarray, np.ndarray]:
  """(inner, outer) int32: each model class in `columns` with a proper ancestor there, and
  its nearest such ancestor, unless both score one dataset class (a row of `columns`): that
  class is the best of its model classes, the ancestor's subtree with the inner one in it."""
  columns = np.asarray(columns)
  rows = {int(c): set(np.nonzero((columns == c).any(axis=-1))[0].tolist())
          for c in np.unique(columns)}
  inner, outer = [], []
  for m in sorted(rows):
    for a in tree.target_table[m][:tree.class_depth[m]][::-1]:
      if int(a) in rows:
        if not rows[m] & rows[int(a)]:
          inner.append(m)
          outer.append(int(a))
        break
  return np.array(inner, np.int32), np.array(outer, np.int32)


def mapped_scores(objective, logits, columns, nested):
  """[B, D] scores of the D dataset classes (the module docstring); `nested` is nested_pairs'
  (inner, outer) for the objective's tree, or empty."""
  member = objective.membership(logits)
  inner, outer = nested
  if len(inner):
    member = jnp.maximum(member.at[:, outer].add(-member[:, inner]), 0.0)
  return jnp.max(member[:, columns], axis=-1)


def make_mapped_step(model_def, objective, shardings, mesh, normalize: str, topk,
                     columns: np.ndarray, real: bool):
  """Like classification.make_eval_step, for a dataset whose classes are `columns` of the
  model's: top-k of the mapped scores (the module docstring) and, with `real`, ReaL top-1."""
  columns = np.asarray(columns)

  def eval_step(module, batch):
    # The objective's tree when traced: a resumed run's is its checkpoint's, restored after
    # the evaluators are built.
    tree = getattr(objective, "tree", None)
    nested = nested_pairs(tree, columns) if tree is not None else ((), ())
    logits = module(batch["image"], train=False)
    scores = mapped_scores(objective, logits, columns, nested)
    mask = objective_base.eval_mask(batch, logits.shape[0])
    out = objective_base.topk_metrics(scores, batch["label"], mask, topk)
    if real:
      out["real_top1"] = real_accuracy(scores, batch[REAL_LABEL], mask)
    return out

  return inference.make_step(model_def, shardings, mesh, normalize, eval_step)


@base.EVALUATORS.register("mapped")
class Mapped(base.Evaluator):
  """Settings: topk (default (1, 5)), class_map (a JSON file {dataset class: model class or
  [model classes]}; without it the dataset's class names must be model classes)."""
  KEYS = ("topk", "class_map")

  def __init__(self, name, cfg, exp):
    super().__init__(name, cfg, exp)
    self.topk = classification.check_topk(name, cfg.get("topk", (1, 5)))
    info = self.dataset.info
    class_map = load_class_map(cfg.class_map) if cfg.get("class_map") else None
    columns = class_columns(list(exp.dataset.info.class_names), info.class_names, info.name,
                            class_map)
    real = REAL_LABEL in info.features
    self.fields = {"label": 0, **({REAL_LABEL: info.num_classes} if real else {})}
    self.objective, self.exp = exp.objective, exp
    self.step = make_mapped_step(exp.model_def, exp.objective, exp.shardings, exp.mesh,
                                 exp.config.data.normalize, self.topk, columns, real)

  def run(self, state) -> dict:
    config = self.exp.config
    totals, skipped, _ = classification.evaluate(
        self.step, state, self.dataset, config.data, self.exp.mesh, split=self.split,
        batch_size=config.batch_size, fields=self.fields)
    results = classification.summarize(totals, self.objective, skipped)
    return {f"{self.name}/{k}": v for k, v in results.items()}
