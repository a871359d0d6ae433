"""Loss functions on arrays: no config, no model, float32 math, scalar results.

Each loss is the formula of the paper it comes from (see each docstring); objectives in
bigpretrain/objectives/ decide which to call with which arrays. Losses that need the semantic
tree take it as a static Python object (a bigpretrain.semantic.tree.SemanticTree, read through
its attributes only: the core imports no recipe library): its index tables become constants
under jit.
"""
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import optax


def _f32(x) -> jax.Array:
  return jnp.asarray(x).astype(jnp.float32)


def _check_classes(logits: jax.Array, tree, name: str = "logits"):
  if logits.ndim != 2 or logits.shape[-1] != tree.num_classes:
    raise ValueError(
        f"{name} must be [B, {tree.num_classes}] for this tree; got shape {logits.shape}.")


def _safe_pow(base: jax.Array, exponent) -> jax.Array:
  """base ** exponent for base >= 0 with 0 ** 0 = 1 and finite gradients at base = 0."""
  positive = base > 0
  powered = jnp.where(positive, base, 1.0) ** exponent
  return jnp.where(positive, powered, jnp.where(jnp.asarray(exponent) == 0, 1.0, 0.0))


def _weighted_mean(per_example: jax.Array, weights: jax.Array | None) -> jax.Array:
  """Plain mean without weights; else sum_b w_b l_b / sum_b w_b, 0 when all weights are 0."""
  if weights is None:
    return jnp.mean(per_example)
  weights = _f32(weights)
  total = jnp.sum(weights)
  return jnp.where(total > 0, jnp.sum(weights * per_example) / jnp.where(total > 0, total, 1.0),
                   0.0)


def cross_entropy(logits: jax.Array, labels: jax.Array, *, label_smoothing: float = 0.0,
                  weights: jax.Array | None = None) -> jax.Array:
  """Softmax cross-entropy with integer labels [B].

  Label smoothing eps spreads over all C classes: target = (1 - eps) onehot + eps / C.
  `weights` are optional per-example weights [B] (e.g. 0 for padding examples); the loss is
  then the weighted mean sum_b w_b l_b / sum_b w_b (0 when all weights are 0), otherwise the
  plain batch mean.
  """
  logits = _f32(logits)
  num_classes = logits.shape[-1]
  targets = optax.smooth_labels(jax.nn.one_hot(labels, num_classes), label_smoothing)
  per_example = optax.softmax_cross_entropy(logits, targets)
  return _weighted_mean(per_example, weights)


def soft_target_cross_entropy(logits: jax.Array, targets: jax.Array, *,
                              weights: jax.Array | None = None) -> jax.Array:
  """Cross-entropy against non-negative soft targets [B, C] (multi-hot or mixed).

  Each target row is normalised to sum 1 (SWAG: 1/K per hashtag of an image); rows summing
  to 0 contribute 0. Without `weights` the result is the plain batch mean (empty rows still
  count in B); with per-example `weights` [B] it is sum_b w_b l_b / sum_b w_b (0 when all
  weights are 0), e.g. w_b = 1 for images with a label and 0 for the rest.
  """
  logits = _f32(logits)
  targets = _f32(targets)
  row_sum = jnp.sum(targets, axis=-1, keepdims=True)
  targets = targets / jnp.where(row_sum > 0, row_sum, 1.0)
  per_example = -jnp.sum(targets * jax.nn.log_softmax(logits, axis=-1), axis=-1)
  return _weighted_mean(per_example, weights)


