"""cosub: co-training 2^L submodels (Touvron et al. 2023) on the DeiT-III recipe.

Each step the batch of B images is repeated to n*B rows (n = num_submodels, 2 or 3) and run
through the same network in ONE forward pass. Stochastic depth draws independent keep/drop
decisions per row and residual branch, so the n copies of an image go through n different
random submodels, and each learns from the labels and from the others' stop-gradient
predictions (losses.cosub_loss). The copies of an image sit on adjacent rows, so they stay on
the same data shard. num_submodels=1 is the same recipe without cosub (the baseline).

Loss kinds: 'bce' (ImageNet-1k: sigmoid BCE, targets binarised with bce_binarize as DeiT-III
does after mixup) and 'ce' (ImageNet-21k pre-training and fine-tuning: softmax CE on soft
targets). Targets are batch['targets'] ([B, C] soft labels, when the trainer applies
mixup/cutmix) or one-hot batch['label'] smoothed by label_smoothing.

Config (config.objective): name='cosub', kind ('bce'|'ce'), num_submodels (1 = off, 2, 3),
label_weight (0.5: weight of the label term; the rest is split over the distillation terms),
label_smoothing (only for one-hot labels; with mixup set config.mixup.label_smoothing),
bce_binarize (bool).
"""
import jax
import jax.numpy as jnp
import optax

from bigpretrain import losses
from bigpretrain.objectives import base

KINDS = ("bce", "ce")


@base.OBJECTIVES.register("cosub")
class Cosub(base.Objective):
  """Co-training of `num_submodels` stochastic-depth submodels of one network."""
  soft_targets = True

  def __init__(self, cfg, info):
    base.check_keys(cfg, {"kind", "num_submodels", "label_weight", "label_smoothing",
                          "bce_binarize"})
    self.num_classes = info.num_classes
    # Semantic eval metrics on WordNet-labelled data.
    self.tree = base.class_tree(info.class_names, required=False)
    self.kind = cfg.get("kind", "bce")
    self.num_submodels = cfg.get("num_submodels", 2)
    self.label_weight = float(cfg.get("label_weight", 0.5))
    self.label_smoothing = float(cfg.get("label_smoothing", 0.0))
    self.bce_binarize = cfg.get("bce_binarize", False)
    if self.kind not in KINDS:
      raise ValueError(f"config.objective.kind={self.kind!r} must be one of {KINDS}.")
    if (not isinstance(self.num_submodels, int) or isinstance(self.num_submodels, bool)
        or self.num_submodels < 1):
      raise ValueError(f"config.objective.num_submodels={self.num_submodels!r} must be an int "
                       ">= 1 (1 = no cosub, 2 = the paper's setting, 3 = supplement D).")
    if not 0.0 <= self.label_weight <= 1.0:
      raise ValueError(f"config.objective.label_weight={self.label_weight} must be in [0, 1].")
    if not 0.0 <= self.label_smoothing < 1.0:
      raise ValueError(
          f"config.objective.label_smoothing={self.label_smoothing} must be in [0, 1).")
    if not isinstance(self.bce_binarize, bool):
      raise ValueError(f"config.objective.bce_binarize={self.bce_binarize!r} must be a bool.")
    if self.bce_binarize and self.kind != "bce":
      raise ValueError("config.objective.bce_binarize=True needs kind='bce' "
                       f"(got kind={self.kind!r}).")
    if self.bce_binarize and self.label_smoothing > 0:
      raise ValueError("config.objective.bce_binarize=True needs label_smoothing=0 (got "
                       f"{self.label_smoothing}): smoothed targets are all > 0, so binarising "
                       "would make every class positive.")

  def dense_targets(self, batch) -> jax.Array:
    return jax.nn.one_hot(batch["label"], self.num_classes, dtype=jnp.float32)

  def targets(self, batch) -> jax.Array:
    """[B, C] float32 targets: mixed soft labels or smoothed one-hot labels, maybe binarised."""
    if "targets" in batch:
      y = batch["targets"].astype(jnp.float32)
    else:
      y = self.dense_targets(batch)
      if self.label_smoothing > 0:
        y = optax.smooth_labels(y, self.label_smoothing)
    if self.bce_binarize:
      y = (y > 0).astype(jnp.float32)
    return y

  def _check_model(self, model):
    rates = model.drop_path_rates
    if rates is None:
      raise ValueError(f"cosub needs a model with stochastic depth (drop_path_rates); "
                       f"{type(model).__name__} has none.")
    if self.num_submodels > 1 and max(rates, default=0.0) <= 0.0:
      raise ValueError(
          f"cosub with num_submodels={self.num_submodels} needs stochastic depth: "
          "config.model.drop_path_rate (tau) is 0, so every submodel is the whole network and "
          "the cosub terms vanish. Set tau > 0 (Table A.1) or num_submodels=1.")

  def loss(self, model, batch, rng, frozen=None):
    del frozen  # cosub has no frozen teacher: the submodels teach each other.
    self._check_model(model)
    images, n = batch["image"], self.num_submodels
    b = images.shape[0]
    y = self.targets(batch)
    aux = {}
    rates = model.effective_drop_path_rates(n * b)
    if rates is not None:
      rates = rates or [0.0]
      aux["train/esd_effective_drop"] = jnp.float32(sum(rates) / len(rates))
    if n == 1:
      logits = model(images, train=True, rng=rng)
      if self.kind == "bce":
        return losses.binary_cross_entropy(logits, y), aux
      return losses.soft_target_cross_entropy(logits, y), aux
    # Copies of an image on adjacent rows: row b*n + i is submodel i's view of image b.
    logits = model(jnp.repeat(images, n, axis=0), train=True, rng=rng).reshape(b, n, -1)
    subs = [logits[:, i] for i in range(n)]
    loss = losses.cosub_loss(subs, y, kind=self.kind, label_weight=self.label_weight)
    pred = jnp.argmax(logits, axis=-1)
    aux["train/submodel_agreement"] = jnp.mean(
        jnp.all(pred == pred[:, :1], axis=-1).astype(jnp.float32))
    return loss, aux

  def eval_metrics(self, model, batch, topk):
    return base.classification_eval(model, batch, topk, self.tree)[2]
