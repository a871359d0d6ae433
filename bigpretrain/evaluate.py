"""Evaluation over a whole split: every example counted once, on any number of hosts."""
import jax

from bigpretrain import preprocess
from bigpretrain import sharding
from input_pipeline import pipeline


def make_eval_step(model_def, objective, shardings, mesh, normalize: str):
  """(params, extra, batch) -> {name: (numerator, denominator)} summed over the global batch;
  uint8 images are normalised by the `normalize` preset (config.data.normalize)."""

  def eval_step(params, extra, batch):
    batch = {**batch, "image": preprocess.normalize(batch["image"], normalize)}
    return objective.eval_metrics(model_def.merge(params, extra), batch)

  return jax.jit(eval_step,
                 in_shardings=(shardings["params"], shardings["extra"],
                               sharding.batch_sharding(mesh)),
                 out_shardings=sharding.replicated(mesh))


def evaluate(eval_step, state, dataset, config, mesh, split: str | None = None,
             objective=None) -> dict:
  """Runs `eval_step` over `split` (default config.data.eval_split).

  Returns numerator / denominator for each (num, den) metric, plus what the objective's
  optional `finalize_eval(totals)` derives from the summed totals (e.g. mAP from histograms).
  """
  split = split or config.data.eval_split
  batches = pipeline.eval_iterator(
      dataset.source(split), config.data, global_batch_size=config.batch_size,
      process_index=jax.process_index(), process_count=jax.process_count())
  totals, skipped = None, 0
  for batch in batches:
    skipped += int(batch.pop("_skipped"))  # Corrupt records arrive as masked rows.
    batch.pop("index", None)
    out = eval_step(state["params"], state["extra"], sharding.global_batch(batch, mesh))
    totals = out if totals is None else jax.tree.map(lambda a, b: a + b, totals, out)
  if totals is None:
    raise ValueError(f"Split {split!r} of {config.data.name!r} is empty.")
  totals = jax.device_get(totals)
  results = {k: float(num) / float(den) for k, (num, den) in totals.items()
             if k.startswith("eval/") and den > 0}
  if hasattr(objective, "finalize_eval"):
    results.update(objective.finalize_eval(totals))
  results["eval/skipped_records"] = skipped
  if "eval/top1" in totals:
    results["eval/num_examples"] = float(totals["eval/top1"][1])
  return results
