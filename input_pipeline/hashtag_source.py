"""`hashtags:demo`: the demo dataset read as a SWAG hashtag dataset (Singh et al. 2022).

The demo's 'hashtags' (class lemmas written as Instagram tags, plus noise tags) are mapped
through the WordNet canonicalisation (bigpretrain.hashtags.vocabulary, appendix A):
- vocabulary: canonical_hashtag of every distinct tag of the train split, tags without one
  dropped, sorted (deterministic on every host); it is the class list (class_names);
- each record gains 'hashtag_ids', the sorted distinct vocabulary ids of its tags;
- train images left without a label are dropped (DatasetInfo.stats counts them); validation
  keeps every image (the soft_target metrics count only labelled ones);
- train has an index_sampler: head/tail resampling (appendix A "Image Sampling"), alpha 0.7,
  epochs of as many samples as train images.

Computing this reads every record and loads WordNet (seconds for the demo), so the result is
cached as JSON (vocabulary and per-record ids) next to the demo's files and read from there.
"""
import json
import os
import pathlib
from typing import Any

import numpy as np

from bigpretrain.hashtags import resampling
from bigpretrain.hashtags import vocabulary
from input_pipeline import datasets
from input_pipeline import demo

FIELD = "hashtag_ids"
SPLITS = ("train", "validation")
ALPHA = 0.7  # Head share of the samples (appendix A).
# Head = labels in at least this many train images (the paper's 5,000 is for billions of
# images). The demo's 109 labels are in 45-686 of its ~17k labelled train images; at 200
# both the head and the tail hold a good part of the labels and of the images.
DEMO_TAIL_THRESHOLD = 200
_CACHE_VERSION = 1
_CACHE_NAME = "hashtags_v1.json"


def canonical_ids(tags, index: dict[str, int], canonical: dict[str, str | None]) -> list[int]:
  """Raw tags -> sorted distinct vocabulary ids (tags without a label, or unseen, dropped)."""
  ids = {index[c] for c in (canonical.get(t) for t in tags) if c is not None and c in index}
  return sorted(ids)


def build_labels(records_by_split: dict[str, list[list[str]]]) -> dict[str, Any]:
  """{'vocabulary': sorted canonical labels of the train tags, 'labels': {split: [ids per
  record]}} from each split's raw tag lists (the work the cache saves)."""
  distinct = sorted({t for split in records_by_split.values() for tags in split for t in tags})
  canonical = {t: vocabulary.canonical_hashtag(t) for t in distinct}
  train_tags = {t for tags in records_by_split["train"] for t in tags}
  labels = sorted({canonical[t] for t in train_tags if canonical[t] is not None})
  index = {label: i for i, label in enumerate(labels)}
  return {"version": _CACHE_VERSION, "vocabulary": labels,
          "raw_hashtags": len(train_tags),
          "labels": {split: [canonical_ids(tags, index, canonical) for tags in lists]
                     for split, lists in records_by_split.items()}}


def _read_cache(path: pathlib.Path) -> dict | None:
  try:
    cached = json.loads(path.read_text())
  except (FileNotFoundError, json.JSONDecodeError):
    return None
  return cached if cached.get("version") == _CACHE_VERSION else None


def demo_labels(builder) -> dict[str, Any]:
  """build_labels of the demo's splits, cached in the demo's data folder."""
  path = pathlib.Path(builder.data_dir) / _CACHE_NAME
  cached = _read_cache(path)
  if cached is not None:
    return cached
  with demo.file_lock(path.with_name(f".{_CACHE_NAME}.lock")):
    cached = _read_cache(path)  # Another process may have written it meanwhile.
    if cached is not None:
      return cached
    base = datasets.Dataset("demo", builder)
    tags = {}
    for split in SPLITS:
      source = base.source(split)
      tags[split] = [source[i]["hashtags"] for i in range(len(source))]
    result = build_labels(tags)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(result, separators=(",", ":")))
    tmp.replace(path)  # Atomic: readers never see half a file.
  return result


