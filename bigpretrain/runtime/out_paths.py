"""An output folder or file of a command, checked before the work that fills it.

A folder that cannot be created, or a file name that is a folder, is otherwise met when the
results are written: after the inference or the index they hold.
"""
import uuid

from etils import epath


def _probe(folder: epath.Path) -> None:
  """Writes and removes an empty file in `folder` (raises OSError if it cannot)."""
  probe = folder / f".write-check-{uuid.uuid4().hex}"
  probe.write_text("")
  probe.unlink()


def folder(path: str, flag: str = "--out") -> epath.Path:
  """Creates the folder `path` (and its parents) and checks that it takes files; a ValueError
  names `flag` where it does not."""
  root = epath.Path(path)
  try:
    root.mkdir(parents=True, exist_ok=True)
    _probe(root)
  except OSError as e:
    raise ValueError(f"{flag}={path} cannot be written as a folder: {e}") from e
  return root


def file(path: str, flag: str = "--out") -> epath.Path:
  """Checks that the file `path` can be written: not a folder, its folder exists and takes
  files; a ValueError names `flag` where it cannot."""
  target = epath.Path(path)
  if target.is_dir():
    raise ValueError(f"{flag}={path} is a folder; give a file name.")
  if not target.parent.is_dir():
    raise ValueError(f"{flag}={path}: the folder {target.parent} does not exist.")
  try:
    _probe(target.parent)
  except OSError as e:
    raise ValueError(f"{flag}={path} cannot be written: {e}") from e
  return target
