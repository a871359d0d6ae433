"""Multi-label training: one sigmoid per class, the asymmetric loss (ASL) or plain BCE, mAP.

Two sources of positives (config.objective.field):
- '' (default): the ImageNet-21K paper's multi-label pretraining baseline (ImageNet-21K
  Pretraining for the Masses, section 3.2): an image's positives are its single 'label' and
  all the label's ancestors in the semantic tree (class names must be WordNet wnids).
- 'NAME': a multi-label dataset's own labels, the id-list batch field NAME (int32 [B, K]
  padded with -1, as soft_target reads 'hashtag_ids'; e.g. 'labels' of tfds voc): the
  positives are exactly the listed classes, no tree, any class names. This is the paper's
  multi-label transfer setting (its Table 2: MS-COCO, Pascal-VOC mAP with ASL).
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
  """Loss: ASL (default) or BCE on the multi-hot targets; eval: mAP and top-k.

  field '': targets = label + ancestors; eval top-k of the hierarchical answer and semantic
  top-1 against the single label. field NAME: targets = the classes listed in batch[NAME];
  eval precision_at_1 / recall_at_k / labelled_share as soft_target reports them (over
  images with at least one label), mAP over all real images (an image without labels is a
  negative for every class).

  With mixup/cutmix the targets are the mixed multi-hot vectors (the losses are linear in y).
  `loss_scale` multiplies the loss (a batch mean): the ASL reference returns the batch sum,
  and under Adam with coupled L2 the loss scale sets the weight decay's effective strength.
  """
  soft_targets = True
  trains_on_tree = True  # Without a tree (field set) nothing is stored.
  KEYS = {"loss", "gamma_neg", "gamma_pos", "clip", "map_bins", "loss_scale", "field"}

  def __init__(self, cfg, info):
    base.check_keys(cfg, self.KEYS)
    self.field = str(cfg.get("field", "") or "")
    if self.field:  # The dataset's own id lists: no tree, any class names.
      self.reads = (self.field,)
      self.tree = None
    else:
      self.tree = base.class_tree(info.class_names, required=False)
      if self.tree is None:
        raise ValueError(
            f"Dataset {info.name!r} has no WordNet wnids as class names: multi_label needs "
            "the semantic tree to add ancestors as positives; for a dataset with its own "
            "label lists set config.objective.field to their id-list field (e.g. 'labels').")
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

  @property
  def targets(self):
    """[C, L] class -> the class and its ancestors, of the tree in use (restore_meta may
    replace it); None without a tree."""
    return None if self.tree is None else jnp.asarray(self.tree.target_table)

  def multi_hot(self, labels):
    """[B] labels -> [B, C] with the label and each of its ancestors set to 1."""
    ids = self.targets[labels]  # [B, L], -1 where the label has no class at that level.
    return jnp.sum(jax.nn.one_hot(ids, self.num_classes), axis=1)  # one_hot(-1) is all zero.

  def dense_targets(self, batch):
    """[B, C] 0/1: label + ancestors, or the classes listed in batch[field]."""
    if self.field:
      return base.id_list_multi_hot(batch[self.field], self.num_classes)
    return self.multi_hot(batch["label"])

  def loss(self, model, batch, rng, frozen=None):
    del frozen
    logits = model(batch["image"], train=True, rng=rng)
    y = batch["targets"] if "targets" in batch else self.dense_targets(batch)
    if self.kind == "asl":
      loss = losses.asymmetric_loss(logits, y, gamma_neg=self.gamma_neg,
                                    gamma_pos=self.gamma_pos, clip=self.clip)
    else:
      loss = losses.binary_cross_entropy(logits, y)
    return self.loss_scale * loss, {}

  def answer(self, logits):
    if self.tree is None:  # Independent sigmoids: each class's own probability.
      return jax.nn.sigmoid(logits.astype(jnp.float32))
    return semantic_metrics.multi_label_answer(logits, self.tree)

  def membership(self, logits):
    # Trained on label + ancestors (sigmoid(c) = P(label under c)), or on the listed classes.
    return jax.nn.sigmoid(logits.astype(jnp.float32))

  def eval_metrics(self, model, batch, topk):
    if self.field:
      logits = model(batch["image"], train=False).astype(jnp.float32)
      mask = base.eval_mask(batch, logits.shape[0])
      y = self.dense_targets(batch)
      out, _ = base.id_list_metrics(logits, y, mask, topk)
      out["ap_hist"] = ap_histograms(jax.nn.sigmoid(logits), y, mask, self.bins)
      return out
    logits, mask, out = base.classification_eval(model, batch, topk, self.tree, self.answer)
    # Score histograms per class: summed over batches and hosts, mAP in finalize_eval.
    out["ap_hist"] = ap_histograms(jax.nn.sigmoid(logits), self.multi_hot(batch["label"]),
                                   mask, self.bins)
    return out

  def finalize_eval(self, totals) -> dict:
    return {"mAP": mean_average_precision(totals["ap_hist"])}
