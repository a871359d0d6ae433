"""Few-shot and linear transfer on frozen features: pooled features of a dataset split, a
seeded k-shot-per-class draw, and the linear classifiers fit on them (CLASSIFIERS): 'ridge',
closed-form ridge regression, and 'logistic', multinomial logistic regression by L-BFGS.

The classifier is big_vision's few-shot evaluator (big_vision/evaluators/fewshot_lsr.py):
features whitened by the training draw's per-dimension mean and std (+1e-5), a constant
feature BIAS_CONSTANT appended (a bias almost free of the penalty), one-hot targets in
{-1, 1}, and W = argmin ||X W - Y||^2 + l2 ||W||^2 solved in closed form, in the primal
(X^T X + l2 I)^-1 X^T Y when N >= D, else the dual X^T (X X^T + l2 I)^-1 Y. The regulariser
is their fixed default L2_REG = 2^10 (no grid: a grid would need a held-out split per task).
The k-shot draw is theirs too: for seed s, numpy's default_rng(s) permutes each class's
examples in class order, and the k-shot set is the first k of every class's permutation, so
the 1-shot set of a seed lies inside its 5-shot set.

'logistic' is the "fc-only" probe of Yalniz et al. 2019 (section 5.2: "extracting features
from the final fc layer and training a logistic regressor"): the same whitened features and
unpenalised bias, W = argmin sum_i CE(softmax(x_i W), y_i) + l2 / 2 ||W||^2 (the bias row not
penalised), minimised with scipy's L-BFGS-B; LOGISTIC_L2 = 1 is scikit-learn's default C = 1,
as the paper gives no value. Convex, so the fit does not depend on the start.
"""
import collections

import jax.numpy as jnp
import numpy as np

from bigpretrain import inference
from bigpretrain import registry

BIAS_CONSTANT = 100.0
L2_REG = 2.0 ** 10
LOGISTIC_L2 = 1.0
LOGISTIC_MAX_ITER = 1000

# A linear classifier on features: fit(x [N, D], y [N], num_classes, l2) -> model, predict(model,
# x) -> scores [N, C], and its default l2.
Classifier = collections.namedtuple("Classifier", ["fit", "predict", "default_l2"])
CLASSIFIERS = registry.Registry("linear classifier", "config.evals.<name>.classifier")
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
  x = _check_xy(x, y, l2, "ridge_fit")
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


def _check_xy(x, y, l2, what: str) -> np.ndarray:
  x = np.asarray(x, np.float64)
  if x.ndim != 2 or len(x) != len(y) or not len(x):
    raise ValueError(f"{what} needs features [N, D] and labels [N] with N > 0; got "
                     f"{x.shape} and {np.shape(y)}.")
  if not l2 > 0:
    raise ValueError(f"l2={l2!r} must be > 0.")
  return x


def logistic_loss_and_grad(w_flat, xb, y, num_classes: int, l2: float):
  """The 'logistic' objective and its gradient at W (flattened [D + 1, C]); xb holds the
  whitened features with the bias column last (not penalised)."""
  # scipy is imported where it is used: it is a large share of every trainer process's
  # start-up, and most runs never fit a probe.
  import scipy.special  # pylint: disable=import-outside-toplevel
  w = w_flat.reshape(xb.shape[1], num_classes)
  logits = xb @ w
  lse = scipy.special.logsumexp(logits, axis=1)
  penalised = w[:-1]
  loss = np.sum(lse - logits[np.arange(len(y)), y]) + 0.5 * l2 * np.sum(penalised ** 2)
  probs = np.exp(logits - lse[:, None])
  probs[np.arange(len(y)), y] -= 1.0
  grad = xb.T @ probs
  grad[:-1] += l2 * penalised
  return loss, grad.ravel()


def logistic_fit(x, y, num_classes: int, l2: float = LOGISTIC_L2,
                 max_iter: int = LOGISTIC_MAX_ITER) -> dict:
  """Multinomial logistic regression on features x [N, D], labels y [N] (module docstring):
  {'w' [D + 1, C], 'mean', 'std'} as ridge_fit, so ridge_predict scores it."""
  x = _check_xy(x, y, l2, "logistic_fit")
  y = np.asarray(y, np.int64)
  mean, std = x.mean(0), x.std(0) + 1e-5
  # Bias column 1 (not BIAS_CONSTANT): it is not penalised, so its scale does not matter.
  xb = np.pad((x - mean) / std, ((0, 0), (0, 1)), constant_values=1.0)
  w0 = np.zeros(xb.shape[1] * num_classes)
  # As scipy.special in logistic_loss_and_grad: imported where it is used.
  import scipy.optimize  # pylint: disable=import-outside-toplevel
  res = scipy.optimize.minimize(logistic_loss_and_grad, w0, args=(xb, y, num_classes, l2),
                                jac=True, method="L-BFGS-B",
                                options={"maxiter": max_iter, "gtol": 1e-6})
  w = res.x.reshape(xb.shape[1], num_classes)
  w[-1] /= BIAS_CONSTANT  # ridge_predict's bias column holds BIAS_CONSTANT.
  return {"w": w, "mean": mean, "std": std}


CLASSIFIERS.register("ridge", Classifier(lambda x, y, c, l2: ridge_fit(x, y, c, l2),
                                         ridge_predict, L2_REG))
CLASSIFIERS.register("logistic", Classifier(lambda x, y, c, l2: logistic_fit(x, y, c, l2),
                                            ridge_predict, LOGISTIC_L2))


def accuracy(x_train, y_train, x_test, y_test, num_classes: int, *,
             classifier: str = "ridge", l2: float | None = None) -> float:
  """Top-1 accuracy on (x_test, y_test) of the named classifier fit on the train pair (l2:
  its default when None)."""
  c = CLASSIFIERS.get(classifier)
  model = c.fit(x_train, y_train, num_classes, c.default_l2 if l2 is None else l2)
  return float(np.mean(np.argmax(c.predict(model, x_test), 1) == np.asarray(y_test)))


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
