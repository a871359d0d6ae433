"""Runs of `python -m bigpretrain.main` as a user starts them: resume, preemption, corruption,
and two processes against one."""
import contextlib
import json
import os
import signal
import shutil
import subprocess
import sys
import time

import jax
import pytest

from bigpretrain import sharding
from bigpretrain.runtime import goodput
from bigpretrain.runtime import metric_writers
from tests import helpers


def _losses(workdir) -> dict[int, float]:
  return {r["step"]: r["train/loss"] for r in metric_writers.read_metrics(str(workdir))
          if "train/loss" in r}


def _wait_for_step(workdir, step, proc, timeout=300):
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + timeout
  while time.time() < deadline:
    if proc.poll() is not None:
      raise AssertionError(f"run ended early:\n{proc.stdout.read()}")
    if os.path.exists(path):
      with open(path) as f:
        steps = [json.loads(l)["step"] for l in f if l.strip().endswith("}")]
      if steps and max(steps) >= step:
        return
    time.sleep(0.05)
  raise AssertionError(f"step {step} not reached")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted 10-step run checkpointing every 3 steps."""
  workdir = tmp_path_factory.mktemp("ref")
  r = helpers.run_main(helpers.main_args(workdir, total_steps=10, ckpt_every_steps=3))
  assert r.returncode == 0, r.stderr[-3000:]
  # Platform probing noise is silenced (this machine has no libtpu); the run's own lines stay.
  assert "Unable to initialize backend" not in r.stderr
  # The run's start-up lines are in its log (kept from before the workdir's lock was taken).
  assert "distributed: single, process 0 of 1" in (workdir / "log.INFO").read_text()
  return workdir, _losses(workdir)


@pytest.mark.slow  # Two runs end to end, one killed.
def test_resume_after_sigkill_gives_identical_losses(reference, tmp_path):
  _, ref = reference
  args = helpers.main_args(tmp_path, total_steps=10, ckpt_every_steps=3)
  proc = helpers.popen_main(args)
  _wait_for_step(tmp_path, 7, proc)  # Past the step-6 checkpoint, before the step-9 one.
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  r = helpers.run_main(args)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "Resuming from step" in r.stdout
  got = _losses(tmp_path)
  assert sorted(got) == list(range(1, 11))
  for step in range(1, 11):
    assert got[step] == pytest.approx(ref[step], rel=1e-6, abs=1e-6), step


def test_sigterm_saves_and_exits_zero(tmp_path):
  args = helpers.main_args(tmp_path, total_steps=100000, ckpt_every_steps=0)
  proc = helpers.popen_main(args)
  _wait_for_step(tmp_path, 3, proc)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out[-3000:]
  saved = [int(p) for p in os.listdir(tmp_path / "checkpoints") if p.isdigit()]
  assert saved and "Preempted: saved checkpoint at step" in out
  assert max(saved) >= 3 and max(saved) == max(_losses(tmp_path))


@pytest.mark.slow  # Two runs end to end (the reference fixture's and the resumed one).
def test_corrupt_latest_checkpoint_falls_back(reference, tmp_path):
  ref_dir, ref = reference
  shutil.copytree(ref_dir, tmp_path, dirs_exist_ok=True)
  ckpts = tmp_path / "checkpoints"
  latest = max(int(p) for p in os.listdir(ckpts) if p.isdigit())
  for root, _, files in os.walk(ckpts / str(latest) / "params"):
    if os.path.basename(root) == "d":
      for f in files:  # Truncate the array data, as an interrupted copy would.
        path = os.path.join(root, f)
        with open(path, "rb") as fh:
          data = fh.read()
        with open(path, "wb") as fh:
          fh.write(data[:len(data) // 2])
  # A longer run than the reference's: a schedule change, allowed explicitly.
  r = helpers.run_main(helpers.main_args(tmp_path, total_steps=12, ckpt_every_steps=3,
                                         allow_schedule_change=True))
  assert r.returncode == 0, r.stderr[-3000:]
  out = r.stdout + r.stderr
  assert out.count(f"checkpoint step {latest} ") == 1 and "is unreadable" in out
  assert "Traceback" not in out  # One warning, not the failed restore's async noise.
  assert (tmp_path / "checkpoints_corrupt" / str(latest)).exists()  # Kept, not deleted.
  # Appended to, never truncated: the first run's rows are all still there.
  assert (tmp_path / "metrics.jsonl").read_bytes().startswith(
      (ref_dir / "metrics.jsonl").read_bytes())
  got = _losses(tmp_path)
  for step in range(1, 11):  # Steps after the fallback are recomputed identically.
    assert got[step] == pytest.approx(ref[step], rel=1e-6, abs=1e-6), step


@pytest.mark.slow  # Two runs end to end (the reference fixture's and the fresh one).
def test_fresh_start_after_a_failed_restore_is_a_fresh_run(reference, tmp_path):
  ref_dir, ref = reference
  shutil.copytree(ref_dir / "checkpoints", tmp_path / "checkpoints")
  steps = [p for p in os.listdir(tmp_path / "checkpoints") if p.isdigit()]
  for root, _, files in os.walk(tmp_path / "checkpoints"):
    if os.path.basename(root) == "d" and f"{os.sep}params{os.sep}" in root:
      for f in files:
        path = os.path.join(root, f)
        with open(path, "r+b") as fh:
          fh.truncate(os.path.getsize(path) // 2)
  # Every checkpoint unreadable, the run starts over: the data stream from its beginning
  # too (not where the failed restores left the iterator).
  r = helpers.run_main(helpers.main_args(tmp_path, total_steps=10, ckpt_every_steps=3))
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.count("is unreadable") == len(steps) > 1 and "Resuming" not in r.stdout
  got = _losses(tmp_path)
  assert sorted(got) == list(range(1, 11))
  for step in range(1, 11):
    assert got[step] == pytest.approx(ref[step], rel=1e-6, abs=1e-6), step


@pytest.mark.multiprocess
def test_two_processes_match_one_process_and_a_slow_one_is_flagged(reference, tmp_path):
  """The reference's command on 2 processes x 2 devices, process 1's input slowed: the same
  losses as on one device, and process 1 named the straggler (perf/slowest_*)."""
  _, ref = reference
  delay = 0.5
  cmd = [str(helpers.ROOT / "launch" / "local.sh"), "2", "--devices_per_process=2", "--"]
  cmd += helpers.main_args(tmp_path, total_steps=10, ckpt_every_steps=3)
  env = helpers.env()
  env["XLA_FLAGS"] = helpers.TEST_XLA_FLAGS  # local.sh adds the device count.
  env["PYTHON"] = sys.executable
  env[goodput.SLOW_INPUT_ENV] = f"{delay}@1"
  r = subprocess.run(cmd, env=env, cwd=helpers.ROOT, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  got = _losses(tmp_path)
  assert sorted(got) == sorted(ref) == list(range(1, 11))
  for step in got:
    assert got[step] == pytest.approx(ref[step], rel=2e-5, abs=2e-5), step
  assert "Straggler: process 1 " in r.stdout
  rows = [row for row in metric_writers.read_metrics(str(tmp_path)) if "train/loss" in row]
  for row in rows[1:]:  # Past the first step (compilation: either process may be slowest).
    assert row["perf/slowest_process"] == 1, row
    # Process 1 spent at least `delay` per step in next(), none of it waiting for process 0.
    assert row["perf/slowest_step_time_ms"] >= 1e3 * delay


def test_a_finished_run_run_again_reports_its_final_eval_without_a_second_row(demo_run,
                                                                             tmp_path, capsys):
  from bigpretrain import train  # pylint: disable=import-outside-toplevel
  workdir = tmp_path / "run"
  shutil.copytree(demo_run, workdir, ignore=shutil.ignore_patterns("*.lock", "log.*"))
  metrics = workdir / "metrics.jsonl"
  logged = metrics.read_text()
  final = [json.loads(l) for l in logged.splitlines() if json.loads(l)["step"] == 2
           and "train/loss" not in json.loads(l)]
  assert len(final) == 1 and len(final[0]) > 1
  want = {k: v for k, v in final[0].items() if k != "step"}
  config = helpers.tiny_config(total_steps=2)  # What demo_run trained.

  assert train.train_and_evaluate(config, str(workdir)) == want
  assert metrics.read_text() == logged  # Nothing evaluated again, no row added.
  assert "had finished" in capsys.readouterr().out

  # Stopped after its last save, before its final eval: the eval runs, once.
  metrics.write_text("".join(l + "\n" for l in logged.splitlines()
                             if json.loads(l) != final[0]))
  final_calls = []

  def recording_final(self, step, *args, **kwargs):
    final_calls.append((step, sharding._RULES.get() is not None,  # pylint: disable=protected-access
                        not jax.sharding.get_abstract_mesh().empty))
    return run_evals(self, step, *args, **kwargs)

  run_evals = train._StepOutputs.run_evals  # pylint: disable=protected-access
  with pytest.MonkeyPatch.context() as patch:  # Under the run's mesh and rules, as in the loop.
    patch.setattr(train._StepOutputs, "run_evals",  # pylint: disable=protected-access
                  recording_final)
    got = train.train_and_evaluate(config, str(workdir))
  assert final_calls == [(2, True, True)], final_calls
  assert got.keys() == want.keys()
  for k, v in want.items():
    assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
  rows = [json.loads(l) for l in metrics.read_text().splitlines()]
  assert sum(r["step"] == 2 and "train/loss" not in r for r in rows) == 1

  # Preempted at an eval step of a longer run (saved, not yet evaluated): the resumed run
  # evaluates that step first, once, then trains on.
  metrics.write_text("".join(l + "\n" for l in logged.splitlines()
                             if json.loads(l) != final[0]))
  longer = helpers.tiny_config(total_steps=3, eval_every_steps=2, allow_schedule_change=True)
  # The owed evaluation runs inside the timer's excluded span, not in the next train row's
  # step time (the first row after such a resume showed a step 20x slower).
  excluded = goodput.IntervalTimer.excluded
  inside, calls = [], []

  @contextlib.contextmanager
  def flagged(self):
    inside.append(True)
    try:
      with excluded(self):
        yield
    finally:
      inside.pop()

  def recording_evals(self, step, *args, **kwargs):
    # Also under the run's mesh and logical rules, as the evaluations in the loop are (model
    # code's sharding.constrain takes its sharded path only there).
    in_context = (sharding._RULES.get() is not None  # pylint: disable=protected-access
                  and not jax.sharding.get_abstract_mesh().empty)
    calls.append((step, bool(inside), in_context))
    return run_evals(self, step, *args, **kwargs)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(goodput.IntervalTimer, "excluded", flagged)
    patch.setattr(train._StepOutputs, "run_evals",  # pylint: disable=protected-access
                  recording_evals)
    train.train_and_evaluate(longer, str(workdir))
  assert calls[0] == (2, True, True), calls
  assert all(c[2] for c in calls), calls
  rows = [json.loads(l) for l in metrics.read_text().splitlines()]
  assert [r["step"] for r in rows if "train/loss" not in r] == [2, 3]
  assert max(r["step"] for r in rows if "train/loss" in r) == 3
