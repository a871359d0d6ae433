"""grain train/eval iterators: decode, augment, skip corrupt records, batch per host.

Sources are random-access (len + __getitem__) and yield dicts with 'image' (encoded PNG/JPEG
bytes) and the fields the objective reads ('label' by default; see record_fields); other keys
are not shipped. Decoding happens in the pipeline (in grain worker processes when
data.num_workers > 0). A source may bring its own index sampler (see _host_sampler), which
replaces shuffle, repeat and the host slice below.

Train: MapDataset.source -> shuffle -> repeat (infinite) [-> weighted mix of several such
streams (mixed_train_iterator)] -> decode + augment (random_map: each record's generator comes
from the seed and its position in the global stream, so augmentations do not depend on worker
or host count; with repeated augmentation the record is decoded once and augmented k times)
-> host slice [process_index::process_count] (all hosts share the stream; host shares are
disjoint) -> to_iter_dataset -> skip and count corrupt records -> batch -> mp_prefetch.
Batches carry uint8 pixels; the jitted steps normalise them on device by data.normalize
(bigpretrain/preprocess.py), which ships a quarter of the bytes a float32 batch would.

Checkpointing: the train iterator is a `grain.DatasetIterator`; `it.get_state()` is a
JSON-serialisable dict and `it.set_state(state)` resumes with exactly the batches the
uninterrupted run would have produced (also with mp_prefetch workers). With Orbax
(grain 0.2.18 ships `grain.checkpoint.CheckpointHandler` plus the args classes
`grain.checkpoint.CheckpointSave` / `grain.checkpoint.CheckpointRestore`, registered with
that handler), save it next to the train state in one CheckpointManager:

  mngr.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(it)))
  mngr.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state),
      data=grain.checkpoint.CheckpointRestore(it)))  # restores `it` in place.

The handler writes one `process_<i>-of-<n>.json` per host (jax.process_index/count), so a
restore needs the same host count and workers per host. On another topology the trainer
continues the global stream instead from a `stream_position.Position` (the `position`
argument of the train iterators); see input_pipeline/stream_position.py.
"""
import dataclasses
import functools
import gc
import math
import os
import re
import signal
import sys
from typing import Any, Iterable, Mapping, Sequence

from absl import logging
import grain
import ml_collections
import numpy as np
import threadpoolctl

from bigpretrain.runtime import units
from input_pipeline import augment
from input_pipeline import augment_spec
from input_pipeline import dataset_base
from input_pipeline import decoding
from input_pipeline import stream_position

# A corrupt record travels to the skip step as {_CORRUPT: source_index}.
_CORRUPT = "_corrupt_index"
# A record the source could not read travels to the decode step as {_UNREADABLE: message}.
_UNREADABLE = "_unreadable_record"
# This many corrupt records in a row means the data is broken, not a few bad files.
_MAX_CONSECUTIVE_CORRUPT = 10_000


def data_defaults() -> ml_collections.ConfigDict:
  """The `config.data` keys this module reads, with their defaults."""
  return ml_collections.ConfigDict(dict(
      name="demo",
      dir="",
      image_size=224,
      train_split="train",
      # The evaluators' split; 'validation[:1000]': a range of its records (tfds's slicing).
      eval_split="validation",
      # '|'-separated ops applied in order; see augment_spec.TRAIN_OPS.
      train_augment="flip",
      # 'squish', 'center_crop', 'shorter_center_crop' or center_crop(F[, bicubic]), e.g.
      # center_crop(0.9, bicubic) (timm's crop_pct 0.9); see augment_spec.eval_resize_op.
      eval_resize="squish",
      # '0_1', 'imagenet' or 'minus1_1' (applied on device); see augment.normalize.
      normalize="0_1",
      # 0 decodes in-process (threads); > 0 starts grain mp_prefetch worker processes.
      num_workers=0,
      # Batches read ahead (per worker process when num_workers > 0).
      prefetch=2,
      # True: a corrupt image raises; False: it is skipped and counted in '_skipped'.
      fail_on_corrupt=False,
      # Repeated augmentation (DeiT-III uses 3): k > 1 puts each train record k times into
      # one host batch, each copy with its own augmentation; see train_iterator.
      repeated_augment=1,
      # Weighted mixing of train sources: '' (off) or 'NAME=WEIGHT;NAME=WEIGHT', datasets
      # named like data.name in data.dir with data.name's classes; data.name gets the rest
      # of the weight (1 - the sum). See datasets.train_sources and mixed_train_iterator.
      mix="",
      # Few-shot training: a seeded per-class draw of this share of data.train_split (1.0 =
      # all); see input_pipeline/subset.py.
      subset_frac=1.0,
      subset_seed=0,
  ))


