"""config.model.remat: every architecture's residual blocks rematerialised under a
jax.checkpoint_policies policy, with the same parameters, loss, gradients and BatchNorm
statistics as without, and the remat really in the differentiated program."""
import functools

from flax import nnx
import jax
import jax.numpy as jnp
from jax.extend import core as jax_core
import ml_collections
import numpy as np
import pytest

from bigpretrain import config_lib
from bigpretrain import models
from bigpretrain.models import base
from bigpretrain.models import layers
from bigpretrain.models import mixer
from bigpretrain.models import mobilenet_v3
from bigpretrain.models import regnet
from bigpretrain.models import resnet
from bigpretrain.models import submodel
from bigpretrain.models import tresnet
from bigpretrain.models import vit

# Tiny members of each family at 32 px: (factory(rngs) -> model, its residual blocks).
_FAMILIES = {
    "vit": (lambda rngs: vit.VisionTransformer(
        num_classes=5, rngs=rngs, patch_size=8, width=32, depth=2, num_heads=2, mlp_dim=64,
        image_size=32, drop_path_rate=0.5), 2),
    "vit_esd": (lambda rngs: vit.VisionTransformer(
        num_classes=5, rngs=rngs, patch_size=8, width=32, depth=2, num_heads=2, mlp_dim=64,
        image_size=32, drop_path_rate=0.5, stochastic_depth="esd"), 2),
    "regnety": (lambda rngs: regnet.RegNet(
        num_classes=5, rngs=rngs, depth=2, w_0=16, w_a=16.0, w_m=2.0, group_width=8,
        se_ratio=0.25, stem_width=8, drop_path_rate=0.2), 2),
    "resnext": (lambda rngs: resnet.ResNet(num_classes=5, rngs=rngs, stage_sizes=(1, 1),
                                           groups=2, width_per_group=16,
                                           drop_path_rate=0.2), 2),
    "resnet_basic": (lambda rngs: resnet.ResNet(num_classes=5, rngs=rngs, stage_sizes=(1, 1),
                                                block="basic", drop_path_rate=0.2), 2),
    "tresnet": (lambda rngs: tresnet.TResNet(num_classes=5, rngs=rngs, stage_sizes=(1, 1, 1, 1),
                                             width_factor=0.125), 4),
    "mixer": (lambda rngs: mixer.MlpMixer(num_classes=5, rngs=rngs, patch_size=8, width=32,
                                          depth=2, tokens_mlp_dim=16, channels_mlp_dim=32,
                                          image_size=32), 2),
    "mobilenet_v3": (lambda rngs: mobilenet_v3.MobileNetV3(num_classes=5, rngs=rngs), 15),
}
# Compiled in the fast lane; the rest of the gradient comparisons are marked slow.
_FAST = ("vit_esd", "resnext", "mixer")  # ESD's traced rng; BatchNorm statistics.


def _build(family: str, remat: str = ""):
  return base.remat_blocks(_FAMILIES[family][0](nnx.Rngs(0)), remat)


def _abstract(family: str, remat: str = ""):
  """(graphdef, params, rest) of the model as shapes: traced, nothing computed."""
  graphdef, params, extra = nnx.split(nnx.eval_shape(lambda: _build(family, remat)),
                                      nnx.Param, ...)
  return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(extra)


def _values(tree, seed: int, scale: float = 0.1):
  """Host-drawn values N(0, scale^2) for a tree of shapes: random heads and last BatchNorm
  scales (their inits are zero and would give the blocks zero gradients), nothing compiled."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: (scale * rng.standard_normal(x.shape)).astype(x.dtype), tree)


def _loss_fn(graphdef, extra, images, labels):
  def loss(params):
    model = nnx.merge(graphdef, params, extra)
    logits = model(images, train=True, rng=jax.random.key(7))
    value = -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(labels)), labels])
    return value, nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
  return loss


def _batch():
  images = np.random.default_rng(2).uniform(-1.0, 1.0, (4, 32, 32, 3)).astype(np.float32)
  return images, np.arange(4) % 5


def _remat_eqns(jaxpr) -> list:
  """The remat (jax.checkpoint) equations of a jaxpr, nested ones included."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("remat2", "checkpoint"):
      out.append(eqn)
    for sub in jax_core.jaxprs_in_params(eqn.params):
      out.extend(_remat_eqns(sub))
  return out


def _grad_jaxpr(family: str, remat: str):
  graphdef, params, extra = _abstract(family, remat)
  images, labels = _batch()
  grad = jax.grad(lambda p, e: _loss_fn(graphdef, e, images, labels)(p)[0])
  return jax.make_jaxpr(grad)(params, extra).jaxpr


def _shapes(tree):
  return jax.tree.map(lambda x: (x.shape, x.dtype), tree)


@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_parameters_and_state_are_those_without_remat(family):
  _, params, extra = _abstract(family)
  _, params_r, extra_r = _abstract(family, "nothing_saveable")
  for plain, remat in ((params, params_r), (extra, extra_r)):
    assert jax.tree.structure(remat) == jax.tree.structure(plain)  # The same names.
    assert _shapes(remat) == _shapes(plain)


