"""Image augmentation ops and normalisation for uint8 RGB images (numpy HWC arrays or PIL
images).

Every random op takes an explicit `np.random.Generator`, so the grain pipeline can hand each
record a generator derived from (seed, position) and get reproducible results. Public ops
accept a uint8 [H, W, 3] array or an RGB PIL image and return the same kind.

The train path's costly pixel ops (inception_crop's upscaling resize, flip, every RandAugment
op) run on arrays with OpenCV and uint8 lookup tables, faster than PIL; each reproduces the
PIL operation it replaces (tests/test_augment.py compares them with PIL: equal, or within a
grey level or two where only rounding differs). Downscaling resizes stay in PIL: its bilinear
filter widens with the scale (antialiasing), which OpenCV's resize does not reproduce. Eval
resizes and the DeiT-III / ImageNet-21K ops go through PIL (Image, ImageOps, ImageEnhance,
ImageFilter).

Ops also accept an image from `decoding.open_image` whose pixels are not decoded yet: the
resizing ops then decode a JPEG at the reduced scale their output allows (see decoding.py);
inception_crop picks its box from the header size first, so the scale follows the box. Any
other op decodes in full. The op-string spec that selects ops by name is augment_spec.py.
"""
import functools
import math
from typing import Callable, Union

import cv2
import numpy as np
from PIL import Image, ImageEnhance, ImageFilter, ImageOps

from input_pipeline import decoding

Img = Union[np.ndarray, Image.Image]

# Resampling filter of every resize but the bicubic ones of DeiT-III's recipes (PIL
# antialiases when it downsamples).
RESAMPLE = Image.Resampling.BILINEAR
BICUBIC = Image.Resampling.BICUBIC  # timm's and DeiT's train-time interpolation.
# Standard ImageNet crop fraction: resize the shorter side to size / 0.875, then crop.
CROP_FRACTION = 0.875
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
NORMALIZE_PRESETS = ("0_1", "imagenet", "minus1_1")
# Fill colour of pixels that geometric RandAugment ops move in from outside the image: the
# ImageNet mean in uint8 (as timm does).
FILL = tuple(round(255 * m) for m in IMAGENET_MEAN)

# Records are processed in parallel by the pipeline's workers and threads; OpenCV's own thread
# pool would only compete with them for the same cores.
cv2.setNumThreads(1)


def _check_array(image) -> np.ndarray:
  if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or (
      image.shape[-1] != 3):
    raise ValueError(f"expected a uint8 [H, W, 3] image, got {getattr(image, 'dtype', None)} "
                     f"{tuple(getattr(image, 'shape', ()))}")
  return image


def to_pil(image: Img) -> Image.Image:
  """An RGB PIL image of any accepted input (decoding an undecoded one in full)."""
  if decoding.is_undecoded(image):
    return decoding.decode(image)
  if isinstance(image, Image.Image):
    if image.mode != "RGB":
      raise ValueError(f"expected an RGB PIL image, got mode {image.mode!r}")
    return image
  return Image.fromarray(_check_array(image), mode="RGB")


def to_array(image: Img) -> np.ndarray:
  """A uint8 [H, W, 3] array of any accepted input (decoding an undecoded one in full); an
  array is returned as it is."""
  if isinstance(image, np.ndarray):
    return _check_array(image)
  return np.asarray(to_pil(image))


def _like(out: Img, image: Img) -> Img:
  """Returns `out` (array or PIL image) as the kind of the op's input `image`."""
  if isinstance(image, np.ndarray):
    return np.asarray(out)
  return out if isinstance(out, Image.Image) else Image.fromarray(out, mode="RGB")


def _size(image: Img) -> tuple[int, int]:
  """(height, width)."""
  if isinstance(image, Image.Image):
    return image.height, image.width
  return image.shape[0], image.shape[1]


def _resize_box(image: Img, size: tuple[int, int],
                box: tuple[float, float, float, float] | None = None,
                resample: int = RESAMPLE) -> Img:
  """Resizes the `box` (left, upper, right, lower) region of `image` to (width, height)."""
  return _like(to_pil(image).resize(size, resample=resample, box=box), image)


def random_flip(image: Img, rng: np.random.Generator) -> Img:
  """Mirrors the image left-right with probability 1/2."""
  if rng.random() < 0.5:
    return _like(cv2.flip(to_array(image), 1), image)
  return image


def squish(image: Img, image_size: int) -> Img:
  """Resizes to image_size x image_size, ignoring the aspect ratio."""
  return _resize_box(decoding.decode(image, image_size, image_size), (image_size, image_size))