@dataclasses.dataclass(frozen=True)
class _Settings:
  """Validated data settings (what the workers need, picklable)."""
  image_size: int
  train_ops: tuple[str, ...]
  train_augment: str
  eval_resize: str
  normalize: str
  num_workers: int
  prefetch: int
  fail_on_corrupt: bool
  repeated_augment: int


def _is_int(value: Any) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _settings(data_cfg: Mapping[str, Any] | ml_collections.ConfigDict) -> _Settings:
  """Reads and checks the data config; missing keys take data_defaults() values."""
  cfg = data_defaults().to_dict()
  cfg.update(data_cfg.to_dict() if isinstance(data_cfg, ml_collections.ConfigDict)
             else dict(data_cfg))
  if not _is_int(cfg["image_size"]) or cfg["image_size"] <= 0:
    raise ValueError(f"data.image_size must be a positive int, got {cfg['image_size']!r}")
  if not isinstance(cfg["train_augment"], str):
    raise ValueError(f"data.train_augment must be a str, got {cfg['train_augment']!r}")
  train_ops = augment_spec.parse_train_ops(cfg["train_augment"])
  augment_spec.eval_resize_op(cfg["eval_resize"])  # Validates it.
  if cfg["normalize"] not in augment.NORMALIZE_PRESETS:
    raise ValueError(f"unknown data.normalize={cfg['normalize']!r}; "
                     f"expected one of {augment.NORMALIZE_PRESETS}")
  if not _is_int(cfg["num_workers"]) or cfg["num_workers"] < 0:
    raise ValueError(f"data.num_workers must be an int >= 0, got {cfg['num_workers']!r}")
  if not _is_int(cfg["prefetch"]) or cfg["prefetch"] < 1:
    raise ValueError(f"data.prefetch must be an int >= 1, got {cfg['prefetch']!r}")
  if not isinstance(cfg["fail_on_corrupt"], bool):
    raise ValueError(f"data.fail_on_corrupt must be a bool, got {cfg['fail_on_corrupt']!r}")
  if not _is_int(cfg["repeated_augment"]) or cfg["repeated_augment"] < 1:
    raise ValueError("data.repeated_augment must be an int >= 1 (1 = off), got "
                     f"{cfg['repeated_augment']!r}")
  return _Settings(
      image_size=int(cfg["image_size"]), train_ops=train_ops,
      train_augment=cfg["train_augment"], eval_resize=cfg["eval_resize"],
      normalize=cfg["normalize"], num_workers=int(cfg["num_workers"]),
      prefetch=int(cfg["prefetch"]), fail_on_corrupt=cfg["fail_on_corrupt"],
      repeated_augment=int(cfg["repeated_augment"]))


def check_data_config(data_cfg) -> None:
  """Raises ValueError naming the first bad data.* setting this module reads; cheap, for
  validating a config before any data is opened."""
  _settings(data_cfg)


def _per_host_batch(global_batch_size: int, process_index: int, process_count: int) -> int:
  """Checks the batch/host arguments and returns the per-host batch size."""
  if not _is_int(process_count) or process_count < 1:
    raise ValueError(f"process_count must be a positive int, got {process_count!r}")
  if not _is_int(process_index) or not 0 <= process_index < process_count:
    raise ValueError(f"process_index must be in [0, {process_count}), got {process_index!r}")
  if not _is_int(global_batch_size) or global_batch_size <= 0:
    raise ValueError(f"global_batch_size must be a positive int, got {global_batch_size!r}")
  if global_batch_size % process_count:
    raise ValueError(f"global_batch_size={global_batch_size} is not divisible by "
                     f"process_count={process_count}")
  return global_batch_size // process_count


