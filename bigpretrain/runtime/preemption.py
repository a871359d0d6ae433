"""SIGTERM: every process saves the same step, then exits 0.

One process: a Python SIGTERM handler sets a flag that the train loop reads after each step.

Several processes: `jax.distributed.initialize` starts the runtime's preemption sync manager
(config jax_enable_preemption_service, on by default), whose own SIGTERM handler tells the
coordination service. Every process learns of the notice, and
`multihost_utils.reached_preemption_sync_point(n)` (what Orbax's `reached_preemption` calls)
turns True on all of them at the same call: one past the furthest any process had made when the
notice arrived. It is a host-side check that never waits for the device, so the host keeps
dispatching steps ahead of it (an all-gather of a flag would wait for the step just
dispatched). No Python handler is installed then: it would replace the runtime's. The call
counter is per process, not the train step, so that a notice that arrives before a loop (while
compiling, or between the stages of bigpretrain.semisup.semi_supervised) stops at that loop's first
step. A SIGTERM after the last loop is not acted on: the run finishes (the semi-supervised
runner, whose context encloses its stages' runs, then stops before its next stage).

Without the sync manager (the service turned off), the flag is all-gathered at log steps only,
where the loop waits for the device anyway.

The handler is installed before the run takes its workdir lock, and covers the whole run. While
the run is being set up (model, data, restore: `setting_up`), one process has nothing to
save yet: the signal stops the set-up at once (raises Interrupted; the lock is released on the
way out) and the command exits 0; one that comes while the lock is taken stops it where it
starts. Python drops an exception raised where it cannot propagate (a garbage-collection
callback, a `__del__`); such an Interrupted is raised again when the set-up ends, and its
"Exception ignored" report is not printed. Code the Interrupted lands in may fail on its way
out with an error of its own (or swallow it and fail later): once a signal came in the set-up,
the run's context reports any error as that stop. The Interrupted may land in XLA's wait for
a compile that goes on in XLA's threads: the commands end with `exit_interrupted`, never
through Python's finalization. Ctrl-C (SIGINT) is a SIGTERM the first time (several
processes: forwarded to the runtime's handler as one), and a second Ctrl-C stops the process
at once, releasing the lock (`on_abort`) and abandoning the save in flight.
"""
import os
import signal
import sys

from absl import logging
import jax
import numpy as np

_calls = 0  # reached_preemption_sync_point's counter: the same sequence on every process.


def sync_manager_running() -> bool:
  """Whether jax.distributed runs the preemption sync manager (several processes only)."""
  if jax.process_count() == 1:
    return False
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  try:  # Repeating the last call's counter changes nothing.
    multihost_utils.reached_preemption_sync_point(_calls)
  except RuntimeError:  # jax_enable_preemption_service is off.
    return False
  return True


def allgather_any(flag: bool) -> bool:
  """True on every process if `flag` is on any: a device all-gather, so it waits for the
  work already dispatched to this process's devices."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return bool(np.max(multihost_utils.process_allgather(np.array(flag, np.int32))))


class Interrupted(BaseException):
  """A SIGTERM or Ctrl-C while the run was being set up: nothing new to save; exit 0.

  Not an Exception (as KeyboardInterrupt is not): a handler of Exception, such as the restore's
  fallback from an unreadable checkpoint, must not take it for that checkpoint's fault."""


def exit_interrupted() -> None:
  """Ends the process (status 0) after an Interrupted set-up, its line printed: without
  Python's finalization, which tears XLA's runtime down under a compile the signal may have
  interrupted (still running on XLA's threads: a segfault at exit). The log is flushed first;
  the lock is released already (the run's context)."""
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)  # pylint: disable=protected-access


def _say(text: str) -> None:
  """One line on stderr, from a signal handler (on a line of its own: a progress bar may be
  mid-line), and in the log."""
  logging.warning("%s", text)
  sys.stdout.flush()
  print(f"\n{text}", file=sys.stderr, flush=True)


