"""Shared pieces of the objectives: config checking, top-k and semantic eval metrics."""
import re

import jax.numpy as jnp

from bigpretrain.semantic import metrics as semantic_metrics
from bigpretrain.semantic import tree as semantic_tree


def check_keys(cfg, allowed: set[str]) -> None:
  """Rejects unknown keys in config.objective, naming them."""
  unknown = sorted(set(cfg.keys()) - allowed - {"name"})
  if unknown:
    raise ValueError(f"config.objective ({cfg.name}) has unknown keys {unknown}; "
                     f"allowed: {sorted(allowed)}.")


def topk_metrics(logits, labels, mask, topk=(1, 5)) -> dict:
  """{'eval/top{k}': (num_correct, num_examples)} over rows with mask 1."""
  out = {}
  order = jnp.argsort(-logits, axis=-1)
  for k in topk:
    k = min(k, logits.shape[-1])
    hit = jnp.any(order[:, :k] == labels[:, None], axis=-1)
    out[f"eval/top{k}"] = (jnp.sum(hit * mask), jnp.sum(mask))
  return out


def eval_mask(batch, batch_size: int):
  return batch["mask"] if "mask" in batch else jnp.ones((batch_size,), jnp.float32)


_WNID = re.compile(r"^[nvar]\d{8}$")


def class_tree(info):
  """The WordNet tree over the dataset's classes, or None when its classes are not wnids."""
  names = list(info.class_names or ())
  if not names or not all(_WNID.match(n) for n in names):
    return None
  return semantic_tree.SemanticTree.from_wnids(names)


def semantic_eval_metrics(logits, labels, mask, tree) -> dict:
  """Semantic top-1 (pooled over levels, as in the ImageNet-21K paper) and per-level top-1."""
  targets = jnp.asarray(tree.target_table)[labels]
  targets = jnp.where(mask[:, None] > 0, targets, -1)
  out = {"eval/semantic_top1": semantic_metrics.semantic_accuracy(logits, targets, tree)}
  correct, valid = semantic_metrics.per_level_accuracy(logits, targets, tree)
  for k in range(tree.num_levels):
    out[f"eval/level{k}_top1"] = (correct[k], valid[k])
  return out


def classification_eval(model, batch, topk, tree):
  """Eval logits plus top-k metrics and, on WordNet-labelled data, semantic metrics."""
  logits = model(batch["image"], train=False)
  mask = eval_mask(batch, logits.shape[0])
  out = topk_metrics(logits, batch["label"], mask, topk)
  if tree is not None:
    out.update(semantic_eval_metrics(logits, batch["label"], mask, tree))
  return logits, mask, out
