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
step. A SIGTERM after the last loop is not acted on: the run finishes.

Without the sync manager (the service turned off), the flag is all-gathered at log steps only,
where the loop waits for the device anyway.
"""
import signal

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


class Preemption:
  """Context of a train loop; `agreed(log_step)` after each step: True on every process at the
  same step once any got SIGTERM (then the loop saves and exits)."""

  def __init__(self):
    self.requested = False
    self._previous = None
    self._runtime = False

  def __enter__(self):
    self._runtime = sync_manager_running()
    if not self._runtime:
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):  # pylint: disable=unused-argument
    logging.warning("SIGTERM received: saving a checkpoint and exiting.")
    self.requested = True

  def __exit__(self, *exc):
    if not self._runtime:
      signal.signal(signal.SIGTERM, self._previous)

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
