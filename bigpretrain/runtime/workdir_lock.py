"""One trainer per workdir: a second run on the same --workdir refuses at start.

The lock is a file, `DIR/.lock`, created with O_CREAT | O_EXCL (atomic on local file systems
and on NFSv3+, which Linux implements with an exclusive create on the server) and holding
the owner's host, pid, job id and start time as JSON. Only process 0 of a job takes it; it
tells the other processes whether it did, so that all of them start or all stop. The owner
touches the file every HEARTBEAT_S seconds from a daemon thread and removes it when the run
ends (normally, on an error or after SIGTERM).

A lock left by a run that is gone does not block: it is taken over at once when its owner
ran on this host and its pid is dead (a SIGKILL), and after STALE_S without heartbeat when
the owner ran on another host (whose pids cannot be checked from here; a job restarted
elsewhere after a hard kill is refused until then, with this explained).

Why not fcntl/flock: advisory locks are per host on many network file systems (NFS clients
without lockd, Lustre without flock), and FUSE mounts of object stores (gcsfuse) do not
implement them at all, so they would silently let two runs in; a file's existence and mtime
are visible on every shared file system pods use.
"""
import json
import os
import socket
import threading
import time

import jax
import numpy as np

from bigpretrain.runtime import console

LOCK_NAME = ".lock"
HEARTBEAT_S = 30.0
STALE_S = 300.0
_JOB_ID_VARS = ("SLURM_JOB_ID",)  # Shown in the refusal, to find the other run.


class WorkdirLocked(RuntimeError):
  """Another live run holds the workdir."""


def _job_id() -> str:
  return next((f"{v}={os.environ[v]}" for v in _JOB_ID_VARS if os.environ.get(v)), "")


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # Someone else's live process.
    return True
  return True


def _stale_reason(owner: dict, age_s: float) -> str:
  """Why the lock `owner` holds can be taken over ('' if it cannot)."""
  if owner.get("host") == socket.gethostname() and not _pid_alive(int(owner.get("pid", -1))):
    return f"its process {owner.get('pid')} on this host is gone"
  if age_s > STALE_S:
    return f"its heartbeat is {age_s:.0f} s old"
  return ""


class WorkdirLock:
  """Context manager holding `workdir`'s lock for the run (see the module docstring)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_NAME)
    self._stop = threading.Event()
    self._thread = None
    self._held = False

  def _try_create(self) -> bool:
    try:
      fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, "w") as f:
      json.dump({"host": socket.gethostname(), "pid": os.getpid(), "job": _job_id(),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
    return True

  def _acquire(self) -> str:
    """Takes the lock; returns '' or the refusal message."""
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    for _ in range(3):  # Another starter may take over a stale lock at the same time.
      if self._try_create():
        return ""
      try:
        with open(self.path) as f:
          text = f.read()
        age_s = time.time() - os.stat(self.path).st_mtime
      except FileNotFoundError:  # Released meanwhile.
        continue
      try:
        owner = json.loads(text)
      except json.JSONDecodeError:  # Written by a starter killed mid-write.
        owner = {}
      reason = _stale_reason(owner, age_s) if owner else (
          "it is unreadable" if age_s > HEARTBEAT_S else "")
      if not reason:
        return (f"workdir {os.path.dirname(self.path)} is in use by another run (host "
                f"{owner.get('host', '?')}, pid {owner.get('pid', '?')}"
                f"{', job ' + owner['job'] if owner.get('job') else ''}, started "
                f"{owner.get('started', '?')}; heartbeat {age_s:.0f} s ago). Use another "
                f"--workdir, or wait for that run to end. If it is gone, its lock {self.path} "
                f"is released after {STALE_S:.0f} s without heartbeat, or delete it.")
      console.warn(f"taking over the lock {self.path} left by host "
                   f"{owner.get('host', '?')} pid {owner.get('pid', '?')}: {reason}.")
      try:
        os.remove(self.path)
      except FileNotFoundError:
        pass
    return f"could not take the lock {self.path}: other runs keep taking it."

  def _heartbeat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      try:
        os.utime(self.path)
      except OSError:  # A full or flaky file system: the next beat tries again.
        pass

  def __enter__(self):
    message = self._acquire() if jax.process_index() == 0 else ""
    if jax.process_count() > 1:  # All processes start, or all stop.
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
      held = multihost_utils.broadcast_one_to_all(np.int32(not message))
      if not message and not held:
        message = "process 0 could not take the workdir lock (see its log)."
    if message:
      raise WorkdirLocked(message)
    if jax.process_index() == 0:
      self._held = True
      self._thread = threading.Thread(target=self._heartbeat, daemon=True,
                                      name="workdir-lock-heartbeat")
      self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    if self._held:
      self._held = False
      try:
        os.remove(self.path)
      except FileNotFoundError:
        pass
