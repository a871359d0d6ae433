"""The inference engine: a model's eval-mode forward pass over a dataset, on the mesh.

`make_forward` jits (params, extra, batch) -> per-row outputs for a batch sharded over the
mesh's data axes; `forward_rows` runs it over a record source on any number of hosts. Teacher
predictions over a pool (pool_predictions.py), pooled features for few-shot probes and dedup,
and zero-shot scores are all this one forward with a different `outputs` function.
"""
import jax

from bigpretrain import preprocess
from bigpretrain import sharding
from input_pipeline import pipeline


def make_forward(model_def, shardings, mesh, normalize: str, outputs):
  """Jitted (params, extra, batch) -> replicated {**outputs(module, images), 'index',
  'mask'}: the eval-mode model on a batch sharded over the mesh's data axes. `outputs` maps
  the merged module and the normalised images to per-row arrays (top-P scores here, pooled
  features in bigpretrain.tools.dedup)."""

  def step(params, extra, batch):
    images = preprocess.normalize(batch["image"], normalize)
    return {**outputs(model_def.merge(params, extra), images),
            "index": batch["index"], "mask": batch["mask"]}

  return jax.jit(step, in_shardings=(shardings["params"], shardings["extra"],
                                     sharding.batch_sharding(mesh)),
                 out_shardings=sharding.replicated(mesh))


def forward_rows(step, variables: dict, source, data_cfg, *, batch_size: int, mesh):
  """Runs a make_forward step over `source` (every process its own slice, as
  pipeline.eval_iterator reads it); yields (rows, skipped) per batch: rows are the batch's
  real records as numpy arrays, the same on every process ('index' = position in `source`),
  skipped the corrupt records the pipeline dropped from the batch."""
  batches = pipeline.eval_iterator(source, data_cfg, global_batch_size=batch_size,
                                   process_index=jax.process_index(),
                                   process_count=jax.process_count(), fields={})
  for batch in batches:
    skipped = int(batch.pop("_skipped"))
    result = jax.device_get(step(variables["params"], variables["extra"],
                                 sharding.global_batch(batch, mesh)))
    keep = result.pop("mask") > 0
    yield {k: v[keep] for k, v in result.items()}, skipped
