"""Evaluators: what runs on the model every few steps, named in `config.evals` (big_vision's
pattern). Each entry `config.evals.NAME = dict(type=..., every_steps=..., ...)` builds the
registered evaluator `type`; its results are logged under 'NAME/...'. A new kind of evaluation
is a base.Evaluator subclass registered where it is defined (`@base.EVALUATORS.register(type)`,
in a module of this package or one listed in config.plugins); the trainer does not change.
"""
from bigpretrain.evaluators import base
# The built-in evaluators register themselves on import.
from bigpretrain.evaluators import classification  # pylint: disable=unused-import
from bigpretrain.evaluators import fewshot  # pylint: disable=unused-import
from bigpretrain.evaluators import hashtag_zero_shot  # pylint: disable=unused-import
from bigpretrain.evaluators import mapped  # pylint: disable=unused-import

register = base.EVALUATORS.register


def names() -> list[str]:
  return base.EVALUATORS.names()


def build(config, exp) -> list[base.Evaluator]:
  """The evaluators of config.evals, in name order; exp is the train.Experiment."""
  out = []
  for name in sorted(config.evals):
    cfg = config.evals[name]
    if not hasattr(cfg, "keys") or "type" not in cfg:
      raise ValueError(f"config.evals.{name} must be a section with a 'type' (one of "
                       f"{names()}), got {cfg!r}.")
    if cfg.type not in base.EVALUATORS:
      raise ValueError(base.EVALUATORS.unknown_message(cfg.type, f"config.evals.{name}.type"))
    out.append(base.EVALUATORS.get(cfg.type)(name, cfg, exp))
  return out
