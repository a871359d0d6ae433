"""Image augmentations and normalisation on numpy uint8 HWC images.

Every random op takes an explicit `np.random.Generator`, so the grain pipeline can hand each
record a generator derived from (seed, position) and get reproducible results. Resampling,
cropping and flipping go through PIL. Train ops share one signature,
`op(image, rng, image_size) -> image`, and are looked up by name in `TRAIN_OPS`.
"""
import math
from typing import Callable

import numpy as np
from PIL import Image

# Resampling filter for every resize (PIL antialiases when it downsamples).
RESAMPLE = Image.Resampling.BILINEAR
# Standard ImageNet crop fraction: resize the shorter side to size / 0.875, then crop.
CROP_FRACTION = 0.875
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
NORMALIZE_PRESETS = ("0_1", "imagenet", "minus1_1")


def _to_pil(image: np.ndarray) -> Image.Image:
  if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
    raise ValueError(
        f"expected a uint8 [H, W, 3] image, got {image.dtype} {tuple(image.shape)}")
  return Image.fromarray(image, mode="RGB")


def _resize_box(image: np.ndarray, size: tuple[int, int],
                box: tuple[float, float, float, float] | None = None) -> np.ndarray:
  """Resizes the `box` (left, upper, right, lower) region of `image` to (width, height)."""
  return np.asarray(_to_pil(image).resize(size, resample=RESAMPLE, box=box))


def random_flip(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """Mirrors the image left-right with probability 1/2."""
  if rng.random() < 0.5:
    return np.asarray(_to_pil(image).transpose(Image.Transpose.FLIP_LEFT_RIGHT))
  return image


def squish(image: np.ndarray, image_size: int) -> np.ndarray:
  """Resizes to image_size x image_size, ignoring the aspect ratio."""
  return _resize_box(image, (image_size, image_size))


def resize_shorter(image: np.ndarray, shorter: int) -> np.ndarray:
  """Resizes so the shorter side is `shorter`, keeping the aspect ratio."""
  h, w = image.shape[:2]
  if w <= h:
    new_w, new_h = shorter, max(shorter, round(h * shorter / w))
  else:
    new_w, new_h = max(shorter, round(w * shorter / h)), shorter
  return _resize_box(image, (new_w, new_h))


def _crop(image: np.ndarray, top: int, left: int, size: int) -> np.ndarray:
  return np.asarray(_to_pil(image).crop((left, top, left + size, top + size)))


def center_crop(image: np.ndarray, image_size: int,
                crop_fraction: float = CROP_FRACTION) -> np.ndarray:
  """Resizes the shorter side to image_size / crop_fraction, then takes the central square."""
  image = resize_shorter(image, round(image_size / crop_fraction))
  h, w = image.shape[:2]
  return _crop(image, (h - image_size) // 2, (w - image_size) // 2, image_size)


def resize_crop(image: np.ndarray, rng: np.random.Generator, image_size: int,
                crop_fraction: float = CROP_FRACTION) -> np.ndarray:
  """Resizes the shorter side to image_size / crop_fraction, then takes a random square."""
  image = resize_shorter(image, round(image_size / crop_fraction))
  h, w = image.shape[:2]
  top = int(rng.integers(0, h - image_size + 1))
  left = int(rng.integers(0, w - image_size + 1))
  return _crop(image, top, left, image_size)


def inception_crop_box(height: int, width: int, rng: np.random.Generator, *,
                       scale: tuple[float, float] = (0.08, 1.0),
                       ratio: tuple[float, float] = (3 / 4, 4 / 3),
                       attempts: int = 10) -> tuple[int, int, int, int]:
  """Samples an Inception-style crop (top, left, height, width).

  Area fraction ~ U(scale), log aspect ratio (w/h) ~ U(log ratio); after `attempts` misses,
  falls back to the largest central crop whose aspect ratio lies in `ratio`.
  """
  area = height * width
  log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
  for _ in range(attempts):
    target = area * rng.uniform(scale[0], scale[1])
    aspect = math.exp(rng.uniform(log_lo, log_hi))
    w = round(math.sqrt(target * aspect))
    h = round(math.sqrt(target / aspect))
    if 0 < w <= width and 0 < h <= height:
      top = int(rng.integers(0, height - h + 1))
      left = int(rng.integers(0, width - w + 1))
      return top, left, h, w
  aspect = width / height
  if aspect < ratio[0]:
    w, h = width, round(width / ratio[0])
  elif aspect > ratio[1]:
    w, h = round(height * ratio[1]), height
  else:
    w, h = width, height
  return (height - h) // 2, (width - w) // 2, h, w


def inception_crop(image: np.ndarray, rng: np.random.Generator, image_size: int, *,
                   scale: tuple[float, float] = (0.08, 1.0),
                   ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> np.ndarray:
  """RandomResizedCrop: an Inception-style crop resized to image_size x image_size."""
  top, left, h, w = inception_crop_box(image.shape[0], image.shape[1], rng,
                                       scale=scale, ratio=ratio)
  return _resize_box(image, (image_size, image_size), box=(left, top, left + w, top + h))


TrainOp = Callable[[np.ndarray, np.random.Generator, int], np.ndarray]

# Train-time ops by name, all with the signature op(image, rng, image_size).
TRAIN_OPS: dict[str, TrainOp] = {
    "flip": lambda image, rng, size: random_flip(image, rng),
    "squish": lambda image, rng, size: squish(image, size),
    "inception_crop": inception_crop,
    "resize_crop": resize_crop,
}

# Eval-time resizes by name, with the signature op(image, image_size).
EVAL_RESIZES: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "squish": squish,
    "center_crop": center_crop,
}


def parse_train_ops(spec: str) -> tuple[str, ...]:
  """Splits a '|'-separated op list ('inception_crop|flip') and checks every name."""
  names = tuple(name.strip() for name in spec.split("|") if name.strip())
  for name in names:
    if name not in TRAIN_OPS:
      raise ValueError(
          f"unknown augmentation op {name!r} in data.train_augment={spec!r}; "
          f"known ops: {sorted(TRAIN_OPS)}")
  return names


def apply_train_ops(image: np.ndarray, names: tuple[str, ...], rng: np.random.Generator,
                    image_size: int) -> np.ndarray:
  """Applies the named train ops in order."""
  for name in names:
    image = TRAIN_OPS[name](image, rng, image_size)
  return image


def normalize(images: np.ndarray, preset: str) -> np.ndarray:
  """Maps uint8 pixels to float32: '0_1' ([0, 1]), 'imagenet' (mean/std), 'minus1_1'."""
  x = images.astype(np.float32)
  if preset == "0_1":
    return x / np.float32(255.0)
  if preset == "minus1_1":
    return x / np.float32(127.5) - np.float32(1.0)
  if preset == "imagenet":
    mean = np.asarray(IMAGENET_MEAN, np.float32)
    std = np.asarray(IMAGENET_STD, np.float32)
    return (x / np.float32(255.0) - mean) / std
  raise ValueError(f"unknown data.normalize={preset!r}; expected one of {NORMALIZE_PRESETS}")
