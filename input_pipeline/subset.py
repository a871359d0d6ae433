"""Few-shot training sets: a seeded per-class draw of a share of a labelled split.

SWAG (Singh et al. 2022, section 4.2, Table 2) fine-tunes on 1% and 10% of ImageNet-1k's
training images, following SimCLRv2 and SEER. `config.data.subset_frac` (1.0 = all) and
`config.data.subset_seed` select them here for any single-label dataset:
- class c with n_c train records keeps k_c = max(1, floor(frac * n_c + 1/2)) of them (rounded
  half up, never zero, so that no class disappears from a 1% draw of a small class);
- which ones: the first k_c of a permutation of the class's record indices (ascending) drawn
  by numpy's Generator seeded with (subset_seed, c). Each class's draw depends only on the
  seed, its own records and c, so the 1% subset lies inside the 10% one for the same seed;
- the kept indices are read in ascending order; the trainer shuffles them as any source.

Finding the classes reads every record of the split once (the labels are inside the
records), once per process and per run.

Also here: record ranges of a split (RangeSource), and splits named with tfds's record slice,
'validation[:1000]' (split_source), as the evaluators read them.
"""
import re
from typing import Any, Mapping

from absl import logging
import numpy as np

from input_pipeline import dataset_base
from input_pipeline import decoding


def per_class_counts(class_sizes, frac: float) -> np.ndarray:
  """k_c = max(1, floor(frac * n_c + 1/2)) for every class with n_c > 0 (0 for empty ones)."""
  n = np.asarray(class_sizes, np.int64)
  k = np.maximum(1, np.floor(frac * n + 0.5).astype(np.int64))
  return np.where(n > 0, np.minimum(k, n), 0)


def per_class_draw(labels, frac: float, seed: int) -> np.ndarray:
  """Sorted indices into `labels` (int class ids [N]) of the per-class draw (module doc)."""
  check_frac(frac)
  labels = np.asarray(labels)
  if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
    raise ValueError(f"labels must be a 1-D array of int class ids, got {labels.dtype} "
                     f"{labels.shape}")
  if labels.size and labels.min() < 0:
    raise ValueError(f"labels must be >= 0, got {labels.min()}")
  if frac == 1.0:
    return np.arange(len(labels), dtype=np.int64)
  order = np.argsort(labels, kind="stable")  # Each class's indices, ascending.
  classes, starts, sizes = np.unique(labels[order], return_index=True, return_counts=True)
  keep = []
  for c, start, size, k in zip(classes, starts, sizes, per_class_counts(sizes, frac)):
    members = order[start:start + size]
    rng = np.random.default_rng([int(seed), int(c)])
    keep.append(members[rng.permutation(size)[:k]])
  return np.sort(np.concatenate(keep)) if keep else np.zeros((0,), np.int64)


def check_frac(frac: Any) -> None:
  if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 1:
    raise ValueError(f"data.subset_frac={frac!r} must be a number in (0, 1] (1 = the whole "
                     "split; 0.01 = 1% of each class).")


class SubsetSource(dataset_base.Source):
  """The records `indices` of `source`, renumbered 0..len-1 (picklable for grain workers)."""

  def __init__(self, source, indices):
    self._source = source
    self._indices = np.asarray(indices, np.int64)
    if self._indices.ndim != 1 or (self._indices.size and (
        self._indices.min() < 0 or self._indices.max() >= len(source))):
      raise ValueError(f"Record indices must be a 1-d array in [0, {len(source)}).")
    self.split = getattr(source, "split", None)

  @property
  def indices(self) -> np.ndarray:
    """The kept records' indices in `source`, ascending."""
    return self._indices

  def __len__(self) -> int:
    return len(self._indices)

  def __getitem__(self, index: int):
    if not 0 <= index < len(self):
      raise IndexError(f"record {index} outside {self!r}")
    return self._source[int(self._indices[index])]

  def __repr__(self) -> str:
    return f"SubsetSource({self._source!r}, len={len(self)})"


class RangeSource(SubsetSource):
  """Records [start, stop) of `source`, renumbered from 0."""

  def __init__(self, source, start: int, stop: int):
    if not 0 <= start <= stop <= len(source):
      raise ValueError(f"Bad record range [{start}, {stop}) of a source of {len(source)}.")
    super().__init__(source, np.arange(start, stop, dtype=np.int64))
    self.start, self.stop = start, stop


