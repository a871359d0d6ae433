"""Training objectives: what a step computes from a batch. One module per objective.

An objective is built once from its config section and the dataset info, and exposes
`loss(model, batch, rng, frozen) -> (loss, aux)` (traced inside the jitted train step; `model`
is the merged NNX module, `frozen` what the objective's optional `load_frozen(mesh, rules,
compute_dtype) -> (tree, shardings)` returned, e.g. a teacher's params) and
`eval_metrics(model, batch) -> {name: (numerator, denominator)}` (sums over the batch, padded
rows masked out).
"""
from bigpretrain.objectives import cosub
from bigpretrain.objectives import multi_label
from bigpretrain.objectives import semantic_kd
from bigpretrain.objectives import semantic_softmax
from bigpretrain.objectives import softmax

_REGISTRY = {
    "cosub": cosub.Cosub,
    "softmax": softmax.Softmax,
    "semantic_softmax": semantic_softmax.SemanticSoftmax,
    "semantic_kd": semantic_kd.SemanticKD,
    "multi_label": multi_label.MultiLabel,
}


def names() -> list[str]:
  return sorted(_REGISTRY)


def get_objective(cfg, info, topk=(1, 5)):
  """Builds the objective named by `cfg.name` (config.objective) for dataset `info`."""
  if cfg.name not in _REGISTRY:
    raise ValueError(f"config.objective.name={cfg.name!r} is unknown; known: {names()}.")
  return _REGISTRY[cfg.name](cfg, info, tuple(topk))
