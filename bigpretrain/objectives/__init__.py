"""Training objectives: what a step computes from a batch. One module per objective.

An objective subclasses `base.Objective` (the contract: the batch fields it reads, whether it
takes mixup's soft targets, loss, eval metrics, optional frozen inputs) and is registered by
name where it is defined (`@base.OBJECTIVES.register(name)`); `config.objective.name` picks
it. An objective outside this package registers the same way, in a module listed in
config.plugins.
"""
from bigpretrain import mixup
from bigpretrain.objectives import base
# The built-in objectives register themselves on import.
from bigpretrain.objectives import cosub  # pylint: disable=unused-import
from bigpretrain.objectives import multi_label  # pylint: disable=unused-import
from bigpretrain.objectives import semantic_kd  # pylint: disable=unused-import
from bigpretrain.objectives import semantic_softmax  # pylint: disable=unused-import
from bigpretrain.objectives import soft_target  # pylint: disable=unused-import
from bigpretrain.objectives import softmax  # pylint: disable=unused-import

register = base.OBJECTIVES.register


def names() -> list[str]:
  return base.OBJECTIVES.names()


def get_objective(cfg, info) -> base.Objective:
  """Builds the objective named by `cfg.name` (config.objective) for dataset `info`."""
  return base.OBJECTIVES.get(cfg.name)(cfg, info)


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
  if config.mixup is not None:
    mixup.check_config(config.mixup)
  if mixup_enabled(config.mixup):
    if not objective.soft_targets:
      raise ValueError(
          f"Objective {name!r} does not take soft targets, so mixup/cutmix "
          f"(config.mixup.mixup_alpha={config.mixup.mixup_alpha}, cutmix_alpha="
          f"{config.mixup.cutmix_alpha}) would train on mixed images against unmixed labels. "
          "Set both to 0, or use an objective that takes soft targets.")
    if getattr(objective, "bce_binarize", False) and config.mixup.label_smoothing > 0:
      raise ValueError(
          f"config.mixup.label_smoothing={config.mixup.label_smoothing} with "
          f"config.objective.bce_binarize=True: smoothed targets are all > 0, so binarising "
          "them makes every class positive. Set one of them off.")
    if getattr(objective, "label_smoothing", 0.0) > 0:
      raise ValueError(
          f"config.objective.label_smoothing={objective.label_smoothing} with mixup/cutmix on: "
          "the mixed targets are smoothed by config.mixup.label_smoothing; set that instead.")


def mixup_enabled(mixup_cfg) -> bool:
  return mixup_cfg is not None and (mixup_cfg.mixup_alpha > 0 or mixup_cfg.cutmix_alpha > 0)
