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
With repeated augmentation the batch is mixed in blocks, one per copy and host (mix_batch).

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


def _partners(x: jax.Array, blocks: int, copies: int) -> jax.Array:
  """[B, ...] -> [blocks, B / blocks, ...]: row j of block g holds row (m - 1 - j + 2c) mod m
  of the same block (m = B / blocks, c = g mod copies); for one block, the batch flipped.

  Flips and rolls, not a gather, so that XLA moves the rows of a sharded batch with
  collective permutes."""
  m = x.shape[0] // blocks
  x = x.reshape(blocks // copies, copies, m, *x.shape[1:])
  return jnp.stack([jnp.roll(jnp.flip(x[:, c], axis=1), 2 * c, axis=1)
                    for c in range(copies)], axis=1).reshape(blocks, m, *x.shape[3:])


def _check(name: str, value, lo: float, hi: float, hi_open: bool = False) -> float:
  ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
  if not ok or value < lo or (value >= hi if hi_open else value > hi):
    bound = f"[{lo}, {hi})" if hi_open else f"[{lo}, {hi}]"
    raise ValueError(f"mixup: {name} must be a number in {bound}, got {value!r}")
  return float(value)


def check_config(mixup_cfg) -> None:
  """config.mixup before anything is built: the ranges mix_batch takes (a negative alpha would
  turn mixing off unsaid), and a label_smoothing, which only mixing applies, with it off."""
  _check("mixup_alpha", mixup_cfg.mixup_alpha, 0, math.inf)
  _check("cutmix_alpha", mixup_cfg.cutmix_alpha, 0, math.inf)
  _check("switch_prob", mixup_cfg.switch_prob, 0, 1)
  smoothing = _check("label_smoothing", mixup_cfg.label_smoothing, 0, 1, hi_open=True)
  if smoothing > 0 and mixup_cfg.mixup_alpha == 0 and mixup_cfg.cutmix_alpha == 0:
    raise ValueError(f"config.mixup.label_smoothing={smoothing} with mixup and cutmix off "
                     "(both alphas 0) would not be applied: set config.objective."
                     "label_smoothing instead, and config.mixup.label_smoothing=0.")


def mix_batch(rng: jax.Array, images: jax.Array, targets: jax.Array, *, mixup_alpha: float,
              cutmix_alpha: float, switch_prob: float = 0.5, label_smoothing: float = 0.0,
              blocks: int = 1, copies: int = 1) -> tuple[jax.Array, jax.Array]:
  """Mixes a batch: (images [B, H, W, C] same dtype, targets float32 [B, C]).

  `targets` are the objective's hard targets (one-hot, or multi-hot for multi-label
  objectives), smoothed as t (1 - s) + s / C before mixing. Both alphas 0 leaves the images
  alone and returns the smoothed targets.

  `blocks` > 1 splits the batch into that many blocks of m = B / blocks consecutive rows, each
  mixed on its own (its own switch, lam and box); row j of block g is paired with row
  (m - 1 - j + 2c) mod m of its block, c = g mod `copies`. With repeated augmentation the
  pipeline's batch is such blocks (copy c of a host's records in block c, see
  train.mixup_layout), so the k copies of a record get k partners and k lams, as when
  DeiT-III's sampler spreads them over GPUs that mix their own batches.
  """
  mixup_alpha = _check("mixup_alpha", mixup_alpha, 0, math.inf)
  cutmix_alpha = _check("cutmix_alpha", cutmix_alpha, 0, math.inf)
  switch_prob = _check("switch_prob", switch_prob, 0, 1)
  label_smoothing = _check("label_smoothing", label_smoothing, 0, 1, hi_open=True)
  if images.ndim != 4 or targets.ndim != 2 or targets.shape[0] != images.shape[0]:
    raise ValueError(f"mixup: expected images [B, H, W, C] and targets [B, C], got "
                     f"{images.shape} and {targets.shape}")
  if (not all(isinstance(v, int) and v >= 1 for v in (blocks, copies))
      or images.shape[0] % blocks or blocks % copies):
    raise ValueError(f"mixup: blocks={blocks!r} must divide the batch of {images.shape[0]} "
                     f"and copies={copies!r} must divide blocks")
  y1 = smooth(targets, label_smoothing)
  if mixup_alpha == 0 and cutmix_alpha == 0:
    return images, y1
  batch, height, width = images.shape[:3]
  # Per block: keys for the switch, mixup's lam, cutmix's lam and cutmix's box.
  keys = jax.vmap(lambda k: jax.random.split(k, 4))(
      jax.random.split(rng, blocks) if blocks > 1 else rng[None])
  x = images.reshape(blocks, batch // blocks, height, width, -1)
  x2 = _partners(images, blocks, copies)

  def mix(x, x2):
    lam = jax.vmap(lambda k: jax.random.beta(k, mixup_alpha, mixup_alpha))(keys[:, 1])
    a = lam[:, None, None, None, None]
    return (a * x.astype(jnp.float32) + (1.0 - a) * x2.astype(jnp.float32)).astype(x.dtype), lam

  def cut(x, x2):
    lam = jax.vmap(lambda k: jax.random.beta(k, cutmix_alpha, cutmix_alpha))(keys[:, 2])
    top, bottom, left, right = (v[:, None, None] for v in jax.vmap(
        lambda k, lam: cutmix_box(k, height, width, lam))(keys[:, 3], lam))
    rows = jnp.arange(height)[None, :, None]
    cols = jnp.arange(width)[None, None, :]
    inside = (rows >= top) & (rows < bottom) & (cols >= left) & (cols < right)
    area = (bottom - top) * (right - left)
    return (jnp.where(inside[:, None, :, :, None], x2, x),
            1.0 - area[:, 0, 0].astype(jnp.float32) / (height * width))

  if cutmix_alpha == 0:
    mixed, lam = mix(x, x2)
  elif mixup_alpha == 0:
    mixed, lam = cut(x, x2)
  else:
    use_cutmix = jax.vmap(jax.random.uniform)(keys[:, 0]) < switch_prob
    if blocks == 1:  # Only the chosen branch runs.
      mixed, lam = jax.lax.cond(use_cutmix[0], cut, mix, x, x2)
    else:
      (mixed_m, lam_m), (mixed_c, lam_c) = mix(x, x2), cut(x, x2)
      mixed = jnp.where(use_cutmix[:, None, None, None, None], mixed_c, mixed_m)
      lam = jnp.where(use_cutmix, lam_c, lam_m)
  lam = lam.astype(jnp.float32)[:, None, None]
  y = lam * y1.reshape(blocks, batch // blocks, -1) + (1.0 - lam) * _partners(y1, blocks, copies)
  return mixed.reshape(images.shape), y.reshape(y1.shape)
