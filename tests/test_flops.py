"""bigpretrain/plan/flops.py: FLOPs counted on the jaxpr, against hand formulas, XLA:CPU's own
count (which, unlike XLA:GPU's, includes matrix products and convolutions), jax's roofline
rules and every model family's published forward multiply-adds."""
from flax import nnx
import jax
from jax.experimental import roofline
import jax.numpy as jnp
import numpy as np
import pytest

from bigpretrain import models
from bigpretrain.models import pallas_conv
from bigpretrain.plan import accelerators
from bigpretrain.plan import flops


def _count(f, *args):
  return flops.jaxpr_flops(jax.jit(f).trace(*args).jaxpr)


def _xla_cpu(f, *args):
  cost = jax.jit(f).lower(*args).compile().cost_analysis()
  return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


def _conv(x, k, groups=1, stride=1, padding="VALID"):
  return jax.lax.conv_general_dilated(x, k, (stride, stride), padding,
                                      feature_group_count=groups,
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))


def test_matrix_products_by_hand_and_as_xla_counts_them():
  a, b = jnp.ones((4, 8, 16)), jnp.ones((4, 16, 32))
  mm = lambda a, b: jnp.einsum("bij,bjk->bik", a, b)
  assert _count(mm, a, b) == 2 * 4 * 8 * 16 * 32 == _xla_cpu(mm, a, b)
  # Its gradient: the forward plus one product per operand, each as large.
  grad = jax.grad(lambda a, b: mm(a, b).sum(), argnums=(0, 1))
  assert _count(grad, a, b) == 3 * 2 * 4 * 8 * 16 * 32


@pytest.mark.parametrize("groups", [1, 4])
def test_convolutions_by_hand_and_as_xla_counts_them(groups):
  x, k = jnp.ones((2, 9, 9, 8)), jnp.ones((3, 3, 8 // groups, 12))
  out = 2 * 7 * 7 * 12  # N, H', W', output features.
  forward = 2 * out * 3 * 3 * (8 // groups)
  conv = lambda x, k: _conv(x, k, groups)
  assert _count(conv, x, k) == forward == _xla_cpu(conv, x, k)
  # The kernel's gradient sums the same products over the batch and the output window; the
  # input's is a full convolution of the padded output gradient (padding counted).
  kernel_grad = 2 * np.prod(k.shape) * 2 * 7 * 7
  input_grad = 2 * np.prod(x.shape) * 3 * 3 * (12 // groups)
  grad = jax.grad(lambda x, k: conv(x, k).sum(), argnums=(0, 1))
  assert _count(grad, x, k) == forward + kernel_grad + input_grad


def test_loops_branches_and_per_device_programs():
  w = jnp.ones((16, 16))
  step = 2 * 16 * 16  # One vector-matrix product.

  def scanned(v):
    return jax.lax.scan(lambda c, _: (c @ w, None), v, None, length=5)[0]
  assert _count(scanned, jnp.ones(16)) == 5 * step
  branches = lambda p, v: jax.lax.cond(p, lambda v: v @ w @ w, lambda v: v, v)
  assert _count(branches, True, jnp.ones(16)) == 2 * step  # The dearer branch.
  # A shard_map body sees one device's rows and runs on every device of its axis.
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("data",))
  rows = jax.device_put(jnp.ones((8 * n, 16)), jax.NamedSharding(mesh, jax.P("data")))
  per_device = jax.shard_map(lambda x: x @ w, mesh=mesh, in_specs=jax.P("data"),
                             out_specs=jax.P("data"))
  assert _count(per_device, rows) == 8 * n * step
  # Per device: the step's count over its devices.
  traced = jax.jit(lambda v: v @ w).trace(jnp.ones(16))
  assert flops.traced_flops_per_device(traced, 4) == step / 4


@pytest.mark.parametrize("per_group", [16, 24])
def test_a_pallas_convolution_counts_what_its_programs_compute(per_group):
  """Its cost estimate, not its body once: with whole tiles the convolution's own count
  (forward, input and kernel gradients); a group of 24 channels runs as tiles of 32."""
  tiles = pallas_conv.Tiles(pixels=16, k=16)
  groups, pixels, taps = 4, 2 * 8 * 8, 9
  x, k = jnp.ones((2, 8, 8, groups * per_group)), jnp.ones((3, 3, per_group, groups * per_group))
  conv = lambda x, k: pallas_conv.conv_pallas(
      x, k, (1, 1), "SAME", feature_group_count=groups,
      dimension_numbers=("NHWC", "HWIO", "NHWC"), tiles=tiles)
  grad = jax.grad(lambda x, k: conv(x, k).sum(), argnums=(0, 1))
  padded = 32 if per_group == 24 else 16  # Channels a tile computes (both sides).
  one = 2 * pixels * groups * taps * padded * padded  # Each of the three products.
  assert _count(conv, x, k) == one
  assert _count(grad, x, k) == 3 * one
  if per_group == 16:  # Whole tiles: XLA's convolution's count.
    reference = lambda x, k: _conv(x, k, groups, padding="SAME")
    assert _count(conv, x, k) == _count(reference, x, k)
    assert _count(grad, x, k) == _count(jax.grad(lambda x, k: reference(x, k).sum(),
                                                 argnums=(0, 1)), x, k)


def test_a_pallas_kernel_without_a_cost_estimate_is_refused():
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel

  def copy(x_ref, y_ref):
    y_ref[...] = x_ref[...]
  kernel = lambda x: pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    interpret=True)(x)
  with pytest.raises(ValueError, match="cost_estimate"):
    _count(kernel, jnp.ones((8, 8)))


def test_a_strided_convolutions_gradients_count_its_real_multiply_adds():
  """The input gradient convolves the output gradient dilated by the stride: its zeros are no
  work. Each forward (output, tap) pair on a real input element is one multiply-add of the
  input gradient, one of the kernel gradient (whose window is dilated, not its input)."""
  x, k = jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 6))
  conv = lambda x, k: _conv(x, k, stride=2, padding="SAME")
  # 8 px, stride 2, SAME: 4 outputs, padding (0, 1): per axis 4 x 3 = 12 (output, tap) pairs,
  # the last output's last tap on padding, so 11 on the input.
  per_pair = 2 * 2 * 4 * 6  # 2 FLOPs x batch x input x output features.
  forward = per_pair * 12 * 12
  input_grad = per_pair * 11 * 11
  kernel_grad = per_pair * 12 * 12  # Output (the kernel) x window (the 4 x 4 output, dilated).
  assert _count(conv, x, k) == forward
  grad = jax.grad(lambda x, k: conv(x, k).sum(), argnums=(0, 1))
  assert _count(grad, x, k) == forward + input_grad + kernel_grad
  # VALID padding: every forward pair is on the input, the input gradient equals the forward.
  valid = lambda x, k: _conv(x, k, stride=2)  # 3 outputs per axis.
  grad = jax.grad(lambda x, k: valid(x, k).sum(), argnums=(0, 1))
  assert _count(grad, x, k) == 3 * per_pair * 9 * 9


