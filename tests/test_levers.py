"""The step's levers as config values: config.model.attention_impl (the padded sequence cuDNN
needs gives the unpadded attention), config.model.head_dtype (a bfloat16 matmul summed in
float32) and config.model.grouped_conv_impl (batched GEMMs, or a convolution per group, give
the grouped convolution), all kernels only: the same parameters, refused where they do not
apply; MFU counts the model's FLOPs whatever the kernels compute."""
import functools

from flax import nnx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from benchmarks import accelerator
from bigpretrain.plan import aot_plan
from bigpretrain.plan import flops
from bigpretrain import config_lib
from bigpretrain import models
from bigpretrain.models import base as models_base
from bigpretrain.models import layers
from bigpretrain.models import pallas_conv
from bigpretrain.models import tresnet
from bigpretrain.models import vit
from tests import helpers


def _reference_attention(q, k, v):
  """softmax(q k^T / sqrt(d)) v per head in float64 numpy; [B, N, H, D] in and out."""
  q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
  s = np.einsum("bnhd,bmhd->bhnm", q, k) / np.sqrt(q.shape[-1])
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bhnm,bmhd->bnhd", p, v)


def test_padded_attention_is_the_unpadded_one():
  """197 tokens (ViT-B/16 at 224 px) padded to 198 with the pad masked out as keys: the same
  values and the same gradients as without padding."""
  q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 197, 2, 8))
  want = _reference_attention(q, k, v)
  for pad_to in (1, 2, 8):
    got = vit.attention(q, k, v, "xla", pad_to)
    assert got.shape == q.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  w = jax.random.normal(jax.random.key(1), q.shape)
  grad = lambda pad_to: jax.grad(
      lambda q, k, v: jnp.sum(w * vit.attention(q, k, v, "xla", pad_to)), (0, 1, 2))(q, k, v)
  for a, b in zip(grad(1), grad(2)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _eqns(jaxpr, primitive: str) -> list:
  """The equations of `primitive` in `jaxpr` and the jaxprs it calls."""
  found = []
  for eqn in jaxpr.eqns:
    found += [eqn] if eqn.primitive.name == primitive else []
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", param)
      if hasattr(inner, "eqns"):
        found += _eqns(inner, primitive)
  return found


def test_cudnn_vit_pads_its_tokens_once_with_the_unpadded_values(monkeypatch):
  """attention_impl='cudnn' pads ViT's odd token sequence (vit_demo at 32 px: 17 tokens) to
  an even length once, before the first block: every attention call sees 18 tokens and
  masks the pad as a key, and the logits and parameter gradients are those of the unpadded
  model. cuDNN needs a GPU, so its calls run XLA's kernel here, shapes recorded."""
  seen = []
  real = jax.nn.dot_product_attention

  def recording(q, k, v, *, implementation=None, **kw):
    seen.append((q.shape[1], implementation, kw.get("key_value_seq_lengths") is not None))
    return real(q, k, v, implementation="xla", **kw)

  def logits_and_grads(impl):
    model = models.get_model("vit_demo", num_classes=5, rngs=nnx.Rngs(0),
                             attention_impl=impl, drop_path_rate=0.1)
    images = jax.random.normal(jax.random.key(3), (4, 32, 32, 3))

    def loss(model):
      logits = model(images, train=True, rng=jax.random.key(4))
      return jnp.sum(logits * jnp.arange(5.0)), logits

    (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    forward = jax.make_jaxpr(lambda x: model(x, train=False))(images)
    pads = _eqns(forward.jaxpr, "pad")
    return logits, nnx.to_pure_dict(grads), pads

  monkeypatch.setattr(vit.jax.nn, "dot_product_attention", recording)
  want, want_grads, pads = logits_and_grads("xla")
  assert set(seen) == {(17, "xla", False)} and not pads
  seen.clear()
  got, got_grads, pads = logits_and_grads("cudnn")
  assert set(seen) == {(18, "cudnn", True)} and len(seen) == 2 * 4  # 4 blocks, traced twice.
  assert len(pads) == 1 and pads[0].outvars[0].aval.shape == (4, 18, 128)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               got_grads, want_grads)


def test_bf16_head_rounds_its_inputs_and_sums_in_float32():
  rngs = nnx.Rngs(0)
  head = layers.classifier_head(64, 11, param_dtype=jnp.float32, rngs=rngs,
                                kernel_init=nnx.initializers.normal(1.0))
  head.bias[...] = jax.random.normal(jax.random.key(2), (11,))
  x = jax.random.normal(jax.random.key(3), (4, 64))
  kernel, bias = np.asarray(head.kernel[...]), np.asarray(head.bias[...])
  f32 = head(x)
  np.testing.assert_allclose(f32, np.asarray(x, np.float64) @ kernel + bias, rtol=1e-5,
                             atol=1e-5)
  head.head_dtype = "bfloat16"
  got = head(x)
  bf16 = lambda a: np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float64)
  want = bf16(x) @ bf16(kernel) + bias  # Rounded inputs, exact sums, float32 bias.
  assert got.dtype == jnp.float32 and head.kernel[...].dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  # Not the float32 head: bf16's 8-bit significand shows in the logits.
  assert 1e-4 < np.abs(got - f32).max() < 0.1 * np.abs(f32).max()
  # The gradients: the logits' cotangent rounded too, float32 sums.
  g = jax.random.normal(jax.random.key(4), (4, 11))
  dx, dw = jax.grad(lambda x, w: jnp.sum(g * layers.bf16_matmul(x, w)), (0, 1))(
      x, head.kernel[...])
  assert dx.dtype == dw.dtype == jnp.float32
  np.testing.assert_allclose(dx, bf16(g) @ bf16(kernel).T, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(dw, bf16(x).T @ bf16(g), rtol=1e-5, atol=1e-4)


def test_levers_are_config_values_that_pick_kernels_only():
  config = helpers.tiny_config("semantic_softmax")
  config.model.attention_impl = "cudnn"
  config.model.head_dtype = "bfloat16"
  config_lib.validate(config)
  model_def = models.ModelDef.from_config(config.model, 10)
  plain = models.ModelDef.from_config({"name": "vit_demo"}, 10)
  # Same parameters; a checkpoint's model meta does not carry them.
  assert (jax.tree.map(jnp.shape, model_def.abstract_pure_params())
          == jax.tree.map(jnp.shape, plain.abstract_pure_params()))
  assert model_def.config() == {"name": "vit_demo"}
  model = model_def.merge(*model_def.create(jax.random.key(0)))
  assert {b.attn.attention_impl for b in model.blocks} == {"cudnn"}
  assert model.head.head_dtype == "bfloat16"
  for key, bad in (("attention_impl", "flash"), ("head_dtype", "float16")):
    bad_config = helpers.tiny_config("semantic_softmax")
    bad_config.model[key] = bad
    with pytest.raises(ValueError, match=f"config.model.{key}='{bad}' must be one of"):
      config_lib.validate(bad_config)
  with pytest.raises(ValueError, match="RegNet has no attention layers"):
    models.get_model("regnety_demo", num_classes=3, rngs=nnx.Rngs(0), attention_impl="cudnn")


@pytest.mark.parametrize("conv", [layers.conv_as_gemm, layers.conv_per_group,
                                  pallas_conv.conv_pallas])
@pytest.mark.parametrize("groups,per_group,out_per_group,kernel,stride,padding", [
    (3, 4, 5, 3, 1, ((1, 1), (1, 1))),  # RegNet's 3x3 grouped conv.
    (2, 8, 8, 3, 2, ((1, 1), (1, 1))),  # Its strided first block.
    (1, 3, 6, 1, 1, ((0, 0), (0, 0))),  # Ungrouped 1x1.
    (4, 2, 2, 3, 2, "SAME")])
def test_the_grouped_conv_impls_are_the_grouped_convolution(conv, groups, per_group,
                                                            out_per_group, kernel, stride,
                                                            padding):
  """grouped_conv_impl 'gemm' (conv_as_gemm), 'split' (conv_per_group) and 'pallas'
  (conv_pallas, its kernels interpreted): values and both gradients of
  jax.lax.conv_general_dilated's grouped convolution, to float32 rounding."""
  x = jax.random.normal(jax.random.key(0), (2, 9, 7, groups * per_group))
  w = jax.random.normal(jax.random.key(1), (kernel, kernel, per_group, groups * out_per_group))
  g = jax.random.normal(jax.random.key(2), (2, 9 // stride + 9 % stride, 7 // stride
                                            + 7 % stride, groups * out_per_group))

  def loss(conv, x, w):
    y = conv(x, w, (stride, stride), padding, dimension_numbers=("NHWC", "HWIO", "NHWC"),
             feature_group_count=groups, precision="highest")
    return jnp.sum(g * y), y

  (_, want), want_grads = jax.value_and_grad(
      functools.partial(loss, jax.lax.conv_general_dilated), (0, 1), has_aux=True)(x, w)
  (_, got), got_grads = jax.value_and_grad(
      functools.partial(loss, conv), (0, 1), has_aux=True)(x, w)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for a, b in zip(got_grads, want_grads):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
  with pytest.raises(ValueError, match="NHWC"):
    conv(x, w, (1, 1), padding, dimension_numbers=("NCHW", "HWIO", "NHWC"),
         feature_group_count=groups)
  if conv is not layers.conv_per_group:
    with pytest.raises(ValueError, match="undilated 2-D convolutions of NHWC"):
      conv(x, w, (1, 1), padding, rhs_dilation=(2, 2), feature_group_count=groups)
  if conv is pallas_conv.conv_pallas:
    with pytest.raises(ValueError, match="powers of two >= 16"):
      conv(x, w, (1, 1), padding, feature_group_count=groups, tiles=pallas_conv.Tiles(96))


@pytest.mark.parametrize("programs", [512, 54])
def test_pallas_conv_over_many_tiles_and_kernel_gradient_splits(monkeypatch, programs):
  """conv_pallas with 16-pixel tiles and 16-wide contraction chunks: 126 pixels (8 tiles or
  chunks, the last one short), 20 channels per group (2 chunks, the second one short), the
  kernel gradient's pixel splits (2 groups x 9 taps: 512 programs give 8 splits of one
  chunk, 54 give 3 splits of 3, 3 and 2 chunks); strided with SAME's uneven padding on 8 x 6
  images (the input gradient's 4 stride phases, 2 tiles each): XLA's values and gradients."""
  monkeypatch.setattr(pallas_conv, "KERNEL_GRAD_PROGRAMS", programs)
  w = jax.random.normal(jax.random.key(1), (3, 3, 20, 40)) / 8
  tiled = functools.partial(pallas_conv.conv_pallas, tiles=pallas_conv.Tiles(16, 16))
  for shape, stride in (((2, 9, 7, 40), 1), ((2, 8, 6, 40), 2)):
    x = jax.random.normal(jax.random.key(0), shape)

    def loss(conv, x, w, stride=stride):
      y = conv(x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
               feature_group_count=2, precision="highest")
      return jnp.sum(jnp.sin(y))

    want = jax.grad(functools.partial(loss, jax.lax.conv_general_dilated), (0, 1))(x, w)
    got = jax.grad(functools.partial(loss, tiled), (0, 1))(x, w)
    for a, b in zip(got, want):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape,groups,out_per_group,kernel,stride,padding", [
    ((2, 8, 6, 40), 2, 24, 3, 2, "SAME"),  # Uneven padding, short tiles and chunks.
    ((1, 9, 7, 40), 2, 24, 3, 1, "SAME"),
    ((1, 7, 7, 112), 1, 112, 3, 2, ((1, 1), (1, 1))),  # RegNetY's 112 channels as 128.
    ((1, 5, 5, 16), 1, 16, 1, 2, "VALID")])  # A strided 1x1.
