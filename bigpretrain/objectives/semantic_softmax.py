"""Semantic softmax (ImageNet-21K Pretraining for the Masses, section 3.3).

One softmax per hierarchy level of the WordNet tree over the classes, each label
contributing to its own level and its ancestors' levels, levels balanced by W_k.
Mixup/cutmix is not accepted: the recipe has none, and a mixed label has no single path
through the tree.
"""
import jax.numpy as jnp

from bigpretrain import losses
from bigpretrain.objectives import base
from bigpretrain.semantic import metrics as semantic_metrics
from bigpretrain.semantic import tree as tree_lib


@base.OBJECTIVES.register("semantic_softmax")
class SemanticSoftmax(base.Objective):
  """Loss: sum_k W_k L_k over levels; eval: semantic top-1 (pooled), per level, and top-k of
  the hierarchical answer (semantic.metrics.semantic_softmax_answer)."""
  trains_on_tree = True

  def __init__(self, cfg, info, allowed=("label_smoothing", "max_weight")):
    base.check_keys(cfg, set(allowed))
    self.tree = base.class_tree(info.class_names)
    if self.tree is None:
      raise ValueError(f"Dataset {info.name!r} has no WordNet wnids as class names: "
                       f"{cfg.name} needs them to build the semantic tree.")
    self.label_smoothing = base.label_smoothing(cfg, 0.2)
    self.max_weight = float(cfg.get("max_weight", tree_lib.MAX_LEVEL_WEIGHT))
    self.tree.level_weights(self.max_weight)  # A bad max_weight fails here, not in the step.

  @property
  def targets(self):
    """[C, L] class -> per-level target, of the tree in use (restore_meta may replace it)."""
    return jnp.asarray(self.tree.target_table)

  def loss(self, model, batch, rng, frozen=None):
    del frozen
    logits = model(batch["image"], train=True, rng=rng)
    targets = self.targets[batch["label"]]
    loss, aux = losses.semantic_softmax_loss(logits, targets, self.tree,
                                             label_smoothing=self.label_smoothing,
                                             max_weight=self.max_weight)
    return loss, {f"train/level{k}_loss": l for k, l in enumerate(aux["level_losses"])}

  def answer(self, logits):
    return semantic_metrics.semantic_softmax_answer(logits, self.tree)

  def eval_metrics(self, model, batch, topk):
    return base.classification_eval(model, batch, topk, self.tree, self.answer)[2]
