"""The one registry, config.plugins, and the layering it keeps: a user's objective, data
source and model in their own package train without editing this repository; no import
cycles; the input pipeline imports only its declared pure libraries from bigpretrain."""
import ast
import json
import os
import subprocess
import sys
import textwrap

import pytest

from bigpretrain import registry
from tests import helpers

ROOT = helpers.ROOT
# What input_pipeline (the lower layer) may import from bigpretrain: pure libraries.
LOWER_LAYER_MAY_USE = ("bigpretrain.cache", "bigpretrain.registry", "bigpretrain.semantic.tree",
                       "bigpretrain.semantic.wordnet", "bigpretrain.hashtags.vocabulary",
                       "bigpretrain.hashtags.resampling", "bigpretrain.selection.tags",
                       "bigpretrain.selection.topk")


def test_registry_lookup_suggestion_idempotence_and_prefixes():
  reg = registry.Registry("widget", "config.widget", prefixes=True)
  a = reg.register("alpha")(object())
  reg.register("alpha", a)  # The same object again: fine (a module imported twice).
  with pytest.raises(ValueError, match="widget 'alpha' is already registered"):
    reg.register("alpha", object())
  b, c = object(), object()
  reg.register("tfds:", b, usage="tfds:NAME")
  reg.register("tfds:long/", c)
  assert reg.get("alpha") is a
  assert reg.get("tfds:x") is b and reg.get("tfds:long/y") is c  # The longest prefix wins.
  with pytest.raises(ValueError) as e:
    reg.get("alpah")
  assert str(e.value) == ("config.widget='alpah' is not a known widget. Did you mean 'alpha'? "
                          "Known: alpha, tfds:NAME, tfds:long/.")
  with pytest.raises(ValueError, match="not a known widget"):
    reg.get("tfds:")  # A prefix alone names nothing.


def test_lazy_entries_import_their_module_on_first_use(tmp_path, monkeypatch):
  (tmp_path / "lazy_widgets.py").write_text(textwrap.dedent("""
      from bigpretrain import registry
      REG = registry.Registry("widget", "config.widget")
      REG.register_lazy("late", "lazy_widgets_impl")
      """))
  (tmp_path / "lazy_widgets_impl.py").write_text(
      "import lazy_widgets\nlazy_widgets.REG.register('late', 'it')\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  import lazy_widgets  # pylint: disable=import-outside-toplevel,import-error
  assert "lazy_widgets_impl" not in sys.modules
  assert lazy_widgets.REG.get("late") == "it"
  with pytest.raises(ValueError, match="cannot import plugin module 'no_such_plugin'"):
    registry.import_plugins(["no_such_plugin"])


def _import_graph() -> dict[str, set[str]]:
  """module -> the project modules it imports (anywhere in it, functions included)."""
  mods = {}
  for path in [*ROOT.glob("bigpretrain/**/*.py"), *ROOT.glob("input_pipeline/**/*.py")]:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    mods[name] = path
  graph = {}
  for name, path in mods.items():
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        deps.update(a.name for a in node.names)
      elif isinstance(node, ast.ImportFrom) and node.module:
        deps.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods
                    else node.module for a in node.names)
    # A submodule importing its own package is how packages work, not a cycle.
    graph[name] = {d for d in deps if d in mods and d != name and not name.startswith(d + ".")}
  return graph


def test_no_import_cycles_and_the_input_pipeline_stays_below_the_trainer():
  graph = _import_graph()
  state, cycles = {}, []

  def visit(node, path):
    state[node] = "open"
    for dep in sorted(graph[node]):
      if state.get(dep) == "open":
        cycles.append(path[path.index(dep):] + [dep])
      elif dep not in state:
        visit(dep, path + [dep])
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node, [node])
  assert not cycles
  lower = {n: sorted(d for d in deps
                     if d.startswith("bigpretrain") and d not in LOWER_LAYER_MAY_USE)
           for n, deps in graph.items() if n.startswith("input_pipeline")}
  assert not {n: d for n, d in lower.items() if d}


PLUGIN = '''
"""A user's package: a data source, an objective and a model, registered on import."""
import jax.numpy as jnp
from flax import nnx

from bigpretrain.models import base as model_base
from bigpretrain.objectives import base as objective_base
from bigpretrain.objectives import softmax
from input_pipeline import datasets


@datasets.SOURCES.register("mydata:")
def load(name, data_dir):
  """'mydata:X' is the demo under another name (a user's own loader would read its files)."""
  return datasets.get_dataset({"name": "demo", "dir": data_dir})


@objective_base.OBJECTIVES.register("my_softmax")
class MySoftmax(softmax.Softmax):
  pass


class MeanPixels(model_base.Classifier):
  def __init__(self, *, num_classes, rngs, dtype=jnp.float32, image_size=32):
    del image_size
    self.head = nnx.Linear(3, num_classes, rngs=rngs)

  def features(self, images, *, train=False, rng=None):
    return jnp.mean(images.astype(jnp.float32), axis=(1, 2))


model_base.MODELS.register("my_mean_pixels", MeanPixels)
'''


def test_a_plugin_outside_the_repo_trains_from_the_command_line(tmp_path):
  plugins = tmp_path / "user_code"
  plugins.mkdir()
  (plugins / "my_plugin.py").write_text(PLUGIN)
  workdir = tmp_path / "run"
  env = {**os.environ, "PYTHONPATH": f"{plugins}{os.pathsep}{ROOT}"}
  out = subprocess.run(
      [sys.executable, "-m", "bigpretrain.main", "--config=configs/single_label.py",
       f"--workdir={workdir}", "--config.plugins=('my_plugin',)", "--config.data.name=mydata:x",
       "--config.model.name=my_mean_pixels", "--config.objective.name=my_softmax",
       "--config.total_steps=2", "--config.batch_size=16", "--config.log_every_steps=1",
       "--config.eval_every_steps=0", "--config.evals.fewshot.shots=()",
       f"--config.compilation_cache_dir={helpers.JAX_CACHE}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]
  config = json.loads((workdir / "config.json").read_text())
  assert config["model"]["name"] == "my_mean_pixels" and config["plugins"] == ["my_plugin"]
