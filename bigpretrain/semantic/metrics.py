"""Semantic accuracy: top-1 accuracy measured separately inside each hierarchy level.

With semantic softmax training an image has one ground truth per level it is labelled at
(Ridnik et al., 2021, section 3.3 and appendix C.3). The prediction at a level is the argmax
of the logits restricted to that level's classes; (image, level) pairs without a target are
ignored. Functions are jnp and jit-friendly: the tree is a static Python object whose tables
become constants.
"""
import jax
import jax.numpy as jnp
import numpy as np

from bigpretrain.semantic.tree import SemanticTree


def _check_shapes(logits, semantic_targets, tree: SemanticTree):
  if logits.ndim != 2 or logits.shape[-1] != tree.num_classes:
    raise ValueError(
        f"logits must be [B, {tree.num_classes}] for this tree; got shape {logits.shape}.")
  if semantic_targets.shape != (logits.shape[0], tree.num_levels):
    raise ValueError(f"semantic_targets must be [B, num_levels] = "
                     f"[{logits.shape[0]}, {tree.num_levels}]; got {semantic_targets.shape}.")


def per_level_accuracy(logits: jax.Array, semantic_targets: jax.Array,
                       tree: SemanticTree) -> tuple[jax.Array, jax.Array]:
  """Correct and labelled counts per level: (correct int32 [L], valid int32 [L])."""
  _check_shapes(logits, semantic_targets, tree)
  semantic_targets = jnp.asarray(semantic_targets)
  correct, valid = [], []
  for k, classes in enumerate(tree.level_classes):
    target = semantic_targets[:, k]
    is_valid = target != -1
    prediction = jnp.asarray(classes)[jnp.argmax(logits[:, classes], axis=-1)]
    correct.append(jnp.sum(is_valid & (prediction == target), dtype=jnp.int32))
    valid.append(jnp.sum(is_valid, dtype=jnp.int32))
  return jnp.stack(correct), jnp.stack(valid)


def semantic_accuracy(logits: jax.Array, semantic_targets: jax.Array,
                      tree: SemanticTree) -> tuple[jax.Array, jax.Array]:
  """Correct and labelled (image, level) pairs pooled over the levels of two or more classes:
  (num_correct, num_valid). A level of one class is always right; the authors' metric leaves
  it out (ImageNet-21K-P's 12th level, one class: the paper's 11 hierarchies)."""
  correct, valid = per_level_accuracy(logits, semantic_targets, tree)
  ranked = jnp.asarray(tree.level_sizes > 1)
  return jnp.sum(jnp.where(ranked, correct, 0)), jnp.sum(jnp.where(ranked, valid, 0))


# Hierarchical inference: one answer per image from a model trained on the class tree.
#
# Read the model as a top-down walk: start at a root class, then at each node either step to
# one of its children or stop there. subtree probability of c: the walk passes through c (the
# label is c or a descendant of c); the probability that it stops at c (the label is exactly
# c) is then that minus the sum over c's children. Its argmax is the single answer and its
# ranking gives top-k. Unlike an argmax over all logits, it neither always answers a root
# (ancestors are the most probable classes) nor a leaf, and needs no threshold.


def level_softmax(logits: jax.Array, tree: SemanticTree) -> jax.Array:
  """[B, C] logits -> [B, C] probabilities, a separate softmax inside each level."""
  probs = jnp.zeros(logits.shape, jnp.float32)
  for classes in tree.level_classes:
    probs = probs.at[:, classes].set(jax.nn.softmax(logits[:, classes].astype(jnp.float32)))
  return probs


def path_probs(level_probs: jax.Array, tree: SemanticTree) -> jax.Array:
  """Semantic softmax: P(the walk passes through c), from the level softmaxes q.

  A level's softmax spreads its mass over all of that level's classes, not over one parent's
  children, and is trained on the images whose label reaches the level (paper, section 3.3):
  q_k(c) is P(the label's level-k class is c | it has one). How many labels stop above level
  k is not in the outputs; this rule takes a parent's mass to go down as far as its own
  children's q allow: the walk at P steps to child c with q_k(c) / q_{k-1}(P) and stops at P
  with the rest, the steps scaled to sum to 1 where P's children hold more than P. (A product
  of q along the chain would count the parent's mass twice: q_k(c) already includes it.) It
  is the project's rule: the paper gives no single answer (its view, view.py, takes each
  level's top class). A labelling consistent with every parent at once would need one depth
  factor per level, the smallest q_{k-1}(P) / (P's children's q_k) over the level's parents:
  set by a model's least consistent parent, it could stop the walks of every image early."""
  out = level_probs
  for classes in tree.level_classes[1:]:  # Parents sit one level up and are already done.
    parents = jnp.asarray(tree.parent[classes])
    q = level_probs[:, classes]
    children = jnp.zeros_like(level_probs).at[:, parents].add(q)[:, parents]
    share = q / jnp.maximum(jnp.maximum(level_probs[:, parents], children), 1e-30)
    out = out.at[:, classes].set(out[:, parents] * share)
  return out


def subtree_sums(probs: jax.Array, tree: SemanticTree) -> jax.Array:
  """[B, C] probabilities of each class being the label -> of the label being c or lying
  under c: each class's own plus its descendants', summed deepest level first."""
  out = probs
  for classes in tree.level_classes[:0:-1]:
    out = out.at[:, jnp.asarray(tree.parent[classes])].add(out[:, classes])
  return out


def stop_probs(subtree: jax.Array, tree: SemanticTree) -> jax.Array:
  """P(the label is exactly c) = P(subtree of c) - sum over c's children, clipped at 0 (a
  multi-label model's sigmoids need not be consistent down the tree)."""
  children = jnp.zeros_like(subtree)
  has_parent = np.flatnonzero(tree.parent >= 0)
  if len(has_parent):
    children = children.at[:, tree.parent[has_parent]].add(subtree[:, has_parent])
  return jnp.maximum(subtree - children, 0.0)


def semantic_softmax_answer(logits: jax.Array, tree: SemanticTree) -> jax.Array:
  """[B, C] per-class probability of being the answer, for per-level softmax models."""
  return stop_probs(path_probs(level_softmax(logits, tree), tree), tree)


def multi_label_answer(logits: jax.Array, tree: SemanticTree) -> jax.Array:
  """The same for sigmoid models trained on label + ancestors: sigmoid(c) estimates
  P(label in the subtree of c)."""
  return stop_probs(jax.nn.sigmoid(logits.astype(jnp.float32)), tree)
