"""Metric writers (metrics.jsonl + TensorBoard via tensorboardX) and the progress bar."""
import json
import math
import os

import numpy as np
import tensorboardX
import tqdm


def _scalar(value):
  value = np.asarray(value)
  return value.item() if value.size == 1 else value.tolist()


class MetricWriter:
  """Writes one JSON object per logged step to `workdir/metrics.jsonl` and TensorBoard events.

  Only process 0 writes. On resume, rows logged after the restored step are dropped, so the
  file always reads as one uninterrupted run.
  """

  def __init__(self, workdir: str, *, enabled: bool = True, resume_step: int | None = None):
    self.enabled = enabled
    self.path = os.path.join(workdir, "metrics.jsonl")
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    if os.path.exists(self.path):
      self._truncate(resume_step or 0)
    self.tb = tensorboardX.SummaryWriter(logdir=workdir, flush_secs=30)

  def _truncate(self, last_step: int) -> None:
    with open(self.path) as f:
      rows = [line for line in f if line.strip()]
    kept = []
    for line in rows:
      try:
        if json.loads(line).get("step", 0) <= last_step:
          kept.append(line)
      except json.JSONDecodeError:  # A line torn by a kill mid-write.
        continue
    with open(self.path, "w") as f:
      f.writelines(kept)

  def write(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    row = {"step": int(step)}
    for k, v in sorted(metrics.items()):
      v = _scalar(v)
      row[k] = v
      if isinstance(v, (int, float)) and math.isfinite(v):
        self.tb.add_scalar(k, v, int(step))
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")

  def close(self) -> None:
    if self.enabled:
      self.tb.close()


def read_metrics(workdir: str) -> list[dict]:
  """Rows of `workdir/metrics.jsonl` (tests, notebooks)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def progress_bar(total: int, initial: int, enabled: bool):
  """tqdm bar over steps; the postfix carries loss and images/s, tqdm supplies the ETA."""
  return tqdm.tqdm(total=total, initial=initial, disable=not enabled, unit="step",
                   dynamic_ncols=True, mininterval=1.0, smoothing=0.1)
