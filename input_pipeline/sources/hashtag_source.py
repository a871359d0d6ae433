"""`hashtags:NAME`: SWAG hashtag datasets (Singh et al. 2022) made by the Beam job
(hashtag_job.py), read with head/tail resampling on train; `hashtags:demo` is the demo.

- class_names: the dataset's vocabulary (canonical hashtags, sorted; id = index);
- records: 'image' (encoded bytes), 'hashtag_ids' (sorted vocabulary ids, shipped as a padded
  id list), 'hashtags' (raw tags), 'file_name';
- train has an index_sampler: head/tail resampling (appendix A "Image Sampling"), head share
  alpha = config.data.resample_alpha (default ALPHA = 0.7, the paper's; its Table 4 ablates
  0.5 and 0.3), epochs of as many samples as train images, tail threshold = the one the dataset was
  prepared with (--tail_threshold, default the paper's 5,000), kept in its metadata;
- info.stats: the job's counts (skipped images by reason, raw tags, head/tail).

`hashtags:demo` is made from the demo by the same job on first use (hashtag_demo.py). Reading
needs no Apache Beam.
"""
import pathlib
import re
import struct
from typing import Any
import zipfile

import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.core import read_only_builder

from bigpretrain.swag import resampling
from input_pipeline import datasets
from input_pipeline.sources import demo

FIELD = "hashtag_ids"
BUILDER_NAME = "bigpretrain_hashtags"
LABEL_INDEX = "hashtag_ids-{split}.npz"  # Written by hashtag_job.prepare beside the shards.
PREFIX = "hashtags:"
ALPHA = 0.7  # Head share of the samples (appendix A); config.data.resample_alpha.
ALPHA_KEY = "resample_alpha"
DEMO_NAME = "demo"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]*")


def _npz_array(path: str, name: str) -> np.ndarray:
  """Member `name` of an .npz file, memory-mapped where np.savez stored it uncompressed (the
  bytes of its .npy sit whole inside the zip), else read."""
  with zipfile.ZipFile(path) as archive:
    member = archive.getinfo(name + ".npy")
  if member.compress_type != zipfile.ZIP_STORED:
    with np.load(path) as arrays:
      return arrays[name]
  with open(path, "rb") as f:
    f.seek(member.header_offset)
    header = f.read(30)  # The zip local file header; the .npy follows its name and extra.
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    f.seek(member.header_offset + 30 + name_len + extra_len)
    version = np.lib.format.read_magic(f)
    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                   else np.lib.format.read_array_header_2_0)
    shape, fortran, dtype = read_header(f)
    offset = f.tell()
  if not shape or not np.prod(shape):
    return np.zeros(shape, dtype)
  return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape,
                   order="F" if fortran else "C")


class LabelIndex:
  """A split's label index file ('ids' flat, 'offsets' [N + 1]: image i holds
  ids[offsets[i]:offsets[i + 1]]), memory-mapped: a host reads only its own slice, and the
  index pickles as its path (grain workers)."""

  def __init__(self, path):
    self.path = str(path)
    self._arrays = None

  def _load(self) -> tuple[np.ndarray, np.ndarray]:
    if self._arrays is None:
      self._arrays = (_npz_array(self.path, "ids"), _npz_array(self.path, "offsets"))
    return self._arrays

  def __len__(self) -> int:
    return max(len(self._load()[1]) - 1, 0)

  def slice(self, start: int, stop: int) -> resampling.Labels:
    """Images [start, stop) of the split, read into memory."""
    ids, offsets = self._load()
    bounds = np.asarray(offsets[start:stop + 1], np.int64)
    return resampling.Labels(np.asarray(ids[bounds[0]:bounds[-1]]), bounds - bounds[0])

  def __getstate__(self):
    return {"path": self.path, "_arrays": None}


class HashtagSource(datasets.Source):
  """Records of one split, 'hashtag_ids' as a list of ints; train is resampled.

  Picklable (grain workers): holds the wrapped RecordSource, the label index by its path and
  the vocabulary's image counts.
  """

  def __init__(self, source, labels: LabelIndex | None, *, label_counts=None,
               tail_threshold: int | None = None, alpha: float = ALPHA,
               head_tail: tuple[int, int] | None = None):
    self._source = source
    self.split = source.split
    if tail_threshold is not None and labels is not None and len(labels) != len(source):
      raise ValueError(f"label index of split {self.split!r} has {len(labels)} images, the "
                       f"split {len(source)}; re-run the preparation to rewrite it")
    self._labels = labels
    self._label_counts = label_counts  # f(h) over the split: int [vocabulary size].
    self._tail_threshold = tail_threshold
    self.alpha = alpha
    self._head_tail = head_tail  # The preparation's (head, tail) image counts.

  def configure(self, data_cfg) -> "HashtagSource":
    """This split read with config.data.resample_alpha (datasets.train_sources' hook)."""
    alpha = data_cfg.get(ALPHA_KEY, ALPHA)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
      raise ValueError(f"config.data.{ALPHA_KEY}={alpha!r} must be in [0, 1] (the head share "
                       "of the resampled samples).")
    if self._head_tail is not None:
      head, tail = self._head_tail
      for group, count, asks, fix in (("head", head, alpha > 0, "a lower"),
                                      ("tail", tail, alpha < 1, "a higher")):
        if asks and count == 0:
          raise ValueError(
              f"config.data.{ALPHA_KEY}={alpha} draws {group} images, and split "
              f"{self.split!r} has none at the tail_threshold={self._tail_threshold} it was "
              f"prepared with (hashtags in fewer images are the tail). Prepare it again with "
              f"{fix} --tail_threshold, or set {ALPHA_KEY}={int(group == 'tail')}.")
    return HashtagSource(self._source, self._labels, label_counts=self._label_counts,
                         tail_threshold=self._tail_threshold, alpha=float(alpha),
                         head_tail=self._head_tail)

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> dict[str, Any]:
    record = dict(self._source[index])
    record[FIELD] = [int(i) for i in record[FIELD]]
    return record

  def __repr__(self) -> str:
    return f"HashtagSource(split={self.split!r}, len={len(self)})"

  def resampler(self, seed: int) -> resampling.ResampledIndices:
    """The head/tail resampling over this split's images, epochs of len(self) samples."""
    if self._tail_threshold is None:
      raise ValueError(f"split {self.split!r} is read as it is, without resampling")
    weights, is_tail = resampling.importance(self._labels.slice(0, len(self)),
                                             self._tail_threshold,
                                             label_counts=self._label_counts)
    return resampling.ResampledIndices(weights, is_tail, alpha=self.alpha, num_samples=len(self),
                                       seed=seed)

  def index_sampler(self, seed: int, process_index: int, process_count: int):
    """This host's resampler over its own slice of the images (resampling.host_sampler:
    memory O(images per host), per-epoch stats logged); the pipeline's sampler hook. None
    for splits read as they are."""
    if self._tail_threshold is None:
      return None
    start, stop = resampling.host_slice(len(self), process_index, process_count)
    return resampling.host_sampler(
        self._labels.slice(start, stop), num_images=len(self), label_counts=self._label_counts,
        tail_threshold=self._tail_threshold, alpha=self.alpha, num_samples=len(self), seed=seed,
        process_index=process_index, process_count=process_count, log_epochs=True)


