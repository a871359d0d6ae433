"""What the commands share: an expected error is one `ERROR:` line and exit status 1."""
import contextlib
import errno
import logging as std_logging
import os
import pathlib
import re
import shutil
import sys
import tempfile
import traceback

from absl import flags
from absl import logging

from bigpretrain.runtime import units

# Bad flags, configs, inputs or data: the user's to fix, so no traceback through jit.
USER_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError,
               ValueError)


def run_errors() -> tuple[type, ...]:
  """What a training run stops with, in one line (bigpretrain.main's, and commands that
  train: a locked or unwritable workdir, a failed save or checkpoint read, a dead worker,
  device memory run out)."""
  # pylint: disable=import-outside-toplevel
  from bigpretrain import checkpoint
  from bigpretrain import train
  from bigpretrain.runtime import metric_writers
  from bigpretrain.runtime import workdir_lock
  return (TypeError, FloatingPointError, workdir_lock.WorkdirLocked,
          workdir_lock.WorkdirUnwritable, checkpoint.CheckpointSaveError,
          checkpoint.CheckpointReadError, metric_writers.MetricWriteError,
          train.DataWorkerDied, train.DeviceOutOfMemory)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing for commands with a --config file flag, each bad --config in one line
  and exit status 2: a bad --config.KEY override (ml_collections raises AttributeError/
  KeyError/TypeError through three chained tracebacks; the line names the key and suggests the
  closest one), a get_config that raises (its error, not the traceback ml_collections puts in
  the flag error), a file that does not load (ml_collections defers that error to the
  config's first use, deep inside the run, or raises it at the first override), a file whose
  code fails to import (its line) and one without get_config."""
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    parsing = re.match(r"flag (--\S+): Error whilst parsing config file:", str(e))
    if parsing:  # The last line of the traceback in the message: get_config's error.
      usage_error(f"{parsing.group(1)}: {str(e).strip().splitlines()[-1]}")
    usage_error(f"{e}\nPass --help for the flags.")
  except OSError as e:  # An override applied to a file that did not load.
    _config_not_loaded(e, argv)
  except Exception as e:  # pylint: disable=broad-except
    where = _in_config_file(e, argv)
    if where:  # The file's own code failed to load (a syntax error, a missing import).
      usage_error(f"{where}: {type(e).__name__}: {e}")
    if isinstance(e, AttributeError) and "has no attribute 'get_config'" in str(e):
      usage_error(f"{_config_arg(argv)}: the file defines no get_config() returning the "
                   "config.")
    if not isinstance(e, (AttributeError, KeyError, TypeError, ValueError)):
      raise
    text = str(e).replace("\\'", "'").replace("\\n", " ")
    hint = re.search(r'Did you mean "[^"]+" instead of "([^"]+)"\?', text)
    name = re.search(r"'([\w-]+)'", text)
    bad = hint.group(1) if hint else name.group(1) if name else ""
    given = next((a.split("=")[0] for a in argv if a.startswith("--config.") and
                  bad in a.split("=")[0].split(".")), "") if bad else ""
    if bad and isinstance(e, (AttributeError, KeyError)):
      usage_error(f"unknown config key {given or bad}. {hint.group(0) if hint else ''}".strip())
    usage_error(f"bad config override: {type(e).__name__}: {text}")
  if "config" in flags.FLAGS and flags.FLAGS["config"].value is not None:
    try:
      flags.FLAGS["config"].value.keys()
    except OSError as e:
      _config_not_loaded(e, argv)
  return rest


def _config_not_loaded(e: OSError, argv: list[str]) -> None:
  """A --config file that did not load: the cause's last line says why."""
  cause = str(e.__cause__ or e).strip().splitlines()[-1].strip()
  usage_error(f"{_config_arg(argv)}: {cause}")


def _config_arg(argv: list[str]) -> str:
  """The --config=FILE[:ARGS] argument as given ('--config' if not in that form)."""
  return next((a for a in argv if a.startswith("--config=")), "--config")


def _in_config_file(e: BaseException, argv: list[str]) -> str:
  """'FILE:LINE' where the --config file's own code raised `e` while loading ('' if not)."""
  name = _config_arg(argv).partition("=")[2].split(":", 1)[0]
  if not name:
    return ""
  path = os.path.abspath(name)
  if isinstance(e, SyntaxError) and e.filename and os.path.abspath(e.filename) == path:
    return f"{name}:{e.lineno}"
  lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
           if os.path.abspath(f.filename) == path]
  return f"{name}:{lines[-1]}" if lines else ""


