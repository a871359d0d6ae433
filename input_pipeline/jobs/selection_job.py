"""Selection of the new dataset D-hat from teacher predictions: an Apache Beam job.

  python -m input_pipeline.prepare selection --predictions=DIR --k=K --data_dir=OUT \
      [--variant=balanced_ranked|unbalanced_ranked|balanced_with_tags] \
      [--class_sizes=SIZES.json | --zipf_total=T [--zipf_exponent=1.0]] [--seed=0] \
      [--expected_classes=CLASSES.txt] [--exclude=FILE] [--beam_runner=...]

The rule (Yalniz et al., 2019, section 3.2): for each class, the K images with the highest
score among those that kept the class in their top-P; an image selected for several classes
appears once per class. Ties go to the smaller image key (dataset, split, index), so the result
is exact and identical on any runner and worker count. Variants (section 4.4, supplement
section 2): balanced_ranked (K per class, the default), unbalanced_ranked (per-class K from
--class_sizes, a JSON {class name: K}, absent classes 0; or Zipf with a fixed --zipf_total,
bigpretrain.semisup.topk.zipf_sizes, classes ranked by a --seed permutation), and
balanced_with_tags (K images per class drawn at random, --seed, among those whose tags map to
the class; bigpretrain.semisup.tags). In-memory equivalents: bigpretrain.semisup.

Input, DIR (written by bigpretrain.tools.infer with selection_formats.py's writers, which need no
Beam):
  - `*.parquet` shards, one row per image, columns
      dataset (string), split (string), index (int64: the image's record index in that split,
        as the dataset's data source numbers it; < 2**40),
      classes (list<int32> of length P: the teacher's top-P classes, best first),
      scores (list<float32> of length P: their softmax scores),
      tags (list<string>, optional: the image's hashtags; balanced_with_tags needs it).
    A key (dataset, split, index) appears once over all shards (a repeat among the selected
    images is an error).
  - predictions.json: {"class_names": [...] (the teacher's classes, label = position),
    "top_p": P, "dataset": NAME, "splits": [...], and optionally "num_records": rows in all
    shards (checked: fewer means unfinished inference), "scores": "softmax" or "logits"}.
  --expected_classes (one class name a line) must equal class_names, else a clear error.
  --exclude: an exclusion list (input_pipeline/exclusions.py; bigpretrain.tools.dedup writes one of
    the pool's near-duplicates of evaluation images): its images are dropped as they are read,
    never candidates, and counted (report num_excluded). predictions.json's num_excluded is
    what inference already left out with the same list.

Output, OUT (an index into the source dataset, not a copy of its images):
  - index-SSSSS-of-NNNNN.parquet: one row per (image, class) selection, columns dataset, split,
    index (int64), label (int32, position in class_names), score (float32: the teacher's score;
    for balanced_with_tags the random priority / 2**53), rank (int32, 0 = best of its class).
    Rows are sorted by (label, rank); shard s holds the classes [s*B, (s+1)*B), where
    B = max(1, 2**20 // max K); shards whose classes got nothing are not written.
  - selection.json, written last (its presence means the selection is complete): "format",
    "params", "dataset", "splits", "class_names", "index_files" (in order) and "report".
  A data source reads D-hat as the rows of index_files concatenated in order: example i is
  record `index` of split `split` of dataset `dataset`, with label `label`.
  The report: num_records (|U| read), num_excluded (of those, dropped by --exclude),
  num_selected (|D-hat|, image-class pairs as in the
  paper's Table 9), num_requested (sum of K), per class the requested K, count, candidates
  (images that kept the class / whose tags map to it) and threshold (lowest selected score,
  null when none), the shortfall (classes that got fewer than K: never an error, only
  reported), and the class-size histogram (10 equal bins over [0, max K]; Table 9's view of how
  balanced D-hat is).

Engine: one element per shard (Reshuffled), read in batches of `batch_size` rows; each batch's
candidate pairs are grouped by class and cut to each class's top K in numpy
(topk.top_k_unsorted: O(M) partitions, no sort), and a CombinePerKey by class (TopKCombineFn)
merges those partial top-Ks the same way, keeping at most 2K + 1024 entries between
compactions, and sorts each class's K once at the end; the runner's combiner lifting merges
within each bundle before the shuffle. Ties are exact because image keys are packed into one
int64 whose order is the key order: rank of (dataset, split) among the sorted sources << 40 |
index.
`naive=True` runs the reference form instead (one element per (class, image) pair into
beam.combiners.Top.PerKey): same output, much slower (benchmarks/selection.py).
A finished selection in OUT with the same parameters is reused; with others it is an error.
"""
import json
import uuid
from typing import Any, Mapping, Sequence