class HashtagDataset(datasets.Dataset):
  """A prepared hashtag dataset: info (class_names = the vocabulary) and split sources."""

  def __init__(self, name: str, builder, image_size: int | None = None):
    self.builder = builder
    meta = dict(builder.info.metadata or {})
    if "vocabulary" not in meta:
      raise ValueError(f"{builder.data_dir} holds no hashtag vocabulary in its metadata; "
                       "prepare it with `python -m input_pipeline.prepare hashtags`.")
    self.vocabulary = [v["label"] for v in meta["vocabulary"]]
    # f(h): the train images holding each label (the job's count, as importance needs).
    self.label_counts = np.asarray([v["images"] for v in meta["vocabulary"]], np.int64)
    self.tail_threshold = int(meta["head_tail"]["tail_threshold"])
    splits = tuple(sorted(builder.info.splits.keys()))
    skipped = dict(meta.get("skipped", {}))
    self.info = datasets.DatasetInfo(
        name=name, num_classes=len(self.vocabulary), class_names=self.vocabulary,
        num_examples={s: int(builder.info.splits[s].num_examples) for s in splits},
        image_size=image_size, splits=splits,
        features={FIELD: int(meta["max_lengths"][FIELD])},
        stats={"raw_hashtags": meta["raw_tags"]["distinct_train_tags"],
               "dropped_unlabelled_train": skipped.get("no_label", 0),
               "skipped": skipped,
               "tail_threshold": self.tail_threshold,
               "tail_train_images": meta["head_tail"]["tail_images"],
               "head_train_images": meta["head_tail"]["head_images"]})

  def source(self, split: str) -> HashtagSource:
    self.check_split(split)
    if split != "train":
      return HashtagSource(_records(self.builder, split), None)
    path = pathlib.Path(self.builder.data_dir) / LABEL_INDEX.format(split=split)
    if not path.exists():
      raise FileNotFoundError(
          f"{path} is missing: re-run `python -m input_pipeline.prepare hashtags` with the "
          "same --data_dir and --name; it writes the label index of a finished dataset.")
    stats = self.info.stats
    return HashtagSource(_records(self.builder, split), LabelIndex(path),
                         label_counts=self.label_counts, tail_threshold=self.tail_threshold,
                         head_tail=(stats["head_train_images"], stats["tail_train_images"]))


def _records(builder, split: str) -> datasets.RecordSource:
  """Random-access records of a split, images left encoded."""
  decoders = {"image": tfds.decode.SkipDecoding()}
  return datasets.RecordSource(builder.as_data_source(split, decoders=decoders), split)


def find(full_name: str, root: pathlib.Path):
  try:
    return read_only_builder.builder_from_files(full_name, data_dir=str(root))
  except tfds.core.registered.DatasetNotFoundError:
    return None


@datasets.SOURCES.register("hashtags:", usage="hashtags:NAME")
@datasets.data_keys(ALPHA_KEY)
def load(name: str, data_dir: str) -> HashtagDataset:
  """'hashtags:NAME': a hashtag dataset prepared in data_dir ('hashtags:demo':
  hashtag_demo.py)."""
  rest = name[len(PREFIX):]
  if not NAME_RE.fullmatch(rest):
    raise ValueError(f"Bad dataset name {name!r}: use 'hashtags:NAME' with NAME the --name "
                     "given to `python -m input_pipeline.prepare hashtags`, or 'hashtags:demo'.")
  root = pathlib.Path(data_dir) if data_dir else datasets.default_data_dir()
  how = (f"Prepare it with `python -m input_pipeline.prepare hashtags --manual_dir=RAW "
         f"--data_dir={root} --name={rest}`.")
  builder = find(f"{BUILDER_NAME}/{rest}", root) if root.is_dir() else None
  if builder is None:
    raise FileNotFoundError(f"No prepared hashtag dataset {name!r} in {root}. {how}")
  return HashtagDataset(name, builder)