def num_eval_batches(n: int, global_batch_size: int) -> int:
  """Batches every host yields for an eval set of n examples: ceil(n / global_batch_size)."""
  return math.ceil(n / global_batch_size)


def decode_image(data: bytes) -> np.ndarray:
  """Decodes PNG/JPEG bytes in full to uint8 [H, W, 3] RGB; raises decoding.CorruptImageError
  (a ValueError) if the bytes are not an image."""
  return np.asarray(decoding.decode(decoding.open_image(data)))


def _corrupt(index, error: Exception, fail: bool) -> None:
  """Raises for a corrupt image or unreadable record when `fail`, else logs it (the caller
  skips the record)."""
  what = "unreadable" if isinstance(error, decoding.CorruptRecordError) else "corrupt image in"
  if fail:
    raise ValueError(f"{what} record {index}: {error}") from error
  logging.log_every_n_seconds(logging.WARNING, "Skipping %s record %s: %s", 10, what, index,
                              error)


class _ReadGuard:
  """source[i], or {_UNREADABLE: message} for a record the source cannot read
  (decoding.CorruptRecordError, e.g. a broken ArrayRecord chunk): the decode step then skips
  and counts it like a corrupt image. A shard unreadable as a whole still raises."""

  def __init__(self, source):
    self._source = source

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index):
    try:
      return self._source[index]
    except decoding.CorruptRecordError as e:
      return {_UNREADABLE: str(e)}


def _image_bytes(record: Mapping[str, Any], index) -> bytes:
  if _UNREADABLE in record:
    raise decoding.CorruptRecordError(record[_UNREADABLE])
  if "image" not in record:
    raise KeyError(f"record {index} has no 'image' key (keys: {sorted(record)})")
  return record["image"]


class _WithSourceIndex(grain.transforms.MapWithIndex):
  """record -> (reference, record) for error messages: the source index (indices past the
  end wrap, as in grain's repeat), or 'i of source s' when several sources are mixed."""

  def __init__(self, num_records: int, source_id: int | None = None):
    self._n = num_records
    self._source_id = source_id

  def map_with_index(self, index: int, record):
    if self._source_id is None:
      return index % self._n, record
    return f"{index % self._n} of source {self._source_id}", record


DEFAULT_FIELDS = {"label": 0}


def _check_fields(fields: Mapping[str, int]) -> dict[str, int]:
  fields = dict(fields)
  for name, size in fields.items():
    if name in ("image", "mask", "index") or name.startswith(("_", "num_")):
      raise ValueError(f"batch field {name!r} is reserved")
    if not _is_int(size) or size < 0:
      raise ValueError(f"batch field {name!r}: size must be 0 (scalar) or the padded length "
                       f"of an id list, got {size!r}")
  return fields


def record_fields(record: Mapping[str, Any], fields: Mapping[str, int], index) -> dict:
  """The shipped fields of a record: scalars as int32/float32; an id list (size K > 0) as
  int32 [K] padded with -1 plus its length in 'num_<name>'."""
  out = {}
  for name, size in fields.items():
    if name not in record:
      raise KeyError(f"record {index} has no field {name!r} (keys: {sorted(record)})")
    value = record[name]
    if size == 0:
      floating = np.issubdtype(np.asarray(value).dtype, np.floating)  # float or np.float32.
      out[name] = np.asarray(value, np.float32 if floating else np.int32)
      continue
    ids = np.asarray(value, np.int64).reshape(-1)
    if len(ids) > size:
      raise ValueError(f"record {index} has {len(ids)} entries in {name!r}, more than its "
                       f"padded length {size}; raise the dataset's max length for {name!r}")
    padded = np.full((size,), -1, np.int32)
    padded[:len(ids)] = ids
    out[name], out[f"num_{name}"] = padded, np.int32(len(ids))
  return out


def empty_fields(fields: Mapping[str, int], scalar_dtypes: Mapping[str, Any] = None) -> dict:
  """Zero scalars (int32, or the dtype `scalar_dtypes` gives, so that a padded batch keeps a
  float field's dtype) and all-padding id lists: the fields of a padding row."""
  out = {}
  for name, size in fields.items():
    if size == 0:
      out[name] = np.zeros((), (scalar_dtypes or {}).get(name, np.int32))
    else:
      out[name], out[f"num_{name}"] = np.full((size,), -1, np.int32), np.int32(0)
  return out


