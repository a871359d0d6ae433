"""Tests for ResNet-18, ResNeXt, RegNetY, the ViT pre-logits layer and `features` everywhere.

Parameter counts are torchvision's (sum of p.numel() over parameters(), so BatchNorm running
statistics excluded) with a 1000-class head; models are built with nnx.eval_shape, so even the
828M-parameter ResNeXt-101 32x48d allocates nothing.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bigpretrain import models
from bigpretrain.models import layers
from bigpretrain.models import pallas_conv
from bigpretrain.models import regnet
from bigpretrain.models import resnet


def _abstract(name, **kw):
  return nnx.eval_shape(lambda: models.get_model(name, rngs=nnx.Rngs(0), **kw))


@functools.lru_cache(maxsize=None)
def _abstract_1k(name):
  """The abstract model with a 1000-class head, built once per test session."""
  return _abstract(name, num_classes=1000)


def _kw():
  return dict(dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))


def _num_params(module) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def _fill(rs, path, x):
  """Random but well-scaled values: kernels N(0, 1/fan_in), BN scale / running var in
  [0.5, 1.5], biases and running means N(0, 0.1)."""
  if len(x.shape) >= 2:
    return rs.normal(0, 1 / np.sqrt(np.prod(x.shape[:-1])), x.shape).astype(x.dtype)
  if path[-1].key in ("scale", "var"):
    return rs.uniform(0.5, 1.5, x.shape).astype(x.dtype)
  return rs.normal(0, 0.1, x.shape).astype(x.dtype)


def _materialize(build, seed=0):
  """Builds a module abstractly, then fills it with random numpy values (no XLA init)."""
  graphdef, state = nnx.split(nnx.eval_shape(build))
  rs = np.random.RandomState(seed)
  pure = jax.tree_util.tree_map_with_path(functools.partial(_fill, rs),
                                          nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state)


def _pure(module):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(module)))


def _logical_names(module):
  _, params, _ = nnx.split(module, nnx.Param, ...)
  flat = jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
  return {jax.tree_util.keystr(path, simple=True, separator="/"):
          leaf.get_metadata().get("out_sharding") for path, leaf in flat}


def _images(batch, size, seed=0):
  return jax.random.normal(jax.random.key(seed), (batch, size, size, 3), jnp.float32)


# --- numpy references -----------------------------------------------------------------------


def _conv_np(x, k, stride=1, groups=1):
  """NHWC conv with an HWIO kernel of `groups` groups and symmetric k // 2 zero padding."""
  kh, pad = k.shape[0], k.shape[0] // 2
  x = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
  ho = (x.shape[1] - kh) // stride + 1
  wo = (x.shape[2] - kh) // stride + 1
  cin_g, cout = k.shape[2], k.shape[3]
  cout_g = cout // groups
  out = np.zeros((x.shape[0], ho, wo, cout))
  for g in range(groups):
    xg = x[..., g * cin_g:(g + 1) * cin_g]
    for a in range(kh):
      for b in range(kh):
        patch = xg[:, a:a + stride * ho:stride, b:b + stride * wo:stride]
        out[..., g * cout_g:(g + 1) * cout_g] += patch @ k[a, b, :, g * cout_g:(g + 1) * cout_g]
  return out


def _bn_np(x, p):
  """BatchNorm on running statistics, eps 1e-5."""
  return (x - p["mean"]) / np.sqrt(p["var"] + 1e-5) * p["scale"] + p["bias"]


def _relu(x):
  return np.maximum(x, 0)


# --- ResNet-18 / ResNeXt --------------------------------------------------------------------


@pytest.mark.parametrize("name,expected", [
    ("resnet18", 11_689_512),
    ("resnext50_32x4d", 25_028_904),
    ("resnext101_32x4d", 44_177_704),
    ("resnext101_32x8d", 88_791_336),
    ("resnext101_32x16d", 194_026_792),
    ("resnext101_32x48d", 828_411_176),
])
def test_resnet_resnext_param_counts(name, expected):
  assert _num_params(_abstract_1k(name)) == expected