from absl import logging
import apache_beam as beam
from apache_beam.options import pipeline_options
from etils import epath
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bigpretrain.semisup import tags as tags_lib
from input_pipeline import exclusions
from input_pipeline.jobs import local_runner
from input_pipeline import selection_formats as formats
from bigpretrain.semisup import topk

RAW_REPORT_FILE = "selection_raw_report.json"  # Written by the pipeline, folded into selection.json.
VARIANTS = topk.VARIANTS
INDEX_BITS = 40  # Record indices < 2**40 (1.1e12 per split); the source rank goes above.
ROWS_PER_SHARD = 1 << 20
BATCH_SIZE = 65536
COMPACT_SLACK = 1024
MAX_CHUNKS = 256
HISTOGRAM_BINS = 10
COUNTER_NAMESPACE = "selection"


def pack_ids(source_rank, index) -> np.ndarray:
  """int64 ids ordered as (dataset, split, index) keys: source rank << 40 | index."""
  return (np.asarray(source_rank, np.int64) << INDEX_BITS) | np.asarray(index, np.int64)


def unpack_ids(ids) -> tuple[np.ndarray, np.ndarray]:
  """Inverse of pack_ids: (source rank, index)."""
  ids = np.asarray(ids, np.int64)
  return ids >> INDEX_BITS, ids & ((1 << INDEX_BITS) - 1)


# ------------------------------------------------------------------------------------------
# Reading shards into candidate pairs.


def _counter(name: str):
  return beam.metrics.Metrics.counter(COUNTER_NAMESPACE, name)


def _list_column(batch: pa.RecordBatch, name: str, p: int, dtype, where: str) -> np.ndarray:
  """A list column whose rows all have length p -> numpy [rows, p]."""
  column = batch.column(name)
  if column.null_count:
    raise ValueError(f"{where}: column {name!r} has null rows.")
  if isinstance(column, pa.FixedSizeListArray) and column.type.list_size == p:
    values = column.flatten()
  else:
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    if (lengths != p).any():
      raise ValueError(f"{where}: column {name!r} has a row of {int(lengths[lengths != p][0])} "
                       f"values; predictions.json says top_p={p}.")
    values = pc.list_flatten(column)
  if values.null_count:
    raise ValueError(f"{where}: column {name!r} has null values.")
  return values.to_numpy(zero_copy_only=False).astype(dtype, copy=False).reshape(-1, p)


