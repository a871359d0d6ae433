"""bigpretrain.runtime.preemption: how the loop learns of a SIGTERM on one and on several processes
(a whole 2-process run, SIGTERMed and resumed, is tests/test_topology_resume.py's)."""
import os
import signal
import sys

import jax
from jax.experimental import multihost_utils
import pytest

from bigpretrain.runtime import preemption


def _no_allgather(*args, **kwargs):
  raise AssertionError("a device all-gather (it waits for the step just dispatched)")


def test_one_process_sigterm_sets_the_flag_and_the_handler_is_restored():
  before = signal.getsignal(signal.SIGTERM)
  with preemption.Preemption() as p:
    assert not p.agreed(log_step=False)
    os.kill(os.getpid(), signal.SIGTERM)
    assert p.agreed(log_step=False)  # At once, not only at a log step.
  assert signal.getsignal(signal.SIGTERM) is before


def test_a_set_up_stop_that_python_dropped_is_raised_when_the_set_up_ends(capsys):
  """A signal handler's exception raised inside a gc callback or `__del__` is dropped by
  Python: the set-up must still stop, with the one line and no "Exception ignored" report."""
  hook = sys.unraisablehook
  with preemption.Preemption() as p:
    p.setting_up(True)

    class Finalized:
      def __del__(self):
        p._handle(signal.SIGTERM, None)  # pylint: disable=protected-access

    Finalized()  # Dropped at once: its __del__ runs where an exception cannot propagate.
    with pytest.raises(preemption.Interrupted, match="^SIGTERM received while the run was "
                       "being set up: nothing new to save; exiting.$"):
      p.setting_up(False)
  assert capsys.readouterr().err == ""
  assert sys.unraisablehook is hook
  # Nor may a handler of Exception (the restore's fallback from an unreadable checkpoint) take
  # the stop for its own error.
  with pytest.raises(preemption.Interrupted):
    try:
      raise preemption.Interrupted("SIGTERM")
    except Exception:  # pylint: disable=broad-except
      pass


def test_several_processes_ask_the_runtime_each_step_and_never_gather(monkeypatch):
  """With the runtime's sync manager: a host-side call per step with a rising counter, True
  where the runtime says so; no Python handler over the runtime's, no device all-gather."""
  calls = []

  def reached(n):
    calls.append(n)
    return n == 5  # The runtime's sync point.

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", reached)
  monkeypatch.setattr(multihost_utils, "process_allgather", _no_allgather)
  monkeypatch.setattr(preemption, "_calls", 2)  # Two steps of an earlier loop.
  before = signal.getsignal(signal.SIGTERM)
  with preemption.Preemption() as p:
    assert signal.getsignal(signal.SIGTERM) is before
    got = [p.agreed(log_step=s % 2 == 0) for s in range(1, 5)]
  assert got == [False, False, True, False]
  # The probe at entry repeats the last counter; then one call per step, continuing it.
  assert calls == [2, 3, 4, 5, 6]


def test_without_the_sync_manager_the_flag_is_gathered_at_log_steps_only(monkeypatch):
  def no_manager(n):
    raise RuntimeError("Preemption sync manager has not been initialized.")

  gathered = []

  def allgather(x):
    gathered.append(int(x))
    return x.reshape(1)

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", no_manager)
  monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
  with preemption.Preemption() as p:
    assert [p.agreed(log_step=False), p.agreed(log_step=True)] == [False, False]
    os.kill(os.getpid(), signal.SIGTERM)  # Caught by the Python handler.
    assert not p.agreed(log_step=False)  # Not gathered between log steps.
    assert p.agreed(log_step=True)
  assert gathered == [0, 1]


@pytest.mark.parametrize("count", [1, 2])
def test_sync_manager_running_needs_several_processes(monkeypatch, count):
  monkeypatch.setattr(jax, "process_count", lambda: count)
  monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", lambda n: False)
  assert preemption.sync_manager_running() == (count > 1)


def test_a_signal_after_a_runs_loop_stops_the_semi_supervised_runner_before_its_next_stage(
    capsys):
  """A run's context takes a SIGTERM after its loop (its final evaluation) and its run ends
  as if none came; the runner's context around it learns of it, and stops before the next
  stage instead of going on to train and infer for hours."""
  from bigpretrain.semisup import semi_supervised  # pylint: disable=import-outside-toplevel
  before = signal.getsignal(signal.SIGTERM)
  with preemption.Preemption(on_signal="finishing this stage, then stopping") as runner:
    semi_supervised._stop_if_signalled(runner, "teacher")  # Nothing came: goes on.
    with preemption.Preemption() as run:
      os.kill(os.getpid(), signal.SIGTERM)
      assert run.requested and not runner.requested
    assert runner.requested
    with pytest.raises(semi_supervised.Interrupted,
                       match=r"^Stopped before \[infer unlabeled\] \(SIGTERM or Ctrl-C\); "
                             r"re-run the same command to resume"):
      semi_supervised._stop_if_signalled(runner, "infer unlabeled")
    os.kill(os.getpid(), signal.SIGTERM)  # Between stages: the runner's own handler.
  assert signal.getsignal(signal.SIGTERM) is before
  assert "SIGTERM received: finishing this stage, then stopping." in capsys.readouterr().err
