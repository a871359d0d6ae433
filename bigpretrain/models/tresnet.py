"""TResNet-M / TResNet-L (Ridnik et al., "TResNet: High Performance GPU-Dedicated
Architecture", WACV 2021) in timm's layout (timm/models/tresnet.py), backbones of the
ImageNet-21K paper (Ridnik et al. 2021, Table 4).

Stem: SpaceToDepth (each 4x4 patch stacked into 48 channels, no strided conv), then a 3x3
conv + BN + leaky ReLU (slope 1e-2) to `planes` = int(64 * width_factor) channels.
Stages 1-2 are BasicBlocks (3x3, 3x3), stages 3-4 Bottlenecks (1x1, 3x3, 1x1 x4), with
planes x1, x2, x4, x8 and stride 1, 2, 2, 2. Inside a block every conv is followed by BN
and leaky ReLU (slope 1e-3), except the last one (BN only); ReLU after the residual sum.
Anti-aliased downsampling: a stride-2 block runs its 3x3 conv at stride 1, then BN + act,
then a blur pool (reflect-pad 1, [1,2,1] x [1,2,1] / 16 depthwise filter, stride 2); the
shortcut is a 2x2 average pool (ceil mode, padding not counted) then 1x1 conv + BN.
Squeeze-Excitation in stages 1-3 (none in stage 4): after the last conv of a BasicBlock with
max(planes // 4, 64) squeeze channels, after the 3x3 of a Bottleneck with
max(planes * 4 // 8, 64). Global average pooling, linear head.
Inplace-ABN (the paper's fused BN + activation) is plain BatchNorm followed by the
activation, as timm does; timm's converter maps an ABN weight w to |w| + 1e-5 (ABN may
store negative scales).

BatchNorm as in resnet.py (PyTorch defaults; global-batch statistics under a sharded jit).
Init as timm: convs He-normal (fan_out), the last BN scale of every residual branch zero
(zero_init_residual=False gives one), SE biases zero; the head is zero like every model here
(timm draws it from N(0, 0.01)).

Parameter names mirror timm's state dict so that a converter maps them one to one:
timm `body.<rest>` is our `<rest>` (`body.conv1.conv.weight` -> `conv1/conv/kernel`,
`body.layer3.0.conv2.bn.running_var` -> `layer3/0/conv2/bn/var`), timm `downsample.1.`
(index 0 is the parameter-free average pool) is our `downsample.`, `head.fc.` is `head.`;
leaves: conv / SE `weight` [O, I, kh, kw] -> `kernel` [kh, kw, I, O] (transpose 2, 3, 1, 0),
`head.fc.weight` [C, F] -> `head/kernel` [F, C], BN `weight` / `bias` / `running_mean` /
`running_var` -> `scale` / `bias` / `mean` / `var`, biases unchanged. SpaceToDepth orders
its channels (row in patch, column in patch, input channel), as timm's, so the stem conv
needs no channel permutation.
"""
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from bigpretrain.models import base
from bigpretrain.models import layers
from bigpretrain.models import regnet
from bigpretrain.models import resnet

BLOCK_SLOPE = 1e-3  # leaky ReLU inside blocks (timm: LeakyReLU(negative_slope=1e-3))
STEM_SLOPE = 1e-2  # leaky ReLU of the stem conv (nn.LeakyReLU's default, as the original)
_SPACE_TO_DEPTH = 4


def space_to_depth(x: jax.Array, block: int = _SPACE_TO_DEPTH) -> jax.Array:
  """[B, H, W, C] -> [B, H / block, W / block, block * block * C], channels ordered
  (row in the block, column in the block, input channel) as timm's SpaceToDepth."""
  b, h, w, c = x.shape
  if h % block or w % block:
    raise ValueError(f"TResNet's SpaceToDepth stem needs image height and width divisible "
                     f"by {block}; got {h}x{w}")
  x = x.reshape(b, h // block, block, w // block, block, c)
  x = x.transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, h // block, w // block, block * block * c)


def blur_pool(x: jax.Array) -> jax.Array:
  """Anti-aliased stride-2 downsampling of [B, H, W, C]: reflect-pad 1, depthwise filter
  [1,2,1] x [1,2,1] / 16, stride 2 (timm's BlurPool2d with filt_size=3) -> ceil(H / 2)."""
  p = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="reflect")
  ho, wo = (x.shape[1] + 1) // 2, (x.shape[2] + 1) // 2
  # The 3x3 binomial filter is separable: [1,2,1]/4 along H, then along W.
  p = (p[:, 0:2 * ho:2] + 2 * p[:, 1:2 * ho:2] + p[:, 2:2 * ho + 1:2]) / 4
  return (p[:, :, 0:2 * wo:2] + 2 * p[:, :, 1:2 * wo:2] + p[:, :, 2:2 * wo + 1:2]) / 4


