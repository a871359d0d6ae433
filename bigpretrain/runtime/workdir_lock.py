"""One trainer per workdir: a second run on the same --workdir refuses at start.

The lock is a file, `DIR/.lock`, created with O_CREAT | O_EXCL (atomic on local file systems
and on NFSv3+, which Linux implements with an exclusive create on the server) and holding
the owner's host, pid, job id and start time as JSON. Only process 0 of a job takes it; it
tells the other processes whether it did, so that all of them start or all stop. The owner
touches the file every HEARTBEAT_S seconds from a daemon thread and removes it when the run
ends (normally, on an error or after SIGTERM).

A lock left by a run that is gone does not block: it is taken over at once when its owner
ran on this host, in this pid namespace since this boot (containers that share a host name,
e.g. with the host's network, each number their own processes) and its pid is dead (a
SIGKILL), or when it is empty or unreadable (a starter
killed mid-write, or a full disk), and after STALE_S without heartbeat when the owner ran on
another host (whose pids cannot be checked from here; a job restarted elsewhere after a hard
kill is refused until then, with this explained). The take-over is atomic: the stale file is
renamed to a name of this starter's own (only one rename of it succeeds), checked to be the
file judged stale, and removed; then the lock is created as at a fresh start.

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


class WorkdirUnwritable(RuntimeError):
  """The workdir (or its checkpoints folder) cannot be written: read-only, or full."""


def check_writable(workdir: str) -> None:
  """Raises WorkdirUnwritable unless a file can be created and written in `workdir` and in its
  checkpoints/ folder (when there): a read-only mount, missing permission or a full disk is
  told in one line before the run takes a lock, builds or saves anything. A URL (gs://...)
  is refused: the lock, log, config and metrics are files of a mounted filesystem (mount a
  bucket with gcsfuse, as launch/gke_jobset.py does, and pass its path)."""
  if "://" in workdir:
    raise WorkdirUnwritable(
        f"--workdir={workdir} is a URL; the run writes its lock, log, metrics and checkpoints "
        "through a mounted filesystem: mount the bucket (e.g. gcsfuse, or GKE's Cloud "
        "Storage FUSE driver: launch/gke_jobset.py mounts a gs:// workdir itself) and pass "
        "its path.")
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise WorkdirUnwritable(f"--workdir={workdir} is a file: give a folder (created if "
                            "absent) for the run's checkpoints, metrics and lock.")
  for folder in (workdir, os.path.join(workdir, "checkpoints")):
    if folder != workdir and not os.path.isdir(folder):
      continue
    probe = os.path.join(folder, f".write_test.{socket.gethostname()}.{os.getpid()}")
    try:
      os.makedirs(folder, exist_ok=True)
      with open(probe, "w") as f:
        f.write("x" * 4096)
        f.flush()
        os.fsync(f.fileno())
    except OSError as e:
      raise WorkdirUnwritable(
          f"cannot write to {folder} ({e.strerror or e}): the run keeps its checkpoints, "
          "metrics and lock there. Make it writable (or free space), or pass another "
          "--workdir.") from e
    finally:
      try:
        os.remove(probe)
      except OSError:
        pass


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


def _pid_space() -> str:
  """This boot's id and this process's pid namespace: where its pids mean the same ('' where
  /proc does not tell)."""
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      boot = f.read().strip()
    return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
  except OSError:
    return ""


def _stale_reason(owner: dict, age_s: float) -> str:
  """Why the lock `owner` holds can be taken over ('' if it cannot)."""
  here = owner.get("host") == socket.gethostname() and owner.get(
      "pid_space", _pid_space()) == _pid_space()  # Locks written without it: the host's.
  if here and not _pid_alive(int(owner.get("pid", -1))):
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
    try:
      with os.fdopen(fd, "w") as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "job": _job_id(),
                   "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "pid_space": _pid_space()}, f)
    except OSError as e:  # E.g. a full disk: an empty lock would block the next start.
      os.remove(self.path)
      raise WorkdirUnwritable(f"cannot write the workdir lock {self.path} ({e.strerror or e})."
                              " Free space or make the workdir writable.") from e
    return True

  def _read(self, path: str | None = None) -> tuple[dict | None, float, tuple]:
    """(the owner, or None when the file is empty or unreadable; its age in s; what tells this
    file from another: its inode, mtime and text, as an inode may be reused at once)."""
    with open(path or self.path) as f:
      text = f.read()
      st = os.fstat(f.fileno())
    try:
      owner = json.loads(text)
    except json.JSONDecodeError:
      owner = None
    return (owner if isinstance(owner, dict) and owner.get("host") else None,
            time.time() - st.st_mtime, (st.st_ino, st.st_mtime_ns, text))

  def _take_over(self, stale: tuple) -> None:
    """Removes the lock file judged stale (`stale`: _read's identity of it) if it is still
    there; leaves any other one."""
    aside = f"{self.path}.stale.{socket.gethostname()}.{os.getpid()}"
    try:
      os.rename(self.path, aside)
    except FileNotFoundError:  # Another starter took it over first.
      return
    if self._read(aside)[2] == stale:
      os.remove(aside)
      return
    # A starter that took it over first already holds a fresh lock: give it back.
    try:
      os.link(aside, self.path)
      os.remove(aside)
    except FileExistsError:
      os.remove(aside)
    except OSError:  # File systems without hard links (gcsfuse).
      os.rename(aside, self.path)

  def _acquire(self) -> str:
    """Takes the lock; returns '' or the refusal message."""
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    for _ in range(5):  # Another starter may take over a stale lock at the same time.
      if self._try_create():
        return ""
      try:
        owner, age_s, identity = self._read()
        if owner is None:  # A live starter writes it just after creating it: look again.
          time.sleep(0.2)
          owner, age_s, again = self._read()
          if again != identity:
            continue
      except FileNotFoundError:  # Released meanwhile.
        continue
      reason = _stale_reason(owner, age_s) if owner else "it is empty or unreadable"
      if not reason:
        return (f"workdir {os.path.dirname(self.path)} is in use by another run (host "
                f"{owner.get('host', '?')}, pid {owner.get('pid', '?')}"
                f"{', job ' + owner['job'] if owner.get('job') else ''}, started "
                f"{owner.get('started', '?')}; heartbeat {age_s:.0f} s ago). Use another "
                f"--workdir, or wait for that run to end. If it is gone, its lock {self.path} "
                f"is released after {STALE_S:.0f} s without heartbeat, or delete it.")
      owner = owner or {}
      console.warn(f"taking over the lock {self.path} left by host "
                   f"{owner.get('host', '?')} pid {owner.get('pid', '?')}: {reason}.")
      self._take_over(identity)
    return f"could not take the lock {self.path}: other runs keep taking it."

  def _heartbeat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      try:
        os.utime(self.path)
      except OSError:  # A full or flaky file system: the next beat tries again.
        pass

  def __enter__(self):
    message, error = "", None
    if jax.process_index() == 0:
      try:
        message = self._acquire()
      except Exception as e:  # pylint: disable=broad-except
        error = e  # Raised below, once the other processes know (else they would wait).
    if jax.process_count() > 1:  # All processes start, or all stop.
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
      held = multihost_utils.broadcast_one_to_all(np.int32(not message and error is None))
      if not message and error is None and not held:
        message = "process 0 could not take the workdir lock (see its log)."
    if error is not None:
      raise error
    if message:
      raise WorkdirLocked(message)
    if jax.process_index() == 0:
      self._held = True
      self._thread = threading.Thread(target=self._heartbeat, daemon=True,
                                      name="workdir-lock-heartbeat")
      self._thread.start()
    return self

  def __exit__(self, *exc):
    self.release()

  def release(self) -> None:
    """Removes the lock if this run holds it (again: nothing)."""
    self._stop.set()
    if self._held:
      self._held = False
      try:
        os.remove(self.path)
      except FileNotFoundError:
        pass
