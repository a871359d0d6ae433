"""Tests for TResNet-M / TResNet-L (bigpretrain/models/tresnet.py).

Counts are timm's (sum of p.numel() over parameters(), BN running statistics excluded) with
a 1000-class head; the full-size models are only traced (nnx.eval_shape), never allocated.
The layers are checked against numpy written from timm's definitions.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bigpretrain import models
from bigpretrain.models import tresnet


@functools.lru_cache(maxsize=None)
def _abstract(name, num_classes=1000):
  return nnx.eval_shape(lambda: models.get_model(name, num_classes=num_classes,
                                                 rngs=nnx.Rngs(0)))


def _num_params(module) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def _shapes(module, size):
  """Abstract (logits, stage outputs) for a batch of 2 images of size x size."""
  x = jax.ShapeDtypeStruct((2, size, size, 3), jnp.float32)
  return nnx.eval_shape(lambda m, v: (m(v), m.stages(v)), module, x)


def _fill(rs, path, x):
  """Well-scaled random values: kernels N(0, 1/fan_in), BN scale / running var in
  [0.5, 1.5], biases and running means N(0, 0.1)."""
  if len(x.shape) >= 2:
    return rs.normal(0, 1 / np.sqrt(np.prod(x.shape[:-1])), x.shape).astype(x.dtype)
  if path[-1].key in ("scale", "var"):
    return rs.uniform(0.5, 1.5, x.shape).astype(x.dtype)
  return rs.normal(0, 0.1, x.shape).astype(x.dtype)


def _materialize(build, seed=0):
  graphdef, state = nnx.split(nnx.eval_shape(build))
  rs = np.random.RandomState(seed)
  pure = jax.tree_util.tree_map_with_path(functools.partial(_fill, rs),
                                          nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state)


def _pure(module):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(module)))


# --- numpy references -----------------------------------------------------------------------


def _space_to_depth_np(x, bs=4):
  """out[b, i, j, (r * bs + s) * C + c] = x[b, bs * i + r, bs * j + s, c], by loops."""
  b, h, w, c = x.shape
  out = np.zeros((b, h // bs, w // bs, bs * bs * c), x.dtype)
  for i in range(h // bs):
    for j in range(w // bs):
      for r in range(bs):
        for s in range(bs):
          out[:, i, j, (r * bs + s) * c:(r * bs + s + 1) * c] = x[:, bs * i + r, bs * j + s]
  return out


def _blur_np(x):
  """Reflect-pad 1, then each channel convolved with [1,2,1] x [1,2,1] / 16 at stride 2."""
  f = np.outer([1, 2, 1], [1, 2, 1]) / 16.0
  p = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="reflect")
  ho, wo = (p.shape[1] - 3) // 2 + 1, (p.shape[2] - 3) // 2 + 1
  out = np.zeros((x.shape[0], ho, wo, x.shape[3]))
  for i in range(ho):
    for j in range(wo):
      out[:, i, j] = np.einsum("bhwc,hw->bc", p[:, 2 * i:2 * i + 3, 2 * j:2 * j + 3], f)
  return out


def _avg_pool_np(x):
  """2x2 stride-2 average pool, ceil mode, averaging only the pixels inside the image."""
  h, w = x.shape[1], x.shape[2]
  out = np.zeros((x.shape[0], (h + 1) // 2, (w + 1) // 2, x.shape[3]))
  for i in range(out.shape[1]):
    for j in range(out.shape[2]):
      out[:, i, j] = x[:, 2 * i:2 * i + 2, 2 * j:2 * j + 2].mean(axis=(1, 2))
  return out


def _conv_np(x, k):
  """Stride-1 NHWC conv with an HWIO kernel and symmetric k // 2 zero padding."""
  pad = k.shape[0] // 2
  p = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
  out = np.zeros(x.shape[:3] + (k.shape[3],))
  for a in range(k.shape[0]):
    for b in range(k.shape[1]):
      out += p[:, a:a + x.shape[1], b:b + x.shape[2]] @ k[a, b]
  return out


def _cna_np(x, p, slope=None):
  """conv, BN on running statistics (eps 1e-5), optional leaky ReLU."""
  bn = p["bn"]
  y = _conv_np(x, p["conv"]["kernel"])
  y = (y - bn["mean"]) / np.sqrt(bn["var"] + 1e-5) * bn["scale"] + bn["bias"]
  return y if slope is None else np.where(y > 0, y, slope * y)