class Preemption:
  """Context of a run; `agreed(log_step)` after each step of its loop: True on every process at
  the same step once any got SIGTERM or Ctrl-C (then the loop saves and exits)."""

  def __init__(self, in_set_up: bool = False,
               on_signal: str = "saving a checkpoint and exiting"):
    """`in_set_up`: the context opens in the run's set-up (train_and_evaluate's, whose lock is
    taken before setting_up(True)): a signal before setting_up(True) stops the set-up there.
    `on_signal`: what the signal's line says happens next."""
    self.requested = False
    self._on_signal = on_signal
    self._in_set_up = in_set_up  # Before the loop: a signal stops the set-up (one process).
    self.on_abort = None  # Called before a second Ctrl-C ends the process (the lock's release).
    self._previous = {}
    self._runtime = False
    self._interruptible = False
    self._interrupts = 0
    self._set_up_stop = None  # The message of an Interrupted raised during the set-up.
    self._unraisablehook = None

  def __enter__(self):
    self._runtime = sync_manager_running()
    signals = (signal.SIGINT,) if self._runtime else (signal.SIGTERM, signal.SIGINT)
    for s in signals:
      self._previous[s] = signal.signal(s, self._handle)
    self._unraisablehook = sys.unraisablehook
    sys.unraisablehook = self._unraisable
    return self

  def _unraisable(self, unraisable):
    """Python's report of an exception it dropped: not for an Interrupted, raised again by
    setting_up(False)."""
    if not isinstance(unraisable.exc_value, Interrupted):
      self._unraisablehook(unraisable)

  def _handle(self, signum, frame):  # pylint: disable=unused-argument
    if signum == signal.SIGINT:
      self._interrupts += 1
      if self._interrupts > 1:
        _say("Second Ctrl-C: stopping now, without saving.")
        if self.on_abort is not None:
          self.on_abort()
        os._exit(130)  # pylint: disable=protected-access
      if self._runtime:  # The runtime's handler tells the other processes.
        _say("Ctrl-C: all processes save a checkpoint and exit (Ctrl-C again stops at once).")
        os.kill(os.getpid(), signal.SIGTERM)
        return
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    self.requested = True
    if self._in_set_up and jax.process_count() == 1:  # (Interruptible only in the set-up.)
      self._set_up_stop = (f"{name} received while the run was being set up: nothing new to "
                           "save; exiting.")
      if self._interruptible:
        self._interruptible = False
        raise Interrupted(self._set_up_stop)
      return  # Not yet interruptible (the lock being taken): setting_up(True) raises it.
    _say(f"{name} received: {self._on_signal}"
         f"{' (Ctrl-C again stops at once)' if signum == signal.SIGINT else ''}.")

  def setting_up(self, on: bool) -> None:
    """While on (the run's set-up, one process), a signal raises Interrupted at once; one
    that came before raises it now, and so does turning it off after one whose Interrupted
    Python dropped."""
    self._interruptible = on
    self._in_set_up = on
    if self._set_up_stop is not None:
      self._interruptible = False
      raise Interrupted(self._set_up_stop)
    if on and self.requested and jax.process_count() == 1:
      self._interruptible = False
      raise Interrupted("SIGTERM or Ctrl-C received while the run was being set up: nothing "
                        "new to save; exiting.")

  def __exit__(self, exc_type, exc, tb):
    self._interruptible = False
    for s, previous in self._previous.items():
      signal.signal(s, previous)
      # A signal this context took after its loop (a run's final evaluation) is the enclosing
      # context's too (the semi-supervised runner's, which stops before its next stage).
      outer = getattr(previous, "__self__", None)
      if self.requested and isinstance(outer, Preemption):
        outer.requested = True
    self._previous = {}
    if self._unraisablehook is not None:
      sys.unraisablehook = self._unraisablehook
      self._unraisablehook = None
    if isinstance(exc, Exception) and self._set_up_stop is not None:
      # The code the stop landed in failed on its way out: the stop it is, logged.
      logging.warning("The set-up's stop surfaced as %s: %s", type(exc).__name__, exc,
                      exc_info=(exc_type, exc, tb))
      raise Interrupted(self._set_up_stop) from exc

  def agreed(self, log_step: bool) -> bool:
    """Whether to save and stop after the step just dispatched; call once per step on every
    process (`log_step`: the loop waits for the device at this step anyway)."""
    global _calls
    if self._runtime:
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
      _calls += 1
      if multihost_utils.reached_preemption_sync_point(_calls):
        logging.warning("A process got SIGTERM: all save this step and exit.")
        return True
      return False
    if jax.process_count() == 1:
      return self.requested
    return log_step and allgather_any(self.requested)
