"""Image augmentation ops and normalisation for uint8 RGB images (numpy HWC arrays or PIL
images).

Every random op takes an explicit `np.random.Generator`, so the grain pipeline can hand each
record a generator derived from (seed, position) and get reproducible results. Pixel work goes
through PIL (Image, ImageOps, ImageEnhance, ImageFilter); numpy only pads and normalises.
Public ops accept a uint8 [H, W, 3] array or an RGB PIL image and return the same kind.

Ops also accept an image from `decoding.open_image` whose pixels are not decoded yet: the
resizing ops then decode a JPEG at the reduced scale their output allows (see decoding.py);
inception_crop picks its box from the header size first, so the scale follows the box. Any
other op decodes in full. The op-string spec that selects ops by name is augment_spec.py.
"""
import math
from typing import Callable, Union

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter, ImageOps

from input_pipeline import decoding

Img = Union[np.ndarray, Image.Image]

# Resampling filter for every resize (PIL antialiases when it downsamples).
RESAMPLE = Image.Resampling.BILINEAR
# Standard ImageNet crop fraction: resize the shorter side to size / 0.875, then crop.
CROP_FRACTION = 0.875
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
NORMALIZE_PRESETS = ("0_1", "imagenet", "minus1_1")
# Fill colour of pixels that geometric RandAugment ops move in from outside the image: the
# ImageNet mean in uint8 (as timm does).
FILL = tuple(round(255 * m) for m in IMAGENET_MEAN)


def to_pil(image: Img) -> Image.Image:
  """An RGB PIL image of any accepted input (decoding an undecoded one in full)."""
  if decoding.is_undecoded(image):
    return decoding.decode(image)
  if isinstance(image, Image.Image):
    if image.mode != "RGB":
      raise ValueError(f"expected an RGB PIL image, got mode {image.mode!r}")
    return image
  if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or (
      image.shape[-1] != 3):
    raise ValueError(f"expected a uint8 [H, W, 3] image, got {getattr(image, 'dtype', None)} "
                     f"{tuple(getattr(image, 'shape', ()))}")
  return Image.fromarray(image, mode="RGB")


def _like(out: Image.Image, image: Img) -> Img:
  """Returns `out` as the kind (array or PIL image) of the op's input `image`."""
  return np.asarray(out) if isinstance(image, np.ndarray) else out


def _size(image: Img) -> tuple[int, int]:
  """(height, width)."""
  if isinstance(image, Image.Image):
    return image.height, image.width
  return image.shape[0], image.shape[1]


def _resize_box(image: Img, size: tuple[int, int],
                box: tuple[float, float, float, float] | None = None) -> Img:
  """Resizes the `box` (left, upper, right, lower) region of `image` to (width, height)."""
  return _like(to_pil(image).resize(size, resample=RESAMPLE, box=box), image)


def random_flip(image: Img, rng: np.random.Generator) -> Img:
  """Mirrors the image left-right with probability 1/2."""
  if rng.random() < 0.5:
    return _like(to_pil(image).transpose(Image.Transpose.FLIP_LEFT_RIGHT), image)
  return image


def squish(image: Img, image_size: int) -> Img:
  """Resizes to image_size x image_size, ignoring the aspect ratio."""
  return _resize_box(decoding.decode(image, image_size, image_size), (image_size, image_size))


def resize_shorter(image: Img, shorter: int) -> Img:
  """Resizes so the shorter side is `shorter`, keeping the aspect ratio."""
  image = decoding.decode(image, shorter, shorter)
  h, w = _size(image)
  if w <= h:
    new_w, new_h = shorter, max(shorter, round(h * shorter / w))
  else:
    new_w, new_h = max(shorter, round(w * shorter / h)), shorter
  if (new_h, new_w) == (h, w):
    return image
  return _resize_box(image, (new_w, new_h))


def _crop(image: Img, top: int, left: int, size: int) -> Img:
  return _like(to_pil(image).crop((left, top, left + size, top + size)), image)


