"""FLOPs and memory traffic of a traced step, counted on its jaxpr: 2 x the multiply-adds of its
matrix products (dot_general) and convolutions, the work that MFU counts, and per op class the
bytes it moves and its roofline time on an accelerator.

Why not XLA's cost analysis of the compiled step: XLA:GPU hands matrix products and
convolutions to cuBLAS and cuDNN as custom calls, which its cost analysis does not count, so
on GPUs it reports a small fraction of the step's FLOPs.
The jaxpr is the same program on every backend, before partitioning: its shapes are global,
and a step's FLOPs per device are its count over the devices of its mesh. Rematerialised
blocks count as often as the differentiated program runs them, and a Pallas kernel as its
cost estimate says (bigpretrain/models/pallas_conv.py: what its programs compute, padding
included): the work the step does. MFU counts the model's FLOPs instead
(train.Experiment.model_flops_per_device).

The per-primitive rules are jax.experimental.roofline's where they agree with the hand
formulas (tests/test_flops.py): a matrix product's FLOPs and every op's bytes (each operand
read and each result written once, as if nothing were fused). A convolution's multiply-adds
are counted here: the library leaves out the taps that fall on padding, the field's tables
(torchvision, timm, the papers) count them, and MFU is compared against those; what neither
counts is the zeros inside a dilated input. The input gradient of a strided convolution is a
convolution over the output gradient with zeros between its elements (lhs_dilation = the
stride): only the taps that land on its elements are work, the forward's multiply-adds, not
stride^2 times as many. The kernel's gradient dilates its window (rhs_dilation), which skips
positions and multiplies no zeros: output x window. The library's interpreter itself is not
used: it runs a scan's body once, counts no branch of a cond and only the last shard_map.

Fused attention (jax.nn.dot_product_attention's cuDNN kernels, one primitive forward and one
backward) counts what the unfused ops count, so MFU does not depend on the kernel: q k^T and
the weighted values forward (2 products), their gradients backward (4; not the scores the
kernel computes again). Its sequence is the padded one the kernel runs (vit.attention); MFU
counts the model's FLOPs instead, the step traced with XLA's kernels
(train.Experiment.model_flops_per_device).

Op classes (CLASSES): 'matmul' (matrix products without batch dimensions and convolutions),
'attention' (matrix products with batch dimensions: attention's scores and weighted values;
fused attention),
'elementwise' (everything else: activations, normalisation, softmax, the optimizer update; each
op's operands and results as the library counts them, or by hand where it has no rule, e.g.
tanh; layout and dtype changes count no bytes).
"""
import dataclasses
import importlib
import math

from jax.experimental import roofline
from jax.extend import core
import numpy as np

CLASSES = ("matmul", "attention", "elementwise")
# The library's per-primitive rules (its package exports the function under the module's name).
_RULES = importlib.import_module("jax.experimental.roofline.roofline")._rooflines
_MATMUL = ("dot_general", "conv_general_dilated")
# Fused attention primitives -> the matrix products each counts, in units of 2 x B x heads x
# T_q x T_kv x head_dim (one product's FLOPs); layout 1 is cuDNN's BNTH (heads before the
# sequence), 0 its BTNH (jax.nn's).
_FUSED_ATTENTION = {"dot_product_attention_fwd_wrapper": 2,
                    "dot_product_attention_bwd_wrapper": 4}
_FREE = ("reshape", "squeeze", "expand_dims", "broadcast_in_dim", "transpose",
         "convert_element_type", "copy", "copy_p", "stop_gradient", "iota", "pvary", "pcast",
         "sharding_constraint", "mesh_cast", "reshard", "random_wrap", "random_unwrap",
         "random_bits", "random_seed", "threefry2x32", "optimization_barrier")


@dataclasses.dataclass
class Cost:
  """One op class's FLOPs (matrix products and convolutions only), the bytes its ops read and
  write, and its roofline seconds: per op the longer of its FLOPs at the chip's peak and its
  bytes at the HBM bandwidth (elementwise: bytes only), summed."""
  flops: float = 0.0
  bytes: float = 0.0
  seconds: float = 0.0

  def __add__(self, other):
    return Cost(self.flops + other.flops, self.bytes + other.bytes,
                self.seconds + other.seconds)

  def __mul__(self, k):
    return Cost(self.flops * k, self.bytes * k, self.seconds * k)


