"""The objective contract, and the pieces objectives share (config checks, eval metrics)."""
import jax
import jax.numpy as jnp
import numpy as np

from bigpretrain import registry
from bigpretrain.runtime import console
from bigpretrain.semantic import metrics as semantic_metrics
from bigpretrain.semantic import tree as semantic_tree
from bigpretrain.semantic import wordnet

# Objective classes by config.objective.name; `cls(config.objective, dataset_info)` builds one.
OBJECTIVES = registry.Registry("objective", "config.objective.name")


class Objective:
  """What a train step computes from a batch. Subclasses set the class attributes and
  implement `loss`; the trainer checks the declarations in `build()`, before compiling.

  reads:        batch fields besides 'image' that loss and eval_metrics use; the dataset must
                have them, and the input pipeline ships only these.
  soft_targets: True if `loss` consumes batch['targets'] [B, C] (mixup/cutmix mixes what
                `dense_targets` returns); False makes mixup/cutmix a build-time error.
  """
  reads: tuple[str, ...] = ("label",)
  soft_targets: bool = False
  # The WordNet tree over the classes (class_tree), or None. With trains_on_tree the loss's
  # targets or heads follow it (semantic softmax's levels, multi-label's ancestors), so the
  # run's checkpoints store it (`meta`) and a resumed run takes it back (`restore_meta`);
  # otherwise it only adds eval metrics.
  tree = None
  trains_on_tree: bool = False

  def loss(self, model, batch, rng, frozen):
    """-> (scalar loss, {metric name: scalar}); traced inside the jitted train step. `model`
    is the merged NNX module; `frozen` is what `load_frozen` returned."""
    raise NotImplementedError

  def dense_targets(self, batch) -> jax.Array:
    """float32 [B, C] hard targets that mixup/cutmix mixes (objectives with soft_targets)."""
    raise NotImplementedError(f"{type(self).__name__} does not take soft targets.")

  def eval_metrics(self, model, batch, topk) -> dict:
    """{name: (numerator, denominator)} summed over the batch, padded rows masked out; names
    without a prefix (the evaluator adds its own)."""
    raise NotImplementedError

  def answer(self, logits) -> jax.Array:
    """[B, C] probability of each class being the image's one label: its argmax is the
    model's answer (predict) and its ranking the eval's top-k. Hierarchical for objectives
    trained on the class tree (semantic.metrics)."""
    return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)

  def membership(self, logits) -> jax.Array:
    """[B, C] probability of the image's label being c or lying under c in the class tree
    (`answer` summed over c's subtree; `answer` itself without a tree): what a model class
    scores when it stands for a dataset class that has subclasses among the model's (an
    ImageNet-1k wnid under an ImageNet-21K model: evaluators.mapped)."""
    tree = getattr(self, "tree", None)
    probs = self.answer(logits)
    return probs if tree is None else semantic_metrics.subtree_sums(probs, tree)

  def finalize_eval(self, totals: dict) -> dict:
    """Metrics derived from the totals summed over a whole split (e.g. mAP from histograms)."""
    del totals
    return {}

  def meta(self) -> dict:
    """Entries of the run's checkpoint 'meta' beside checkpoint.run_meta's: what the weights
    mean that the config does not fix. An objective trained on the class tree stores it
    ('class_tree': {'parent': [...]}, over meta's class_names): its heads were trained for
    that tree, and the rule that builds a tree from a class list may change between versions."""
    if not self.trains_on_tree or self.tree is None:
      return {}
    return {"class_tree": {"parent": self.tree.parent.tolist()}}

  def restore_meta(self, saved: dict) -> str:
    """Takes back the class tree that `meta` stored in `saved`, the meta of the checkpoint this
    objective's weights come from (a resumed run). Returns how this objective's tree (the one
    built now) differed, '' when it did not or nothing was stored (a checkpoint written before
    trees were stored keeps the tree built now)."""
    stored = stored_tree(saved, self.tree) if self.trains_on_tree else None
    if stored is None:
      return ""
    change = semantic_tree.describe_change(stored, self.tree)
    # Train on with the stored tree, not refuse: the heads were trained for its class groups.
    self.tree = stored
    return change

  def load_frozen(self, mesh, rules, compute_dtype, data_cfg):
    """(tree, shardings) of fixed step inputs (a distillation teacher), or (None, None).
    `data_cfg` is config.data (e.g. to check that a teacher expects the same input)."""
    del mesh, rules, compute_dtype, data_cfg
    return None, None

  def abstract_frozen(self, mesh, rules, compute_dtype, data_cfg, model=None):
    """load_frozen's (tree, shardings) as ShapeDtypeStructs, for compiling a step ahead of
    time (bigpretrain.plan.aot_plan): no weights read. `model` (a config.model mapping) stands in
    for a checkpoint's model, e.g. to plan a distillation before its teacher exists."""
    del mesh, rules, compute_dtype, data_cfg, model
    return None, None


