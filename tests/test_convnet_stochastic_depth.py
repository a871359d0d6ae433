"""Stochastic depth in ResNet / RegNet residual blocks (cosub supplement Table B.1 trains
ResNet-152 and RegNet-16GF with cosub): rates per block, a dropped branch leaves exactly the
shortcut, eval ignores it, and the cosub configs build convnets with it. Tiny models."""
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bigpretrain.models import layers
from bigpretrain.models import regnet
from bigpretrain.models import resnet
from configs import cosub_in1k


def _tiny_resnet(rate, schedule="linear"):
  return resnet.ResNet(num_classes=5, rngs=nnx.Rngs(0), stage_sizes=(2, 1), block="basic",
                       drop_path_rate=rate, drop_path_schedule=schedule,
                       zero_init_residual=False)


def _tiny_regnet(rate):
  return regnet.RegNet(num_classes=5, rngs=nnx.Rngs(0), depth=3, w_0=16, w_a=8.0, w_m=2.0,
                       group_width=8, stem_width=8, drop_path_rate=rate,
                       drop_path_schedule="uniform", zero_init_residual=False)


def test_rates_per_block():
  assert _tiny_resnet(0.3).drop_path_rates == pytest.approx([0.0, 0.15, 0.3])  # Linear.
  assert _tiny_resnet(0.3, "uniform").drop_path_rates == [0.3] * 3
  assert [b.drop_path_rate for b in _tiny_resnet(0.3).blocks] == pytest.approx([0, 0.15, 0.3])
  model = _tiny_regnet(0.2)
  assert model.drop_path_rates == [0.2] * len(model.blocks)


@pytest.mark.parametrize("make", [lambda r: _tiny_resnet(r, "uniform"), _tiny_regnet])
def test_a_dropped_branch_leaves_the_shortcut(make):
  x = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
  rng = jax.random.key(1)
  model = make(1.0)  # Every branch dropped in training.
  out = model.features(x, train=True, rng=rng)
  for block in model.blocks:  # Branch weights no longer matter.
    first = block.conv1 if hasattr(block, "conv1") else block.conv_a
    first.kernel[...] = first.kernel[...] * 3.0 + 1.0
  model2 = make(1.0)
  nnx.update(model2, nnx.state(model))
  np.testing.assert_allclose(model2.features(x, train=True, rng=rng), out, rtol=1e-5,
                             atol=1e-5)
  # Eval mode runs every branch: the rate changes nothing there.
  plain = make(0.0)
  nnx.update(plain, nnx.state(model))
  np.testing.assert_allclose(model.features(x), plain.features(x), rtol=1e-6, atol=1e-6)
  assert not np.allclose(model.features(x), out, atol=1e-3)
  with pytest.raises(ValueError, match="rng"):
    model.features(x, train=True)


def test_partial_drop_is_per_sample_and_seeded():
  x = jax.random.normal(jax.random.key(0), (16, 8, 8, 3))
  model = _tiny_resnet(0.5, "uniform")
  a = model.features(x, train=True, rng=jax.random.key(3))
  b = model.features(x, train=True, rng=jax.random.key(3))
  np.testing.assert_array_equal(a, b)
  c = model.features(x, train=True, rng=jax.random.key(4))
  assert not np.allclose(a, c)
  # Kept rows are scaled by 1 / (1 - rate), dropped ones are 0.
  y = jnp.ones((16, 2, 2, 3))
  dropped = layers.drop_path(y, 0.5, layers.fold_rng(jax.random.key(3), 0))
  assert set(np.unique(np.asarray(dropped))) <= {0.0, 2.0}


def test_cosub_configs_build_convnets_with_stochastic_depth():
  config = cosub_in1k.get_config("dataset=tfds:imagenet2012,model=resnet152,tau=0.05")
  assert config.model.to_dict() == {"name": "resnet152", "drop_path_rate": 0.05,
                                    "drop_path_schedule": "uniform", "remat": "",
                                    "attention_impl": "auto", "head_dtype": "float32",
                                    "grouped_conv_impl": "xla", "pointwise_conv_impl": "xla"}
  with pytest.raises(ValueError, match="pass tau="):
    cosub_in1k.get_config("dataset=tfds:imagenet2012,model=regnety_16gf")
