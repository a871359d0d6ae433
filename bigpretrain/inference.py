"""The inference engine: a model's eval-mode forward pass over a dataset, on the mesh.

`make_forward` jits (params, extra, batch) -> per-row outputs for a batch sharded over the
mesh's data axes; `forward_rows` runs it over a record source on any number of hosts. Teacher
predictions over a pool (pool_predictions.py), pooled features for few-shot probes and dedup,
and zero-shot scores are all this one forward with a different `outputs` function.
"""
import jax
from jax.experimental import multihost_utils
import numpy as np

from bigpretrain import preprocess
from bigpretrain import sharding
from bigpretrain.runtime import console
from bigpretrain.runtime import distributed
from input_pipeline import pipeline


def make_step(model_def, shardings, mesh, normalize: str, fn):
  """The one jitted eval-mode step: (params, extra, batch) -> fn(module, batch), replicated.

  The batch is sharded over the mesh's data axes, its uint8 images normalised by the
  `normalize` preset (config.data.normalize) before `fn` sees them; `module` is the merged
  model. Evaluators sum metrics in `fn`, inference returns per-row outputs (make_forward).
  """

  def step(params, extra, batch):
    batch = {**batch, "image": preprocess.normalize(batch["image"], normalize)}
    return fn(model_def.merge(params, extra), batch)

  return jax.jit(step, in_shardings=(shardings["params"], shardings["extra"],
                                     sharding.batch_sharding(mesh)),
                 out_shardings=sharding.replicated(mesh))


def make_forward(model_def, shardings, mesh, normalize: str, outputs):
  """make_step returning per-row arrays: {**outputs(module, images), 'index', 'mask'}
  (top-P scores for pool predictions, pooled features for probes and dedup)."""
  return make_step(model_def, shardings, mesh, normalize, lambda module, batch: {
      **outputs(module, batch["image"]), "index": batch["index"], "mask": batch["mask"]})


def total_over_processes(count: int) -> int:
  """`count` (e.g. the corrupt records of this process's slice) summed over the processes;
  every process must call it alike."""
  if jax.process_count() == 1:
    return count
  return int(np.sum(multihost_utils.process_allgather(np.int64(count))))


def warn_of_shared_memory(data_cfg, batch_size: int) -> None:
  """Warns (the first process of each host) when the data workers of one pass of global
  batches of `batch_size` would not fit in the host's shared memory
  (pipeline.shared_memory_shortfall)."""
  on_host, first_on_host = distributed.processes_on_this_host()
  shortfall = pipeline.shared_memory_shortfall(data_cfg, batch_size // jax.process_count(),
                                               processes=on_host)
  if shortfall and first_on_host:
    console.warn(shortfall)


def forward_rows(step, variables: dict, source, data_cfg, *, batch_size: int, mesh,
                 fields=None):
  """Runs a per-row step (make_forward, or make_step returning a 'mask') over `source`, every
  process its own slice as pipeline.eval_iterator reads it, with the record `fields` the
  step reads; yields (rows, skipped) per batch: rows are the batch's real records as numpy
  arrays, the same on every process, sorted by 'index' (position in `source`) when the step
  returns it, so in one order for any process count; skipped the corrupt records the
  pipeline dropped from the batch (on all processes)."""
  batches = pipeline.eval_iterator(source, data_cfg, global_batch_size=batch_size,
                                   process_index=jax.process_index(),
                                   process_count=jax.process_count(), fields=fields or {})
  for batch in batches:
    skipped = total_over_processes(int(batch.pop("_skipped")))
    result = jax.device_get(step(variables["params"], variables["extra"],
                                 sharding.global_batch(batch, mesh)))
    keep = np.flatnonzero(result.pop("mask") > 0)
    if "index" in result:  # The hosts' rows interleave in the global batch.
      keep = keep[np.argsort(result["index"][keep], kind="stable")]
    yield {k: v[keep] for k, v in result.items()}, skipped
