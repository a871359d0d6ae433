"""The train-op string (config data.train_augment) and the eval resize (data.eval_resize).

Train ops are selected by a '|'-separated string, each entry `name` or `name(arg, ...)`, e.g.
'inception_crop|flip|randaugment(2, 9)'; see TRAIN_OPS. Arguments are checked when the config
is built, so a typo fails before anything runs. The eval resize is a bare name of
EVAL_RESIZES or center_crop(F[, interpolation]) (CenterCrop: timm's crop_pct, torchvision's
resize / crop sizes), checked by eval_resize_op.
"""
import dataclasses
import functools
import math
import re
from typing import Callable

import numpy as np

from bigpretrain import registry
from input_pipeline import augment
from input_pipeline import decoding
from input_pipeline.augment import Img

TrainOp = Callable[[Img, np.random.Generator, int], Img]


# Train-time ops by name: builder(name, *args) -> op(image, rng, image_size); a plugin adds
# its own with @TRAIN_OPS.register(name).
TRAIN_OPS = registry.Registry("augmentation op", "data.train_augment")


def _number(op: str, what: str, value, lo: float, hi: float, integer: bool = False):
  """Checks one op argument."""
  ok = isinstance(value, (int, float)) and not isinstance(value, bool)
  if ok and integer:
    ok = float(value).is_integer()
  if not ok or not lo <= value <= hi:
    kind = "an int" if integer else "a number"
    raise ValueError(f"augmentation op {op!r}: {what} must be {kind} in [{lo}, {hi}], "
                     f"got {value!r}")
  return int(value) if integer else float(value)


def _arity(op: str, args: tuple, allowed: tuple[int, ...], usage: str) -> None:
  if len(args) not in allowed:
    raise ValueError(f"augmentation op {op!r}: expected {usage}, got {len(args)} argument(s)")


def _no_args(fn: Callable[[], TrainOp], usage: str):
  def build(op, *args):
    _arity(op, args, (0,), usage)
    return fn()
  return build


def _inception_crop(resample: int):
  """inception_crop[(min_scale, max_scale)] resizing by `resample`."""
  def build(op, *args):
    _arity(op, args, (0, 2), f"{op} or {op}(min_scale, max_scale)")
    scale = (0.08, 1.0)
    if args:
      scale = (_number(op, "min_scale", args[0], 0, 1), _number(op, "max_scale", args[1], 0, 1))
      if not 0 < scale[0] <= scale[1]:
        raise ValueError(f"augmentation op {op!r}: need 0 < min_scale <= max_scale")
    return lambda image, rng, size: augment.inception_crop(image, rng, size, scale=scale,
                                                           resample=resample)
  return build


# torchvision's RandomResizedCrop (bilinear), and timm's / DeiT's bicubic one.
TRAIN_OPS.register("inception_crop", _inception_crop(augment.RESAMPLE))
TRAIN_OPS.register("inception_crop_bicubic", _inception_crop(augment.BICUBIC))


@TRAIN_OPS.register("randaugment")
def _build_randaugment(op, *args):
  _arity(op, args, (0, 2, 3, 4), "randaugment or randaugment(N, M[, P[, INC]])")
  n, m, p, inc = 2, 9.0, 0.5, 0
  if args:
    n = _number(op, "N (ops per image)", args[0], 0, 100, integer=True)
    m = _number(op, "M (magnitude)", args[1], 0, 10)
  if len(args) >= 3:
    p = _number(op, "P (op probability)", args[2], 0, 1)
  if len(args) == 4:  # timm's inc1: the increasing ops.
    inc = _number(op, "INC (1: timm's increasing ops, 'inc1')", args[3], 0, 1, integer=True)
  return lambda image, rng, size: augment.rand_augment(image, rng, n, m, p, bool(inc))


@TRAIN_OPS.register("cutout")
def _build_cutout(op, *args):
  _arity(op, args, (0, 1, 2), "cutout, cutout(P) or cutout(P, factor)")
  p = _number(op, "P (probability)", args[0], 0, 1) if args else 1.0
  factor = _number(op, "factor", args[1], 0, 1) if len(args) > 1 else 0.5
  return lambda image, rng, size: augment.cutout(image, rng, p, factor)


@TRAIN_OPS.register("color_jitter")
def _build_color_jitter(op, *args):
  _arity(op, args, (0, 1, 3), "color_jitter, color_jitter(S) or color_jitter(B, C, S)")
  if not args:
    args = (0.3,)
  values = [_number(op, "strength", a, 0, 1) for a in args]
  b, c, s = values * 3 if len(values) == 1 else values
  return lambda image, rng, size: augment.color_jitter(image, rng, b, c, s)


