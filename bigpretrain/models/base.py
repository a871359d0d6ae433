"""The model contract and the registry of models by name (config.model.name)."""
import re

import jax
import jax.numpy as jnp
from flax import nnx

from bigpretrain import registry
from bigpretrain.models import layers

# Model factories by name: `factory(num_classes=..., rngs=..., **options) -> Classifier`.
MODELS = registry.Registry("model", "config.model.name")

# What every model's `remat` option accepts (config.model.remat): a jax.checkpoint_policies
# name, or one of REMAT_OFF for no rematerialisation.
REMAT_POLICIES = layers.REMAT_POLICIES
REMAT_OFF = layers.REMAT_OFF
# The attention kernels, classifier-head precisions and grouped-convolution kernels models
# accept (config.model).
ATTENTION_IMPLS = layers.ATTENTION_IMPLS
HEAD_DTYPES = layers.HEAD_DTYPES
GROUPED_CONV_IMPLS = layers.GROUPED_CONV_IMPLS
POINTWISE_CONV_IMPLS = layers.POINTWISE_CONV_IMPLS
# config.model.attention_impl also takes 'auto' (the configs' default): auto_attention's pick.
ATTENTION_CHOICES = ATTENTION_IMPLS + ("auto",)


class Classifier(nnx.Module):
  """An image classifier: `features` (uint8-normalised images [B, H, W, 3] -> pooled [B, D])
  then `head` ([B, D] -> float32 logits [B, C]). Subclasses define both; linear probes,
  dedup and zero-shot read `features`, the trainer calls the model.

  drop_path_rates: the per-block stochastic-depth rates, or None for a model without
  stochastic depth (cosub needs it).

  Layer order (LayerDecay, bigpretrain/optim.py): layer 0 is the stem, the top-level
  attributes named in STEM; layer i + 1 the i-th residual block in forward order over
  residual_stages(); the last layer the attributes named in TOP (after the last block: final
  norm, head). Each family names its own; a parameter under any other name is an error, so a
  new layer cannot silently fall outside the order.
  """
  drop_path_rates: list[float] | None = None
  STEM: tuple[str, ...] = ()
  TOP: tuple[str, ...] = ("head",)

  def __call__(self, images: jax.Array, *, train: bool = False,
               rng: jax.Array | None = None) -> jax.Array:
    return self.head(self.features(images, train=train, rng=rng))

  def features(self, images: jax.Array, *, train: bool = False,
               rng: jax.Array | None = None) -> jax.Array:
    raise NotImplementedError

  def effective_drop_path_rates(self, batch_size: int) -> list[float] | None:
    """The drop rates a batch of `batch_size` rows really gets (efficient stochastic depth
    rounds the dropped rows per device); None without stochastic depth."""
    del batch_size
    return self.drop_path_rates

  def residual_stages(self) -> list:
    """The nnx.Lists holding the residual blocks, in forward order (the layer ablation of
    bigpretrain/evaluators/evaluate.py, remat_blocks); [] for a model without them."""
    blocks = getattr(self, "blocks", None)
    return [blocks] if isinstance(blocks, nnx.List) else []

  def num_layers(self) -> int:
    """The layers of the layer order: the stem, every residual block, the top."""
    return sum(len(stage) for stage in self.residual_stages()) + 2

  def layer_of(self, path: str) -> int:
    """The layer (0 = stem .. num_layers() - 1 = top) of the parameter at `path`
    ('blocks/3/attn/qkv/kernel', relative to the model)."""
    first, index = re.match(r"([^/]+)(?:/(\d+))?", path).groups()
    if first in self.STEM:
      return 0
    if first in self.TOP:
      return self.num_layers() - 1
    offset = 1
    for stage in self.residual_stages():
      if getattr(self, first, None) is stage and index is not None:
        return offset + int(index)
      offset += len(stage)
    raise ValueError(f"{type(self).__name__}: parameter {path!r} is in none of its layers "
                     f"(stem {self.STEM}, residual blocks, top {self.TOP}).")

  def adapt_param(self, path: str, saved: jax.Array, method: str) -> jax.Array | None:
    """This model's value of parameter `path` (relative to the model) from a checkpoint's
    array `saved` of another shape, e.g. a ViT's position embedding at a new image size
    (`method`: how it resamples, see vit.RESIZE_METHODS); None when the difference is not
    one this model adapts (the caller refuses it). Models without size-dependent
    parameters adapt nothing."""
    del path, saved, method
    return None


