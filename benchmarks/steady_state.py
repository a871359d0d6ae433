"""The steady-state rate of an input pipeline: the one method every pipeline figure in
benchmarks/ uses (keep_up.py, accelerator.py's keep_up, input_pipeline.py).

With W grain worker processes (data.num_workers) the batches come from the workers in turn
(batch j from worker j mod W), and each worker's first batch carries its start-up: process
spawn, imports, opening the shards. A rate timed over the first few dozen batches is mostly
start-up. So the rate is taken after a warm-up of `warmup_per_worker` batches from every
worker, over whole rounds of W batches (each worker the same share), for at least
`min_seconds` or exactly `batches_per_worker` rounds when given. In-process decoding
(W = 0) counts as one worker.

CPU: user + system seconds over the timed window (psutil) of the worker processes (this
process's children) and of the consuming process itself (its decode threads when W = 0),
each per record; and of the consumer's busiest thread. The consumer's serial ceiling lies
between 1 / its CPU per record (all its threads on one core) and 1 / its busiest thread's
(threads on their own cores, e.g. grain's thread that frees each batch's shared memory).
"""
import resource
import time
from typing import Any, Callable, Iterator

import psutil

WARMUP_PER_WORKER = 2
MIN_SECONDS = 15.0


def _cpu_seconds(procs: list[psutil.Process]) -> float:
  return sum(sum(p.cpu_times()[:2]) for p in procs)


def _thread_cpu_seconds(proc: psutil.Process) -> dict[int, float]:
  return {t.id: t.user_time + t.system_time for t in proc.threads()}


def measure(it: Iterator[dict], *, batch_size: int, workers: int,
            min_seconds: float = MIN_SECONDS, batches_per_worker: int | None = None,
            warmup_per_worker: int = WARMUP_PER_WORKER,
            consume: Callable[[dict], Any] | None = None) -> dict:
  """Steady-state figures of `it`, a pipeline of `workers` worker processes yielding batches
  of `batch_size` records; `consume` (default: nothing) is what the consumer does with each
  batch besides taking it, e.g. the copy to the devices."""
  if workers < 0 or batch_size < 1 or warmup_per_worker < 1:
    raise ValueError(f"need workers >= 0, batch_size >= 1, warmup_per_worker >= 1; got "
                     f"{workers}, {batch_size}, {warmup_per_worker}")
  if batches_per_worker is not None and batches_per_worker < 1:
    raise ValueError(f"batches_per_worker must be >= 1, got {batches_per_worker}")
  consume = consume or (lambda batch: None)
  round_size = max(workers, 1)
  for _ in range(warmup_per_worker * round_size):
    consume(next(it))
  me = psutil.Process()
  children = me.children(recursive=True)
  if workers and len(children) < workers:
    raise RuntimeError(f"expected {workers} worker processes, found {len(children)}")
  worker_cpu0, my_cpu0, threads0 = _cpu_seconds(children), _cpu_seconds([me]), (
      _thread_cpu_seconds(me))
  t0 = time.perf_counter()
  rounds = 0
  while True:
    for _ in range(round_size):
      consume(next(it))
    rounds += 1
    elapsed = time.perf_counter() - t0
    if (rounds >= batches_per_worker if batches_per_worker else elapsed >= min_seconds):
      break
  worker_cpu, my_cpu = _cpu_seconds(children) - worker_cpu0, _cpu_seconds([me]) - my_cpu0
  busiest = max(cpu - threads0.get(tid, 0.0) for tid, cpu in _thread_cpu_seconds(me).items())
  records = rounds * round_size * batch_size
  rate = records / elapsed
  return {"records_per_sec": rate, "records_per_sec_per_worker": rate / round_size,
          "worker_cpu_s_per_record": worker_cpu / records,
          "consumer_cpu_s_per_record": my_cpu / records,
          "consumer_busiest_thread_cpu_s_per_record": busiest / records,
          "workers": workers, "batch_size": batch_size,
          "warmup_batches": warmup_per_worker * round_size,
          "timed_batches": rounds * round_size, "timed_s": elapsed}


def report(figures: dict) -> dict:
  """`figures` as a benchmark line gives them: rates to 0.1 record/s, CPU to 0.1 microsecond
  per record, time to ms; with the benchmarks' common `images_per_sec` (records/s) and
  `step_time_ms` (per batch) and this process's `peak_rss_mb`."""
  digits = {"records_per_sec": 1, "records_per_sec_per_worker": 1, "timed_s": 3,
            "worker_cpu_s_per_record": 7, "consumer_cpu_s_per_record": 7,
            "consumer_busiest_thread_cpu_s_per_record": 7}
  out = {k: round(v, digits[k]) if k in digits else v for k, v in figures.items()}
  out["images_per_sec"] = out["records_per_sec"]
  out["step_time_ms"] = round(1e3 * figures["timed_s"] / figures["timed_batches"], 2)
  out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
  return out