def binary_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Sigmoid binary cross-entropy with logits, mean over all elements (B x C)."""
  return jnp.mean(optax.sigmoid_binary_cross_entropy(_f32(logits), _f32(targets)))


def asymmetric_loss(logits: jax.Array, multi_hot: jax.Array, *, gamma_neg: float = 4.0,
                    gamma_pos: float = 0.0, clip: float = 0.05, eps: float = 1e-8) -> jax.Array:
  """Asymmetric loss (ASL, Ridnik et al. 2021) for multi-label training.

  p = sigmoid(x); negatives use the shifted probability p_m = max(p - clip, 0):
    loss = -sum_c [ y (1 - p)^gamma_pos log(max(p, eps))
                    + (1 - y) p_m^gamma_neg log(max(1 - p_m, eps)) ],
  summed over classes and averaged over the batch. The focusing weights (1 - p)^gamma_pos and
  p_m^gamma_neg are NOT stop-gradiented, like the ASL reference's default.
  """
  logits = _f32(logits)
  y = _f32(multi_hot)
  p = jax.nn.sigmoid(logits)
  p_m = jnp.maximum(p - clip, 0.0)
  positive = y * _safe_pow(1.0 - p, gamma_pos) * jnp.log(jnp.maximum(p, eps))
  negative = (1.0 - y) * _safe_pow(p_m, gamma_neg) * jnp.log(jnp.maximum(1.0 - p_m, eps))
  return -jnp.mean(jnp.sum(positive + negative, axis=-1))


def semantic_softmax_loss(logits: jax.Array, semantic_targets: jax.Array, tree, *,
                          label_smoothing: float = 0.2,
                          max_weight: float = 20.0) -> tuple[jax.Array, dict]:
  """Semantic softmax loss (Ridnik et al. 2021, section 3.3, eq. 2).

  For each level k, a softmax over that level's n_k classes and a label-smoothed
  cross-entropy (eps spread over the n_k classes) against semantic_targets[:, k] (global class
  ids, -1 = no label at this level). L_k sums over the batch and divides by the whole batch
  size B, so unlabelled rows count as 0. The total is sum_k W_k L_k with
  W = tree.level_weights(max_weight). A level with a single class gives 0.

  Returns:
    (loss, {"level_losses": float32 [L]}).
  """
  logits = _f32(logits)
  _check_classes(logits, tree)
  semantic_targets = jnp.asarray(semantic_targets)
  if semantic_targets.shape != (logits.shape[0], tree.num_levels):
    raise ValueError(f"semantic_targets must be [B, num_levels] = "
                     f"[{logits.shape[0]}, {tree.num_levels}]; got {semantic_targets.shape}.")
  batch = logits.shape[0]
  index_in_level = jnp.asarray(tree.index_in_level)
  level_losses = []
  for k, classes in enumerate(tree.level_classes):
    n_k = len(classes)
    log_probs = jax.nn.log_softmax(logits[:, classes], axis=-1)
    target = semantic_targets[:, k]
    valid = target != -1
    local = index_in_level[jnp.where(valid, target, 0)]
    target_log_prob = jnp.take_along_axis(log_probs, local[:, None], axis=-1)[:, 0]
    per_example = -((1.0 - label_smoothing) * target_log_prob
                    + label_smoothing / n_k * jnp.sum(log_probs, axis=-1))
    level_losses.append(jnp.sum(jnp.where(valid, per_example, 0.0)) / batch)
  level_losses = jnp.stack(level_losses)
  weights = jnp.asarray(tree.level_weights(max_weight))
  return jnp.sum(weights * level_losses), {"level_losses": level_losses}


def semantic_kd_loss(student_logits: jax.Array, teacher_logits: jax.Array,
                     tree) -> tuple[jax.Array, dict]:
  """Semantic knowledge distillation (Ridnik et al. 2021, section 3.4, eq. 4).

  Per level k: student and teacher softmax over the level's n_k classes; the teacher's
  confidence P_{b,k} is the sum of its top ceil(n_k / 20) probabilities at that level;
  L_k = sum_b P_{b,k} sum_c (p_s - p_t)^2 / B, and loss = sum_k L_k. The teacher (and hence
  P) is fully stop-gradient.

  Returns:
    (loss, {"level_losses": float32 [L]}).
  """
  student_logits = _f32(student_logits)
  teacher_logits = jax.lax.stop_gradient(_f32(teacher_logits))
  _check_classes(student_logits, tree, "student_logits")
  _check_classes(teacher_logits, tree, "teacher_logits")
  if student_logits.shape != teacher_logits.shape:
    raise ValueError(f"student_logits {student_logits.shape} and teacher_logits "
                     f"{teacher_logits.shape} differ in shape.")
  batch = student_logits.shape[0]
  level_losses = []
  for classes in tree.level_classes:
    p_s = jax.nn.softmax(student_logits[:, classes], axis=-1)
    p_t = jax.nn.softmax(teacher_logits[:, classes], axis=-1)
    top = math.ceil(len(classes) / 20)
    confidence = jnp.sum(jax.lax.top_k(p_t, top)[0], axis=-1)
    squared = jnp.sum(jnp.square(p_s - p_t), axis=-1)
    level_losses.append(jnp.sum(confidence * squared) / batch)
  level_losses = jnp.stack(level_losses)
  return jnp.sum(level_losses), {"level_losses": level_losses}


def cosub_loss(submodel_logits: Sequence[jax.Array], targets: jax.Array, *, kind: str = "bce",
               label_weight: float = 0.5) -> jax.Array:
  """Co-training of submodels (cosub, Touvron et al. 2023).

  With n submodels s_1..s_n (n >= 2; the paper uses 2 or 3), L = binary_cross_entropy and
  sigma = sigmoid for kind "bce", L = soft_target_cross_entropy and sigma = softmax for "ce":
    loss = mean_i [ label_weight L(s_i, y)
                    + (1 - label_weight) / (n - 1) sum_{j != i} L(s_i, sg(sigma(s_j))) ].
  Each submodel's prediction is a stop-gradient target for the others, so gradients reach
  a submodel only through its own logits.
  """
  submodel_logits = [_f32(s) for s in submodel_logits]
  n = len(submodel_logits)
  if n < 2:
    raise ValueError(f"cosub_loss needs at least 2 submodels; got {n}.")
  if kind == "bce":
    loss_fn, activation = binary_cross_entropy, jax.nn.sigmoid
  elif kind == "ce":
    loss_fn, activation = soft_target_cross_entropy, jax.nn.softmax
  else:
    raise ValueError(f"cosub_loss kind must be 'bce' or 'ce'; got {kind!r}.")
  shapes = {s.shape for s in submodel_logits} | {jnp.shape(targets)}
  if len(shapes) != 1:
    raise ValueError(f"Submodel logits and targets must share one shape; got {sorted(shapes)}.")
  teachers = [jax.lax.stop_gradient(activation(s)) for s in submodel_logits]
  total = 0.0
  for i, s_i in enumerate(submodel_logits):
    distill = sum(loss_fn(s_i, teachers[j]) for j in range(n) if j != i)
    total += label_weight * loss_fn(s_i, targets) + (1.0 - label_weight) / (n - 1) * distill
  return total / n
