"""Tests for bigpretrain.semantic.metrics against numpy loops."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bigpretrain.semantic import metrics
from bigpretrain.semantic.tree import SemanticTree

# 0 (root) -> 1, 2;  1 -> 3, 4;  3 -> 5;  2 -> 7;  6 is a lone root.
# Levels by hand: [0, 6], [1, 2], [3, 4, 7], [5].
_PARENT = [-1, 0, 0, 1, 1, 3, -1, 2]
_LEVELS = [[0, 6], [1, 2], [3, 4, 7], [5]]
_CHAINS = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 1, 3, 5],
           6: [6], 7: [0, 2, 7]}


def _targets(labels):
  """Semantic targets from the hand-written ancestor chains."""
  out = np.full((len(labels), len(_LEVELS)), -1, dtype=np.int32)
  for b, label in enumerate(labels):
    for k, c in enumerate(_CHAINS[label]):
      out[b, k] = c
  return out


def _numpy_per_level(logits, targets):
  correct = np.zeros(len(_LEVELS), dtype=np.int64)
  valid = np.zeros(len(_LEVELS), dtype=np.int64)
  for b in range(logits.shape[0]):
    for k, classes in enumerate(_LEVELS):
      t = targets[b, k]
      if t == -1:
        continue
      valid[k] += 1
      best = max(classes, key=lambda c: logits[b, c])
      correct[k] += int(best == t)
  return correct, valid


def test_per_level_and_pooled_accuracy_match_numpy_loops():
  tree = SemanticTree.from_parents(_PARENT)
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 8, size=64)
  targets = _targets(labels)
  np.testing.assert_array_equal(targets, tree.semantic_targets(labels))
  logits = rng.normal(size=(64, 8)).astype(np.float32)
  correct, valid = metrics.per_level_accuracy(jnp.asarray(logits), jnp.asarray(targets), tree)
  want_correct, want_valid = _numpy_per_level(logits, targets)
  np.testing.assert_array_equal(correct, want_correct)
  np.testing.assert_array_equal(valid, want_valid)
  assert 0 < want_correct[:3].sum() < want_valid[:3].sum()  # Non-trivial data.
  num_correct, num_valid = metrics.semantic_accuracy(logits, targets, tree)
  # Pooled over the levels of two or more classes: level 3 holds class 5 alone.
  assert want_valid[3] > 0 and want_correct[3] == want_valid[3]
  assert int(num_correct) == want_correct[:3].sum() and int(num_valid) == want_valid[:3].sum()


def test_prediction_is_restricted_to_the_level():
  tree = SemanticTree.from_parents(_PARENT)
  # Image labelled 3 (targets 0, 1, 3). Global argmax is class 7 (level 2), but inside level 0
  # class 0 beats 6 and inside level 1 class 2 beats 1; at level 2 class 7 beats 3.
  logits = np.array([[0.5, 0.1, 0.9, 0.3, 0.0, 0.0, 0.2, 5.0]], np.float32)
  targets = _targets([3])
  correct, valid = metrics.per_level_accuracy(logits, targets, tree)
  assert correct.tolist() == [1, 0, 0, 0]
  assert valid.tolist() == [1, 1, 1, 0]
  assert [int(x) for x in metrics.semantic_accuracy(logits, targets, tree)] == [1, 3]


def test_jit_with_tree_closed_over_and_static():
  tree = SemanticTree.from_parents(_PARENT)
  rng = np.random.default_rng(1)
  labels = rng.integers(0, 8, size=16)
  logits = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
  targets = jnp.asarray(_targets(labels))
  want = _numpy_per_level(np.asarray(logits), np.asarray(targets))
  closed = jax.jit(functools.partial(metrics.per_level_accuracy, tree=tree))(logits, targets)
  static = jax.jit(metrics.semantic_accuracy, static_argnums=2)(logits, targets, tree)
  np.testing.assert_array_equal(closed[0], want[0])
  np.testing.assert_array_equal(closed[1], want[1])
  assert int(static[0]) == want[0][:3].sum() and int(static[1]) == want[1][:3].sum()


def _level_softmax_by_hand(row):
  p = np.zeros(len(_PARENT))
  for classes in _LEVELS:
    e = np.exp(row[classes] - row[classes].max())
    p[classes] = e / e.sum()
  return p


def test_semantic_softmax_answer_is_the_walk_stop_probability():
  """P(through c) = P(through parent) * q(c) / max(q(parent), q of the parent's children),
  P(answer c) = P(through c) - P(through c's children), written out per class."""
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, len(_PARENT))).astype(np.float32) * 2
  tree = SemanticTree.from_parents(_PARENT)
  got = np.asarray(metrics.semantic_softmax_answer(jnp.asarray(logits), tree))
  children = {c: [d for d, p in enumerate(_PARENT) if p == c] for c in range(len(_PARENT))}
  for b in range(3):
    q = _level_softmax_by_hand(logits[b].astype(np.float64))
    through = {}
    for c in sum(_LEVELS, []):  # Parents first.
      parent = _PARENT[c]
      through[c] = q[c] if parent < 0 else through[parent] * q[c] / max(
          q[parent], sum(q[d] for d in children[parent]))
    for c in range(len(_PARENT)):
      want = through[c] - sum(through[d] for d in children[c])
      np.testing.assert_allclose(got[b, c], want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got[b].sum(), 1.0, rtol=1e-5)  # A distribution over classes.


