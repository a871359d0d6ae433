"""One registry type for everything a config names: objectives, evaluators, models, data
sources, train ops, optimizers, schedules and model-init hooks.

A thing registers itself where it is defined (`@REGISTRY.register("name")`); a config names
it; a miss says which names exist and which one was probably meant. Registering the same
object twice is a no-op (a module may be imported twice, e.g. as a plugin and by a test);
another object under a taken name is an error naming both registering modules, also when the
name is a lazily imported built-in's (see register_lazy) and whichever registers first. A
registry made with `prefixes=True` also serves names by prefix: a key ending in ':' or '/'
(e.g. 'tfds:') serves every longer name that starts with it, the longest such key winning,
and an exact key winning over all. A registry made with `builtins=MODULE` imports that module
(its built-in entries, which register themselves) on its first lookup, so the module holding
the registry need not import them.

Pure Python: the input pipeline uses it too (see DESIGN: it is one of the few libraries the
lower layer may import).
"""
import difflib
import importlib
import sys
import traceback
from typing import Any


class Registry:
  """Names -> objects of one kind; `config_key` names the config field in error messages."""

  def __init__(self, kind: str, config_key: str, *, prefixes: bool = False, builtins: str = ""):
    self.kind, self.config_key, self.prefixes = kind, config_key, prefixes
    self._builtins = builtins
    # The module holding the registry: its own entries register before the built-ins load.
    self._home = sys._getframe(1).f_globals.get("__name__", "?")  # pylint: disable=protected-access
    self._items: dict[str, Any] = {}
    self._usage: dict[str, str] = {}
    self._lazy: dict[str, str] = {}
    self._owners: dict[str, str] = {}  # The module that registered each name in _items.

  def register(self, name: str, obj: Any = None, *, usage: str = "") -> Any:
    """Registers `obj` under `name`; without `obj`, a decorator. `usage` is how the name is
    written in messages (e.g. 'tfds:NAME[/CONFIG]' for the prefix 'tfds:')."""

    owner = sys._getframe(1).f_globals.get("__name__", "?")  # pylint: disable=protected-access

    def add(o):
      if owner != self._home and not owner.startswith(self._builtins or "\0"):
        self._load_builtins()  # A plugin's name is checked against the built-ins' now.
      if name in self._items and self._items[name] is not o:
        raise ValueError(self._clash(name, self._owners[name], owner))
      if self._lazy.get(name, owner) != owner:
        raise ValueError(self._clash(name, f"{self._lazy[name]} (imported on first use)",
                                     owner))
      self._items[name] = o
      self._owners[name] = owner
      self._usage[name] = usage or name
      return o

    return add if obj is None else add(obj)

  def register_lazy(self, name: str, module: str, usage: str = "") -> None:
    """`name` is served by `module`, imported on first use (it must register `name`): keeps
    optional dependencies (e.g. Apache Beam) out of every import."""
    if self._owners.get(name, module) != module:
      raise ValueError(self._clash(name, self._owners[name], module))
    self._lazy[name] = module
    self._usage.setdefault(name, usage or name)

  def _load_builtins(self) -> None:
    if self._builtins:
      module, self._builtins = self._builtins, ""
      importlib.import_module(module)

  def _clash(self, name: str, first: str, second: str) -> str:
    return (f"{self.kind} {name!r} is already registered by module {first}; module {second} "
            f"registers another {self.kind} under the same name. Rename one of them.")

  def _key(self, name: str) -> str | None:
    self._load_builtins()
    if name in self._items or name in self._lazy:
      if not (self.prefixes and name.endswith((":", "/"))):
        return name
    if not self.prefixes:
      return None
    matches = [k for k in (*self._items, *self._lazy) if k.endswith((":", "/"))
               and name.startswith(k) and len(name) > len(k)]
    return max(matches, key=len) if matches else None

  def get(self, name: str) -> Any:
    """The object registered for `name`; ValueError naming the known ones on a miss."""
    key = self._key(str(name))
    if key is None:
      raise ValueError(self.unknown_message(name))
    if key not in self._items:
      importlib.import_module(self._lazy[key])
      if key not in self._items:
        raise ValueError(f"Module {self._lazy[key]} did not register {self.kind} {key!r}.")
    return self._items[key]

  def __contains__(self, name: str) -> bool:
    return self._key(str(name)) is not None

  def names(self) -> list[str]:
    """The registered names as written in messages, sorted."""
    self._load_builtins()
    return sorted(self._usage[k] for k in {*self._items, *self._lazy})

  def keys(self) -> list[str]:
    self._load_builtins()
    return sorted({*self._items, *self._lazy})

  def loaded(self) -> dict[str, Any]:
    """The names as written in messages -> objects, of the entries already imported (the
    built-ins and plugins; a lazily imported one only once used)."""
    self._load_builtins()
    return {self._usage[k]: self._items[k] for k in sorted(self._items)}

  def unknown_message(self, name, key: str | None = None) -> str:
    """That `name` is unknown, with its close match; `key`: the setting that gave it (default:
    the registry's config key)."""
    close = difflib.get_close_matches(str(name), self.keys(), n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (f"{key or self.config_key}={name!r} is not a known {self.kind}.{hint} Known: "
            f"{', '.join(self.names())}.")


def import_plugins(modules, where: str = "config.plugins") -> None:
  """Imports each module named in `modules` (dotted names, importable from sys.path): a
  plugin registers its objectives, sources, models, ... when imported."""
  for name in modules or ():
    if not isinstance(name, str) or not name:
      raise ValueError(f"{where} must list module names (strings), got {name!r}.")
    try:
      importlib.import_module(name)
    except ModuleNotFoundError as e:
      if e.name is not None and not name.startswith(e.name):  # Its own import failed.
        raise ValueError(f"{where}: plugin module {name!r} failed to import: {e}.") from e
      raise ValueError(f"{where}: cannot import plugin module {name!r} ({e}). Put its folder "
                       "on PYTHONPATH or install it.") from e
    except Exception as e:  # pylint: disable=broad-except
      frame = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != __file__][-1]
      raise ValueError(f"{where}: plugin module {name!r} failed to import, at "
                       f"{frame.filename}:{frame.lineno}: {type(e).__name__}: {e}") from e

