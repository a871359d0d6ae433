"""Single-label softmax cross-entropy with label smoothing over all classes."""
from bigpretrain import losses
from bigpretrain.objectives import base


class Softmax:
  """The plain classification objective (ImageNet-21K single-label baseline, fine-tuning)."""

  def __init__(self, cfg, info, topk=(1, 5)):
    self.topk = topk
    base.check_keys(cfg, {"label_smoothing"})
    self.label_smoothing = float(cfg.get("label_smoothing", 0.0))
    self.tree = base.class_tree(info)  # For semantic metrics, comparable across objectives.

  def loss(self, model, batch, rng, frozen=None):
    del frozen
    logits = model(batch["image"], train=True, rng=rng)
    loss = losses.cross_entropy(logits, batch["label"], label_smoothing=self.label_smoothing)
    return loss, {}

  def eval_metrics(self, model, batch):
    return base.classification_eval(model, batch, self.topk, self.tree)[2]
