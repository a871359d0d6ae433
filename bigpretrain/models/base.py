"""The model contract and the registry of models by name (config.model.name)."""
import jax
from flax import nnx

from bigpretrain import registry
from bigpretrain.models import layers

# Model factories by name: `factory(num_classes=..., rngs=..., **options) -> Classifier`.
MODELS = registry.Registry("model", "config.model.name")


class Classifier(nnx.Module):
  """An image classifier: `features` (uint8-normalised images [B, H, W, 3] -> pooled [B, D])
  then `head` ([B, D] -> float32 logits [B, C]). Subclasses define both; linear probes,
  dedup and zero-shot read `features`, the trainer calls the model.

  drop_path_rates: the per-block stochastic-depth rates, or None for a model without
  stochastic depth (cosub needs it).
  """
  drop_path_rates: list[float] | None = None

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
    bigpretrain/evaluate.py, remat_blocks); [] for a model without them."""
    blocks = getattr(self, "blocks", None)
    return [blocks] if isinstance(blocks, nnx.List) else []


def remat_blocks(model: nnx.Module, policy: str) -> nnx.Module:
  """Rematerialises every residual block of `model` (its residual_stages()) with the
  jax.checkpoint_policies `policy` (layers.REMAT_POLICIES; '' or 'none' leaves the model as it
  is): each block's forward pass runs under nnx.remat, so training keeps a block's input and
  recomputes its insides in the backward pass instead of holding them, trading compute for
  activation memory (big_vision's ViT `remat_policy`, per encoder block, alike). Parameter
  and state paths are unchanged, so checkpoints load either way. Returns `model`.
  """
  if layers.remat_policy(policy) is None:
    return model
  stages = model.residual_stages() if isinstance(model, Classifier) else []
  if not stages:
    raise ValueError(f"remat={policy!r}: {type(model).__name__} has no residual blocks "
                     "(Classifier.residual_stages()) to rematerialise.")
  for stage in stages:
    for block in stage:
      block.__class__ = layers.remat_class(type(block), policy)
  return model


def set_kernels(model: nnx.Module, attention_impl: str = "xla",
                head_dtype: str = "float32") -> nnx.Module:
  """Sets how `model` computes, not what: every attention layer's kernel (`attention_impl`,
  layers.ATTENTION_IMPLS) and the classifier head's matmul dtype (`head_dtype`,
  layers.HEAD_DTYPES). Parameters are unchanged, so checkpoints load either way. Raises
  ValueError for an unknown value or an attention kernel for a model without attention."""
  if attention_impl not in layers.ATTENTION_IMPLS:
    raise ValueError(f"attention_impl={attention_impl!r} must be one of "
                     f"{layers.ATTENTION_IMPLS}.")
  if head_dtype not in layers.HEAD_DTYPES:
    raise ValueError(f"head_dtype={head_dtype!r} must be one of {layers.HEAD_DTYPES}.")
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
  return model
