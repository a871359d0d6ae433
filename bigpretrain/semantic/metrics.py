"""Semantic accuracy: top-1 accuracy measured separately inside each hierarchy level.

With semantic softmax training an image has one ground truth per level it is labelled at
(Ridnik et al., 2021, section 3.3 and appendix C.3). The prediction at a level is the argmax
of the logits restricted to that level's classes; (image, level) pairs without a target are
ignored. Functions are jnp and jit-friendly: the tree is a static Python object whose tables
become constants.
"""
import jax
import jax.numpy as jnp

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
  """Correct and labelled (image, level) pairs pooled over levels: (num_correct, num_valid)."""
  correct, valid = per_level_accuracy(logits, semantic_targets, tree)
  return jnp.sum(correct), jnp.sum(valid)
