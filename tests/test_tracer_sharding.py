"""Tracer.sharding without its origin walk (bigpretrain/runtime/tracer_sharding.py): the probe
Flax NNX makes on every variable assignment reads no traced equations, and it still fails
the way hasattr() and getattr() expect."""
from flax import nnx
import jax
from jax._src import core
from jax._src.interpreters import partial_eval as pe
import jax.numpy as jnp
import numpy as np
import pytest

from bigpretrain import models
from bigpretrain.runtime import tracer_sharding


def test_the_probe_fails_as_an_attribute_error_and_concrete_arrays_keep_theirs():
  assert not tracer_sharding.needed()  # Installed by the models package.
  seen = {}

  @jax.jit
  def f(x):
    seen["hasattr"] = hasattr(x, "sharding")
    seen["getattr"] = getattr(x, "sharding", None)
    with pytest.raises(AttributeError, match="'sharding' attribute is not available"):
      x.sharding  # pylint: disable=pointless-statement
    return x * 2

  x = jnp.arange(4.0)
  np.testing.assert_array_equal(f(x), [0.0, 2.0, 4.0, 6.0])
  assert seen == {"hasattr": False, "getattr": None}
  assert isinstance(x.sharding, jax.sharding.Sharding)


def test_install_replaces_the_slow_form_only(monkeypatch):
  def slow(self):
    raise AttributeError(f"no sharding.{self._origin_msg()}")

  monkeypatch.setattr(core.Tracer, "sharding", property(slow))
  assert tracer_sharding.needed()
  tracer_sharding.install()
  assert not tracer_sharding.needed()
  assert core.Tracer.__dict__["sharding"].fget is tracer_sharding._sharding


def test_tracing_a_batchnorm_model_walks_no_equations(monkeypatch):
  """Init under jit (an RNG draw per parameter) and a train forward (BatchNorm's statistics):
  each assigns NNX variables traced values; none of it reads the equations traced so far."""
  walks = []
  find = pe.JaxprStackFrame.find_progenitors
  monkeypatch.setattr(pe.JaxprStackFrame, "find_progenitors",
                      lambda self, t: walks.append(1) or find(self, t))

  def init_and_forward(images):
    model = models.get_model("resnet18", num_classes=10, rngs=nnx.Rngs(0))
    return model(images, train=True)

  traced = jax.jit(init_and_forward).trace(jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32))
  assert len(traced.jaxpr.eqns) > 500  # A whole ResNet-18's init and forward were traced.
  assert not walks