def resize_shorter(image: Img, shorter: int, resample: int = RESAMPLE) -> Img:
  """Resizes so the shorter side is `shorter`, keeping the aspect ratio; the longer side is
  truncated, as torchvision's Resize(int) does (375x500 -> 224x298)."""
  image = decoding.decode(image, shorter, shorter)
  h, w = _size(image)
  if w <= h:
    new_w, new_h = shorter, max(shorter, int(h * shorter / w))
  else:
    new_w, new_h = max(shorter, int(w * shorter / h)), shorter
  if (new_h, new_w) == (h, w):
    return image
  return _resize_box(image, (new_w, new_h), resample=resample)


def _crop(image: Img, top: int, left: int, size: int) -> Img:
  return _like(to_pil(image).crop((left, top, left + size, top + size)), image)


def center_crop(image: Img, image_size: int, crop_fraction: float = CROP_FRACTION) -> Img:
  """Resizes the shorter side to image_size / crop_fraction, then takes the central square."""
  image = resize_shorter(image, round(image_size / crop_fraction))
  h, w = _size(image)
  return _crop(image, (h - image_size) // 2, (w - image_size) // 2, image_size)


def resize_center_crop(image: Img, image_size: int, scale_size: int,
                       resample: int = RESAMPLE) -> Img:
  """torchvision's Resize(scale_size) then CenterCrop(image_size), the eval transform of timm
  and torchvision: the shorter side to scale_size (>= image_size), then the central square at
  offsets round((side - image_size) / 2) (Python's round, halves to even, as torchvision's
  center_crop; center_crop above floors them, so a 1-pixel shift tells the two apart)."""
  image = resize_shorter(image, scale_size, resample=resample)
  h, w = _size(image)
  return _crop(image, round((h - image_size) / 2), round((w - image_size) / 2), image_size)


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

  The rule: resize so the shorter side is image_size (aspect kept; bicubic, as DeiT-III's
  transforms.Resize(img_size, interpolation=3)), pad `pad` pixels on every side by reflection
  (numpy 'reflect', edge pixel not repeated; DeiT-III pads 4 pixels at 224), then crop
  image_size x image_size at top ~ U{0..H+2pad-S}, left ~ U{0..W+2pad-S} (drawn in that
  order).
  """
  resized = resize_shorter(image, image_size, resample=BICUBIC)
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
                   ratio: tuple[float, float] = (3 / 4, 4 / 3),
                   resample: int = RESAMPLE) -> Img:
  """RandomResizedCrop: an Inception-style crop resized to image_size x image_size, bilinear
  (torchvision's default) or bicubic (`resample`: timm's and DeiT's
  RandomResizedCropAndInterpolation(interpolation='bicubic')).

  As in both (their F.resized_crop), the box is cut out first and only then resized: pixels
  outside the box never contribute (PIL's resize(box=...) would weigh them in the edge rows
  and columns). A bilinear crop no larger than the output on both sides is upscaled with
  OpenCV's resize of the cut-out (PIL's weights within a level of rounding, and its edge rule:
  edge pixels repeated); an undecoded input then gives an array. Other crops are resized by
  PIL, after a reduced-scale decode where it allows (see _resize_scaled_box).
  """
  h, w = _size(image)
  top, left, ch, cw = inception_crop_box(h, w, rng, scale=scale, ratio=ratio)
  box = (left, top, left + cw, top + ch)
  size = (image_size, image_size)
  if ch <= image_size and cw <= image_size and resample == RESAMPLE:
    out = cv2.resize(to_array(_cut(image, box)), size, interpolation=cv2.INTER_LINEAR)
    return out if decoding.is_undecoded(image) else _like(out, image)
  if decoding.is_undecoded(image):
    return _resize_scaled_box(image, box, image_size, resample)
  return _like(to_pil(_cut(image, box)).resize(size, resample=resample), image)


def _cut(image: Img, box: tuple[int, int, int, int]) -> Img:
  """The (left, upper, right, lower) `box` of `image` alone: a view of an array, a PIL crop
  of an image (an undecoded one decoded in full)."""
  left, top, right, bottom = box
  if isinstance(image, np.ndarray):
    return _check_array(image)[top:bottom, left:right]
  return to_pil(image).crop(box)


def _resize_scaled_box(image: Image.Image, box: tuple[int, int, int, int], image_size: int,
                       resample: int) -> Image.Image:
  """Decodes an undecoded `image` at the largest scale that keeps >= image_size pixels a side
  in `box`, and resizes the box there to image_size x image_size.

  At 1/2, 1/4 or 1/8 scale the box has fractional edges. Rule: cut the decoded image to the
  box rounded outward, then resize the fractional box within that cut. Decoded pixels wholly
  outside the box never contribute; one that straddles an edge does (it holds box content in
  part; cutting it off instead, by rounding the box inward or to the nearest pixel, would
  move the box by up to a decoded pixel). At full scale this is inception_crop's
  crop-then-resize.
  """
  shorter = min(box[2] - box[0], box[3] - box[1])
  image, factor = decoding.decode_scaled(image, shorter // image_size)
  scaled = [min(v / factor, limit) for v, limit in zip(box, image.size * 2)]
  outer = (math.floor(scaled[0]), math.floor(scaled[1]), math.ceil(scaled[2]),
           math.ceil(scaled[3]))
  inner = (scaled[0] - outer[0], scaled[1] - outer[1], scaled[2] - outer[0],
           scaled[3] - outer[1])
  return image.crop(outer).resize((image_size, image_size), resample=resample, box=inner)


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
  if isinstance(image, np.ndarray):  # One copy, not three through PIL.
    out = _check_array(image).copy()
    out[box[1]:box[3], box[0]:box[2]] = colour
    return out
  out = to_pil(image).copy()
  out.paste(colour, box)
  return out


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
# with FILL. Each op is the PIL operation named in its docstring, computed on arrays.

_LEVELS = np.arange(256)
# PIL's ImageFilter.SMOOTH kernel, the blur that ImageEnhance.Sharpness extrapolates from.
_SMOOTH = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32) / 13


def _signed(value: float, rng: np.random.Generator) -> float:
  return -value if rng.random() < 0.5 else value


def _lut(image: np.ndarray, lut: np.ndarray) -> np.ndarray:
  """Maps pixel values through a [256] (all channels) or [256, 3] (per channel) table."""
  lut = np.clip(lut, 0, 255).astype(np.uint8)
  return cv2.LUT(image, lut if lut.ndim == 1 else lut.reshape(256, 1, 3))


def _blend_lut(degenerate: float, factor: float) -> np.ndarray:
  """PIL's Image.blend with a constant image: trunc(d + factor (v - d)) in float32, clipped."""
  d = np.float32(degenerate)
  return np.trunc(d + np.float32(factor) * (_LEVELS.astype(np.float32) - d))


