"""The one channel for what a run tells its user: each line goes to stdout (flushed, so it
keeps its place among the progress bar and the other processes' lines) and to the absl log.

`say` for what happened ("Resuming from step 20"), `warn` for what the user should know is not
as asked ("WARNING: ..."). Errors that stop a command are the tools' (tools/cli.py).
"""
from absl import logging


def say(text: str) -> None:
  logging.info("%s", text)
  print(text, flush=True)


def warn(text: str) -> None:
  logging.warning("%s", text)
  print(f"WARNING: {text}", flush=True)