def test_resnext_grouped_widths_follow_torchvision():
  # width = int(planes * width_per_group / 64) * groups: 32x4d stage 1 has 4 * 32 = 128
  # channels in 32 groups of 4; 32x48d has 48 * 32 = 1536 in groups of 48.
  model = _abstract_1k("resnext50_32x4d")
  first = model.blocks[0]
  assert first.conv1.kernel.shape == (1, 1, 64, 128)
  assert first.conv2.kernel.shape == (3, 3, 4, 128) and first.conv2.feature_group_count == 32
  assert first.conv3.kernel.shape == (1, 1, 128, 256)
  stage4 = model.blocks[3 + 4 + 6]
  assert stage4.conv2.kernel.shape == (3, 3, 32, 1024) and stage4.conv2.strides == 2
  big = _abstract_1k("resnext101_32x48d")
  assert big.blocks[0].conv2.kernel.shape == (3, 3, 48, 1536)
  assert big.blocks[-1].conv2.kernel.shape == (3, 3, 384, 12288)
  names = _logical_names(model)
  assert names["blocks/0/conv2/kernel"] == (None, None, "conv_in", "conv_out")  # grouped
  assert names["blocks/0/conv1/kernel"] == (None, None, "conv_in", "conv_out")


def test_resnet18_basic_blocks():
  model = _abstract_1k("resnet18")
  assert model.num_blocks == 8 and model.num_features == 512
  assert all(isinstance(b, resnet.BasicBlock) for b in model.blocks)
  assert model.blocks[0].downsample_conv is None  # 64 -> 64, stride 1
  assert model.blocks[2].conv1.strides == 2 and model.blocks[2].downsample_conv.strides == 2
  assert model.blocks[2].conv1.kernel.shape == (3, 3, 64, 128)


def test_basic_block_and_grouped_bottleneck_match_numpy():
  x = np.asarray(jax.random.normal(jax.random.key(1), (2, 5, 5, 8)), np.float64)
  xj = jnp.asarray(x, jnp.float32)

  basic = _materialize(lambda: resnet.BasicBlock(8, 16, stride=2, **_kw()))
  block = _materialize(lambda: resnet.Bottleneck(8, 4, stride=1, groups=4, **_kw()))
  got_basic, got_block = nnx.jit(lambda a, b, v: (a(v, train=False), b(v, train=False)))(
      basic, block, xj)
  p = _pure(basic)
  y = _relu(_bn_np(_conv_np(x, p["conv1"]["kernel"], 2), p["bn1"]))
  y = _bn_np(_conv_np(y, p["conv2"]["kernel"]), p["bn2"])
  short = _bn_np(_conv_np(x, p["downsample_conv"]["kernel"], 2), p["downsample_bn"])
  np.testing.assert_allclose(got_basic, _relu(short + y), rtol=1e-4, atol=1e-4)

  # ResNeXt bottleneck, planes 4: width int(4 * 64 / 64) * 4 = 16 in 4 groups of 4, out 16.
  p = _pure(block)
  assert p["conv2"]["kernel"].shape == (3, 3, 4, 16)
  y = _relu(_bn_np(_conv_np(x, p["conv1"]["kernel"]), p["bn1"]))
  y = _relu(_bn_np(_conv_np(y, p["conv2"]["kernel"], groups=4), p["bn2"]))
  y = _bn_np(_conv_np(y, p["conv3"]["kernel"]), p["bn3"])
  short = _bn_np(_conv_np(x, p["downsample_conv"]["kernel"]), p["downsample_bn"])
  np.testing.assert_allclose(got_block, _relu(short + y), rtol=1e-4, atol=1e-4)


def test_residual_branches_start_at_zero_unless_asked():
  x = jax.random.normal(jax.random.key(1), (2, 5, 5, 16))

  @nnx.jit
  def build_and_run(v):  # one compile instead of one per initializer and op
    basic = resnet.BasicBlock(16, 16, stride=1, **_kw())
    ones = resnet.BasicBlock(16, 16, stride=1, zero_init_residual=False, **_kw())
    return basic.bn2.scale[...], basic(v, train=False), ones.bn2.scale[...]

  zero_scale, out, one_scale = build_and_run(x)
  np.testing.assert_array_equal(zero_scale, np.zeros(16))
  np.testing.assert_allclose(out, np.maximum(x, 0), atol=1e-6)
  np.testing.assert_array_equal(one_scale, np.ones(16))