class _TrainDecode(grain.transforms.RandomMap):
  """(source index, record) -> {'image' uint8, fields...} or a corrupt marker.

  With repeated augmentation k > 1, 'image' is [k, S, S, 3]: the record decoded once and
  augmented k times in a row with the record's generator.
  """

  def __init__(self, settings: _Settings, fields: Mapping[str, int]):
    self._s = settings
    self._fields = dict(fields)

  def random_map(self, element, rng: np.random.Generator):
    index, record = element
    try:
      image = decoding.open_image(_image_bytes(record, index))
      if self._s.repeated_augment > 1:  # Decode once, in full, for all the copies.
        image = decoding.decode(image)
      # The first op decodes a single copy (JPEGs at a reduced scale where it allows).
      copies = [self._augment(image, rng, index) for _ in range(self._s.repeated_augment)]
    except (decoding.CorruptImageError, decoding.CorruptRecordError) as e:
      _corrupt(index, e, self._s.fail_on_corrupt)
      return {_CORRUPT: index}
    out = copies[0] if len(copies) == 1 else np.stack(copies)
    return {"image": out, **record_fields(record, self._fields, index)}

  def _augment(self, image, rng: np.random.Generator, index) -> np.ndarray:
    size = self._s.image_size
    image = augment_spec.apply_train_ops(image, self._s.train_ops, rng, size)
    if image.shape != (size, size, 3):
      raise ValueError(
          f"data.train_augment={self._s.train_augment!r} made a {image.shape} image from "
          f"record {index}, expected ({size}, {size}, 3); include a resizing op "
          f"(one of {augment_spec.RESIZING_OPS})")
    return image


class _SkipCorruptIterator(grain.DatasetIterator):
  """Drops corrupt markers and stores how many preceded each element in '_skipped'."""

  def __init__(self, parent: grain.DatasetIterator, max_consecutive: int):
    super().__init__(parent)
    self._max_consecutive = max_consecutive

  def __next__(self):
    skipped = 0
    while True:
      element = next(self._parent)
      if _CORRUPT not in element:
        element["_skipped"] = np.int32(skipped)
        return element
      skipped += 1
      if skipped >= self._max_consecutive:
        raise RuntimeError(
            f"{skipped} corrupt records in a row (last: record {element[_CORRUPT]}); "
            "the data source looks broken")

  # The skip step holds no state between elements: the parent's state is the whole state.
  def get_state(self):
    return self._parent.get_state()

  def set_state(self, state):
    self._parent.set_state(state)


class _SkipCorruptIterDataset(grain.IterDataset):
  """IterDataset wrapper for _SkipCorruptIterator."""

  def __init__(self, parent: grain.IterDataset, max_consecutive: int):
    super().__init__(parent)
    self._max_consecutive = max_consecutive

  def __iter__(self):
    return _SkipCorruptIterator(self._parent.__iter__(), self._max_consecutive)


class _FinishTrainBatch(grain.transforms.Map):
  """Sums the per-row skip counts to one int32 scalar; images stay uint8 (the jitted step
  normalises them on device).

  Repeated augmentation: [b / k, k, S, S, 3] becomes [b, S, S, 3] copy-major (row
  c * b / k + j is copy c of record j); the other fields are tiled alike.
  """

  def map(self, batch):
    images = batch.pop("image")
    skipped = np.int32(batch.pop("_skipped").sum())
    if images.ndim == 5:
      k = images.shape[1]
      images = images.swapaxes(0, 1).reshape((-1,) + images.shape[2:])
      batch = {name: np.tile(v, (k,) + (1,) * (v.ndim - 1)) for name, v in batch.items()}
    return {"image": images, **batch, "_skipped": skipped}


def _read_options(buffer: int, settings: _Settings) -> grain.ReadOptions:
  """Reads `buffer` elements ahead. In-process, up to 16 threads decode in parallel (PIL
  releases the GIL); in each worker process 2 threads overlap reading with decoding, as the
  workers already fill the cores (more threads only add contention)."""
  threads = 16 if settings.num_workers == 0 else 2
  return grain.ReadOptions(num_threads=min(threads, buffer), prefetch_buffer_size=buffer)