@TRAIN_OPS.register("three_augment")
def _build_three_augment(op, *args):
  _arity(op, args, (0, 1), "three_augment or three_augment(jitter)")
  jitter = _number(op, "jitter", args[0], 0, 1) if args else 0.3
  return lambda image, rng, size: augment.three_augment(image, rng, jitter)


@TRAIN_OPS.register("simple_random_crop")
def _build_simple_random_crop(op, *args):
  _arity(op, args, (0, 1), "simple_random_crop or simple_random_crop(pad)")
  pad = _number(op, "pad", args[0], 0, 1024, integer=True) if args else 4
  return lambda image, rng, size: augment.simple_random_crop(image, rng, size, pad)


for _name, _builder in (
    ("flip", _no_args(lambda: lambda image, rng, size: augment.random_flip(image, rng), "flip")),
    ("squish", _no_args(lambda: lambda image, rng, size: augment.squish(image, size), "squish")),
    ("resize_crop", _no_args(lambda: augment.resize_crop, "resize_crop"))):
  TRAIN_OPS.register(_name, _builder)
# Ops after which the image is image_size x image_size.
RESIZING_OPS = ("squish", "inception_crop", "inception_crop_bicubic", "resize_crop",
                "simple_random_crop")

# Eval-time resizes by name, with the signature op(image, image_size).
# 'center_crop' resizes the shorter side to image_size / 0.875 first (the standard 87.5% crop);
# 'shorter_center_crop' resizes it to image_size itself, as SWAG evaluates (Singh et al. 2022,
# section 4.1: "resize smaller side to 224 then 224x224 center crop"). Other crop fractions and
# the bicubic resize are written center_crop(F[, interpolation]); see CenterCrop.
EVAL_RESIZES: dict[str, Callable[[Img, int], Img]] = {
    "squish": augment.squish,
    "center_crop": augment.center_crop,
    "shorter_center_crop": functools.partial(augment.center_crop, crop_fraction=1.0),
}
# The interpolations of center_crop(F, interpolation): the two timm's and torchvision's
# published eval transforms use (PIL's, as both resize PIL images with PIL).
INTERPOLATIONS = {"bilinear": augment.RESAMPLE, "bicubic": augment.BICUBIC}
EVAL_RESIZE_USAGE = (f"one of {sorted(EVAL_RESIZES)}, or center_crop(F) / center_crop(F, "
                     f"{'|'.join(INTERPOLATIONS)}) with F a crop fraction in (0, 1]: a "
                     "number such as 0.9, or crop/resize such as 224/232")


@dataclasses.dataclass(frozen=True)
class CenterCrop:
  """center_crop(F[, interpolation]): timm's eval transform at crop_pct F, torchvision's at
  C/R (Resize(R) then CenterCrop(C)).

  The shorter side goes to scale_size (below), then the central image_size square is kept with
  torchvision's CenterCrop offsets (augment.resize_center_crop); interpolation defaults to
  bilinear. Unlike the bare 'center_crop' (round(S / 0.875): 37 at 32 px), the parametrised
  form uses timm's floor: math.floor(S / F) (center_crop(0.875) gives 36 at 32 px).
  """
  fraction: float  # F; for a ratio, crop / resize
  ratio: tuple[int, int] | None  # (crop C, resize R) when F is written C/R
  resample: int

  def scale_size(self, image_size: int) -> int:
    """The shorter side before the crop: floor(S / F) for a decimal F, as timm's
    transforms_factory computes it (floating point); floor(S * R / C) exactly for C/R, so at
    S = C it is R."""
    if self.ratio is not None:
      crop, resize = self.ratio
      return image_size * resize // crop
    return math.floor(image_size / self.fraction)

  def __call__(self, image: Img, image_size: int) -> Img:
    return augment.resize_center_crop(image, image_size, self.scale_size(image_size),
                                      self.resample)


_RATIO_RE = re.compile(r"(\d+)\s*/\s*(\d+)")
_CENTER_CROP_RE = re.compile(r"\s*center_crop\s*\((.*)\)\s*")


def _crop_fraction(text: str, bad: Callable[[str], ValueError]
                   ) -> tuple[float, tuple[int, int] | None]:
  """'0.9' -> (0.9, None); '224/232' -> (224 / 232, (224, 232)); out of (0, 1]: `bad`."""
  ratio = _RATIO_RE.fullmatch(text)
  if ratio:
    crop, resize = int(ratio.group(1)), int(ratio.group(2))
    if not 0 < crop <= resize:
      raise bad(f"a crop/resize ratio needs 0 < crop <= resize, got {text}")
    return crop / resize, (crop, resize)
  try:
    fraction = float(text)
  except ValueError:
    raise bad(f"{text!r} is not a crop fraction (a number such as 0.9, or crop/resize such "
              "as 224/232)") from None
  if not (math.isfinite(fraction) and 0 < fraction <= 1):
    raise bad(f"the crop fraction must be in (0, 1], got {text}")
  return fraction, None