class HashtagSource:
  """Records of one split with 'hashtag_ids' added; train skips images without a label.

  Picklable (grain workers): holds the wrapped RecordSource and plain arrays.
  """

  def __init__(self, source, labels: list[list[int]], *, drop_unlabelled: bool,
               tail_threshold: int | None = None):
    self._source = source
    self.split = source.split
    keep = [i for i, ids in enumerate(labels) if ids or not drop_unlabelled]
    self._indices = np.asarray(keep, np.int64)
    self._labels = [labels[i] for i in keep]
    self._tail_threshold = tail_threshold

  def __len__(self) -> int:
    return len(self._indices)

  def __getitem__(self, index: int) -> dict[str, Any]:
    if not 0 <= index < len(self):
      raise IndexError(f"record {index} outside {self!r}")
    record = dict(self._source[int(self._indices[index])])
    record[FIELD] = list(self._labels[index])
    return record

  def __repr__(self) -> str:
    return f"HashtagSource(split={self.split!r}, len={len(self)})"

  def resampler(self, seed: int) -> resampling.ResampledIndices:
    """The head/tail resampling over this split's images, epochs of len(self) samples."""
    if self._tail_threshold is None:
      raise ValueError(f"split {self.split!r} is read as it is, without resampling")
    weights, is_tail = resampling.importance(self._labels, self._tail_threshold)
    return resampling.ResampledIndices(weights, is_tail, alpha=ALPHA, num_samples=len(self),
                                       seed=seed)

  def index_sampler(self, seed: int, process_index: int, process_count: int):
    """This host's resampler over its own slice of the images (resampling.host_sampler:
    memory O(images per host), per-epoch stats logged); the pipeline's sampler hook. None
    for splits read as they are."""
    if self._tail_threshold is None:
      return None
    start, stop = resampling.host_slice(len(self), process_index, process_count)
    counts = np.bincount(np.concatenate([np.asarray(ids, np.int64) for ids in self._labels]))
    return resampling.host_sampler(
        self._labels[start:stop], num_images=len(self), label_counts=counts,
        tail_threshold=self._tail_threshold, alpha=ALPHA, num_samples=len(self), seed=seed,
        process_index=process_index, process_count=process_count, log_epochs=True)


class HashtagDataset:
  """`hashtags:demo`: info (class_names = the canonical labels) and per-split sources."""

  def __init__(self, name: str, data_dir: str):
    builder = demo.prepare(data_dir or None)
    self._base = datasets.Dataset("demo", builder)
    cached = demo_labels(builder)
    self.vocabulary = list(cached["vocabulary"])
    self._labels = cached["labels"]
    train = self._labels["train"]
    kept = [ids for ids in train if ids]
    max_len = max(len(ids) for split in SPLITS for ids in self._labels[split])
    _, is_tail = resampling.importance(kept, DEMO_TAIL_THRESHOLD)
    self.info = datasets.DatasetInfo(
        name=name, num_classes=len(self.vocabulary), class_names=self.vocabulary,
        num_examples={"train": len(kept), "validation": len(self._labels["validation"])},
        image_size=self._base.info.image_size, splits=SPLITS,
        features={FIELD: max_len},
        stats={"raw_hashtags": cached["raw_hashtags"],
               "dropped_unlabelled_train": len(train) - len(kept),
               "tail_threshold": DEMO_TAIL_THRESHOLD,
               "tail_train_images": int(is_tail.sum())})

  def source(self, split: str) -> HashtagSource:
    if split not in SPLITS:
      raise ValueError(f"Unknown split {split!r} for dataset {self.info.name!r}; known "
                       f"splits: {list(SPLITS)}.")
    return HashtagSource(self._base.source(split), self._labels[split],
                         drop_unlabelled=split == "train",
                         tail_threshold=DEMO_TAIL_THRESHOLD if split == "train" else None)


def load(name: str, data_dir: str) -> HashtagDataset:
  """Loader for datasets.register_source."""
  if name != "hashtags:demo":
    raise ValueError(f"Unknown hashtag dataset {name!r}; built in: 'hashtags:demo'.")
  return HashtagDataset(name, data_dir)