def _one_thread_per_worker(worker_index: int, worker_count: int) -> None:
  """Worker process init: the BLAS and OpenMP thread pools (numpy's OpenBLAS and the one
  OpenCV bundles) default to one thread per core, so W workers on C cores would hold W x C
  threads; each worker is one core's worth of work. (OpenCV's own pool is set to one thread
  where augment.py is imported.)"""
  del worker_index, worker_count
  threadpoolctl.threadpool_limits(1)


def _maybe_mp_prefetch(ds: grain.IterDataset, settings: _Settings) -> grain.IterDataset:
  if settings.num_workers == 0:
    return ds
  return ds.mp_prefetch(grain.MultiprocessingOptions(
      num_workers=settings.num_workers, per_worker_buffer_size=settings.prefetch),
      worker_init_fn=_one_thread_per_worker)


SHARED_MEMORY = "/dev/shm"


def shared_memory_shortfall(data_cfg, per_process_batch: int, iterators: int = 1,
                            processes: int = 1, path: str = SHARED_MEMORY) -> str | None:
  """What to do when `path`, where grain's worker processes hand their batches over, has less
  free space than `processes` processes on the host (each with `iterators` worker-fed
  iterators of `data_cfg`'s workers: a train stream and its evaluations) fill with batches of
  `per_process_batch` images: each worker holds up to data.prefetch finished batches there
  and writes one more. Past it a worker dies of SIGBUS. None when it fits, with no workers,
  or without such a folder."""
  settings = _settings(data_cfg)
  num_workers, prefetch = settings.num_workers, settings.prefetch
  batch_bytes = per_process_batch * settings.image_size ** 2 * 3  # uint8 images; labels few.
  if num_workers == 0 or not os.path.isdir(path):
    return None
  stat = os.statvfs(path)
  free = stat.f_bavail * stat.f_frsize
  count = processes * iterators * num_workers * (prefetch + 1)
  need = count * batch_bytes
  if free >= need:
    return None
  on_host = f"{processes} processes on this host x " if processes > 1 else ""
  return (f"{path} has {units.size(free)} free, and the data workers fill up to "
          f"{units.size(need)} there ({count} batches of {units.size(batch_bytes)}: {on_host}"
          f"{iterators} x {num_workers} workers x (data.prefetch={prefetch} + 1)); a worker "
          "that finds it full dies of SIGBUS. Give the container more shared memory (docker "
          "run --shm-size=...), or lower data.num_workers or data.prefetch.")


_WORKER_DEATH = re.compile(r"Worker process was terminated unexpectedly with exit code (-?\d+)")


def worker_death(e: BaseException) -> str | None:
  """'a data worker process died (how: the likely cause)' when `e` is grain's report of a
  worker process that ended (the out-of-memory killer, a full SHARED_MEMORY), else None."""
  code = _WORKER_DEATH.search(str(e)) if isinstance(e, RuntimeError) else None
  if code is None:
    return None
  code = int(code.group(1))
  how = (f"killed by {signal.Signals(-code).name}" if code < 0 and -code in
         signal.valid_signals() else f"exit code {code}")
  likely = {-signal.SIGKILL: ": most likely the out-of-memory killer; see `dmesg`",
            -signal.SIGBUS: f": most likely {SHARED_MEMORY} was full, where workers hand "
                            "their batches over (docker run --shm-size=...)"}.get(code, "")
  return f"a data worker process died ({how}{likely})"


def _derived_seed(seed: int, *keys: int) -> int:
  """A 32-bit seed for one use (shuffling source i, augmenting) of the run's seed."""
  return int(np.random.SeedSequence((seed, *keys)).generate_state(1)[0])


def _check_seed(seed: int) -> None:
  if not _is_int(seed) or seed < 0:
    raise ValueError(f"seed must be a non-negative int, got {seed!r}")