def test_pallas_kernels_use_no_lane_out_of_bounds_and_write_each_output_once(
    monkeypatch, shape, groups, out_per_group, kernel, stride, padding):
  """On a GPU Triton loads and stores every lane its mask lets through at the indices as
  computed, and one out of bounds reads or writes another tensor's memory; the interpreter
  clips the indices (pallas_conv._indices), so the values alone cannot show a missing mask
  term. Here every lane each kernel uses, by its unclipped indices, is in bounds, and each
  element of each kernel's output (forward, input and kernel gradients; 54 programs: uneven
  kernel-gradient splits) is stored exactly once."""
  monkeypatch.setattr(pallas_conv, "KERNEL_GRAD_PROGRAMS", 54)
  outside, writes = [], {}

  def lanes(kind, ref_shape, rows, cols, mask):
    rows, cols = np.broadcast_arrays(np.asarray(rows)[:, None], np.asarray(cols)[None, :])
    rows, cols = rows[np.asarray(mask)], cols[np.asarray(mask)]
    bad = (rows < 0) | (rows >= ref_shape[0]) | (cols < 0) | (cols >= ref_shape[1])
    outside.extend([kind] * int(bad.sum()))
    if kind == "store":
      np.add.at(writes.setdefault(ref_shape, np.zeros(ref_shape, int)), (rows, cols), 1)

  gather, scatter = pallas_conv._gather, pallas_conv._scatter  # pylint: disable=protected-access

  def checked_gather(ref, rows, cols, mask, interpret):
    jax.debug.callback(functools.partial(lanes, "load", ref.shape), rows, cols, mask)
    return gather(ref, rows, cols, mask, interpret)

  def checked_scatter(ref, rows, cols, value, mask, interpret):
    # Under the interpreter each output has one extra last row (see _scatter).
    ref_shape = (ref.shape[0] - 1, ref.shape[1])
    jax.debug.callback(functools.partial(lanes, "store", ref_shape), rows, cols, mask)
    return scatter(ref, rows, cols, value, mask, interpret)

  monkeypatch.setattr(pallas_conv, "_gather", checked_gather)
  monkeypatch.setattr(pallas_conv, "_scatter", checked_scatter)
  x = jax.random.normal(jax.random.key(0), shape)
  w = jax.random.normal(jax.random.key(1), (kernel, kernel, shape[3] // groups,
                                            groups * out_per_group))
  y, vjp = jax.vjp(lambda x, w: pallas_conv.conv_pallas(
      x, w, (stride, stride), padding, dimension_numbers=("NHWC", "HWIO", "NHWC"),
      feature_group_count=groups, tiles=pallas_conv.Tiles(16, 16)), x, w)
  jax.effects_barrier()
  assert len(writes) == 1 and all((n == 1).all() for n in writes.values())
  writes.clear()
  vjp(jnp.ones_like(y))
  jax.effects_barrier()
  assert len(writes) == 2 and all((n == 1).all() for n in writes.values())
  assert not outside