@functools.lru_cache(maxsize=None)
def _center_crop(spec: str, where: str) -> CenterCrop:
  """Parses center_crop(F[, interpolation]); ValueError saying what is wrong."""
  def bad(reason):
    return ValueError(f"{where}={spec!r}: {reason}")

  match = _CENTER_CROP_RE.fullmatch(spec)
  if not match:
    raise ValueError(f"unknown {where}={spec!r}; expected {EVAL_RESIZE_USAGE}")
  args = [a.strip() for a in match.group(1).split(",")]
  if len(args) > 2 or not args[0]:
    raise bad("expected center_crop(F) or center_crop(F, interpolation)")
  fraction, ratio = _crop_fraction(args[0], bad)
  interpolation = args[1] if len(args) == 2 else "bilinear"
  if interpolation not in INTERPOLATIONS:
    raise bad(f"unknown interpolation {interpolation!r}; expected one of "
              f"{list(INTERPOLATIONS)}")
  return CenterCrop(fraction, ratio, INTERPOLATIONS[interpolation])


def eval_resize_op(spec: str, where: str = "data.eval_resize") -> Callable[[Img, int], Img]:
  """The eval resize a data.eval_resize string names, op(image, image_size) (a bare name of
  EVAL_RESIZES or center_crop(F[, interpolation])). Raises ValueError naming `where` (the
  setting or flag it came from) for an unknown name, a fraction outside (0, 1] or an unknown
  interpolation."""
  if not isinstance(spec, str):
    raise ValueError(f"{where} must be a str, got {spec!r}")
  if spec in EVAL_RESIZES:
    return EVAL_RESIZES[spec]
  return _center_crop(spec, where)


_OP_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:\((.*)\))?")


def _parse_op(text: str, spec: str) -> tuple[str, tuple]:
  """'name' or 'name(1, 0.5)' -> (name, (1, 0.5))."""
  match = _OP_RE.fullmatch(text)
  if not match:
    raise ValueError(f"cannot parse augmentation op {text!r} in data.train_augment={spec!r}; "
                     "write name or name(arg, ...)")
  name, arg_text = match.group(1), match.group(2)
  if name not in TRAIN_OPS:
    raise ValueError(f"{TRAIN_OPS.unknown_message(name)} (in data.train_augment={spec!r})")
  args = []
  if arg_text is not None and arg_text.strip():
    for a in arg_text.split(","):
      a = a.strip()
      try:
        args.append(int(a) if re.fullmatch(r"[+-]?\d+", a) else float(a))
      except ValueError:
        raise ValueError(f"augmentation op {text!r}: argument {a!r} is not a number") from None
  return name, tuple(args)


def _canonical(name: str, args: tuple) -> str:
  return f"{name}({', '.join(repr(a) for a in args)})" if args else name


def parse_train_ops(spec: str) -> tuple[str, ...]:
  """Splits and checks a '|'-separated op list; returns the ops in canonical form.

  'inception_crop | flip|randaugment(2,9)' -> ('inception_crop', 'flip', 'randaugment(2, 9)').
  An unknown op, unparsable text or bad arguments raise ValueError naming the op.
  """
  ops = []
  for text in spec.split("|"):
    text = text.strip()
    if text:
      name, args = _parse_op(text, spec)
      TRAIN_OPS.get(name)(name, *args)  # Validates the arguments.
      ops.append(_canonical(name, args))
  return tuple(ops)


@functools.lru_cache(maxsize=None)
def _build(op: str) -> TrainOp:
  name, args = _parse_op(op, op)
  return TRAIN_OPS.get(name)(name, *args)


def apply_train_ops(image: Img, ops: tuple[str, ...], rng: np.random.Generator,
                    image_size: int) -> np.ndarray:
  """Applies the ops (as parse_train_ops returns them) in order; returns a uint8 array.

  `image` may be a decoding.open_image result: the first op decodes it (see decoding.py).
  """
  out = image if decoding.is_undecoded(image) else augment.to_array(image)
  for op in ops:  # Arrays between ops: the array-based ops then convert nothing.
    out = augment.to_array(_build(op)(out, rng, image_size))
  return np.ascontiguousarray(augment.to_array(out))  # No ops: decoded here.


