"""Top-K images per class (Yalniz et al., 2019, section 3.2) on arrays in memory.

The teacher keeps, for each unlabelled image, its P highest-scoring classes. For each class l,
the images that kept l are ranked by their score for l and the first K form D-hat_l; D-hat is
the union over classes, an image appearing once for each class that selected it (the paper
replicates it). Equal scores rank the smaller id first, so the selection is one exact set
whatever the order or grouping of the input: the rule the Beam job input_pipeline/jobs/selection_job.py
applies at scale (its combiner merges partial top-Ks with `top_k_unsorted`), here on arrays in
memory.

Variants (section 4.4, supplement section 2): balanced-ranked is `select(..., k=K)`;
unbalanced-ranked is `select(..., k=sizes)` with per-class sizes, e.g. `zipf_sizes(C, total)`;
balanced-with-tags is bigpretrain/semisup/tags.py.
"""
from typing import Mapping

import numpy as np


VARIANTS = ("balanced_ranked", "unbalanced_ranked", "balanced_with_tags")


def check_choice(variant: str, k, has_class_sizes: bool, zipf_total: int | None) -> None:
  """ValueError unless the selection `variant` has its parameters and no other: K per class
  (k >= 1) for the balanced variants; exactly one of class sizes or a Zipf total >= 1 for
  unbalanced_ranked. Checkable before there are predictions to select from."""
  if variant not in VARIANTS:
    raise ValueError(f"Unknown variant {variant!r}; expected one of {VARIANTS}.")
  if variant != "unbalanced_ranked":
    if k is None or has_class_sizes or zipf_total is not None:
      raise ValueError(f"{variant} takes --k (K per class) and neither --class_sizes nor "
                       "--zipf_total.")
    if np.ndim(k) == 0 and not isinstance(k, Mapping) and (
        isinstance(k, bool) or int(k) != k or k < 1):
      raise ValueError(f"k={k!r}: K images per class must be an integer >= 1 (0 selects "
                       "nothing).")
    return
  if k is not None or has_class_sizes == (zipf_total is not None):
    raise ValueError("unbalanced_ranked takes exactly one of --class_sizes (JSON {class name: "
                     "K}) and --zipf_total (total over all classes), and no --k.")
  if zipf_total is not None and (isinstance(zipf_total, bool) or int(zipf_total) != zipf_total
                                 or zipf_total < 1):
    raise ValueError(f"zipf_total={zipf_total!r} must be an integer >= 1.")


def per_class_k(k, num_classes: int) -> np.ndarray:
  """K as int64 [num_classes]: from an int (every class), a {class: K} mapping (absent classes
  get 0) or an array-like of num_classes values. ValueError on a negative or non-integer K."""
  if isinstance(k, Mapping):
    out = np.zeros(num_classes, np.int64)
    for c, value in k.items():
      if not 0 <= int(c) < num_classes:
        raise ValueError(f"Per-class K given for class {c!r}; classes are 0..{num_classes - 1}.")
      out[int(c)] = _count(value, f"K of class {c}")
    return out
  if np.ndim(k) == 0:
    return np.full(num_classes, _count(k, "k"), np.int64)
  values = np.asarray(k)
  if values.shape != (num_classes,):
    raise ValueError(f"Per-class K has shape {values.shape}; expected ({num_classes},).")
  return np.array([_count(v, f"K of class {c}") for c, v in enumerate(values.tolist())],
                  np.int64)


def _count(value, name: str) -> int:
  if isinstance(value, bool) or int(value) != value or value < 0:
    raise ValueError(f"{name}={value!r}; expected an integer >= 0.")
  return int(value)


