"""Mixup and CutMix on device, inside the jitted train step (timm's batch-level semantics).

One mixing coefficient lam per batch; every example i is paired with example B - 1 - i (the
batch flipped along its first axis):
  - mixup:  image = lam * x + (1 - lam) * flip(x),  lam ~ Beta(mixup_alpha, mixup_alpha);
  - cutmix: lam ~ Beta(cutmix_alpha, cutmix_alpha) sets a box of int(H sqrt(1 - lam)) by
    int(W sqrt(1 - lam)) pixels centred at a uniform pixel (cy, cx), clipped to the image as
    rows [cy - h // 2, cy + h // 2) (columns alike); flip(x) is pasted there in every image,
    and lam is corrected to 1 - box area / (H W), the share of pixels still from x.
With both alphas > 0, cutmix is chosen with probability switch_prob, else mixup. Targets are
lam * smooth(t) + (1 - lam) * smooth(flip(t)), smooth(t) = t (1 - s) + s / C, where t are the
objective's hard targets (one-hot labels, or multi-hot for multi-label objectives).

Pure jnp: jit-able, and the flip works on batches sharded over devices (XLA moves the rows).
"""
import math
import numbers

import jax
import jax.numpy as jnp
import ml_collections


def mixup_defaults() -> ml_collections.ConfigDict:
  """The `config.mixup` keys and defaults (both alphas 0 = off)."""
  return ml_collections.ConfigDict(dict(mixup_alpha=0.0, cutmix_alpha=0.0, switch_prob=0.5,
                                        label_smoothing=0.0))


def smooth(targets: jax.Array, label_smoothing: float = 0.0) -> jax.Array:
  """float32 [B, C] targets t -> t (1 - s) + s / C (for one-hot t: 1 - s + s / C at the
  label, s / C elsewhere)."""
  off = label_smoothing / targets.shape[-1]
  return targets.astype(jnp.float32) * (1.0 - label_smoothing) + off


def cutmix_box(rng: jax.Array, height: int, width: int,
               lam: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """(top, bottom, left, right), int32, bottom/right exclusive, for a CutMix coefficient lam."""
  ratio = jnp.sqrt(1.0 - lam)
  cut_h = jnp.floor(height * ratio).astype(jnp.int32)
  cut_w = jnp.floor(width * ratio).astype(jnp.int32)
  ky, kx = jax.random.split(rng)
  cy = jax.random.randint(ky, (), 0, height)
  cx = jax.random.randint(kx, (), 0, width)
  top = jnp.clip(cy - cut_h // 2, 0, height)
  bottom = jnp.clip(cy + cut_h // 2, 0, height)
  left = jnp.clip(cx - cut_w // 2, 0, width)
  right = jnp.clip(cx + cut_w // 2, 0, width)
  return top, bottom, left, right


def _cutmix(rng, images, lam):
  """Pastes the flipped batch into one box; returns (images, corrected lam)."""
  height, width = images.shape[1], images.shape[2]
  top, bottom, left, right = cutmix_box(rng, height, width, lam)
  rows = jnp.arange(height)[:, None]
  cols = jnp.arange(width)[None, :]
  inside = (rows >= top) & (rows < bottom) & (cols >= left) & (cols < right)
  mixed = jnp.where(inside[None, :, :, None], jnp.flip(images, axis=0), images)
  area = (bottom - top) * (right - left)
  return mixed, 1.0 - area.astype(jnp.float32) / (height * width)


def _mixup(images, lam):
  x = images.astype(jnp.float32)
  mixed = lam * x + (1.0 - lam) * jnp.flip(x, axis=0)
  return mixed.astype(images.dtype), lam


def _check(name: str, value, lo: float, hi: float, hi_open: bool = False) -> float:
  ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
  if not ok or value < lo or (value >= hi if hi_open else value > hi):
    bound = f"[{lo}, {hi})" if hi_open else f"[{lo}, {hi}]"
    raise ValueError(f"mixup: {name} must be a number in {bound}, got {value!r}")
  return float(value)


def mix_batch(rng: jax.Array, images: jax.Array, targets: jax.Array, *, mixup_alpha: float,
              cutmix_alpha: float, switch_prob: float = 0.5,
              label_smoothing: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """Mixes a batch: (images [B, H, W, C] same dtype, targets float32 [B, C]).

  `targets` are the objective's hard targets (one-hot, or multi-hot for multi-label
  objectives), smoothed as t (1 - s) + s / C before mixing. Both alphas 0 leaves the images
  alone and returns the smoothed targets.
  """
  mixup_alpha = _check("mixup_alpha", mixup_alpha, 0, math.inf)
  cutmix_alpha = _check("cutmix_alpha", cutmix_alpha, 0, math.inf)
  switch_prob = _check("switch_prob", switch_prob, 0, 1)
  label_smoothing = _check("label_smoothing", label_smoothing, 0, 1, hi_open=True)
  if images.ndim != 4 or targets.ndim != 2 or targets.shape[0] != images.shape[0]:
    raise ValueError(f"mixup: expected images [B, H, W, C] and targets [B, C], got "
                     f"{images.shape} and {targets.shape}")
  y1 = smooth(targets, label_smoothing)
  if mixup_alpha == 0 and cutmix_alpha == 0:
    return images, y1
  y2 = jnp.flip(y1, axis=0)
  k_switch, k_mix, k_cut, k_box = jax.random.split(rng, 4)
  if cutmix_alpha == 0:
    images, lam = _mixup(images, jax.random.beta(k_mix, mixup_alpha, mixup_alpha))
  elif mixup_alpha == 0:
    images, lam = _cutmix(k_box, images, jax.random.beta(k_cut, cutmix_alpha, cutmix_alpha))
  else:
    use_cutmix = jax.random.uniform(k_switch) < switch_prob
    images, lam = jax.lax.cond(
        use_cutmix,
        lambda x: _cutmix(k_box, x, jax.random.beta(k_cut, cutmix_alpha, cutmix_alpha)),
        lambda x: _mixup(x, jax.random.beta(k_mix, mixup_alpha, mixup_alpha)),
        images)
  lam = lam.astype(jnp.float32)
  return images, lam * y1 + (1.0 - lam) * y2
