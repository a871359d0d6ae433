r"""Evaluate a trained model on several test sets in one command, whole or with residual
blocks removed; one JSON line out.

--workdir is a run folder: its config.json gives the data settings, batch size, mesh and
sharding rules of the trainer's own eval, so evaluating the run's dataset repeats the
trainer's final 'eval/...' numbers. --checkpoint is a checkpoint dir or a
`bigpretrain.tools.convert` output: its meta gives the preprocessing, the rest are defaults.
Without --datasets the run's dataset and eval split are evaluated. NAME is any data.name
(demo, tfds:NAME[/CONFIG], folder:NAME, imagenet21k_p, ...), read from --data_dir (default:
the run's data.dir); SPLIT defaults to the run's eval split for the run's dataset, else
'validation', else 'test', else the only split.

Per dataset:
- Same classes as the model (same class names, or a model without names and as many
  classes): the run's objective's eval metrics (top-k, semantic top-1 on WordNet classes,
  mAP for multi-label, ...), as the trainer's classification evaluator computes them.
- Other classes: top-k over the dataset's classes, each class scored by the model's answer
  (objective.answer: softmax, or the hierarchical probability of semantic models) of its
  class, or the max over its classes when --class_map gives several (ObjectNet's 113 classes
  each map to one or more ImageNet classes; we score a class by its best ImageNet class, the
  usual ObjectNet protocol). The map is found by name when every dataset class is a model
  class (a 21K model on ImageNet-1K wnids); otherwise --class_map=FILE is needed, a JSON
  object {dataset class name: model class name or list of names}.
- ReaL labels (datasets with a 'real_label' list per image, e.g. tfds:imagenet2012_real, whose
  'original_label' is the label): also 'real_top1', Beyer et al. 2020 ("Are we done with
  ImageNet?"): the top-1 class is one of the image's real labels; images with no real label
  are left out (their count is 'num_real_examples').

--drop_blocks removes residual blocks (cosub supplement D.2; see models/submodel.py);
'sweep' evaluates the whole model, then each removable block removed alone, and prints a
table and one JSON line {"num_blocks", "full": {dataset: metrics}, "drop": {block: {dataset:
metrics}}, "not_removable": [blocks]}.
"""
import dataclasses
import json
import os
import re

import jax
import ml_collections
import numpy as np

from bigpretrain import objectives
from bigpretrain import sharding
from bigpretrain.evaluators import classification
from bigpretrain.evaluators import mapped
from bigpretrain.models import pretrained
from bigpretrain.models import submodel
from input_pipeline import datasets
from input_pipeline import subset

def parse_datasets(text: str) -> list[tuple[str, str]]:
  """'demo:validation,tfds:imagenet_v2' -> [('demo', 'validation'), ('tfds:imagenet_v2', '')].

  The text after the last ':' is a split unless that ':' ends a name prefix ('tfds:'); a
  split may be sliced ('demo:validation[:1000]': subset.split_source), its ':' kept."""
  prefixes = tuple(p for p in datasets.name_prefixes() if p.endswith(":"))
  out = []
  for spec in (s.strip() for s in text.split(",")):
    if not spec:
      continue
    head, sliced = re.fullmatch(r"(.*?)(\[[^\[\]]*\])?", spec).groups()
    name, sep, split = head.rpartition(":")
    split += sliced or ""
    if not sep or (name + ":") in prefixes:
      name, split = spec, ""
    if not name:
      raise ValueError(f"Bad dataset {spec!r} in --datasets={text!r}: use NAME[:SPLIT].")
    out.append((name, split))
  return out


def parse_drop_blocks(text: str):
  """'' -> (), '3,7' -> (3, 7), 'sweep' -> 'sweep'."""
  text = text.strip()
  if text == "sweep":
    return "sweep"
  try:
    return tuple(int(t) for t in text.split(",") if t.strip())
  except ValueError:
    raise ValueError(f"--drop_blocks={text!r}: give block indices like 3,7 or 'sweep'.") from None


