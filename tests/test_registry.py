"""The one registry, config.plugins, and the layering it keeps: a user's objective, data
source and model in their own package train without editing this repository; no import
cycles; the input pipeline imports only its declared pure libraries from bigpretrain; the
trainer's core reaches models, objectives and evaluators only through their contracts and
imports no recipe library; no library imports a command."""
import ast
import functools
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
from PIL import Image
import pytest

from bigpretrain import registry
from tests import helpers

ROOT = helpers.ROOT
# What input_pipeline (the lower layer) may import from bigpretrain: pure libraries (and the
# commands' shared error style, for its command).
LOWER_LAYER_MAY_USE = ("bigpretrain.moved", "bigpretrain.runtime.cache", "bigpretrain.registry",
                       "bigpretrain.runtime.transient", "bigpretrain.runtime.units",
                       "bigpretrain.semantic.tree", "bigpretrain.tools.cli",
                       "bigpretrain.semantic.wordnet", "bigpretrain.swag.vocabulary",
                       "bigpretrain.swag.resampling", "bigpretrain.semisup.tags",
                       "bigpretrain.semisup.topk")


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


def test_a_name_clash_names_both_modules_whichever_registers_first(tmp_path, monkeypatch):
  """A plugin taking a built-in's name (also a built-in source, whose module is imported on
  the registry's first use, e.g. 'demo_coarse') is refused, never a silent replacement."""
  from input_pipeline import datasets  # pylint: disable=import-outside-toplevel
  (tmp_path / "takes_demo_coarse.py").write_text(
      "from input_pipeline import datasets\n"
      "datasets.SOURCES.register('demo_coarse', lambda name, data_dir: None)\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(ValueError) as e:
    registry.import_plugins(["takes_demo_coarse"])
  assert ("dataset 'demo_coarse' is already registered by module "
          "input_pipeline.sources.demo_coarse; module takes_demo_coarse registers another "
          "dataset" in str(e.value)), e.value
  assert datasets.SOURCES.get("demo_coarse").__module__ == "input_pipeline.sources.demo_coarse"
  # The other order: a name taken, then declared by a lazily imported module.
  reg = registry.Registry("widget", "config.widget")
  reg.register("late", object())
  with pytest.raises(ValueError, match=f"'late' is already registered by module {__name__}; "
                     "module other.module registers another widget"):
    reg.register_lazy("late", "other.module")


def test_a_plugin_that_fails_on_import_is_one_error_naming_it(tmp_path, monkeypatch):
  (tmp_path / "broken_plugin.py").write_text("import os\nraise RuntimeError('no licence')\n")
  (tmp_path / "needs_a_dep.py").write_text("import not_an_installed_package\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(ValueError) as e:
    registry.import_plugins(["broken_plugin"])
  assert str(e.value) == (f"config.plugins: plugin module 'broken_plugin' failed to import, at "
                          f"{tmp_path / 'broken_plugin.py'}:2: RuntimeError: no licence")
  with pytest.raises(ValueError) as e:
    registry.import_plugins(["needs_a_dep"])
  assert str(e.value) == ("config.plugins: plugin module 'needs_a_dep' failed to import: No "
                          "module named 'not_an_installed_package'.")


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


# The trainer's core: it reaches models, objectives and evaluators through their contracts
# (the packages' registries and base modules) only.
CORE = ("bigpretrain.train", "bigpretrain.config_lib", "bigpretrain.registry",
        "bigpretrain.checkpoint", "bigpretrain.sharding", "bigpretrain.optim",
        "bigpretrain.losses", "bigpretrain.inference", "bigpretrain.initial_state",
        "bigpretrain.mixup", "bigpretrain.preprocess", "bigpretrain.model_init",
        "bigpretrain.divergence", "bigpretrain.moved", "bigpretrain.runtime")
CONTRACTS = ("bigpretrain.models", "bigpretrain.models.base", "bigpretrain.objectives",
             "bigpretrain.objectives.base", "bigpretrain.evaluators",
             "bigpretrain.evaluators.base")
EXTENSIONS = ("bigpretrain.models", "bigpretrain.objectives", "bigpretrain.evaluators")
RECIPE_LIBRARIES = ("bigpretrain.semantic", "bigpretrain.swag", "bigpretrain.semisup")
COMMANDS = ("bigpretrain.main", "bigpretrain.tools", "input_pipeline.prepare")


def _within(name: str, packages) -> bool:
  return any(name == p or name.startswith(p + ".") for p in packages)


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
  """The imports that break the layers: a cycle; the input pipeline importing the trainer
  side (beyond LOWER_LAYER_MAY_USE); the core importing a model family, an objective, an
  evaluator, a recipe library or a command; any library importing a command."""
  out, state = [], {}

  def visit(node, path):
    state[node] = "open"
    for dep in sorted(graph[node]):
      if state.get(dep) == "open":
        out.append("cycle: " + " -> ".join(path[path.index(dep):] + [dep]))
      elif dep not in state:
        visit(dep, path + [dep])
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node, [node])
  for name, deps in sorted(graph.items()):
    for dep in sorted(deps):
      if (name.startswith("input_pipeline") and dep.startswith("bigpretrain")
          and dep not in LOWER_LAYER_MAY_USE):
        out.append(f"lower layer: {name} imports {dep}")
      if _within(name, CORE) and dep not in CONTRACTS and _within(dep, EXTENSIONS
                                                                    + RECIPE_LIBRARIES):
        out.append(f"core: {name} imports {dep}")
      if not _within(name, COMMANDS) and _within(dep, COMMANDS):
        out.append(f"library imports a command: {name} imports {dep}")
  return out


def test_the_layers_hold_and_a_planted_violation_is_caught():
  graph = _import_graph()
  assert not layer_violations(graph)
  planted = {
      "bigpretrain.checkpoint": "bigpretrain.models.vit",  # a model family
      "bigpretrain.train": "bigpretrain.swag.zero_shot",  # a recipe library
      "bigpretrain.config_lib": "bigpretrain.tools.plan",  # a command, from the core
      "bigpretrain.swag.zero_shot": "bigpretrain.tools.zero_shot",  # a command, from a library
      "input_pipeline.pipeline": "bigpretrain.train",  # the lower layer reaching up
      "bigpretrain.registry": "bigpretrain.train",  # a cycle (train imports the registry)
  }
  for module, dep in planted.items():
    bad = {m: set(d) for m, d in graph.items()}
    bad[module].add(dep)
    assert layer_violations(bad), (module, dep)


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


@pytest.mark.slow  # Four commands end to end.
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

  # The checkpoint names its plugins: the commands that open it import them themselves.
  image = tmp_path / "photo.png"
  Image.fromarray(np.full((32, 32, 3), 200, np.uint8)).save(image)
  commands = {
      "predict": ["bigpretrain.tools.predict", f"--workdir={workdir}", "--json", str(image)],
      "evaluate": ["bigpretrain.tools.evaluate", f"--checkpoint={workdir}",
                   "--datasets=demo:validation", "--batch_size=16", "--json"],
  }
  for name, args in commands.items():
    r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600, check=False)
    assert r.returncode == 0, (name, r.stderr[-3000:])
    assert json.loads(r.stdout.strip().splitlines()[-1]), name
  # Without the plugin's folder on the path: one error naming the module, no traceback.
  r = subprocess.run([sys.executable, "-m", *commands["predict"]], cwd=ROOT,
                     env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                     text=True, timeout=600, check=False)
  assert r.returncode != 0
  assert "cannot import plugin module 'my_plugin'" in r.stderr, r.stderr[-2000:]


