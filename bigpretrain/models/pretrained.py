"""Models from checkpoints that describe themselves (their 'meta' item): teachers, predict,
inference, zero-shot and weight export need nothing but the checkpoint's path."""
import dataclasses

from flax import nnx
import jax

from bigpretrain import checkpoint
from bigpretrain import models
from bigpretrain import sharding


@dataclasses.dataclass
class Loaded:
  """A checkpoint's model: its definition, {'params', 'extra'} arrays and meta."""
  model_def: object  # models.ModelDef
  variables: dict
  meta: dict
  shardings: dict | None = None  # Set when loaded onto a mesh.

  def module(self) -> nnx.Module:
    return self.model_def.merge(self.variables["params"], self.variables["extra"])


def load(path: str, *, mesh=None, rules=(), compute_dtype: str | None = None,
         step: int | None = None) -> Loaded:
  """Loads a run's workdir or checkpoint dir (its latest step, or `step`). With `mesh`,
  arrays are sharded by the logical `rules`; without, they land on the first local device.
  `compute_dtype` overrides the checkpoint's (a teacher computes in the student's
  precision)."""
  meta = checkpoint.read_meta(path, step)
  model_def = models.ModelDef.from_config(meta["model"], meta["num_classes"],
                                          compute_dtype or meta["compute_dtype"])
  abstract, shardings = abstract_variables(model_def, mesh, rules)
  return Loaded(model_def, checkpoint.load_params(path, abstract, step), meta, shardings)


def abstract_variables(model_def, mesh=None, rules=()) -> tuple[dict, dict | None]:
  """({'params', 'extra'} as ShapeDtypeStructs, their shardings): params sharded by the
  logical `rules` on `mesh`, extra replicated; without a mesh, unsharded and None."""
  abstract = {"params": model_def.abstract_pure_params(),
              "extra": model_def.abstract_pure_extra()}
  if mesh is None:
    return abstract, None
  shardings = {
      "params": sharding.state_shardings(model_def.abstract_params, rules, mesh),
      "extra": sharding.state_shardings(model_def.abstract_extra, (), mesh),
  }
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
  return abstract, shardings