class _ReadShard(beam.DoFn):
  """Shard path -> batches of candidate pairs {'classes', 'ids', 'scores' [M], 'records': n}.

  Ranked variants: one pair per (image, top-P class) with the teacher's score; tags: one pair
  per (image, class its tags map to) with the seeded random priority. ValueError naming the
  shard on malformed rows (wrong P, bad class, unknown source, non-finite score).
  """

  def __init__(self, preds: formats.Predictions, variant: str, batch_size: int, seed: int,
               lemmas: Mapping[str, Sequence[int]] | None, excluded: np.ndarray):
    self._preds = preds
    self._variant = variant
    self._batch_size = batch_size
    self._seed = seed
    self._lemmas = lemmas
    self._excluded = excluded  # Sorted packed ids of the images on the exclusion list.
    self._records = _counter("records_read")
    self._dropped = _counter("records_excluded")
    self._shards = _counter("shards_read")

  def process(self, path: str):
    preds = self._preds
    with_tags = self._variant == "balanced_with_tags"
    columns = ["dataset", "split", "index"] + (["tags"] if with_tags else ["classes", "scores"])
    with epath.Path(path).open("rb") as f:
      shard = pq.ParquetFile(f)
      absent = [c for c in columns if c not in shard.schema_arrow.names]
      if absent:
        raise ValueError(f"Prediction shard {path} has no column(s) {absent}"
                         + (" (balanced_with_tags needs the images' tags)" if with_tags else "")
                         + f"; it has {shard.schema_arrow.names}.")
      for batch in shard.iter_batches(batch_size=self._batch_size, columns=columns):
        if not batch.num_rows:
          continue
        ids = self._ids(batch, path)
        records = len(ids)
        drop = excluded_mask(ids, self._excluded)
        if drop.any():
          batch, ids = batch.filter(pa.array(~drop)), ids[~drop]
          self._dropped.inc(int(drop.sum()))
        if with_tags:
          tags = batch.column("tags").to_pylist()
          classes, pair_ids = tags_lib.tag_pairs(ids, [t or [] for t in tags], self._lemmas)
          scores = tags_lib.random_priority(self._seed, classes, pair_ids)
        else:
          top = _list_column(batch, "classes", preds.top_p, np.int64, path)
          values = _list_column(batch, "scores", preds.top_p, np.float32, path)
          _, top, values = topk.check_predictions(
              ids, top, values, num_classes=len(preds.class_names), where=path)
          classes, pair_ids, scores = top.ravel(), np.repeat(ids, preds.top_p), values.ravel()
        self._records.inc(records)
        yield {"classes": classes, "ids": pair_ids, "scores": scores, "records": records,
               "excluded": records - len(ids)}
    self._shards.inc()

  def _ids(self, batch: pa.RecordBatch, path: str) -> np.ndarray:
    """Packed int64 ids of a batch's rows; ValueError on an unknown source or a bad index."""
    preds = self._preds
    dataset, split = batch.column("dataset"), batch.column("split")
    index = batch.column("index")
    if dataset.null_count or split.null_count or index.null_count:
      raise ValueError(f"{path}: null dataset, split or index.")
    if not pc.all(pc.equal(dataset, preds.dataset)).as_py():
      other = pc.filter(dataset, pc.not_equal(dataset, preds.dataset))[0].as_py()
      raise ValueError(f"{path}: row of dataset {other!r}; predictions.json says "
                       f"{preds.dataset!r}.")
    ranks = pc.index_in(split, value_set=pa.array([s for _, s in preds.sources]))
    if ranks.null_count:
      other = pc.filter(split, pc.is_null(ranks))[0].as_py()
      raise ValueError(f"{path}: row of split {other!r}; predictions.json lists "
                       f"{list(preds.splits)}.")
    index = index.to_numpy(zero_copy_only=False).astype(np.int64)
    if index.size and (index.min() < 0 or index.max() >= 1 << INDEX_BITS):
      raise ValueError(f"{path}: record index {index.min() if index.min() < 0 else index.max()}"
                       f" is outside 0..2**{INDEX_BITS}-1.")
    return pack_ids(ranks.to_numpy(zero_copy_only=False), index)


# ------------------------------------------------------------------------------------------
# Top-K per class: the combiner, and the naive reference.


class _PartialTopK(beam.DoFn):
  """Candidate batch -> (class, (class, ids, scores)) of each class's top K in the batch (in no
  particular order: the combiner sorts at the end)."""

  def __init__(self, k: np.ndarray):
    self._k = k

  def process(self, batch):
    classes = batch["classes"]
    # Group by class; a stable sort of 16-bit keys is numpy's O(M) radix sort.
    keys = classes.astype(np.uint16) if len(self._k) <= 1 << 16 else classes
    order = np.argsort(keys, kind="stable")
    classes, ids, scores = classes[order], batch["ids"][order], batch["scores"][order]
    bounds = topk.group_starts(classes)
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
      c = int(classes[a])
      k = int(self._k[c])
      if k == 0:
        continue
      group_ids, group_scores = ids[a:b], scores[a:b]
      if b - a > k:
        keep = topk.top_k_unsorted(group_ids, group_scores, k)
        group_ids, group_scores = group_ids[keep], group_scores[keep]
      yield c, (c, group_ids, group_scores)


def excluded_mask(ids: np.ndarray, excluded: np.ndarray) -> np.ndarray:
  """Which packed ids are in the sorted array `excluded` (bool, like ids)."""
  if not excluded.size:
    return np.zeros(len(ids), bool)
  at = np.minimum(np.searchsorted(excluded, ids), excluded.size - 1)
  return excluded[at] == ids


