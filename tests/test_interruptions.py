"""Interruptions of a real run: SIGTERM while it is set up, Ctrl-C while it trains; what the
signal handlers do in-process; a data worker's death. Each is one line, never a traceback,
and leaves no lock behind."""
import os
import signal
import subprocess
import sys
import time

import pytest

from bigpretrain.runtime import metric_writers
from bigpretrain.runtime import preemption
from bigpretrain import train
from tests import helpers


def _wait_for(condition, proc, what: str, timeout: float = 300):
  deadline = time.time() + timeout
  while not condition():
    assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()}"
    assert time.time() < deadline, f"no {what} after {timeout} s"
    time.sleep(0.05)


def _start(workdir, **overrides) -> subprocess.Popen:
  env = helpers.env()
  del env["JAX_PLATFORMS"]  # As a user runs it, with libtpu and the CUDA plugin installed.
  return subprocess.Popen([sys.executable, "-m", "bigpretrain.main"]
                          + helpers.main_args(workdir, **overrides),
                          env=env, cwd=helpers.ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_sigterm_while_set_up_and_ctrl_c_while_training(tmp_path):
  lock = tmp_path / ".lock"
  # SIGTERM once the lock is taken, while the model, data and restore are set up.
  run = _start(tmp_path, total_steps=100000)
  _wait_for(lock.exists, run, "lock")
  run.send_signal(signal.SIGTERM)
  out, err = run.communicate(timeout=300)
  assert run.returncode == 0, err[-3000:]
  assert err.strip() == ("SIGTERM received while the run was being set up: nothing new to "
                         "save; exiting."), err[-3000:]
  assert not lock.exists() and not (tmp_path / "checkpoints" / "1").exists()
  # Only the platforms this host has were started: no CUDA-plugin or libtpu errors, one line.
  (log,) = tmp_path.glob("log.*.INFO.*")
  assert "JAX platforms: cpu (the devices this host has" in log.read_text()

  # The same command: Ctrl-C while it trains saves the step it reached and exits 0.
  run = _start(tmp_path, total_steps=100000)
  _wait_for(lambda: (tmp_path / "metrics.jsonl").exists() and any(
      r["step"] >= 2 for r in metric_writers.read_metrics(str(tmp_path))), run, "step 2")
  run.send_signal(signal.SIGINT)
  out, err = run.communicate(timeout=300)
  assert run.returncode == 0, err[-3000:]
  assert "Traceback" not in err, err[-3000:]
  assert "Ctrl-C received: saving a checkpoint and exiting (Ctrl-C again stops at once)." in err
  saved = int(out.split("Preempted: saved checkpoint at step ")[1].split(";")[0])
  assert (tmp_path / "checkpoints" / str(saved)).is_dir() and saved >= 2
  assert not lock.exists()


def test_a_second_ctrl_c_stops_at_once_releasing_the_lock(monkeypatch, capsys):
  released, exits = [], []

  def exit_now(code):
    exits.append(code)
    raise SystemExit(code)

  monkeypatch.setattr(os, "_exit", exit_now)
  before = signal.getsignal(signal.SIGINT)
  with preemption.Preemption() as p:
    p.on_abort = lambda: released.append(True)
    os.kill(os.getpid(), signal.SIGINT)
    assert p.agreed(log_step=False) and not exits  # The first: save and stop.
    with pytest.raises(SystemExit):
      os.kill(os.getpid(), signal.SIGINT)
  assert exits == [130] and released == [True]
  assert signal.getsignal(signal.SIGINT) is before
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1] == "Second Ctrl-C: stopping now, without saving."


def test_a_signal_while_set_up_stops_it_and_one_before_stops_it_at_once(capsys):
  with preemption.Preemption() as p:
    p.setting_up(True)
    with pytest.raises(preemption.Interrupted, match="SIGTERM received while the run"):
      os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(preemption.Interrupted):  # A set-up that goes on anyway ends there.
      p.setting_up(False)
  with preemption.Preemption() as p:
    os.kill(os.getpid(), signal.SIGTERM)  # While the lock is taken: acted on right after.
    with pytest.raises(preemption.Interrupted):
      p.setting_up(True)
  capsys.readouterr()
  # A run's context opens in its set-up: a signal while its lock is taken (before
  # setting_up(True)) says only the set-up's line, where the set-up starts.
  with preemption.Preemption(in_set_up=True) as p:
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(preemption.Interrupted, match="^SIGTERM received while the run was "
                       "being set up: nothing new to save; exiting.$"):
      p.setting_up(True)
  assert capsys.readouterr().err == ""


def test_an_error_raised_on_the_way_out_of_a_stopped_set_up_is_the_stop(capsys):
  def fails_on_the_way_out():  # Code that cleans up after any exception and fails doing it.
    try:
      os.kill(os.getpid(), signal.SIGTERM)
    finally:
      raise ValueError()  # pylint: disable=lost-exception

  def swallows_it_and_fails_later():
    try:
      os.kill(os.getpid(), signal.SIGTERM)
    except BaseException:  # pylint: disable=broad-exception-caught
      pass
    raise TypeError()

  for library_call in (fails_on_the_way_out, swallows_it_and_fails_later):
    with pytest.raises(preemption.Interrupted, match="^SIGTERM received while the run was "
                       "being set up: nothing new to save; exiting.$") as e:
      with preemption.Preemption(in_set_up=True) as p:
        p.setting_up(True)
        library_call()
    assert isinstance(e.value.__cause__, (ValueError, TypeError))
  with pytest.raises(ValueError, match="^a real error$"):  # An error of its own goes through.
    with preemption.Preemption(in_set_up=True) as p:
      p.setting_up(True)
      raise ValueError("a real error")
  capsys.readouterr()


