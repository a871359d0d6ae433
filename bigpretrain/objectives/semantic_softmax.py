"""Semantic softmax (ImageNet-21K Pretraining for the Masses, section 3.3).

One softmax per hierarchy level of the WordNet tree over the classes, each label
contributing to its own level and its ancestors' levels, levels balanced by W_k.
"""
import jax.numpy as jnp

from bigpretrain import losses
from bigpretrain.objectives import base
from bigpretrain.semantic import metrics as semantic_metrics
from bigpretrain.semantic import tree as semantic_tree


class SemanticSoftmax:
  """Loss: sum_k W_k L_k over levels; eval: semantic top-1 (pooled), per level, and top-k."""

  def __init__(self, cfg, info, topk=(1, 5)):
    self.topk = topk
    base.check_keys(cfg, {"label_smoothing", "max_weight"})
    if not info.class_names:
      raise ValueError(f"Dataset {info.name!r} has no class wnids: semantic_softmax needs them "
                       "to build the WordNet tree.")
    self.tree = semantic_tree.SemanticTree.from_wnids(list(info.class_names))
    self.label_smoothing = float(cfg.get("label_smoothing", 0.2))
    self.max_weight = float(cfg.get("max_weight", 20.0))
    self.targets = jnp.asarray(self.tree.target_table)  # [C, L] class -> per-level target.

  def loss(self, model, batch, rng):
    logits = model(batch["image"], train=True, rng=rng)
    targets = self.targets[batch["label"]]
    loss, aux = losses.semantic_softmax_loss(logits, targets, self.tree,
                                             label_smoothing=self.label_smoothing,
                                             max_weight=self.max_weight)
    return loss, {f"train/level{k}_loss": l for k, l in enumerate(aux["level_losses"])}

  def eval_metrics(self, model, batch):
    logits = model(batch["image"], train=False)
    mask = base.eval_mask(batch, logits.shape[0])
    targets = jnp.where(mask[:, None] > 0, self.targets[batch["label"]], -1)
    out = base.topk_metrics(logits, batch["label"], mask, self.topk)
    out["eval/semantic_top1"] = semantic_metrics.semantic_accuracy(logits, targets, self.tree)
    correct, valid = semantic_metrics.per_level_accuracy(logits, targets, self.tree)
    for k in range(self.tree.num_levels):
      out[f"eval/level{k}_top1"] = (correct[k], valid[k])
    return out