def test_pallas_conv_products_take_the_precision_asked_for():
  """conv_pallas's products (all three kernels', in the CUDA and the interpreted branch) at
  the `precision` given, as XLA's convolution: on a GPU, float32 at 'highest' is exact where
  the default is TF32."""
  x, w = jnp.ones((1, 4, 4, 8)), jnp.ones((3, 3, 4, 8))
  for precision, highest in ((None, 0), ("highest", 6)):
    loss = lambda x, w, precision=precision: pallas_conv.conv_pallas(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=2, precision=precision, tiles=pallas_conv.Tiles(16, 16)).sum()
    text = str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, w))
    assert text.count("dot_general") == 6
    assert text.count("precision=(Precision.HIGHEST, Precision.HIGHEST)") == highest


def test_grouped_conv_impl_picks_the_kernel_of_grouped_convs_only():
  """model.grouped_conv_impl 'gemm' / 'split' / 'pallas' on regnety_demo: its grouped 3x3
  convs (and no other conv) compute as GEMMs / per group / by the Pallas kernels, with the
  same logits and gradients as 'xla' and the same parameters."""
  def build(impl):
    return models.get_model("regnety_demo", num_classes=5, rngs=nnx.Rngs(0),
                            grouped_conv_impl=impl)

  xla = build("xla")
  convs = lambda m: [c for _, c in nnx.iter_graph(m) if isinstance(c, nnx.Conv)]
  images = jax.random.normal(jax.random.key(3), (4, 32, 32, 3))

  def loss(model):
    logits = model(images, train=False)
    return jnp.sum(logits * jnp.arange(5.0)), logits

  (_, want), want_grads = nnx.value_and_grad(loss, has_aux=True)(xla)
  for impl, fn in (("gemm", layers.batch_local_gemm_conv),
                   ("split", layers.batch_local_split_conv),
                   ("pallas", layers.batch_local_pallas_conv)):
    other = build(impl)
    picked = [c.conv_general_dilated is fn for c in convs(other)]
    assert picked == [c.feature_group_count > 1 for c in convs(xla)] and any(picked), impl
    (_, got), got_grads = nnx.value_and_grad(loss, has_aux=True)(other)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5),
                 nnx.to_pure_dict(got_grads), nnx.to_pure_dict(want_grads))
    assert (jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(other, nnx.Param)))
            == jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(xla, nnx.Param))))


