"""cosub: efficient stochastic depth, the cosub objective, LayerDecay, the sqrt lr rule, configs."""
import json
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import ml_collections
import numpy as np
import pytest
from flax import nnx

from bigpretrain import config_lib
from bigpretrain import models
from bigpretrain import optim
from bigpretrain import train
from bigpretrain.models import layers
from bigpretrain.models import vit
from bigpretrain.objectives import cosub
from configs import cosub_finetune_in1k
from configs import cosub_in1k
from configs import cosub_in21k
from tests import helpers


def _mesh(data, fsdp, tensor=1):
  return jax.make_mesh((data, fsdp, tensor), ("data", "fsdp", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)


def _block(rate, mode, seed=1):
  return vit.Block(8, 2, 16, qkv_bias=True, layerscale_init=None, drop_path_rate=rate,
                   dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(seed),
                   stochastic_depth=mode)


def _tiny_vit(**kw):
  return vit.VisionTransformer(num_classes=5, rngs=nnx.Rngs(0), patch_size=8, width=16,
                               depth=2, num_heads=2, mlp_dim=32, image_size=16,
                               head_zeroinit=False, **kw)


# --- efficient stochastic depth -------------------------------------------------------------


def test_esd_kept_rows_and_effective_rate_by_hand():
  assert layers.esd_kept_rows(0.5, 8) == 4
  assert layers.esd_kept_rows(0.35, 10) == 6  # floor(6.5)
  assert layers.esd_kept_rows(0.9, 10) == 1  # (1 - 0.9) * 10 is 0.999... in floats
  assert layers.esd_kept_rows(0.0, 7) == 7 and layers.esd_kept_rows(1.0, 7) == 0
  # Supplement C.1: a local batch of 8 only allows rates in steps of 1/8.
  assert layers.esd_effective_rate(0.3, 8) == pytest.approx(0.375)  # floor(5.6) = 5 kept
  assert layers.esd_effective_rate(0.5, 5) == pytest.approx(0.6)  # floor(2.5) = 2 kept
  with pytest.raises(ValueError, match="drop_path_rate"):
    layers.esd_kept_rows(1.2, 8)


def test_esd_keeps_exactly_floor_rows_in_every_shard():
  # Branch adds 1 to a row, so out - x marks the kept rows with n / k.
  x = jnp.zeros((40, 3))
  mesh = _mesh(4, 2)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"))))
    f = jax.jit(lambda v, k: layers.esd_residual(v, jnp.ones_like, 0.5, k))
    outs = [np.asarray(f(xs, jax.random.key(s))) for s in range(5)]
  for out in outs:
    per_shard = out[:, 0].reshape(8, 5)  # 8 shards of 5 rows: floor(0.5 * 5) = 2 kept.
    np.testing.assert_array_equal(np.sum(per_shard > 0, axis=1), np.full(8, 2))
    np.testing.assert_allclose(per_shard[per_shard > 0], 5 / 2)
    assert np.all(out == out[:, :1])  # One decision per row.
  assert len({o.tobytes() for o in outs}) == 5  # Different keys, different rows.
  # Without a mesh the whole batch is one shard: floor(0.5 * 40) = 20 rows.
  out = np.asarray(layers.esd_residual(x, jnp.ones_like, 0.5, jax.random.key(0)))
  assert np.sum(out[:, 0] > 0) == 20 and np.allclose(out[out > 0], 2.0)
  with pytest.raises(ValueError, match="do not split evenly"):
    layers.esd_residual(x, jnp.ones_like, 0.5, jax.random.key(0), num_shards=3)


def test_esd_refuses_a_rate_below_1_that_keeps_no_row_and_scales_in_float32():
  x = jnp.zeros((2, 3))
  with pytest.raises(ValueError, match=r"keeps none of a data shard's 2 rows.*at least 3 rows"):
    layers.esd_residual(x, jnp.ones_like, 0.6, jax.random.key(0))
  np.testing.assert_array_equal(layers.esd_residual(x, jnp.ones_like, 1.0, None), x)
  # A bfloat16 branch: the kept rows get bf16(branch x 5/3), the scale taken in float32.
  v = jax.random.normal(jax.random.key(1), (5, 64))
  out = np.asarray(layers.esd_residual(
      jnp.zeros((5, 64)), lambda r: (r + v[:r.shape[0]]).astype(jnp.bfloat16), 0.4,
      jax.random.key(2)))
  kept = out[np.any(out != 0, axis=1)]
  assert kept.shape == (3, 64)  # floor(0.6 x 5)
  want = (np.asarray(v[:3].astype(jnp.bfloat16), np.float32) * np.float32(5 / 3)).astype(
      jnp.bfloat16).astype(np.float32)
  np.testing.assert_array_equal(np.sort(kept, axis=0), np.sort(want, axis=0))


def test_esd_rate_zero_equals_the_plain_block():
  x = jax.random.normal(jax.random.key(2), (6, 3, 8))
  block = _block(0.0, "esd")
  np.testing.assert_allclose(block(x, train=True, rng=jax.random.key(3)), block(x),
                             rtol=1e-6, atol=1e-6)
  h = x + block.attn(block.norm1(x))
  np.testing.assert_allclose(block(x, train=True), h + block.mlp(block.norm2(h)),
                             rtol=1e-5, atol=1e-5)
  # Eval ignores the rate.
  np.testing.assert_array_equal(_block(0.5, "esd")(x), _block(0.5, "mask")(x))


def _combos(block, x, scale):
  """Block output for each (attention kept, MLP kept) with kept branches x scale."""
  out = {}
  attn = block.attn(block.norm1(x))
  for a in (0, 1):
    h = x + a * scale * attn
    mlp = block.mlp(block.norm2(h))
    for m in (0, 1):
      out[(a, m)] = np.asarray(h + m * scale * mlp, np.float64)
  return out


def test_esd_block_rows_and_expectation_match_masked_stochastic_depth():
  rate, batch, draws = 0.5, 8, 3000
  esd, masked = _block(rate, "esd"), _block(rate, "mask")  # Same seed: same weights.
  x = jax.random.normal(jax.random.key(2), (batch, 3, 8))
  combos = _combos(esd, x, 1 / (1 - rate))
  # One draw: each row is one of the 4 combinations, and each branch ran on exactly 4 rows.
  out = np.asarray(esd(x, train=True, rng=jax.random.key(7)))
  which = np.full((batch, 2), -1)
  for key, want in combos.items():
    which[np.all(np.isclose(out, want, rtol=1e-5, atol=1e-5), axis=(1, 2))] = key
  assert np.all(which >= 0)
  np.testing.assert_array_equal(which.sum(axis=0), [4, 4])
  # Many draws: both estimate the exact expectation, the mean over the 4 equally likely combos.
  keys = jax.random.split(jax.random.key(11), draws)
  run = lambda blk: jax.jit(jax.vmap(lambda k: blk(x, train=True, rng=k)))(keys)
  exact = sum(combos.values()) / 4
  for samples in (np.asarray(run(esd), np.float64), np.asarray(run(masked), np.float64)):
    stderr = samples.std(axis=0) / np.sqrt(draws)
    z = np.abs(samples.mean(axis=0) - exact) / np.maximum(stderr, 1e-6)
    assert z.max() < 5.0, z.max()


def test_esd_vit_keeps_batch_rows_on_their_shard():
  # The gradient of an ESD ViT on a batch-sharded input compiles with no cross-device
  # gather: ESD's row sampling, gather and scatter-add stay inside each data shard.
  model = _tiny_vit(drop_path_rate=0.5, drop_path_schedule="uniform", stochastic_depth="esd")
  graphdef, state = nnx.split(model)

  def loss(state, images, rng):
    return jnp.mean(nnx.merge(graphdef, state)(images, train=True, rng=rng) ** 2)

  for shape in ((8, 1), (4, 2)):
    mesh = _mesh(*shape)
    with jax.set_mesh(mesh):
      images = jax.device_put(jnp.ones((32, 16, 16, 3)), NamedSharding(mesh, P(("data", "fsdp"))))
      hlo = jax.jit(jax.grad(loss)).lower(state, images, jax.random.key(0)).compile().as_text()
    assert not re.search(r"\b(all-gather|all-to-all|collective-permute)\(", hlo), shape
    assert re.search(r"\ball-reduce\(", hlo)  # The gradient sum over shards is there.


def test_vit_esd_effective_rates_follow_the_mesh():
  model = _tiny_vit(drop_path_rate=0.3, drop_path_schedule="uniform", stochastic_depth="esd")
  assert model.effective_drop_path_rates(80) == [pytest.approx(0.3)] * 2  # floor(56) of 80
  with jax.set_mesh(_mesh(8, 1)):
    # 16 rows over 8 shards: 2 local rows, floor(1.4) = 1 kept.
    assert model.effective_drop_path_rates(16) == [pytest.approx(0.5)] * 2
    with pytest.raises(ValueError, match="data shards"):
      model.effective_drop_path_rates(12)
  masked = _tiny_vit(drop_path_rate=0.3, drop_path_schedule="uniform")
  assert masked.effective_drop_path_rates(16) == [0.3, 0.3]
  with pytest.raises(ValueError, match="stochastic_depth"):
    _tiny_vit(stochastic_depth="drop")


# --- the cosub objective --------------------------------------------------------------------


class _Info:
  class_names = None

  def __init__(self, num_classes=4):
    self.num_classes = num_classes


class _StubModel:
  """Logits = flattened image @ w + (row % n) * d: copy i of an image gets i * d."""

  drop_path_rates = [0.5]

  def __init__(self, w, d, rates=None, n=2):
    self.w, self.d, self.n = w, d, n
    if rates is not None:
      self.drop_path_rates = rates

  def effective_drop_path_rates(self, rows):
    del rows
    return [0.25]

  def __call__(self, images, *, train=False, rng=None):
    del rng
    assert train
    rows = images.shape[0]
    return images.reshape(rows, -1) @ self.w + (jnp.arange(rows) % self.n)[:, None] * self.d


def _objective(num_classes=4, **kw):
  return cosub.Cosub(ml_collections.ConfigDict(dict(name="cosub", **kw)), _Info(num_classes))


def _np_log_softmax(s):
  s = s - s.max(-1, keepdims=True)
  return s - np.log(np.exp(s).sum(-1, keepdims=True))


def _np_ce(s, t):  # soft-target CE, batch mean
  return float(np.mean(-np.sum(t * _np_log_softmax(s), -1)))


def _np_bce(s, t):  # mean over B x C
  return float(np.mean(np.maximum(s, 0) - s * t + np.log1p(np.exp(-np.abs(s)))))


def _np_sigmoid(s):
  return 1 / (1 + np.exp(-s))


def _np_softmax(s):
  return np.exp(_np_log_softmax(s))


def _stub_case(seed=0):
  rs = np.random.RandomState(seed)
  images = rs.normal(size=(3, 2, 1, 1)).astype(np.float32)  # B=3 images of 2 "pixels"
  w = rs.normal(size=(2, 4)).astype(np.float32)
  d = rs.normal(size=(4,)).astype(np.float32)
  return images, w, d, np.array([0, 3, 1])


@pytest.mark.parametrize("kind", ["ce", "bce"])
def test_cosub_objective_two_submodels_by_hand(kind):
  images, w, d, labels = _stub_case()
  obj = _objective(kind=kind, num_submodels=2)
  loss, aux = obj.loss(_StubModel(w, d), {"image": images, "label": labels}, jax.random.key(0))
  base = images.reshape(3, 2) @ w
  s1, s2 = base, base + d  # rows 2b and 2b + 1
  y = np.eye(4)[labels]
  lf, act = (_np_ce, _np_softmax) if kind == "ce" else (_np_bce, _np_sigmoid)
  want = (0.5 * (0.5 * lf(s1, y) + 0.5 * lf(s1, act(s2)))
          + 0.5 * (0.5 * lf(s2, y) + 0.5 * lf(s2, act(s1))))
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  assert float(aux["train/esd_effective_drop"]) == 0.25
  agree = np.mean(np.argmax(s1, -1) == np.argmax(s2, -1))
  np.testing.assert_allclose(float(aux["train/submodel_agreement"]), agree)


@pytest.mark.parametrize("kind", ["ce", "bce"])
def test_cosub_objective_three_submodels_by_hand(kind):
  images, w, d, labels = _stub_case(1)
  obj = _objective(kind=kind, num_submodels=3, label_smoothing=0.1)
  loss, _ = obj.loss(_StubModel(w, d, n=3), {"image": images, "label": labels},
                     jax.random.key(0))
  base = images.reshape(3, 2) @ w
  s = [base, base + d, base + 2 * d]
  y = np.eye(4)[labels] * 0.9 + 0.1 / 4
  lf, act = (_np_ce, _np_softmax) if kind == "ce" else (_np_bce, _np_sigmoid)
  # Label term 0.5; the other 0.5 split over the 2 distillation terms: 6 in total.
  terms = [0.5 * lf(s[i], y) + 0.25 * sum(lf(s[i], act(s[j])) for j in range(3) if j != i)
           for i in range(3)]
  np.testing.assert_allclose(float(loss), np.mean(terms), rtol=1e-5)


def test_cosub_off_is_the_plain_loss_and_bce_binarises_mixed_targets():
  images, w, d, labels = _stub_case(2)
  s = images.reshape(3, 2) @ w
  mixed = np.array([[0.7, 0.3, 0, 0], [0, 0, 0.4, 0.6], [0, 1.0, 0, 0]], np.float32)
  batch = {"image": images, "label": labels, "targets": mixed}
  loss, aux = _objective(kind="bce", num_submodels=1, bce_binarize=True).loss(
      _StubModel(w, d, n=1), batch, jax.random.key(0))
  np.testing.assert_allclose(float(loss), _np_bce(s, (mixed > 0).astype(np.float64)), rtol=1e-5)
  assert "train/submodel_agreement" not in aux
  loss, _ = _objective(kind="ce", num_submodels=1).loss(_StubModel(w, d, n=1), batch,
                                                        jax.random.key(0))
  np.testing.assert_allclose(float(loss), _np_ce(s, mixed), rtol=1e-5)


@pytest.mark.parametrize("kind", ["ce", "bce"])
def test_cosub_objective_stops_gradients_through_the_teacher(kind):
  # d loss / d s2 (the second copy's logits) comes only from submodel 2's own terms:
  # 0.5 * [0.5 (act(s2) - y) + 0.5 (act(s2) - act(s1))] / N, N = B (ce) or B x C (bce).
  b, c = 3, 4
  logits = jax.random.normal(jax.random.key(5), (2 * b, c))
  labels = np.array([1, 0, 3])

  class Fixed:
    drop_path_rates = [0.1]

    def __init__(self, out):
      self.out = out

    def __call__(self, images, *, train=False, rng=None):
      return self.out

    def effective_drop_path_rates(self, batch_size):  # The models.base.Classifier contract.
      del batch_size
      return self.drop_path_rates

  obj = _objective(kind=kind, num_submodels=2)
  batch = {"image": jnp.zeros((b, 1, 1, 1)), "label": labels}
  grad = np.asarray(jax.grad(lambda l: obj.loss(Fixed(l), batch, None)[0])(logits))
  s1, s2 = np.asarray(logits[0::2], np.float64), np.asarray(logits[1::2], np.float64)
  y = np.eye(c)[labels]
  act, n = (_np_softmax, b) if kind == "ce" else (_np_sigmoid, b * c)
  want2 = 0.5 * (0.5 * (act(s2) - y) + 0.5 * (act(s2) - act(s1))) / n
  want1 = 0.5 * (0.5 * (act(s1) - y) + 0.5 * (act(s1) - act(s2))) / n
  np.testing.assert_allclose(grad[1::2], want2, rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(grad[0::2], want1, rtol=1e-4, atol=1e-7)


def test_binarised_bce_refuses_the_mixup_steps_label_smoothing():
  from bigpretrain import objectives  # pylint: disable=import-outside-toplevel
  from input_pipeline import datasets  # pylint: disable=import-outside-toplevel
  config = cosub_in1k.get_config()
  info = datasets.get_dataset(config.data).info
  objectives.check(objectives.get_objective(config.objective, info), info, config)
  with config.unlocked():
    config.mixup.label_smoothing = 0.1  # Where objective.label_smoothing's error sends users.
  with pytest.raises(ValueError, match=r"config.mixup.label_smoothing=0.1 with "
                                       r"config.objective.bce_binarize=True"):
    objectives.check(objectives.get_objective(config.objective, info), info, config)


def test_cosub_objective_errors_are_clear():
  images, w, d, labels = _stub_case()
  batch = {"image": images, "label": labels}
  with pytest.raises(ValueError, match="tau"):
    _objective(num_submodels=2).loss(_StubModel(w, d, rates=[0.0, 0.0]), batch, None)
  _objective(num_submodels=1).loss(_StubModel(w, d, rates=[0.0]), batch, None)  # baseline ok
  with pytest.raises(ValueError, match="unknown keys.*'lam'"):
    _objective(lam=0.5)
  with pytest.raises(ValueError, match="label_smoothing=0"):
    _objective(kind="bce", bce_binarize=True, label_smoothing=0.1)
  with pytest.raises(ValueError, match="kind='bce'"):
    _objective(kind="ce", bce_binarize=True)
  with pytest.raises(ValueError, match="kind"):
    _objective(kind="mse")
  with pytest.raises(ValueError, match="num_submodels"):
    _objective(num_submodels=0)
  # Checked when the run is built, before anything is compiled.
  with pytest.raises(ValueError, match="config.mixup.label_smoothing"):
    train.build(helpers.tiny_config("cosub_in21k", **{"objective.label_smoothing": 0.1}))


def test_cosub_objective_with_esd_vit_under_a_mesh():
  model = _tiny_vit(drop_path_rate=0.3, drop_path_schedule="uniform", stochastic_depth="esd")
  graphdef, state = nnx.split(model)
  obj = _objective(num_classes=5, kind="ce", num_submodels=2)
  mesh = _mesh(8, 1)
  rs = np.random.RandomState(0)
  with jax.set_mesh(mesh):
    sharding = NamedSharding(mesh, P(("data", "fsdp")))
    batch = {"image": jax.device_put(rs.normal(size=(8, 16, 16, 3)).astype(np.float32), sharding),
             "label": jax.device_put(np.arange(8) % 5, sharding)}
    step = jax.jit(lambda st, bt, k: obj.loss(nnx.merge(graphdef, st), bt, k))
    loss, aux = step(state, batch, jax.random.key(0))
    loss2, _ = step(state, batch, jax.random.key(1))
  # 2 x 8 rows over 8 shards: 2 local rows, floor(0.7 * 2) = 1 kept -> effective rate 0.5.
  assert float(aux["train/esd_effective_drop"]) == 0.5
  assert np.isfinite(float(loss)) and float(loss) != float(loss2)
  assert 0.0 <= float(aux["train/submodel_agreement"]) <= 1.0


def test_cosub_eval_is_one_deterministic_pass_with_masked_topk():
  model = _tiny_vit(drop_path_rate=0.5, drop_path_schedule="uniform", stochastic_depth="esd")
  images = np.random.RandomState(3).normal(size=(6, 16, 16, 3)).astype(np.float32)
  logits = np.asarray(model(images))
  labels = np.argmax(logits, -1)
  labels[:2] = (labels[:2] + 1) % 5  # Rows 0, 1 wrong; row 5 masked out.
  mask = np.array([1, 1, 1, 1, 1, 0], np.float32)
  out = _objective(num_classes=5).eval_metrics(model, {"image": images, "label": labels,
                                                       "mask": mask}, (1, 5))
  assert [float(v) for v in out["top1"]] == [3.0, 5.0]


# --- LayerDecay and the lr rule -------------------------------------------------------------


def _layers(config):
  """The layer order of `config`'s model (shapes only), which LayerDecay reads."""
  return models.ModelDef.from_config(config.model, 10,
                                     image_size=config.data.image_size).abstract_module()


def test_layer_decay_multipliers_for_a_12_block_vit():
  model = nnx.eval_shape(lambda: vit.VisionTransformer(
      num_classes=3, rngs=nnx.Rngs(0), patch_size=8, width=8, depth=12, num_heads=2,
      mlp_dim=8, image_size=16, layerscale_init=1e-4))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  ld = 0.75
  mults = optim.layer_decay_multipliers(params, ld, layers=model)
  # Supplement A.1: block l (1-based) of L = 12 gets LD^(12 - l), the final block 1;
  # embeddings are layer 0: LD^12; head/norm 1.
  for i in range(12):
    for leaf in jax.tree.leaves(mults["blocks"][i]):
      assert leaf == pytest.approx(ld ** (11 - i))
  for key in ("patch_embed", "cls_token", "pos_embed"):
    np.testing.assert_allclose(jax.tree.leaves(mults[key]), ld ** 12, rtol=1e-12)
  assert set(jax.tree.leaves(mults["head"]) + jax.tree.leaves(mults["norm"])) == {1.0}
  # BEiT / MAE: one more factor LD below the head.
  mae = optim.layer_decay_multipliers(params, ld, "mae", layers=model)
  np.testing.assert_allclose(jax.tree.leaves(mae["blocks"][11]), ld, rtol=1e-12)
  np.testing.assert_allclose(jax.tree.leaves(mae["pos_embed"]), ld ** 13, rtol=1e-12)
  # First AdamW step on unit gradients: update = -lr * C_LD * multiplier.
  cfg = optim.optim_defaults()
  cfg.update(dict(name="adamw", lr=1e-3, weight_decay=0.0, layer_decay=ld))
  cfg.schedule.name = "constant"
  tx, schedule = optim.make_optimizer(cfg, total_steps=10, layers=model)
  assert float(schedule(0)) == pytest.approx(2e-3)
  concrete = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), params)
  updates, _ = tx.update(concrete, tx.init(concrete), concrete)
  np.testing.assert_allclose(updates["blocks"][0]["mlp"]["fc1"]["kernel"],
                             -2e-3 * ld ** 11, rtol=1e-5)
  np.testing.assert_allclose(updates["blocks"][11]["ls2"]["gamma"], -2e-3, rtol=1e-5)
  np.testing.assert_allclose(updates["pos_embed"], -2e-3 * ld ** 12, rtol=1e-5)
  np.testing.assert_allclose(updates["head"]["kernel"], -2e-3, rtol=1e-5)