def test_resnet_bad_options_are_named():
  with pytest.raises(ValueError, match="basic block supports only groups=1"):
    _abstract("resnet18", num_classes=10, groups=32)
  with pytest.raises(ValueError, match="block must be one of"):
    resnet.ResNet(num_classes=3, rngs=nnx.Rngs(0), stage_sizes=(1,), block="dense")
  with pytest.raises(TypeError, match="fixed by the architecture"):
    _abstract("resnext50_32x4d", num_classes=10, groups=8)


def test_resnet18_forward_32px_features_and_train_mode():
  model = _materialize(lambda: models.get_model("resnet18", num_classes=5, rngs=nnx.Rngs(0)))
  x = _images(4, 32)
  logits, feats, train_logits = nnx.jit(
      lambda m, v: (m(v), m.features(v), m(v, train=True)))(model, x)
  assert logits.shape == (4, 5) and logits.dtype == jnp.float32
  assert feats.shape == (4, 512) and feats.dtype == jnp.float32
  want = np.asarray(feats, np.float64) @ _pure(model.head)["kernel"] + _pure(model.head)["bias"]
  np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)
  assert bool(jnp.all(jnp.isfinite(train_logits)))
  assert not np.allclose(logits, train_logits)  # batch vs running statistics


# --- RegNetY --------------------------------------------------------------------------------

# torchvision's regnet_y_* BlockParams.from_init_params arguments, (depth, w_0, w_a, w_m,
# group width), read from torchvision/models/regnet.py; se_ratio 0.25 for all.
_TORCHVISION_REGNETY = {
    "regnety_400mf": (16, 48, 27.89, 2.09, 8),
    "regnety_8gf": (17, 192, 76.82, 2.19, 56),
    "regnety_16gf": (18, 200, 106.23, 2.48, 112),
    "regnety_32gf": (20, 232, 115.89, 2.53, 232),
    "regnety_128gf": (27, 456, 160.83, 2.52, 264),
}


