"""RegNetY (Radosavovic et al. 2020) in the torchvision / ClassyVision layout SWAG uses.

Stages come from the RegNet parameters (depth, w_0, w_a, w_m, group width) exactly as
torchvision's BlockParams.from_init_params derives them: per-block widths
u_j = w_0 + w_a * j, quantised to w_0 * w_m^round(log(u_j / w_0) / log(w_m)) rounded to a
multiple of 8; runs of equal width form the stages (each starting with stride 2); each stage
width is then made divisible by its group width (min(group width, stage width)) with
torchvision's _make_divisible (nearest multiple, never 10% below). ClassyVision / pycls
round to the nearest multiple instead: the same stages for SWAG's 16/32/128GF, but for 8GF
a first stage of 168 channels where torchvision has 224; we follow torchvision throughout
(its 39,381,472-parameter 8GF).

Stem: 3x3 stride-2 conv to 32 channels, BatchNorm, ReLU. Blocks (ResBottleneckBlock,
bottleneck ratio 1): 1x1 conv, 3x3 grouped conv (width / group_width groups, carrying the
stride), Squeeze-Excitation, 1x1 conv, each conv followed by BatchNorm (ReLU after the
first two); projection shortcut (1x1 conv + BN) when the width or resolution changes; ReLU
after the sum. The SE squeeze width is int(round(se_ratio * the block's INPUT width)), not of
the bottleneck width (torchvision, ClassyVision and SWAG all do this). Global average
pooling and a linear head. BatchNorm as in resnet.py (PyTorch defaults). Synchronised BN
(SWAG, appendix B) needs no code: the trainer's jit sees the global batch array, so the
batch mean/variance are reductions over the whole batch that XLA turns into cross-device
all-reduces over the data axis (tests/test_swag.py checks outputs and running statistics of
an 8-device step against one device on the whole batch, and that per-device statistics
differ).

Stochastic depth on each block's residual branch (drop_path_rate, drop_path_schedule; masked
only) as resnet.py, for cosub (supplement Table B.1: RegNet-16GF).

Init: convs He-normal (fan_out) as torchvision, SE biases zero, zero head, and the last
BatchNorm scale of each block zero (zero_init_residual, as for our ResNets; SWAG's released
code initialises it to one: pass zero_init_residual=False for that).
"""
import functools
import itertools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from bigpretrain.models import base
from bigpretrain.models import layers
from bigpretrain.models import resnet

_QUANT = 8  # block widths are multiples of 8


def regnet_stages(depth: int, w_0: int, w_a: float, w_m: float,
                  group_width: int) -> tuple[tuple[int, int, int], ...]:
  """(width, depth, group width) per stage, as torchvision's BlockParams.from_init_params
  computes them for a bottleneck ratio of 1."""
  if depth < 1 or group_width < 1:
    raise ValueError(f"RegNet depth and group_width must be >= 1, got {depth}, {group_width}")
  if w_a < 0 or w_0 <= 0 or w_m <= 1 or w_0 % _QUANT:
    raise ValueError(f"invalid RegNet parameters w_0={w_0}, w_a={w_a}, w_m={w_m}: need "
                     f"w_a >= 0, w_m > 1 and w_0 a positive multiple of {_QUANT}")
  widths = []
  for j in range(depth):
    capacity = round(math.log((j * w_a + w_0) / w_0) / math.log(w_m))
    widths.append(int(round(w_0 * w_m**capacity / _QUANT) * _QUANT))
  stages = []
  for width, run in itertools.groupby(widths):
    gw = min(group_width, width)
    stages.append((layers.make_divisible(width, gw), len(list(run)), gw))
  return tuple(stages)


class SqueezeExcite(nnx.Module):
  """Channel gate: global average pool, 1x1 conv + ReLU, 1x1 conv, sigmoid, multiply."""

  def __init__(self, ch: int, squeeze: int, *, dtype, param_dtype, rngs: nnx.Rngs):
    init = layers.partitioned(nnx.initializers.variance_scaling(2.0, "fan_out", "normal"),
                              (None, None, "conv_in", "conv_out"))
    # Through batch_local_conv like every conv here: under a tensor axis the gate's
    # activations must stay split by rows (see its docstring).
    conv = functools.partial(nnx.Conv, kernel_size=(1, 1), kernel_init=init, dtype=dtype,
                             param_dtype=param_dtype, rngs=rngs,
                             conv_general_dilated=layers.batch_local_conv)
    self.fc1 = conv(ch, squeeze)
    self.fc2 = conv(squeeze, ch)

  def __call__(self, x: jax.Array) -> jax.Array:
    s = jnp.mean(x, axis=(1, 2), keepdims=True)
    return x * jax.nn.sigmoid(self.fc2(jax.nn.relu(self.fc1(s))))