def read_run_config(workdir: str) -> dict:
  """The run's config.json (written by the trainer) as a dict."""
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} does not exist: --workdir needs a run folder; pass a "
                            "checkpoint dir or a `bigpretrain.tools.convert` output as "
                            "--checkpoint.")
  with open(path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path} is not valid JSON ({e}): the run folder's config.json is "
                       "damaged; pass its checkpoints as --checkpoint instead.") from None


@dataclasses.dataclass
class TestSet:
  """One dataset split to evaluate, and how the model's classes map onto its labels."""
  name: str  # 'NAME:SPLIT', the key of its results.
  dataset: datasets.Dataset
  split: str
  data_cfg: dict
  fields: dict
  objective: object  # Scores the model's classes (its answer), or the run's eval metrics.
  columns: np.ndarray | None  # None: the model's own classes (objective.eval_metrics).
  real: bool


class Evaluation:
  """A loaded model on a mesh, and the test sets to run it on."""

  def __init__(self, path: str, *, run_config: dict | None = None, batch_size: int = 0,
               topk=(1, 5)):
    run_config = run_config or {}
    self.run_data = dict(run_config.get("data", {}))
    mesh_cfg = run_config.get("mesh", dict(data=-1, fsdp=1, tensor=1))
    self.rules = rules = tuple(tuple(r) for r in run_config.get("sharding_rules", ()))
    self.mesh = sharding.make_mesh(mesh_cfg)
    self.batch_size = batch_size or run_config.get("batch_size", 0) or 8 * self.mesh.size
    sharding.check_batch_size(self.batch_size, self.mesh,
                              "--batch_size" if batch_size else "the run's config.batch_size")
    self.topk = tuple(topk)
    self.loaded = pretrained.load(path, mesh=self.mesh, rules=rules)
    self.meta = self.loaded.meta
    self._steps = {}

  def test_set(self, name: str, split: str = "", *, data_dir: str | None = None,
               class_map: dict | None = None) -> TestSet:
    """Looks up dataset `name` (a data.name) and checks it against the model."""
    meta = self.meta
    own = name == meta["dataset"]
    data_cfg = {**meta["data"], **self.run_data, "name": name}
    if data_dir is not None:
      data_cfg["dir"] = data_dir
    dataset = datasets.get_dataset(data_cfg)
    info = dataset.info
    if not split:
      defaults = ([data_cfg.get("eval_split", "validation")] if own else []) + [
          "validation", "test"]
      split = next((s for s in defaults if subset.split_name(s) in info.splits),
                   info.splits[0] if len(info.splits) == 1 else "")
      if not split:
        raise ValueError(f"Dataset {name!r} has splits {list(info.splits)}: name one, "
                         f"e.g. --datasets={name}:{info.splits[0]}.")
    subset.check_split(info, split, f"--datasets={name}:{split}")
    model_names = list(meta["class_names"])
    real = mapped.REAL_LABEL in info.features
    same = info.num_classes == meta["num_classes"] and (
        info.class_names == model_names or not model_names)
    if same and class_map is None and not real:
      objective = objectives.get_objective(ml_collections.ConfigDict(meta["objective"]), info)
      objective.restore_meta(meta)  # The class tree the model was trained on, when stored.
      missing = objectives.missing_fields(objective, info)
      if missing:
        raise ValueError(f"Dataset {name!r} lacks the fields {missing} that objective "
                         f"{meta['objective']['name']!r} reads.")
      return TestSet(f"{name}:{split}", dataset, split, data_cfg,
                     objectives.batch_fields(objective, info), objective, None, False)
    if same and class_map is None:
      columns = np.arange(info.num_classes, dtype=np.int32)[:, None]
    else:
      if not model_names:
        raise ValueError(f"The model has no class names, so its {meta['num_classes']} classes "
                         f"cannot be matched with the {info.num_classes} of dataset {name!r}.")
      columns = mapped.class_columns(model_names, info.class_names, name, class_map)
    model_info = datasets.DatasetInfo(meta["dataset"], meta["num_classes"], model_names, {},
                                      None, ())
    objective = objectives.get_objective(ml_collections.ConfigDict(meta["objective"]),
                                         model_info)
    objective.restore_meta(meta)
    fields = {"label": 0}
    if real:  # A set of distinct classes has at most num_classes entries.
      fields[mapped.REAL_LABEL] = info.num_classes
    return TestSet(f"{name}:{split}", dataset, split, data_cfg, fields, objective, columns,
                   real)

  def _step(self, ts: TestSet, drop: tuple[int, ...]):
    key = (ts.name, drop)
    if key not in self._steps:
      model_def = self.loaded.model_def
      if drop:
        submodel.check(self.loaded.module(), drop)
        model_def = submodel.WithoutBlocks(model_def, drop)
      normalize = self.meta["data"]["normalize"]
      if ts.columns is None:
        step = classification.make_eval_step(model_def, ts.objective, self.loaded.shardings,
                                             self.mesh, normalize, self.topk)
      else:
        step = mapped.make_mapped_step(model_def, ts.objective, self.loaded.shardings, self.mesh,
                                normalize, self.topk, ts.columns, ts.real)
      self._steps[key] = step
    return self._steps[key]

  def run(self, test_sets, drop=()) -> dict:
    """{test set name: metrics} with the blocks `drop` removed."""
    drop = tuple(sorted({int(i) for i in drop}))
    if drop:  # Bad indices fail before any data is read.
      submodel.check(self.loaded.module(), drop)
    out = {}
    with jax.set_mesh(self.mesh), sharding.use_rules(self.rules):
      for ts in test_sets:
        totals, skipped, _ = classification.evaluate(
            self._step(ts, drop), self.loaded.variables, ts.dataset, ts.data_cfg, self.mesh,
            split=ts.split, batch_size=self.batch_size, fields=ts.fields)
        out[ts.name] = classification.summarize(totals, ts.objective, skipped)
    return out

  def sweep(self, test_sets) -> dict:
    """The whole model, then each removable block removed alone (see the module docstring)."""
    ok = submodel.removable(self.loaded.module())
    return {"num_blocks": len(ok), "full": self.run(test_sets),
            "drop": {str(i): self.run(test_sets, (i,)) for i, r in enumerate(ok) if r},
            "not_removable": [i for i, r in enumerate(ok) if not r]}