def _blend(degenerate: np.ndarray, image: np.ndarray, factor: float) -> np.ndarray:
  """PIL's Image.blend(degenerate, image, factor), rounded where PIL truncates (the two
  differ by at most one level)."""
  return cv2.addWeighted(image, factor, degenerate, 1.0 - factor, 0.0)


def _warp(image: np.ndarray, matrix: tuple[float, ...], size: tuple[int, int]) -> np.ndarray:
  """A (width, height) `size` image whose pixel (x, y) samples `image` bilinearly at (a x + b y
  + c, d x + e y + f) in PIL's coordinates (pixel centres at +0.5), edge pixels repeated
  outside (PIL's bilinear rule)."""
  a, b, c, d, e, f = matrix
  # The same map in OpenCV's coordinates (pixel centres at integers), on the image padded by
  # its edge pixels, as RGBA: OpenCV's warp is about twice as fast on 4 channels as on 3 and
  # much faster with a constant border than with a replicated one.
  m = np.array([[a, b, c + 0.5 * (a + b) + 0.5], [d, e, f + 0.5 * (d + e) + 0.5]])
  padded = cv2.cvtColor(cv2.copyMakeBorder(image, 1, 1, 1, 1, cv2.BORDER_REPLICATE),
                        cv2.COLOR_RGB2RGBA)
  return cv2.cvtColor(cv2.warpAffine(padded, m, size, flags=cv2.WARP_INVERSE_MAP | (
      cv2.INTER_LINEAR), borderMode=cv2.BORDER_CONSTANT), cv2.COLOR_RGBA2RGB)


