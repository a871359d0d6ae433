"""Input-pipeline throughput against a plain decode loop or a timm DataLoader: one JSON line.

  python benchmarks/input_pipeline.py [--workers=2] [--batch_size=32] [--min_seconds=15] \
      [--source_size=400x300 | --data_dir=DIR] \
      [--augment='inception_crop|flip|randaugment(2, 9)'] [--records=256] \
      [--dataset_size=1281167] [--peer [--rounds=3] | --stages | --ceiling]

Every rate is a steady-state rate (benchmarks/steady_state.py): after two batches from every
worker, whole rounds over the workers for at least --min_seconds (or --batches_per_worker
rounds); with records/s per worker and the CPU seconds per record of the workers and of this
(consuming) process.

Source: --records synthetic photo-like JPEGs (--source_size, default 400 x 300 like an average
ImageNet photo; quality 90: colour fields with the 1/f amplitude spectrum of natural images
plus a few sharp-edged shapes, about 70 KiB at 400 x 300, so they decode about as slowly as
photos of that size), written once per run with
array_record's ArrayRecordWriter to a temporary .array_record file and read back through
grain's ArrayRecordDataSource, the way prepared datasets are read. The source presents
--dataset_size records (default 1,281,167, ImageNet-1k's train split) cycling over the written
JPEGs, so that per-record costs that depend on the dataset size (grain's index shuffle) are
those of a real dataset. --data_dir instead reads the train split of an `imagenet21k_p`
dataset prepared there by `python -m input_pipeline.prepare imagenet21k_p` (224 x 224 JPEGs
at quality 75; benchmarks/photo_set.py writes a raw folder of photo crops for it), presented
the same way as --dataset_size records cycling over its records.

Measured on those records:
  - pipeline: input_pipeline.pipeline.train_iterator with the configured workers (grain
    mp_prefetch processes) doing decode + --augment (default inception crop to 224, flip,
    RandAugment(2, 9)) + batching to uint8 batches, in steady state;
  - decode loop: a single-threaded Python loop reading each record and decoding it in full
    with pipeline.decode_image (PIL), repeated for at least --decode_seconds.
The pipeline's first op may decode a JPEG at 1/2-1/8 scale where its output allows (see
input_pipeline/augment.py); the decode loop always decodes in full, as a plain loop would.
`ratio` = pipeline records/s / decode-loop records/s. `images_per_sec` and `step_time_ms` are
the pipeline's (the median round's with --peer; per batch); `peak_rss_mb` is this process, `peak_rss_workers_mb` the largest
worker.

--peer (needs torch and timm) replaces the decode loop with the tool users would otherwise
pick: a torch DataLoader with --workers worker processes over the same records, timm's train
transforms (create_transform(is_training=True, auto_augment='rand-m9-n2',
interpolation='bilinear', use_prefetcher=True): RandomResizedCrop 224, flip, RandAugment(2, 9)
with timm's op set and magnitudes, colour jitter off as timm turns it off under RandAugment;
PIL decode of the whole JPEG) and uint8 batches from timm's fast_collate. The two run
alternately, --rounds times each, each in steady state;
`peer_ratio` is the median of the per-round ratios (the machine may be shared: alternation
exposes both to the same load); `*_cpu_ms_per_record` is the CPU time (user + system, main
process and workers) each spent per record, which other load changes less than rates.

--ceiling measures the serial ceiling: what the consuming process can take when the workers
do almost nothing. Records are uint8 224 x 224 x 3 pixels as binary PPM (a header and the raw
bytes: PIL's "decode" is a copy) in an uncompressed ArrayRecord file, the augmentation is
'squish' to the same size (a copy), and this process does what the trainer does with each
batch: takes it from the workers and copies it to the local devices (sharding.global_batch).
`consumer_ceiling_records_per_sec` = 1 / this process's CPU seconds per record: the rate at
which the consumer's own work would fill one core, whatever the workers' cores;
`busiest_thread_ceiling_records_per_sec` = 1 / its busiest thread's, where its threads run on
cores of their own.

--stages times, in one process and without workers, each stage of --augment per record (in
microseconds, mean over --records records): decode (the JPEG decode the crop asks for), crop
and resize (inception_crop or squish less its decode), cutout, randaugment, flip, the rest of the op chain
(header read, conversion to an array) and batching (stacking a batch), in CPU time of the
thread (time.thread_time: what each costs the worker, less sensitive to other load on the
machine than wall time). The stages are found by
wrapping the module functions by name, so the same command times an older checkout of
input_pipeline put first on PYTHONPATH.
"""
import importlib
import io
import json
import math
import os
import resource
import sys
import tempfile
import time

# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# input_pipeline package; the repository comes last (an older checkout on PYTHONPATH wins).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE] + [
    os.path.dirname(_HERE)]

from absl import app
from absl import flags
from array_record.python import array_record_module
import grain
import numpy as np
from PIL import Image, ImageDraw

from benchmarks import steady_state  # pylint: disable=g-import-not-at-top
from bigpretrain.runtime import distributed
from input_pipeline import pipeline

_RECORDS = flags.DEFINE_integer("records", 256, "Synthetic JPEGs written to ArrayRecord.")
_DATASET_SIZE = flags.DEFINE_integer(
    "dataset_size", 1_281_167, "Records the source presents (cycling over the --records "
    "JPEGs); default ImageNet-1k's train split.")
_WORKERS = flags.DEFINE_integer("workers", 2, "grain worker processes (data.num_workers).")
_BATCH = flags.DEFINE_integer("batch_size", 32, "Batch size (one host).")
_MIN_SECONDS = flags.DEFINE_float("min_seconds", steady_state.MIN_SECONDS,
                                  "Least timed seconds of each pipeline rate.")
_BATCHES_PER_WORKER = flags.DEFINE_integer(
    "batches_per_worker", None, "Timed batches per worker instead of --min_seconds.")
_SIZE = flags.DEFINE_integer("image_size", 224, "Train crop size.")
_AUGMENT = flags.DEFINE_string("augment", "inception_crop|flip|randaugment(2, 9)",
                               "data.train_augment.")
