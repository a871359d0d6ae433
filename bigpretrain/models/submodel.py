"""Submodels with whole residual blocks removed: the layer ablation of the cosub supplement
(D.2, after Fan et al.'s LayerDrop): "we trim one block (i.e., a multi-head self-attention and
its corresponding FFN)" of a trained network and evaluate what is left.

Removing a block drops its residual branch and keeps its shortcut, as stochastic depth does
when it drops the block: a ViT or Mixer block becomes x -> x; a ResNet / ResNeXt / RegNetY /
TResNet block, whose ReLU follows the sum, becomes x -> relu(x); a MobileNetV3 block with an
identity shortcut becomes x -> x. Blocks are numbered 0.. in forward order over the whole
network (ResNet-50: 0-15 over its four stages). A block whose shortcut is a projection (it
changes the width or the resolution) cannot be removed: nothing of the same shape is left.
"""
from flax import nnx
import jax

from bigpretrain.models import mixer
from bigpretrain.models import mobilenet_v3
from bigpretrain.models import regnet
from bigpretrain.models import resnet
from bigpretrain.models import tresnet
from bigpretrain.models import vit


def _identity(x):
  return x


# Block class -> (what the block computes without its residual branch, whether it has an
# identity shortcut).
_SKIPS = {
    vit.Block: (_identity, lambda b: True),
    mixer.MixerBlock: (_identity, lambda b: True),
    resnet.BasicBlock: (jax.nn.relu, lambda b: b.downsample_conv is None),
    resnet.Bottleneck: (jax.nn.relu, lambda b: b.downsample_conv is None),
    regnet.ResBottleneckBlock: (jax.nn.relu, lambda b: b.proj_conv is None),
    tresnet.BasicBlock: (jax.nn.relu, lambda b: b.downsample is None),
    tresnet.Bottleneck: (jax.nn.relu, lambda b: b.downsample is None),
    mobilenet_v3.DepthwiseSeparable: (_identity, lambda b: True),
    mobilenet_v3.InvertedResidual: (_identity, lambda b: b.has_skip),
}


class Removed(nnx.Module):
  """Stands in for a removed block: its shortcut only (`fn`: identity or ReLU), no weights."""

  def __init__(self, fn):
    self.fn = fn

  def __call__(self, x: jax.Array, **kwargs) -> jax.Array:
    del kwargs  # train / rng of the block it replaces.
    return self.fn(x)


def _kind(block) -> type:
  """The block's class; a rematerialised block's is the class it wraps (layers.remat_class)."""
  return getattr(type(block), "remat_of", type(block))


def _lists(model) -> list:
  """The nnx.Lists holding the model's residual blocks, in forward order."""
  stages = model.residual_stages()
  if not stages:
    raise ValueError(f"{type(model).__name__} has no residual blocks to remove.")
  return stages


def blocks(model) -> list[tuple[nnx.List, int]]:
  """(list, position) of every block of `model`, numbered over the whole network."""
  return [(lst, i) for lst in _lists(model) for i in range(len(lst))]


def removable(model) -> list[bool]:
  """Per block: whether it has an identity shortcut, so that it can be removed."""
  out = []
  for lst, i in blocks(model):
    block = lst[i]
    if _kind(block) not in _SKIPS:
      raise ValueError(f"block {len(out)} of {type(model).__name__} is a "
                       f"{type(block).__name__}, which bigpretrain.models.submodel does not "
                       "know how to remove.")
    out.append(_SKIPS[_kind(block)][1](block))
  return out


def check(model, indices) -> list[int]:
  """The sorted block indices, after checking that each exists and can be removed."""
  ok = removable(model)
  indices = sorted({int(i) for i in indices})
  for i in indices:
    if not 0 <= i < len(ok):
      raise ValueError(f"block {i} does not exist: {type(model).__name__} has {len(ok)} "
                       f"blocks, numbered 0-{len(ok) - 1}.")
    if not ok[i]:
      raise ValueError(f"block {i} of {type(model).__name__} changes the width or resolution "
                       "(projection shortcut), so it cannot be removed; removable blocks: "
                       f"{[j for j, r in enumerate(ok) if r]}.")
  return indices


def remove_blocks(model, indices):
  """Replaces the listed blocks of `model` in place by their shortcut; returns `model`.

  Call it on a merged module (e.g. inside a jitted step): the removed blocks' weights are
  then simply unused.
  """
  listed = blocks(model)
  for i in check(model, indices):
    lst, pos = listed[i]
    lst[pos] = Removed(_SKIPS[_kind(lst[pos])][0])
  return model


class WithoutBlocks:
  """A models.ModelDef whose `merge` returns the model with `indices` removed: hand it to
  code that merges a ModelDef inside jit (e.g. evaluators.classification.make_eval_step)."""

  def __init__(self, model_def, indices):
    self.model_def = model_def
    self.indices = tuple(indices)

  def merge(self, params, extra):
    return remove_blocks(self.model_def.merge(params, extra), self.indices)
