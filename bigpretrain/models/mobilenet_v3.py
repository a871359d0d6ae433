"""MobileNetV3-Large (Howard et al. 2019), width multiplier 1.0, in timm's layout.

Stem 3x3/2 conv (16) + hard-swish; a depthwise-separable block; 14 inverted-residual blocks
(1x1 expand, kxk depthwise, optional squeeze-excite with ReLU and a hard-sigmoid gate,
1x1 linear projection, identity shortcut when shape allows); a 1x1 conv to 960; global
average pooling; a 1x1 conv with bias to 1280 + hard-swish; the linear classifier.
Squeeze-excite widths are 1/4 of the expanded width rounded to a multiple of 8, as in timm.
BatchNorm eps 1e-5; padding symmetric (k // 2).
"""
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from bigpretrain.models import base
from bigpretrain.models import layers

# (kernel, expanded width, out channels, squeeze-excite, activation, stride) per block,
# Table 1 of the paper; 'RE' = ReLU, 'HS' = hard-swish.
_LARGE = (
    (3, 64, 24, False, "RE", 2), (3, 72, 24, False, "RE", 1),
    (5, 72, 40, True, "RE", 2), (5, 120, 40, True, "RE", 1), (5, 120, 40, True, "RE", 1),
    (3, 240, 80, False, "HS", 2), (3, 200, 80, False, "HS", 1), (3, 184, 80, False, "HS", 1),
    (3, 184, 80, False, "HS", 1),
    (3, 480, 112, True, "HS", 1), (3, 672, 112, True, "HS", 1),
    (5, 672, 160, True, "HS", 2), (5, 960, 160, True, "HS", 1), (5, 960, 160, True, "HS", 1),
)
_ACTIVATIONS = {"RE": jax.nn.relu, "HS": jax.nn.hard_swish}
_CONV_NAMES = (None, None, "conv_in", "conv_out")
_DEPTHWISE_NAMES = (None, None, None, "conv_out")


make_divisible = layers.make_divisible


class _Ops:
  """Conv / BatchNorm constructors sharing dtype and rngs."""

  def __init__(self, dtype, param_dtype, rngs):
    self.kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def conv(self, in_ch, out_ch, kernel=1, *, stride=1, groups=1, bias=False):
    names = _DEPTHWISE_NAMES if groups > 1 or in_ch == 3 else _CONV_NAMES
    pad = kernel // 2
    init = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")
    return nnx.Conv(in_ch, out_ch, (kernel, kernel), strides=stride,
                    padding=((pad, pad), (pad, pad)), feature_group_count=groups,
                    use_bias=bias, kernel_init=layers.partitioned(init, names),
                    conv_general_dilated=layers.batch_local_conv, **self.kw)

  def bn(self, ch):
    return layers.BatchNorm(ch, momentum=0.9, epsilon=1e-5, **self.kw)


class SqueezeExcite(nnx.Module):
  """Channel gate: global pool, 1x1 reduce + ReLU, 1x1 expand, hard-sigmoid, multiply."""

  def __init__(self, ch: int, ops: _Ops):
    reduced = make_divisible(ch / 4)
    self.conv_reduce = ops.conv(ch, reduced, bias=True)
    self.conv_expand = ops.conv(reduced, ch, bias=True)

  def __call__(self, x: jax.Array) -> jax.Array:
    s = jnp.mean(x, axis=(1, 2), keepdims=True)
    s = self.conv_expand(jax.nn.relu(self.conv_reduce(s)))
    return x * jax.nn.hard_sigmoid(s)


class DepthwiseSeparable(nnx.Module):
  """First block: 3x3 depthwise + BN + ReLU, 1x1 linear projection + BN, identity shortcut."""

  def __init__(self, ch: int, ops: _Ops):
    self.conv_dw, self.bn1 = ops.conv(ch, ch, 3, groups=ch), ops.bn(ch)
    self.conv_pw, self.bn2 = ops.conv(ch, ch), ops.bn(ch)

  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    ura = not train
    y = jax.nn.relu(self.bn1(self.conv_dw(x), use_running_average=ura))
    return x + self.bn2(self.conv_pw(y), use_running_average=ura)