def _make_divisible_np(v, d):
  new = max(d, int(v + d / 2) // d * d)
  return new + d if new < 0.9 * v else new


def _stages_np(depth, w_0, w_a, w_m, group_width, adjust):
  """The RegNet quantisation in float32 numpy (torch's default dtype), then either
  torchvision's width/group adjustment ('make_divisible') or ClassyVision's ('round')."""
  u = np.arange(depth, dtype=np.float32) * np.float32(w_a) + np.float32(w_0)
  ks = np.round(np.log(u / np.float32(w_0)) / np.float32(np.log(w_m)))
  ws = (np.round(np.float32(w_0) * np.power(np.float32(w_m), ks) / 8) * 8).astype(int)
  boundaries = [0] + [i for i in range(1, depth) if ws[i] != ws[i - 1]] + [depth]
  out = []
  for a, b in zip(boundaries[:-1], boundaries[1:]):
    w = int(ws[a])
    g = min(group_width, w)
    w = _make_divisible_np(w, g) if adjust == "make_divisible" else int(round(w / g) * g)
    out.append((w, b - a, g))
  return tuple(out)


@pytest.mark.parametrize("name", sorted(_TORCHVISION_REGNETY))
def test_regnet_stages_match_an_independent_derivation(name):
  params = _TORCHVISION_REGNETY[name]
  want = _stages_np(*params, adjust="make_divisible")
  assert regnet.regnet_stages(*params) == want
  assert _abstract_1k(name).stages == want
  # ClassyVision's rounding (the code SWAG trained with) agrees for SWAG's sizes; for 8GF
  # it makes the first stage 168 wide (pycls's RegNetY-8GF) where torchvision's gives 224.
  classy = _stages_np(*params, adjust="round")
  if name == "regnety_8gf":
    assert classy[0] == (168, 2, 56) and classy[1:] == want[1:]
  else:
    assert classy == want


def test_regnety_stage_widths_and_depths_literal():
  # The stages written out; the final widths are those SWAG's regnet.py comments give for
  # 16/32/128GF (3024 / 3712 / 7392 feature maps).
  assert regnet.regnet_stages(*_TORCHVISION_REGNETY["regnety_8gf"]) == (
      (224, 2, 56), (448, 4, 56), (896, 10, 56), (2016, 1, 56))
  assert regnet.regnet_stages(*_TORCHVISION_REGNETY["regnety_16gf"]) == (
      (224, 2, 112), (448, 4, 112), (1232, 11, 112), (3024, 1, 112))
  assert regnet.regnet_stages(*_TORCHVISION_REGNETY["regnety_32gf"]) == (
      (232, 2, 232), (696, 5, 232), (1392, 12, 232), (3712, 1, 232))
  assert regnet.regnet_stages(*_TORCHVISION_REGNETY["regnety_128gf"]) == (
      (528, 2, 264), (1056, 7, 264), (2904, 17, 264), (7392, 1, 264))


@pytest.mark.parametrize("name,expected", [
    ("regnety_400mf", 4_344_144),  # torchvision's num_params
    ("regnety_8gf", 39_381_472),
    ("regnety_16gf", 83_590_140),
    ("regnety_32gf", 145_046_770),
    ("regnety_128gf", 644_812_894),  # SWAG's, as torchvision ships it
])
def test_regnety_param_counts(name, expected):
  assert _num_params(_abstract_1k(name)) == expected


def test_regnety_squeeze_width_is_a_quarter_of_the_block_input():
  model = _abstract_1k("regnety_16gf")
  first = model.blocks[0]  # stem 32 -> 224
  assert first.se.fc1.kernel.shape == (1, 1, 224, 8)  # round(0.25 * 32), not 0.25 * 224
  second_stage = model.blocks[2]  # 224 -> 448
  assert second_stage.se.fc1.kernel.shape == (1, 1, 448, 56)
  assert model.blocks[3].se.fc1.kernel.shape == (1, 1, 448, 112)
  assert second_stage.conv_b.feature_group_count == 448 // 112
  assert second_stage.conv_b.strides == 2 and second_stage.proj_conv.strides == 2
  assert model.blocks[3].proj_conv is None
  assert model.stem_conv.kernel.shape == (3, 3, 3, 32) and model.stem_conv.strides == 2


def test_regnet_block_matches_numpy():
  block = _materialize(lambda: regnet.ResBottleneckBlock(
      8, 16, stride=2, group_width=4, se_ratio=0.25, **_kw()))
  p = _pure(block)
  assert p["se"]["fc1"]["kernel"].shape == (1, 1, 16, 2)  # round(0.25 * 8 input channels)
  x = np.asarray(jax.random.normal(jax.random.key(1), (2, 5, 5, 8)), np.float64)
  got = nnx.jit(lambda m, v: m(v, train=False))(block, jnp.asarray(x, jnp.float32))
  y = _relu(_bn_np(_conv_np(x, p["conv_a"]["kernel"]), p["bn_a"]))
  y = _relu(_bn_np(_conv_np(y, p["conv_b"]["kernel"], 2, groups=4), p["bn_b"]))
  s = y.mean(axis=(1, 2))
  s = _relu(s @ p["se"]["fc1"]["kernel"][0, 0] + p["se"]["fc1"]["bias"])
  s = s @ p["se"]["fc2"]["kernel"][0, 0] + p["se"]["fc2"]["bias"]
  y = y * (1 / (1 + np.exp(-s)))[:, None, None, :]
  y = _bn_np(_conv_np(y, p["conv_c"]["kernel"]), p["bn_c"])
  short = _bn_np(_conv_np(x, p["proj_conv"]["kernel"], 2), p["proj_bn"])
  np.testing.assert_allclose(got, _relu(short + y), rtol=1e-4, atol=1e-4)


def _tiny_regnet(**kw):
  # Block widths 8, 16, 32, 32: three stages of widths (8, 16, 32) and depths (1, 1, 2).
  return regnet.RegNet(num_classes=5, rngs=nnx.Rngs(0), depth=4, w_0=8, w_a=8.0, w_m=2.0,
                       group_width=8, image_size=32, **kw)


def test_tiny_regnety_forward_32px_features_and_train_mode():
  model = _materialize(_tiny_regnet)
  assert model.stages == ((8, 1, 8), (16, 1, 8), (32, 2, 8))
  x = _images(4, 32)
  logits, feats, train_logits = nnx.jit(
      lambda m, v: (m(v), m.features(v), m(v, train=True)))(model, x)
  assert logits.shape == (4, 5) and feats.shape == (4, 32)
  want = np.asarray(feats, np.float64) @ _pure(model.head)["kernel"] + _pure(model.head)["bias"]
  np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)
  assert bool(jnp.all(jnp.isfinite(train_logits))) and not np.allclose(logits, train_logits)