@pytest.mark.parametrize("stride,padding", [(1, "SAME"), (2, "SAME"), (2, "VALID"),
                                            (2, ((0, 0), (0, 0)))])
def test_pointwise_as_gemm_is_the_1x1_convolution(stride, padding):
  """pointwise_conv_impl 'gemm' (pointwise_as_gemm): values and both gradients of
  jax.lax.conv_general_dilated's 1x1 convolution (strided over odd sizes too), to float32
  rounding, also under an 8-device batch split; anything but an unpadded, undilated,
  ungrouped 1x1 convolution is refused."""
  x = jax.random.normal(jax.random.key(0), (8, 9, 7, 6))
  w = jax.random.normal(jax.random.key(1), (1, 1, 6, 10))
  g = jax.random.normal(jax.random.key(2), (8, 9 // stride + 9 % stride, 7 // stride
                                            + 7 % stride, 10))

  def loss(conv, x, w):
    y = conv(x, w, (stride, stride), padding, dimension_numbers=("NHWC", "HWIO", "NHWC"),
             precision="highest")
    return jnp.sum(g * y), y

  (_, want), want_grads = jax.value_and_grad(
      functools.partial(loss, jax.lax.conv_general_dilated), (0, 1), has_aux=True)(x, w)
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  for conv in (layers.pointwise_as_gemm, layers.batch_local_pointwise_conv):
    with jax.set_mesh(mesh):  # Rows split over all 8 devices (batch_local_conv's case).
      xs = jax.device_put(x, jax.sharding.PartitionSpec(("data", "fsdp")))
      (_, got), got_grads = jax.jit(jax.value_and_grad(
          functools.partial(loss, conv), (0, 1), has_aux=True))(xs, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
  # The same FLOPs for MFU (bigpretrain.plan.flops): no product of the stride's zeros.
  count = lambda conv: flops.jaxpr_flops(jax.make_jaxpr(jax.grad(
      lambda x, w: loss(conv, x, w)[0], (0, 1)))(x, w).jaxpr)
  assert count(layers.pointwise_as_gemm) == count(jax.lax.conv_general_dilated) > 0
  dims = ("NHWC", "HWIO", "NHWC")
  for bad in (dict(rhs=jnp.ones((3, 3, 6, 10))), dict(padding=((1, 1), (1, 1))),
              dict(rhs=jnp.ones((1, 1, 3, 10)), feature_group_count=2),
              dict(rhs_dilation=(2, 2)), dict(dimension_numbers=("NCHW", "HWIO", "NHWC"))):
    args = {"lhs": x, "rhs": w, "window_strides": (1, 1), "padding": "SAME",
            "dimension_numbers": dims, **bad}
    with pytest.raises(ValueError, match="ungrouped, undilated, unpadded 1x1"):
      layers.pointwise_as_gemm(**args)


_CONVNETS = {  # Small ones with 1x1 convolutions (ResNet's are TResNet's kinds).
    "regnet": lambda impl: models.get_model("regnety_demo", num_classes=5, rngs=nnx.Rngs(0),
                                            pointwise_conv_impl=impl),
    "tresnet": lambda impl: models_base.set_kernels(tresnet.TResNet(
        num_classes=5, rngs=nnx.Rngs(0), stage_sizes=(1, 1, 1, 1), width_factor=0.125),
        pointwise_conv_impl=impl)}


@pytest.mark.parametrize("family", sorted(_CONVNETS))
def test_pointwise_conv_impl_picks_the_1x1_convs_only(family):
  """model.pointwise_conv_impl 'gemm': exactly the ungrouped 1x1 convs (projections,
  shortcuts, Squeeze-Excitation) compute as GEMMs, with the same logits, gradients and
  parameters as 'xla'."""
  xla, gemm = _CONVNETS[family]("xla"), _CONVNETS[family]("gemm")
  convs = lambda m: [c for _, c in nnx.iter_graph(m) if isinstance(c, nnx.Conv)]
  want_picked = [c.kernel_size == (1, 1) and c.feature_group_count == 1 for c in convs(xla)]
  picked = [c.conv_general_dilated is layers.batch_local_pointwise_conv for c in convs(gemm)]
  assert picked == want_picked and any(picked) and not all(picked)
  images = jax.random.normal(jax.random.key(3), (4, 32, 32, 3))

  def loss(model):
    logits = model(images, train=True)
    return jnp.sum(logits * jnp.arange(5.0)), logits

  grad = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
  (_, want), want_grads = grad(xla)
  (_, got), got_grads = grad(gemm)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5),
               nnx.to_pure_dict(got_grads), nnx.to_pure_dict(want_grads))
  assert (jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(gemm, nnx.Param)))
          == jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(xla, nnx.Param))))