# A split with tfds's record slice: 'validation[:1000]', 'train[-500:]'.
_SLICED_SPLIT = re.compile(r"(?P<name>[^\[\]]+)\[(?P<start>-?\d*):(?P<stop>-?\d*)\]")


def split_name(split: str) -> str:
  """The split `split` reads from: 'validation[:1000]' -> 'validation'."""
  sliced = _SLICED_SPLIT.fullmatch(split)
  return sliced["name"] if sliced else split


def check_split(info, split: str, where: str) -> None:
  """ValueError naming `where` and the dataset's splits unless `split` (or the split it
  slices, split_name) is one of `info.splits`."""
  if split_name(split) not in info.splits:
    raise ValueError(f"{where}: dataset {info.name!r} has no split {split!r}; its splits: "
                     f"{list(info.splits)}.")


def split_source(dataset, split: str):
  """`dataset.source(split)`; 'NAME[START:STOP]' (tfds's slicing by records, Python's bounds:
  either may be left out or count from the end) is that range of split NAME's records."""
  sliced = _SLICED_SPLIT.fullmatch(split)
  if sliced is None:
    if "[" in split:
      raise ValueError(f"Split {split!r}: a slice of a split is NAME[START:STOP] with integer "
                       "bounds, e.g. 'validation[:1000]'.")
    return dataset.source(split)
  source = dataset.source(sliced["name"])
  bound = lambda text: int(text) if text else None
  start, stop, _ = slice(bound(sliced["start"]), bound(sliced["stop"])).indices(len(source))
  if stop <= start:
    raise ValueError(f"Split {split!r} of {dataset.info.name!r} holds no records (split "
                     f"{sliced['name']!r} has {len(source)}).")
  return RangeSource(source, start, stop)


def _read(source, ids) -> list:
  """The records `ids` of `source`; None for one that cannot be read (CorruptRecordError, which
  training skips and counts too)."""
  try:
    return (source.__getitems__(ids) if hasattr(source, "__getitems__")
            else [source[i] for i in ids])
  except decoding.CorruptRecordError:
    out = []
    for i in ids:
      try:
        out.append(source[i])
      except decoding.CorruptRecordError:
        out.append(None)
    return out


def labels(source) -> np.ndarray:
  """int64 [len(source)]: the 'label' of every record of `source`, read in chunks; -1 for a
  record that cannot be read."""
  out = []
  for start in range(0, len(source), 1024):
    ids = list(range(start, min(start + 1024, len(source))))
    for i, record in zip(ids, _read(source, ids)):
      if record is None:
        out.append(-1)
        continue
      label = record.get("label") if isinstance(record, Mapping) else None
      if isinstance(label, bool) or not isinstance(label, (int, np.integer)):
        raise ValueError(f"data.subset_frac needs single-label records with an int 'label'; "
                         f"record {i} has {label!r}")
      out.append(int(label))
  return np.asarray(out, np.int64)


# (dataset, dir, split, size) -> labels: draws of other shares or seeds, and build() and the
# train iterator, share one read of the records.
_LABELS: dict[tuple, np.ndarray] = {}


def apply(source, data_cfg, dataset_name: str):
  """`source` (data.train_split of `dataset_name`), or its per-class draw when
  data.subset_frac < 1."""
  frac = data_cfg.get("subset_frac", 1.0)
  seed = data_cfg.get("subset_seed", 0)
  check_frac(frac)
  if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
    raise ValueError(f"data.subset_seed={seed!r} must be an int >= 0.")
  if frac == 1.0:
    return source
  if isinstance(source, dataset_base.Source) and source.index_sampler is not None:
    raise ValueError(f"data.subset_frac={frac} cannot be applied to {dataset_name!r}: its train "
                     "split has its own index sampler (e.g. hashtag resampling).")
  key = (dataset_name, str(data_cfg.get("dir", "")), getattr(source, "split", None),
         len(source))
  if key not in _LABELS:
    _LABELS[key] = labels(source)
    unreadable = int(np.sum(_LABELS[key] < 0))
    if unreadable:
      logging.warning("data.subset_frac: %d unreadable records of %s are left out of the draw.",
                      unreadable, dataset_name)
  readable = np.flatnonzero(_LABELS[key] >= 0)
  draw = per_class_draw(_LABELS[key][readable], float(frac), seed)
  return SubsetSource(source, readable[draw])
