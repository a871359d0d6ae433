"""What the commands share: an expected error is one `ERROR:` line and exit status 1."""
import contextlib
import sys

from absl import app
from absl import flags
from absl import logging

# Bad flags, configs, inputs or data: the user's to fix, so no traceback through jit.
USER_ERRORS = (FileNotFoundError, ValueError)


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
