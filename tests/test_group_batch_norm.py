"""BatchNorm over groups of rows (model.bn_group_size): the semi-supervised recipe's "24 images
per GPU" statistics, independent of the mesh; 0 keeps whole-batch (synchronised) statistics."""
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from bigpretrain import config_lib
from bigpretrain import sharding
from bigpretrain.models import layers
from bigpretrain.models import resnet


def _numpy_group_bn(x, n, scale, bias, eps):
  """Each group of n rows normalised by its own mean and biased variance over (rows, H, W)."""
  g = x.reshape((-1, n) + x.shape[1:]).astype(np.float64)
  mean = g.mean(axis=(1, 2, 3), keepdims=True)
  var = g.var(axis=(1, 2, 3), keepdims=True)
  y = (g - mean) / np.sqrt(var + eps) * scale + bias
  return y.reshape(x.shape), mean.reshape(-1, x.shape[-1]), var.reshape(-1, x.shape[-1])


def test_layer_matches_numpy_per_group_batch_norm():
  rs = np.random.RandomState(0)
  x = (rs.randn(12, 3, 3, 5) * 2 + rs.randn(12, 1, 1, 5)).astype(np.float32)
  bn = layers.BatchNorm(5, momentum=0.9, epsilon=1e-5, rngs=nnx.Rngs(0))
  bn.scale[...] = scale = rs.uniform(0.5, 1.5, 5).astype(np.float32)
  bn.bias[...] = bias = rs.randn(5).astype(np.float32)
  layers.set_bn_group_size(bn, 4)
  y = bn(jnp.asarray(x), use_running_average=False)
  want, means, variances = _numpy_group_bn(x, 4, scale, bias, 1e-5)
  np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
  # Running averages move towards the mean over the 3 groups of their statistics.
  np.testing.assert_allclose(bn.mean[...], 0.1 * means.mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(bn.var[...], 0.9 + 0.1 * variances.mean(0), rtol=1e-5)
  # Evaluation reads the running averages, as without groups.
  y_eval = bn(jnp.asarray(x), use_running_average=True)
  want_eval = ((x - 0.1 * means.mean(0)) / np.sqrt(0.9 + 0.1 * variances.mean(0) + 1e-5)
               * scale + bias)
  np.testing.assert_allclose(y_eval, want_eval, rtol=1e-4, atol=1e-4)
  # The whole batch's statistics differ: the groups are what is normalised.
  layers.set_bn_group_size(bn, 0)
  assert np.abs(np.asarray(bn(jnp.asarray(x), use_running_average=False)) - want).max() > 0.05


def test_a_batch_the_group_does_not_divide_is_refused():
  bn = layers.BatchNorm(2, rngs=nnx.Rngs(0))
  layers.set_bn_group_size(bn, 4)
  with pytest.raises(ValueError, match="group size 4 does not divide the 6 rows"):
    bn(jnp.ones((6, 2, 2, 2)), use_running_average=False)
  config = config_lib.base_config()
  config.model = ml_collections.ConfigDict(dict(name="resnet50", bn_group_size=24))
  config.batch_size, config.total_steps = 100, 10
  with pytest.raises(ValueError, match="bn_group_size=24 must divide config.batch_size=100"):
    config_lib.validate(config)


def _tiny_resnet(group_size):
  return resnet.ResNet(num_classes=6, rngs=nnx.Rngs(0), stage_sizes=(1, 1), block="basic",
                       zero_init_residual=False, bn_group_size=group_size)


def _train_forward(graphdef, params, rest, images):
  model = nnx.merge(graphdef, params, rest)
  logits = model(images, train=True)
  return logits, nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))


def test_a_model_in_groups_equals_each_group_run_alone():
  """ResNet with bn_group_size 4 on 8 rows = the whole-batch ResNet on rows 0-3 and on rows
  4-7 (same weights); its running statistics are the mean of those two runs' (the update is
  linear in the batch statistics)."""
  images = np.random.RandomState(1).randn(8, 32, 32, 3).astype(np.float32)
  grouped = nnx.split(_tiny_resnet(4), nnx.Param, ...)
  plain = nnx.split(_tiny_resnet(0), nnx.Param, ...)
  params, rest = (nnx.to_pure_dict(s) for s in grouped[1:])
  logits, stats = _train_forward(grouped[0], params, rest, images)
  halves = [_train_forward(plain[0], params, rest, images[i:i + 4]) for i in (0, 4)]
  np.testing.assert_allclose(logits, np.concatenate([h[0] for h in halves]), rtol=1e-4,
                             atol=1e-5)
  for got, a, b in zip(*(jax.tree.leaves(t) for t in (stats, halves[0][1], halves[1][1]))):
    np.testing.assert_allclose(got, (np.asarray(a) + np.asarray(b)) / 2, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("axes", [{"data": 2, "fsdp": 2, "tensor": 2}, {"fsdp": 8}],
                         ids=["data2-fsdp2-tensor2", "fsdp8"])
def test_group_statistics_do_not_depend_on_the_mesh(axes):
  """16 rows in groups of 4 on 8 devices: 2 rows per device (a group spans two devices) or
  4 per data shard; outputs and statistics equal one device's."""
  graphdef, params, rest = nnx.split(_tiny_resnet(4), nnx.Param, ...)
  params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
  images = np.random.RandomState(2).randn(16, 32, 32, 3).astype(np.float32)
  step = jax.jit(functools.partial(_train_forward, graphdef))
  want_logits, want_stats = step(params, rest, images)
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1, **axes})
  with jax.set_mesh(mesh):
    logits, stats = step(params, rest, jax.device_put(images, sharding.batch_sharding(mesh)))
  np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-5)
  for got, want in zip(jax.tree.leaves(stats), jax.tree.leaves(want_stats)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
