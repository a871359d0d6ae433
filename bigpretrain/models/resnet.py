"""ResNet v1.5 (He et al. 2016) and ResNeXt (Xie et al. 2017) in torchvision's layout.

BasicBlock (two 3x3 convs; ResNet-18/34) or Bottleneck (1x1, 3x3, 1x1 x4) blocks; the stride
sits on the 3x3 conv (v1.5). ResNeXt is the Bottleneck with a grouped 3x3 conv of `groups`
groups and width int(planes * width_per_group / 64) * groups (torchvision's formula), so
"32x4d" is groups=32, width_per_group=4, and the FB WSL "32x48d" is groups=32,
width_per_group=48.

BatchNorm runs on batch statistics when train=True (updating the nnx.BatchStat running
averages, momentum 0.9 in Flax terms = 0.1 in PyTorch terms) and on the running averages
otherwise. Under jit with a sharded batch the statistics are those of the global batch;
bn_group_size=N takes them per group of N rows instead, as a trainer without synchronised BN
does with N images per GPU (layers.BatchNorm; the semi-supervised recipe's 24).
Init: convs He-normal (fan_out), the last BatchNorm scale of every residual branch zero
(Goyal et al. 2017, so each block starts as the identity; zero_init_residual=False gives
torchvision's default of one), zero head.
Padding is symmetric (k // 2), as in torchvision, so PyTorch weights would give equal outputs.

Stochastic depth (drop_path_rate; cosub supplement Table B.1 trains ResNet-152 and RegNet-16GF
with cosub): each block's residual branch is zeroed per sample with its rate (drop_path_schedule
'linear', timm's per-block rule, or 'uniform', cosub's) and the kept rows scaled by 1 / (1 -
rate), before the sum and its ReLU; the shortcut is never dropped. Only the masked form:
efficient stochastic depth would run the branch's BatchNorms on a row subset, changing their
batch statistics.
"""
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from bigpretrain.models import base
from bigpretrain.models import layers

# Grouped kernels too: their per-group input dim splits over FSDP like any other (the kernel
# is gathered whole before the conv).
_CONV_NAMES = (None, None, "conv_in", "conv_out")


def conv(in_ch, out_ch, kernel, *, stride=1, groups=1, dtype, param_dtype, rngs,
         names=_CONV_NAMES):
  """Bias-free conv with symmetric k // 2 padding, He-normal (fan_out) init; grouped ones
  run per batch shard (layers.batch_local_conv)."""
  pad = kernel // 2
  init = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")
  return nnx.Conv(in_ch, out_ch, (kernel, kernel), strides=stride,
                  padding=((pad, pad), (pad, pad)), feature_group_count=groups,
                  use_bias=False, kernel_init=layers.partitioned(init, names), dtype=dtype,
                  param_dtype=param_dtype, rngs=rngs,
                  conv_general_dilated=layers.batch_local_conv)


def residual_sum(x: jax.Array, y: jax.Array, rate: float, train: bool,
                 rng: jax.Array | None) -> jax.Array:
  """relu(x + DP(y)): the residual branch y stochastically dropped per sample when training."""
  if train and rate > 0.0:
    y = layers.drop_path(y, rate, rng)
  return jax.nn.relu(x + y)


def check_convnet_stochastic_depth(stochastic_depth: str) -> None:
  if layers.check_stochastic_depth_mode(stochastic_depth) != "mask":
    raise ValueError(f"stochastic_depth={stochastic_depth!r}: convnets take 'mask' only "
                     "(efficient stochastic depth would run the branch's BatchNorms on a row "
                     "subset and change their batch statistics).")


def batch_norm(ch, *, dtype, param_dtype, rngs, zero_scale=False):
  """BatchNorm with PyTorch's momentum (0.1 = Flax 0.9) and eps (1e-5). Its running variance
  averages the biased batch variance where PyTorch's averages the unbiased one (n / (n - 1)
  times it: negligible at a training batch's n)."""
  return layers.BatchNorm(ch, momentum=0.9, epsilon=1e-5, dtype=dtype, param_dtype=param_dtype,
                          scale_init=(nnx.initializers.zeros if zero_scale
                                      else nnx.initializers.ones),
                          rngs=rngs)


