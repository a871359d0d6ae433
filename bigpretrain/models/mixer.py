"""MLP-Mixer (Tolstikhin et al. 2021).

Patch embedding (a strided conv), then blocks of  x + token_mixing(LN(x)^T)^T  and
x + channel_mixing(LN(x)), each an MLP with exact GELU; a final LayerNorm, global average
pooling over patches, and a zero-initialised linear head. Attribute names follow the ViT
(patch_embed, blocks, norm, head) so the trainer's per-layer rules apply unchanged.
"""
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from bigpretrain.models import base
from bigpretrain.models import layers


class MixerBlock(nnx.Module):
  """Token-mixing MLP across patches, then channel-mixing MLP across features."""

  def __init__(self, num_tokens: int, width: int, tokens_mlp_dim: int, channels_mlp_dim: int,
               *, dtype, param_dtype, rngs: nnx.Rngs):
    norm = functools.partial(nnx.LayerNorm, width, epsilon=1e-6, dtype=dtype,
                             param_dtype=param_dtype, rngs=rngs)
    self.norm1 = norm()
    # The token axis is a sequence position, not a model dimension: replicated.
    self.token_mixing = layers.Mlp(num_tokens, tokens_mlp_dim, names=(None, None),
                                   dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.norm2 = norm()
    self.channel_mixing = layers.Mlp(width, channels_mlp_dim, dtype=dtype,
                                     param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    y = jnp.swapaxes(self.norm1(x), 1, 2)
    x = x + jnp.swapaxes(self.token_mixing(y), 1, 2)
    return x + self.channel_mixing(self.norm2(x))


class MlpMixer(base.Classifier):
  """MLP-Mixer classifier: `model(images, *, train, rng) -> float32 logits [B, C]`.

  Its token-mixing MLPs are tied to the token count: a checkpoint of another image size is
  not adapted (the base class's adapt_param refuses it)."""
  STEM = ("patch_embed",)
  TOP = ("norm", "head")

  def __init__(self, *, num_classes: int, rngs: nnx.Rngs, patch_size: int, width: int,
               depth: int, tokens_mlp_dim: int, channels_mlp_dim: int, image_size=224,
               dtype=jnp.float32, param_dtype=jnp.float32, drop_path_rate: float = 0.0):
    if drop_path_rate:
      raise ValueError(f"MlpMixer does not implement stochastic depth; got drop_path_rate="
                       f"{drop_path_rate!r} (only 0 is accepted)")
    h, w = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    if h % patch_size or w % patch_size:
      raise ValueError(f"image_size {image_size!r} is not divisible by patch_size {patch_size}")
    self.num_classes = num_classes
    self.image_size = (h, w)
    self.width = width
    self.dtype = dtype
    num_tokens = (h // patch_size) * (w // patch_size)
    self.patch_embed = nnx.Conv(
        3, width, (patch_size, patch_size), strides=patch_size, padding="VALID",
        kernel_init=layers.partitioned(nnx.initializers.lecun_normal(),
                                       (None, None, None, "embed")),
        dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.blocks = nnx.List([
        MixerBlock(num_tokens, width, tokens_mlp_dim, channels_mlp_dim, dtype=dtype,
                   param_dtype=param_dtype, rngs=rngs)
        for _ in range(depth)])
    self.depth = self.num_blocks = depth
    self.norm = nnx.LayerNorm(width, epsilon=1e-6, dtype=dtype, param_dtype=param_dtype,
                              rngs=rngs)
    self.head = layers.classifier_head(width, num_classes, param_dtype=param_dtype, rngs=rngs)

  def features(self, images: jax.Array, *, train: bool = False,
               rng: jax.Array | None = None) -> jax.Array:
    """Average-pooled, final-normed features [B, width] in float32."""
    del train, rng  # nothing stochastic
    if images.ndim != 4 or images.shape[1:3] != self.image_size:
      raise ValueError(f"expected images [B, {self.image_size[0]}, {self.image_size[1]}, 3], "
                       f"got shape {images.shape}")
    x = self.patch_embed(images.astype(self.dtype))
    x = x.reshape(x.shape[0], -1, self.width)
    for block in self.blocks:
      x = block(x)
    return jnp.mean(self.norm(x), axis=1).astype(jnp.float32)


VARIANTS = {
    "mixer_s16": functools.partial(MlpMixer, patch_size=16, width=512, depth=8,
                                   tokens_mlp_dim=256, channels_mlp_dim=2048),
    "mixer_b16": functools.partial(MlpMixer, patch_size=16, width=768, depth=12,
                                   tokens_mlp_dim=384, channels_mlp_dim=3072),
    "mixer_l16": functools.partial(MlpMixer, patch_size=16, width=1024, depth=24,
                                   tokens_mlp_dim=512, channels_mlp_dim=4096),
}

for _name, _factory in sorted(VARIANTS.items()):
  base.MODELS.register(_name, _factory)
