"""Predictions of a trained run on image files, in the paper's semantic view (ImageNet-21K
paper, Figure 1): the library of `python -m bigpretrain.tools.predict`.

For each image: the model's answer (one class, by the training objective's `answer` rule:
hierarchical for semantic and multi-label models) and, on WordNet-labelled classes, each
hierarchy level whose top probability exceeds a threshold, with WordNet names
(bigpretrain/semantic/view.py); datasets whose classes are not WordNet synsets get the top-5
classes. The forward pass is the inference engine's (inference.make_step), on all devices.
"""
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from bigpretrain import config_lib
from bigpretrain import inference
from bigpretrain import objectives
from bigpretrain import sharding
from bigpretrain.models import pretrained
from bigpretrain.objectives import base
from bigpretrain.semantic import view
from input_pipeline import augment_spec
from input_pipeline import datasets
from input_pipeline import decoding

_BATCH = 64  # Images per forward pass (rounded up to whole rows per device).


def expand_paths(args) -> list[str]:
  """Files as given; a folder -> its image files (recursive, sorted, non-image extensions
  and hidden entries left out)."""
  out = []
  for arg in args:
    if not os.path.isdir(arg):
      out.append(arg)
      continue
    for root, dirs, files in os.walk(arg):
      dirs[:] = sorted(d for d in dirs if not d.startswith("."))
      out += [os.path.join(root, f) for f in sorted(files)
              if not f.startswith(".") and not decoding.is_non_image(f)]
  return out


def load_image(path: str, data_cfg) -> np.ndarray:
  """Decodes and resizes like the eval pipeline; uint8 [S, S, 3]. `data_cfg` has eval_resize
  and image_size (a checkpoint's meta['data']). Errors: OSError, CorruptImageError."""
  with open(path, "rb") as f:
    image = decoding.open_image(f.read())
  return np.asarray(
      augment_spec.eval_resize_op(data_cfg["eval_resize"])(image, data_cfg["image_size"]))


def predict(workdir: str, paths, threshold: float = 0.5) -> list[dict]:
  """One result per path, in order: {'image', 'answer', 'levels'} or {'image', 'top5'}, or
  {'image', 'error'} for a file that cannot be read or decoded."""
  mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
  loaded = pretrained.load(workdir, mesh=mesh, rules=config_lib.base_config().sharding_rules)
  meta, variables = loaded.meta, loaded.variables
  try:  # Said once, naming the checkpoint, not for every image.
    augment_spec.eval_resize_op(meta["data"]["eval_resize"])
  except ValueError as e:
    raise ValueError(f"{workdir}'s meta: {e}") from None
  step = inference.make_step(loaded.model_def, loaded.shardings, mesh,
                             meta["data"]["normalize"],
                             lambda module, batch: module(batch["image"], train=False))
  batch_size = -(-_BATCH // mesh.size) * mesh.size  # Whole rows per device.
  names = meta["class_names"] or [str(c) for c in range(meta["num_classes"])]
  sigmoid = meta["objective"].get("name") == "multi_label"
  info = datasets.DatasetInfo(meta["dataset"], meta["num_classes"], names, {}, None, ())
  objective = objectives.get_objective(ml_collections.ConfigDict(meta["objective"]), info)
  objective.restore_meta(meta)  # The class tree the model was trained on, when stored.
  tree = objective.tree
  if tree is None:  # E.g. multi_label on id lists: the per-level view of wnid classes.
    tree = base.class_tree(names, required=False)

  results, good, images = [], [], []
  for path in paths:
    try:
      images.append(load_image(path, meta["data"]))
    except (OSError, decoding.CorruptImageError) as e:
      reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
      results.append({"image": path, "error": reason})
      continue
    good.append(len(results))
    results.append(None)
  for start in range(0, len(images), batch_size):
    chunk = np.stack(images[start:start + batch_size])
    padded = np.zeros((batch_size, *chunk.shape[1:]), chunk.dtype)
    padded[:len(chunk)] = chunk
    logits = np.asarray(jax.device_get(step(
        variables["params"], variables["extra"],
        sharding.global_batch({"image": padded}, mesh))))[:len(chunk)]
    answers = np.asarray(objective.answer(jnp.asarray(logits)))
    for slot, row, answer in zip(good[start:start + batch_size], logits, answers):
      path = paths[slot]
      if tree is not None:
        c = int(np.argmax(answer))
        results[slot] = {"image": path,
                         "answer": {"class": c, "wnid": tree.wnids[c],
                                    "name": view.synset_name(tree.wnids[c]),
                                    "prob": float(answer[c])},
                         "levels": view.semantic_view(row, tree, sigmoid, threshold)}
      else:
        top = np.argsort(-row)[:5]
        results[slot] = {"image": path, "top5": [{"class": int(c), "name": names[c]}
                                                 for c in top]}
  return results