_DECODE_SECONDS = flags.DEFINE_float("decode_seconds", 3.0, "Minimum decode-loop time.")
_SOURCE_SIZE = flags.DEFINE_string("source_size", "400x300", "WIDTHxHEIGHT of the JPEGs.")
_PEER = flags.DEFINE_bool("peer", False, "Compare with a torch DataLoader + timm transforms.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "--peer: alternating rounds of each.")
_STAGES = flags.DEFINE_bool("stages", False, "Per-record CPU cost of each stage instead.")
_CEILING = flags.DEFINE_bool("ceiling", False, "The consumer's serial ceiling instead.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Read the train split of imagenet21k_p "
                                "prepared here instead of synthetic JPEGs.")

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
  """Random-access {'image': JPEG bytes, 'label': int} over one ArrayRecord file (picklable),
  presenting `size` records: record i is the file's record i % (records in the file).

  The presented size matters: grain's index shuffle costs about 120 us per element over 256
  records but about 6 us over ImageNet's 1.28M (its cost per element falls with the dataset
  size), so a source of only the written records would charge the pipeline for a cost that
  real datasets do not have.
  """

  def __init__(self, path: str, size: int | None = None):
    self._path = path
    self._source = grain.sources.ArrayRecordDataSource([path])
    self.num_written = len(self._source)
    self._size = size or self.num_written

  def __len__(self) -> int:
    return self._size

  def __getitem__(self, index: int) -> dict:
    return {"image": self._source[index % self.num_written], "label": index % 1000}

  def __reduce__(self):
    return JpegRecords, (self._path, self._size)


class PreparedRecords:
  """The train split of `imagenet21k_p` prepared in `data_dir` (its tfds records: 'image'
  JPEG bytes, 'label', 'file_name'), presenting `size` records as JpegRecords does: record i
  is the split's record i % (its length). Picklable (the split's source is)."""

  def __init__(self, data_dir: str, size: int | None = None):
    from input_pipeline import datasets  # pylint: disable=g-import-not-at-top
    cfg = pipeline.data_defaults()
    cfg.name, cfg.dir = datasets.IMAGENET21K_P, data_dir
    self._source = datasets.get_dataset(cfg).source("train")
    self.num_written = len(self._source)
    self._size = size or self.num_written

  def __len__(self) -> int:
    return self._size

  def __getitem__(self, index: int) -> dict:
    return self._source[index % self.num_written]


def decode_loop(source, min_seconds: float) -> float:
  """Records/s of a single-threaded read + decode loop."""
  done, t0 = 0, time.perf_counter()
  while True:
    for i in range(source.num_written):
      pipeline.decode_image(source[i]["image"])
    done += source.num_written
    elapsed = time.perf_counter() - t0
    if elapsed >= min_seconds:
      return done / elapsed


def _steady(it, consume=None) -> dict:
  """steady_state.measure of `it` with this command's flags."""
  return steady_state.measure(it, batch_size=_BATCH.value, workers=_WORKERS.value,
                              min_seconds=_MIN_SECONDS.value,
                              batches_per_worker=_BATCHES_PER_WORKER.value, consume=consume)


def _check_images(images, shape: tuple[int, ...]):
  if images.shape != shape or str(images.dtype) not in ("uint8", "torch.uint8"):
    raise AssertionError(f"batch images {images.dtype} {tuple(images.shape)}, expected "
                         f"uint8 {shape}")


def pipeline_rate(source, augment: str | None = None, consume=None) -> dict:
  """Steady-state figures of the train pipeline over `source` with `augment` (default
  --augment); `consume` is what this process does with each batch besides taking it."""
  cfg = pipeline.data_defaults()
  cfg.image_size = _SIZE.value
  cfg.train_augment = augment or _AUGMENT.value
  cfg.num_workers = _WORKERS.value
  it = pipeline.train_iterator(source, cfg, global_batch_size=_BATCH.value, seed=0,
                               process_index=0, process_count=1)
  size = _SIZE.value

  def check_and_consume(batch):
    _check_images(batch["image"], (_BATCH.value, size, size, 3))
    if consume:
      consume(batch)

  try:
    return _steady(it, check_and_consume)
  finally:
    if hasattr(it, "close"):
      it.close()


_PEER_LENGTH = 1_000_000  # Records one peer epoch presents: more than any timed run takes.


class _PeerRecords:
  """The records as a torch map-style dataset: PIL image (decoded in full) -> timm transform;
  index i reads record i % len(source), so one pass covers every timed batch."""

  def __init__(self, source, transform, length: int):
    self._source, self._transform, self._length = source, transform, length

  def __len__(self) -> int:
    return self._length

  def __getitem__(self, i: int):
    record = self._source[i % len(self._source)]
    image = Image.open(io.BytesIO(record["image"])).convert("RGB")
    return self._transform(image), record["label"]


def peer_rate(source, seed: int) -> dict:
  """Steady-state figures of a torch DataLoader with timm's train transforms."""
  import timm.data  # pylint: disable=g-import-not-at-top
  import timm.data.loader  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  if _AUGMENT.value != "inception_crop|flip|randaugment(2, 9)":
    raise ValueError("--peer runs timm's 'inception crop, flip, rand-m9-n2' only; leave "
                     f"--augment at its default (got {_AUGMENT.value!r})")
  transform = timm.data.create_transform(
      _SIZE.value, is_training=True, auto_augment="rand-m9-n2", interpolation="bilinear",
      use_prefetcher=True)  # use_prefetcher: uint8 CHW arrays, no normalisation.
  loader = torch.utils.data.DataLoader(
      _PeerRecords(source, transform, _PEER_LENGTH), batch_size=_BATCH.value, shuffle=True,
      num_workers=_WORKERS.value, collate_fn=timm.data.loader.fast_collate, drop_last=True,
      prefetch_factor=2 if _WORKERS.value else None,
      generator=torch.Generator().manual_seed(seed))
  it = iter(loader)
  shape = (_BATCH.value, 3, _SIZE.value, _SIZE.value)
  try:
    return _steady(it, lambda batch: _check_images(batch[0], shape))
  finally:
    del it


class _StageTimer:
  """Wraps module functions by name and adds up the time spent inside each stage (a stage's
  function called from inside the same stage is not counted twice)."""

  def __init__(self):
    self.seconds = {}
    self._active = set()

  def wrap(self, module, name: str, stage: str) -> None:
    fn = getattr(module, name, None)
    if fn is None:
      return
    def timed(*args, **kwargs):
      if stage in self._active:
        return fn(*args, **kwargs)
      self._active.add(stage)
      t0 = time.thread_time()
      try:
        return fn(*args, **kwargs)
      finally:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.thread_time() - t0
        self._active.discard(stage)
    setattr(module, name, timed)


def stage_costs(source) -> dict[str, float]:
  """CPU microseconds per record of each stage, the least of 3 passes over the records."""
  from input_pipeline import augment, augment_spec, decoding  # pylint: disable=g-import-not-at-top
  ops = augment_spec.parse_train_ops(_AUGMENT.value)
  images = [source[i]["image"] for i in range(source.num_written)]
  n = len(images)
  best = {}
  for _ in range(3):
    timer = _StageTimer()
    for name in ("decode_scaled", "decode_array", "decode"):
      timer.wrap(decoding, name, "decode")
    timer.wrap(augment, "inception_crop", "crop_resize")
    timer.wrap(augment, "squish", "crop_resize")
    timer.wrap(augment, "cutout", "cutout")
    timer.wrap(augment, "rand_augment", "randaugment")
    timer.wrap(augment, "random_flip", "flip")
    t0 = time.thread_time()
    outs = []
    for i, data in enumerate(images):
      outs.append(augment_spec.apply_train_ops(decoding.open_image(data), ops,
                                               np.random.default_rng(i), _SIZE.value))
    total = time.thread_time() - t0
    t0 = time.thread_time()
    for start in range(0, n - _BATCH.value + 1, _BATCH.value):
      np.stack(outs[start:start + _BATCH.value])
    batching = (time.thread_time() - t0) / (n // _BATCH.value) / _BATCH.value * n
    for module in (decoding, augment):  # Undo the wrapping.
      importlib.reload(module)
    sec = dict(timer.seconds)
    if "crop_resize" in sec:  # The resizing op decodes: its own share without the decode.
      sec["crop_resize"] -= sec.get("decode", 0.0)
    sec["other"] = total - sum(sec.values())
    sec["batching"] = batching
    sec["total"] = total + batching
    for k, v in sec.items():
      best[k] = min(best.get(k, math.inf), 1e6 * v / n)
  return {k: round(v, 1) for k, v in best.items()}


def write_ppm_records(path: str, num: int, size: int) -> None:
  """`num` random uint8 size x size x 3 images as binary PPM in an uncompressed ArrayRecord
  file: prepared pixels that a worker reads and copies without decoding."""
  rng = np.random.default_rng(0)
  writer = array_record_module.ArrayRecordWriter(path, "group_size:1,uncompressed")
  for _ in range(num):
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), np.uint8)).save(buf, "PPM")
    writer.write(buf.getvalue())
  writer.close()


