"""Building blocks shared by the models: stochastic depth, LayerScale, MLP, init helpers."""
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Dtype = jnp.dtype | type


def gelu(x: jax.Array) -> jax.Array:
  """Exact (erf) GELU, as in the ViT/DeiT/Mixer reference models."""
  return jax.nn.gelu(x, approximate=False)


def partitioned(init, names: Sequence[str | None]):
  """Wraps an initializer so the created nnx.Param carries logical axis names."""
  return nnx.with_partitioning(init, tuple(names))


def drop_path_rates(rate: float, depth: int, schedule: str = "linear") -> list[float]:
  """Per-block stochastic-depth rates.

  'linear' (DeiT): block i gets rate * i / (depth - 1), so the first block is never dropped
  and the last one is dropped with `rate`. 'uniform' (cosub): every block gets `rate`.
  """
  if not 0.0 <= rate <= 1.0:
    raise ValueError(f"drop_path_rate must be in [0, 1], got {rate!r}")
  if schedule == "linear":
    if depth == 1:
      return [float(rate)]
    return [float(rate) * i / (depth - 1) for i in range(depth)]
  if schedule == "uniform":
    return [float(rate)] * depth
  raise ValueError(f"drop_path_schedule must be 'linear' or 'uniform', got {schedule!r}")


def drop_path(x: jax.Array, rate: float, rng: jax.Array) -> jax.Array:
  """Stochastic depth on one residual branch: zeroes whole rows (samples) with prob `rate`.

  Kept rows are scaled by 1 / (1 - rate) so the expectation is unchanged. `x` has the batch
  on axis 0; the same keep/drop decision applies to every other element of a row.
  """
  if rate <= 0.0:
    return x
  if rate >= 1.0:
    return jnp.zeros_like(x)
  keep_prob = 1.0 - rate
  keep = jax.random.bernoulli(rng, keep_prob, (x.shape[0],) + (1,) * (x.ndim - 1))
  return x * (keep.astype(x.dtype) / jnp.asarray(keep_prob, x.dtype))


def fold_rng(rng: jax.Array | None, *data: int) -> jax.Array | None:
  """`rng` with each of `data` folded in (None stays None): one key per block / branch."""
  if rng is None:
    return None
  for d in data:
    rng = jax.random.fold_in(rng, d)
  return rng


def check_rng(train: bool, rates: Sequence[float], rng: jax.Array | None, model: str):
  """Fails early when training with stochastic depth but no key was given."""
  if train and rng is None and any(r > 0.0 for r in rates):
    raise ValueError(
        f"{model}: train=True with drop_path_rate > 0 needs an explicit `rng` key "
        "(stochastic depth draws its randomness from the rng argument).")


class LayerScale(nnx.Module):
  """Per-channel learnable scale of a residual branch (CaiT / DeiT-III), init to a constant."""

  def __init__(self, dim: int, init_value: float, *, param_dtype: Dtype = jnp.float32):
    self.gamma = nnx.Param(jnp.full((dim,), init_value, param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    return x * self.gamma[...].astype(x.dtype)


class Mlp(nnx.Module):
  """Two linear layers with an activation in between (transformer / mixer MLP)."""

  def __init__(self, in_dim: int, hidden_dim: int, *, rngs: nnx.Rngs,
               names: tuple[str | None, str | None] = ("embed", "mlp"),
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32,
               activation=None):
    outer, inner = names
    kernel_init = nnx.initializers.xavier_uniform()
    bias_init = nnx.initializers.normal(1e-6)
    self.fc1 = nnx.Linear(in_dim, hidden_dim, kernel_init=partitioned(kernel_init, names),
                          bias_init=bias_init, dtype=dtype, param_dtype=param_dtype,
                          rngs=rngs)
    self.fc2 = nnx.Linear(hidden_dim, in_dim,
                          kernel_init=partitioned(kernel_init, (inner, outer)),
                          bias_init=bias_init, dtype=dtype, param_dtype=param_dtype,
                          rngs=rngs)
    self.activation = activation or gelu

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(self.activation(self.fc1(x)))
