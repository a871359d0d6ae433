"""Public modules that moved to their recipe's package keep their earlier import paths.

`import bigpretrain.zero_shot` (or `bigpretrain.hashtags.vocabulary`, ...) gives the module at
its new place, the same module object, so code written against the earlier layout and the
public names in DESIGN.md keep working; nothing is imported twice. New code uses the new paths.
"""
import importlib
import importlib.abc
import importlib.util
import sys

# Earlier dotted name (a module or a package prefix) -> where it lives now.
MOVED = {
    "bigpretrain.hashtags": "bigpretrain.swag",
    "bigpretrain.zero_shot": "bigpretrain.swag.zero_shot",
    "bigpretrain.head_init": "bigpretrain.swag.head_init",
    "bigpretrain.selection": "bigpretrain.semisup",
    "bigpretrain.convert": "bigpretrain.models.convert",
    "bigpretrain.flops": "bigpretrain.plan.flops",
    "bigpretrain.aot_plan": "bigpretrain.plan.aot_plan",
    "bigpretrain.accelerators": "bigpretrain.plan.accelerators",
}


def new_name(name: str) -> str | None:
  """The current dotted name of a module imported under `name`, or None if it did not move."""
  for old, new in MOVED.items():
    if name == old or name.startswith(old + "."):
      return new + name[len(old):]
  return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Serves an earlier name with the module at its new place."""

  def find_spec(self, fullname, path, target=None):
    del path, target
    return importlib.util.spec_from_loader(fullname, self) if new_name(fullname) else None

  def create_module(self, spec):
    return importlib.import_module(new_name(spec.name))

  def exec_module(self, module):
    del module  # Already executed under its new name.


def install() -> None:
  if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())
