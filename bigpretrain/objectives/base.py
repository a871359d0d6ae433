"""Shared pieces of the objectives: config checking and top-k classification metrics."""
import jax.numpy as jnp


def check_keys(cfg, allowed: set[str]) -> None:
  """Rejects unknown keys in config.objective, naming them."""
  unknown = sorted(set(cfg.keys()) - allowed - {"name"})
  if unknown:
    raise ValueError(f"config.objective ({cfg.name}) has unknown keys {unknown}; "
                     f"allowed: {sorted(allowed)}.")


def topk_metrics(logits, labels, mask, topk=(1, 5)) -> dict:
  """{'eval/top{k}': (num_correct, num_examples)} over rows with mask 1."""
  out = {}
  order = jnp.argsort(-logits, axis=-1)
  for k in topk:
    k = min(k, logits.shape[-1])
    hit = jnp.any(order[:, :k] == labels[:, None], axis=-1)
    out[f"eval/top{k}"] = (jnp.sum(hit * mask), jnp.sum(mask))
  return out


def eval_mask(batch, batch_size: int):
  return batch["mask"] if "mask" in batch else jnp.ones((batch_size,), jnp.float32)