def excluded_ids(preds: formats.Predictions, listed: exclusions.Exclusions) -> np.ndarray:
  """Sorted packed ids of the listed images that belong to the predictions' sources."""
  ids = [pack_ids(rank, listed.indices(dataset, split))
         for rank, (dataset, split) in enumerate(preds.sources)
         if listed.indices(dataset, split).size]
  ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
  if len(listed) and not ids.size:
    logging.warning("Exclusion list %s names %d images, none of the predictions' sources %s.",
                    listed.path, len(listed), preds.sources)
  return ids


def _batch_counts(batch, num_classes: int):
  """Candidate batch -> (records, excluded records, candidates per class [C])."""
  return (batch["records"], batch["excluded"],
          np.bincount(batch["classes"], minlength=num_classes))


def _check_unique(ids: np.ndarray, c: int, preds: formats.Predictions) -> None:
  """ValueError when an image key is selected twice for class c (a repeated prediction)."""
  unique = np.unique(ids)
  if unique.size != ids.size:
    repeated = unique[np.flatnonzero(np.bincount(np.searchsorted(unique, ids)) > 1)[0]]
    rank, index = unpack_ids(repeated)
    dataset, split = preds.sources[int(rank)]
    raise ValueError(f"Image ({dataset}, {split}, {int(index)}) appears more than once in the "
                     f"predictions in {preds.path} (selected twice for class {c}).")


class TopKCombineFn(beam.CombineFn):
  """Per class, its best K (id, score) pairs, merged in numpy. The accumulator
  [class, id chunks, score chunks, size] is cut to its top K (topk.top_k_unsorted, O(size))
  whenever it holds more than 2K + COMPACT_SLACK entries or MAX_CHUNKS chunks, and sorted
  once at the end."""

  def __init__(self, k: np.ndarray, preds: formats.Predictions):
    self._k = k
    self._preds = preds

  def create_accumulator(self):
    return [-1, [], [], 0]

  def _top_k(self, acc) -> tuple[np.ndarray, np.ndarray]:
    ids, scores = np.concatenate(acc[1]), np.concatenate(acc[2])
    keep = topk.top_k_unsorted(ids, scores, int(self._k[acc[0]]))
    return ids[keep], scores[keep]

  def _compact(self, acc):
    if acc[3] > 2 * int(self._k[acc[0]]) + COMPACT_SLACK or len(acc[1]) > MAX_CHUNKS:
      ids, scores = self._top_k(acc)
      acc[1], acc[2], acc[3] = [ids], [scores], len(ids)
    return acc

  def add_input(self, mutable_accumulator, element):
    c, ids, scores = element
    acc = mutable_accumulator
    acc[0] = c
    acc[1].append(ids)
    acc[2].append(scores)
    acc[3] += len(ids)
    return self._compact(acc)

  def merge_accumulators(self, accumulators):
    out = self.create_accumulator()
    for acc in accumulators:
      if acc[0] < 0:
        continue
      out[0] = acc[0]
      out[1].extend(acc[1])
      out[2].extend(acc[2])
      out[3] += acc[3]
      out = self._compact(out)
    return out

  def extract_output(self, accumulator):
    acc = accumulator
    if acc[0] < 0:
      return np.zeros(0, np.int64), np.zeros(0, np.float32)
    ids, scores = self._top_k(acc)
    order = np.lexsort((ids, -scores))
    ids, scores = ids[order], scores[order]
    _check_unique(ids, acc[0], self._preds)
    return ids, scores


def _explode(batch):
  """Candidate batch -> one (class, (score, id)) element per pair: the naive form."""
  for c, i, s in zip(batch["classes"].tolist(), batch["ids"].tolist(),
                     batch["scores"].tolist()):
    yield c, (s, i)


def _rank_key(score_id):
  """Top.PerKey's order: higher score first, then smaller id."""
  return score_id[0], -score_id[1]


