"""Every model family gives one device's loss, gradients and BatchNorm statistics on a mesh
with all three axes split (data:2,fsdp:2,tensor:2), parameters sharded by the default
sharding rules as the trainer shards them (the data-only and FSDP meshes are covered by
tests/test_train.py and the models' own tests).

A train-mode step on random weights (non-zero head and BatchNorm scales, so every block's
gradient is non-trivial); models are tiny so each case compiles in seconds.
"""
import functools
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bigpretrain import config_lib
from bigpretrain import sharding
from bigpretrain.models import mixer
from bigpretrain.models import mobilenet_v3
from bigpretrain.models import regnet
from bigpretrain.models import resnet
from bigpretrain.models import tresnet
from bigpretrain.models import vit

def _tiny_mobilenet_v3():
  """MobileNetV3 with three of its block types (depthwise, SE, ReLU and hard-swish), so it
  compiles in seconds."""
  blocks = [(3, 16, 16, False, "RE", 2), (3, 24, 16, True, "RE", 2),
            (3, 32, 16, True, "HS", 1)]
  with mock.patch.object(mobilenet_v3, "_LARGE", blocks):
    return mobilenet_v3.MobileNetV3(num_classes=6, rngs=nnx.Rngs(0), num_features=64)


_FAMILIES = {
    "vit": lambda: vit.VisionTransformer(num_classes=6, rngs=nnx.Rngs(0), patch_size=8,
                                         width=32, depth=2, num_heads=2, mlp_dim=64,
                                         image_size=32),
    # ResNeXt bottlenecks: grouped 3x3 convs (layers.batch_local_conv's shard_map path).
    "resnet": lambda: resnet.ResNet(num_classes=6, rngs=nnx.Rngs(0), stage_sizes=(1, 1),
                                    groups=2, width_per_group=8),
    # The demo RegNetY: grouped convs, SE, projection shortcuts (the model that diverged).
    "regnet": lambda: regnet.VARIANTS["regnety_demo"](num_classes=6, rngs=nnx.Rngs(0)),
    "tresnet": lambda: tresnet.TResNet(num_classes=6, rngs=nnx.Rngs(0), stage_sizes=(1, 1, 1, 1),
                                       width_factor=0.125),
    "mobilenet_v3": lambda: _tiny_mobilenet_v3(),
    "mixer": lambda: mixer.MlpMixer(num_classes=6, rngs=nnx.Rngs(0), patch_size=8, width=32,
                                    depth=2, tokens_mlp_dim=16, channels_mlp_dim=64,
                                    image_size=32),
}


def _random_state(build):
  """(graphdef, abstract params, params, rest): kernels N(0, 1/fan_in), BatchNorm / norm
  scales 1 + N(0, 0.1) (zero-initialised residual scales would hide the blocks' gradients),
  biases N(0, 0.1), running variances 1."""
  graphdef, params, rest = nnx.split(nnx.eval_shape(build), nnx.Param, ...)
  rs = np.random.RandomState(0)

  def fill(path, x):
    name = path[-1].key
    if len(x.shape) >= 2:
      return rs.normal(0, 1 / np.sqrt(np.prod(x.shape[:-1])), x.shape).astype(x.dtype)
    if name == "var":
      return np.ones(x.shape, x.dtype)
    if name == "mean":
      return np.zeros(x.shape, x.dtype)
    return (float(name == "scale") + rs.normal(0, 0.1, x.shape)).astype(x.dtype)

  fill_all = lambda s: jax.tree_util.tree_map_with_path(fill, nnx.to_pure_dict(s))
  return graphdef, params, fill_all(params), fill_all(rest)


def _step(graphdef, params, rest, images, labels):
  """Softmax cross-entropy of a train-mode forward: (loss, new rest), gradients."""
  def loss_fn(p):
    model = nnx.merge(graphdef, p, rest)
    logits = model(images, train=True, rng=jax.random.key(0))
    loss = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))
    return loss, nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
  return jax.value_and_grad(loss_fn, has_aux=True)(params)


def _errors(got, want) -> dict[str, float]:
  """Per-parameter max |got - want| over the larger of the parameter's and a 1e-2 share of
  the largest gradient (gradients that are zero in exact arithmetic are float noise)."""
  flat = jax.tree_util.tree_flatten_with_path(want)[0]
  floor = 1e-2 * max(float(np.abs(w).max()) for _, w in flat)
  return {jax.tree_util.keystr(path, simple=True, separator="/"):
          float(np.abs(np.asarray(g, np.float64) - w).max() / max(np.abs(w).max(), floor))
          for (path, w), g in zip(flat, jax.tree.leaves(got))}


