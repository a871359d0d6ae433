"""Training objectives: what a step computes from a batch. One module per objective.

An objective subclasses `base.Objective` (the contract: the batch fields it reads, whether it
takes mixup's soft targets, loss, eval metrics, optional frozen inputs) and is registered by
name; `config.objective.name` picks it. A new objective needs only `register(name, cls)`.
"""
from bigpretrain.objectives import base
from bigpretrain.objectives import cosub
from bigpretrain.objectives import multi_label
from bigpretrain.objectives import semantic_kd
from bigpretrain.objectives import semantic_softmax
from bigpretrain.objectives import soft_target
from bigpretrain.objectives import softmax

_REGISTRY = {}


def register(name: str, cls) -> None:
  """Makes `cls(cfg, info)` (a base.Objective) selectable as config.objective.name=name."""
  if name in _REGISTRY and _REGISTRY[name] is not cls:
    raise ValueError(f"objective {name!r} is already registered")
  _REGISTRY[name] = cls


def names() -> list[str]:
  return sorted(_REGISTRY)


def get_objective(cfg, info) -> base.Objective:
  """Builds the objective named by `cfg.name` (config.objective) for dataset `info`."""
  if cfg.name not in _REGISTRY:
    raise ValueError(f"config.objective.name={cfg.name!r} is unknown; known: {names()}.")
  return _REGISTRY[cfg.name](cfg, info)


def missing_fields(objective: base.Objective, info) -> list[str]:
  """The batch fields the objective reads that dataset `info` cannot ship."""
  return [f for f in objective.reads if info.features.get(f) is None]


def batch_fields(objective: base.Objective, info) -> dict:
  """The fields the objective reads, with their sizes (see pipeline.record_fields)."""
  return {f: info.features[f] for f in objective.reads}


def check(objective: base.Objective, info, config) -> None:
  """The objective's declarations against the dataset and the config, before compiling."""
  name = config.objective.name
  missing = missing_fields(objective, info)
  if missing:
    raise ValueError(
        f"Objective {name!r} reads batch fields {missing} that dataset {info.name!r} does not "
        f"provide (it has {sorted(k for k, v in info.features.items() if v is not None)}).")
  if mixup_enabled(config.mixup):
    if not objective.soft_targets:
      raise ValueError(
          f"Objective {name!r} does not take soft targets, so mixup/cutmix "
          f"(config.mixup.mixup_alpha={config.mixup.mixup_alpha}, cutmix_alpha="
          f"{config.mixup.cutmix_alpha}) would train on mixed images against unmixed labels. "
          "Set both to 0, or use an objective that takes soft targets.")
    if getattr(objective, "label_smoothing", 0.0) > 0:
      raise ValueError(
          f"config.objective.label_smoothing={objective.label_smoothing} with mixup/cutmix on: "
          "the mixed targets are smoothed by config.mixup.label_smoothing; set that instead.")


def mixup_enabled(mixup_cfg) -> bool:
  return mixup_cfg is not None and (mixup_cfg.mixup_alpha > 0 or mixup_cfg.cutmix_alpha > 0)


for _name, _cls in (("cosub", cosub.Cosub), ("softmax", softmax.Softmax),
                    ("semantic_softmax", semantic_softmax.SemanticSoftmax),
                    ("semantic_kd", semantic_kd.SemanticKD),
                    ("multi_label", multi_label.MultiLabel),
                    ("soft_target", soft_target.SoftTarget)):
  register(_name, _cls)
