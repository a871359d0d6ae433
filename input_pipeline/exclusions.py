"""Exclusion lists: pool records removed before teacher inference and selection.

Written by `python -m bigpretrain.tools.dedup` (near-duplicates of evaluation images, Yalniz
et al. 2019, supplement section 5) and honoured by `tools.infer --exclude=FILE` (the records are
never scored) and the selection job's `--exclude=FILE` (never selected). The format is a
tab-separated text file, so that a person reviewing the dedup report can delete a line to keep
an image:

  dataset<TAB>split<TAB>index
  demo<TAB>unlabeled<TAB>17
  ...

one line per record (`index`: the record's position in that split, as the dataset's data
source numbers it), sorted, no repeats. Readable without Apache Beam.
"""
import dataclasses
import hashlib
from typing import Iterable

from etils import epath
import numpy as np

HEADER = ("dataset", "split", "index")


@dataclasses.dataclass(frozen=True)
class Exclusions:
  """An exclusion list: per (dataset, split), the sorted unique record indices."""
  path: str
  records: dict[tuple[str, str], np.ndarray]

  def __len__(self) -> int:
    return sum(len(v) for v in self.records.values())

  def indices(self, dataset: str, split: str) -> np.ndarray:
    """Sorted int64 record indices of (dataset, split) on the list (empty if none)."""
    return self.records.get((dataset, split), np.zeros(0, np.int64))

  def sha256(self) -> str:
    """Digest of the content (not of the path): a changed list is a changed run."""
    h = hashlib.sha256()
    for (dataset, split), index in sorted(self.records.items()):
      h.update(f"{dataset}\t{split}\t".encode())
      h.update(index.astype("<i8").tobytes())
    return h.hexdigest()

  def describe(self) -> dict:
    """The list as run parameters and reports record it."""
    return {"path": self.path, "num_records": len(self), "sha256": self.sha256()}


def _check_name(value: str, what: str) -> str:
  if not value or any(c in value for c in "\t\n\r"):
    raise ValueError(f"Exclusion list {what} {value!r} is empty or holds a tab or newline.")
  return value


def write(path, keys: Iterable[tuple[str, str, int]]) -> int:
  """Writes the (dataset, split, index) keys, sorted and deduplicated (temporary file +
  rename); returns the number of lines written."""
  rows = sorted({(_check_name(d, "dataset"), _check_name(s, "split"), int(i))
                 for d, s, i in keys})
  if any(i < 0 for _, _, i in rows):
    raise ValueError("Exclusion list record indices must be >= 0.")
  path = epath.Path(path)
  tmp = path.parent / f".{path.name}.tmp"
  tmp.write_text("".join(f"{d}\t{s}\t{i}\n" for d, s, i in [HEADER] + rows))
  tmp.rename(path)
  return len(rows)


def read(path) -> Exclusions:
  """Reads an exclusion list; FileNotFoundError or ValueError naming the file and line."""
  path = epath.Path(path)
  if not path.exists():
    raise FileNotFoundError(f"Exclusion list {path} does not exist.")
  lines = path.read_text().splitlines()
  if not lines or tuple(lines[0].split("\t")) != HEADER:
    raise ValueError(f"{path} is not an exclusion list: its first line must be "
                     f"{chr(9).join(HEADER)!r} (tab-separated).")
  found: dict[tuple[str, str], list[int]] = {}
  for number, line in enumerate(lines[1:], start=2):
    if not line.strip():
      continue
    fields = line.split("\t")
    if len(fields) != 3 or not fields[0] or not fields[1] or not fields[2].strip().isdigit():
      raise ValueError(f"{path}, line {number}: expected 'dataset<TAB>split<TAB>index' with a "
                       f"non-negative integer index; got {line!r}.")
    found.setdefault((fields[0], fields[1]), []).append(int(fields[2]))
  return Exclusions(str(path), {key: np.unique(np.asarray(v, np.int64))
                                for key, v in sorted(found.items())})
