"""The files of the semi-supervised stages, readable without Apache Beam: prediction shards and
predictions.json (written by bigpretrain.tools.infer, read by the selection job) and the names of
the selection's output files (read by the `selection:DIR` data source). The formats are
described in input_pipeline/jobs/selection_job.py's docstring.
"""
import dataclasses
import json
import uuid
from typing import Sequence

from etils import epath
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FORMAT = "bigpretrain.semisup/1"
INFO_FILE = "predictions.json"
SELECTION_FILE = "selection.json"


def write_predictions(path, dataset: str, split: str, index, classes, scores,
                      tags: Sequence[Sequence[str]] | None = None) -> None:
  """Writes one prediction shard (Parquet; module docstring) for rows of one split."""
  index = np.asarray(index, np.int64)
  classes, scores = np.asarray(classes, np.int32), np.asarray(scores, np.float32)
  n, p = classes.shape
  columns = {
      "dataset": pa.array([dataset] * n, pa.string()),
      "split": pa.array([split] * n, pa.string()),
      "index": pa.array(index),
      "classes": pa.FixedSizeListArray.from_arrays(pa.array(classes.ravel()), p),
      "scores": pa.FixedSizeListArray.from_arrays(pa.array(scores.ravel()), p),
  }
  if tags is not None:
    columns["tags"] = pa.array([list(t) for t in tags], pa.list_(pa.string()))
  with epath.Path(path).open("wb") as f:
    pq.write_table(pa.table(columns), f)


def write_info(pred_dir, *, class_names: Sequence[str], top_p: int, dataset: str,
               splits: Sequence[str], num_records: int | None = None,
               scores: str = "softmax", num_excluded: int | None = None) -> None:
  """Writes predictions.json (module docstring) into pred_dir; num_excluded: records left
  out by an exclusion list (bigpretrain.tools.infer --exclude)."""
  info = {"class_names": list(class_names), "top_p": int(top_p), "dataset": dataset,
          "splits": sorted(splits), "scores": scores}
  if num_records is not None:
    info["num_records"] = int(num_records)
  if num_excluded is not None:
    info["num_excluded"] = int(num_excluded)
  write_whole(epath.Path(pred_dir) / INFO_FILE, json.dumps(info, indent=1))


def write_whole(path: epath.Path, text: str) -> None:
  """Writes `path` whole or not at all (a temporary name, then a rename): a done-marker that
  a kill mid-write leaves half written would be trusted by the re-run."""
  tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex}"
  tmp.write_text(text)
  tmp.replace(path)


@dataclasses.dataclass(frozen=True)
class Predictions:
  """A predictions folder: its info and its shards (sorted paths)."""
  path: str
  class_names: tuple[str, ...]
  top_p: int
  dataset: str
  splits: tuple[str, ...]
  shards: tuple[str, ...]
  num_records: int | None

  @property
  def sources(self) -> list[tuple[str, str]]:
    """(dataset, split) pairs in key order; an image's packed id starts with its position."""
    return sorted((self.dataset, s) for s in self.splits)


def load_predictions(pred_dir, expected_class_names: Sequence[str] | None = None
                     ) -> Predictions:
  """Reads and checks a predictions folder; FileNotFoundError or ValueError saying what is
  wrong (missing folder, info or shards; a class list other than expected_class_names)."""
  root = epath.Path(pred_dir)
  if not root.is_dir():
    raise FileNotFoundError(f"Predictions folder {root} (--predictions) does not exist.")
  info_path = root / INFO_FILE
  if not info_path.exists():
    raise FileNotFoundError(f"{info_path} is missing: a predictions folder holds Parquet shards "
                            f"and {INFO_FILE} (see input_pipeline/jobs/selection_job.py).")
  info = json.loads(info_path.read_text())
  missing = [key for key in ("class_names", "top_p", "dataset", "splits") if key not in info]
  if missing:
    raise ValueError(f"{info_path} lacks {missing}.")
  names, top_p = [str(c) for c in info["class_names"]], info["top_p"]
  if not names or isinstance(top_p, bool) or not isinstance(top_p, int) or not (
      1 <= top_p <= len(names)):
    raise ValueError(f"{info_path}: expected class_names (non-empty) and 1 <= top_p <= "
                     f"{len(names)}; got {len(names)} classes, top_p={top_p!r}.")
  splits = info["splits"]
  if not splits or isinstance(splits, str) or len(set(splits)) != len(splits):
    raise ValueError(f"{info_path}: splits must be a non-empty list of distinct names; "
                     f"got {splits!r}.")
  if expected_class_names is not None:
    check_class_names(names, list(expected_class_names), str(root))
  shards = sorted(str(p) for p in root.glob("*.parquet"))
  if not shards:
    raise FileNotFoundError(f"No prediction shards (*.parquet) in {root}.")
  return Predictions(str(root), tuple(names), top_p, str(info["dataset"]),
                     tuple(sorted(splits)), tuple(shards), info.get("num_records"))


def check_class_names(found: Sequence[str], expected: Sequence[str], where: str) -> None:
  """ValueError when a teacher's class list differs from the expected one."""
  if list(found) == list(expected):
    return
  first = next((i for i, (a, b) in enumerate(zip(found, expected)) if a != b),
               min(len(found), len(expected)))
  at = (f"label {first} is {found[first] if first < len(found) else '(none)'!r} there, "
        f"{expected[first] if first < len(expected) else '(none)'!r} expected")
  raise ValueError(f"The predictions in {where} come from a teacher with another class list: "
                   f"{len(found)} classes, {len(expected)} expected; first difference: {at}.")