@pytest.mark.parametrize("key,impls,bad,refusal", [
    ("grouped_conv_impl", ("gemm", "split", "pallas"), "im2col",
     "has no grouped convolutions of more than one channel"),
    ("pointwise_conv_impl", ("gemm",), "cublas", "has no ungrouped 1x1 convolutions")])
def test_conv_forms_are_config_values_a_vit_refuses(key, impls, bad, refusal):
  for impl in impls:
    with pytest.raises(ValueError, match=f"{key}='{impl}': VisionTransformer {refusal}"):
      models.get_model("vit_demo", num_classes=3, rngs=nnx.Rngs(0), **{key: impl})
  config = helpers.tiny_config("semantic_softmax")
  config.model[key] = bad
  with pytest.raises(ValueError, match=f"config.model.{key}='{bad}' must be one"):
    config_lib.validate(config)
  assert models.ModelDef.from_config({"name": "regnety_demo", key: impls[0]},
                                     5).config() == {"name": "regnety_demo"}


@pytest.mark.parametrize("name,platform,dtype,kernel", [
    ("vit_demo", "gpu", "bfloat16", "cudnn"), ("vit_demo", "cuda", "float16", "cudnn"),
    ("vit_demo", "gpu", "float32", "xla"),  # cuDNN's fused kernel takes 16-bit inputs only.
    ("vit_demo", "cpu", "bfloat16", "xla"), ("vit_demo", "tpu", "bfloat16", "xla"),
    ("regnety_demo", "gpu", "bfloat16", "xla")])  # No attention layers: nothing to fuse.
