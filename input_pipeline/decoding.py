"""Image decoding for the input pipeline: header first, pixels when an op needs them.

`open_image` reads only the header. `decode` then decodes a JPEG straight to a 1/2, 1/4 or
1/8 scale when the caller's output still gets at least its full resolution from it (libjpeg's
DCT scaling through PIL's `draft`; entropy decoding is not reduced, so the saving is smaller
than the pixel count suggests). Every failure is a CorruptImageError, which the pipeline
counts and skips. `to_rgb` scales 16-bit images to 8 bits (PIL's convert clips them).
"""
import io
import os
import re

import numpy as np
from PIL import Image, ImageFile


class CorruptImageError(ValueError):
  """The bytes are not a decodable image (bad header, truncated or broken data)."""


class CorruptRecordError(ValueError):
  """A stored record cannot be read (e.g. an ArrayRecord chunk whose checksum does not
  match); the pipeline skips and counts it like a corrupt image."""


class UnreadableShardError(ValueError):
  """A whole shard file cannot be read (e.g. its index is gone): the data is broken, not one
  record, and the run stops naming the file."""


class StorageUnavailableError(ValueError):
  """A record's reads kept failing for the storage or network (runtime.transient), retried
  over a while: the data may be intact, so the run stops rather than skip records."""


def is_non_image(name: str) -> bool:
  """True for a file name whose extension no image format PIL reads uses (notes.txt,
  labels.json, a README.md): such files are ignored, not counted as corrupt images. Names
  without an extension are tried as images."""
  suffix = os.path.splitext(name)[1].lower()
  if not suffix:
    return False
  Image.init()
  return suffix not in Image.registered_extensions()


def text_name(name: str) -> str:
  """A file name as valid UTF-8 text: the bytes of a name that are not UTF-8 (the OS and
  tarfile hand them over as lone surrogates) written as \\xNN, as Python's backslashreplace
  does: latin-1 b'caf\\xe9.jpg' -> the text caf\\xe9.jpg. tfds text features and Beam's string
  coder refuse lone surrogates; UTF-8 names are returned unchanged."""
  try:
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
  except UnicodeEncodeError:  # Other lone surrogates (a JSON '\\ud800' escape): kept visible.
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


_STREAM_REPR = re.compile(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>")


def open_image(data: bytes) -> Image.Image:
  """Reads only the header of PNG/JPEG/... bytes; the first op that needs pixels decodes them
  (see the module docstring). Raises CorruptImageError if the header is not an image's."""
  if not data:
    raise CorruptImageError("empty (0 bytes), not an image")
  try:
    return Image.open(io.BytesIO(data))
  except Exception as e:  # pylint: disable=broad-except
    # PIL reports bad data through many types (UnidentifiedImageError, SyntaxError,
    # DecompressionBombError, ...); any of them means the record is unusable. Its message
    # names the in-memory stream, not the file: the caller names that.
    text = _STREAM_REPR.sub("", str(e)).strip()
    raise CorruptImageError(f"{type(e).__name__}: {text} ({len(data)} bytes)") from e


# PIL modes of 16-bit single-channel images (16-bit grey PNGs open as 'I;16'; 'I' is 32-bit).
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")


def to_rgb(image: Image.Image) -> Image.Image:
  """An 8-bit RGB image of a decoded one. 16-bit grey ('I;16...', or 'I' holding values in
  [0, 65535]) keeps each value's high byte, v >> 8, as PIL itself reduces 16-bit RGB PNGs
  when it opens them; PIL's convert('RGB') would clip these at 255 (a mid-grey 16-bit image
  turns white). Other 32-bit integer images (values outside 16 bits) are refused with
  CorruptImageError naming the mode; every other mode goes through PIL's convert."""
  if image.mode == "RGB":
    return image
  if image.mode in SIXTEEN_BIT_MODES + ("I",):
    values = np.asarray(image).astype(np.int64)
    if values.size and (values.min() < 0 or values.max() > 0xFFFF):
      raise CorruptImageError(f"unsupported {image.mode!r} image with values in "
                              f"[{values.min()}, {values.max()}], not 16-bit")
    grey = (values >> 8).astype(np.uint8)
    return Image.fromarray(np.stack([grey] * 3, axis=-1), "RGB")
  return image.convert("RGB")


def is_undecoded(image) -> bool:
  """True for an open_image result whose pixels are not loaded yet (PIL empties `tile`)."""
  return isinstance(image, ImageFile.ImageFile) and bool(image.tile)


def decode_scaled(image: Image.Image, max_factor: int = 1) -> tuple[Image.Image, int]:
  """Decodes an open_image result to RGB, a JPEG downscaled in the decoder by the largest of
  8, 4, 2 that is <= max_factor; returns (image, factor used). Errors: CorruptImageError."""
  factor = 1
  if max_factor >= 2 and image.format == "JPEG":
    wanted = next(f for f in (8, 4, 2) if f <= max_factor)
    width = image.width
    drafted = image.draft(None, (width // wanted, image.height // wanted))
    if drafted is not None:  # (mode, (0, 0, width / scale, height / scale)).
      factor = round(width / drafted[1][2])
  try:
    image.load()
    return to_rgb(image), factor
  except Exception as e:  # pylint: disable=broad-except
    raise CorruptImageError(f"{type(e).__name__}: {e}") from e


def decode(image, min_width: int = 0, min_height: int = 0):
  """Pixels of an open_image result (RGB), JPEG-downscaled while both sides stay at least
  (min_width, min_height); arrays and RGB images are returned as they are, other decoded
  images converted (PIL decodes WebP and ICO when it opens them, in their own modes)."""
  if not is_undecoded(image):
    if isinstance(image, Image.Image) and image.mode != "RGB":
      try:
        return to_rgb(image)
      except CorruptImageError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        raise CorruptImageError(f"{type(e).__name__}: {e}") from e
    return image
  max_factor = min(image.width // min_width, image.height // min_height) if (
      min_width > 0 and min_height > 0) else 1
  return decode_scaled(image, max_factor)[0]
