"""Work that process 0 does alone (an index, a report, a selection), its failure known to all.

In a multi-host job the other processes wait for such work at the next collective; had process
0 raised, they would wait there until the job's timeout. `run` tells every process the
outcome: process 0 raises its own error, the others `FailedOnProcess0`, naming the work.
"""
import jax
import numpy as np


class FailedOnProcess0(RuntimeError):
  """Process 0's part of a multi-host job raised (its log has the error)."""


def run(what: str, fn, *args, **kwargs):
  """fn(*args, **kwargs) on process 0, its result there (None on the others); a collective:
  every process calls it. `what` names the work in the other processes' error."""
  result, error = None, None
  if jax.process_index() == 0:
    try:
      result = fn(*args, **kwargs)
    except Exception as e:  # pylint: disable=broad-except
      error = e  # Raised below, once the other processes know.
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    ok = bool(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
    if not ok and jax.process_index() != 0:
      raise FailedOnProcess0(f"{what} failed on process 0 (its log says why).")
  if error is not None:
    raise error
  return result
