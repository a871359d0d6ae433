"""Classifier-head initialisation for fine-tuning from a hashtag model (SWAG, Singh et al.
2022, section 4.2: "initializes this linear classifier using the zero-shot transfer approach
described in Section 4.4 (without Platt scaling) before finetuning the full model").

The rule: with the class map of bigpretrain/swag/zero_shot.py (class c -> its hashtags H_c), the new
head's weights and bias for class c are the MEAN of the hashtag head's over H_c, so that the
initialised model's logit for c is exactly the mean of the hashtag logits over H_c, i.e.
zero_shot.aggregate(hashtag_logits, class_map, 'mean'). The paper aggregates hashtag
probabilities; a linear head can only reproduce a linear function of the hashtag logits, so
this averages logits: 'mean' is the paper's aggregation without Platt scaling, and 'max_split'
(its ViT aggregation) is not linear, so no head can reproduce it.
"""
from collections.abc import Sequence

import jax
import numpy as np

from bigpretrain import checkpoint
from bigpretrain import model_init
from bigpretrain.swag import zero_shot

KERNEL, BIAS = "params/head/kernel", "params/head/bias"


def zero_shot_head(kernel, bias, mapping: Sequence[Sequence[int]]) -> tuple[np.ndarray,
                                                                           np.ndarray]:
  """Hashtag head kernel [D, H] and bias [H] -> class head [D, C], [C]: column c is the mean
  of the hashtag columns mapping[c] (class -> hashtag ids, as zero_shot.class_map returns)."""
  kernel, bias = np.asarray(kernel, np.float32), np.asarray(bias, np.float32)
  if kernel.ndim != 2 or bias.shape != kernel.shape[1:]:
    raise ValueError(f"expected a head kernel [D, H] and bias [H], got {kernel.shape} and "
                     f"{bias.shape}")
  num_hashtags = kernel.shape[1]
  columns, biases = [], []
  for c, ids in enumerate(mapping):
    ids = np.asarray(ids, np.int64).reshape(-1)
    if not ids.size or ids.min() < 0 or ids.max() >= num_hashtags:
      raise ValueError(f"class {c}: hashtag ids {ids.tolist()} must be a non-empty list in "
                       f"[0, {num_hashtags})")
    columns.append(kernel[:, ids].mean(axis=1))
    biases.append(bias[ids].mean())
  if not columns:
    raise ValueError("the class map is empty")
  return np.stack(columns, axis=1), np.asarray(biases, np.float32)


@model_init.HOOKS.register("zero_shot")
def zero_shot_init(init_dir: str, params: dict, class_names: Sequence[str]) -> dict:
  """`params` (the model being fine-tuned, already loaded from init_dir) with its head set
  by zero_shot_head from init_dir's hashtag head; class_names are the target dataset's
  WordNet ids. Each new head array keeps the sharding of the one it replaces."""
  meta = checkpoint.read_meta(init_dir)
  hashtags = list(meta.get("class_names") or ())
  if not hashtags or not all("." in h for h in hashtags):
    raise ValueError(f"config.model_init_head='zero_shot' needs a hashtag model: the classes "
                     f"of {init_dir} ({hashtags[:3]}...) are not canonical hashtags "
                     "('crane.n.04+grus.n.01').")
  head = params.get("head", {})
  if "kernel" not in head or "bias" not in head:
    raise ValueError("config.model_init_head='zero_shot' needs a model whose classifier is "
                     f"params/head/{{kernel,bias}}; this one has {sorted(params)}")
  mapping = zero_shot.class_map(list(class_names), hashtags)  # Clear errors for non-wnids.
  saved = checkpoint.load_arrays(init_dir, [KERNEL, BIAS])
  kernel, bias = zero_shot_head(saved[KERNEL], saved[BIAS], mapping)
  if kernel.shape != head["kernel"].shape:
    raise ValueError(f"the zero-shot head has shape {kernel.shape}, the model's "
                     f"{head['kernel'].shape}: {init_dir} has another feature width")
  new_head = {**head,
              "kernel": jax.device_put(kernel.astype(head["kernel"].dtype),
                                       head["kernel"].sharding),
              "bias": jax.device_put(bias.astype(head["bias"].dtype), head["bias"].sharding)}
  print(f"Zero-shot head from {init_dir}: {len(mapping)} classes from "
        f"{len({i for ids in mapping for i in ids})} of {len(hashtags)} hashtags.", flush=True)
  return {**params, "head": new_head}
