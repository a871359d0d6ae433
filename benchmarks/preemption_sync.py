"""How far the host runs ahead of the device on several processes, by preemption check. One
JSON line (from process 0).

  PYTHON=python launch/local.sh 2 --devices_per_process=2 --module=benchmarks.preemption_sync \
      -- --config=configs/semantic_softmax.py --config.model.name=vit_demo \
      --config.batch_size=32 --steps=20 --rounds=5

Runs the trainer's loop shape on the config's real train step (a fixed host batch put on the
mesh each step, as the loop does with its pipeline's) with each way of agreeing on a SIGTERM
(bigpretrain.runtime.preemption), alternated round by round:
  every_step  the flag all-gathered on the devices after every step (the former check)
  sync_point  the runtime's preemption sync point (a host-side call)
  log_steps   the flag all-gathered at log steps only (the fallback without the sync manager)
Every --log_every steps the loop waits for the device, as the trainer's metrics flush does.
Per mode: step time (median over rounds) and its ratio to every_step (median of per-round
ratios); `ahead`: the fraction of steps whose dispatch returned before the previous step's
result was ready (the host was a step ahead); `in_flight`: mean and max number of dispatched
steps not yet done when the host goes for the next batch.
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import json  # pylint: disable=g-import-not-at-top
import statistics
import time

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from benchmarks import common
from bigpretrain.runtime import distributed
from bigpretrain.runtime import preemption
from bigpretrain import sharding

_CONFIG = config_flags.DEFINE_config_file("config", None, "Recipe config.", lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 20, "Steps per mode per round.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Alternated rounds.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 10, "The loop waits for the device every N steps.")
distributed.define_flags()

MODES = ("every_step", "sync_point", "log_steps")


def run_mode(runner, host_batch, mode: str, steps: int, log_every: int) -> dict:
  """`steps` steps of the trainer's loop with `mode`'s preemption check."""
  exp = runner.exp
  ahead, in_flight, outstanding, prev = 0, [], [], None
  with preemption.Preemption() as check, jax.set_mesh(exp.mesh):
    if mode == "sync_point" and not check._runtime:  # pylint: disable=protected-access
      raise RuntimeError("No preemption sync manager: run on several processes through "
                         "jax.distributed (launch/local.sh 2 ...).")
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
      batch = sharding.global_batch(host_batch, exp.mesh)
      runner.state, metrics = runner.step(runner.state, batch, exp.frozen)
      loss = metrics["train/loss"]
      ahead += prev is not None and not prev.is_ready()
      log = step % log_every == 0 or step == steps
      if mode == "every_step":
        stop = preemption.allgather_any(check.requested)
      elif mode == "log_steps":
        stop = log and preemption.allgather_any(check.requested)
      else:
        stop = check.agreed(log)
      assert not stop
      outstanding = [x for x in outstanding + [loss] if not x.is_ready()]
      in_flight.append(len(outstanding))
      if log:
        jax.block_until_ready(metrics)
      prev = loss
    seconds = (time.perf_counter() - t0) / steps
  return {"step_s": seconds, "ahead": ahead / (steps - 1), "in_flight": in_flight}


def main(argv):
  del argv
  distributed.initialize_from_flags()
  logging.set_verbosity(logging.WARNING)
  # Opens the processes' CPU collective context while they are in step: opened by the first
  # step instead, a compile that ends > 30 s apart on a loaded machine times it out.
  preemption.allgather_any(False)
  config = _CONFIG.value
  runner = common.Runner(config)
  host_batch = runner.rows
  runs = {m: [] for m in MODES}
  for _ in range(_ROUNDS.value):
    for mode in MODES:
      runs[mode].append(run_mode(runner, host_batch, mode, _STEPS.value, _LOG_EVERY.value))
  ref = runs["every_step"]
  out = {"benchmark": "preemption_sync", "processes": jax.process_count(),
         "devices": jax.device_count(), "platform": jax.devices()[0].platform,
         "model": config.model.name, "batch_size": config.batch_size,
         "steps": _STEPS.value, "rounds": _ROUNDS.value, "log_every": _LOG_EVERY.value,
         "modes": {}}
  for mode, rs in runs.items():
    flights = [n for r in rs for n in r["in_flight"]]
    out["modes"][mode] = {
        "step_time_ms": round(1e3 * statistics.median(r["step_s"] for r in rs), 2),
        "time_ratio_to_every_step": round(statistics.median(
            r["step_s"] / b["step_s"] for r, b in zip(rs, ref)), 3),
        "ahead": round(statistics.mean(r["ahead"] for r in rs), 3),
        "in_flight_mean": round(statistics.mean(flights), 2), "in_flight_max": max(flights),
        "step_time_ms_rounds": [round(1e3 * r["step_s"], 2) for r in rs]}
  if jax.process_index() == 0:
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
  sys.exit(app.run(main))