class _Saver:
  """A checkpointer whose save of step 8 is in flight."""

  def __init__(self):
    self.waited = False

  def wait(self):
    self.waited = True

  def latest_step(self):
    return 8 if self.waited else 4


def test_a_killed_data_worker_is_one_line_after_the_save_in_flight():
  def batches():
    yield {"image": 0}
    # What grain raises when a worker process is killed (kill -9, the OOM killer).
    raise RuntimeError("Worker process was terminated unexpectedly with exit code -9. Search "
                       "the logs above for the source of the crash.")

  it, saver = batches(), _Saver()
  assert train._next_batch(it, saver) == {"image": 0}  # pylint: disable=protected-access
  with pytest.raises(train.DataWorkerDied) as e:
    train._next_batch(it, saver)  # pylint: disable=protected-access
  assert saver.waited
  assert str(e.value) == (
      "a data worker process died (killed by SIGKILL: most likely the out-of-memory killer; "
      "see `dmesg`). Lower data.num_workers or data.prefetch, or give the job more memory, "
      "then re-run the same command to resume from the last checkpoint (step 8).")
  other = iter(())
  with pytest.raises(StopIteration):  # Anything else goes through unchanged.
    train._next_batch(other, saver)  # pylint: disable=protected-access


def test_a_data_worker_killed_by_sigbus_names_the_shared_memory():
  # SIGBUS: a worker writing a batch into a full /dev/shm; and no checkpoint saved yet.
  class _NoSave(_Saver):
    def latest_step(self):
      return None

  def batches():
    raise RuntimeError("Worker process was terminated unexpectedly with exit code -7.")
    yield  # pylint: disable=unreachable

  with pytest.raises(train.DataWorkerDied) as e:
    train._next_batch(batches(), _NoSave())  # pylint: disable=protected-access
  # An evaluation's worker dies the same way (the train stream's wait meanwhile).
  class _Dies:
    every_steps = 2

    def run(self, state):
      del state
      next(batches())

  out = train._StepOutputs(  # pylint: disable=protected-access
      config=None, total_steps=4, evaluators=[_Dies()], writer=None, checkpointer=_NoSave(),
      train_iter=None, perf=None, profiler=None, bar=None, pending=None)
  with pytest.raises(train.DataWorkerDied) as in_eval:
    out.run_evals(2, {})
  assert str(in_eval.value) == str(e.value)
  assert str(e.value) == (
      "a data worker process died (killed by SIGBUS: most likely /dev/shm was full, where "
      "workers hand their batches over (docker run --shm-size=...)). Lower data.num_workers or "
      "data.prefetch, or give the job more memory, then re-run the same command to start over "
      "(no checkpoint was saved yet).")


def test_an_error_that_stops_the_run_lets_the_save_in_flight_finish():
  saver = _Saver()
  train._settle_saves(saver, None)  # pylint: disable=protected-access
  assert not saver.waited  # A normal end waits in the loop's own order.
  train._settle_saves(saver, metric_writers.MetricWriteError)  # pylint: disable=protected-access
  assert saver.waited and saver.latest_step() == 8


def test_device_memory_run_out_is_one_line_saying_what_to_change(tmp_path, monkeypatch):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import ml_collections  # pylint: disable=import-outside-toplevel

  def runs_out(*args):  # XLA's own error: a 640 GB buffer (on CPU, as on an accelerator).
    del args
    jax.jit(lambda x: jnp.outer(x, x) + 1)(jnp.ones((400_000,), jnp.float32)).block_until_ready()

  monkeypatch.setattr(train, "_train_and_evaluate", runs_out)
  with pytest.raises(train.DeviceOutOfMemory) as e:
    train.train_and_evaluate(ml_collections.ConfigDict({"batch_size": 32}), str(tmp_path))
  assert str(e.value) == (
      "the devices ran out of memory (RESOURCE_EXHAUSTED: Out of memory allocating "
      "640000000000 bytes.). Lower config.batch_size=32 (over 8 devices), set "
      "config.model.remat (e.g. 'nothing_saveable'), or shard the weights over more devices "
      "(config.mesh's fsdp); `python -m bigpretrain.tools.plan --config=... --topology=... "
      "--max_batch` finds the largest batch that fits, without a device.")


def test_a_data_workers_death_in_a_command_is_one_line(capsys):
  from bigpretrain.tools import cli  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit) as e:
    with cli.user_errors():
      raise RuntimeError("Worker process was terminated unexpectedly with exit code -9. Search "
                         "the logs above for the source of the crash.")
  assert e.value.code == 1
  assert capsys.readouterr().err == (
      "ERROR: a data worker process died (killed by SIGKILL: most likely the out-of-memory "
      "killer; see `dmesg`). Use fewer data workers (--num_workers, or a section's num_workers "
      "in the semi-supervised runner's config) or give the job more memory, then re-run it.\n")
  with pytest.raises(RuntimeError, match="^another error$"):  # Any other goes through.
    with cli.user_errors():
      raise RuntimeError("another error")