def _se_np(x, p):
  s = x.mean(axis=(1, 2))
  s = np.maximum(s @ p["fc1"]["kernel"][0, 0] + p["fc1"]["bias"], 0)
  s = s @ p["fc2"]["kernel"][0, 0] + p["fc2"]["bias"]
  return x * (1 / (1 + np.exp(-s)))[:, None, None, :]


# --- counts, shapes, names ------------------------------------------------------------------


@pytest.mark.parametrize("name,expected", [("tresnet_m", 31_389_032),
                                           ("tresnet_l", 55_989_256)])
def test_param_counts_match_timm(name, expected):
  assert _num_params(_abstract(name)) == expected


@pytest.mark.parametrize("name,widths", [("tresnet_m", (64, 128, 1024, 2048)),
                                         ("tresnet_l", (76, 152, 1216, 2432))])
def test_output_and_stage_shapes_at_224_and_64(name, widths):
  model = _abstract(name)
  assert model.stage_widths == widths and model.num_features == widths[-1]
  for size in (224, 64):  # Stages at 1/4, 1/8, 1/16, 1/32 of the input.
    logits, stages = _shapes(model, size)
    assert logits.shape == (2, 1000) and logits.dtype == jnp.float32
    assert [s.shape for s in stages] == [(2, size // r, size // r, w)
                                         for r, w in zip((4, 8, 16, 32), widths)]


def test_sizes_not_divisible_by_32_round_up_and_by_4_are_required():
  model = _abstract("tresnet_m")
  _, stages = _shapes(model, 36)  # 9 -> ceil halvings 5, 3, 2 (timm's ceil-mode pooling)
  assert [s.shape[1] for s in stages] == [9, 5, 3, 2]
  with pytest.raises(ValueError, match="divisible by 4; got 66x66"):
    _shapes(model, 66)


def test_layout_se_and_names_follow_timm():
  m = _abstract("tresnet_m")
  names = {jax.tree_util.keystr(p, simple=True, separator="/"): v.shape
           for p, v in jax.tree_util.tree_flatten_with_path(
               nnx.state(m, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))[0]}
  # timm: body.conv1.conv.weight [64, 48, 3, 3], body.layer2.0.downsample.1.conv.weight, ...
  assert names["conv1/conv/kernel"] == (3, 3, 48, 64)
  assert names["layer1/0/se/fc1/kernel"] == (1, 1, 64, 64)  # max(64 // 4, 64)
  assert names["layer2/0/downsample/conv/kernel"] == (1, 1, 64, 128)
  assert names["layer3/0/se/fc1/kernel"] == (1, 1, 256, 128)  # on the 3x3's 256, 1024 // 8
  assert names["layer3/10/conv3/bn/scale"] == (1024,)
  assert names["head/kernel"] == (2048, 1000)
  assert "layer1/0/downsample/conv/kernel" not in names  # 64 -> 64 at stride 1
  assert not any(n.startswith("layer4/") and "/se/" in n for n in names)
  assert [len(getattr(m, f"layer{i}")) for i in range(1, 5)] == [3, 4, 11, 3]
  # Leaky ReLU slopes: 1e-2 after the stem conv (timm's nn.LeakyReLU default), 1e-3 in blocks.
  assert m.conv1.slope == 1e-2 and m.layer1[0].conv1.slope == m.layer3[0].conv2.slope == 1e-3
  assert m.layer1[0].conv2.slope is None and m.layer3[0].conv3.slope is None
  blurred = [b.conv1.blur for b in m.layer2] + [b.conv2.blur for b in m.layer3]
  assert blurred == [True, False, False, False] + [True] + [False] * 10


# --- layers against numpy -------------------------------------------------------------------


def test_space_to_depth_is_the_timm_reshape():
  x = np.random.RandomState(0).normal(size=(2, 8, 12, 3)).astype(np.float32)
  np.testing.assert_array_equal(tresnet.space_to_depth(jnp.asarray(x)), _space_to_depth_np(x))


@pytest.mark.parametrize("size", [(6, 8), (7, 5)])
def test_blur_pool_is_the_binomial_filter(size):
  x = np.random.RandomState(1).normal(size=(2, *size, 3))
  out = tresnet.blur_pool(jnp.asarray(x, jnp.float32))
  np.testing.assert_allclose(out, _blur_np(x), rtol=1e-5, atol=1e-6)
  # A constant map stays constant (the filter sums to 1, reflect padding adds no zeros).
  np.testing.assert_allclose(tresnet.blur_pool(jnp.full((1, 5, 5, 1), 3.0)), 3.0, rtol=1e-6)


@pytest.mark.parametrize("size", [6, 5])
def test_strided_bottleneck_matches_numpy(size):
  """1x1 + act, 3x3 + act + blur, SE, 1x1 + BN; avg-pool + 1x1 + BN shortcut; ReLU."""
  block = _materialize(lambda: tresnet.Bottleneck(8, 4, stride=2, use_se=True,
                                                  dtype=jnp.float32, param_dtype=jnp.float32,
                                                  rngs=nnx.Rngs(0)))
  x = np.random.RandomState(2).normal(size=(2, size, size, 8))
  out = nnx.jit(lambda b, v: b(v, train=False))(block, jnp.asarray(x, jnp.float32))
  p = _pure(block)
  y = _cna_np(x, p["conv1"], slope=1e-3)
  y = _blur_np(_cna_np(y, p["conv2"], slope=1e-3))
  y = _cna_np(_se_np(y, p["se"]), p["conv3"])
  want = np.maximum(_cna_np(_avg_pool_np(x), p["downsample"]) + y, 0)
  assert p["se"]["fc1"]["kernel"].shape == (1, 1, 4, 64)  # max(16 // 8, 64)
  np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


def test_basic_block_matches_numpy_and_starts_as_identity():
  kw = dict(stride=1, use_se=True, dtype=jnp.float32, param_dtype=jnp.float32)
  block = _materialize(lambda: tresnet.BasicBlock(8, 8, rngs=nnx.Rngs(0), **kw))
  x = np.random.RandomState(3).normal(size=(2, 4, 4, 8))
  out = nnx.jit(lambda b, v: b(v, train=False))(block, jnp.asarray(x, jnp.float32))
  p = _pure(block)
  y = _se_np(_cna_np(_cna_np(x, p["conv1"], slope=1e-3), p["conv2"]), p["se"])
  np.testing.assert_allclose(out, np.maximum(x + y, 0), rtol=1e-4, atol=1e-5)
  # Freshly initialised, the last BN scale is zero: the block is relu(identity).
  fresh = tresnet.BasicBlock(8, 8, rngs=nnx.Rngs(0), **kw)
  assert not np.any(fresh.conv2.bn.scale[...]) and np.all(fresh.conv1.bn.scale[...] == 1)
  np.testing.assert_allclose(fresh(jnp.asarray(x, jnp.float32), train=False),
                             np.maximum(x, 0), rtol=1e-6)


def test_tiny_tresnet_features_feed_the_head_in_both_modes():
  model = _materialize(lambda: tresnet.TResNet(num_classes=5, rngs=nnx.Rngs(0),
                                               stage_sizes=(1, 1, 1, 1), width_factor=0.125))
  x = jax.random.normal(jax.random.key(0), (4, 32, 32, 3))
  logits, feats, train_logits = nnx.jit(
      lambda m, v: (m(v), m.features(v), m(v, train=True)))(model, x)
  assert feats.shape == (4, 256) and logits.shape == train_logits.shape == (4, 5)
  head = _pure(model.head)
  np.testing.assert_allclose(logits, np.asarray(feats, np.float64) @ head["kernel"]
                             + head["bias"], rtol=1e-4, atol=1e-4)
  assert np.all(np.isfinite(train_logits))
  assert not np.allclose(train_logits, logits)  # batch statistics, not running ones


def test_bad_options_are_named():
  with pytest.raises(ValueError, match="stochastic depth"):
    models.get_model("tresnet_m", num_classes=3, rngs=nnx.Rngs(0), drop_path_rate=0.1)
  with pytest.raises(ValueError, match="4 stages"):
    tresnet.TResNet(num_classes=3, rngs=nnx.Rngs(0), stage_sizes=(1, 1, 1))
  with pytest.raises(TypeError, match="fixed by the architecture"):
    models.get_model("tresnet_l", num_classes=3, rngs=nnx.Rngs(0), width_factor=1.0)