def check_predictions(ids, classes, scores, *, num_classes: int | None = None,
                      where: str = "predictions") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Validated (ids int64 [N], classes int64 [N, P], scores [N, P]); ValueError naming the
  problem: shapes, non-integer ids or classes, a class outside [0, num_classes), a class twice
  in one image's top-P, a non-finite score, an id twice."""
  ids, classes, scores = np.asarray(ids), np.asarray(classes), np.asarray(scores)
  if ids.ndim != 1 or classes.ndim != 2 or classes.shape != scores.shape or (
      classes.shape[0] != ids.shape[0]):
    raise ValueError(f"{where}: expected ids [N] and classes, scores [N, P]; got shapes "
                     f"{ids.shape}, {classes.shape}, {scores.shape}.")
  for name, a in (("ids", ids), ("classes", classes)):
    if a.size and not np.issubdtype(a.dtype, np.integer):
      raise ValueError(f"{where}: {name} must be integers; got dtype {a.dtype}.")
  if scores.size and not (np.issubdtype(scores.dtype, np.floating)
                          or np.issubdtype(scores.dtype, np.signedinteger)):
    raise ValueError(f"{where}: scores must be floats (or signed ints); got {scores.dtype}.")
  ids, classes = ids.astype(np.int64), classes.astype(np.int64)
  if classes.size:
    if classes.min() < 0:
      raise ValueError(f"{where}: negative class {classes.min()}.")
    if num_classes is not None and classes.max() >= num_classes:
      raise ValueError(f"{where}: class {classes.max()} is outside 0..{num_classes - 1} "
                       f"({num_classes} classes).")
    row_sorted = np.sort(classes, axis=1)
    twice = np.flatnonzero((row_sorted[:, 1:] == row_sorted[:, :-1]).any(axis=1))
    if twice.size:
      raise ValueError(f"{where}: image {ids[twice[0]]} lists a class twice in its top-P: "
                       f"{classes[twice[0]].tolist()}.")
    if np.issubdtype(scores.dtype, np.floating) and not np.isfinite(scores).all():
      row = np.flatnonzero(~np.isfinite(scores).all(axis=1))[0]
      raise ValueError(f"{where}: image {ids[row]} has non-finite scores "
                       f"{scores[row].tolist()}.")
  sorted_ids = np.sort(ids)
  dup = np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1])
  if dup.size:
    raise ValueError(f"{where}: id {sorted_ids[dup[0]]} appears twice.")
  return ids, classes, scores


def group_starts(sorted_classes: np.ndarray) -> np.ndarray:
  """Start offsets of the runs of equal values in a sorted array, plus its length at the end."""
  c = np.asarray(sorted_classes)
  if c.size == 0:
    return np.zeros(1, np.int64)
  return np.r_[np.flatnonzero(np.r_[True, c[1:] != c[:-1]]), c.size].astype(np.int64)


def ranks(sorted_classes: np.ndarray) -> np.ndarray:
  """Position of each entry within its run of equal classes (0 = first) in a sorted array."""
  bounds = group_starts(sorted_classes)
  return np.arange(bounds[-1]) - np.repeat(bounds[:-1], np.diff(bounds))