def test_sqrt_lr_rule_in_optim_and_configs():
  assert optim.scale_lr(1e-3, 1024) == pytest.approx(1e-3 / np.sqrt(2))
  assert optim.scale_lr(1e-4, 8192) == pytest.approx(2e-4)
  c21 = cosub_in21k.get_config("dataset=imagenet21k_p,model=vit_b16")
  assert c21.batch_size == 2048 and c21.optim.lr == pytest.approx(1e-3)
  c21.batch_size = 512  # The lr follows batch-size overrides: 1e-3 * sqrt(1/4).
  assert c21.optim.lr == pytest.approx(5e-4)
  c1k = cosub_in1k.get_config("dataset=tfds:imagenet2012,model=vit_b16")
  assert c1k.optim.lr == pytest.approx(1e-3 * np.sqrt(1536 / 2048))
  ft = cosub_finetune_in1k.get_config("dataset=tfds:imagenet2012,model=vit_b16,init=/ckpt")
  assert ft.optim.lr == pytest.approx(1e-4)
  _, schedule = optim.make_optimizer(ft.optim, total_steps=1000, layers=_layers(ft))
  assert max(float(schedule(s)) for s in range(0, 1000, 10)) == pytest.approx(2e-4, rel=1e-3)


# --- configs --------------------------------------------------------------------------------