def _naive_arrays(class_top, k: np.ndarray, preds: formats.Predictions, dtype):
  """(class, [(score, id)] best first) -> (class, (ids, scores)) cut to the class's K."""
  c, top = class_top
  top = top[:int(k[c])]
  ids = np.array([i for _, i in top], np.int64)
  _check_unique(ids, c, preds)
  return c, (ids, np.array([s for s, _ in top], dtype))


def select_pcoll(batches, k: np.ndarray, preds: formats.Predictions, *, naive: bool = False,
                 score_dtype=np.float32):
  """Candidate batches -> (PCollection of (class, (ids, scores)) best first, counts PCollection
  of (records, candidates per class) summed over batches)."""
  counts = (batches
            | "Counts" >> beam.Map(_batch_counts, len(k))
            | "SumCounts" >> beam.CombineGlobally(_SumCounts(len(k))))
  if not naive:
    selected = (batches
                | "PartialTopK" >> beam.ParDo(_PartialTopK(k))
                | "TopKPerClass" >> beam.CombinePerKey(TopKCombineFn(k, preds)))
  else:
    selected = (batches
                | "Explode" >> beam.FlatMap(_explode)
                | "TopPerKey" >> beam.combiners.Top.PerKey(max(int(k.max()), 1), key=_rank_key)
                | "CutToK" >> beam.Map(_naive_arrays, k, preds, score_dtype))
  return selected, counts


class _SumCounts(beam.CombineFn):
  """(records, excluded, per-class candidates [C]) summed; (0, 0, zeros) for no input."""

  def __init__(self, num_classes: int):
    self._num_classes = num_classes

  def create_accumulator(self):
    return 0, 0, np.zeros(self._num_classes, np.int64)

  def add_input(self, mutable_accumulator, element):
    return tuple(a + e for a, e in zip(mutable_accumulator, element))

  def merge_accumulators(self, accumulators):
    total = self.create_accumulator()
    for acc in accumulators:
      total = tuple(t + a for t, a in zip(total, acc))
    return total

  def extract_output(self, accumulator):
    return int(accumulator[0]), int(accumulator[1]), accumulator[2].tolist()


# ------------------------------------------------------------------------------------------
# Writing the index and the report.