def ceiling(source) -> dict:
  """Steady-state figures of the pipeline over PPM records with a same-size squish, each
  batch copied to the local devices as the trainer does; plus the consumer's ceiling."""
  import jax  # pylint: disable=g-import-not-at-top
  from bigpretrain import sharding  # pylint: disable=g-import-not-at-top
  mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
  out = pipeline_rate(source, "squish", lambda batch: jax.block_until_ready(
      sharding.global_batch(batch, mesh)))
  # Between these two (benchmarks/steady_state.py); None below the CPU clock's resolution.
  per_sec = lambda cpu_s: 1 / cpu_s if cpu_s else None
  out["consumer_ceiling_records_per_sec"] = per_sec(out["consumer_cpu_s_per_record"])
  out["busiest_thread_ceiling_records_per_sec"] = per_sec(
      out["consumer_busiest_thread_cpu_s_per_record"])
  out["devices"] = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
  return out


def _source_text(source, what: str) -> str:
  mean_bytes = float(np.mean([len(source[i]["image"]) for i in range(source.num_written)]))
  return (f"array_record: {len(source)} records cycling over {source.num_written} {what} "
          f"(mean {mean_bytes / 1024:.1f} KiB)")


def _report(figures: dict) -> dict:
  return {k: round(v, 1) if k.endswith("_sec") and v is not None else v
          for k, v in steady_state.report(figures).items()}