def _affine(image: np.ndarray, matrix: tuple[float, ...]) -> np.ndarray:
  """PIL's Image.transform(AFFINE, matrix, BILINEAR, fillcolor=FILL): output pixel (x, y)
  samples input (a x + b y + c, d x + e y + f) in PIL's coordinates (pixel centres at +0.5);
  a sample inside the image interpolates with edge pixels repeated, one outside is FILL."""
  a, b, c, d, e, f = matrix
  h, w = image.shape[:2]
  out = _warp(image, matrix, (w, h))
  # Nearest-neighbour rounding of the sample position in OpenCV's coordinates marks the
  # samples whose floor in PIL's lies outside the image.
  m = np.array([[a, b, c + 0.5 * (a + b) - 0.5], [d, e, f + 0.5 * (d + e) - 0.5]])
  outside = cv2.warpAffine(np.zeros((h, w), np.uint8), m, (w, h),
                           flags=cv2.WARP_INVERSE_MAP | cv2.INTER_NEAREST,
                           borderMode=cv2.BORDER_CONSTANT, borderValue=1)
  return cv2.copyTo(_fill_image(h, w), outside, out)


@functools.lru_cache(maxsize=8)
def _fill_image(h: int, w: int) -> np.ndarray:
  """A read-only [h, w, 3] image of FILL (numpy fills a 3-wide last axis slowly: made once)."""
  out = np.tile(np.asarray(FILL, np.uint8), (h, w, 1))
  out.flags.writeable = False
  return out


def _rotate(image: np.ndarray, degrees: float) -> np.ndarray:
  """PIL's Image.rotate(degrees, BILINEAR, fillcolor=FILL): counter-clockwise about the
  centre (w / 2, h / 2), with PIL's matrix (entries rounded to 15 decimals)."""
  h, w = image.shape[:2]
  angle = -math.radians(degrees)
  cos, sin = round(math.cos(angle), 15), round(math.sin(angle), 15)
  cx, cy = w / 2, h / 2
  return _affine(image, (cos, sin, cos * -cx + sin * -cy + cx,
                         -sin, cos, -sin * -cx + cos * -cy + cy))


def _sharpness(image: np.ndarray, factor: float) -> np.ndarray:
  """ImageEnhance.Sharpness: blend from PIL's SMOOTH filter, which leaves the 1-pixel frame
  of the image as it is."""
  smooth = cv2.filter2D(image, -1, _SMOOTH, borderType=cv2.BORDER_REPLICATE)
  smooth[[0, -1]] = image[[0, -1]]
  smooth[:, [0, -1]] = image[:, [0, -1]]
  return _blend(smooth, image, factor)


def _gray(image: np.ndarray) -> np.ndarray:
  """ITU-R 601 luma [H, W] (PIL's 'L', up to one level of rounding)."""
  return cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)


def _color(image: np.ndarray, factor: float) -> np.ndarray:
  """ImageEnhance.Color: blend from the grey image."""
  return _blend(cv2.cvtColor(_gray(image), cv2.COLOR_GRAY2RGB), image, factor)


def _contrast(image: np.ndarray, factor: float) -> np.ndarray:
  """ImageEnhance.Contrast: blend from the mean grey level (rounded)."""
  mean = int(cv2.mean(_gray(image))[0] + 0.5)
  return _lut(image, _blend_lut(mean, factor))


def _histograms(image: np.ndarray) -> np.ndarray:
  """int64 [3, 256] per-channel histograms."""
  return np.stack([cv2.calcHist([image], [c], None, [256], [0, 256]).reshape(256)
                   for c in range(3)]).astype(np.int64)


def _auto_contrast(image: np.ndarray) -> np.ndarray:
  """ImageOps.autocontrast: each channel's [min, max] stretched to [0, 255] (truncated)."""
  luts = []
  for h in _histograms(image):
    used = np.flatnonzero(h)
    lo, hi = used[0], used[-1]
    if hi <= lo:
      luts.append(_LEVELS)
    else:
      scale = 255.0 / (hi - lo)
      luts.append(np.trunc(_LEVELS * scale - lo * scale))
  return _lut(image, np.stack(luts, -1))


