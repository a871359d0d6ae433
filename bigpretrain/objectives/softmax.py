"""Single-label softmax cross-entropy with label smoothing over all classes."""
import jax
import jax.numpy as jnp

from bigpretrain import losses
from bigpretrain.objectives import base


@base.OBJECTIVES.register("softmax")
class Softmax(base.Objective):
  """The plain classification objective (ImageNet-21K single-label baseline, fine-tuning).

  With mixup/cutmix the loss is the cross-entropy against the mixed targets (timm's
  SoftTargetCrossEntropy); config.mixup.label_smoothing then smooths them.
  """
  soft_targets = True

  def __init__(self, cfg, info):
    base.check_keys(cfg, {"label_smoothing"})
    self.label_smoothing = base.label_smoothing(cfg, 0.0)
    self.num_classes = info.num_classes
    # For semantic metrics, comparable across objectives.
    self.tree = base.class_tree(info.class_names, required=False)

  def dense_targets(self, batch):
    return jax.nn.one_hot(batch["label"], self.num_classes, dtype=jnp.float32)

  def loss(self, model, batch, rng, frozen=None):
    del frozen
    logits = model(batch["image"], train=True, rng=rng)
    if "targets" in batch:
      return losses.soft_target_cross_entropy(logits, batch["targets"]), {}
    loss = losses.cross_entropy(logits, batch["label"], label_smoothing=self.label_smoothing)
    return loss, {}

  def eval_metrics(self, model, batch, topk):
    return base.classification_eval(model, batch, topk, self.tree)[2]
