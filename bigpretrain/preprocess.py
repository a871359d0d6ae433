"""On-device input normalisation: the pipeline ships uint8 pixels and the jitted steps turn
them into float32 here (a quarter of the host-to-device bytes, no float pass on the host)."""
import jax
import jax.numpy as jnp

from input_pipeline import augment


def normalize(images: jax.Array, preset: str) -> jax.Array:
  """uint8 [..., 3] -> float32 by `config.data.normalize` (see augment.normalization_affine)."""
  if images.dtype != jnp.uint8:
    raise TypeError(f"expected uint8 pixels from the input pipeline, got {images.dtype}")
  scale, offset = augment.normalization_affine(preset)
  return images.astype(jnp.float32) * scale + offset