def evaluate(path: str, specs=(), *, run_config: dict | None = None, data_dir: str | None = None,
             class_map: dict | None = None, drop_blocks=(), batch_size: int = 0, topk=(1, 5)):
  """Evaluates the model at `path` on the (name, split) `specs` (default: its own dataset);
  `drop_blocks` is a tuple of block indices or 'sweep'."""
  ev = Evaluation(path, run_config=run_config, batch_size=batch_size, topk=topk)
  if not specs and "source" in ev.meta:
    raise ValueError(f"{path} holds weights converted from {ev.meta['source']['from']}, "
                     "trained on no dataset of this project: give --datasets=NAME[:SPLIT].")
  specs = list(specs) or [(ev.meta["dataset"], "")]
  test_sets = [ev.test_set(n, s, data_dir=data_dir, class_map=class_map) for n, s in specs]
  names = [ts.name for ts in test_sets]
  if len(set(names)) != len(names):
    raise ValueError(f"--datasets lists a dataset twice: {names}.")
  if drop_blocks == "sweep":
    return ev.sweep(test_sets)
  return ev.run(test_sets, drop_blocks)


def sweep_table(result: dict, metric: str = "top1") -> str:
  """The sweep as text: one row per removed block, `metric` per dataset and its change."""
  names = list(result["full"])
  lines = ["block  " + "  ".join(f"{n} {metric} (change)" for n in names)]
  def row(label, metrics):
    cells = []
    for n in names:
      v, full = metrics[n].get(metric, float("nan")), result["full"][n].get(metric, float("nan"))
      cells.append(f"{100 * v:6.2f}% ({100 * (v - full):+6.2f})")
    return f"{label:<6} " + "  ".join(cells)
  lines.append(row("none", result["full"]))
  for block, metrics in result["drop"].items():
    lines.append(row(block, metrics))
  if result["not_removable"]:
    lines.append(f"not removable (projection shortcut): {result['not_removable']}")
  return "\n".join(lines)