def test_auto_attention_is_cudnn_on_gpus_in_16_bit_else_xla(name, platform, dtype, kernel):
  """The configs' default, attention_impl='auto', resolved for the devices' platform: the
  kernel in the model definition and in every attention layer of the built model."""
  assert config_lib.base_config().model.attention_impl == "auto"
  for model_cfg in ({"name": name, "attention_impl": "auto"}, {"name": name}):
    model_def = models.ModelDef.from_config(model_cfg, 10, dtype, platform=platform)
    assert model_def.kwargs["attention_impl"] == kernel, model_cfg
  model = model_def.merge(*model_def.create(jax.random.key(0)))
  layers_ = [m for _, m in nnx.iter_graph(model) if hasattr(type(m), "attention_impl")]
  assert {m.attention_impl for m in layers_} == ({kernel} if name == "vit_demo" else set())
  assert model_def.config() == {"name": name}  # Not in a checkpoint's meta.
  if platform == "cpu":  # get_model resolves it for JAX's default backend, this CPU.
    built = models.get_model(name, num_classes=10, rngs=nnx.Rngs(0), attention_impl="auto",
                             dtype=jnp.dtype(dtype))
    assert {m.attention_impl for _, m in nnx.iter_graph(built)
            if hasattr(type(m), "attention_impl")} == {"xla"}