def test_regnet_batch_norm_statistics_are_global_under_a_sharded_batch():
  """Synchronised BatchNorm (SWAG section 4.1): with the batch split over 8 devices, the
  running mean moves towards the mean over the global batch, not over one shard."""
  model = _materialize(_tiny_regnet)
  x = _images(8, 32, seed=3)
  conv_out = np.asarray(model.stem_conv(x), np.float64)
  mesh = jax.make_mesh((8,), ("data",))
  xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  before = np.asarray(model.stem_bn.mean[...], np.float64)
  nnx.jit(lambda m, v: m(v, train=True))(model, xs)
  np.testing.assert_allclose(model.stem_bn.mean[...],
                             0.9 * before + 0.1 * conv_out.mean(axis=(0, 1, 2)),
                             rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("conv,one_device", [
    (layers.batch_local_conv, jax.lax.conv_general_dilated),
    (layers.batch_local_gemm_conv, layers.conv_as_gemm),
    (layers.batch_local_split_conv, layers.conv_per_group),
    (layers.batch_local_pallas_conv, pallas_conv.conv_pallas)])
def test_grouped_convolution_computes_only_each_devices_rows(conv, one_device):
  """layers.batch_local_conv (grouped convs; also as GEMMs, per group or by the Pallas
  kernels, grouped_conv_impl 'gemm' / 'split' / 'pallas'): under an 8-device batch split,
  value and kernel gradient equal the unsharded convolution's, and each device does an
  eighth of the work (XLA's own partitioning of grouped convs convolves the global batch
  everywhere)."""
  rs = np.random.RandomState(0)
  x = rs.randn(16, 6, 6, 64).astype(np.float32)
  k = rs.randn(3, 3, 32, 64).astype(np.float32) / 16
  dims = ("NHWC", "HWIO", "NHWC")

  def loss(conv, x, k):
    y = conv(x, k, (1, 1), "SAME", dimension_numbers=dims, feature_group_count=2)
    return jnp.sum(y * jnp.cos(y))

  def compiled(conv, *args):
    return jax.jit(jax.value_and_grad(functools.partial(loss, conv), argnums=1)).lower(
        *args).compile()

  want_value, want_grad = jax.value_and_grad(
      functools.partial(loss, jax.lax.conv_general_dilated), argnums=1)(x, k)
  one_device_flops = compiled(one_device, x, k).cost_analysis()["flops"]
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, jax.sharding.PartitionSpec(("data", "fsdp")))
    ks = jax.device_put(k, jax.sharding.PartitionSpec(None, None, "fsdp"))
    step = compiled(conv, xs, ks)
    value, grad = step(xs, ks)
  np.testing.assert_allclose(value, want_value, rtol=1e-4)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-3)
  if conv is layers.batch_local_pallas_conv:
    # XLA counts an interpreted kernel's loop body once, whatever its trip count: check that
    # the kernels read each device's 2 images' rows (2 x 6 x 6), never the 16 images'.
    hlo = step.as_text()
    assert "f32[72,64]" in hlo and "f32[576,64]" not in hlo
  else:
    assert step.cost_analysis()["flops"] < 1.25 * one_device_flops / 8


@pytest.mark.parametrize("conv", [layers.batch_local_conv, layers.batch_local_pallas_conv])
def test_grouped_convolution_sums_bfloat16_kernel_gradients_in_float32(conv):
  """As nnx.Conv calls it in bfloat16 (kernel cast first): the cross-device sum of the kernel
  gradient is float32 (XLA:CPU aborted compiling a bfloat16 one) and matches one device's."""
  rs = np.random.RandomState(1)
  x = jnp.asarray(rs.randn(16, 6, 6, 64), jnp.bfloat16)
  k = rs.randn(3, 3, 32, 64).astype(np.float32) / 16

  def loss(conv, k, x):
    y = conv(x, k.astype(jnp.bfloat16), (1, 1), "SAME",
             dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  want = jax.grad(functools.partial(loss, jax.lax.conv_general_dilated))(k, x)
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, jax.sharding.PartitionSpec("fsdp"))
    step = jax.jit(jax.grad(functools.partial(loss, conv)))
    compiled = step.lower(k, xs).compile()
    grad = compiled(k, xs)
  sums = [line for line in compiled.as_text().splitlines() if "all-reduce(" in line]
  assert sums and not any("bf16" in line for line in sums), sums
  np.testing.assert_allclose(grad, want, rtol=0.05, atol=0.05 * float(np.abs(want).max()))