class ResBottleneckBlock(nnx.Module):
  """x + F(x) (or proj(x) + F(x)), F = 1x1, 3x3 grouped [+ SE], 1x1; then ReLU."""

  def __init__(self, in_ch: int, out_ch: int, *, stride: int, group_width: int,
               se_ratio: float | None, dtype, param_dtype, rngs: nnx.Rngs,
               zero_init_residual: bool = True, drop_path_rate: float = 0.0):
    self.drop_path_rate = float(drop_path_rate)
    if out_ch % group_width:
      raise ValueError(f"block width {out_ch} is not divisible by group_width {group_width}")
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    cv = functools.partial(resnet.conv, **kw)
    bn = functools.partial(resnet.batch_norm, **kw)
    self.conv_a, self.bn_a = cv(in_ch, out_ch, 1), bn(out_ch)
    self.conv_b = cv(out_ch, out_ch, 3, stride=stride, groups=out_ch // group_width)
    self.bn_b = bn(out_ch)
    self.se = (SqueezeExcite(out_ch, int(round(se_ratio * in_ch)), **kw) if se_ratio
               else None)
    self.conv_c, self.bn_c = cv(out_ch, out_ch, 1), bn(out_ch, zero_scale=zero_init_residual)
    if stride != 1 or in_ch != out_ch:
      self.proj_conv, self.proj_bn = cv(in_ch, out_ch, 1, stride=stride), bn(out_ch)
    else:
      self.proj_conv = self.proj_bn = None

  def __call__(self, x: jax.Array, *, train: bool, rng: jax.Array | None = None) -> jax.Array:
    ura = not train
    y = jax.nn.relu(self.bn_a(self.conv_a(x), use_running_average=ura))
    y = jax.nn.relu(self.bn_b(self.conv_b(y), use_running_average=ura))
    if self.se is not None:
      y = self.se(y)
    y = self.bn_c(self.conv_c(y), use_running_average=ura)
    if self.proj_conv is not None:
      x = self.proj_bn(self.proj_conv(x), use_running_average=ura)
    return resnet.residual_sum(x, y, self.drop_path_rate, train, rng)


class RegNet(base.Classifier):
  """RegNet classifier: `model(images, *, train, rng) -> float32 logits [B, C]`.

  `depth, w_0, w_a, w_m, group_width` are the RegNet parameters (regnet_stages);
  se_ratio 0.25 makes a RegNetY, None a RegNetX.
  """
  STEM = ("stem_conv", "stem_bn")

  def __init__(self, *, num_classes: int, rngs: nnx.Rngs, depth: int, w_0: int, w_a: float,
               w_m: float, group_width: int, se_ratio: float | None = 0.25,
               stem_width: int = 32, image_size=224, dtype=jnp.float32,
               param_dtype=jnp.float32, drop_path_rate: float = 0.0,
               drop_path_schedule: str = "linear", stochastic_depth: str = "mask",
               zero_init_residual: bool = True, bn_group_size: int = 0):
    resnet.check_convnet_stochastic_depth(stochastic_depth)
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.num_classes = num_classes
    self.image_size = image_size  # informational: the network is resolution-agnostic
    self.dtype = dtype
    self.stages = regnet_stages(depth, w_0, w_a, w_m, group_width)
    self.stem_conv = resnet.conv(3, stem_width, 3, stride=2,
                                 names=(None, None, None, "conv_out"), **kw)
    self.stem_bn = resnet.batch_norm(stem_width, **kw)
    blocks = []
    in_ch = stem_width
    self.drop_path_rates = layers.drop_path_rates(
        drop_path_rate, sum(num for _, num, _ in self.stages), drop_path_schedule)
    for width, num, gw in self.stages:
      for i in range(num):
        blocks.append(ResBottleneckBlock(in_ch, width, stride=2 if i == 0 else 1,
                                         group_width=gw, se_ratio=se_ratio,
                                         zero_init_residual=zero_init_residual,
                                         drop_path_rate=self.drop_path_rates[len(blocks)],
                                         **kw))
        in_ch = width
    self.blocks = nnx.List(blocks)
    self.depth = self.num_blocks = len(blocks)
    self.num_features = in_ch
    self.head = layers.classifier_head(in_ch, num_classes, param_dtype=param_dtype, rngs=rngs)
    layers.set_bn_group_size(self, bn_group_size)

  def features(self, images: jax.Array, *, train: bool = False,
               rng: jax.Array | None = None) -> jax.Array:
    """Globally average-pooled final features [B, num_features] in float32 (head input)."""
    layers.check_rng(train, self.drop_path_rates, rng, "RegNet")
    x = self.stem_bn(self.stem_conv(images.astype(self.dtype)), use_running_average=not train)
    # Activations stay split by rows under FSDP (see layers.constrain_batch).
    x = layers.constrain_batch(jax.nn.relu(x))
    for i, block in enumerate(self.blocks):
      x = layers.constrain_batch(block(x, train=train, rng=layers.fold_rng(rng, i)))
    return jnp.mean(x.astype(jnp.float32), axis=(1, 2))


# (depth, w_0, w_a, w_m, group_width) of torchvision's regnet_y_* (pycls RegNetY-*); the
# 128GF one is SWAG's (torchvision's regnet_y_128gf, which carries SWAG's weights).
# 400MF is a small member of the family for CPU demos.
_REGNETY = {
    "regnety_400mf": (16, 48, 27.89, 2.09, 8),
    "regnety_8gf": (17, 192, 76.82, 2.19, 56),
    "regnety_16gf": (18, 200, 106.23, 2.48, 112),
    "regnety_32gf": (20, 232, 115.89, 2.53, 232),
    "regnety_128gf": (27, 456, 160.83, 2.52, 264),
}

VARIANTS = {
    name: functools.partial(RegNet, depth=d, w_0=w0, w_a=wa, w_m=wm, group_width=gw,
                            se_ratio=0.25, stem_width=32)
    for name, (d, w0, wa, wm, gw) in _REGNETY.items()
}
# A 6-block RegNetY for the CPU demo configs: stages (32, 1), (64, 2), (128, 3), group width
# 64. XLA's CPU gradients of many-group convolutions are slow (regnety_400mf, 8-channel
# groups: ~14 s per 64-image 32x32 step on 2 cores; this model: ~0.25 s).
VARIANTS["regnety_demo"] = functools.partial(RegNet, depth=6, w_0=32, w_a=24.0, w_m=2.0,
                                           group_width=64, se_ratio=0.25, stem_width=16)

for _name, _factory in sorted(VARIANTS.items()):
  base.MODELS.register(_name, _factory)