def quiet_logs() -> None:
  """Orbax and JAX log every restore step and platform probe at INFO, which buries a
  command's own output and error line: WARNING and above only, unless --verbosity is given.
  (A command's own lines go through print or runtime.console, not the log level.)"""
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  std_logging.getLogger("jax._src.xla_bridge").setLevel(std_logging.WARNING)


def usage_error(message: str) -> None:
  """A command used wrongly (a flag missing or out of range, stray arguments): `ERROR:
  message` and exit status 2, without absl's page of help that app.UsageError prints."""
  print(f"ERROR: {message}", file=sys.stderr, flush=True)
  sys.exit(2)


@contextlib.contextmanager
def user_errors(*more: type, log_traceback: bool = False):
  """Turns USER_ERRORS (and `more`, and a checkpoint read that failed for a storage reason)
  raised inside into `ERROR: <message>` on stderr and exit 1;
  with `log_traceback` the traceback also goes to the absl log."""
  try:
    yield
  except USER_ERRORS + more + _read_errors() as e:
    _fail(str(e), log_traceback)
  except KeyboardInterrupt:  # Ctrl-C: said in one line, not a traceback of where it landed.
    print("\nInterrupted (Ctrl-C).", file=sys.stderr, flush=True)
    sys.exit(130)
  except (OSError, RuntimeError) as e:
    # A full file system (a prepare job's output: Beam raises a RuntimeError from it; a
    # shard, /dev/shm), or a data worker's death in an inference command.
    from input_pipeline import pipeline  # pylint: disable=import-outside-toplevel
    full, death = no_space(e), pipeline.worker_death(e)
    if full:
      _fail(full, log_traceback)
    if death is None:
      raise
    _fail(f"{death}. Use fewer data workers (--num_workers, or a section's num_workers in the "
          "semi-supervised runner's config) or give the job more memory, then re-run it.",
          log_traceback)


def no_space(error: BaseException, *paths: str) -> str | None:
  """For an OSError of a full file system or quota (ENOSPC, EDQUOT), or an error raised from
  one: that OSError and the free space of each file system in play (the file it names,
  `paths`, /dev/shm where the data workers' batches and Python's semaphores live, the
  temporary folder); else None."""
  e, seen = error, set()
  while e is not None and id(e) not in seen and not (
      isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)):
    seen.add(id(e))
    e = e.__cause__ or e.__context__
  if e is None or id(e) in seen:
    return None
  places = [os.path.dirname(os.path.abspath(f)) for f in (e.filename, e.filename2)
            if isinstance(f, (str, os.PathLike))] + [str(p) for p in paths]
  places += [p for p in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(p)]
  free, devices = [], set()
  for place in places:
    path = pathlib.Path(place).absolute()
    while not path.exists() and path != path.parent:  # A folder not made yet: its parent's.
      path = path.parent
    try:
      device = path.stat().st_dev
      if device not in devices:
        devices.add(device)
        free.append(f"{place} {units.size(shutil.disk_usage(path).free)}")
    except OSError:
      continue  # Gone or unreadable: nothing to say about it.
  return (f"{e}: a file system is full (free: {', '.join(free)}). Free some space, or write "
          "elsewhere, and run the command again.")


def _fail(message: str, log_traceback: bool) -> None:
  """`ERROR: message` on stderr and exit 1, inside the except block that caught the error
  (whose traceback goes to the absl log with `log_traceback`)."""
  if log_traceback:
    logging.exception("Run failed")
  print(f"ERROR: {message}", file=sys.stderr, flush=True)
  sys.exit(1)


def _read_errors() -> tuple[type, ...]:
  """A checkpoint read failed for a reason outside it (evaluated only when an error is met)."""
  from bigpretrain import checkpoint  # pylint: disable=import-outside-toplevel
  return (checkpoint.CheckpointReadError,)


def check_usage(argv, *required: str) -> None:
  """usage_error for positional arguments or a `required` flag left unset."""
  if len(argv) > 1:
    usage_error(f"Unexpected arguments {argv[1:]}. Pass --help for the flags.")
  for name in required:
    if flags.FLAGS[name].value in (None, ""):
      usage_error(f"--{name} is required. Pass --help for the flags.")
