"""Paper 002's transfer pieces: the 'logistic' fc-only probe of bigpretrain/evaluators/linear_probe.py
(checked against an independent numpy objective) and configs/transfer.py's semisup_cub
recipe (supplement Table 13). Cheap: numpy on tiny problems and config checks."""
import math

import numpy as np
import pytest

from bigpretrain import checkpoint
from bigpretrain import config_lib
from bigpretrain.evaluators import linear_probe
from bigpretrain import optim
from configs import transfer


def _problem(seed=0, n=40, d=3, c=3):
  rng = np.random.default_rng(seed)
  y = np.arange(n) % c
  x = rng.normal(size=(n, d)) + 1.5 * np.eye(c, d)[y] + 3.0  # Offset: whitening matters.
  return x, y


def _objective(w_unit, x, y, l2):
  """sum_i CE + l2/2 ||W||^2 (bias row free), W on whitened features with a bias of 1."""
  xs = (x - x.mean(0)) / (x.std(0) + 1e-5)
  logits = xs @ w_unit[:-1] + w_unit[-1]
  m = logits.max(1, keepdims=True)
  lse = (m + np.log(np.exp(logits - m).sum(1, keepdims=True)))[:, 0]
  return np.sum(lse - logits[np.arange(len(y)), y]) + 0.5 * l2 * np.sum(w_unit[:-1] ** 2)


def test_logistic_fit_is_the_regularised_optimum():
  x, y = _problem()
  l2 = 1.0
  model = linear_probe.logistic_fit(x, y, 3, l2)
  w = model["w"].copy()
  w[-1] *= linear_probe.BIAS_CONSTANT  # Back to a bias feature of 1.
  base = _objective(w, x, y, l2)
  eps = 1e-5
  for i in range(w.shape[0]):  # Central differences of the independent objective: ~0.
    for j in range(w.shape[1]):
      e = np.zeros_like(w)
      e[i, j] = eps
      g = (_objective(w + e, x, y, l2) - _objective(w - e, x, y, l2)) / (2 * eps)
      assert abs(g) < 1e-3, (i, j, g)
  # And it is a minimum: random moves only increase the objective (convex).
  rng = np.random.default_rng(1)
  for _ in range(5):
    assert _objective(w + 1e-2 * rng.normal(size=w.shape), x, y, l2) > base
  # ridge_predict scores the model: its argmax is the logistic prediction.
  xs = (x - x.mean(0)) / (x.std(0) + 1e-5)
  np.testing.assert_allclose(linear_probe.ridge_predict(model, x), xs @ w[:-1] + w[-1],
                             rtol=1e-9, atol=1e-9)


def test_logistic_loss_gradient_matches_finite_differences():
  x, y = _problem(seed=2, n=12)
  xb = np.pad((x - x.mean(0)) / x.std(0), ((0, 0), (0, 1)), constant_values=1.0)
  w = np.random.default_rng(3).normal(size=xb.shape[1] * 3)
  _, grad = linear_probe.logistic_loss_and_grad(w, xb, y, 3, 0.7)
  eps = 1e-6
  num = [(linear_probe.logistic_loss_and_grad(w + eps * e, xb, y, 3, 0.7)[0]
          - linear_probe.logistic_loss_and_grad(w - eps * e, xb, y, 3, 0.7)[0]) / (2 * eps)
         for e in np.eye(len(w))]
  np.testing.assert_allclose(grad, num, rtol=1e-5, atol=1e-6)


def test_accuracy_by_classifier_name():
  x, y = _problem(seed=4, n=90)
  for name in ("ridge", "logistic"):
    acc = linear_probe.accuracy(x, y, x, y, 3, classifier=name)
    assert 0.7 < acc <= 1.0, name  # Chance is 1/3.
  assert linear_probe.accuracy(x, y, x, y, 3) == linear_probe.ridge_accuracy(x, y, x, y, 3)
  with pytest.raises(ValueError, match="logistc"):
    linear_probe.accuracy(x, y, x, y, 3, classifier="logistc")


@pytest.fixture
def meta(monkeypatch):
  monkeypatch.setattr(checkpoint, "read_meta", lambda path: {
      "model": {"name": "resnet50"}, "data": {"image_size": 224, "normalize": "imagenet"}})