def center_crop(image: Img, image_size: int, crop_fraction: float = CROP_FRACTION) -> Img:
  """Resizes the shorter side to image_size / crop_fraction, then takes the central square."""
  image = resize_shorter(image, round(image_size / crop_fraction))
  h, w = _size(image)
  return _crop(image, (h - image_size) // 2, (w - image_size) // 2, image_size)


def resize_crop(image: Img, rng: np.random.Generator, image_size: int,
                crop_fraction: float = CROP_FRACTION) -> Img:
  """Resizes the shorter side to image_size / crop_fraction, then takes a random square."""
  image = resize_shorter(image, round(image_size / crop_fraction))
  h, w = _size(image)
  top = int(rng.integers(0, h - image_size + 1))
  left = int(rng.integers(0, w - image_size + 1))
  return _crop(image, top, left, image_size)


def simple_random_crop(image: Img, rng: np.random.Generator, image_size: int,
                       pad: int = 4) -> Img:
  """DeiT-III Simple Random Crop: shorter side to image_size, reflect-pad, random square crop.

  The rule: resize so the shorter side is image_size (aspect kept), pad `pad` pixels on every
  side by reflection (numpy 'reflect', edge pixel not repeated; DeiT-III pads 4 pixels at
  224), then crop image_size x image_size at top ~ U{0..H+2pad-S}, left ~ U{0..W+2pad-S}
  (drawn in that order).
  """
  resized = resize_shorter(image, image_size)
  array = np.asarray(resized)
  if pad:
    array = np.pad(array, ((pad, pad), (pad, pad), (0, 0)), mode="reflect")
  h, w = array.shape[:2]
  top = int(rng.integers(0, h - image_size + 1))
  left = int(rng.integers(0, w - image_size + 1))
  out = np.ascontiguousarray(array[top:top + image_size, left:left + image_size])
  return out if isinstance(image, np.ndarray) else Image.fromarray(out, mode="RGB")


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


def inception_crop(image: Img, rng: np.random.Generator, image_size: int, *,
                   scale: tuple[float, float] = (0.08, 1.0),
                   ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> Img:
  """RandomResizedCrop: an Inception-style crop resized to image_size x image_size."""
  h, w = _size(image)
  top, left, ch, cw = inception_crop_box(h, w, rng, scale=scale, ratio=ratio)
  box = (left, top, left + cw, top + ch)
  if decoding.is_undecoded(image):  # The box keeps >= image_size pixels a side at the decoded scale.
    image, factor = decoding.decode_scaled(image, min(cw, ch) // image_size)
    box = tuple(min(v / factor, limit) for v, limit in zip(box, image.size * 2))
  return _resize_box(image, (image_size, image_size), box=box)


def cutout(image: Img, rng: np.random.Generator, prob: float = 1.0,
           factor: float = 0.5) -> Img:
  """The ImageNet-21K recipe's Cutout: one random-colour box of about `factor` x the sides.

  As the authors' CutoutPIL (Alibaba-MIIL ImageNet21K, src_files/helper_functions/
  augmentations.py; cutout_factor=0.5 on every training image). The rule (draws in this
  order): with probability `prob` (u = rng.random() < prob; 1 = every image, as theirs),
  ch = floor(factor * H + 0.5), cw likewise, a centre cy ~ U{0..H-1}, cx ~ U{0..W-1}, and the
  box of rows cy - ch // 2 .. cy + ch // 2 and columns cx - cw // 2 .. cx + cw // 2, both ends
  included (PIL's ImageDraw.rectangle), clipped to the image, filled with one colour
  (r, g, b), each channel ~ U{0..255}.
  """
  if rng.random() >= prob:
    return image
  h, w = _size(image)
  ch, cw = int(factor * h + 0.5), int(factor * w + 0.5)
  cy, cx = int(rng.integers(0, h)), int(rng.integers(0, w))
  colour = tuple(int(c) for c in rng.integers(0, 256, 3))
  box = (max(0, cx - cw // 2), max(0, cy - ch // 2),
         min(w, cx + cw // 2 + 1), min(h, cy + ch // 2 + 1))
  out = to_pil(image).copy()
  out.paste(colour, box)
  return _like(out, image)


def color_jitter(image: Img, rng: np.random.Generator, brightness: float = 0.3,
                 contrast: float = 0.3, saturation: float = 0.3) -> Img:
  """Colour jitter: brightness, contrast and saturation in a random order.

  Draws: the order (rng.permutation(3) over brightness, contrast, saturation), then for each
  op in that order with strength s > 0 a factor ~ U[max(0, 1 - s), 1 + s], applied with PIL's
  ImageEnhance (Brightness, Contrast, Color). Hue is not jittered (DeiT-III uses 0).
  """
  order = rng.permutation(3)
  strengths = (brightness, contrast, saturation)
  enhancers = (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color)
  out = to_pil(image)
  for k in order:
    s = strengths[k]
    if s > 0:
      out = enhancers[k](out).enhance(float(rng.uniform(max(0.0, 1 - s), 1 + s)))
  return _like(out, image)


def grayscale(image: Img) -> Img:
  """ITU-R 601 luma (PIL 'L'), repeated over the three channels."""
  return _like(to_pil(image).convert("L").convert("RGB"), image)


def solarize(image: Img, threshold: int = 128) -> Img:
  """Inverts every pixel value >= threshold."""
  return _like(ImageOps.solarize(to_pil(image), threshold), image)


def gaussian_blur(image: Img, sigma: float) -> Img:
  """Gaussian blur with standard deviation `sigma` pixels."""
  return _like(to_pil(image).filter(ImageFilter.GaussianBlur(radius=sigma)), image)


# 3-Augment's choices, picked uniformly.
THREE_AUGMENT_CHOICES = ("grayscale", "solarize", "gaussian_blur")
BLUR_SIGMA = (0.1, 2.0)


def three_augment(image: Img, rng: np.random.Generator, jitter: float = 0.3) -> Img:
  """DeiT-III 3-Augment: one of grayscale / solarize / Gaussian blur, then colour jitter.

  Draws: k ~ U{0, 1, 2} picks THREE_AUGMENT_CHOICES[k]; grayscale and solarize (threshold 128)
  use no randomness, the blur draws sigma ~ U[0.1, 2.0]; then color_jitter(jitter, jitter,
  jitter). DeiT-III follows this with a horizontal flip: add '|flip'.
  """
  k = int(rng.integers(0, 3))
  if k == 0:
    image = grayscale(image)
  elif k == 1:
    image = solarize(image)
  else:
    image = gaussian_blur(image, float(rng.uniform(*BLUR_SIGMA)))
  return color_jitter(image, rng, jitter, jitter, jitter)


# RandAugment (Cubuk et al. 2020) with the op set and magnitude mapping of timm's
# 'rand-mM-nN' (the AutoAugment/TPU mapping): magnitude M in [0, 10], f = M / 10.
#   rotate +-30 f degrees; shear_x/y +-0.3 f; translate_x/y +-0.45 f of the width/height
#   (sign +/- with probability 1/2 each); posterize keeps int(4 f) bits; solarize inverts
#   pixels >= int(256 f); solarize_add adds int(110 f) to pixels < 128; color, contrast,
#   brightness, sharpness enhance by 0.1 + 1.8 f; auto_contrast, equalize, invert ignore M.
# Geometric ops resample bilinearly (timm picks bilinear or bicubic at random) and fill
# with FILL.


def _signed(value: float, rng: np.random.Generator) -> float:
  return -value if rng.random() < 0.5 else value


def _affine(image: Image.Image, matrix: tuple[float, ...]) -> Image.Image:
  """Output pixel (x, y) samples input (a x + b y + c, d x + e y + f)."""
  return image.transform(image.size, Image.Transform.AFFINE, matrix, resample=RESAMPLE,
                         fillcolor=FILL)


def _solarize_add(image: Image.Image, add: int, threshold: int = 128) -> Image.Image:
  lut = [min(255, v + add) if v < threshold else v for v in range(256)]
  return image.point(lut * 3)


def _enhance(enhancer) -> Callable[[Image.Image, float, np.random.Generator], Image.Image]:
  return lambda image, f, rng: enhancer(image).enhance(0.1 + 1.8 * f)


RandOp = Callable[[Image.Image, float, np.random.Generator], Image.Image]

# name -> op(image, f = M / 10, rng); only signed ops draw from rng (one draw, the sign).
RAND_AUGMENT_OPS: dict[str, RandOp] = {
    "auto_contrast": lambda image, f, rng: ImageOps.autocontrast(image),
    "equalize": lambda image, f, rng: ImageOps.equalize(image),
    "invert": lambda image, f, rng: ImageOps.invert(image),
    "rotate": lambda image, f, rng: image.rotate(
        _signed(30 * f, rng), resample=RESAMPLE, fillcolor=FILL),
    "posterize": lambda image, f, rng: ImageOps.posterize(image, int(4 * f)),
    "solarize": lambda image, f, rng: ImageOps.solarize(image, int(256 * f)),
    "solarize_add": lambda image, f, rng: _solarize_add(image, int(110 * f)),
    "color": _enhance(ImageEnhance.Color),
    "contrast": _enhance(ImageEnhance.Contrast),
    "brightness": _enhance(ImageEnhance.Brightness),
    "sharpness": _enhance(ImageEnhance.Sharpness),
    "shear_x": lambda image, f, rng: _affine(image, (1, _signed(0.3 * f, rng), 0, 0, 1, 0)),
    "shear_y": lambda image, f, rng: _affine(image, (1, 0, 0, _signed(0.3 * f, rng), 1, 0)),
    "translate_x": lambda image, f, rng: _affine(
        image, (1, 0, _signed(0.45 * f * image.width, rng), 0, 1, 0)),
    "translate_y": lambda image, f, rng: _affine(
        image, (1, 0, 0, 0, 1, _signed(0.45 * f * image.height, rng))),
}
RAND_AUGMENT_NAMES = tuple(RAND_AUGMENT_OPS)  # Fixed order: index -> op.


def rand_augment(image: Img, rng: np.random.Generator, num_ops: int = 2,
                 magnitude: float = 9, prob: float = 0.5) -> Img:
  """RandAugment: `num_ops` ops drawn uniformly with replacement, each applied w.p. `prob`.

  Draws: the op indices (rng.integers(0, 15, num_ops)) into RAND_AUGMENT_NAMES, then per op
  u = rng.random() (applied if u < prob) and, for signed ops, the sign. timm's 'rand-m9-n2'
  is num_ops=2, magnitude=9, prob=0.5.
  """
  indices = rng.integers(0, len(RAND_AUGMENT_NAMES), num_ops)
  out = to_pil(image)
  for i in indices:
    if rng.random() < prob:
      out = RAND_AUGMENT_OPS[RAND_AUGMENT_NAMES[i]](out, magnitude / 10, rng)
  return _like(out, image)


def normalization_affine(preset: str) -> tuple[np.ndarray, np.ndarray]:
  """float32 (scale, offset) per channel with normalize(x) = x * scale + offset (also usable
  on device, e.g. to normalise uint8 batches inside a jitted step)."""
  if preset == "0_1":
    scale, offset = np.full(3, 1 / 255), np.zeros(3)
  elif preset == "minus1_1":
    scale, offset = np.full(3, 1 / 127.5), np.full(3, -1.0)
  elif preset == "imagenet":
    std, mean = np.asarray(IMAGENET_STD), np.asarray(IMAGENET_MEAN)
    scale, offset = 1 / (255 * std), -mean / std
  else:
    raise ValueError(f"unknown data.normalize={preset!r}; expected one of {NORMALIZE_PRESETS}")
  return scale.astype(np.float32), offset.astype(np.float32)


def normalize(images: np.ndarray, preset: str) -> np.ndarray:
  """Maps uint8 pixels [..., W, 3] to float32: '0_1' (x / 255), 'imagenet' ((x / 255 - mean)
  / std), 'minus1_1' (x / 127.5 - 1); one multiply-add pass."""
  scale, offset = normalization_affine(preset)
  x = np.asarray(images)
  if x.ndim < 2 or x.shape[-1] != 3:
    raise ValueError(f"normalize expects [..., W, 3] pixels, got shape {x.shape}")
  # Constants tiled over whole rows: broadcasting a length-3 axis would run numpy's inner
  # loop three elements at a time (several times slower).
  w = x.shape[-2]
  out = np.multiply(x.reshape(-1, w * 3), np.tile(scale, w), dtype=np.float32)
  out += np.tile(offset, w)
  return out.reshape(x.shape)