@pytest.mark.parametrize("module,model,arg,tau,ld", [
    (cosub_in1k, "vit_s16", "", 0.05, 0.0),
    (cosub_in1k, "vit_h14", "", 0.6, 0.0),
    (cosub_in21k, "vit_b16", "", 0.1, 0.0),
    (cosub_in21k, "vit_l16", ",epochs=270", 0.35, 0.0),
    (cosub_in1k, "vit_m16", "", 0.1, 0.0),
    (cosub_finetune_in1k, "vit_b16", ",init=/ckpt", 0.15, 0.75),  # DeiT-III's fine-tuning tau.
    (cosub_finetune_in1k, "vit_h14", ",init=/ckpt", 0.45, 0.85),
    (cosub_finetune_in1k, "vit_m16", ",init=/ckpt", 0.1, 0.75),
])
def test_paper_scale_configs_take_table_a1_defaults(module, model, arg, tau, ld):
  config = module.get_config(f"dataset=tfds:imagenet2012,model={model}{arg}")
  assert config.model.drop_path_rate == pytest.approx(tau)
  assert config.optim.layer_decay == pytest.approx(ld)
  assert config.model.drop_path_schedule == "uniform" and config.model.stochastic_depth == "esd"
  assert config.optim.weight_decay == 0.02
  config_lib.validate(config)
  abstract = nnx.eval_shape(lambda: models.get_model(
      config.model.name, rngs=nnx.Rngs(0), num_classes=10,
      **{k: v for k, v in config.model.items() if k != "name"}))
  assert abstract.blocks[0].ls1 is not None and not abstract.pos_embed_cls


