"""The objective's own eval metrics over a whole split: every example counted once, on any
number of hosts (top-k, semantic top-1 on WordNet-labelled data, mAP for multi-label...)."""
import jax
import jax.numpy as jnp
import numpy as np

from bigpretrain import objectives
from bigpretrain import inference
from bigpretrain import sharding
from bigpretrain.evaluators import base
from bigpretrain.runtime import console
from input_pipeline import pipeline
from input_pipeline import subset


def make_eval_step(model_def, objective, shardings, mesh, normalize: str, topk):
  """(params, extra, batch) -> {name: totals} summed over the global batch (the objective's
  eval metrics; inference.make_step)."""
  return inference.make_step(model_def, shardings, mesh, normalize,
                             lambda module, batch: objective.eval_metrics(module, batch, topk))


def ratios(totals: dict) -> dict:
  """numerator / denominator of each scalar (num, den) entry with den > 0."""
  out = {}
  for k, value in totals.items():
    num, den = value
    if np.ndim(num) == 0 and den > 0:
      out[k] = float(num) / float(den)
  return out


@jax.jit
def _add(totals, out):
  """The running totals plus one batch's: one dispatch per batch, not one per metric."""
  return jax.tree.map(jnp.add, totals, out)


def evaluate(eval_step, state, dataset, data_cfg, mesh, *, split: str, batch_size: int,
             fields) -> tuple[dict, int, int]:
  """Sums `eval_step` over `split`: (host totals, corrupt records skipped on all processes,
  batches). ValueError when no record of the split could be read."""
  batches = pipeline.eval_iterator(
      subset.split_source(dataset, split), data_cfg, global_batch_size=batch_size,
      process_index=jax.process_index(), process_count=jax.process_count(), fields=fields)
  totals, skipped, read, count = None, 0, 0, 0
  for batch in batches:
    skipped += int(batch.pop("_skipped"))  # Corrupt records arrive as masked rows.
    read += int(np.sum(batch["mask"]))
    batch.pop("index", None)
    out = eval_step(state["params"], state["extra"], sharding.global_batch(batch, mesh))
    totals = out if totals is None else _add(totals, out)
    count += 1
  if totals is None:
    raise ValueError(f"Split {split!r} of {dataset.info.name!r} is empty.")
  skipped = inference.total_over_processes(skipped)
  if not inference.total_over_processes(read):
    raise ValueError(f"No record of split {split!r} of {dataset.info.name!r} could be read "
                     f"({skipped} corrupt or unreadable records skipped): check the data.")
  return jax.device_get(totals), skipped, count


def check_topk(name: str, topk) -> tuple[int, ...]:
  """config.evals.NAME.topk as a tuple; ValueError unless a non-empty tuple of ints >= 1."""
  topk = tuple(topk)
  if not topk or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1
                         for k in topk):
    raise ValueError(f"config.evals.{name}.topk={topk!r} must be a non-empty tuple of "
                     "ints >= 1.")
  return topk


def summarize(totals: dict, objective, skipped: int) -> dict:
  """A split's metrics from its summed totals: the ratios, the objective's own (e.g. mAP),
  the corrupt records skipped and the examples counted (also for ReaL labels)."""
  results = ratios(totals)
  results.update(objective.finalize_eval(totals))
  results["skipped_records"] = skipped
  for metric, count in (("top1", "num_examples"), ("real_top1", "num_real_examples")):
    if metric in totals:
      results[count] = float(totals[metric][1])
  return results


@base.EVALUATORS.register("classification")
class Classification(base.Evaluator):
  """Settings: topk (tuple of ints, default (1, 5)). Evaluating on another dataset needs the
  train dataset's class list (e.g. ImageNet-v2 for an ImageNet model)."""
  KEYS = ("topk",)

  def __init__(self, name, cfg, exp):
    super().__init__(name, cfg, exp)
    self.topk = check_topk(name, cfg.get("topk", (1, 5)))
    info, train_info = self.dataset.info, exp.dataset.info
    if info.class_names != train_info.class_names or info.num_classes != train_info.num_classes:
      raise ValueError(f"config.evals.{name}: dataset {info.name!r} has other classes than "
                       f"{train_info.name!r}; a classification eval needs the same class list.")
    over = [k for k in self.topk if k > info.num_classes]
    if over:
      console.warn(f"config.evals.{name}.topk {over} exceed the {info.num_classes} classes of "
                   f"{info.name!r}: k={info.num_classes} (every class) is reported in their "
                   "place.")
    missing = objectives.missing_fields(exp.objective, info)
    if missing:
      raise ValueError(f"config.evals.{name}: dataset {info.name!r} lacks the fields "
                       f"{missing} that objective {exp.config.objective.name!r} reads.")
    self.fields = objectives.batch_fields(exp.objective, info)
    self.objective = exp.objective
    self.exp = exp
    self.step = make_eval_step(exp.model_def, exp.objective, exp.shardings, exp.mesh,
                               exp.config.data.normalize, self.topk)

  def run(self, state) -> dict:
    config = self.exp.config
    totals, skipped, _ = evaluate(self.step, state, self.dataset, config.data, self.exp.mesh,
                                  split=self.split, batch_size=config.batch_size,
                                  fields=self.fields)
    results = summarize(totals, self.objective, skipped)
    return {f"{self.name}/{k}": v for k, v in results.items()}