def classes_per_shard(k: np.ndarray) -> int:
  """Classes per index shard: about ROWS_PER_SHARD rows at most."""
  return max(1, ROWS_PER_SHARD // max(1, int(k.max())))


def index_file_name(shard: int, num_shards: int) -> str:
  return f"index-{shard:05d}-of-{num_shards:05d}.parquet"


class _WriteShard(beam.DoFn):
  """(shard, [(class, (ids, scores))]) -> the shard's Parquet file (written to a temporary
  name, then renamed); yields {'file', 'classes': [[class, count, threshold]]}."""

  def __init__(self, out_dir: str, preds: formats.Predictions, num_shards: int):
    self._out_dir = out_dir
    self._preds = preds
    self._num_shards = num_shards
    self._rows = _counter("rows_written")

  def process(self, shard_items):
    shard, items = shard_items
    items = sorted(items, key=lambda item: item[0])
    ids = np.concatenate([i for _, (i, _) in items]).astype(np.int64)
    scores = np.concatenate([s for _, (_, s) in items])
    labels = np.repeat([c for c, _ in items], [len(i) for _, (i, _) in items]).astype(np.int32)
    rank, index = unpack_ids(ids)
    names = np.array([s for _, s in self._preds.sources], dtype=object)
    table = pa.table({
        "dataset": pa.array([self._preds.dataset] * len(ids), pa.string()),
        "split": pa.array(names[rank], pa.string()),
        "index": pa.array(index),
        "label": pa.array(labels),
        "score": pa.array(_as_score(scores)),
        "rank": pa.array(topk.ranks(labels).astype(np.int32)),
    })
    name = index_file_name(shard, self._num_shards)
    final = epath.Path(self._out_dir) / name
    tmp = final.parent / f".{name}.{uuid.uuid4().hex}.tmp"
    with tmp.open("wb") as f:
      pq.write_table(table, f)
    tmp.rename(final)
    self._rows.inc(len(ids))
    yield {"file": name, "classes": [
        [c, len(i), float(_as_score(s[-1:])[0]) if len(i) else None] for c, (i, s) in items]}


def _as_score(scores: np.ndarray) -> np.ndarray:
  """Scores as stored: float32; integer priorities (balanced_with_tags) / 2**53."""
  if np.issubdtype(scores.dtype, np.integer):
    return (scores.astype(np.float64) / 2.0**tags_lib.PRIORITY_BITS).astype(np.float32)
  return scores.astype(np.float32)


def _shard_of(class_selected, per_shard: int):
  return class_selected[0] // per_shard, class_selected


def _write_raw_report(_, path: str, written, counts):
  records, excluded, candidates = counts
  with epath.Path(path).open("w") as f:
    json.dump({"records": records, "excluded": excluded, "candidates": candidates,
               "written": sorted(written, key=lambda w: w["file"])}, f)


def build_report(k: np.ndarray, candidates: Sequence[int], records: int,
                 class_stats: Sequence[Sequence[Any]], class_names: Sequence[str],
                 excluded: int = 0) -> dict[str, Any]:
  """The selection report (module docstring) from per-class [class, count, threshold] rows."""
  num_classes = len(class_names)
  counts, thresholds = [0] * num_classes, [None] * num_classes
  for c, count, threshold in class_stats:
    counts[c], thresholds[c] = int(count), threshold
  counts_arr = np.asarray(counts, np.int64)
  short = np.flatnonzero(counts_arr < k)
  top = max(int(k.max()), 1)
  hist, edges = np.histogram(counts_arr, bins=HISTOGRAM_BINS, range=(0, top))
  return {
      "num_records": int(records),
      "num_excluded": int(excluded),
      "num_selected": int(counts_arr.sum()),
      "num_requested": int(k.sum()),
      "num_classes": num_classes,
      "num_full_classes": int(num_classes - short.size),
      "requested": k.tolist(),
      "counts": counts,
      "candidates": [int(c) for c in candidates],
      "thresholds": thresholds,
      "shortfall": {
          "num_classes": int(short.size),
          "num_missing": int((k - counts_arr)[short].sum()),
          "classes": {class_names[c]: {"requested": int(k[c]), "selected": counts[c],
                                       "candidates": int(candidates[c])} for c in short},
      },
      "class_size_histogram": {"edges": edges.tolist(), "num_classes": hist.tolist()},
  }


# ------------------------------------------------------------------------------------------
# Running a selection.


def read_class_sizes(path: str, name: str = "--class_sizes") -> dict:
  """The JSON {class name: K} file `path`; `name`: the setting's, for the message."""
  with open(path, encoding="utf-8") as f:
    try:
      return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"{name}={path} is not valid JSON: {e}.") from None


def resolve_k(variant: str, num_classes: int, class_names: Sequence[str], *,
              k: int | None, class_sizes: Mapping[str, int] | None, zipf_total: int | None,
              zipf_exponent: float, seed: int) -> np.ndarray:
  """Per-class K [C] for a variant; ValueError on a missing or contradictory choice."""
  topk.check_choice(variant, k, class_sizes is not None, zipf_total)
  if variant != "unbalanced_ranked":
    return topk.per_class_k(k, num_classes)
  if zipf_total is not None:
    return topk.zipf_sizes(num_classes, zipf_total, exponent=zipf_exponent, seed=seed)
  if not isinstance(class_sizes, Mapping):
    raise ValueError(f"--class_sizes must be a JSON object {{class name: K}}, got "
                     f"{type(class_sizes).__name__}.")
  bad = {n: v for n, v in class_sizes.items()
         if isinstance(v, bool) or not isinstance(v, int) or v < 0}
  if bad:
    raise ValueError(f"--class_sizes: each K must be an int >= 0; got "
                     f"{dict(list(bad.items())[:5])}.")
  position = {name: c for c, name in enumerate(class_names)}
  unknown = sorted(set(class_sizes) - set(position))
  if unknown:
    raise ValueError(f"--class_sizes names {len(unknown)} classes the teacher does not have, "
                     f"e.g. {unknown[:5]}.")
  absent = len(position) - len(class_sizes)
  if absent:
    logging.warning("--class_sizes gives no K for %d classes: they get 0.", absent)
  return topk.per_class_k({position[n]: v for n, v in class_sizes.items()}, num_classes)


