"""What the commands share: an expected error is one `ERROR:` line and exit status 1."""
import contextlib
import sys

from absl import app
from absl import flags
from absl import logging

# Bad flags, configs, inputs or data: the user's to fix, so no traceback through jit.
USER_ERRORS = (FileNotFoundError, ValueError)


def run_errors() -> tuple[type, ...]:
  """What a training run stops with, in one line (bigpretrain.main's, and commands that
  train: a locked or unwritable workdir, a failed save or checkpoint read, a dead worker)."""
  # pylint: disable=import-outside-toplevel
  from bigpretrain import checkpoint
  from bigpretrain import train
  from bigpretrain.runtime import metric_writers
  from bigpretrain.runtime import workdir_lock
  return (TypeError, FloatingPointError, workdir_lock.WorkdirLocked,
          workdir_lock.WorkdirUnwritable, checkpoint.CheckpointSaveError,
          checkpoint.CheckpointReadError, metric_writers.MetricWriteError,
          train.DataWorkerDied)


@contextlib.contextmanager
def user_errors(*more: type, log_traceback: bool = False):
  """Turns USER_ERRORS (and `more`) raised inside into `ERROR: <message>` on stderr and exit 1;
  with `log_traceback` the traceback also goes to the absl log."""
  try:
    yield
  except USER_ERRORS + more as e:
    if log_traceback:
      logging.exception("Run failed")
    print(f"ERROR: {e}", file=sys.stderr, flush=True)
    sys.exit(1)


def check_usage(argv, *required: str) -> None:
  """app.UsageError for positional arguments or a `required` flag left unset."""
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments {argv[1:]}.")
  for name in required:
    if flags.FLAGS[name].value in (None, ""):
      raise app.UsageError(f"--{name} is required.")