class _SampledStream(grain.MapDataset):
  """Infinite (source index, record) stream of one host: position j reads
  source[sampler[j]]."""

  def __init__(self, source, sampler):
    super().__init__()
    self._source = source
    self._sampler = sampler

  def __len__(self) -> int:
    return sys.maxsize

  def __getitem__(self, position):
    if isinstance(position, slice):
      return self.slice(position)
    index = int(self._sampler[position])
    return index, self._source[index]


def _source_stream(source, seed: int, source_id: int | None) -> grain.MapDataset:
  """Infinite stream of (reference, record): a new shuffle of `source` every epoch."""
  if len(source) == 0:
    name = "train source" if source_id is None else f"train source {source_id}"
    raise ValueError(f"{name} is empty")
  ds = grain.MapDataset.source(source)
  ds = ds.map_with_index(_WithSourceIndex(len(source), source_id))
  return ds.shuffle(seed=_derived_seed(seed, 1, source_id or 0)).repeat()


def _host_sampler(source, seed: int, process_index: int, process_count: int):
  """The source's own index sampler for this host (dataset_base.Source.index_sampler, e.g.
  a resampler), or None; a plain sequence of records has none."""
  if not isinstance(source, dataset_base.Source) or source.index_sampler is None:
    return None
  return source.index_sampler(seed, process_index, process_count)


def _train_batches(stream: grain.MapDataset, settings: _Settings, *, global_batch_size: int,
                   seed: int, process_index: int, process_count: int,
                   fields: Mapping[str, int], host_stream: bool = False,
                   position: stream_position.Position | None = None
                   ) -> grain.DatasetIterator:
  """Repeated augmentation, decode + augment, [the rest of the global stream after
  `position`,] host slice (unless the stream is already this host's, `host_stream`), skip
  corrupt, batch, workers."""
  per_host = _per_host_batch(global_batch_size, process_index, process_count)
  k = settings.repeated_augment
  if per_host % k:
    raise ValueError(f"data.repeated_augment={k} must divide the per-host batch "
                     f"{per_host} (global_batch_size={global_batch_size}, "
                     f"process_count={process_count})")
  records = per_host // k  # Distinct records per host batch.
  position = position or stream_position.Position()
  if host_stream and not position.at_start:
    raise ValueError(
        "this train source draws its own per-host sample stream (index_sampler), which has "
        "no global order to continue on another topology; resume with the process count and "
        "data.num_workers the checkpoint was written with")
  if host_stream:
    ds = stream.random_map(_TrainDecode(settings, fields),
                           seed=_derived_seed(seed, 2, process_index))
  else:
    ds = stream.random_map(_TrainDecode(settings, fields), seed=_derived_seed(seed, 2))
    if not position.at_start:
      ds = stream_position.ContinuedStream(ds, position)
    ds = ds[process_index::process_count]
  read = _read_options(settings.prefetch * records, settings)
  it_ds = _SkipCorruptIterDataset(ds.to_iter_dataset(read), _MAX_CONSECUTIVE_CORRUPT)
  it_ds = it_ds.batch(records, drop_remainder=True)
  # Batching last in the workers lets grain write batches into shared memory (no pickled
  # copy per batch); the cheap finish runs in this process.
  return iter(_maybe_mp_prefetch(it_ds, settings).map(_FinishTrainBatch()))


def train_iterator(source, data_cfg, *, global_batch_size: int, seed: int,
                   process_index: int, process_count: int,
                   fields: Mapping[str, int] = DEFAULT_FIELDS,
                   position: stream_position.Position | None = None
                   ) -> grain.DatasetIterator:
  """Infinite, shuffled, augmented, checkpointable iterator over this host's batches.

  Batches: 'image' uint8 [b, S, S, 3], the `fields` (name -> 0 for a scalar, int32 [b]; or
  K for an id list, int32 [b, K] padded with -1 plus 'num_<name>' int32 [b]; default
  'label'), '_skipped' int32 scalar (corrupt records this host skipped while making the
  batch), with b = global_batch_size // process_count.

  A source with an `index_sampler` (dataset_base.Source) is read in the sampler's order on
  each host instead of shuffled and sliced across hosts.

  Repeated augmentation, data.repeated_augment = k > 1 (k must divide b): each host batch
  holds b / k records from the stream (host slicing as above), each decoded once and
  augmented k times; row c * (b / k) + j is copy c of record j, so with the batch split
  contiguously over the host's devices the copies sit b / k rows apart (on different devices
  when the host has at least k). An epoch of len(source) rows thus shows len(source) / k
  distinct records; a full pass over the data takes k epochs (timm's RASampler instead
  shows a random n / k subset each epoch).

  `position` (default: the beginning) continues the global stream after the records a run
  on another topology already read (see stream_position.py).
  """
  return mixed_train_iterator([source], [1.0], data_cfg, global_batch_size=global_batch_size,
                              seed=seed, process_index=process_index,
                              process_count=process_count, fields=fields, position=position)


