"""Top-K selection job on the local Beam runner: scaling and the naive form. One JSON line.

  python benchmarks/selection.py [--n=1000000] [--num_classes=1000] [--top_p=10] [--k=2000] \
      [--workers=1] [--naive=true]

Synthetic predictions (input_pipeline/jobs/selection_job.py's Parquet format, shards of
--rows_per_shard rows, written before timing): N and 4N images, each with --top_p distinct
classes drawn from a Zipf-like class distribution (p ~ 1 / (rank + 10), so tail classes get few
candidates, as in the paper's Table 9) and descending scores rounded to 1e-3 (many ties). K is
chosen so selection is non-trivial: at N = 1M an average class has N * P / C = 10k candidates
for K = 2000. Timed: `input_pipeline.jobs.selection_job.prepare` end to end (pipeline start-up, reading,
selecting, writing the index and the report) with the local FnApiRunner; --workers > 1 uses
multi_processing workers. Both sizes select the same C * K pairs, so the output side (sorting
and writing C * K index rows) costs the same at N and 4N; t(4N) / t(N) shows how the input side
(reading and partial top-K of N * P pairs) grows on top of it.

Fields: images_per_sec (at 4N), seconds at N and 4N, scaling_4n_over_n = t(4N) / t(N) (the issue
asks <= 4.4), naive_seconds_n and speedup_vs_naive = t_naive(N) / t(N) for the naive form (one
Beam element per (class, image) pair into Top.PerKey; the issue asks >= 10), the same three
ratios on this process's CPU seconds (cpu_*; with --workers=1 the in-memory runner runs in
this process, so they hold on a busy machine where wall times do not), peak_rss_mb (this
process), and the 1-minute load average at the start and end (a busy machine slows every wall
time). An untimed run on 1000 images first pays one-time imports and set-up.
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import json  # pylint: disable=g-import-not-at-top
import resource
import shutil
import tempfile
import time

from absl import app
from absl import flags
from absl import logging
import numpy as np

from input_pipeline.jobs import selection_job
from input_pipeline import selection_formats

_N = flags.DEFINE_integer("n", 1_000_000, "Images of the small run; the large one has 4x.")
_CLASSES = flags.DEFINE_integer("num_classes", 1000, "Teacher classes.")
_TOP_P = flags.DEFINE_integer("top_p", 10, "Classes kept per image (P).")
_K = flags.DEFINE_integer("k", 2000, "Images per class (K).")
_ROWS = flags.DEFINE_integer("rows_per_shard", 250_000, "Rows per prediction shard.")
_WORKERS = flags.DEFINE_integer("workers", 1, "FnApiRunner workers (--direct_num_workers).")
_NAIVE = flags.DEFINE_bool("naive", True, "Also time the naive Top.PerKey form at N.")


def write_synthetic(out_dir: str, n: int, num_classes: int, top_p: int, rows_per_shard: int,
                    seed: int = 0) -> None:
  """n synthetic top-P predictions over classes 0..num_classes-1 into out_dir."""
  rng = np.random.default_rng(seed)
  weights = 1.0 / (np.arange(num_classes) + 10.0)
  cdf = np.cumsum(weights / weights.sum())
  for shard, start in enumerate(range(0, n, rows_per_shard)):
    rows = min(rows_per_shard, n - start)
    classes = np.searchsorted(cdf, rng.random((rows, top_p))).clip(max=num_classes - 1)
    while True:  # Redraw rows that hold a class twice.
      ordered = np.sort(classes, axis=1)
      bad = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
      if not bad.size:
        break
      classes[bad] = np.searchsorted(cdf, rng.random((bad.size, top_p))).clip(
          max=num_classes - 1)
    scores = np.round(-np.sort(-rng.random((rows, top_p)), axis=1), 3)
    selection_formats.write_predictions(os.path.join(out_dir, f"predictions-{shard:05d}.parquet"),
                                "synthetic", "unlabeled", np.arange(start, start + rows),
                                classes, scores)
  selection_formats.write_info(out_dir, class_names=[f"class_{c}" for c in range(num_classes)],
                       top_p=top_p, dataset="synthetic", splits=["unlabeled"], num_records=n)


def timed_selection(pred_dir: str, out_dir: str, naive: bool = False
                    ) -> tuple[float, float, dict]:
  """(wall seconds, this process's CPU seconds, selection.json) of one selection."""
  options = ([f"--direct_num_workers={_WORKERS.value}",
              "--direct_running_mode=multi_processing"] if _WORKERS.value > 1 else [])
  t0, c0 = time.perf_counter(), time.process_time()
  info = selection_job.prepare(pred_dir, out_dir, k=_K.value, beam_options=options, naive=naive)
  return time.perf_counter() - t0, time.process_time() - c0, info


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  load_start = os.getloadavg()[0]
  root = tempfile.mkdtemp(prefix="selection_bench_")
  try:
    warmup = os.path.join(root, "pred_warmup")  # One-time imports and set-up, untimed.
    os.makedirs(warmup)
    write_synthetic(warmup, 1000, _CLASSES.value, _TOP_P.value, _ROWS.value)
    timed_selection(warmup, os.path.join(root, "out_warmup"))
    timed_selection(warmup, os.path.join(root, "out_warmup_naive"), naive=True)
    seconds, cpu, reports = {}, {}, {}
    for n in (_N.value, 4 * _N.value):
      pred = os.path.join(root, f"pred_{n}")
      os.makedirs(pred)
      write_synthetic(pred, n, _CLASSES.value, _TOP_P.value, _ROWS.value)
      seconds[n], cpu[n], info = timed_selection(pred, os.path.join(root, f"out_{n}"))
      reports[n] = info["report"]
    naive_s = naive_cpu = None
    if _NAIVE.value:
      naive_s, naive_cpu, naive_info = timed_selection(
          os.path.join(root, f"pred_{_N.value}"), os.path.join(root, "out_naive"), naive=True)
      if naive_info["report"] != reports[_N.value]:
        raise RuntimeError("The naive form selected something else than the combiner.")
  finally:
    shutil.rmtree(root, ignore_errors=True)
  n, n4 = _N.value, 4 * _N.value
  print(json.dumps({
      "benchmark": "selection", "runner": "FnApiRunner", "workers": _WORKERS.value,
      "num_classes": _CLASSES.value, "top_p": _TOP_P.value, "k": _K.value,
      "n": n, "selected_n": reports[n]["num_selected"],
      "full_classes_n": reports[n]["num_full_classes"],
      "selected_4n": reports[n4]["num_selected"],
      "images_per_sec": round(n4 / seconds[n4], 1),
      "images_per_sec_n": round(n / seconds[n], 1),
      "seconds_n": round(seconds[n], 2), "seconds_4n": round(seconds[n4], 2),
      "scaling_4n_over_n": round(seconds[n4] / seconds[n], 3),
      "naive_seconds_n": None if naive_s is None else round(naive_s, 2),
      "speedup_vs_naive": None if naive_s is None else round(naive_s / seconds[n], 2),
      "cpu_seconds_n": round(cpu[n], 2), "cpu_seconds_4n": round(cpu[n4], 2),
      "cpu_scaling_4n_over_n": round(cpu[n4] / cpu[n], 3),
      "naive_cpu_seconds_n": None if naive_cpu is None else round(naive_cpu, 2),
      "cpu_speedup_vs_naive": None if naive_cpu is None else round(naive_cpu / cpu[n], 2),
      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
      "load_avg_1m_start": round(load_start, 2), "load_avg_1m_end": round(os.getloadavg()[0], 2),
      "cpu_count": os.cpu_count(),
  }), flush=True)


if __name__ == "__main__":
  app.run(main)