def test_mfu_counts_the_model_flops_not_the_cudnn_pad_token(monkeypatch):
  """attention_impl='cudnn' runs vit_demo's 5 tokens (16 px) as 6 through every block; the
  step's FLOPs for MFU are the model's, those of the step with XLA's kernels. (cuDNN's calls
  run XLA's kernel here, as above.)"""
  real = jax.nn.dot_product_attention
  monkeypatch.setattr(vit.jax.nn, "dot_product_attention",
                      lambda *a, implementation=None, **kw: real(*a, implementation="xla", **kw))
  config = helpers.tiny_config("semantic_softmax")
  config.data.image_size = 16
  config.batch_size = 8
  counted = {}
  for impl in ("xla", "cudnn"):
    config.model.attention_impl = impl
    exp, state, traced = aot_plan.trace_step(config)
    assert exp.model_def.kwargs["attention_impl"] == impl
    counted[impl] = (flops.traced_flops_per_device(traced, exp.mesh.size),
                     exp.model_flops_per_device(state, aot_plan.abstract_batch(exp), traced))
  assert counted["xla"][0] == counted["xla"][1] == counted["cudnn"][1]
  assert counted["cudnn"][0] > 1.1 * counted["xla"][0]  # 6 tokens for 5 in every GEMM.


@pytest.mark.parametrize("recipe,model,classes,key,values", [
    ("semantic_softmax", "vit_demo", None, "remat", ("", "nothing_saveable")),
    ("swag_regnety", "regnety_demo", 100, "grouped_conv_impl", ("xla", "pallas"))])
def test_plan_flops_are_the_model_flops_whatever_the_remat_or_kernel(recipe, model, classes,
                                                                     key, values):
  """MFU's FLOPs (PaLM, appendix B) leave out a rematerialised block's second forward and
  count a Pallas kernel's work as the model's; the traced step itself counts otherwise."""
  config = helpers.tiny_config(recipe)
  config.model.name, config.data.image_size, config.batch_size = model, 32, 8
  planned, traced = [], []
  for value in values:
    config.model[key] = value
    planned.append(aot_plan.step_flops(config, classes)["flops_per_device"])
    exp, _, t = aot_plan.trace_step(config, classes)
    traced.append(flops.traced_flops_per_device(t, exp.mesh.size))
  assert planned[0] == planned[1] == traced[0] > 0
  assert traced[1] != traced[0]


def test_head_flops_are_six_b_d_c_of_the_step():
  """The suite's head share: the products over the classes in the train step's jaxpr are the
  head's forward and its two gradients, 3 x 2 x B x D x C."""
  config = helpers.tiny_config("semantic_softmax")
  config.data.image_size = 16
  config.batch_size = 8
  exp, _, traced = aot_plan.trace_step(config)
  classes = exp.dataset.info.num_classes
  width = 128  # vit_demo's.
  assert accelerator.head_flops(traced.jaxpr, classes) == 6 * 8 * width * classes