class BasicBlock(nnx.Module):
  """3x3 (carrying the stride), 3x3; projection shortcut when the shape changes."""

  expansion = 1

  def __init__(self, in_ch: int, planes: int, *, stride: int, dtype, param_dtype,
               rngs: nnx.Rngs, zero_init_residual: bool = True, drop_path_rate: float = 0.0):
    self.drop_path_rate = float(drop_path_rate)
    out_ch = planes * self.expansion
    cv = functools.partial(conv, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    bn = functools.partial(batch_norm, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.conv1, self.bn1 = cv(in_ch, planes, 3, stride=stride), bn(planes)
    self.conv2, self.bn2 = cv(planes, out_ch, 3), bn(out_ch, zero_scale=zero_init_residual)
    if stride != 1 or in_ch != out_ch:
      self.downsample_conv = cv(in_ch, out_ch, 1, stride=stride)
      self.downsample_bn = bn(out_ch)
    else:
      self.downsample_conv = self.downsample_bn = None

  def __call__(self, x: jax.Array, *, train: bool, rng: jax.Array | None = None) -> jax.Array:
    ura = not train
    y = jax.nn.relu(self.bn1(self.conv1(x), use_running_average=ura))
    y = self.bn2(self.conv2(y), use_running_average=ura)
    if self.downsample_conv is not None:
      x = self.downsample_bn(self.downsample_conv(x), use_running_average=ura)
    return residual_sum(x, y, self.drop_path_rate, train, rng)


class Bottleneck(nnx.Module):
  """1x1 reduce, 3x3 (grouped for ResNeXt, carrying the stride), 1x1 expand to planes x4;
  projection shortcut when the shape changes."""

  expansion = 4

  def __init__(self, in_ch: int, planes: int, *, stride: int, dtype, param_dtype,
               rngs: nnx.Rngs, groups: int = 1, width_per_group: int = 64,
               zero_init_residual: bool = True, drop_path_rate: float = 0.0):
    self.drop_path_rate = float(drop_path_rate)
    width = int(planes * (width_per_group / 64.0)) * groups
    out_ch = planes * self.expansion
    cv = functools.partial(conv, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    bn = functools.partial(batch_norm, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.conv1, self.bn1 = cv(in_ch, width, 1), bn(width)
    self.conv2, self.bn2 = cv(width, width, 3, stride=stride, groups=groups), bn(width)
    self.conv3, self.bn3 = cv(width, out_ch, 1), bn(out_ch, zero_scale=zero_init_residual)
    if stride != 1 or in_ch != out_ch:
      self.downsample_conv = cv(in_ch, out_ch, 1, stride=stride)
      self.downsample_bn = bn(out_ch)
    else:
      self.downsample_conv = self.downsample_bn = None

  def __call__(self, x: jax.Array, *, train: bool, rng: jax.Array | None = None) -> jax.Array:
    ura = not train
    y = jax.nn.relu(self.bn1(self.conv1(x), use_running_average=ura))
    y = jax.nn.relu(self.bn2(self.conv2(y), use_running_average=ura))
    y = self.bn3(self.conv3(y), use_running_average=ura)
    if self.downsample_conv is not None:
      x = self.downsample_bn(self.downsample_conv(x), use_running_average=ura)
    return residual_sum(x, y, self.drop_path_rate, train, rng)


_BLOCKS = {"basic": BasicBlock, "bottleneck": Bottleneck}


class ResNet(base.Classifier):
  """ResNet / ResNeXt classifier: `model(images, *, train, rng) -> float32 logits [B, C]`.

  `block` is 'basic' or 'bottleneck'; `groups` and `width_per_group` (ResNeXt) apply to the
  bottleneck only, as in torchvision.
  """
  STEM = ("stem_conv", "stem_bn")

  def __init__(self, *, num_classes: int, rngs: nnx.Rngs, stage_sizes: tuple[int, ...],
               block: str = "bottleneck", groups: int = 1, width_per_group: int = 64,
               image_size=224, dtype=jnp.float32, param_dtype=jnp.float32,
               drop_path_rate: float = 0.0, drop_path_schedule: str = "linear",
               stochastic_depth: str = "mask", zero_init_residual: bool = True,
               bn_group_size: int = 0):
    check_convnet_stochastic_depth(stochastic_depth)
    if block not in _BLOCKS:
      raise ValueError(f"block must be one of {sorted(_BLOCKS)}, got {block!r}")
    if groups < 1 or width_per_group < 1:
      raise ValueError(f"groups and width_per_group must be >= 1, got {groups}, "
                       f"{width_per_group}")
    if block == "basic" and (groups, width_per_group) != (1, 64):
      raise ValueError("the basic block supports only groups=1 and width_per_group=64 "
                       f"(as torchvision); got {groups}, {width_per_group}")
    block_cls = _BLOCKS[block]
    block_kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                    zero_init_residual=zero_init_residual)
    if block == "bottleneck":
      block_kw.update(groups=groups, width_per_group=width_per_group)
    self.num_classes = num_classes
    self.image_size = image_size  # informational: the network is resolution-agnostic
    self.dtype = dtype
    # The stem sees 3 input channels, too few to shard: its input dim stays replicated.
    self.stem_conv = conv(3, 64, 7, stride=2, dtype=dtype, param_dtype=param_dtype,
                          rngs=rngs, names=(None, None, None, "conv_out"))
    self.stem_bn = batch_norm(64, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    blocks = []
    in_ch = 64
    self.drop_path_rates = layers.drop_path_rates(drop_path_rate, sum(stage_sizes),
                                                  drop_path_schedule)
    for stage, num in enumerate(stage_sizes):
      planes = 64 * 2**stage
      for i in range(num):
        stride = 2 if (i == 0 and stage > 0) else 1
        blocks.append(block_cls(in_ch, planes, stride=stride,
                                drop_path_rate=self.drop_path_rates[len(blocks)], **block_kw))
        in_ch = planes * block_cls.expansion
    self.blocks = nnx.List(blocks)
    self.depth = self.num_blocks = len(blocks)
    self.num_features = in_ch
    self.head = layers.classifier_head(in_ch, num_classes, param_dtype=param_dtype, rngs=rngs)
    layers.set_bn_group_size(self, bn_group_size)

  def features(self, images: jax.Array, *, train: bool = False,
               rng: jax.Array | None = None) -> jax.Array:
    """Globally average-pooled final features [B, num_features] in float32 (head input)."""
    layers.check_rng(train, self.drop_path_rates, rng, "ResNet")
    x = self.stem_bn(self.stem_conv(images.astype(self.dtype)), use_running_average=not train)
    x = jax.nn.relu(x)
    x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    for i, block in enumerate(self.blocks):
      x = block(x, train=train, rng=layers.fold_rng(rng, i))
    return jnp.mean(x.astype(jnp.float32), axis=(1, 2))


def _resnext(stage_sizes, groups, width_per_group):
  return functools.partial(ResNet, stage_sizes=stage_sizes, block="bottleneck", groups=groups,
                           width_per_group=width_per_group)


VARIANTS = {
    "resnet18": functools.partial(ResNet, stage_sizes=(2, 2, 2, 2), block="basic"),
    "resnet50": functools.partial(ResNet, stage_sizes=(3, 4, 6, 3)),
    "resnet101": functools.partial(ResNet, stage_sizes=(3, 4, 23, 3)),
    "resnet152": functools.partial(ResNet, stage_sizes=(3, 8, 36, 3)),
    "resnext50_32x4d": _resnext((3, 4, 6, 3), 32, 4),
    # ResNeXt-101 32xCd, C in {4, 8, 16, 48}: the students and teachers of Yalniz et al. 2019
    # (section 4); 32x48d is Mahajan et al. 2018's WSL model, the rest as in torchvision.
    "resnext101_32x4d": _resnext((3, 4, 23, 3), 32, 4),
    "resnext101_32x8d": _resnext((3, 4, 23, 3), 32, 8),
    "resnext101_32x16d": _resnext((3, 4, 23, 3), 32, 16),
    "resnext101_32x48d": _resnext((3, 4, 23, 3), 32, 48),
}

for _name, _factory in sorted(VARIANTS.items()):
  base.MODELS.register(_name, _factory)
