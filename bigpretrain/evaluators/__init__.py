"""Evaluators: what runs on the model every few steps, named in `config.evals` (big_vision's
pattern). Each entry `config.evals.NAME = dict(type=..., every_steps=..., ...)` builds the
registered evaluator `type`; its results are logged under 'NAME/...'. A new kind of evaluation
is a module that calls `register(type, cls)`; the trainer does not change.
"""
from bigpretrain.evaluators import base
from bigpretrain.evaluators import classification
from bigpretrain.evaluators import fewshot

_REGISTRY: dict[str, type] = {}


def register(type_name: str, cls) -> None:
  """Makes `cls(name, cfg, exp)` (a base.Evaluator) selectable as evals.NAME.type=type_name."""
  if type_name in _REGISTRY and _REGISTRY[type_name] is not cls:
    raise ValueError(f"evaluator type {type_name!r} is already registered")
  _REGISTRY[type_name] = cls


def names() -> list[str]:
  return sorted(_REGISTRY)


def build(config, exp) -> list[base.Evaluator]:
  """The evaluators of config.evals, in name order; exp is the train.Experiment."""
  out = []
  for name in sorted(config.evals):
    cfg = config.evals[name]
    if not hasattr(cfg, "keys") or "type" not in cfg:
      raise ValueError(f"config.evals.{name} must be a section with a 'type' (one of "
                       f"{names()}), got {cfg!r}.")
    if cfg.type not in _REGISTRY:
      raise ValueError(f"config.evals.{name}.type={cfg.type!r} is unknown; known: {names()}.")
    out.append(_REGISTRY[cfg.type](name, cfg, exp))
  return out


register("classification", classification.Classification)
register("fewshot", fewshot.FewShot)
register("linear", fewshot.Linear)