def _library_flops(f, *args):
  """FLOPs by jax.experimental.roofline's interpreter, for an `f` of matrix products and
  convolutions (and layout ops, which it counts as none)."""
  return roofline.roofline(f)(*args)[1].unfused_flops


def test_jax_roofline_agrees_on_matrix_products_and_unpadded_convolutions():
  """jax.experimental.roofline counts a matrix product as here; a convolution without padding
  too, its strided input gradient included; with padding it leaves out the taps on it (the
  published tables, and this count, include them): 3 x 3 SAME on 9 x 9 has (9 x 3 - 2)^2 =
  625 (output, tap) pairs on the input, against 9 x 9 x 9 = 729 counted here."""
  a, b = jnp.ones((4, 8, 16)), jnp.ones((16, 32))
  mm = lambda a, b: a @ b
  assert _count(mm, a, b) == _library_flops(mm, a, b) == 2 * 4 * 8 * 16 * 32
  x, k = jnp.ones((2, 9, 9, 8)), jnp.ones((3, 3, 8, 12))
  strided = lambda x, k: _conv(x, k, stride=2)
  g = jnp.ones(jax.eval_shape(strided, x, k).shape)

  def vjp(x, k, g):  # The forward and both gradients.
    out, grads = jax.vjp(strided, x, k)
    return out, grads(g)
  assert _count(vjp, x, k, g) == _library_flops(vjp, x, k, g) == 3 * 2 * 2 * 4 * 4 * 12 * 9 * 8
  same = lambda x, k: _conv(x, k, padding="SAME")
  assert _count(same, x, k) == 2 * 2 * 12 * 8 * 9 * 9 * 9
  assert _library_flops(same, x, k) == 2 * 2 * 12 * 8 * 625