class InvertedResidual(nnx.Module):
  """1x1 expand, kxk depthwise (stride), optional SE, 1x1 linear projection."""

  def __init__(self, in_ch: int, kernel: int, mid_ch: int, out_ch: int, se: bool,
               activation: str, stride: int, ops: _Ops):
    self.activation = _ACTIVATIONS[activation]
    self.conv_pw, self.bn1 = ops.conv(in_ch, mid_ch), ops.bn(mid_ch)
    self.conv_dw = ops.conv(mid_ch, mid_ch, kernel, stride=stride, groups=mid_ch)
    self.bn2 = ops.bn(mid_ch)
    self.se = SqueezeExcite(mid_ch, ops) if se else None
    self.conv_pwl, self.bn3 = ops.conv(mid_ch, out_ch), ops.bn(out_ch)
    self.has_skip = stride == 1 and in_ch == out_ch

  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    ura = not train
    y = self.activation(self.bn1(self.conv_pw(x), use_running_average=ura))
    y = self.activation(self.bn2(self.conv_dw(y), use_running_average=ura))
    if self.se is not None:
      y = self.se(y)
    y = self.bn3(self.conv_pwl(y), use_running_average=ura)
    return x + y if self.has_skip else y


class MobileNetV3(base.Classifier):
  """MobileNetV3-Large: `model(images, *, train, rng) -> float32 logits [B, C]`."""
  STEM = ("conv_stem", "bn_stem")
  TOP = ("conv_last", "bn_last", "conv_head", "head")  # After the last block.

  def __init__(self, *, num_classes: int, rngs: nnx.Rngs, image_size=224,
               dtype=jnp.float32, param_dtype=jnp.float32, drop_path_rate: float = 0.0,
               num_features: int = 1280, bn_group_size: int = 0):
    if drop_path_rate:
      raise ValueError(f"MobileNetV3 does not implement stochastic depth; got drop_path_rate="
                       f"{drop_path_rate!r} (only 0 is accepted)")
    ops = _Ops(dtype, param_dtype, rngs)
    self.num_classes = num_classes
    self.image_size = image_size  # informational: the network is resolution-agnostic
    self.dtype = dtype
    self.conv_stem, self.bn_stem = ops.conv(3, 16, 3, stride=2), ops.bn(16)
    blocks = [DepthwiseSeparable(16, ops)]
    in_ch = 16
    for kernel, mid_ch, out_ch, se, activation, stride in _LARGE:
      blocks.append(InvertedResidual(in_ch, kernel, mid_ch, out_ch, se, activation, stride, ops))
      in_ch = out_ch
    self.blocks = nnx.List(blocks)
    self.depth = self.num_blocks = len(blocks)
    self.conv_last, self.bn_last = ops.conv(in_ch, 960), ops.bn(960)
    self.conv_head = ops.conv(960, num_features, bias=True)
    self.num_features = num_features
    self.head = layers.classifier_head(num_features, num_classes, param_dtype=param_dtype,
                                       rngs=rngs)
    layers.set_bn_group_size(self, bn_group_size)

  def features(self, images: jax.Array, *, train: bool = False,
               rng: jax.Array | None = None) -> jax.Array:
    """The 1280-d pre-classifier features [B, 1280] in float32."""
    del rng  # nothing stochastic
    ura = not train
    x = jax.nn.hard_swish(self.bn_stem(self.conv_stem(images.astype(self.dtype)),
                                       use_running_average=ura))
    for block in self.blocks:
      x = block(x, train=train)
    x = jax.nn.hard_swish(self.bn_last(self.conv_last(x), use_running_average=ura))
    x = jnp.mean(x, axis=(1, 2), keepdims=True)
    x = jax.nn.hard_swish(self.conv_head(x))
    return x.reshape(x.shape[0], -1).astype(jnp.float32)


VARIANTS = {"mobilenetv3_large_100": functools.partial(MobileNetV3, num_features=1280)}

for _name, _factory in sorted(VARIANTS.items()):
  base.MODELS.register(_name, _factory)