def test_regnet_bad_parameters_are_named():
  with pytest.raises(ValueError, match="w_0 a positive multiple of 8"):
    regnet.regnet_stages(4, 12, 8.0, 2.0, 8)
  with pytest.raises(ValueError, match="w_m > 1"):
    regnet.regnet_stages(4, 8, 8.0, 1.0, 8)
  with pytest.raises(ValueError, match="'mask' only"):
    _abstract("regnety_8gf", num_classes=10, drop_path_rate=0.1, stochastic_depth="esd")
  with pytest.raises(TypeError, match="fixed by the architecture"):
    _abstract("regnety_8gf", num_classes=10, w_0=64)


# --- ViT pre-logits (SWAG) ------------------------------------------------------------------


def test_vit_pre_logits_count_axes_and_tanh_representation():
  base = 5_717_416  # ViT-Ti/16, 1000 classes (tests/test_models.py)
  model = _abstract("vit_ti16", num_classes=1000, pre_logits=True)
  assert _num_params(model) == base + 192 * 192 + 192
  assert model.pre_logits.kernel.shape == (192, 192)
  assert _logical_names(model)["pre_logits/kernel"] == ("embed", None)

  # features = tanh(pooled @ W + b), pooled being what the same trunk gives without it.
  rep = _materialize(lambda: models.get_model("vit_demo", num_classes=4, rngs=nnx.Rngs(0),
                                              pre_logits=True))
  plain = nnx.clone(rep)
  plain.pre_logits = None
  x = _images(2, 32)
  pooled, feats, logits = nnx.jit(
      lambda a, b, v: (a.features(v), b.features(v), b(v)))(plain, rep, x)
  w = _pure(rep.pre_logits)
  np.testing.assert_allclose(feats, np.tanh(np.asarray(pooled, np.float64) @ w["kernel"]
                                            + w["bias"]), rtol=1e-4, atol=1e-5)
  head = _pure(rep.head)
  np.testing.assert_allclose(logits, np.asarray(feats, np.float64) @ head["kernel"]
                             + head["bias"], rtol=1e-4, atol=1e-5)


# --- the registry and `features` ------------------------------------------------------------


def test_design_names_are_registered():
  names = set(models.list_models())
  want = {"resnet18", "resnet50", "resnet101", "resnet152", "resnext50_32x4d",
          "resnext101_32x4d", "resnext101_32x8d", "resnext101_32x16d", "resnext101_32x48d",
          "regnety_8gf", "regnety_16gf", "regnety_32gf", "regnety_128gf"}
  assert want <= names


def test_every_registered_model_has_features():
  """Dedup and linear probes call model.features(images, train=False) on any model."""
  for name in models.list_models():
    factory = models.base.MODELS.get(name)
    if isinstance(factory, functools.partial):
      cls = factory.func
    else:  # a function building the model (vit_demo): build it abstractly.
      cls = type(_abstract(name, num_classes=3))
    assert callable(getattr(cls, "features", None)), name


def test_mixer_features_feed_the_head():
  from bigpretrain.models import mixer  # pylint: disable=g-import-not-at-top
  model = _materialize(lambda: mixer.MlpMixer(num_classes=3, rngs=nnx.Rngs(0), patch_size=8,
                                              width=16, depth=2, tokens_mlp_dim=8,
                                              channels_mlp_dim=32, image_size=32))
  logits, feats = nnx.jit(lambda m, v: (m(v), m.features(v)))(model, _images(2, 32))
  assert feats.shape == (2, 16)
  head = _pure(model.head)
  np.testing.assert_allclose(logits, np.asarray(feats, np.float64) @ head["kernel"]
                             + head["bias"], rtol=1e-4, atol=1e-4)
