"""'selection:DIR': the selected dataset D-hat, read through its index from the source dataset.

DIR is the output of `python -m input_pipeline.prepare selection` (input_pipeline/jobs/selection_job.py:
selection.json + index-*.parquet). Split 'train' is D-hat: example i is record `index` of
split `split` of dataset `dataset` (looked up by name in the same data.dir), with label
`label`; rows in index-file order, so an image selected for two classes appears twice (the
paper's D-hat, section 3.2). The source dataset's other splits ('validation', ...) pass
through unchanged, so the student is evaluated as usual; the source's own 'train' is hidden by
D-hat's. Class list: selection.json's class_names, the teacher's.

A source dataset with another class list (or none in common: the weakly supervised pool of the
semi-weakly supervised variant, e.g. a `hashtags:NAME` dataset, Yalniz et al. 2019 section
4.4) lends D-hat its images only: a record is the source's 'image' and the selection's
'label', no other field of the source is read (its labels mean other classes), and the
dataset has split 'train' alone, its eval labels being in another class list: evaluate the
student on the labelled dataset (config.evals.NAME.dataset).
Read with pyarrow only (no Apache Beam), once, when the dataset is looked up.
"""
import json
from typing import Any

from etils import epath
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from input_pipeline import datasets
from input_pipeline import selection_formats

SPLIT = "train"


class IndexSource(datasets.Source):
  """Random-access D-hat records: the source record of each index row, with its label."""

  def __init__(self, sources: dict[str, Any], split_names: list[str], split_codes: np.ndarray,
               index: np.ndarray, labels: np.ndarray, images_only: bool = False):
    self._sources = sources
    self._images_only = images_only
    self._split_names = split_names
    self._codes, self._index, self._labels = split_codes, index, labels
    self.split = SPLIT

  def __len__(self) -> int:
    return len(self._index)

  def __getitem__(self, i: int) -> dict[str, Any]:
    if not -len(self) <= i < len(self):
      raise IndexError(f"Index {i} out of range for D-hat's {len(self)} records.")
    split = self._split_names[self._codes[i]]
    record = self._sources[split][int(self._index[i])]
    label = int(self._labels[i])
    if self._images_only:  # A pool of another class list: its own fields stay unread.
      return {"image": record["image"], "label": label}
    return {**record, "label": label}

  def __repr__(self) -> str:
    return f"IndexSource(splits={self._split_names!r}, len={len(self)})"


class SelectionDataset(datasets.Dataset):
  """D-hat as split 'train' plus the source dataset's other splits (module docstring)."""

  def __init__(self, name: str, data_dir: str):
    root = epath.Path(name[len("selection:"):])
    done = root / selection_formats.SELECTION_FILE
    if not done.exists():
      raise FileNotFoundError(
          f"No finished selection in {root} ({selection_formats.SELECTION_FILE} is missing) for dataset "
          f"{name!r}: run `python -m input_pipeline.prepare selection --data_dir={root} ...`.")
    meta = json.loads(done.read_text())
    if meta.get("format") != selection_formats.FORMAT:
      raise ValueError(f"{done} has format {meta.get('format')!r}; expected {selection_formats.FORMAT!r}.")
    self.source_dataset = datasets.get_dataset({"name": meta["dataset"], "dir": data_dir})
    src = self.source_dataset.info
    names = [str(c) for c in meta["class_names"]]
    # The source labels in the selection's classes (the pool is a split of the labelled
    # dataset), or in others (a weakly supervised pool): then D-hat lends its images only.
    self.images_only = (src.class_names != names if src.class_names
                        else src.num_classes != len(names))
    table = _read_index(root, meta["index_files"])
    self._split_names, self._codes, self._index, self._labels = _columns(
        table, meta["dataset"], src, len(names), str(root))
    others = [] if self.images_only else [s for s in src.splits if s != SPLIT]
    self.info = datasets.DatasetInfo(
        name=name, num_classes=len(names), class_names=names,
        num_examples={SPLIT: len(self._index), **{s: src.num_examples[s] for s in others}},
        image_size=src.image_size, splits=tuple(sorted([SPLIT] + others)),
        features={"label": 0} if self.images_only else dict(src.features))

  def source(self, split: str) -> datasets.Source:
    self.check_split(split)
    if split != SPLIT:
      return self.source_dataset.source(split)
    sources = {s: self.source_dataset.source(s) for s in self._split_names}
    return IndexSource(sources, self._split_names, self._codes, self._index, self._labels,
                       images_only=self.images_only)


def _read_index(root: epath.Path, files) -> pa.Table:
  tables = []
  for name in files:
    with (root / name).open("rb") as f:
      tables.append(pq.read_table(f, columns=["dataset", "split", "index", "label"]))
  if not tables:
    return pa.table({"dataset": pa.array([], pa.string()), "split": pa.array([], pa.string()),
                     "index": pa.array([], pa.int64()), "label": pa.array([], pa.int32())})
  return pa.concat_tables(tables)


def _columns(table: pa.Table, dataset: str, src, num_classes: int, where: str):
  """(split names, split code, index, label) arrays, checked against the source dataset."""
  names = set(table.column("dataset").unique().to_pylist())
  if names - {dataset}:
    raise ValueError(f"Selection {where} has rows of datasets {sorted(names - {dataset})}; "
                     f"selection.json names only {dataset!r}.")
  splits = table.column("split").combine_chunks().dictionary_encode()
  split_names = [str(s) for s in splits.dictionary.to_pylist()]
  unknown = [s for s in split_names if s not in src.splits]
  if unknown:
    raise ValueError(f"Selection {where} reads splits {unknown} that dataset {dataset!r} "
                     f"lacks (it has {list(src.splits)}).")
  codes = splits.indices.to_numpy(zero_copy_only=False).astype(np.int32)
  index = table.column("index").to_numpy().astype(np.int64)
  labels = table.column("label").to_numpy().astype(np.int32)
  sizes = np.array([src.num_examples[s] for s in split_names] or [0], np.int64)
  bad = (index < 0) | (index >= sizes[codes]) if len(index) else np.zeros(0, bool)
  if bad.any():
    i = int(np.argmax(bad))
    raise ValueError(f"Selection {where}: row {i} points at record {index[i]} of split "
                     f"{split_names[codes[i]]!r}, which has {sizes[codes[i]]} records.")
  if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
    raise ValueError(f"Selection {where} has labels outside [0, {num_classes}).")
  return split_names, codes, index, labels


@datasets.SOURCES.register("selection:", usage="selection:DIR")
def load(name: str, data_dir: str) -> SelectionDataset:
  return SelectionDataset(name, data_dir)
