"""The one channel for what a run tells its user: each line goes to stdout (flushed, so it
keeps its place among the progress bar and the other processes' lines) and to the absl log.

`say` for what happened ("Resuming from step 20"), `warn` for what the user should know is not
as asked ("WARNING: ..."). Errors that stop a command are the tools' (tools/cli.py).
"""
import logging as logging_std
import sys

from absl import logging


def say(text: str) -> None:
  logging.info("%s", text)
  print(text, flush=True)


def warn(text: str) -> None:
  logging.warning("%s", text)
  print(f"WARNING: {text}", flush=True)


def report_log_errors_once(handler: logging_std.Handler) -> None:
  """A log file that cannot be written (a full disk) is said once on stderr, not with a
  traceback for every later log line (Python logging's Handler.handleError); the run goes on,
  and what stops it (e.g. the failed checkpoint save) says so itself."""
  said = []

  def handle_error(record):
    del record
    if not said:
      said.append(True)
      error = sys.exc_info()[1]
      print(f"WARNING: the log cannot be written ({type(error).__name__}: {error}); its later "
            "lines are lost.", file=sys.stderr, flush=True)

  handler.handleError = handle_error
