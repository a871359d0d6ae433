"""ResNet v1.5 (He et al. 2016; torchvision layout: the stride sits on the 3x3 conv).

BatchNorm runs on batch statistics when train=True (updating the nnx.BatchStat running
averages, momentum 0.9 in Flax terms = 0.1 in PyTorch terms) and on the running averages
otherwise. Under jit with a sharded batch the statistics are those of the global batch.
Init: convs He-normal (fan_out), the last BatchNorm scale of every residual branch zero
(Goyal et al. 2017, so each block starts as the identity), zero head.
Padding is symmetric (k // 2), as in torchvision, so PyTorch weights would give equal outputs.
"""
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from bigpretrain.models import layers

_CONV_NAMES = (None, None, "conv_in", "conv_out")


def _conv(in_ch, out_ch, kernel, *, stride=1, dtype, param_dtype, rngs, names=_CONV_NAMES):
  pad = kernel // 2
  init = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")
  return nnx.Conv(in_ch, out_ch, (kernel, kernel), strides=stride,
                  padding=((pad, pad), (pad, pad)), use_bias=False,
                  kernel_init=layers.partitioned(init, names), dtype=dtype,
                  param_dtype=param_dtype, rngs=rngs)


def _batch_norm(ch, *, dtype, param_dtype, rngs, zero_scale=False):
  return nnx.BatchNorm(ch, momentum=0.9, epsilon=1e-5, dtype=dtype, param_dtype=param_dtype,
                       scale_init=nnx.initializers.zeros if zero_scale else nnx.initializers.ones,
                       rngs=rngs)


class Bottleneck(nnx.Module):
  """1x1 reduce, 3x3 (carrying the stride), 1x1 expand x4; projection shortcut when needed."""

  expansion = 4

  def __init__(self, in_ch: int, width: int, *, stride: int, dtype, param_dtype,
               rngs: nnx.Rngs):
    out_ch = width * self.expansion
    conv = functools.partial(_conv, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    bn = functools.partial(_batch_norm, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.conv1, self.bn1 = conv(in_ch, width, 1), bn(width)
    self.conv2, self.bn2 = conv(width, width, 3, stride=stride), bn(width)
    self.conv3, self.bn3 = conv(width, out_ch, 1), bn(out_ch, zero_scale=True)
    if stride != 1 or in_ch != out_ch:
      self.downsample_conv = conv(in_ch, out_ch, 1, stride=stride)
      self.downsample_bn = bn(out_ch)
    else:
      self.downsample_conv = self.downsample_bn = None

  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    ura = not train
    y = jax.nn.relu(self.bn1(self.conv1(x), use_running_average=ura))
    y = jax.nn.relu(self.bn2(self.conv2(y), use_running_average=ura))
    y = self.bn3(self.conv3(y), use_running_average=ura)
    if self.downsample_conv is not None:
      x = self.downsample_bn(self.downsample_conv(x), use_running_average=ura)
    return jax.nn.relu(x + y)


class ResNet(nnx.Module):
  """Bottleneck ResNet classifier: `model(images, *, train, rng) -> float32 logits [B, C]`."""

  def __init__(self, *, num_classes: int, rngs: nnx.Rngs, stage_sizes: tuple[int, ...],
               image_size=224, dtype=jnp.float32, param_dtype=jnp.float32,
               drop_path_rate: float = 0.0):
    if drop_path_rate:
      raise ValueError(f"ResNet does not implement stochastic depth; got drop_path_rate="
                       f"{drop_path_rate!r} (only 0 is accepted)")
    self.num_classes = num_classes
    self.image_size = image_size  # informational: the network is resolution-agnostic
    self.dtype = dtype
    # The stem sees 3 input channels, too few to shard: its input dim stays replicated.
    self.stem_conv = _conv(3, 64, 7, stride=2, dtype=dtype, param_dtype=param_dtype,
                           rngs=rngs, names=(None, None, None, "conv_out"))
    self.stem_bn = _batch_norm(64, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    blocks = []
    in_ch = 64
    for stage, num in enumerate(stage_sizes):
      width = 64 * 2**stage
      for i in range(num):
        stride = 2 if (i == 0 and stage > 0) else 1
        blocks.append(Bottleneck(in_ch, width, stride=stride, dtype=dtype,
                                 param_dtype=param_dtype, rngs=rngs))
        in_ch = width * Bottleneck.expansion
    self.blocks = nnx.List(blocks)
    self.depth = self.num_blocks = len(blocks)
    self.num_features = in_ch
    self.head = layers.classifier_head(in_ch, num_classes, param_dtype=param_dtype, rngs=rngs)

  def features(self, images: jax.Array, *, train: bool = False,
               rng: jax.Array | None = None) -> jax.Array:
    """Globally average-pooled final features [B, 2048] in float32."""
    del rng  # nothing stochastic
    x = self.stem_bn(self.stem_conv(images.astype(self.dtype)), use_running_average=not train)
    x = jax.nn.relu(x)
    x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    for block in self.blocks:
      x = block(x, train=train)
    return jnp.mean(x.astype(jnp.float32), axis=(1, 2))

  def __call__(self, images: jax.Array, *, train: bool = False,
               rng: jax.Array | None = None) -> jax.Array:
    return self.head(self.features(images, train=train, rng=rng))


MODELS = {
    "resnet50": functools.partial(ResNet, stage_sizes=(3, 4, 6, 3)),
    "resnet101": functools.partial(ResNet, stage_sizes=(3, 4, 23, 3)),
    "resnet152": functools.partial(ResNet, stage_sizes=(3, 8, 36, 3)),
}