def top_k_pairs(classes, ids, scores, k) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Candidate (class, id, score) pairs -> the selected pairs, sorted by class, best first.

  classes, ids, scores: [M] each, one entry per candidate; k: an int, or an int array indexed
  by class (per-class K). Order: score descending, then id ascending. The selection of a union
  equals the selection of the union of selections, so partial results merge exactly in any
  order and grouping (what the Beam combiner relies on). A sort: O(M log M).
  """
  classes, ids, scores = np.asarray(classes), np.asarray(ids), np.asarray(scores)
  if classes.size == 0:
    return classes, ids, scores
  order = np.lexsort((ids, -scores, classes))
  ordered = classes[order]
  if np.ndim(k) == 0:
    limit = k
  else:
    k = np.asarray(k)
    if ordered[-1] >= k.shape[0]:
      raise ValueError(f"Class {ordered[-1]} has no K: per-class K covers {k.shape[0]} classes.")
    limit = k[ordered]
  keep = order[ranks(ordered) < limit]
  return classes[keep], ids[keep], scores[keep]


def top_k_unsorted(ids, scores, k: int) -> np.ndarray:
  """Positions of the best k entries of one class (score descending, then id ascending; ids
  distinct), in no particular order: O(M) with np.partition instead of a sort. Exactly the
  set `top_k_pairs` keeps: every entry scoring above the k-th best score, then the smallest ids
  among those scoring equal to it."""
  ids, scores = np.asarray(ids), np.asarray(scores)
  if scores.shape[0] <= k:
    return np.arange(scores.shape[0])
  if k <= 0:
    return np.zeros(0, np.int64)
  kth = np.partition(scores, scores.shape[0] - k)[scores.shape[0] - k]  # k-th best score.
  above = np.flatnonzero(scores > kth)
  tied = np.flatnonzero(scores == kth)
  need = k - above.size
  if need < tied.size:
    tied = tied[np.argpartition(ids[tied], need - 1)[:need]]
  return np.concatenate([above, tied])


def select(ids, classes, scores, *, k, num_classes: int | None = None) -> dict[int, list[int]]:
  """For each class, the ids of its top-K images, best first (ties: smaller id first).

  ids: int [N] (distinct); classes: int [N, P], each image's top-P classes (distinct); scores:
  [N, P] the matching scores. k: an int (balanced-ranked), or per class (unbalanced-ranked) a
  {class: K} mapping (absent classes get 0) or an array [C]. Keys: 0..num_classes-1 when
  num_classes is given, else the classes some image kept; a class with fewer candidates than
  K gets them all.
  """
  ids, classes, scores = check_predictions(ids, classes, scores, num_classes=num_classes)
  seen = np.unique(classes)
  if isinstance(k, Mapping) or np.ndim(k) != 0:
    size = num_classes
    if size is None:  # Enough classes for the data and for every K given.
      given = [int(c) + 1 for c in k] if isinstance(k, Mapping) else [np.shape(k)[0]]
      size = max([int(seen[-1]) + 1 if seen.size else 0] + given)
    k = per_class_k(k, size)
  else:
    k = _count(k, "k")
  picked_classes, picked_ids, _ = top_k_pairs(
      classes.ravel(), np.repeat(ids, classes.shape[1]), scores.ravel(), k)
  keys = range(num_classes) if num_classes is not None else seen.tolist()
  out = {int(c): [] for c in keys}
  bounds = group_starts(picked_classes)
  for a, b in zip(bounds[:-1], bounds[1:]):
    out[int(picked_classes[a])] = picked_ids[a:b].tolist()
  return out


def zipf_sizes(num_classes: int, total: int, *, exponent: float = 1.0,
               seed: int | None = None) -> np.ndarray:
  """Per-class K following Zipf's law with an exact total (unbalanced-ranked, supplement
  section 2: "the number of examples per label follows a Zipfian distribution").

  The class of rank r (1-based) gets the quota total * r^-exponent / sum_j j^-exponent. Rounding
  (largest remainder): every class gets the floor of its quota, then the classes with the
  largest fractional parts (ties: better rank) get one more until the sizes sum to `total`
  exactly. Rank order: class index (seed None), or a permutation drawn with
  np.random.default_rng(seed) (the paper took the order from hashtag counts; pass those sizes
  to `select` directly when known). Returns int64 [num_classes].
  """
  num_classes, total = _count(num_classes, "num_classes"), _count(total, "total")
  if num_classes == 0:
    raise ValueError("zipf_sizes needs num_classes >= 1.")
  if not np.isfinite(exponent) or exponent < 0:
    raise ValueError(f"exponent={exponent!r}; expected a finite value >= 0.")
  weights = np.arange(1, num_classes + 1, dtype=np.float64) ** -float(exponent)
  quotas = total * weights / weights.sum()
  by_rank = np.floor(quotas).astype(np.int64)
  left = total - int(by_rank.sum())
  by_rank[np.lexsort((np.arange(num_classes), -(quotas - by_rank)))[:left]] += 1
  if seed is None:
    return by_rank
  order = np.random.default_rng(seed).permutation(num_classes)  # order[r] = class of rank r.
  sizes = np.empty(num_classes, np.int64)
  sizes[order] = by_rank
  return sizes
