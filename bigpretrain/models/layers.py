"""Building blocks shared by the models: stochastic depth, BatchNorm, LayerScale, MLP, init
helpers, rematerialised blocks."""
from collections.abc import Callable, Sequence
import functools
import math

import jax
import jax.numpy as jnp
import flax
from flax import nnx

from bigpretrain.models import pallas_conv

# Parameters are created abstractly and placed by bigpretrain.sharding from logical axis
# names; Flax's eager variable sharding would require a mesh at construction.
flax.config.update("flax_always_shard_variable", False)

Dtype = jnp.dtype | type


def gelu(x: jax.Array) -> jax.Array:
  """Exact GELU, x * Phi(x), as in the ViT / DeiT / Mixer reference models.

  In 16-bit compute: x / 2 * (1 + erf(x / sqrt(2))), PyTorch's nn.GELU, with x / sqrt(2) and
  1 + erf in float32 (the sum's cancellation in the negative tail is far below the 16-bit
  rounding; jax.nn.gelu rounds x / sqrt(2) to 16 bits, a few % off there). erf is one
  HLO op, where jax.nn.gelu's erfc is expanded per element into two exponentials, two
  divisions and three branches: the largest fusion of ViT-B/16's bfloat16 step on an H200
  (docs/benchmarks.md). In float32 and wider: jax.nn.gelu(approximate=False), whose erfc
  keeps the tail's relative precision.
  """
  if jnp.dtype(x.dtype).itemsize > 2:
    return jax.nn.gelu(x, approximate=False)
  cdf = (1 + jax.lax.erf(x.astype(jnp.float32) * math.sqrt(0.5))) / 2
  return x * cdf.astype(x.dtype)


def partitioned(init, names: Sequence[str | None]):
  """Wraps an initializer so the created nnx.Param carries logical axis names."""
  return nnx.with_partitioning(init, tuple(names))