def test_config_recipe_details():
  c1k = cosub_in1k.get_config("dataset=tfds:imagenet2012")
  assert (c1k.objective.kind, c1k.objective.bce_binarize, c1k.optim.name) == ("bce", True, "lamb")
  assert (c1k.mixup.mixup_alpha, c1k.mixup.cutmix_alpha, c1k.data.repeated_augment) == (0.8, 1, 3)
  assert c1k.num_epochs == 400 and c1k.optim.schedule.warmup_frac == pytest.approx(5 / 400)
  c21 = cosub_in21k.get_config("dataset=imagenet21k_p")
  assert (c21.objective.kind, c21.mixup.mixup_alpha, c21.mixup.cutmix_alpha) == ("ce", 0, 1)
  assert c21.mixup.label_smoothing == 0.1 and "simple_random_crop" in c21.data.train_augment
  assert "three_augment" in c21.data.train_augment and c21.num_epochs == 90
  ft = cosub_finetune_in1k.get_config("dataset=tfds:imagenet2012,init=/ckpt")
  assert ft.model_init == "/ckpt" and ft.optim.layer_decay_lr_scale == 2.0
  # Outside the demo the recipe fine-tunes: without a checkpoint it would train from scratch.
  with pytest.raises(ValueError, match="needs init=DIR"):
    cosub_finetune_in1k.get_config("dataset=tfds:imagenet2012,model=vit_b16")
  assert cosub_finetune_in1k.get_config("dataset=tfds:imagenet2012,init=none").model_init == ""
  # DeiT-III's 21k -> 1k fine-tuning (README_revenge.md): LAMB, cutmix only, smoothing 0.1,
  # Simple Random Crop + 3-Augment, no repeated augmentation, 50 epochs.
  assert (ft.objective.kind, ft.optim.name, ft.mixup.mixup_alpha, ft.mixup.cutmix_alpha,
          ft.mixup.label_smoothing) == ("ce", "lamb", 0, 1, 0.1)
  assert ft.data.train_augment == "simple_random_crop|three_augment|flip"
  assert ft.data.repeated_augment == 1 and ft.num_epochs == 50
  assert ft.optim.layer_decay_convention == "cosub"
  assert cosub_finetune_in1k.get_config(
      "layer_decay_convention=mae").optim.layer_decay_convention == "mae"
  # LAMB clipped at global norm 1.0; cosine from 1e-6 to 1e-5 (deit main.py defaults),
  # absolute values whatever the peak (with LayerDecay, the peak is lr * C_LD).
  for config, peak in ((c1k, c1k.optim.lr), (c21, c21.optim.lr), (ft, 2 * ft.optim.lr)):
    assert config.optim.grad_clip_norm == 1.0
    _, schedule = optim.make_optimizer(config.optim, total_steps=1000, layers=_layers(config))
    assert float(schedule(0)) == pytest.approx(1e-6, rel=1e-4)
    assert max(float(schedule(s)) for s in range(0, 1000, 5)) == pytest.approx(peak, rel=1e-3)
    assert float(schedule(1000)) == pytest.approx(1e-5, rel=1e-4)
  # Without LayerDecay no C_LD applies: the same absolute ends around the plain peak.
  no_ld = cosub_finetune_in1k.get_config("dataset=tfds:imagenet2012,init=/ckpt,layer_decay=0")
  _, schedule = optim.make_optimizer(no_ld.optim, total_steps=1000, layers=_layers(no_ld))
  assert [float(schedule(0)), float(schedule(1000))] == pytest.approx([1e-6, 1e-5], rel=1e-4)
  assert max(float(schedule(s)) for s in range(0, 1000, 5)) == pytest.approx(no_ld.optim.lr,
                                                                             rel=1e-3)
  assert cosub_in1k.get_config("submodels=1").objective.num_submodels == 1
  with pytest.raises(ValueError, match="Table A.1"):
    cosub_in1k.get_config("dataset=tfds:imagenet2012,model=vit_ti16")
  assert cosub_in1k.get_config("dataset=tfds:imagenet2012,model=vit_ti16,tau=0.1") \
      .model.drop_path_rate == 0.1


def test_cosub_trains_in_the_trainer_with_mixup_and_esd(tmp_path):
  # cosub_in1k's demo path (BCE, binarised mixup/cutmix targets, repeated augmentation, ESD)
  # on 8 data shards: 24 images x 2 copies = 6 rows per shard, floor(0.7 * 6) = 4 kept.
  config = helpers.tiny_config("cosub_in1k", batch_size=24, total_steps=3,
                               **{"model.drop_path_rate": 0.3})
  train.train_and_evaluate(config, str(tmp_path))
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  train_rows = [r for r in rows if "train/loss" in r]
  assert [r["step"] for r in train_rows] == [1, 2, 3]
  for r in train_rows:
    assert r["train/esd_effective_drop"] == pytest.approx(1 / 3)
    assert np.isfinite(r["train/loss"]) and 0 <= r["train/submodel_agreement"] <= 1
  assert any("eval/top1" in r for r in rows)