def _spatial_taps(out_size, window, stride, padding, lhs_dilation, rhs_dilation, lhs_size):
  """(output position, window tap) pairs of one spatial dimension that multiply an element:
  all of them (padding included) unless the input is dilated; then only those on its
  elements."""
  if lhs_dilation == 1:
    return out_size * window
  pos = (np.arange(out_size)[:, None] * stride + np.arange(window)[None, :] * rhs_dilation
         - padding[0])
  on_element = (pos % lhs_dilation == 0) & (pos >= 0) & (pos <= (lhs_size - 1) * lhs_dilation)
  return int(on_element.sum())


def conv_flops(eqn) -> float:
  """2 x the multiply-adds of a conv_general_dilated equation (see the module docstring)."""
  lhs, rhs, out = eqn.invars[0].aval, eqn.invars[1].aval, eqn.outvars[0].aval
  p = eqn.params
  dn = p["dimension_numbers"]
  taps = 1
  for i in range(len(dn.out_spec) - 2):
    taps *= _spatial_taps(out.shape[dn.out_spec[2 + i]], rhs.shape[dn.rhs_spec[2 + i]],
                          p["window_strides"][i], p["padding"][i], p["lhs_dilation"][i],
                          p["rhs_dilation"][i], lhs.shape[dn.lhs_spec[2 + i]])
  # Every output feature of every output image sums over the kernel's input features (with
  # feature groups the kernel's input dimension is already per group).
  return (2.0 * out.shape[dn.out_spec[0]] * out.shape[dn.out_spec[1]]
          * rhs.shape[dn.rhs_spec[1]] * taps)


# The collectives a shard_map body calls: the plan counts them from the compiled program
# (hlo_collectives), whose collectives are the ones that run; jax's rules for them need a mesh.
_COLLECTIVES = frozenset({"psum", "psum_invariant", "pmax", "pmin", "all_gather",
                          "all_gather_invariant", "all_to_all", "ppermute", "psum_scatter",
                          "reduce_scatter", "pbroadcast", "axis_index"})


def _library(eqn):
  """jax.experimental.roofline's result for one primitive, or None where it has no rule or
  the operands are not plain arrays (RNG keys, tokens)."""
  rule = _RULES.get(eqn.primitive)
  avals_in, avals_out = [v.aval for v in eqn.invars], [v.aval for v in eqn.outvars]
  if rule is None or not all(isinstance(getattr(a, "dtype", None), np.dtype)
                             for a in avals_in + avals_out):
    return None
  ctx = roofline.RooflineRuleContext(
      name_stack=eqn.source_info.name_stack, primitive=eqn.primitive, avals_in=avals_in,
      avals_out=avals_out, jaxpr_eqn_ctx=eqn.ctx, mesh=None, pin_lhs_in_vmem=False,
      pin_rhs_in_vmem=False)
  return rule(ctx, *map(roofline.RooflineShape.from_aval, avals_in), **eqn.params)


def _bytes(eqn, result) -> float:
  """Bytes an op reads and writes unfused: the library's, or where it has no rule or counts
  none (tanh, pow, clamp, reduce_max, concatenate, ...) its operands and results; layout and
  dtype changes none (XLA folds them into their neighbours)."""
  if result is not None and result.unfused_hbm_bytes:
    return float(result.unfused_hbm_bytes)
  if eqn.primitive.name in _FREE:
    return 0.0
  avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
  return float(sum(math.prod(a.shape) * a.dtype.itemsize for a in avals
                   if isinstance(getattr(a, "dtype", None), np.dtype)))


def fused_attention_flops(eqn) -> float:
  """FLOPs of a fused attention primitive (_FUSED_ATTENTION) from its query and key shapes."""
  query, key = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
  kv_len = key[2] if eqn.params["layout"] == 1 else key[1]
  return 2.0 * _FUSED_ATTENTION[eqn.primitive.name] * math.prod(query) * kv_len