def mixed_train_iterator(sources: Sequence, weights: Sequence[float], data_cfg, *,
                         global_batch_size: int, seed: int, process_index: int,
                         process_count: int,
                         fields: Mapping[str, int] = DEFAULT_FIELDS,
                         position: stream_position.Position | None = None
                         ) -> grain.DatasetIterator:
  """Like train_iterator, over a weighted mix of one or more sources (one: train_iterator).

  Each source is shuffled (its own seed from `seed`) and repeated on its own, then
  grain's MapDataset.mix interleaves them in a fixed pattern in which source i fills a share
  weights[i] / sum(weights) of every long enough window of the global stream (grain rounds
  the weights to integers, the smallest scaled to 100). Labels are taken from each source as
  they are (map them to one label space beforehand if they differ). Checkpointing, host
  slicing and repeated augmentation work as in train_iterator; with several sources a
  corrupt record is reported as 'record i of source s'.
  """
  settings = _settings(data_cfg)
  _check_seed(seed)
  sources, weights = list(sources), list(weights)
  if not sources:
    raise ValueError("mixed_train_iterator needs at least one source")
  if len(weights) != len(sources):
    raise ValueError(f"got {len(sources)} sources but {len(weights)} weights")
  for i, w in enumerate(weights):
    if isinstance(w, bool) or not isinstance(w, (int, float, np.number)) or not (
        math.isfinite(w) and w > 0):
      raise ValueError(f"weight {i} must be a positive finite number, got {w!r}")
  fields = _check_fields(fields)
  batches = functools.partial(_train_batches, settings=settings,
                              global_batch_size=global_batch_size, seed=int(seed),
                              process_index=process_index, process_count=process_count,
                              fields=fields, position=position)
  samplers = [_host_sampler(src, int(seed), process_index, process_count) for src in sources]
  sources = [_ReadGuard(src) for src in sources]
  if any(s is not None for s in samplers):
    if len(sources) > 1:
      raise ValueError("a source with its own index sampler cannot be mixed with other "
                       "sources; leave data.mix empty")
    return batches(_SampledStream(sources[0], samplers[0]), host_stream=True)
  ids = range(len(sources)) if len(sources) > 1 else [None]  # None: no 'of source s'.
  streams = [_source_stream(src, int(seed), i) for i, src in zip(ids, sources)]
  stream = streams[0] if len(streams) == 1 else grain.MapDataset.mix(
      streams, [float(w) for w in weights])
  return batches(stream)


class _PaddedHostSource:
  """Host p's eval rows: row k is source[p + k * process_count], or padding past the end."""

  def __init__(self, source, process_index: int, process_count: int, num_rows: int):
    self._source = source
    self._n = len(source)
    self._p = process_index
    self._count = process_count
    self._num_rows = num_rows

  def __len__(self) -> int:
    return self._num_rows

  def __getitem__(self, k: int) -> tuple[int, Mapping[str, Any] | None]:
    g = self._p + k * self._count
    return (g, self._source[g]) if g < self._n else (-1, None)


def _scalar_dtypes(source, fields: Mapping[str, int]) -> dict[str, np.dtype]:
  """The dtype of each scalar field as record_fields ships it, from the split's first record:
  every batch then has the same dtypes, padded or not, on every host (one host's batch of
  padding alone would otherwise differ). int32 where that record cannot be read."""
  scalars = {name: 0 for name, size in fields.items() if size == 0}
  if not scalars or not len(source):
    return {}
  try:
    return {k: v.dtype for k, v in record_fields(source[0], scalars, 0).items()}
  except decoding.StorageUnavailableError:
    raise  # Not the record's fault: the run stops (datasets.READ_RETRY_WAITS_S).
  except (decoding.CorruptRecordError, KeyError, ValueError):  # Its rows say so when read.
    return {}