# Grouped and depthwise convolution gradients compile slowly on XLA:CPU: the convnets are slow.
@pytest.mark.parametrize("family", [
    pytest.param(f, marks=pytest.mark.slow) if f in ("regnet", "resnet", "tresnet", "mobilenet_v3")
    else f for f in sorted(_FAMILIES)])
def test_tensor_parallel_mesh_matches_one_device(family):
  graphdef, abstract, params, rest = _random_state(_FAMILIES[family])
  rs = np.random.RandomState(1)
  images = rs.randn(16, 32, 32, 3).astype(np.float32)
  labels = rs.randint(0, 6, 16).astype(np.int32)
  step = jax.jit(functools.partial(_step, graphdef))
  (want_loss, want_rest), want_grads = step(params, rest, images, labels)
  rules = config_lib.base_config().sharding_rules
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  shardings = sharding.state_shardings(abstract, rules, mesh)
  # As the trainer traces its step: with the rules in force for the models' constraints.
  sharded = jax.jit(sharding.with_rules(functools.partial(_step, graphdef), rules))
  with jax.set_mesh(mesh):
    (loss, new_rest), grads = sharded(jax.device_put(params, shardings), rest,
                                   jax.device_put(images, sharding.batch_sharding(mesh)),
                                   jax.device_put(labels, sharding.batch_sharding(mesh)))
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  bad = {k: f"{v:.1e}" for k, v in _errors(grads, want_grads).items() if v > 1e-4}
  assert not bad, f"gradients differ from one device's: {bad}"
  for got, want in zip(jax.tree.leaves(new_rest), jax.tree.leaves(want_rest)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_vit_attention_on_tensor_moves_the_qkv_kernel_not_the_activation():
  """The fused qkv kernel's [q | k | v] columns, split over 'tensor' in contiguous chunks, cut
  across q, k and v: the step is to split its kernel by heads first (sharding.constrain), so
  no activation of the ViT's 17 tokens is all-gathered, only kernels."""
  build = lambda: vit.VisionTransformer(num_classes=6, rngs=nnx.Rngs(0), patch_size=8,
                                        width=64, depth=2, num_heads=4, mlp_dim=128,
                                        image_size=32)
  graphdef, abstract, params, rest = _random_state(build)
  rules = config_lib.base_config().sharding_rules
  mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 4})
  shardings = sharding.state_shardings(abstract, rules, mesh)
  step = jax.jit(sharding.with_rules(functools.partial(_step, graphdef), rules))
  images, labels = np.zeros((16, 32, 32, 3), np.float32), np.zeros((16,), np.int32)
  with jax.set_mesh(mesh):
    hlo = step.lower(jax.device_put(params, shardings), rest,
                     jax.device_put(images, sharding.batch_sharding(mesh)),
                     jax.device_put(labels, sharding.batch_sharding(mesh))).compile().as_text()
  gathered = re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", hlo)
  assert gathered and not [g for g in gathered if "17" in g.split(",")], gathered


def test_a_batch_shard_shared_by_processes_is_refused():
  # 2 processes, the batch over 1 device (tensor parallelism across them): each would stitch
  # its own rows into the one shard.
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": -1}, jax.devices()[:2])
  with mock.patch.object(jax, "process_count", return_value=2):
    with pytest.raises(ValueError, match="1 data-parallel devices .* the 2 processes"):
      sharding.check_batch_size(16, mesh)
  sharding.check_batch_size(16, mesh)  # One process: fine.


@pytest.mark.parametrize("fsdp, batch_size, name, message", [
    (3, 16, "--{}", r"--fsdp=3 must be a positive divisor of the 8 devices"),
    (0, 16, "--{}", r"--fsdp=0 must be a positive divisor"),
    (2, 0, "--{}", r"--batch_size=0 must be a positive integer"),
    (2, 12, "config.dedup.{}",
     r"config\.dedup\.batch_size=12 is not divisible by the 8 data-parallel devices "
     r"\(mesh data=4 x fsdp=2\)"),
])
def test_the_inference_mesh_names_the_settings_it_refuses(fsdp, batch_size, name, message):
  # The inference commands' flags (or the runner's sections), not the trainer's config keys.
  with pytest.raises(ValueError, match=message):
    sharding.inference_mesh(fsdp, batch_size, name)
  assert dict(sharding.inference_mesh(2, 16, name).shape) == {"data": 4, "fsdp": 2, "tensor": 1}