def _add_eqn(eqn, accelerator, scale: float, totals: dict, elementwise: bool) -> None:
  name = eqn.primitive.name
  counted = name in _MATMUL or name in _FUSED_ATTENTION
  if (not counted and not elementwise) or name in _COLLECTIVES:
    return
  result = _library(eqn)
  nbytes = _bytes(eqn, result)
  bandwidth = accelerator.hbm_bandwidth if accelerator else 0.0
  memory_s = nbytes / bandwidth if bandwidth else 0.0
  if counted:
    if name in _FUSED_ATTENTION:
      flops = fused_attention_flops(eqn)
    else:
      flops = conv_flops(eqn) if name == "conv_general_dilated" else float(result.flops)
    batched = name in _FUSED_ATTENTION or (name == "dot_general"
                                           and eqn.params["dimension_numbers"][1][0])
    cost = totals["attention" if batched else "matmul"]
    seconds = memory_s
    if accelerator:  # float32 operands run at the float32 peak (TF32 on GPUs).
      f32 = any(v.aval.dtype == np.float32 for v in eqn.invars[:2])
      seconds = max(flops / (accelerator.peak_f32 if f32 else accelerator.peak_bf16), memory_s)
    cost.flops += scale * flops
  else:
    cost, seconds = totals["elementwise"], memory_s
  cost.bytes += scale * nbytes
  cost.seconds += scale * seconds


def _add_kernel(eqn, accelerator, scale: float, totals: dict) -> None:
  """A Pallas kernel counts as a matrix product of its cost estimate (its body runs once per
  program of its grid, its loops' trip counts may be the program's)."""
  estimate = eqn.params.get("cost_estimate")
  if estimate is None:
    raise ValueError(f"pallas_call {eqn.params.get('name_and_src_info', '')} has no "
                     "cost_estimate: its FLOPs and bytes cannot be counted.")
  flops, nbytes = float(estimate.flops), float(estimate.bytes_accessed)
  seconds = 0.0
  if accelerator:
    f32 = any(v.aval.dtype == np.float32 for v in eqn.invars[:2])
    seconds = max(flops / (accelerator.peak_f32 if f32 else accelerator.peak_bf16),
                  nbytes / accelerator.hbm_bandwidth)
  cost = totals["matmul"]
  cost.flops += scale * flops
  cost.bytes += scale * nbytes
  cost.seconds += scale * seconds


def _walk(jaxpr, accelerator, scale: float, totals: dict, elementwise: bool) -> None:
  jaxpr = jaxpr.jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else jaxpr
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "cond":  # One branch runs: the dearest.
      branches = [jaxpr_costs(b, accelerator, elementwise) for b in eqn.params["branches"]]
      dearest = max(branches, key=lambda c: (sum(x.flops for x in c.values()),
                                             sum(x.bytes for x in c.values())))
      for c in CLASSES:
        totals[c] += dearest[c] * scale
    elif name == "scan":
      _walk(eqn.params["jaxpr"], accelerator, scale * eqn.params["length"], totals,
            elementwise)
    elif name == "shard_map":  # The body sees one device's shapes; it runs on each device.
      axes = eqn.params.get("newly_manual_axes", eqn.params.get("manual_axes"))  # By version.
      copies = math.prod(eqn.params["mesh"].shape[a] for a in axes)
      _walk(eqn.params["jaxpr"], accelerator, scale * copies, totals, elementwise)
    elif name == "pallas_call":
      _add_kernel(eqn, accelerator, scale, totals)
    elif subs := list(core.jaxprs_in_params(eqn.params)):
      # pjit, remat, custom_jvp/vjp calls, while (once): their sub-programs.
      for sub in subs:
        _walk(sub, accelerator, scale, totals, elementwise)
    else:
      _add_eqn(eqn, accelerator, scale, totals, elementwise)


def jaxpr_costs(jaxpr, accelerator=None, elementwise: bool = True) -> dict:
  """{op class: Cost} of a (closed) jaxpr over all its devices; seconds need `accelerator`
  (an accelerators.Accelerator: its peaks and HBM bandwidth), else 0. `elementwise=False`
  leaves that class empty (faster: the FLOPs alone)."""
  totals = {c: Cost() for c in CLASSES}
  _walk(jaxpr, accelerator, 1.0, totals, elementwise)
  return totals


def jaxpr_flops(jaxpr) -> float:
  """FLOPs of a (closed) jaxpr as the module docstring counts them, over all its devices."""
  costs = jaxpr_costs(jaxpr, elementwise=False)
  return costs["matmul"].flops + costs["attention"].flops


def traced_flops_per_device(traced, num_devices: int) -> float:
  """FLOPs per device of one call of `traced` (jax.jit(f).trace(...)), a step partitioned
  over `num_devices` devices."""
  return jaxpr_flops(traced.jaxpr) / num_devices