def _equalize(image: np.ndarray) -> np.ndarray:
  """ImageOps.equalize: each channel through its cumulative histogram, PIL's integer rule
  (step = (pixels - count of the top value) // 255; value v -> (step // 2 + pixels below v)
  // step)."""
  luts = []
  for h in _histograms(image):
    used = h[h > 0]
    step = (used.sum() - used[-1]) // 255 if len(used) > 1 else 0
    if not step:
      luts.append(_LEVELS)
    else:
      below = np.concatenate([[0], np.cumsum(h)[:-1]])
      luts.append((step // 2 + below) // step)
  return _lut(image, np.stack(luts, -1))


def _posterize(bits: int) -> np.ndarray:
  return _LEVELS & ~(2 ** (8 - bits) - 1)


def _solarize_add(add: int, threshold: int = 128) -> np.ndarray:
  return np.where(_LEVELS < threshold, np.minimum(255, _LEVELS + add), _LEVELS)


def _enhance_factor(f: float) -> float:
  return 0.1 + 1.8 * f


RandOp = Callable[[np.ndarray, float, np.random.Generator], np.ndarray]

# name -> op(uint8 [H, W, 3] array, f = M / 10, rng); only signed ops draw from rng (one draw,
# the sign).
RAND_AUGMENT_OPS: dict[str, RandOp] = {
    "auto_contrast": lambda image, f, rng: _auto_contrast(image),
    "equalize": lambda image, f, rng: _equalize(image),
    "invert": lambda image, f, rng: _lut(image, 255 - _LEVELS),
    "rotate": lambda image, f, rng: _rotate(image, _signed(30 * f, rng)),
    "posterize": lambda image, f, rng: _lut(image, _posterize(int(4 * f))),
    "solarize": lambda image, f, rng: _lut(
        image, np.where(_LEVELS < int(256 * f), _LEVELS, 255 - _LEVELS)),
    "solarize_add": lambda image, f, rng: _lut(image, _solarize_add(int(110 * f))),
    "color": lambda image, f, rng: _color(image, _enhance_factor(f)),
    "contrast": lambda image, f, rng: _contrast(image, _enhance_factor(f)),
    "brightness": lambda image, f, rng: _lut(image, _blend_lut(0, _enhance_factor(f))),
    "sharpness": lambda image, f, rng: _sharpness(image, _enhance_factor(f)),
    "shear_x": lambda image, f, rng: _affine(image, (1, _signed(0.3 * f, rng), 0, 0, 1, 0)),
    "shear_y": lambda image, f, rng: _affine(image, (1, 0, 0, _signed(0.3 * f, rng), 1, 0)),
    "translate_x": lambda image, f, rng: _affine(
        image, (1, 0, _signed(0.45 * f * image.shape[1], rng), 0, 1, 0)),
    "translate_y": lambda image, f, rng: _affine(
        image, (1, 0, 0, 0, 1, _signed(0.45 * f * image.shape[0], rng))),
}
RAND_AUGMENT_NAMES = tuple(RAND_AUGMENT_OPS)  # Fixed order: index -> op.


def _increasing_factor(f: float, rng: np.random.Generator) -> float:
  return max(0.1, 1.0 + _signed(0.9 * f, rng))


# timm's 'inc1' variant (_RAND_INCREASING_TRANSFORMS, same order), where a larger magnitude
# always distorts more: posterize keeps 4 - int(4f) bits, solarize inverts from 256 - int(256f)
# up, the enhance ops blend by 1 +- 0.9f (a signed op: one draw, the sign).
RAND_AUGMENT_INCREASING_OPS: dict[str, RandOp] = {
    **RAND_AUGMENT_OPS,
    "posterize": lambda image, f, rng: _lut(image, _posterize(4 - int(4 * f))),
    "solarize": lambda image, f, rng: _lut(
        image, np.where(_LEVELS < 256 - int(256 * f), _LEVELS, 255 - _LEVELS)),
    "color": lambda image, f, rng: _color(image, _increasing_factor(f, rng)),
    "contrast": lambda image, f, rng: _contrast(image, _increasing_factor(f, rng)),
    "brightness": lambda image, f, rng: _lut(image, _blend_lut(0, _increasing_factor(f, rng))),
    "sharpness": lambda image, f, rng: _sharpness(image, _increasing_factor(f, rng)),
}


def rand_augment(image: Img, rng: np.random.Generator, num_ops: int = 2,
                 magnitude: float = 9, prob: float = 0.5, increasing: bool = False) -> Img:
  """RandAugment: `num_ops` ops drawn uniformly with replacement, each applied w.p. `prob`.

  Draws: the op indices (rng.integers(0, 15, num_ops)) into RAND_AUGMENT_NAMES, then per op
  u = rng.random() (applied if u < prob) and, for signed ops, the sign. timm's 'rand-m9-n2'
  is num_ops=2, magnitude=9, prob=0.5; 'rand-m9-inc1' adds increasing=True
  (RAND_AUGMENT_INCREASING_OPS).
  """
  ops = RAND_AUGMENT_INCREASING_OPS if increasing else RAND_AUGMENT_OPS
  indices = rng.integers(0, len(RAND_AUGMENT_NAMES), num_ops)
  out = to_array(image)
  for i in indices:
    if rng.random() < prob:
      out = ops[RAND_AUGMENT_NAMES[i]](out, magnitude / 10, rng)
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