@pytest.mark.parametrize("family", [f if f != "mobilenet_v3" else pytest.param(
    f, marks=pytest.mark.slow) for f in sorted(_FAMILIES)])
def test_each_block_is_rematerialised_in_the_gradient(family):
  assert not _remat_eqns(_grad_jaxpr(family, ""))
  eqns = _remat_eqns(_grad_jaxpr(family, "nothing_saveable"))
  assert len(eqns) == _FAMILIES[family][1]
  assert all(e.params["policy"] is jax.checkpoint_policies.nothing_saveable for e in eqns)


@pytest.mark.parametrize("family", [f if f in _FAST else pytest.param(f, marks=pytest.mark.slow)
                                    for f in sorted(_FAMILIES) if f != "mobilenet_v3"])
def test_loss_gradients_and_batch_statistics_equal_without_remat(family):
  """The same parameters and BatchNorm statistics through both models in one program."""
  images, labels = _batch()
  graphdef, params, extra = _abstract(family)
  graphdef_r = _abstract(family, "nothing_saveable")[0]
  params = _values(params, 0)
  extra = jax.tree.map(lambda x: x + 1.0, _values(extra, 1))  # Running variances > 0.

  @jax.jit
  def run(params, extra):
    return [jax.value_and_grad(_loss_fn(g, extra, images, labels), has_aux=True)(params)
            for g in (graphdef, graphdef_r)]

  ((loss, extra), grads), ((loss_r, extra_r), grads_r) = run(params, extra)
  np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
  assert jax.tree.structure(grads_r) == jax.tree.structure(grads)
  # Nearly every gradient is nonzero (a squeeze-excite's ReLU may zero a tiny squeeze's).
  nonzero = [bool(np.any(g)) for g in jax.tree.leaves(grads)]
  assert sum(nonzero) >= 0.9 * len(nonzero)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6),
               grads_r, grads)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-7),
               extra_r, extra)


def test_none_is_off():
  assert not _remat_eqns(_grad_jaxpr("vit", "none"))
  assert type(_build("mixer", "none").blocks[0]) is mixer.MixerBlock


def test_the_config_policy_reaches_the_blocks():
  model_def = models.ModelDef.from_config(
      ml_collections.ConfigDict(dict(name="vit_demo", remat="dots_saveable")), 5,
      image_size=32)
  plain_def = models.ModelDef.from_config(dict(name="vit_demo", remat=""), 5, image_size=32)
  params = model_def.abstract_pure_params()
  assert _shapes(params) == _shapes(plain_def.abstract_pure_params())
  images, _ = _batch()
  jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(
      model_def.merge(p, {})(images, train=True, rng=jax.random.key(0)))))(params).jaxpr
  eqns = _remat_eqns(jaxpr)
  assert len(eqns) == 4  # vit_demo's blocks.
  assert all(e.params["policy"] is jax.checkpoint_policies.dots_saveable for e in eqns)
  # A checkpoint's model config describes the weights, not how a run trained them.
  assert "remat" not in model_def.config() and model_def.config()["name"] == "vit_demo"


def test_a_bad_policy_fails_validation_naming_the_valid_ones():
  config = config_lib.base_config()
  config.total_steps = 1
  config.model.remat = "nothing_savable"
  with pytest.raises(ValueError, match="config.model.remat='nothing_savable'") as e:
    config_lib.validate(config)
  for name in layers.REMAT_POLICIES:
    assert name in str(e.value)
  with pytest.raises(ValueError, match="dots_with_no_batch_dims_saveable"):
    models.get_model("vit_demo", num_classes=5, rngs=nnx.Rngs(0), remat="full")


@pytest.mark.parametrize("remat", ["", "none", "dots_saveable"])
def test_good_policies_and_a_section_without_the_key_validate(remat):
  config = config_lib.base_config()
  config.total_steps = 1
  config.model.remat = remat
  config_lib.validate(config)
  config = config_lib.base_config()
  config.total_steps = 1
  config.model = dict(name="vit_demo")  # A recipe's own section: remat off.
  config_lib.validate(config)


@pytest.mark.parametrize("recipe", ["semantic_softmax", "single_label", "cosub_in21k",
                                    "swag_vit", "swag_regnety", "swag_finetune"])
def test_recipes_keep_the_key_settable_from_the_command_line(recipe):
  module = __import__(f"configs.{recipe}", fromlist=["get_config"])
  config = module.get_config()
  assert config.model.remat == ""
  config.model.remat = "nothing_saveable"  # What --config.model.remat=... sets.


def test_a_model_without_residual_blocks_is_refused():
  class Flat(base.Classifier):
    def __init__(self):
      self.blocks = None

  with pytest.raises(ValueError, match="no residual blocks"):
    base.remat_blocks(Flat(), "nothing_saveable")
  assert isinstance(base.remat_blocks(Flat(), "none"), Flat)


def test_layer_ablation_removes_rematerialised_blocks():
  model = nnx.eval_shape(lambda: _build("resnet_basic", "nothing_saveable"))
  assert type(model.blocks[0]).remat_of is resnet.BasicBlock
  assert submodel.removable(model) == [True, False]  # The second block is strided.
  submodel.remove_blocks(model, [0])
  assert isinstance(model.blocks[0], submodel.Removed)