def check_keys(cfg, allowed: set[str]) -> None:
  """Rejects unknown keys in config.objective, naming them."""
  unknown = sorted(set(cfg.keys()) - allowed - {"name"})
  if unknown:
    raise ValueError(f"config.objective ({cfg.name}) has unknown keys {unknown}; "
                     f"allowed: {sorted(allowed)}.")


def label_smoothing(cfg, default: float) -> float:
  """config.objective.label_smoothing (default `default`), refused outside [0, 1)."""
  value = float(cfg.get("label_smoothing", default))
  if not 0.0 <= value < 1.0:
    raise ValueError(f"config.objective.label_smoothing={value} must be in [0, 1).")
  return value


def topk_metrics(logits, labels, mask, topk=(1, 5)) -> dict:
  """{'top{k}': (num_correct, num_examples)} over rows with mask 1."""
  out = {}
  order = jnp.argsort(-logits, axis=-1)
  for k in topk:
    k = min(k, logits.shape[-1])
    hit = jnp.any(order[:, :k] == labels[:, None], axis=-1)
    out[f"top{k}"] = (jnp.sum(hit * mask), jnp.sum(mask))
  return out


def eval_mask(batch, batch_size: int):
  return batch["mask"] if "mask" in batch else jnp.ones((batch_size,), jnp.float32)


def id_list_multi_hot(ids, num_classes: int) -> jax.Array:
  """int [B, K] ids padded with -1 -> float32 [B, C], 1 at each listed id (repeats once).

  A compare-and-reduce over K that XLA fuses: no [B, K, C] array is materialised.
  """
  ids = jnp.asarray(ids)
  hot = jnp.any(ids[:, :, None] == jnp.arange(num_classes)[None, None, :], axis=1)
  return hot.astype(jnp.float32)


def id_list_metrics(logits, y, mask, topk) -> tuple[dict, jax.Array]:
  """Top-k metrics of an id-list target y [B, C] (0/1), over the rows with mask 1 that have
  at least one label (L = the row's labels): labelled_share (such rows / rows),
  precision_at_1 (top-1 in L), recall_at_k (|top-k ∩ L| / |L|, k capped at C).
  Returns (metrics, the labelled-row mask [B])."""
  num_classes = logits.shape[-1]
  count = jnp.sum(y, axis=-1)
  labelled = (count > 0).astype(jnp.float32) * mask
  num_labelled = jnp.sum(labelled)
  out = {"labelled_share": (num_labelled, jnp.sum(mask))}
  top1 = jnp.argmax(logits, axis=-1)
  hit = jnp.take_along_axis(y, top1[:, None], axis=-1)[:, 0]
  out["precision_at_1"] = (jnp.sum(hit * labelled), num_labelled)
  for k in sorted(set(min(int(k), num_classes) for k in topk)):
    _, top = jax.lax.top_k(logits, k)
    found = jnp.sum(jnp.take_along_axis(y, top, axis=-1), axis=-1)
    recall = found / jnp.maximum(count, 1.0)
    out[f"recall_at_{k}"] = (jnp.sum(recall * labelled), num_labelled)
  return out, labelled


def class_tree(class_names, required: bool = True):
  """The WordNet tree over the classes, or None when the class names are not wnids. A list of
  wnids the tree cannot be built over (one outside WordNet 3.0, a repeated one) raises, or,
  when the tree only adds metrics (not `required`), is warned about and gives None."""
  names = list(class_names or ())
  if not names or not all(wordnet.is_wnid(n) for n in names):
    return None
  try:
    return semantic_tree.SemanticTree.from_wnids(names)
  except ValueError as e:
    if required:
      raise
    console.warn(f"no semantic metrics: {e}")
    return None


def stored_tree(meta: dict, like):
  """The class tree stored in checkpoint meta `meta` (see Objective.meta), over the classes of
  tree `like`; None when it stores none or `like` is None."""
  stored = (meta or {}).get("class_tree")
  if stored is None or like is None:
    return None
  return semantic_tree.SemanticTree.from_parents(stored["parent"], like.wnids)


def semantic_eval_metrics(logits, labels, mask, tree) -> dict:
  """Semantic top-1 (pooled over levels, as in the ImageNet-21K paper) and per-level top-1."""
  targets = jnp.asarray(tree.target_table)[labels]
  targets = jnp.where(mask[:, None] > 0, targets, -1)
  out = {"semantic_top1": semantic_metrics.semantic_accuracy(logits, targets, tree)}
  correct, valid = semantic_metrics.per_level_accuracy(logits, targets, tree)
  for k in np.flatnonzero(tree.level_sizes > 1):  # As semantic_accuracy pools them.
    out[f"level{k}_top1"] = (correct[k], valid[k])
  return out


def classification_eval(model, batch, topk, tree, answer=None):
  """Eval logits plus top-k metrics (of `answer(logits)` when given) and, on WordNet-labelled
  data, semantic metrics."""
  logits = model(batch["image"], train=False)
  mask = eval_mask(batch, logits.shape[0])
  out = topk_metrics(logits if answer is None else answer(logits), batch["label"], mask, topk)
  if tree is not None:
    out.update(semantic_eval_metrics(logits, batch["label"], mask, tree))
  return logits, mask, out