def avg_pool_2x2(x: jax.Array) -> jax.Array:
  """2x2 stride-2 average pool with ceil mode, padding not counted (the shortcut's pool)."""
  pad = ((0, x.shape[1] % 2), (0, x.shape[2] % 2))
  return nnx.avg_pool(x, (2, 2), strides=(2, 2), padding=pad, count_include_pad=False)


class ConvNormAct(nnx.Module):
  """Bias-free conv, BatchNorm, optional leaky ReLU, optional blur pool (timm ConvNormActAa).

  With `blur`, the conv runs at stride 1 and the blur pool does the stride-2 downsampling.
  """

  def __init__(self, in_ch: int, out_ch: int, kernel: int, *, slope: float | None,
               blur: bool = False, zero_scale: bool = False, dtype, param_dtype,
               rngs: nnx.Rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.conv = resnet.conv(in_ch, out_ch, kernel, **kw)
    self.bn = resnet.batch_norm(out_ch, zero_scale=zero_scale, **kw)
    self.slope = slope
    self.blur = blur

  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    x = self.bn(self.conv(x), use_running_average=not train)
    if self.slope is not None:
      x = jax.nn.leaky_relu(x, self.slope)
    return blur_pool(x) if self.blur else x


class Shortcut(ConvNormAct):
  """Projection shortcut: 2x2 average pool when strided, then 1x1 conv + BN (no act)."""

  def __init__(self, in_ch: int, out_ch: int, *, stride: int, **kw):
    super().__init__(in_ch, out_ch, 1, slope=None, **kw)
    self.stride = stride

  @classmethod
  def maybe(cls, in_ch: int, out_ch: int, *, stride: int, **kw):
    """The shortcut a block needs: None (identity) unless the shape changes."""
    return None if stride == 1 and in_ch == out_ch else cls(in_ch, out_ch, stride=stride, **kw)

  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    return super().__call__(avg_pool_2x2(x) if self.stride == 2 else x, train=train)


class BasicBlock(nnx.Module):
  """3x3 (+ blur when strided), 3x3 (BN only), SE; shortcut; ReLU after the sum."""

  expansion = 1

  def __init__(self, in_ch: int, planes: int, *, stride: int, use_se: bool, dtype,
               param_dtype, rngs: nnx.Rngs, zero_init_residual: bool = True):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.conv1 = ConvNormAct(in_ch, planes, 3, slope=BLOCK_SLOPE, blur=stride == 2, **kw)
    self.conv2 = ConvNormAct(planes, planes, 3, slope=None, zero_scale=zero_init_residual,
                             **kw)
    self.se = regnet.SqueezeExcite(planes, max(planes // 4, 64), **kw) if use_se else None
    self.downsample = Shortcut.maybe(in_ch, planes, stride=stride, **kw)

  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    y = self.conv2(self.conv1(x, train=train), train=train)
    if self.se is not None:
      y = self.se(y)
    shortcut = x if self.downsample is None else self.downsample(x, train=train)
    return jax.nn.relu(shortcut + y)


class Bottleneck(nnx.Module):
  """1x1, 3x3 (+ blur when strided), SE, 1x1 to planes x4 (BN only); shortcut; ReLU."""

  expansion = 4

  def __init__(self, in_ch: int, planes: int, *, stride: int, use_se: bool, dtype,
               param_dtype, rngs: nnx.Rngs, zero_init_residual: bool = True):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    out_ch = planes * self.expansion
    self.conv1 = ConvNormAct(in_ch, planes, 1, slope=BLOCK_SLOPE, **kw)
    self.conv2 = ConvNormAct(planes, planes, 3, slope=BLOCK_SLOPE, blur=stride == 2, **kw)
    self.se = (regnet.SqueezeExcite(planes, max(out_ch // 8, 64), **kw) if use_se
               else None)
    self.conv3 = ConvNormAct(planes, out_ch, 1, slope=None, zero_scale=zero_init_residual,
                             **kw)
    self.downsample = Shortcut.maybe(in_ch, out_ch, stride=stride, **kw)

  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    y = self.conv2(self.conv1(x, train=train), train=train)
    if self.se is not None:
      y = self.se(y)
    y = self.conv3(y, train=train)
    shortcut = x if self.downsample is None else self.downsample(x, train=train)
    return jax.nn.relu(shortcut + y)


class TResNet(base.Classifier):
  """TResNet classifier: `model(images, *, train, rng) -> float32 logits [B, C]`.

  `stage_sizes` are the blocks per stage; `width_factor` scales the base width 64
  (planes = int(64 * width_factor), as timm). Images need height and width divisible by 4
  (SpaceToDepth); the final map is 1/32 of the input at sizes divisible by 32.
  """
  STEM = ("conv1",)

  def __init__(self, *, num_classes: int, rngs: nnx.Rngs, stage_sizes: tuple[int, ...],
               width_factor: float = 1.0, image_size=224, dtype=jnp.float32,
               param_dtype=jnp.float32, drop_path_rate: float = 0.0,
               zero_init_residual: bool = True, bn_group_size: int = 0):
    if drop_path_rate:
      raise ValueError(f"TResNet does not implement stochastic depth; got drop_path_rate="
                       f"{drop_path_rate!r} (only 0 is accepted)")
    if len(stage_sizes) != 4 or min(stage_sizes) < 1:
      raise ValueError(f"TResNet needs 4 stages of >= 1 block each, got {stage_sizes!r}")
    planes = int(64 * width_factor)
    if planes < 1:
      raise ValueError(f"width_factor {width_factor!r} gives {planes} base channels")
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.num_classes = num_classes
    self.image_size = image_size  # informational: the network is resolution-agnostic
    self.dtype = dtype
    self.conv1 = ConvNormAct(3 * _SPACE_TO_DEPTH**2, planes, 3, slope=STEM_SLOPE, **kw)
    # (block, planes, stride, SE) per stage, timm's TResNet v1.
    specs = ((BasicBlock, planes, 1, True), (BasicBlock, 2 * planes, 2, True),
             (Bottleneck, 4 * planes, 2, True), (Bottleneck, 8 * planes, 2, False))
    in_ch = planes
    widths = []
    for index, (num, (block, width, stride, use_se)) in enumerate(zip(stage_sizes, specs)):
      blocks = []
      for i in range(num):
        blocks.append(block(in_ch, width, stride=stride if i == 0 else 1, use_se=use_se,
                            zero_init_residual=zero_init_residual, **kw))
        in_ch = width * block.expansion
      setattr(self, f"layer{index + 1}", nnx.List(blocks))
      widths.append(in_ch)
    self.stage_widths = tuple(widths)
    self.depth = self.num_blocks = sum(stage_sizes)
    self.num_features = in_ch
    self.head = layers.classifier_head(in_ch, num_classes, param_dtype=param_dtype, rngs=rngs)
    layers.set_bn_group_size(self, bn_group_size)

  def stages(self, images: jax.Array, *, train: bool = False) -> list[jax.Array]:
    """The four stage outputs [B, H / s, W / s, stage_widths[i]], s = 4, 8, 16, 32."""
    x = self.conv1(space_to_depth(images.astype(self.dtype)), train=train)
    outs = []
    for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
      for block in stage:
        x = block(x, train=train)
      outs.append(x)
    return outs

  def residual_stages(self) -> list:
    return [self.layer1, self.layer2, self.layer3, self.layer4]

  def features(self, images: jax.Array, *, train: bool = False,
               rng: jax.Array | None = None) -> jax.Array:
    """Globally average-pooled final features [B, num_features] in float32 (head input)."""
    del rng  # nothing stochastic
    x = self.stages(images, train=train)[-1]
    return jnp.mean(x.astype(jnp.float32), axis=(1, 2))


VARIANTS = {
    # timm's tresnet_m / tresnet_l (the TResNet paper's Table 1 variants).
    "tresnet_m": functools.partial(TResNet, stage_sizes=(3, 4, 11, 3), width_factor=1.0),
    "tresnet_l": functools.partial(TResNet, stage_sizes=(4, 5, 18, 3), width_factor=1.2),
}

for _name, _factory in sorted(VARIANTS.items()):
  base.MODELS.register(_name, _factory)