def _pipeline(pipeline, preds: formats.Predictions, k: np.ndarray, variant: str, seed: int,
              out_dir: str, batch_size: int, naive: bool, excluded: np.ndarray) -> None:
  lemmas = None
  if variant == "balanced_with_tags":
    try:
      lemmas = tags_lib.class_lemmas(preds.class_names)
    except ValueError as e:
      raise ValueError(f"balanced_with_tags maps tags to classes through WordNet, so the "
                       f"teacher's class names must be wnids: {e}") from e
  batches = (pipeline
             | "Shards" >> beam.Create(list(preds.shards))
             | "ReshuffleShards" >> beam.Reshuffle()
             | "Read" >> beam.ParDo(_ReadShard(preds, variant, batch_size, seed, lemmas,
                                                     excluded)))
  score_dtype = np.int64 if variant == "balanced_with_tags" else np.float32
  selected, counts = select_pcoll(batches, k, preds, naive=naive, score_dtype=score_dtype)
  per_shard = classes_per_shard(k)
  num_shards = -(-len(k) // per_shard)
  written = (selected
             | "NonEmpty" >> beam.Filter(lambda kv: len(kv[1][0]) > 0)
             | "KeyByShard" >> beam.Map(_shard_of, per_shard)
             | "GroupByShard" >> beam.GroupByKey()
             | "WriteShards" >> beam.ParDo(_WriteShard(out_dir, preds, num_shards)))
  _ = (pipeline
       | "ReportSeed" >> beam.Create([None])
       | "WriteReport" >> beam.Map(_write_raw_report, str(epath.Path(out_dir) / RAW_REPORT_FILE),
                                   written=beam.pvalue.AsList(written),
                                   counts=beam.pvalue.AsSingleton(counts)))


def prepare(predictions_dir, data_dir, *, k: int | None = None,
            variant: str = "balanced_ranked", class_sizes: Mapping[str, int] | None = None,
            zipf_total: int | None = None, zipf_exponent: float = 1.0, seed: int = 0,
            expected_class_names: Sequence[str] | None = None, beam_runner=None,
            beam_options: Sequence[str] | None = None, batch_size: int = BATCH_SIZE,
            naive: bool = False, exclude: str | None = None) -> dict[str, Any]:
  """Selects D-hat from the predictions in predictions_dir into data_dir, or reuses a
  finished selection made with the same parameters. Returns selection.json's content.

  k / class_sizes / zipf_total / zipf_exponent / seed: the variant's parameters (module
  docstring); expected_class_names: the class list the predictions must have; beam_runner,
  beam_options: the Beam runner and extra flags; naive: run the Top.PerKey reference form;
  exclude: an exclusion list whose images are never selected.
  """
  if int(batch_size) != batch_size or batch_size < 1:
    raise ValueError(f"batch_size={batch_size!r}; expected a positive int.")
  preds = formats.load_predictions(predictions_dir, expected_class_names)
  k_arr = resolve_k(variant, len(preds.class_names), preds.class_names, k=k,
                    class_sizes=class_sizes, zipf_total=zipf_total,
                    zipf_exponent=zipf_exponent, seed=seed)
  params = {"predictions": preds.path, "variant": variant, "k": k,
            "class_sizes": dict(sorted(class_sizes.items())) if class_sizes else None,
            "zipf_total": zipf_total, "zipf_exponent": zipf_exponent, "seed": seed}
  excluded = np.zeros(0, np.int64)
  if exclude:
    listed = exclusions.read(exclude)
    excluded = excluded_ids(preds, listed)
    params["exclude"] = listed.describe()
  out = epath.Path(data_dir)
  done = out / formats.SELECTION_FILE
  if done.exists():
    info = json.loads(done.read_text())
    if info.get("params") != params or info.get("class_names") != list(preds.class_names):
      raise ValueError(f"{out} already holds a selection made with other parameters: "
                       f"{info.get('params')} vs {params} now. Use another --data_dir, or "
                       "delete that folder to select again.")
    logging.info("Reusing the finished selection in %s.", out)
    return info
  out.mkdir(parents=True, exist_ok=True)
  for stale in sorted(out.glob("index-*.parquet")):  # Left by an interrupted run.
    logging.warning("Removing %s, left by an unfinished selection.", stale)
    stale.unlink()
  logging.info("Selecting %s from %d shards of %s (%d classes, P=%d), %d wanted",
               variant, len(preds.shards), preds.path, len(k_arr), preds.top_p, k_arr.sum())
  options = pipeline_options.PipelineOptions(list(beam_options or []))
  with beam.Pipeline(runner=local_runner.runner_or_local(beam_runner),
                     options=options) as pipeline:
    _pipeline(pipeline, preds, k_arr, variant, seed, str(out), batch_size, naive, excluded)
  raw_path = out / RAW_REPORT_FILE
  raw = json.loads(raw_path.read_text())
  if preds.num_records is not None and raw["records"] != preds.num_records:
    raise ValueError(f"Read {raw['records']} predictions from {preds.path}, but "
                     f"{formats.INFO_FILE} says num_records={preds.num_records}: unfinished or "
                     "damaged inference output.")
  stats = [row for w in raw["written"] for row in w["classes"]]
  info = {
      "format": formats.FORMAT,
      "params": params,
      "dataset": preds.dataset,
      "splits": list(preds.splits),
      "top_p": preds.top_p,
      "class_names": list(preds.class_names),
      "index_files": [w["file"] for w in raw["written"]],
      "columns": ["dataset", "split", "index", "label", "score", "rank"],
      "report": build_report(k_arr, raw["candidates"], raw["records"], stats,
                             preds.class_names, excluded=raw["excluded"]),
  }
  formats.write_whole(done, json.dumps(info))
  raw_path.unlink()
  return info


def read_index(data_dir) -> tuple[dict[str, Any], pa.Table]:
  """(selection.json, D-hat's rows in order) of a finished selection."""
  root = epath.Path(data_dir)
  done = root / formats.SELECTION_FILE
  if not done.exists():
    raise FileNotFoundError(
        f"No finished selection in {root} ({formats.SELECTION_FILE} is missing).")
  info = json.loads(done.read_text())
  tables = []
  for name in info["index_files"]:
    with (root / name).open("rb") as f:
      tables.append(pq.read_table(f))
  if not tables:
    empty = {"dataset": pa.string(), "split": pa.string(), "index": pa.int64(),
             "label": pa.int32(), "score": pa.float32(), "rank": pa.int32()}
    return info, pa.schema(empty).empty_table()
  return info, pa.concat_tables(tables)


def selected_ids(info: Mapping[str, Any], table: pa.Table) -> dict[int, list[tuple]]:
  """{class: [(dataset, split, index) best first]} for every class, from read_index."""
  out = {c: [] for c in range(len(info["class_names"]))}
  for d, s, i, label in zip(*(table.column(n).to_pylist()
                              for n in ("dataset", "split", "index", "label"))):
    out[label].append((d, s, i))
  return out


def summary(info: Mapping[str, Any], data_dir) -> str:
  """Human-readable summary of a selection and its report."""
  r = info["report"]
  hist = r["class_size_histogram"]
  bins = ", ".join(f"[{a:g}, {b:g}{']' if j == len(hist['num_classes']) - 1 else ')'}: {n}"
                   for j, (a, b, n) in enumerate(zip(hist["edges"], hist["edges"][1:],
                                                     hist["num_classes"])) if n)
  short = r["shortfall"]
  lines = [
      f"Selection ({info['params']['variant']}) in {data_dir}, from {info['params']['predictions']}",
      f"  read {r['num_records']} images ({r.get('num_excluded', 0)} excluded); |D-hat| = {r['num_selected']} of "
      f"{r['num_requested']} wanted, {len(info['index_files'])} index file(s)",
      f"  classes: {r['num_full_classes']} of {r['num_classes']} got their K; class sizes: "
      f"{bins or 'none'}",
  ]
  if short["num_classes"]:
    examples = dict(list(short["classes"].items())[:5])
    lines.append(f"  shortfall: {short['num_classes']} classes miss {short['num_missing']} "
                 f"images (fewer candidates than K), e.g. {examples}")
  lines.append(f"  full report: {epath.Path(data_dir) / formats.SELECTION_FILE}")
  return "\n".join(lines)