def test_semantic_answer_counts_the_parents_mass_once():
  """Root A; B, C, F under it; one leaf under each (D, E, G), labelled 40 / 30 / 30 %: level
  softmaxes at those frequencies (the loss's minimiser) answer D with 0.4, not B (a product of
  the level probabilities along the chain gave B 0.4 x (1 - 0.4) = 0.24 > D's 0.16)."""
  tree = SemanticTree.from_parents([-1, 0, 0, 0, 1, 2, 3])
  logits = np.log(np.array([[1.0, 0.4, 0.3, 0.3, 0.4, 0.3, 0.3]], np.float32))
  answer = np.asarray(metrics.semantic_softmax_answer(jnp.asarray(logits), tree))[0]
  np.testing.assert_allclose(answer, [0, 0, 0, 0, 0.4, 0.3, 0.3], atol=1e-6)


def test_semantic_answer_picks_a_confident_deep_class_and_stops_when_unsure():
  tree = SemanticTree.from_parents(_PARENT)
  big = 8.0
  # Confident along 0 -> 1 -> 3 -> 5: the answer is the leaf 5.
  deep = np.zeros((1, len(_PARENT)), np.float32)
  deep[0, [0, 1, 3, 5]] = big
  # Confident 0 -> 1, but level 2 puts most mass on 7 (under 2, which level 1 rejected):
  # p2 = (1, 1, e) / (2 + e) for (3, 4, 7), so P(stop at 1) ~ e / (2 + e) = 0.58 beats
  # P(4) ~ 0.21 and P(3) ~ 0 (the one-class last level always continues to 5): answer 1.
  unsure = np.zeros((1, len(_PARENT)), np.float32)
  unsure[0, [0, 1]] = big
  unsure[0, 7] = 1.0
  answer = metrics.semantic_softmax_answer(jnp.asarray(np.concatenate([deep, unsure])), tree)
  assert np.argmax(np.asarray(answer), axis=-1).tolist() == [5, 1]
  # A flat argmax over all logits ties 0, 1, 3, 5 in the first row: no meaningful answer.


def test_multi_label_answer_subtracts_the_children():
  tree = SemanticTree.from_parents(_PARENT)
  logits = np.array([[3.0, 1.0, -1.0, 0.5, -2.0, -3.0, -4.0, 0.0]], np.float32)
  s = 1 / (1 + np.exp(-logits[0].astype(np.float64)))
  want = np.array([max(0.0, s[c] - sum(s[d] for d, p in enumerate(_PARENT) if p == c))
                   for c in range(len(_PARENT))])
  got = np.asarray(metrics.multi_label_answer(jnp.asarray(logits), tree))[0]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_eval_metrics_name_the_ranked_levels_only():
  from bigpretrain.objectives import base  # pylint: disable=import-outside-toplevel
  tree = SemanticTree.from_parents(_PARENT)
  labels = np.array([5, 3, 6, 7])
  logits = np.random.default_rng(2).normal(size=(4, 8)).astype(np.float32)
  out = base.semantic_eval_metrics(jnp.asarray(logits), jnp.asarray(labels), jnp.ones(4), tree)
  assert sorted(out) == ["level0_top1", "level1_top1", "level2_top1", "semantic_top1"]
  correct, valid = _numpy_per_level(logits, _targets(labels))
  assert [int(x) for x in out["semantic_top1"]] == [correct[:3].sum(), valid[:3].sum()]
