"""Few-shot and linear transfer on frozen features: pooled features of a dataset split, a
seeded k-shot-per-class draw, and a closed-form ridge-regression classifier.

The classifier is big_vision's few-shot evaluator (big_vision/evaluators/fewshot_lsr.py):
features whitened by the training draw's per-dimension mean and std (+1e-5), a constant
feature BIAS_CONSTANT appended (a bias almost free of the penalty), one-hot targets in
{-1, 1}, and W = argmin ||X W - Y||^2 + l2 ||W||^2 solved in closed form, in the primal
(X^T X + l2 I)^-1 X^T Y when N >= D, else the dual X^T (X X^T + l2 I)^-1 Y. The regulariser
is their fixed default L2_REG = 2^10 (no grid: a grid would need a held-out split per task).
The k-shot draw is theirs too: for seed s, numpy's default_rng(s) permutes each class's
examples in class order, and the k-shot set is the first k of every class's permutation, so
the 1-shot set of a seed lies inside its 5-shot set.
"""
import jax.numpy as jnp
import numpy as np

from bigpretrain import inference

BIAS_CONSTANT = 100.0
L2_REG = 2.0 ** 10
DEFAULT_SHOTS = (1, 5, 10, 25)
DEFAULT_SEEDS = 3


def kshot_draw(labels, num_classes: int, shots: int, seed: int) -> np.ndarray:
  """Indices into `labels` [N] of `shots` examples of every class (class order, each class
  its permutation's first `shots`); ValueError when a class has fewer."""
  labels = np.asarray(labels)
  if isinstance(shots, bool) or not isinstance(shots, (int, np.integer)) or shots < 1:
    raise ValueError(f"shots={shots!r} must be an int >= 1.")
  if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
    raise ValueError(f"labels must be in [0, {num_classes}), got [{labels.min()}, "
                     f"{labels.max()}].")
  rng = np.random.default_rng(seed)
  out = []
  for c in range(num_classes):
    members = np.flatnonzero(labels == c)
    if len(members) < shots:
      raise ValueError(f"{shots}-shot draw: class {c} has only {len(members)} examples; "
                       f"use shots <= {len(members)} or a larger train split.")
    out.append(rng.permutation(members)[:shots])
  return np.concatenate(out).astype(np.int64)


def _prepare(x, mean, std):
  x = (np.asarray(x, np.float64) - mean) / std
  return np.pad(x, ((0, 0), (0, 1)), constant_values=BIAS_CONSTANT)


def ridge_fit(x, y, num_classes: int, l2: float = L2_REG) -> dict:
  """The ridge classifier of features x [N, D] with labels y [N] (module docstring):
  {'w' [D + 1, C], 'mean' [D], 'std' [D]}, in float64."""
  x = np.asarray(x, np.float64)
  if x.ndim != 2 or len(x) != len(y) or not len(x):
    raise ValueError(f"ridge_fit needs features [N, D] and labels [N] with N > 0; got "
                     f"{x.shape} and {np.shape(y)}.")
  if not l2 > 0:
    raise ValueError(f"l2={l2!r} must be > 0.")
  mean, std = x.mean(0), x.std(0) + 1e-5
  xb = _prepare(x, mean, std)
  t = 2.0 * np.eye(num_classes)[np.asarray(y)] - 1.0
  n, d = xb.shape
  if n >= d:
    w = np.linalg.solve(xb.T @ xb + l2 * np.eye(d), xb.T @ t)
  else:
    w = xb.T @ np.linalg.solve(xb @ xb.T + l2 * np.eye(n), t)
  return {"w": w, "mean": mean, "std": std}


def ridge_predict(model: dict, x) -> np.ndarray:
  """Class scores [N, C] of features x [N, D]."""
  return _prepare(x, model["mean"], model["std"]) @ model["w"]


def ridge_accuracy(x_train, y_train, x_test, y_test, num_classes: int,
                   l2: float = L2_REG) -> float:
  """Top-1 accuracy on (x_test, y_test) of the ridge classifier fit on the train pair."""
  scores = ridge_predict(ridge_fit(x_train, y_train, num_classes, l2), x_test)
  return float(np.mean(np.argmax(scores, 1) == np.asarray(y_test)))


def drawn_indices(y_train, num_classes: int, shots, seeds: int) -> np.ndarray:
  """Sorted indices of every record some (k, seed) draw takes: the features to compute."""
  draws = [kshot_draw(y_train, num_classes, k, s) for k in shots for s in range(seeds)]
  return np.unique(np.concatenate(draws))


def fewshot_accuracies(x_drawn, drawn, y_train, x_test, y_test, num_classes: int, *, shots,
                       seeds: int, l2: float = L2_REG) -> dict[int, float]:
  """{k: test accuracy of the k-shot ridge classifier, mean over the draws of seeds
  0..seeds-1} for every k in `shots`. y_train [N] labels the pool the draws come from;
  x_drawn holds the features of its records `drawn` (drawn_indices: sorted, covering every
  draw), so that only drawn records need a forward pass."""
  out = {}
  for k in shots:
    accs = []
    for seed in range(seeds):
      idx = kshot_draw(y_train, num_classes, k, seed)
      rows = np.searchsorted(drawn, idx)
      if np.any(rows >= len(drawn)) or np.any(drawn[np.minimum(rows, len(drawn) - 1)] != idx):
        raise ValueError("x_drawn lacks records of a draw: compute it for drawn_indices().")
      accs.append(ridge_accuracy(x_drawn[rows], y_train[idx], x_test, y_test, num_classes, l2))
    out[k] = float(np.mean(accs))
  return out


def make_features_step(model_def, shardings, mesh, normalize: str):
  """Jitted (params, extra, batch) -> replicated {'features', 'index', 'mask'}: the eval-mode
  model's pooled features (model.features(), float32), batch sharded over the mesh."""

  def pooled(module, images):
    return {"features": module.features(images, train=False).astype(jnp.float32)}

  return inference.make_forward(model_def, shardings, mesh, normalize, pooled)


def features(step, variables: dict, source, data_cfg, *, batch_size: int,
             mesh) -> np.ndarray:
  """Features [len(source), D] of every record of `source`, in source order (every process
  gets all of them); a corrupt record is an error (its features would be missing)."""
  parts, index = [], []
  for rows, skipped in inference.forward_rows(step, variables, source, data_cfg,
                                          batch_size=batch_size, mesh=mesh):
    if skipped:
      raise ValueError(f"{skipped} corrupt records in {source!r}: few-shot features need "
                       "every drawn record.")
    parts.append(rows["features"])
    index.append(rows["index"])
  order = np.argsort(np.concatenate(index), kind="stable")
  return np.concatenate(parts)[order]


def check_model(model_def, where: str) -> None:
  """ValueError unless the model (a models.ModelDef) has features(): pooled features."""
  module_type = type(model_def.merge(model_def.abstract_params, model_def.abstract_extra))
  if not callable(getattr(module_type, "features", None)):
    raise ValueError(f"{where}: model {model_def.name!r} has no features() method (pooled "
                     "features), which few-shot and linear transfer read.")
