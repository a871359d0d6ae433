"""Every command in README.md and docs/ runs as written: its module or script exists, each
flag it passes is one the command defines, each --config file loads with its argument, and
each --config.KEY override names a key of that config. Flags are read from the commands'
sources (absl DEFINE_* calls, argparse add_argument), so no command is started."""
import ast
import functools
import importlib.util
import pathlib
import re
import shlex

import pytest

from tests import helpers

ROOT = helpers.ROOT
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Flags absl itself defines for every command.
ABSL_FLAGS = {"help", "helpfull", "helpshort", "helpxml", "flagfile", "undefok", "logtostderr",
              "alsologtostderr", "log_dir", "v", "verbosity", "stderrthreshold", "only_check_args"}


def _blocks(text: str) -> tuple[list[str], str]:
  """(the page's shell code blocks, the page without its code blocks)."""
  blocks, prose, current = [], [], None
  for line in text.splitlines():
    if line.startswith("```"):
      if current is None:
        current = [] if line[3:].strip() in ("", "bash", "sh") else False
      else:
        if current is not False:
          blocks.append("\n".join(current))
        current = None
    elif current is None:
      prose.append(line)
    elif current is not False:
      current.append(line)
  return blocks, "\n".join(prose)


def _commands(text: str) -> list[str]:
  """The command lines of a page: shell code blocks (continuations joined, comments cut)
  and inline `python ...` spans."""
  out = []
  blocks, prose = _blocks(text)
  for block in blocks:
    joined = re.sub(r"\\\n\s*", " ", block)
    for line in joined.splitlines():
      line = re.sub(r"\s+#.*$", "", line).strip()
      if line and not line.startswith("#"):
        out += [part.strip() for part in line.split("&&")]
  for span in re.findall(r"`((?:python|pytest) [^`]+)`", prose.replace("\n", " ")):
    out.append(re.sub(r"\s+", " ", span))
  return out


def _all_commands() -> list[tuple[str, str]]:
  return [(page.relative_to(ROOT).as_posix(), c) for page in PAGES
          for c in _commands(page.read_text())]


def _source_of(module: str) -> pathlib.Path:
  spec = importlib.util.find_spec(module)
  assert spec is not None and spec.origin, f"no module {module}"
  return pathlib.Path(spec.origin)


@functools.cache
def _flags_of(path: pathlib.Path) -> frozenset:
  """Flag names a command file defines: DEFINE_*("name", ...), add_argument("--name") and
  add_parser("name") (argparse subcommands), and those of X.define_flags() it calls."""
  names = set()
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if not isinstance(node, ast.Call):
      continue
    func = node.func
    attr = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    first = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
    if attr.startswith("DEFINE_") and isinstance(first, str):
      names.add(first)
    elif attr == "add_argument":
      names.update(a.value.lstrip("-") for a in node.args if isinstance(a, ast.Constant))
    elif attr == "add_parser" and isinstance(first, str):
      names.add(first)
    elif attr == "define_flags" and isinstance(func, ast.Attribute) and isinstance(
        func.value, ast.Name):
      for imp in ast.walk(tree):
        if isinstance(imp, ast.ImportFrom) and imp.module and any(
            a.name == func.value.id for a in imp.names):
          names |= _flags_of(_source_of(f"{imp.module}.{func.value.id}"))
  return frozenset(names)


def _check_config(path_arg: str, overrides: list[str]) -> None:
  path, _, arg = path_arg.partition(":")
  if re.search(r"<|\.\.\.|/[A-Z]+\.py$", path):  # configs/<recipe>.py, configs/X.py, ...
    return
  assert (ROOT / path).is_file(), f"no config file {path}"
  if "$" in arg or "|" in arg:  # A placeholder or a choice of values.
    return
  spec = importlib.util.spec_from_file_location("doc_config", ROOT / path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  try:
    config = module.get_config(arg or None)
  except FileNotFoundError:  # The argument names a checkpoint to read: the reader's own.
    return
  for key in overrides:
    if re.search(r"[A-Z/]|\.\.\.|^key$", key):  # Placeholders: KEY, data/fsdp/tensor, ...
      continue
    node = config
    for part in key.split("."):
      assert hasattr(node, "keys") and part in node, f"{path_arg} has no key {key!r}"
      node = node[part]


@pytest.mark.parametrize("page,command", _all_commands())
def test_documented_command_is_valid(page, command):
  del page
  words = shlex.split(command.replace("[", " ").replace("]", " "))
  if words[0] in ("pip", "for", "do", "done"):  # Installs and shell loops around commands.
    return
  if words[0] == "pytest":  # Its -m expression names registered markers only.
    expression = words[words.index("-m") + 1] if "-m" in words else ""
    markers = set(re.findall(r"\b(\w+)\b", expression)) - {"not", "and", "or"}
    registered = set(re.findall(r"^\s+(\w+):", (ROOT / "pytest.ini").read_text(), re.M))
    assert markers <= registered
    return
  while re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # Environment settings first.
    words = words[1:]
  if words[0] in ("sbatch", "bash") or words[0].startswith("launch/"):
    script = next(w for w in words if w.startswith("launch/"))
    assert (ROOT / script).is_file(), script
    return
  assert words[0] in ("python", "python3"), command
  if words[1] == "-m":
    source, args = _source_of(words[2]), words[3:]
  else:
    source, args = ROOT / words[1], words[2:]
    assert source.is_file(), words[1]
  if "--" in args:  # A launcher: what follows the '--' is bigpretrain.main's.
    cut = args.index("--")
    _check_flags(source, args[:cut])
    _check_flags(_source_of("bigpretrain.main"), args[cut + 1:])
  else:
    _check_flags(source, args)


def _check_flags(source: pathlib.Path, args: list[str]) -> None:
  defined = _flags_of(source) | ABSL_FLAGS
  overrides, config = [], None
  for word in args:
    if not word.startswith("--"):
      continue
    name, _, value = word[2:].partition("=")
    name = name.split("|")[0]
    if name.startswith("config."):
      overrides.append(name[len("config."):])
    elif name == "config":
      config = value
    else:
      assert name in defined or name.removeprefix("no") in defined, (
          f"{source.name} defines no flag --{name}")
  if config:
    assert "config" in defined, f"{source.name} takes no --config"
    _check_config(config, overrides)


def test_pages_link_to_files_that_exist():
  for page in PAGES:
    for target in re.findall(r"\]\(([^)#]+)\)", page.read_text()):
      if not target.startswith("http"):
        assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