class _EvalDecode(grain.transforms.Map):
  """(index, record) -> eval row; padding and corrupt rows are zeros with mask 0."""

  def __init__(self, settings: _Settings, fields: Mapping[str, int],
               scalar_dtypes: Mapping[str, Any]):
    self._s = settings
    self._fields = dict(fields)
    self._dtypes = dict(scalar_dtypes)

  def map(self, element):
    index, record = element
    size = self._s.image_size
    image = None
    if record is not None:
      try:  # The resize decodes (JPEGs at a reduced scale where it allows).
        image = decoding.open_image(_image_bytes(record, index))
        image = np.asarray(augment_spec.eval_resize_op(self._s.eval_resize)(image, size))
      except (decoding.CorruptImageError, decoding.CorruptRecordError) as e:
        _corrupt(index, e, self._s.fail_on_corrupt)
        image = None
    if image is None:
      return {"image": np.zeros((size, size, 3), np.uint8),
              **empty_fields(self._fields, self._dtypes),
              "mask": np.float32(0), "index": np.int64(-1),
              "_skipped": np.int32(record is not None)}
    return {"image": image, **record_fields(record, self._fields, index),
            "mask": np.float32(1), "index": np.int64(index), "_skipped": np.int32(0)}


class _FinishEvalBatch(grain.transforms.Map):
  """Sums the per-row skip counts to one int32 scalar; images stay uint8."""

  def map(self, batch):
    return {**batch, "_skipped": np.int32(batch["_skipped"].sum())}


def eval_iterator(source, data_cfg, *, global_batch_size: int, process_index: int,
                  process_count: int,
                  fields: Mapping[str, int] = DEFAULT_FIELDS) -> Iterable[dict]:
  """Re-iterable eval batches of this host; every host yields the same number of batches.

  Host p takes source rows p, p + P, p + 2P, ... (P = process_count) and pads them to
  num_eval_batches(len(source), global_batch_size) batches of global_batch_size // P rows.
  Batches: 'image' uint8 [b, S, S, 3], the `fields` as in train_iterator (zeros and
  padding in mask-0 rows), 'mask' float32 [b] (1 = real
  example, 0 = padding or corrupt), 'index' int64 [b] (source index, -1 for mask-0 rows),
  '_skipped' int32 scalar (corrupt records in the batch). Across hosts every source record
  appears exactly once.
  """
  settings = _settings(data_cfg)
  per_host = _per_host_batch(global_batch_size, process_index, process_count)
  num_rows = num_eval_batches(len(source), global_batch_size) * per_host
  ds = grain.MapDataset.source(
      _PaddedHostSource(_ReadGuard(source), process_index, process_count, num_rows))
  fields = _check_fields(fields)
  ds = ds.map(_EvalDecode(settings, fields, _scalar_dtypes(source, fields)))
  finish = _FinishEvalBatch()
  if settings.num_workers == 0:
    # In-process: threads decode single records, then rows are grouped into batches.
    read = _read_options(settings.prefetch * per_host, settings)
    return ds.to_iter_dataset(read).batch(per_host).map(finish)
  # With workers, batch the MapDataset so each worker builds whole batches: the batch count
  # and order stay those of the in-process path.
  ds = ds.batch(per_host).map(finish)
  read = _read_options(settings.prefetch, settings)
  return _FreedAtEnd(_maybe_mp_prefetch(ds.to_iter_dataset(read), settings))


class _FreedAtEnd:
  """Iterates a worker-fed IterDataset, each pass closing its iterator and freeing the
  workers' last batches when it ends: grain keeps them (shared memory) in the frames of the
  exhausted iterator's StopIteration, a reference cycle only the cyclic collector breaks,
  so each evaluation would hold them until a collection ran (at exit: reported as leaked)."""

  def __init__(self, ds: grain.IterDataset):
    self._ds = ds

  def __iter__(self):
    it = iter(self._ds)
    try:
      yield from it
    finally:
      it.close()
      gc.collect()
