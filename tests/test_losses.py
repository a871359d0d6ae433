"""Tests for bigpretrain.losses against hand-written numpy loops and closed forms."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bigpretrain import losses
from bigpretrain.semantic.tree import SemanticTree

# --- numpy references (float64, explicit loops) ---------------------------------------------


def _log_softmax(z):
  z = np.asarray(z, np.float64)
  m = z.max()
  return z - (m + math.log(np.exp(z - m).sum()))


def _softmax(z):
  return np.exp(_log_softmax(z))


def _sigmoid(x):
  return 1.0 / (1.0 + math.exp(-x))


def _np_soft_ce(logits, targets):
  total = 0.0
  for b in range(logits.shape[0]):
    s = targets[b].sum()
    if s == 0:
      continue
    logp = _log_softmax(logits[b])
    total += -sum(targets[b, c] / s * logp[c] for c in range(logits.shape[1]))
  return total / logits.shape[0]


def _np_bce(logits, targets):
  total = 0.0
  for x, y in zip(logits.ravel(), targets.ravel()):
    p = _sigmoid(float(x))
    total += -(y * math.log(p) + (1 - y) * math.log(1 - p))
  return total / logits.size


def _rng_logits(seed, shape, scale=2.0):
  return (np.random.default_rng(seed).normal(size=shape) * scale).astype(np.float32)


# --- cross_entropy, soft targets, BCE --------------------------------------------------------


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_cross_entropy_with_label_smoothing_matches_loops(eps):
  logits = _rng_logits(0, (5, 4))
  labels = np.array([0, 3, 1, 1, 2])
  want = 0.0
  for b in range(5):
    logp = _log_softmax(logits[b])
    target = [(1 - eps) * (c == labels[b]) + eps / 4 for c in range(4)]
    assert abs(sum(target) - 1.0) < 1e-12  # Smoothed targets still sum to 1.
    want += -sum(t * lp for t, lp in zip(target, logp)) / 5
  got = losses.cross_entropy(jnp.asarray(logits), jnp.asarray(labels), label_smoothing=eps)
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_cross_entropy_uniform_logits_is_log_c_and_weights_are_a_weighted_mean():
  assert float(losses.cross_entropy(jnp.zeros((3, 7)), jnp.array([0, 1, 6]),
                                    label_smoothing=0.2)) == pytest.approx(math.log(7), rel=1e-6)
  logits = _rng_logits(1, (4, 3))
  labels = np.array([2, 0, 1, 1])
  per_example = [-_log_softmax(logits[b])[labels[b]] for b in range(4)]
  weights = np.array([1.0, 0.0, 2.0, 1.0])
  want = sum(w * l for w, l in zip(weights, per_example)) / weights.sum()
  got = losses.cross_entropy(logits, labels, weights=weights)
  np.testing.assert_allclose(float(got), want, rtol=1e-5)
  assert float(losses.cross_entropy(logits, labels, weights=np.zeros(4))) == 0.0


def test_cross_entropy_computes_in_float32_from_bfloat16():
  logits = _rng_logits(2, (3, 5))
  got = losses.cross_entropy(jnp.asarray(logits, jnp.bfloat16), jnp.array([0, 1, 2]))
  assert got.dtype == jnp.float32


def test_soft_target_cross_entropy_normalises_rows_and_skips_empty_rows():
  logits = _rng_logits(3, (4, 5))
  targets = np.array([[1, 0, 1, 0, 0],      # Two hashtags: 1/2 each.
                      [0, 0, 0, 0, 0],      # No target: contributes 0, still counted in B.
                      [0.2, 0.3, 0, 0, 0],  # Mixed, sums to 0.5: rescaled to 0.4, 0.6.
                      [0, 0, 0, 3, 0]], np.float32)
  got = losses.soft_target_cross_entropy(logits, targets)
  np.testing.assert_allclose(float(got), _np_soft_ce(logits, targets), rtol=1e-5)
  lp = [_log_softmax(logits[b]) for b in range(4)]
  by_hand = (-(lp[0][0] + lp[0][2]) / 2 - (0.4 * lp[2][0] + 0.6 * lp[2][1]) - lp[3][3]) / 4
  np.testing.assert_allclose(float(got), by_hand, rtol=1e-5)


def test_binary_cross_entropy_is_elementwise_mean():
  logits = _rng_logits(4, (3, 4), scale=3.0)
  targets = np.random.default_rng(5).uniform(size=(3, 4)).astype(np.float32)
  targets[0, :2] = [0.0, 1.0]
  got = losses.binary_cross_entropy(logits, targets)
  np.testing.assert_allclose(float(got), _np_bce(logits, targets), rtol=1e-5)
  # Closed form: zero logits give log 2 whatever the targets.
  assert float(losses.binary_cross_entropy(np.zeros((2, 3)), targets[:2, :3])) == pytest.approx(
      math.log(2), rel=1e-6)


# --- asymmetric loss ------------------------------------------------------------------------


def _np_asl(logits, y, gamma_neg, gamma_pos, clip, eps=1e-8):
  total = 0.0
  for b in range(logits.shape[0]):
    for c in range(logits.shape[1]):
      p = _sigmoid(float(logits[b, c]))
      if y[b, c]:
        total += -((1 - p) ** gamma_pos) * math.log(max(p, eps))
      else:
        p_m = max(p - clip, 0.0)
        total += -(p_m ** gamma_neg) * math.log(max(1 - p_m, eps))
  return total / logits.shape[0]


@pytest.mark.parametrize("gamma_neg, gamma_pos, clip", [
    (4.0, 0.0, 0.05), (2.0, 1.0, 0.1), (1.0, 0.5, 0.3), (0.0, 0.0, 0.0)])
def test_asymmetric_loss_matches_loops(gamma_neg, gamma_pos, clip):
  logits = _rng_logits(6, (3, 6), scale=2.5)
  y = np.zeros((3, 6), np.float32)
  y[0, 1] = y[1, [0, 4]] = y[2, 5] = 1.0
  got = losses.asymmetric_loss(logits, y, gamma_neg=gamma_neg, gamma_pos=gamma_pos, clip=clip)
  np.testing.assert_allclose(float(got), _np_asl(logits, y, gamma_neg, gamma_pos, clip),
                             rtol=1e-5)


def test_asymmetric_loss_without_focusing_or_clip_is_bce_summed_over_classes():
  logits = _rng_logits(7, (4, 5))
  y = (np.random.default_rng(8).uniform(size=(4, 5)) < 0.3).astype(np.float32)
  got = losses.asymmetric_loss(logits, y, gamma_neg=0.0, gamma_pos=0.0, clip=0.0)
  np.testing.assert_allclose(float(got), 5 * _np_bce(logits, y), rtol=1e-5)


def test_asymmetric_loss_clip_discards_easy_negatives():
  # A negative with p = sigmoid(-4) ~ 0.018 < clip = 0.05 has p_m = 0: no loss, no gradient.
  loss, grad = jax.value_and_grad(losses.asymmetric_loss)(jnp.array([[-4.0]]), jnp.zeros((1, 1)))
  assert float(loss) == 0.0 and float(grad[0, 0]) == 0.0


def test_asymmetric_loss_gradient_includes_focusing_weights():
  # Finite differences of the float64 reference include d(weight)/dx: the loss does not
  # stop-gradient the focusing weights.
  logits = np.array([[0.7, -0.3, 1.5], [-1.2, 2.0, 0.1]], np.float64)
  y = np.array([[1, 0, 0], [0, 1, 0]], np.float32)
  kw = dict(gamma_neg=3.0, gamma_pos=1.0, clip=0.05)
  grad = np.asarray(jax.grad(lambda x: losses.asymmetric_loss(x, y, **kw))(
      jnp.asarray(logits, jnp.float32)))
  h = 1e-5
  for b in range(2):
    for c in range(3):
      up, down = logits.copy(), logits.copy()
      up[b, c] += h
      down[b, c] -= h
      numeric = (_np_asl(up, y, **kw) - _np_asl(down, y, **kw)) / (2 * h)
      np.testing.assert_allclose(grad[b, c], numeric, rtol=1e-3, atol=1e-5)


def test_asymmetric_loss_gradients_finite_at_saturation():
  logits = jnp.array([[40.0, -40.0, 0.0]])
  for kw in (dict(gamma_neg=4.0, gamma_pos=0.0, clip=0.05),
             dict(gamma_neg=0.5, gamma_pos=0.5, clip=0.0)):
    grad = jax.grad(lambda x, kw=kw: losses.asymmetric_loss(x, jnp.array([[1.0, 0.0, 1.0]]),
                                                            **kw))(logits)
    assert np.all(np.isfinite(np.asarray(grad)))


# --- semantic softmax and semantic KD ---------------------------------------------------------

# Tiny tree (class: parent): 0 (root) -> 1, 2;  1 -> 3, 4;  3 -> 5;  2 -> 7;  6 is a root with
# no ancestor and no children. Levels by hand: [0, 6], [1, 2], [3, 4, 7], [5] (one class, the
# deepest). O_k = [8, 6, 4, 1], so W = [1, 4/3, 2, 8] with max_weight 20.
_PARENT = [-1, 0, 0, 1, 1, 3, -1, 2]
_LEVELS = [[0, 6], [1, 2], [3, 4, 7], [5]]
_WEIGHTS = [1.0, 4 / 3, 2.0, 8.0]
_CHAINS = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 1, 3, 5],
           6: [6], 7: [0, 2, 7]}


def _targets(labels):
  out = np.full((len(labels), 4), -1, dtype=np.int32)
  for b, label in enumerate(labels):
    for k, c in enumerate(_CHAINS[label]):
      out[b, k] = c
  return out


def _np_semantic_softmax(logits, targets, eps, weights):
  batch = logits.shape[0]
  level_losses = []
  for k, classes in enumerate(_LEVELS):
    n = len(classes)
    total = 0.0
    for b in range(batch):
      t = targets[b, k]
      if t == -1:
        continue
      logp = _log_softmax(logits[b, classes])
      j = classes.index(t)
      total += -((1 - eps) * logp[j] + eps / n * logp.sum())
    level_losses.append(total / batch)
  return sum(w * l for w, l in zip(weights, level_losses)), level_losses


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_semantic_softmax_loss_matches_loops(eps):
  tree = SemanticTree.from_parents(_PARENT)
  labels = [5, 6, 7, 0, 4, 2]  # Deepest class, lone root, rows without deeper labels...
  targets = _targets(labels)
  logits = _rng_logits(10, (6, 8))
  loss, aux = losses.semantic_softmax_loss(logits, targets, tree, label_smoothing=eps)
  want, want_levels = _np_semantic_softmax(logits, targets, eps, _WEIGHTS)
  np.testing.assert_allclose(np.asarray(aux["level_losses"]), want_levels, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  assert float(aux["level_losses"][3]) == 0.0  # A level with one class.


def test_semantic_softmax_loss_closed_form_and_max_weight():
  tree = SemanticTree.from_parents(_PARENT)
  targets = _targets([5, 6])
  # Zero logits: every labelled (row, level) costs log(n_k), whatever the smoothing.
  # Level 0: both rows; level 1: row 0; level 2: row 0; level 3: log 1 = 0. B = 2.
  loss, aux = losses.semantic_softmax_loss(jnp.zeros((2, 8)), targets, tree, max_weight=1.5)
  levels = [math.log(2), math.log(2) / 2, math.log(3) / 2, 0.0]
  np.testing.assert_allclose(np.asarray(aux["level_losses"]), levels, rtol=1e-6)
  np.testing.assert_allclose(float(loss), levels[0] + 4 / 3 * levels[1] + 1.5 * levels[2],
                             rtol=1e-6)


def test_semantic_softmax_loss_gradient_only_from_labelled_levels():
  tree = SemanticTree.from_parents(_PARENT)
  logits = _rng_logits(11, (1, 8))
  grad = jax.grad(lambda x: losses.semantic_softmax_loss(x, _targets([6]), tree)[0])(logits)
  grad = np.asarray(grad)[0]
  # Label 6 only has a level-0 target: only level-0 logits (classes 0 and 6) move.
  assert np.all(grad[[1, 2, 3, 4, 5, 7]] == 0.0)
  p = _softmax(logits[0, [0, 6]])
  np.testing.assert_allclose(grad[[0, 6]], (p - [0.1, 0.9]) * 1.0, rtol=1e-5)


def test_semantic_softmax_loss_rejects_wrong_shapes():
  tree = SemanticTree.from_parents(_PARENT)
  with pytest.raises(ValueError, match="logits must be"):
    losses.semantic_softmax_loss(jnp.zeros((2, 7)), _targets([0, 1]), tree)
  with pytest.raises(ValueError, match="semantic_targets must be"):
    losses.semantic_softmax_loss(jnp.zeros((2, 8)), _targets([0, 1])[:, :3], tree)


def _np_semantic_kd(student, teacher, levels):
  batch = student.shape[0]
  level_losses = []
  for classes in levels:
    top = -(-len(classes) // 20)
    total = 0.0
    for b in range(batch):
      ps, pt = _softmax(student[b, classes]), _softmax(teacher[b, classes])
      confidence = sum(sorted(pt, reverse=True)[:top])
      total += confidence * sum((s - t) ** 2 for s, t in zip(ps, pt))
    level_losses.append(total / batch)
  return sum(level_losses), level_losses


def test_semantic_kd_loss_matches_loops_on_small_levels():
  tree = SemanticTree.from_parents(_PARENT)
  student, teacher = _rng_logits(12, (5, 8)), _rng_logits(13, (5, 8))
  loss, aux = losses.semantic_kd_loss(student, teacher, tree)
  want, want_levels = _np_semantic_kd(student, teacher, _LEVELS)
  np.testing.assert_allclose(np.asarray(aux["level_losses"]), want_levels, rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  assert float(aux["level_losses"][3]) == 0.0


def test_semantic_kd_confidence_sums_top_ceil_n_over_20():
  # 41 roots (level 0, ceil(41/20) = 3 teacher probabilities summed) and two children of
  # class 0 (level 1, top 1).
  tree = SemanticTree.from_parents([-1] * 41 + [0, 0])
  levels = [list(range(41)), [41, 42]]
  student, teacher = _rng_logits(14, (3, 43), 3.0), _rng_logits(15, (3, 43), 3.0)
  loss, aux = losses.semantic_kd_loss(student, teacher, tree)
  want, want_levels = _np_semantic_kd(student, teacher, levels)
  np.testing.assert_allclose(np.asarray(aux["level_losses"]), want_levels, rtol=1e-5)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  # By hand: a uniform teacher has confidence 3/41 at level 0 and 1/2 at level 1; a student
  # putting all mass on one class has squared error (1 - 1/n)^2 + (n - 1)/n^2 = 1 - 1/n.
  student = np.full((1, 43), -1e4, np.float32)
  student[0, [7, 42]] = 0.0
  _, aux = losses.semantic_kd_loss(student, np.zeros((1, 43), np.float32), tree)
  np.testing.assert_allclose(np.asarray(aux["level_losses"]),
                             [3 / 41 * (1 - 1 / 41), 0.5 * 0.5], rtol=1e-5)


def test_semantic_kd_teacher_gets_no_gradient():
  tree = SemanticTree.from_parents(_PARENT)
  student, teacher = _rng_logits(16, (2, 8)), _rng_logits(17, (2, 8))
  g_student, g_teacher = jax.grad(lambda s, t: losses.semantic_kd_loss(s, t, tree)[0],
                                  argnums=(0, 1))(student, teacher)
  assert np.all(np.asarray(g_teacher) == 0.0)
  assert np.any(np.asarray(g_student) != 0.0)


def test_tree_losses_jit_with_tree_static_or_closed_over():
  tree = SemanticTree.from_parents(_PARENT)
  targets = _targets([5, 6, 7])
  logits, teacher = _rng_logits(18, (3, 8)), _rng_logits(19, (3, 8))
  eager, _ = losses.semantic_softmax_loss(logits, targets, tree)
  static = jax.jit(losses.semantic_softmax_loss, static_argnums=2)(logits, targets, tree)[0]
  closed = jax.jit(functools.partial(losses.semantic_kd_loss, tree=tree))(logits, teacher)[0]
  np.testing.assert_allclose(float(static), float(eager), rtol=1e-6)
  np.testing.assert_allclose(float(closed), _np_semantic_kd(logits, teacher, _LEVELS)[0],
                             rtol=1e-5)


# --- cosub ------------------------------------------------------------------------------------


def _np_cosub(subs, targets, kind, label_weight):
  n = len(subs)
  if kind == "bce":
    loss_fn = _np_bce
    act = lambda s: np.vectorize(_sigmoid)(s.astype(np.float64))
  else:
    loss_fn = _np_soft_ce
    act = lambda s: np.stack([_softmax(row) for row in s])
  total = 0.0
  for i in range(n):
    total += label_weight * loss_fn(subs[i], targets)
    for j in range(n):
      if j != i:
        total += (1 - label_weight) / (n - 1) * loss_fn(subs[i], act(subs[j]))
  return total / n


def _dense_targets(seed, shape):
  rng = np.random.default_rng(seed)
  onehot = np.eye(shape[1], dtype=np.float32)[rng.integers(0, shape[1], size=shape[0])]
  other = np.eye(shape[1], dtype=np.float32)[rng.integers(0, shape[1], size=shape[0])]
  return 0.7 * onehot + 0.3 * other  # Mixup-like soft targets.


@pytest.mark.parametrize("kind", ["bce", "ce"])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("label_weight", [0.5, 0.3])
def test_cosub_loss_matches_loops(kind, n, label_weight):
  subs = [_rng_logits(20 + i, (4, 5)) for i in range(n)]
  targets = _dense_targets(30, (4, 5))
  got = losses.cosub_loss([jnp.asarray(s) for s in subs], targets, kind=kind,
                          label_weight=label_weight)
  np.testing.assert_allclose(float(got), _np_cosub(subs, targets, kind, label_weight), rtol=1e-5)


def test_cosub_two_submodels_matches_paper_form():
  # n = 2, lambda = 0.5: 0.5 [(1 - lam) L(s1, y) + lam L(s1, sg(s2))] + 0.5 [same for s2].
  s1, s2 = _rng_logits(40, (3, 4)), _rng_logits(41, (3, 4))
  y = _dense_targets(42, (3, 4))
  sig = np.vectorize(_sigmoid)
  want = 0.5 * (0.5 * _np_bce(s1, y) + 0.5 * _np_bce(s1, sig(s2.astype(np.float64)))) + \
      0.5 * (0.5 * _np_bce(s2, y) + 0.5 * _np_bce(s2, sig(s1.astype(np.float64))))
  np.testing.assert_allclose(float(losses.cosub_loss([s1, s2], y)), want, rtol=1e-5)


@pytest.mark.parametrize("kind", ["bce", "ce"])
@pytest.mark.parametrize("n", [2, 3])
def test_cosub_distillation_targets_are_stop_gradient(kind, n):
  subs = [jnp.asarray(_rng_logits(50 + i, (3, 4))) for i in range(n)]
  y = _dense_targets(60, (3, 4))
  lw = 0.4
  loss_fn = losses.binary_cross_entropy if kind == "bce" else losses.soft_target_cross_entropy
  act = jax.nn.sigmoid if kind == "bce" else jax.nn.softmax
  # Constants (numpy) as teachers: only the terms where s_2 is the student carry gradient.
  teachers = [np.asarray(act(s)) for s in subs]

  def direct_only(s):
    distill = sum(loss_fn(s, teachers[j]) for j in range(n) if j != 1)
    return (lw * loss_fn(s, y) + (1 - lw) / (n - 1) * distill) / n

  def no_stop_gradient(s_all):  # What a missing stop-gradient would give.
    total = 0.0
    for i in range(n):
      distill = sum(loss_fn(s_all[i], act(s_all[j])) for j in range(n) if j != i)
      total += lw * loss_fn(s_all[i], y) + (1 - lw) / (n - 1) * distill
    return total / n

  def with_s2(s, fn):
    return fn([s if i == 1 else subs[i] for i in range(n)])

  cosub = lambda s_all: losses.cosub_loss(s_all, y, kind=kind, label_weight=lw)
  got = np.asarray(jax.grad(with_s2)(subs[1], cosub))
  np.testing.assert_allclose(got, np.asarray(jax.grad(direct_only)(subs[1])), rtol=1e-5,
                             atol=1e-7)
  leaky = np.asarray(jax.grad(with_s2)(subs[1], no_stop_gradient))
  assert not np.allclose(got, leaky, rtol=1e-3, atol=1e-5)  # The check can tell them apart.


def test_cosub_is_jittable_and_validates():
  subs = [_rng_logits(70 + i, (2, 3)) for i in range(3)]
  y = _dense_targets(71, (2, 3))
  jitted = jax.jit(functools.partial(losses.cosub_loss, kind="ce", label_weight=0.5))(subs, y)
  np.testing.assert_allclose(float(jitted), _np_cosub(subs, y, "ce", 0.5), rtol=1e-5)
  with pytest.raises(ValueError, match="at least 2"):
    losses.cosub_loss([subs[0]], y)
  with pytest.raises(ValueError, match="'mse'"):
    losses.cosub_loss(subs, y, kind="mse")
  with pytest.raises(ValueError, match="share one shape"):
    losses.cosub_loss([subs[0], subs[1][:, :2]], y)


def test_simple_losses_jit():
  logits, labels = _rng_logits(80, (3, 4)), np.array([0, 2, 3])
  y = _dense_targets(81, (3, 4))
  for fn, args in ((losses.cross_entropy, (logits, labels)),
                   (losses.soft_target_cross_entropy, (logits, y)),
                   (losses.binary_cross_entropy, (logits, y)),
                   (losses.asymmetric_loss, (logits, (y > 0).astype(np.float32)))):
    np.testing.assert_allclose(float(jax.jit(fn)(*args)), float(fn(*args)), rtol=1e-6)