def make_divisible(value: float, divisor: int = 8) -> int:
  """Rounds to the nearest multiple of `divisor`, never going more than 10% below `value`
  (timm's / torchvision's _make_divisible, used for MobileNetV3 and RegNet widths)."""
  out = max(divisor, int(value + divisor / 2) // divisor * divisor)
  return out + divisor if out < 0.9 * value else out


# config.model.attention_impl: jax.nn.dot_product_attention's implementation in attention
# layers. 'xla' is XLA's own softmax(q k^T) v on every backend; 'cudnn' is cuDNN's fused flash
# attention on NVIDIA GPUs (one custom call forward, one backward, no [B, heads, N, N] scores
# in memory). The configs' default, 'auto', picks one per platform (base.auto_attention).
ATTENTION_IMPLS = ("xla", "cudnn")
# config.model.head_dtype: what the classifier's matmuls read. 'float32' (the default): the
# features and the kernel in float32. 'bfloat16': both, and the gradient of the logits, rounded
# to bfloat16, products summed in float32, float32 bias and logits (bf16_matmul): the bf16
# Tensor Core / MXU rate for a head of 11k-27k classes, whose share of the step grows with the
# class count.
HEAD_DTYPES = ("float32", "bfloat16")
# config.model.grouped_conv_impl: how grouped convolutions with more than one channel per
# group (RegNet's, ResNeXt's; depthwise ones stay convolutions) are computed. 'xla' hands
# them to XLA as they are (on GPUs cuDNN's grouped kernels); 'gemm' computes each as one
# batched matrix product over its groups (conv_as_gemm): GEMM kernels, at the cost of moving
# each window through memory (faster than cuDNN's on an H200, not on an H100 in an earlier
# form: docs/benchmarks.md); 'split' as one ungrouped convolution per group
# (conv_per_group): dense kernels of group-width channels, at the cost of copying each
# group's channels out and the outputs back together; 'pallas' as implicit-GEMM kernels that
# read each window straight from the activations (pallas_conv: Triton's on NVIDIA GPUs,
# Pallas's interpreter elsewhere).
GROUPED_CONV_IMPLS = ("xla", "gemm", "split", "pallas")
# config.model.pointwise_conv_impl: how ungrouped 1x1 convolutions (the bottlenecks' and
# shortcuts' projections, Squeeze-Excitation's) are computed. 'xla' hands them to XLA as
# convolutions (on GPUs cuDNN calls, each filter transposed into cuDNN's layout and back);
# 'gemm' as one matrix product over the channels (pointwise_as_gemm): cuBLAS GEMMs on GPUs,
# which read the kernel as it is stored (why: docs/benchmarks.md, "1x1 convolutions as GEMMs").
POINTWISE_CONV_IMPLS = ("xla", "gemm")


def bf16_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x @ w with both rounded to bfloat16 and the products summed in float32 (float32
  result); its gradients alike: the float32 cotangent is rounded to bfloat16 too, so all
  three GEMMs (forward, features' and kernel's gradients) run at the bfloat16 rate. Without
  this, JAX differentiates a mixed float32 x bfloat16 product into float32 GEMMs."""
  return _bf16_matmul(x, w, x.dtype, w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _bf16_matmul(x, w, x_dtype, w_dtype):
  del x_dtype, w_dtype  # The gradients' dtypes.
  return jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                 preferred_element_type=jnp.float32)


def _bf16_matmul_fwd(x, w, x_dtype, w_dtype):
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  return _bf16_matmul(xb, wb, x_dtype, w_dtype), (xb, wb)


def _bf16_matmul_bwd(x_dtype, w_dtype, res, g):
  xb, wb = res
  gb = g.astype(jnp.bfloat16)
  dx = jnp.dot(gb, wb.T, preferred_element_type=jnp.float32).astype(x_dtype)
  dw = jnp.dot(xb.reshape(-1, xb.shape[-1]).T, gb.reshape(-1, gb.shape[-1]),
               preferred_element_type=jnp.float32).astype(w_dtype)
  return dx, dw


_bf16_matmul.defvjp(_bf16_matmul_fwd, _bf16_matmul_bwd)


class ClassifierHead(nnx.Linear):
  """nnx.Linear with float32 logits whatever `head_dtype` (HEAD_DTYPES) its matmul reads."""

  head_dtype = "float32"

  def __call__(self, inputs: jax.Array) -> jax.Array:
    if self.head_dtype == "float32":
      return super().__call__(inputs)
    return bf16_matmul(inputs, self.kernel[...]) + self.bias[...].astype(jnp.float32)


def classifier_head(in_features: int, num_classes: int, *, param_dtype, rngs,
                    kernel_init=nnx.initializers.zeros) -> nnx.Linear:
  """The linear classifier every model ends with (zero-initialised by default): float32
  logits, a float32 matmul unless models.get_model sets its head_dtype."""
  return ClassifierHead(in_features, num_classes,
                        kernel_init=partitioned(kernel_init, ("embed", "classes")),
                        dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs)


def drop_path_rates(rate: float, depth: int, schedule: str = "linear") -> list[float]:
  """Per-block stochastic-depth rates.

  'linear' (DeiT): block i gets rate * i / (depth - 1), so the first block is never dropped
  (a single block neither, as DeiT's linspace(0, rate, 1) gives) and the last one is
  dropped with `rate`. 'uniform' (cosub): every block gets `rate`.
  """
  if not 0.0 <= rate <= 1.0:
    raise ValueError(f"drop_path_rate must be in [0, 1], got {rate!r}")
  if schedule == "linear":
    return [float(rate) * i / max(depth - 1, 1) for i in range(depth)]
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
  # The scale in float32: 1 / 0.9 in bfloat16 (1.109375) would bias every kept row low.
  return (x * jnp.where(keep, 1.0 / keep_prob, 0.0).astype(jnp.float32)).astype(x.dtype)


STOCHASTIC_DEPTH_MODES = ("mask", "esd")
# Mesh axes the batch is split over (bigpretrain.sharding.BATCH_AXES; not imported, so the
# models stay independent of the trainer).
_BATCH_AXES = ("data", "fsdp")


def check_stochastic_depth_mode(mode: str) -> str:
  if mode not in STOCHASTIC_DEPTH_MODES:
    raise ValueError(f"stochastic_depth must be one of {STOCHASTIC_DEPTH_MODES}, got {mode!r}")
  return mode


def data_shards() -> int:
  """Number of data-parallel shards of the batch under the current mesh (1 without one).

  The product of the 'data' and 'fsdp' axes of `jax.sharding.get_abstract_mesh()`, i.e. of
  the mesh set with `jax.set_mesh` (the trainer runs its step under it).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  return math.prod(mesh.shape.get(a, 1) for a in _BATCH_AXES)


def esd_kept_rows(rate: float, rows: int) -> int:
  """Rows of a local batch of `rows` whose branch ESD computes: floor((1 - rate) * rows).

  The kept rows round down, so the dropped rows round up to ceil(rate * rows) and the rate
  applied is never below the requested one (cosub supplement C.1, LBS_ESD = floor(tau x LBS),
  with tau there the kept share: 0.5 over 5 rows drops 3, an effective 0.6). A tiny
  tolerance keeps float error from flooring an exact product one row too low (e.g.
  (1 - 0.9) * 10 is 0.999... in binary floating point).
  """
  if not 0.0 <= rate <= 1.0:
    raise ValueError(f"drop_path_rate must be in [0, 1], got {rate!r}")
  return min(rows, math.floor((1.0 - rate) * rows + 1e-6))


def esd_effective_rate(rate: float, rows: int) -> float:
  """The drop rate ESD actually applies to a local batch of `rows` (cosub supplement C.1)."""
  return 1.0 - esd_kept_rows(rate, rows) / rows


def _constrain_to_shards(x: jax.Array) -> jax.Array:
  """Pins axis 0 of `x` (one entry per data shard) to the batch mesh axes, when on Auto axes."""
  axes = _auto_batch_axes(x.shape[0])
  # Explicit axes carry the sharding in the type; the reshape keeps it.
  return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(axes)) if axes else x


def _auto_batch_axes(rows: int) -> tuple[str, ...]:
  """The current mesh's batch axes when they are all Auto and split `rows`, else ()."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  axes = tuple(a for a in _BATCH_AXES if a in mesh.axis_names)
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  if not axes or not all(types[a] == jax.sharding.AxisType.Auto for a in axes):
    return ()
  if rows % math.prod(mesh.shape[a] for a in axes):
    return ()  # Rows that do not split over the mesh (e.g. a single eval image): as they come.
  return axes


def constrain_batch(x: jax.Array) -> jax.Array:
  """Pins axis 0 of activations `x` to the batch mesh axes ('data', 'fsdp'), the other axes
  left to the compiler, when run under a mesh with Auto axes (a no-op otherwise).

  FSDP shards weights over 'fsdp' on their 'embed' axis while the batch is split over the
  same axis; left alone, XLA's sharding propagation may follow the weights and split the
  activations on 'embed' instead, all-reducing partial [global batch, ...] activations (this
  made per-device temporaries depend on the device count). The constraint keeps activations
  split by rows and weights all-gathered, as FSDP intends (MaxText constrains alike).
  """
  axes = _auto_batch_axes(x.shape[0])
  if not axes:
    return x
  rest = (jax.sharding.PartitionSpec.UNCONSTRAINED,) * (x.ndim - 1)
  return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(axes, *rest))


def batch_local_conv(lhs: jax.Array, rhs: jax.Array, *args,
                     conv_fn=jax.lax.conv_general_dilated, **kwargs) -> jax.Array:
  """`jax.lax.conv_general_dilated` (batch on lhs axis 0) computed on each device's own rows.

  XLA's SPMD partitioner all-gathers the batch-split input of a grouped convolution
  (feature_group_count > 1) and convolves the global batch on every device. Under a mesh with
  Auto batch axes this runs the convolution in `jax.shard_map` instead: each device convolves
  its rows with the whole kernel (all-gathered, as FSDP intends) and the kernel's gradient is
  summed over the batch axes, in float32 (a bfloat16 sum loses precision, and XLA:CPU aborts
  compiling one). Ungrouped convolutions, which XLA partitions by rows itself, and batches
  that are not split run as they are. `conv_fn` computes it (conv_general_dilated's arguments;
  conv_as_gemm for grouped_conv_impl 'gemm', conv_per_group for 'split'). Pass it as
  nnx.Conv's `conv_general_dilated`.

  Under a multi-device mesh the output (and so its cotangent) is pinned to rows: batch on
  the batch axes, channels whole (see _pin_rows). Left free, XLA may split conv activations
  on their channels over 'tensor' (following the kernels' 'conv_out' axis); with the batch
  split over both 'data' and 'fsdp' and 'tensor' > 1, XLA's SPMD partitioner then
  miscompiled the input gradient of a 1x1 conv feeding a 3x3 conv and BatchNorm (the
  forward was right; RegNetY's early blocks got wrong gradients on a data:2,fsdp:2,tensor:2
  mesh). Kernels keep their sharded storage and are gathered whole, as FSDP intends.
  """
  conv = lambda x, k: conv_fn(x, k, *args, **kwargs)
  axes = _auto_batch_axes(lhs.shape[0])
  if kwargs.get("feature_group_count", 1) == 1 or not axes or data_shards() == 1:
    return _pin_rows(conv(lhs, rhs))

  # Pallas's interpreter (pallas_conv's form off GPUs, traced on every platform) fails JAX's
  # checks of what varies over the mesh; unchecked, shard_map sums a replicated input's
  # gradient itself, as pcast's does.
  check_vma = conv_fn is not pallas_conv.conv_pallas

  def local(x, k):  # Marked per-device before the cast, so its gradient's sum is float32.
    k = jax.lax.pcast(k, axes, to="varying") if check_vma else k
    return conv(x, k.astype(rhs.dtype))

  rows = jax.sharding.PartitionSpec(axes)
  return _pin_rows(jax.shard_map(
      local, in_specs=(rows, jax.sharding.PartitionSpec()), out_specs=rows,
      axis_names=set(axes), check_vma=check_vma)(
          lhs, rhs.astype(jnp.promote_types(rhs.dtype, jnp.float32))))


def _nhwc_hwio(lhs: jax.Array, rhs: jax.Array, dimension_numbers) -> bool:
  """Whether `dimension_numbers` lay out `lhs` and `rhs` as NHWC images and an HWIO kernel."""
  return jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers) == (
      jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, ("NHWC", "HWIO", "NHWC")))


def conv_as_gemm(lhs: jax.Array, rhs: jax.Array, window_strides: Sequence[int], padding,
                 lhs_dilation=None, rhs_dilation=None, dimension_numbers=None,
                 feature_group_count: int = 1, precision=None, preferred_element_type=None,
                 out_sharding=None) -> jax.Array:
  """jax.lax.conv_general_dilated of 2-D NHWC images with an HWIO kernel (nnx.Conv's
  layout), computed as one matrix product batched over the groups: each output pixel's
  window is gathered into a row of window x channels-per-group values (im2col), so a 3x3
  grouped convolution of group width g is a [pixels, 9 g] x [9 g, g] product per group. The
  same function up to the order of the sums; its gradients are products and pads of
  slices. Dilated convolutions and other layouts raise ValueError."""
  del out_sharding  # The callers pin their outputs themselves (batch_local_conv).
  if (any(d != 1 for d in (lhs_dilation or ()) + (rhs_dilation or ()))
      or lhs.ndim != 4 or not _nhwc_hwio(lhs, rhs, dimension_numbers)):
    raise ValueError("conv_as_gemm takes undilated 2-D convolutions of NHWC images with "
                     f"HWIO kernels; got dimension_numbers={dimension_numbers}, "
                     f"lhs_dilation={lhs_dilation}, rhs_dilation={rhs_dilation}.")
  kh, kw, per_group, out_ch = rhs.shape
  groups = feature_group_count
  if isinstance(padding, str):
    padding = jax.lax.padtype_to_pads(lhs.shape[1:3], (kh, kw), window_strides, padding)
  x = jnp.pad(lhs, ((0, 0), *padding, (0, 0)))
  batch, height, width, _ = x.shape
  (sh, sw) = window_strides
  out_h, out_w = (height - kh) // sh + 1, (width - kw) // sw + 1
  x = x.reshape(batch, height, width, groups, per_group)
  taps = [x[:, i:i + sh * (out_h - 1) + 1:sh, j:j + sw * (out_w - 1) + 1:sw]
          for i in range(kh) for j in range(kw)]
  patches = jnp.stack(taps, axis=4)  # [batch, out_h, out_w, groups, taps, per_group]
  kernel = rhs.reshape(kh * kw, per_group, groups, out_ch // groups)
  y = jax.lax.dot_general(patches, kernel, (((4, 5), (0, 1)), ((3,), (2,))),
                          precision=precision, preferred_element_type=preferred_element_type)
  # dot_general puts the batch (group) axis first: [groups, batch, out_h, out_w, out / groups].
  return jnp.moveaxis(y, 0, 3).reshape(batch, out_h, out_w, out_ch)


def conv_per_group(lhs: jax.Array, rhs: jax.Array, window_strides: Sequence[int], padding,
                   lhs_dilation=None, rhs_dilation=None, dimension_numbers=None,
                   feature_group_count: int = 1, precision=None, preferred_element_type=None,
                   out_sharding=None) -> jax.Array:
  """jax.lax.conv_general_dilated of NHWC images with an HWIO kernel, a grouped one computed
  as one ungrouped convolution per group (its slice of the input's and of the kernel's output
  channels), concatenated on the channels: the same sums. Other layouts raise ValueError."""
  del out_sharding  # The callers pin their outputs themselves (batch_local_conv).
  if not _nhwc_hwio(lhs, rhs, dimension_numbers):
    raise ValueError("conv_per_group takes NHWC images with HWIO kernels; got "
                     f"dimension_numbers={dimension_numbers}.")
  per_group = lhs.shape[-1] // feature_group_count
  out_per_group = rhs.shape[-1] // feature_group_count
  conv = functools.partial(
      jax.lax.conv_general_dilated, window_strides=window_strides, padding=padding,
      lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
      dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=precision,
      preferred_element_type=preferred_element_type)
  return jnp.concatenate(
      [conv(lhs[..., g * per_group:(g + 1) * per_group],
            rhs[..., g * out_per_group:(g + 1) * out_per_group])
       for g in range(feature_group_count)], axis=-1)


def is_pointwise(conv: nnx.Conv) -> bool:
  """Whether `conv` is a 1x1 convolution pointwise_as_gemm computes: ungrouped, undilated,
  and padded by nothing (a 1x1 window's 'SAME' or 'VALID', or zeros)."""
  ones = lambda v: v is None or all(d == 1 for d in (v if isinstance(v, Sequence) else (v,)))
  pad = conv.padding
  unpadded = pad in ("SAME", "VALID") or pad == 0 or (
      not isinstance(pad, str) and all(p == 0 or tuple(p) == (0, 0) for p in pad))
  return (tuple(conv.kernel_size) == (1, 1) and conv.feature_group_count == 1 and unpadded
          and ones(conv.input_dilation) and ones(conv.kernel_dilation))


def pointwise_as_gemm(lhs: jax.Array, rhs: jax.Array, window_strides: Sequence[int], padding,
                      lhs_dilation=None, rhs_dilation=None, dimension_numbers=None,
                      feature_group_count: int = 1, precision=None,
                      preferred_element_type=None, out_sharding=None) -> jax.Array:
  """jax.lax.conv_general_dilated of NHWC images with a 1x1 HWIO kernel (ungrouped,
  undilated, unpadded: see is_pointwise) as a matrix product over the channels of the
  strided pixels, x[:, ::sh, ::sw] @ kernel[0, 0]: the same sums. Other convolutions raise
  ValueError."""
  del out_sharding  # The callers pin their outputs themselves (batch_local_conv).
  if isinstance(padding, str):
    padding = jax.lax.padtype_to_pads(lhs.shape[1:3], rhs.shape[:2], window_strides, padding)
  if (lhs.ndim != 4 or not _nhwc_hwio(lhs, rhs, dimension_numbers) or rhs.shape[:2] != (1, 1)
      or feature_group_count != 1 or any(tuple(p) != (0, 0) for p in padding)
      or any(d != 1 for d in (lhs_dilation or ()) + (rhs_dilation or ()))):
    raise ValueError("pointwise_as_gemm takes ungrouped, undilated, unpadded 1x1 "
                     f"convolutions of NHWC images with HWIO kernels; got kernel "
                     f"{rhs.shape}, dimension_numbers={dimension_numbers}, padding={padding}, "
                     f"feature_group_count={feature_group_count}.")
  sh, sw = window_strides
  return jax.lax.dot_general(lhs[:, ::sh, ::sw], rhs[0, 0], (((3,), (0,)), ((), ())),
                             precision=precision,
                             preferred_element_type=preferred_element_type)


def batch_local_pointwise_conv(lhs: jax.Array, rhs: jax.Array, *args, **kwargs) -> jax.Array:
  """batch_local_conv computing the convolution with pointwise_as_gemm (pointwise_conv_impl
  'gemm')."""
  return batch_local_conv(lhs, rhs, *args, conv_fn=pointwise_as_gemm, **kwargs)


def batch_local_split_conv(lhs: jax.Array, rhs: jax.Array, *args, **kwargs) -> jax.Array:
  """batch_local_conv computing the convolution with conv_per_group (grouped_conv_impl
  'split')."""
  return batch_local_conv(lhs, rhs, *args, conv_fn=conv_per_group, **kwargs)


def batch_local_gemm_conv(lhs: jax.Array, rhs: jax.Array, *args, **kwargs) -> jax.Array:
  """batch_local_conv computing the convolution with conv_as_gemm (grouped_conv_impl
  'gemm')."""
  return batch_local_conv(lhs, rhs, *args, conv_fn=conv_as_gemm, **kwargs)


def batch_local_pallas_conv(lhs: jax.Array, rhs: jax.Array, *args, **kwargs) -> jax.Array:
  """batch_local_conv computing the convolution with pallas_conv.conv_pallas
  (grouped_conv_impl 'pallas')."""
  return batch_local_conv(lhs, rhs, *args, conv_fn=pallas_conv.conv_pallas, **kwargs)


def _pin_rows(x: jax.Array) -> jax.Array:
  """Pins `x` to rows split over the batch axes and every other axis whole, under an Auto
  mesh of more than one device (a no-op otherwise, so one device compiles the plain step)."""
  axes = _auto_batch_axes(x.shape[0])
  if not axes or jax.sharding.get_abstract_mesh().size == 1:
    return x
  return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(axes))


def esd_residual(x: jax.Array, branch: Callable[[jax.Array], jax.Array], rate: float,
                 rng: jax.Array | None, *, num_shards: int | None = None) -> jax.Array:
  """Efficient stochastic depth (cosub supplement C): x + branch on a random row subset.

  Instead of computing `branch` on every row and zeroing a random share of them, each data
  shard picks k = floor((1 - rate) * n) of its n rows by a random permutation (a static
  count, so it jits), computes `branch` on those rows only, scales the result by n / k and
  adds it back to those rows; the other rows pass through unchanged. Every row's branch is
  thus kept with probability k / n and the expectation equals x + branch(x), as with masked
  stochastic depth at the effective rate 1 - k / n. Rows never leave their shard: the batch is
  viewed as [num_shards, n, ...] with axis 0 on the ('data', 'fsdp') mesh axes, and the gather
  and scatter are batched over that axis. `branch` must act on each row independently.

  `num_shards` defaults to data_shards(). rate 0 computes the branch on all rows (no rng
  needed); rate 1 skips the branch. A rate below 1 that floors k to 0 is refused: the block
  would never train, a model other than the one asked for.
  """
  rows = x.shape[0]
  shards = data_shards() if num_shards is None else int(num_shards)
  if shards < 1 or rows % shards:
    raise ValueError(f"efficient stochastic depth: {rows} rows do not split evenly over "
                     f"{shards} data shards (mesh data x fsdp).")
  n = rows // shards
  keep = esd_kept_rows(rate, n)
  if keep == n:
    return x + branch(x)
  if keep == 0:
    if rate < 1.0:
      need = math.ceil(1.0 / (1.0 - rate) - 1e-6)
      raise ValueError(
          f"efficient stochastic depth: drop rate {rate:g} keeps none of a data shard's {n} "
          f"rows (floor((1 - rate) x {n}) = 0), so the block would never train. Give each data "
          f"shard at least {need} rows (batch_size / (data x fsdp)) or use "
          "config.model.stochastic_depth='mask'.")
    return x
  if rng is None:
    raise ValueError(f"efficient stochastic depth with rate {rate} needs an `rng` key.")
  xs = _constrain_to_shards(x.reshape((shards, n) + x.shape[1:]))
  idx = jax.vmap(lambda k: jax.random.permutation(k, n)[:keep])(jax.random.split(rng, shards))
  idx = _constrain_to_shards(idx)
  sub = jax.vmap(lambda rows_, i: rows_[i])(xs, idx)  # [shards, keep, ...]
  y = branch(sub.reshape((shards * keep,) + x.shape[1:]))
  # The n / k scale in float32 (bf16 would round e.g. 5/3 to 1.664), as drop_path's.
  y = (y.reshape((shards, keep) + y.shape[1:]).astype(jnp.float32) * (n / keep)).astype(y.dtype)
  out = jax.vmap(lambda rows_, i, v: rows_.at[i].add(v.astype(rows_.dtype),
                                                     unique_indices=True))(xs, idx, y)
  return out.reshape(x.shape)


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


class BatchNorm(nnx.BatchNorm):
  """nnx.BatchNorm whose training statistics can be those of groups of `group_size` rows.

  group_size 0 (the default): statistics of the whole batch, which under a sharded jit is the
  global batch (synchronised BatchNorm, SWAG's choice). group_size N: rows [0, N), [N, 2N),
  ... are normalised each with its own mean and variance, as a data-parallel trainer without
  sync BN does with N images per GPU (Yalniz et al. 2019, section 4.1: 24 per GPU); the groups
  are fixed by the row index, so the result does not depend on the mesh. The running averages
  move towards the mean over groups of the group means and of the group (biased) variances:
  the statistics an evaluation then sees are those of an N-image batch, not of the global
  batch. Evaluation (use_running_average) is unchanged. Same variables as nnx.BatchNorm, so
  checkpoints are interchangeable; set the size with `set_bn_group_size`.
  """
  group_size: int = 0

  def __call__(self, x: jax.Array, use_running_average: bool | None = None, *,
               mask: jax.Array | None = None) -> jax.Array:
    running = self.use_running_average if use_running_average is None else use_running_average
    if not self.group_size or running:
      return super().__call__(x, use_running_average, mask=mask)
    if mask is not None or self.axis != -1:
      raise ValueError("group BatchNorm normalises the last axis and takes no mask")
    rows, n = x.shape[0], self.group_size
    if rows % n:
      raise ValueError(f"BatchNorm group size {n} does not divide the {rows} rows of the "
                       "batch: make the batch size a multiple of model.bn_group_size.")
    dtype = jnp.promote_types(self.dtype or x.dtype, jnp.float32)
    groups = x.reshape((rows // n, n) + x.shape[1:]).astype(dtype)
    axes = tuple(range(1, groups.ndim - 1))
    mean = groups.mean(axes, keepdims=True)
    var = jnp.square(groups - mean).mean(axes, keepdims=True)
    features = x.shape[-1]
    for stat, value in ((self.mean, mean), (self.var, var)):
      stat[...] = jax.lax.stop_gradient(
          self.momentum * stat[...] + (1 - self.momentum) * value.reshape(-1, features).mean(0))
    y = (groups - mean) * jax.lax.rsqrt(var + self.epsilon)
    if self.scale is not None:
      y = y * self.scale[...].astype(dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(dtype)
    return y.reshape(x.shape).astype(self.dtype or x.dtype)


def set_bn_group_size(model: nnx.Module, group_size: int) -> None:
  """Sets the statistics group of every BatchNorm in `model` (0 = the whole batch)."""
  if group_size < 0:
    raise ValueError(f"bn_group_size must be >= 0 (0 = whole-batch statistics), got "
                     f"{group_size}")
  for _, module in nnx.iter_modules(model):
    if isinstance(module, BatchNorm):
      module.group_size = int(group_size)


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


# The jax.checkpoint_policies a block's rematerialisation may name (config.model.remat): what
# the backward pass keeps of the block's forward; everything else is recomputed. The other
# names there build a policy from arguments (checkpoint_name tags, memory kinds to offload to).
REMAT_POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
                  "everything_saveable")
REMAT_OFF = ("", "none")


def remat_policy(name: str) -> Callable | None:
  """The jax.checkpoint_policies policy called `name`; None for '' or 'none' (no remat).

  'nothing_saveable' keeps only the block's input and recomputes the whole block in the
  backward pass; 'dots_saveable' also keeps every matmul / conv output;
  'dots_with_no_batch_dims_saveable' keeps the matmuls without batch dimensions (the weight
  matmuls, not attention's) and no conv output: on a convnet it is 'nothing_saveable' (but for
  the 1x1 convolutions pointwise_conv_impl='gemm' makes matmuls); 'everything_saveable' keeps
  all (no memory saved).
  """
  if name in REMAT_OFF:
    return None
  if name not in REMAT_POLICIES:
    raise ValueError(f"remat={name!r} is not a rematerialisation policy: use one of "
                     f"{REMAT_POLICIES} (jax.checkpoint_policies), or '' / 'none' for off.")
  return getattr(jax.checkpoint_policies, name)


@functools.cache
def remat_class(block_cls: type, policy: str) -> type:
  """A subclass of the nnx.Module `block_cls` whose forward pass runs under nnx.remat with
  the jax.checkpoint_policies `policy`: the backward pass recomputes what the policy does not
  keep instead of holding it from the forward. Same attributes, so the same parameters.

  The block is called `block(x, **kwargs)`; keyword values that are not arrays (train=True,
  rng=None) are static, arrays (an rng key) are traced. Variables the block updates
  (BatchNorm statistics) are updated as without remat.
  """
  checkpoint_policy = remat_policy(policy)
  if checkpoint_policy is None:
    raise ValueError(f"remat_class needs a policy, got {policy!r}")

  def __call__(self, x, **kwargs):
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}

    def forward(block, x, arrays):
      return block_cls.__call__(block, x, **static, **arrays)

    return nnx.remat(forward, policy=checkpoint_policy)(self, x, arrays)

  return type(block_cls.__name__, (block_cls,),
              {"__call__": __call__, "__module__": block_cls.__module__,
               "__qualname__": block_cls.__qualname__, "__doc__": block_cls.__doc__,
               "remat_policy": policy, "remat_of": block_cls})