def remat_blocks(model: nnx.Module, policy: str) -> nnx.Module:
  """Rematerialises every residual block of `model` (its residual_stages()) with the
  jax.checkpoint_policies `policy` (layers.REMAT_POLICIES; '' or 'none': none is): each block's forward pass runs under nnx.remat, so training keeps a block's input and
  recomputes its insides in the backward pass instead of holding them, trading compute for
  activation memory (big_vision's ViT `remat_policy`, per encoder block, alike). Parameter
  and state paths are unchanged, so checkpoints load either way. Returns `model`.
  """
  stages = model.residual_stages() if isinstance(model, Classifier) else []
  if layers.remat_policy(policy) is None:  # Off, also for blocks rematerialised before.
    for stage in stages:
      for block in stage:
        block.__class__ = getattr(type(block), "remat_of", type(block))
    return model
  if not stages:
    raise ValueError(f"remat={policy!r}: {type(model).__name__} has no residual blocks "
                     "(Classifier.residual_stages()) to rematerialise.")
  for stage in stages:
    for block in stage:
      block.__class__ = layers.remat_class(type(block), policy)
  return model


def auto_attention(model: nnx.Module, platform: str, compute_dtype) -> str:
  """attention_impl='auto': 'cudnn' (fused flash attention) for a model with attention
  layers on NVIDIA GPUs ('gpu' or 'cuda' devices) computing in bfloat16 or float16, the
  dtypes cuDNN's kernel takes; 'xla' anywhere else. The two give the same losses up to bf16
  rounding (benchmarks/accelerator.py's attention_loss figure)."""
  modules = [m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)]
  sixteen_bit = jnp.dtype(compute_dtype) in (jnp.bfloat16, jnp.float16)
  fused = (platform in ("gpu", "cuda") and sixteen_bit
           and any(hasattr(type(m), "attention_impl") for m in modules))
  return "cudnn" if fused else "xla"


# What nnx.Conv computes a grouped convolution with, per layers.GROUPED_CONV_IMPLS value
# (outside a batch-split mesh: the form itself).
GROUPED_CONVS = {"xla": layers.batch_local_conv, "gemm": layers.batch_local_gemm_conv,
                 "split": layers.batch_local_split_conv,
                 "pallas": layers.batch_local_pallas_conv}
# ... and an ungrouped 1x1 convolution, per layers.POINTWISE_CONV_IMPLS value.
POINTWISE_CONVS = {"xla": layers.batch_local_conv, "gemm": layers.batch_local_pointwise_conv}


def set_kernels(model: nnx.Module, attention_impl: str = "xla",
                head_dtype: str = "float32", grouped_conv_impl: str = "xla",
                pointwise_conv_impl: str = "xla") -> nnx.Module:
  """Sets how `model` computes, not what: every attention layer's kernel (`attention_impl`,
  layers.ATTENTION_IMPLS), the classifier head's matmul dtype (`head_dtype`,
  layers.HEAD_DTYPES), how its grouped convolutions of more than one channel per group
  are computed (`grouped_conv_impl`, layers.GROUPED_CONV_IMPLS) and how its 1x1 ones
  (`pointwise_conv_impl`, layers.POINTWISE_CONV_IMPLS). Parameters are unchanged, so
  checkpoints load either way. Raises ValueError for an unknown value, an attention kernel
  for a model without attention, or a convolution form for a model without such
  convolutions."""
  for key, value, allowed in (("attention_impl", attention_impl, layers.ATTENTION_IMPLS),
                              ("head_dtype", head_dtype, layers.HEAD_DTYPES),
                              ("grouped_conv_impl", grouped_conv_impl,
                               layers.GROUPED_CONV_IMPLS),
                              ("pointwise_conv_impl", pointwise_conv_impl,
                               layers.POINTWISE_CONV_IMPLS)):
    if value not in allowed:
      raise ValueError(f"{key}={value!r} must be one of {allowed}.")
  modules = [m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)]
  # Attention layers (vit.Attention; not imported here, vit imports base) carry the attribute.
  attention = [m for m in modules if hasattr(type(m), "attention_impl")]
  if attention_impl != "xla" and not attention:
    raise ValueError(f"attention_impl={attention_impl!r}: {type(model).__name__} has no "
                     "attention layers.")
  for m in attention:
    m.attention_impl = attention_impl
  for m in modules:
    if isinstance(m, layers.ClassifierHead):
      m.head_dtype = head_dtype
  _set_convs(model, modules, "grouped_conv_impl", grouped_conv_impl, GROUPED_CONVS,
             lambda m: m.feature_group_count > 1 and m.in_features > m.feature_group_count,
             "grouped convolutions of more than one channel per group")
  _set_convs(model, modules, "pointwise_conv_impl", pointwise_conv_impl, POINTWISE_CONVS,
             layers.is_pointwise, "ungrouped 1x1 convolutions")
  return model


def _set_convs(model, modules, key: str, impl: str, forms: dict, applies, what: str) -> None:
  """Sets forms[impl] as the convolution function of the model's own convolutions (those
  computed by one of `forms`) that `applies` to; `impl` other than 'xla' for a model with
  none raises ValueError."""
  convs = [m for m in modules if isinstance(m, nnx.Conv) and applies(m)
           and m.conv_general_dilated in forms.values()]
  if impl != "xla" and not convs:
    raise ValueError(f"{key}={impl!r}: {type(model).__name__} has no {what}.")
  for m in convs:
    m.conv_general_dilated = forms[impl]