# Forward multiply-adds per image at 224 px with 1,000 classes, as published.
_PUBLISHED_GMACS = {
    # torchvision's model tables ("GFLOPS", counted as multiply-adds), IMAGENET1K_V1 weights.
    "resnet50": 4.09,  # ResNet50_Weights
    "regnety_16gf": 15.91,  # RegNet_Y_16GF_Weights
    "vit_b16": 17.56,  # ViT_B_16_Weights
    "resnext50_32x4d": 4.23,  # ResNeXt50_32X4D_Weights
    # timm's model cards ("GMACs"): tresnet_m.miil_in1k, mixer_b16_224.goog_in21k_ft_in1k.
    "tresnet_m": 5.8,
    "mixer_b16": 12.6,
    # Howard et al. 2019 (Searching for MobileNetV3), Table 3: Large 1.0, 219 M multiply-adds.
    "mobilenetv3_large_100": 0.219,
}


@pytest.mark.parametrize("name", sorted(_PUBLISHED_GMACS))
def test_train_step_flops_are_three_times_the_published_forward(name):
  """Forward and backward of one 224-px image: 3 x 2 x the published forward multiply-adds
  (the backward computes two products per forward one), within 3%. Traced only; in eval
  mode, whose products are the train step's (BatchNorm's statistics and stochastic depth
  add none)."""
  abstract = nnx.eval_shape(lambda: models.get_model(name, num_classes=1000, rngs=nnx.Rngs(0)))
  graphdef, params, extra = nnx.split(abstract, nnx.Param, ...)

  def loss(params, extra, images):
    return nnx.merge(graphdef, params, extra)(images).sum()

  images = jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32)
  step = jax.make_jaxpr(jax.grad(loss))(params, extra, images)
  ratio = flops.jaxpr_flops(step) / (3 * 2 * _PUBLISHED_GMACS[name] * 1e9)
  assert ratio == pytest.approx(1.0, abs=0.03), ratio


def test_roofline_seconds_per_op_class_by_hand():
  """On an H100 (989.5 TFLOP/s bf16, 494.5 float32, 3.35 TB/s): a bf16 matrix product as
  large as this is compute-bound, tanh memory-bound, a batched float32 product (attention's
  class) compute-bound at the float32 peak."""
  h100 = accelerators.get("h100")
  x = w = jnp.ones((1024, 1024), jnp.bfloat16)
  q = jnp.ones((2, 1024, 1024), jnp.float32)

  def f(x, w, q):
    return jnp.tanh(x @ w), jnp.einsum("bij,bjk->bik", q, q)
  costs = flops.jaxpr_costs(jax.make_jaxpr(f)(x, w, q), h100)
  mm_flops, mm_bytes = 2 * 1024**3, 3 * 1024**2 * 2
  assert (costs["matmul"].flops, costs["matmul"].bytes) == (mm_flops, mm_bytes)
  assert costs["matmul"].seconds == pytest.approx(mm_flops / 989.5e12)
  assert mm_bytes / 3.35e12 < costs["matmul"].seconds
  tanh_bytes = 2 * 1024**2 * 2  # Read and write, bf16.
  assert costs["elementwise"].bytes == tanh_bytes and costs["elementwise"].flops == 0
  assert costs["elementwise"].seconds == pytest.approx(tanh_bytes / 3.35e12)
  att_flops, att_bytes = 2 * 2 * 1024**3, 3 * 2 * 1024**2 * 4
  assert (costs["attention"].flops, costs["attention"].bytes) == (att_flops, att_bytes)
  assert att_bytes / 3.35e12 < costs["attention"].seconds
  assert costs["attention"].seconds == pytest.approx(att_flops / 494.5e12)


def test_fused_attention_counts_what_xlas_attention_counts():
  """cuDNN's fused attention (one primitive forward, one backward) counts the products XLA's
  own attention is made of: 2 forward, 4 backward; MFU does not depend on the kernel."""
  q = jnp.ones((2, 6, 3, 16), jnp.bfloat16)  # [B, T, heads, head_dim]
  kv = jnp.ones((2, 8, 3, 16), jnp.bfloat16)  # 8 keys and values per query row.
  product = 2 * 2 * 3 * 6 * 8 * 16  # One [T, head_dim] x [head_dim, T_kv] product per head.
  attend = lambda impl: lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, implementation=impl).astype(jnp.float32).sum()
  grad = lambda impl: jax.grad(attend(impl), argnums=(0, 1, 2))
  try:
    fused = (_count(attend("cudnn"), q, kv, kv), _count(grad("cudnn"), q, kv, kv))
  except RuntimeError as e:  # JAX checks the installed cuDNN when it traces the call.
    pytest.skip(f"{e}: pip install 'nvidia-cudnn-cu13>=9.12.0.46,<10' (bigpretrain[cuda]).")
  unfused = (_count(attend("xla"), q, kv, kv), _count(grad("xla"), q, kv, kv))
  assert fused == unfused == (2 * product, 6 * product)
