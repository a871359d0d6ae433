"""Input-pipeline throughput against a plain decode loop: one JSON line.

  python benchmarks/input_pipeline.py [--workers=2] [--batch_size=32] [--batches=60] \
      [--source_size=400x300] [--augment='inception_crop|flip|randaugment(2, 9)']

Source: --records synthetic photo-like JPEGs (--source_size, default 400 x 300 like an average
ImageNet photo; quality 90: colour fields with the 1/f amplitude spectrum of natural images
plus a few sharp-edged shapes, about 70 KiB at 400 x 300, so they decode about as slowly as
photos of that size), written once per run with
array_record's ArrayRecordWriter to a temporary .array_record file and read back through
grain's ArrayRecordDataSource, the way prepared datasets are read.

Measured on those records:
  - pipeline: input_pipeline.pipeline.train_iterator with the configured workers (grain
    mp_prefetch processes) doing decode + --augment (default inception crop to 224, flip,
    RandAugment(2, 9)) + batching to uint8 batches; timed over --batches batches after
    --warmup batches (worker start-up excluded);
  - decode loop: a single-threaded Python loop reading each record and decoding it in full
    with pipeline.decode_image (PIL), repeated for at least --decode_seconds.
The pipeline's first op may decode a JPEG at 1/2-1/8 scale where its output allows (see
input_pipeline/augment.py); the decode loop always decodes in full, as a plain loop would.
`ratio` = pipeline records/s / decode-loop records/s. `images_per_sec` and `step_time_ms` are
the pipeline's (per batch); `peak_rss_mb` is this process, `peak_rss_workers_mb` the largest
worker.
"""
import io
import json
import os
import resource
import sys
import tempfile
import time

# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# input_pipeline package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from absl import app
from absl import flags
from array_record.python import array_record_module
import grain
import numpy as np
from PIL import Image, ImageDraw

from input_pipeline import pipeline  # pylint: disable=g-import-not-at-top

_RECORDS = flags.DEFINE_integer("records", 256, "Synthetic JPEGs written to ArrayRecord.")
_WORKERS = flags.DEFINE_integer("workers", 2, "grain worker processes (data.num_workers).")
_BATCH = flags.DEFINE_integer("batch_size", 32, "Batch size (one host).")
_BATCHES = flags.DEFINE_integer("batches", 60, "Timed pipeline batches.")
_WARMUP = flags.DEFINE_integer("warmup", 4, "Untimed pipeline batches first.")
_SIZE = flags.DEFINE_integer("image_size", 224, "Train crop size.")
_AUGMENT = flags.DEFINE_string("augment", "inception_crop|flip|randaugment(2, 9)",
                               "data.train_augment.")
_DECODE_SECONDS = flags.DEFINE_float("decode_seconds", 3.0, "Minimum decode-loop time.")
_SOURCE_SIZE = flags.DEFINE_string("source_size", "400x300", "WIDTHxHEIGHT of the JPEGs.")

QUALITY = 90


