"""SWAG's hashtag objective (Singh et al. 2022, section 3.2): softmax cross-entropy against a
target of 1/K on each of the K canonical hashtags of an image.

Labels arrive as a padded id list per example (int32 [B, K], -1 = padding, the pipeline's
id-list fields) and become a [B, C] multi-hot on device: C is ~27k hashtags in the paper, too
large to ship densely from the host. Images without a hashtag carry no target: the loss is
averaged over the images that have one, and eval metrics count only those.

Eval metrics, over images with at least one label (L = the image's distinct labels):
  precision_at_1: share of images whose top-1 prediction is in L;
  recall_at_k:    mean over images of |top-k predictions ∩ L| / |L| (for each k in topk);
  mAP:            the multi-label objective's binned per-class AP, averaged over classes
                  with a positive, on the softmax probabilities;
  labelled_share: share of eval images with at least one label.
"""
import math

import jax
import jax.numpy as jnp

from bigpretrain import losses
from bigpretrain.objectives import base
from bigpretrain.objectives import multi_label


@base.OBJECTIVES.register("soft_target")
class SoftTarget(base.Objective):
  """Settings: field (the id-list batch field, default 'hashtag_ids'), map_bins (1000).

  With mixup/cutmix the mixed targets are lam t_i + (1 - lam) t_j of the normalised targets
  (1/K each); the loss weighs each row by its target mass, so it stays lam CE_i +
  (1 - lam) CE_j summed over images and divided by the images with a label (an unlabelled
  partner adds nothing).
  """
  soft_targets = True
  KEYS = {"field", "map_bins"}

  def __init__(self, cfg, info):
    base.check_keys(cfg, self.KEYS)
    self.field = str(cfg.get("field", "hashtag_ids"))
    self.reads = (self.field,)
    self.num_classes = int(info.num_classes)
    if self.num_classes < 2:
      raise ValueError(f"soft_target needs at least 2 classes; dataset {info.name!r} has "
                       f"{self.num_classes}.")
    self.bins = int(cfg.get("map_bins", 1000))
    if self.bins < 1:
      raise ValueError(f"config.objective.map_bins={self.bins} must be >= 1.")

  def multi_hot(self, ids) -> jax.Array:
    """int [B, K] ids padded with -1 -> float32 [B, C], 1 at each listed id (repeats once)."""
    return base.id_list_multi_hot(ids, self.num_classes)

  def dense_targets(self, batch) -> jax.Array:
    """1/K on each of an image's K distinct labels; all zero for an image without labels."""
    y = self.multi_hot(batch[self.field])
    count = jnp.sum(y, axis=-1, keepdims=True)
    return y / jnp.maximum(count, 1.0)

  def loss(self, model, batch, rng, frozen=None):
    del frozen
    logits = model(batch["image"], train=True, rng=rng)
    targets = batch["targets"] if "targets" in batch else self.dense_targets(batch)
    # Row mass: 1 for an image with labels, 0 without (mixed rows: their labelled share).
    weights = jnp.sum(targets, axis=-1)
    loss = losses.soft_target_cross_entropy(logits, targets, weights=weights)
    return loss, {}

  def scores(self, logits) -> jax.Array:
    """Softmax probabilities as log-scaled scores in [0, 1] for the mAP histograms.

    1 + log p / (2 log C), clipped: p in [1/C^2, 1] spans the bins with chance (1/C) in the
    middle; linear bins on p would put nearly every score of a 27k-way softmax in bin 0. A
    monotone map of p, so per-class AP is that of p up to the binning.
    """
    log_p = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.clip(1.0 + log_p / (2.0 * math.log(self.num_classes)), 0.0, 1.0)

  def eval_metrics(self, model, batch, topk):
    logits = model(batch["image"], train=False).astype(jnp.float32)
    mask = base.eval_mask(batch, logits.shape[0])
    y = self.multi_hot(batch[self.field])
    out, labelled = base.id_list_metrics(logits, y, mask, topk)
    out["ap_hist"] = multi_label.ap_histograms(self.scores(logits), y, labelled, self.bins)
    return out

  def finalize_eval(self, totals) -> dict:
    return {"mAP": multi_label.mean_average_precision(totals["ap_hist"])}
