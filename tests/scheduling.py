"""pytest-xdist's file scheduling, mended for a worker that crashes.

When a worker dies (a C++ abort, the kernel's OOM killer), xdist 3.8's `--dist loadfile` puts
every file the worker ever ran back on the queue, the finished ones included, and runs the
test it died on again. A finished file handed to a replacement worker is an empty unit that
never completes, and a replacement worker given a one-test file waits for a second test: at
the end of the run every worker idles and the session hangs (pytest-xdist issues 1323, 1327,
1378). Here a crash costs its one test, reported failed by xdist as before, and the rest of
the run goes on and ends.
"""
from xdist.scheduler import LoadFileScheduling


class CrashSafeLoadFileScheduling(LoadFileScheduling):
  """`--dist loadfile` that requeues only the unfinished tests of a crashed worker."""

  def remove_node(self, node):
    workload = self.assigned_work.pop(node)
    pending = {scope: unit for scope, unit in workload.items() if not all(unit.values())}
    if not pending:
      return None
    crashed = next(nodeid for unit in pending.values()
                   for nodeid, done in unit.items() if not done)
    pending[self._split_scope(crashed)][crashed] = True  # Reported failed; not run again.
    self.workqueue.update({s: unit for s, unit in pending.items() if not all(unit.values())})
    for other in self.assigned_work:
      self._reschedule(other)
    return crashed

  def _reschedule(self, node):
    super()._reschedule(node)
    # A worker starts a test once it has the next one (or the end): keep two in its hands.
    while (not node.shutting_down and self.workqueue
           and self._pending_of(self.assigned_work[node]) < 2):
      self._assign_work_unit(node)
    if not self.workqueue and not node.shutting_down:
      node.shutdown()