def _pink_noise(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
  """A [height, width] field with the 1/f amplitude spectrum of natural images, std 1."""
  fy = np.fft.fftfreq(height)[:, None]
  fx = np.fft.rfftfreq(width)[None, :]
  f = np.hypot(fx, fy)
  f[0, 0] = 1.0
  spectrum = (rng.normal(size=f.shape) + 1j * rng.normal(size=f.shape)) / f
  spectrum[0, 0] = 0.0
  field = np.fft.irfft2(spectrum, s=(height, width))
  return field / field.std()


def synthetic_jpeg(seed: int, width: int = 400, height: int = 300) -> bytes:
  """A JPEG with photo-like statistics: 1/f luminance and colour fields, a few sharp-edged
  shapes (about 70 KiB at 400 x 300 and quality 90, like an ImageNet photo that size)."""
  rng = np.random.default_rng(seed)
  lum = 50 * _pink_noise(rng, width, height)
  c1, c2 = 20 * _pink_noise(rng, width, height), 20 * _pink_noise(rng, width, height)
  pixels = np.stack([lum + c1, lum - 0.5 * (c1 + c2), lum + c2], -1) + rng.integers(60, 200, 3)
  image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
  draw = ImageDraw.Draw(image)
  for _ in range(4):
    x, y = int(rng.integers(0, width)), int(rng.integers(0, height))
    w = int(rng.integers(width // 20, int(width / 2.5)))
    h = int(rng.integers(height // 15, int(height / 2.5)))
    colour = tuple(int(c) for c in rng.integers(0, 256, 3))
    shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
    shape([x, y, x + w, y + h], fill=colour)
  buf = io.BytesIO()
  image.save(buf, "JPEG", quality=QUALITY)
  return buf.getvalue()


def write_records(path: str, num: int, width: int, height: int) -> None:
  writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
  for i in range(num):
    writer.write(synthetic_jpeg(i, width, height))
  writer.close()


class JpegRecords:
  """Random-access {'image': JPEG bytes, 'label': int} over one ArrayRecord file (picklable)."""

  def __init__(self, path: str):
    self._path = path
    self._source = grain.sources.ArrayRecordDataSource([path])

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> dict:
    return {"image": self._source[index], "label": index % 1000}

  def __reduce__(self):
    return JpegRecords, (self._path,)


def decode_loop(source, min_seconds: float) -> float:
  """Records/s of a single-threaded read + decode loop."""
  done, t0 = 0, time.perf_counter()
  while True:
    for i in range(len(source)):
      pipeline.decode_image(source[i]["image"])
    done += len(source)
    elapsed = time.perf_counter() - t0
    if elapsed >= min_seconds:
      return done / elapsed


def pipeline_rate(source) -> tuple[float, float]:
  """(records/s, seconds per batch) of the train pipeline."""
  cfg = pipeline.data_defaults()
  cfg.image_size = _SIZE.value
  cfg.train_augment = _AUGMENT.value
  cfg.num_workers = _WORKERS.value
  it = pipeline.train_iterator(source, cfg, global_batch_size=_BATCH.value, seed=0,
                               process_index=0, process_count=1)
  try:
    for _ in range(_WARMUP.value):
      next(it)
    t0 = time.perf_counter()
    for _ in range(_BATCHES.value):
      batch = next(it)
    elapsed = time.perf_counter() - t0
    assert batch["image"].shape == (_BATCH.value, _SIZE.value, _SIZE.value, 3)
  finally:
    if hasattr(it, "close"):
      it.close()
  return _BATCHES.value * _BATCH.value / elapsed, elapsed / _BATCHES.value


def main(argv):
  del argv
  width, height = (int(v) for v in _SOURCE_SIZE.value.lower().split("x"))
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "jpegs.array_record")
    write_records(path, _RECORDS.value, width, height)
    source = JpegRecords(path)
    mean_bytes = float(np.mean([len(source[i]["image"]) for i in range(len(source))]))
    decode_rps = decode_loop(source, _DECODE_SECONDS.value)
    pipe_rps, batch_s = pipeline_rate(source)
  print(json.dumps({
      "benchmark": "input_pipeline",
      "source": f"array_record: {_RECORDS.value} synthetic {width}x{height} JPEGs "
                f"(quality {QUALITY}, mean {mean_bytes / 1024:.1f} KiB)",
      "augment": _AUGMENT.value, "image_size": _SIZE.value, "workers": _WORKERS.value,
      "batch_size": _BATCH.value, "cpu_count": os.cpu_count(),
      "pipeline_records_per_sec": round(pipe_rps, 1),
      "decode_loop_records_per_sec": round(decode_rps, 1),
      "ratio": round(pipe_rps / decode_rps, 3),
      "images_per_sec": round(pipe_rps, 1),
      "step_time_ms": round(1e3 * batch_s, 2),
      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
      "peak_rss_workers_mb": round(
          resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
  }))


if __name__ == "__main__":
  app.run(main)
