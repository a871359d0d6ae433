"""Metric writers (metrics.jsonl + TensorBoard via tensorboardX) and the progress bar."""
import importlib
import json
import math
import os
import sys

from absl import logging
import numpy as np
import tqdm


def _import_without_torch(name: str):
  """Imports `name` with torch hidden from it unless torch is already loaded.

  tensorboardX's writer imports torch whenever it is installed (the interop extra), only to
  name torch tensors in its type hints: seconds of every trainer process's start-up and most
  of a gigabyte of memory. The writer here logs Python numbers; torch stays importable."""
  if "torch" in sys.modules:
    return importlib.import_module(name)
  sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX expects.
  try:
    return importlib.import_module(name)
  finally:
    del sys.modules["torch"]


tensorboardX = _import_without_torch("tensorboardX")


def _scalar(value):
  value = np.asarray(value)
  return value.item() if value.size == 1 else value.tolist()


class MetricWriteError(RuntimeError):
  """metrics.jsonl could not be written (e.g. a full disk)."""


class MetricWriter:
  """Writes one JSON object per logged step to `workdir/metrics.jsonl` and TensorBoard events.

  Only process 0 writes. The file is only ever appended to: a run resumed from an earlier
  checkpoint (e.g. after falling back from a corrupt one) logs some steps again after the
  rows already there; `read_metrics` reads the file as one uninterrupted run. A last line torn
  by a kill mid-write is ended first, so that the appended rows start on a line of their own.
  A failed write raises MetricWriteError, naming the file and the cause.
  """

  def __init__(self, workdir: str, *, enabled: bool = True):
    self.enabled = enabled
    self.path = os.path.join(workdir, "metrics.jsonl")
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self.tb = tensorboardX.SummaryWriter(logdir=workdir, flush_secs=30)
    self._torn = _ends_mid_line(self.path)

  def write(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    row = {"step": int(step)}
    for k, v in sorted(metrics.items()):
      v = _scalar(v)
      row[k] = v
      if isinstance(v, (int, float)) and math.isfinite(v):
        self.tb.add_scalar(k, v, int(step))
    try:
      with open(self.path, "a") as f:
        f.write(("\n" if self._torn else "") + json.dumps(row) + "\n")
    except OSError as e:
      raise MetricWriteError(f"writing {self.path} failed ({type(e).__name__}: {e}). Free "
                             "space (or fix the file system) and re-run the same command to "
                             "resume from the last checkpoint.") from e
    self._torn = False

  def close(self) -> None:
    """Flushes and closes the TensorBoard file (again: a no-op). A failing flush (e.g. a
    full disk, already reported by the run) is logged, not raised."""
    if self.enabled:
      self.enabled = False
      try:
        self.tb.close()
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("Closing the TensorBoard writer failed: %s: %s", type(e).__name__, e)


def _ends_mid_line(path: str) -> bool:
  """Whether the file exists and its last byte is not a newline."""
  try:
    with open(path, "rb") as f:
      f.seek(0, os.SEEK_END)
      if f.tell() == 0:
        return False
      f.seek(-1, os.SEEK_END)
      return f.read(1) != b"\n"
  except FileNotFoundError:
    return False


def read_metrics(workdir: str) -> list[dict]:
  """Rows of `workdir/metrics.jsonl` as one uninterrupted run (tests, notebooks): where a
  resumed run logged a step already logged, the rows it re-logs (that step and later) replace
  the earlier ones. A step is logged again by a row below the last step logged, or by a train
  row (one with 'train/loss') at or below the last train row's step; a step's evaluation rows
  follow its train row at the same step. A line torn by a kill mid-write is skipped."""
  rows, top, train_top = [], None, None
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue
      step, is_train = row.get("step", 0), "train/loss" in row
      if ((top is not None and step < top) or
          (is_train and train_top is not None and step <= train_top)):
        rows = [r for r in rows if r.get("step", 0) < step]
        top = step  # The resumed run's own rows at this step follow: they stay.
        train_top = max((r.get("step", 0) for r in rows if "train/loss" in r), default=None)
      rows.append(row)
      top = step if top is None else max(top, step)
      train_top = step if is_train else train_top
  return rows


def progress_bar(total: int, initial: int, enabled: bool):
  """tqdm bar over steps; the postfix carries loss and images/s, tqdm supplies the ETA."""
  return tqdm.tqdm(total=total, initial=initial, disable=not enabled, unit="step",
                   dynamic_ncols=True, mininterval=1.0, smoothing=0.1)
