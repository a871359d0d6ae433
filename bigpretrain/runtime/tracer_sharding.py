"""`Tracer.sharding` without the walk that makes tracing an NNX model quadratic in its size.

A JAX tracer has no concrete sharding, so `tracer.sharding` raises AttributeError (and
`getattr(x, 'sharding', None)` gives None). In the JAX this project pins, the error's message
first calls `_origin_msg()`, which walks every equation traced so far to say where the value
came from. Flax NNX probes `getattr(value, 'sharding', None)` on every `variable[...] = value`
(`Variable.set_value`): each parameter's RNG draw at init and each BatchNorm statistic update
in the train step, so tracing a model costs a walk of the program per variable. The same
behaviour made a large MaxText model slow to trace, and JAX removed the walk
(jax-ml/jax#40041; jax 0.12.0.1 raises the error without it).

`install()` gives `Tracer.sharding` that same AttributeError, only where the installed JAX
still builds the origin lines; nothing a traced program computes changes. The models package
installs it on import.
"""
from jax._src import core


def _sharding(self):
  # What JAX's own property raises, less the origin lines; hasattr()/getattr() still work.
  raise AttributeError(f"The 'sharding' attribute is not available on {self._error_repr()}.")


def needed() -> bool:
  """Whether this JAX's Tracer.sharding builds the origin message (its slow form)."""
  prop = core.Tracer.__dict__.get("sharding")
  return isinstance(prop, property) and "_origin_msg" in prop.fget.__code__.co_names


def install() -> None:
  """Replaces the slow Tracer.sharding (idempotent; a no-op on a JAX without it)."""
  if needed():
    core.Tracer.sharding = property(_sharding)
