"""A seeded, class-balanced labelled subset of a split: `data.subset_frac` / `data.subset_seed`.

The semi-supervised recipe's labelled set D on the demo is a 10% draw of the train split, the
rest of which joins the unlabelled pool U (configs/semi_supervised.py). With
`config.data.subset_frac=F` (0 < F < 1) the dataset's `data.subset_split` ('train') is cut to
the draw: every label c with n_c records keeps floor(F * n_c + 0.5) of them, at least one (so
every class stays in D), drawn without replacement by a generator seeded with
(data.subset_seed, c), so a class's draw depends only on the seed and its own records. Other
splits pass through. The kept indices are sorted and are the records' indices in the full
split, so `complement()` names the rest (U's share of the split) in the same numbering.
"""
import dataclasses

import numpy as np

SUBSET_KEYS = ("subset_frac", "subset_seed", "subset_split")
_READ_CHUNK = 1024


def counts(labels: np.ndarray, frac: float) -> np.ndarray:
  """Records kept per label [C] (C = labels.max() + 1): floor(frac * n_c + 0.5), >= 1 where
  n_c > 0 (a class rounded to zero would vanish from the labelled set)."""
  n = np.bincount(labels)
  return np.where(n > 0, np.maximum(np.floor(frac * n + 0.5), 1), 0).astype(np.int64)


def draw(labels, frac: float, seed: int) -> np.ndarray:
  """Sorted indices of the class-balanced draw of `frac` of the records with these labels."""
  labels = np.asarray(labels, np.int64)
  if not 0 < frac < 1:
    raise ValueError(f"data.subset_frac={frac!r} must be in (0, 1) (0 = no subset).")
  if labels.ndim != 1 or (labels.size and labels.min() < 0):
    raise ValueError("Subset labels must be a 1-D array of class ids >= 0.")
  if not labels.size:
    return np.zeros(0, np.int64)
  keep = counts(labels, frac)
  order = np.argsort(labels, kind="stable")  # Records grouped by label, by index inside.
  starts = np.searchsorted(labels[order], np.arange(len(keep) + 1))
  picked = []
  for c in np.flatnonzero(keep):
    members = order[starts[c]:starts[c + 1]]
    rng = np.random.default_rng([int(seed), int(c)])
    picked.append(rng.choice(members, size=int(keep[c]), replace=False))
  return np.sort(np.concatenate(picked))


def complement(indices: np.ndarray, num_records: int) -> np.ndarray:
  """Sorted indices of the records of the split that the draw left out."""
  mask = np.ones(num_records, bool)
  mask[np.asarray(indices, np.int64)] = False
  return np.flatnonzero(mask)


def read_labels(source) -> np.ndarray:
  """The 'label' of every record of a random-access source (images are read, not decoded)."""
  out = np.zeros(len(source), np.int64)
  for a in range(0, len(source), _READ_CHUNK):
    ids = list(range(a, min(a + _READ_CHUNK, len(source))))
    records = (source.__getitems__(ids) if hasattr(source, "__getitems__")
               else [source[i] for i in ids])
    out[a:a + len(ids)] = [int(r["label"]) for r in records]
  return out


class IndexedSource:
  """The records `indices` of a random-access source, renumbered 0..len-1."""

  def __init__(self, source, indices: np.ndarray):
    self._source, self.indices = source, np.asarray(indices, np.int64)
    self.split = getattr(source, "split", None)

  def __len__(self) -> int:
    return len(self.indices)

  def __getitem__(self, i: int):
    return self._source[int(self.indices[i])]

  def __repr__(self) -> str:
    return f"IndexedSource({self._source!r}, len={len(self)})"


def settings(data_cfg) -> tuple[float, int, str]:
  """(frac, seed, split) from a data config; frac 0 = no subset. ValueError on bad values."""
  frac = data_cfg.get("subset_frac", 0.0) or 0.0
  seed = data_cfg.get("subset_seed", 0)
  split = data_cfg.get("subset_split", "train")
  if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac < 1:
    raise ValueError(f"data.subset_frac={frac!r} must be a number in [0, 1) (0 = no subset).")
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise ValueError(f"data.subset_seed={seed!r} must be an int.")
  return float(frac), seed, str(split)


class SubsetDataset:
  """A dataset whose `split` is cut to the seeded class-balanced draw (module docstring)."""

  def __init__(self, dataset, frac: float, seed: int, split: str = "train"):
    info = dataset.info
    if split not in info.splits:
      raise ValueError(f"data.subset_split={split!r} is not a split of dataset "
                       f"{info.name!r}; its splits: {list(info.splits)}.")
    self.base, self.split = dataset, split
    self.full_size = info.num_examples[split]
    self.indices = draw(read_labels(dataset.source(split)), frac, seed)
    self.info = dataclasses.replace(info, num_examples={**info.num_examples,
                                                         split: len(self.indices)})

  def source(self, split: str):
    if split != self.split:
      return self.base.source(split)
    return IndexedSource(self.base.source(split), self.indices)

  def rest(self) -> np.ndarray:
    """Indices (in the full split) of the records not in the draw."""
    return complement(self.indices, self.full_size)


def maybe_wrap(dataset, data_cfg):
  """`dataset`, cut to its labelled subset when data_cfg sets subset_frac > 0."""
  frac, seed, split = settings(data_cfg)
  return SubsetDataset(dataset, frac, seed, split) if frac > 0 else dataset
