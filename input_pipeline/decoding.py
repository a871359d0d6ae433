"""Image decoding for the input pipeline: header first, pixels when an op needs them.

`open_image` reads only the header. `decode` then decodes a JPEG straight to a 1/2, 1/4 or
1/8 scale when the caller's output still gets at least its full resolution from it (libjpeg's
DCT scaling through PIL's `draft`; entropy decoding is not reduced, so the saving is smaller
than the pixel count suggests). Every failure is a CorruptImageError, which the pipeline
counts and skips.
"""
import io

from PIL import Image, ImageFile


class CorruptImageError(ValueError):
  """The bytes are not a decodable image (bad header, truncated or broken data)."""


def open_image(data: bytes) -> Image.Image:
  """Reads only the header of PNG/JPEG/... bytes; the first op that needs pixels decodes them
  (see the module docstring). Raises CorruptImageError if the header is not an image's."""
  try:
    return Image.open(io.BytesIO(data))
  except Exception as e:  # pylint: disable=broad-except
    # PIL reports bad data through many types (UnidentifiedImageError, SyntaxError,
    # DecompressionBombError, ...); any of them means the record is unusable.
    raise CorruptImageError(f"{type(e).__name__}: {e}") from e


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
    return (image if image.mode == "RGB" else image.convert("RGB")), factor
  except Exception as e:  # pylint: disable=broad-except
    raise CorruptImageError(f"{type(e).__name__}: {e}") from e


def decode(image, min_width: int = 0, min_height: int = 0):
  """Pixels of an open_image result (RGB), JPEG-downscaled while both sides stay at least
  (min_width, min_height); arrays and decoded images are returned as they are."""
  if not is_undecoded(image):
    return image
  max_factor = min(image.width // min_width, image.height // min_height) if (
      min_width > 0 and min_height > 0) else 1
  return decode_scaled(image, max_factor)[0]