def test_transfer_linear_names_its_classifier(meta):
  assert transfer.get_config("mode=linear,init=/c").evals.linear.classifier == "ridge"
  c = transfer.get_config("mode=linear,init=/c,classifier=logistic")
  assert c.evals.linear.classifier == "logistic"
  with pytest.raises(ValueError, match="classifier="):
    transfer.get_config("mode=linear,init=/c,classifier=svm")


def test_semisup_cub_recipe_is_table_13(meta):
  c = config_lib.validate(transfer.get_config(
      "mode=finetune,init=/c,recipe=semisup_cub,dataset=tfds:caltech_birds2011"))
  assert c.batch_size == 768 and c.optim.name == "sgd"
  assert c.optim.lr == pytest.approx(0.0025 / 256 * 768)
  assert c.optim.weight_decay == 0.001 and c.num_epochs == 300
  assert c.model_init == "/c" and c.data.image_size == 224
  n = 5994  # CUB-2011's train split (section 5.2).
  total = config_lib.resolve_total_steps(c, n)
  assert total == math.ceil(300 * n / 768)
  lr = optim.make_schedule(c.optim.schedule, lr=c.optim.lr, total_steps=total)
  for epochs, factor in ((0, 1.0), (99, 1.0), (101, 0.1), (199, 0.1), (201, 0.01), (299, 0.01)):
    step = int(epochs / 300 * total)
    assert float(lr(step)) == pytest.approx(c.optim.lr * factor, rel=1e-5), epochs


def test_swag_transfer_drops_the_vit_tanh_layer(monkeypatch):
  monkeypatch.setattr(checkpoint, "read_meta", lambda path: {
      "model": {"name": "vit_b16", "pre_logits": True},
      "data": {"image_size": 224, "normalize": "imagenet"}})
  swag = transfer.get_config("mode=finetune,init=/c,recipe=swag")
  assert swag.model.pre_logits is False and swag.data.image_size == 224
  linear = transfer.get_config("mode=linear,init=/c")
  assert linear.model.pre_logits is True  # A frozen probe reads the model as trained.


def test_swag_transfer_takes_table_8_for_the_checkpoints_model(monkeypatch):
  import types
  from configs import swag_finetune
  monkeypatch.setattr(checkpoint, "read_meta", lambda path: {
      "model": {"name": "vit_h14"}, "data": {"image_size": 224, "normalize": "imagenet"}})
  info = types.SimpleNamespace(num_examples={"train": 1_803_460}, num_classes=365)
  monkeypatch.setattr(swag_finetune.datasets, "get_dataset",
                      lambda cfg: types.SimpleNamespace(info=info))
  # Table 8: ViT H/14 on Places365 at lr 3e-3 (RegNetY-16GF, the recipe's default: 1.2e-2).
  places = transfer.get_config("mode=finetune,init=/c,recipe=swag,dataset=tfds:places365_small")
  assert places.optim.lr == pytest.approx(3e-3)
  # Section 4.1: ViTs fine-tune 28 epochs on ImageNet-1k.
  info.num_examples, info.num_classes = {"train": 1_281_167}, 1000
  in1k = transfer.get_config("mode=finetune,init=/c,recipe=swag,dataset=tfds:imagenet2012")
  assert in1k.num_epochs == 28 and in1k.model.name == "vit_h14"


def test_batchnorm_statistics_are_the_recipes_not_the_checkpoints(monkeypatch):
  """semisup_cub's BN over 24 images (paper 002: 768 images on 32 GPUs, BN on each GPU) from
  a checkpoint without grouping; the in21k recipe's whole-batch BN from one with it (swag's:
  tests/test_swag_finetune_recipe.py)."""
  grouped = {"name": "resnet50", "bn_group_size": 24}
  for model, recipe, want in (({"name": "resnet50"}, "semisup_cub", 24),
                              (grouped, "in21k", None)):
    monkeypatch.setattr(checkpoint, "read_meta", lambda path, m=model: {
        "model": m, "data": {"image_size": 224, "normalize": "imagenet"}})
    c = transfer.get_config(f"mode=finetune,init=/c,recipe={recipe},"
                            "dataset=tfds:caltech_birds2011")
    assert c.model.get("bn_group_size") == want, recipe
  demo = transfer.get_config("mode=finetune,init=/c,recipe=semisup_cub")
  assert "bn_group_size" not in demo.model  # The demo's batch of 64 keeps whole-batch BN.