def main(argv):
  del argv
  distributed.select_platforms()  # No plugin errors on a host without their devices.
  width, height = (int(v) for v in _SOURCE_SIZE.value.lower().split("x"))
  common = {"benchmark": "input_pipeline", "augment": _AUGMENT.value,
            "image_size": _SIZE.value, "workers": _WORKERS.value,
            "batch_size": _BATCH.value, "cpu_count": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2)}
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "records.array_record")
    if _CEILING.value:
      write_ppm_records(path, _RECORDS.value, _SIZE.value)
      source = JpegRecords(path, _DATASET_SIZE.value)
      out = ceiling(source)
      print(json.dumps({**common, "mode": "ceiling", "augment": "squish",
                        "source": _source_text(source, f"uint8 {_SIZE.value}-px PPMs"),
                        **_report(out)}))
      return
    if _DATA_DIR.value:
      source = PreparedRecords(_DATA_DIR.value, _DATASET_SIZE.value)
      common["source"] = _source_text(source, f"imagenet21k_p JPEGs in {_DATA_DIR.value}")
    else:
      write_records(path, _RECORDS.value, width, height)
      source = JpegRecords(path, _DATASET_SIZE.value)
      common["source"] = _source_text(
          source, f"synthetic {width}x{height} JPEGs (quality {QUALITY})")
    if _STAGES.value:
      print(json.dumps({**common, "mode": "stages", "input_pipeline": os.path.dirname(
          pipeline.__file__), "us_per_record": stage_costs(source)}))
      return
    if _PEER.value:
      ours, peers = [], []
      for r in range(_ROUNDS.value):
        ours.append(pipeline_rate(source))
        peers.append(peer_rate(source, seed=r))
      rates = lambda runs: [round(o["records_per_sec"], 1) for o in runs]
      cpu_ms = lambda o: round(1e3 * (o["worker_cpu_s_per_record"]
                                      + o["consumer_cpu_s_per_record"]), 2)
      ratios = [o["records_per_sec"] / p["records_per_sec"] for o, p in zip(ours, peers)]
      print(json.dumps({
          **common, "mode": "peer",
          "pipeline_records_per_sec": rates(ours), "peer_records_per_sec": rates(peers),
          "peer_ratios": [round(x, 3) for x in ratios],
          "peer_ratio": round(float(np.median(ratios)), 3),
          "pipeline_cpu_ms_per_record": [cpu_ms(o) for o in ours],
          "peer_cpu_ms_per_record": [cpu_ms(p) for p in peers],
          "timed_batches": [o["timed_batches"] for o in ours],
          "images_per_sec": float(np.median(rates(ours))),
          "step_time_ms": round(float(np.median(
              [1e3 * o["timed_s"] / o["timed_batches"] for o in ours])), 2),
          "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
      }))
      return
    decode_rps = decode_loop(source, _DECODE_SECONDS.value)
    pipe = pipeline_rate(source)
  print(json.dumps({
      **common, **_report(pipe),
      "decode_loop_records_per_sec": round(decode_rps, 1),
      "ratio": round(pipe["records_per_sec"] / decode_rps, 3),
      "peak_rss_workers_mb": round(
          resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
  }))


if __name__ == "__main__":
  app.run(main)