# ---------------------------------------------------------------- the dataset contract


def _selection_dir(folder, demo) -> str:
  """A selection D-hat written by hand (selection_source's files): 3 unlabeled demo images."""
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  from input_pipeline import selection_formats  # pylint: disable=import-outside-toplevel
  pq.write_table(pa.table({"dataset": pa.array(["demo"] * 3), "split": ["unlabeled"] * 3,
                           "index": pa.array([0, 5, 9], pa.int64()),
                           "label": pa.array([1, 2, 3], pa.int32())}),
                 str(folder / "index-00000.parquet"))
  (folder / selection_formats.SELECTION_FILE).write_text(json.dumps({
      "format": selection_formats.FORMAT, "dataset": "demo",
      "class_names": demo.info.class_names, "index_files": ["index-00000.parquet"]}))
  return f"selection:{folder}"


def test_every_registered_dataset_loader_returns_the_declared_contract(tmp_path, monkeypatch):
  from input_pipeline import datasets  # pylint: disable=import-outside-toplevel
  from input_pipeline.sources import demo as demo_source  # pylint: disable=import-outside-toplevel
  from input_pipeline.sources import hashtag_demo  # pylint: disable=import-outside-toplevel
  from input_pipeline import subset  # pylint: disable=import-outside-toplevel
  demo = datasets.get_dataset({"name": "demo"})
  # Registered key -> (a name it serves, the name its loader is called with), demo-sized.
  cases = {
      "demo": ("demo", "demo"), "demo/": ("demo/trunc20",) * 2,
      "demo_plain": ("demo_plain",) * 2, "demo_plain/": ("demo_plain/trunc20",) * 2,
      "demo_coarse": ("demo_coarse",) * 2, "demo_plain_coarse": ("demo_plain_coarse",) * 2,
      "tfds:": (f"tfds:{demo.builder.info.full_name.rsplit('/', 1)[0]}",) * 2,
      "hashtags:demo": ("hashtags:demo",) * 2,
      # The prefix loader, on the demo's files as the hashtags:demo loader prepares them.
      "hashtags:": ("hashtags:other", f"hashtags:{hashtag_demo.prepared_name(demo.builder)}"),
      "selection:": (_selection_dir(tmp_path, demo),) * 2,
      # Prepared by Beam jobs: their loaders read the demo's files here.
      "imagenet21k_p": ("imagenet21k_p",) * 2, "folder:": ("folder:x",) * 2,
  }
  def loader(key):  # A prefix serves the longer names.
    return datasets.SOURCES.get(key + "x" if key.endswith((":", "/")) else key)

  built_in = [k for k in datasets.SOURCES.keys()  # Not the tests' own loaders.
              if loader(k).__module__.startswith("input_pipeline.")]
  assert sorted(cases) == sorted(built_in)  # A new loader needs a case here.
  for key, (lookup, name) in cases.items():
    with monkeypatch.context() as patch:
      if key in ("imagenet21k_p", "folder:"):
        patch.setattr(datasets.read_only_builder, "builder_from_files",
                      lambda *args, **kwargs: demo.builder)
      if key.startswith("demo_plain"):  # Generated with a few images per class, not 27,500.
        patch.setattr(demo_source, "prepare", functools.partial(
            demo_source.prepare, split_sizes={"train": 2, "validation": 1, "unlabeled": 1}))
      dataset = datasets.SOURCES.get(lookup)(name, "")
    assert isinstance(dataset, datasets.Dataset), key
    assert isinstance(dataset.info, datasets.DatasetInfo), key
    assert dataset.info.splits and set(dataset.info.num_examples) == set(dataset.info.splits)
    for split in dataset.info.splits:
      source = dataset.source(split)
      assert isinstance(source, datasets.Source), (key, split)
      assert source.split == split and len(source) == dataset.info.num_examples[split] > 0
      record = source[len(source) - 1]
      assert isinstance(record["image"], bytes), (key, split)
      assert set(dataset.info.features) <= set(record), (key, split)
      assert isinstance(source.configure({}), datasets.Source)
      # index_sampler: None, or a method that may return None (this split is not resampled).
      sampler = source.index_sampler and source.index_sampler(0, 0, 1)
      assert (sampler is not None) == (key.startswith("hashtags:") and split == "train")
      if sampler is not None:
        assert 0 <= sampler[0] < len(source)
        with pytest.raises(ValueError, match="own index sampler"):
          subset.apply(source, {"subset_frac": 0.5}, name)
    with pytest.raises(ValueError, match="known splits"):
      dataset.source("no_such_split")


def test_a_train_source_outside_the_contract_is_refused():
  from input_pipeline import datasets  # pylint: disable=import-outside-toplevel

  class Loose:  # Duck-typed: what a source provides, without datasets.Source's members.
    def __len__(self):
      return 1

    def __getitem__(self, i):
      return {"image": b"", "label": 0}

  class Plugin(datasets.Dataset):
    info = datasets.DatasetInfo(name="loose", num_classes=1, class_names=["a"],
                                num_examples={"train": 1}, image_size=8, splits=("train",))

    def source(self, split):
      return Loose()

  with pytest.raises(TypeError, match="Loose, not a datasets.Source"):
    datasets.train_sources({}, Plugin())
