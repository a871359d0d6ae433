"""Multi-label baseline (ImageNet-21K Pretraining for the Masses, section 3.2).

Each image's positives are its label and all the label's ancestors in the semantic tree; one
sigmoid per class, trained with the asymmetric loss (ASL, the paper's choice) or plain BCE.
Evaluated by mAP over classes.
"""
import jax
import jax.numpy as jnp
import numpy as np

from bigpretrain import losses
from bigpretrain.objectives import base
from bigpretrain.semantic import metrics as semantic_metrics


def average_precision_from_histograms(pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
  """Per-class AP from score histograms [C, bins] of positives and negatives.

  Equals average precision over scores quantised to the bins, ties within a bin counted
  together (sklearn's average_precision_score on the quantised scores); NaN for classes
  without positives.
  """
  pos = np.asarray(pos, np.float64)[:, ::-1]  # Highest scores first.
  neg = np.asarray(neg, np.float64)[:, ::-1]
  tp, fp = np.cumsum(pos, 1), np.cumsum(neg, 1)
  total = tp[:, -1]
  precision = np.divide(tp, tp + fp, out=np.zeros_like(tp), where=(tp + fp) > 0)
  with np.errstate(invalid="ignore", divide="ignore"):
    return (precision * pos).sum(1) / total


def ap_histograms(scores, positives, mask, bins: int):
  """Per-class score histograms of positives and negatives, each float32 [C, bins].

  scores [B, C] in [0, 1] fall into `bins` equal bins; positives [B, C] are 0/1; rows with
  mask 0 count nowhere. Summed over batches and hosts, the histograms give per-class AP
  (average_precision_from_histograms) without keeping any score.
  """
  num_classes = scores.shape[-1]
  y = positives * mask[:, None]
  binned = jnp.clip((scores * bins).astype(jnp.int32), 0, bins - 1)
  index = (jnp.arange(num_classes)[None, :] * bins + binned).reshape(-1)
  size = num_classes * bins
  pos = jax.ops.segment_sum(y.reshape(-1), index, num_segments=size)
  neg = jax.ops.segment_sum(((1 - positives) * mask[:, None]).reshape(-1), index,
                            num_segments=size)
  return pos.reshape(num_classes, bins), neg.reshape(num_classes, bins)


def mean_average_precision(histograms) -> float:
  """mAP over the classes with at least one positive, from summed ap_histograms."""
  pos, neg = histograms
  return float(np.nanmean(average_precision_from_histograms(pos, neg)))


@base.OBJECTIVES.register("multi_label")
class MultiLabel(base.Objective):
  """Loss: ASL (default) or BCE on label + ancestors; eval: mAP, top-k, semantic top-1.

  With mixup/cutmix the targets are the mixed multi-hot vectors (the losses are linear in y).
  `loss_scale` multiplies the loss (a batch mean): the ASL reference returns the batch sum,
  and under Adam with coupled L2 the loss scale sets the weight decay's effective strength.
  """
  soft_targets = True
  KEYS = {"loss", "gamma_neg", "gamma_pos", "clip", "map_bins", "loss_scale"}

  def __init__(self, cfg, info):
    base.check_keys(cfg, self.KEYS)
    self.tree = base.class_tree(info.class_names)
    if self.tree is None:
      raise ValueError(f"Dataset {info.name!r} has no WordNet wnids as class names: "
                       "multi_label needs the semantic tree to add ancestors as positives.")
    self.kind = cfg.get("loss", "asl")
    if self.kind not in ("asl", "bce"):
      raise ValueError(f"config.objective.loss={self.kind!r}: expected 'asl' or 'bce'.")
    self.gamma_neg = float(cfg.get("gamma_neg", 4.0))
    self.gamma_pos = float(cfg.get("gamma_pos", 0.0))
    self.clip = float(cfg.get("clip", 0.05))
    self.bins = int(cfg.get("map_bins", 1000))
    self.loss_scale = float(cfg.get("loss_scale", 1.0))
    if not self.loss_scale > 0:
      raise ValueError(f"config.objective.loss_scale={self.loss_scale!r}: must be > 0.")
    self.num_classes = info.num_classes
    self.targets = jnp.asarray(self.tree.target_table)

  def multi_hot(self, labels):
    """[B] labels -> [B, C] with the label and each of its ancestors set to 1."""
    ids = self.targets[labels]  # [B, L], -1 where the label has no class at that level.
    return jnp.sum(jax.nn.one_hot(ids, self.num_classes), axis=1)  # one_hot(-1) is all zero.

  def dense_targets(self, batch):
    return self.multi_hot(batch["label"])

  def loss(self, model, batch, rng, frozen=None):
    del frozen
    logits = model(batch["image"], train=True, rng=rng)
    y = batch["targets"] if "targets" in batch else self.multi_hot(batch["label"])
    if self.kind == "asl":
      loss = losses.asymmetric_loss(logits, y, gamma_neg=self.gamma_neg,
                                    gamma_pos=self.gamma_pos, clip=self.clip)
    else:
      loss = losses.binary_cross_entropy(logits, y)
    return self.loss_scale * loss, {}

  def answer(self, logits):
    return semantic_metrics.multi_label_answer(logits, self.tree)

  def membership(self, logits):
    return jax.nn.sigmoid(logits.astype(jnp.float32))  # Trained on label + ancestors.

  def eval_metrics(self, model, batch, topk):
    logits, mask, out = base.classification_eval(model, batch, topk, self.tree, self.answer)
    # Score histograms per class: summed over batches and hosts, mAP in finalize_eval.
    out["ap_hist"] = ap_histograms(jax.nn.sigmoid(logits), self.multi_hot(batch["label"]),
                                   mask, self.bins)
    return out

  def finalize_eval(self, totals) -> dict:
    return {"mAP": mean_average_precision(totals["ap_hist"])}
