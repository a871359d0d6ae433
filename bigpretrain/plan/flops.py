"""FLOPs of a traced step, counted on its jaxpr: 2 x the multiply-adds of its matrix products
(dot_general) and convolutions, the work that MFU counts.

Why not XLA's cost analysis of the compiled step: XLA:GPU hands matrix products and
convolutions to cuBLAS and cuDNN as custom calls, which its cost analysis does not count, so
on GPUs it reports a small fraction of the step's FLOPs.
The jaxpr is the same program on every backend, before partitioning: its shapes are global,
and a step's FLOPs per device are its count over the devices of its mesh. Elementwise work
(normalisation, activations, softmax) is not counted; rematerialised blocks are, as often as
the differentiated program runs them.
"""
import math

from jax.extend import core


def _dot_flops(eqn) -> float:
  lhs, rhs = (v.aval for v in eqn.invars[:2])
  (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
  rhs_free = [d for d in range(rhs.ndim) if d not in (*rhs_contract, *rhs_batch)]
  return 2.0 * math.prod(lhs.shape) * math.prod(rhs.shape[d] for d in rhs_free)


def _conv_flops(eqn) -> float:
  # Every output element sums over the kernel's input features and window (as given: with
  # feature groups the kernel's input dimension is already per group), padding included.
  rhs, out = eqn.invars[1].aval, eqn.outvars[0].aval
  rhs_spec = eqn.params["dimension_numbers"].rhs_spec  # (out features, in features, window)
  per_output = math.prod(rhs.shape[d] for d in rhs_spec[1:])
  return 2.0 * math.prod(out.shape) * per_output


def jaxpr_flops(jaxpr) -> float:
  """FLOPs of a (closed) jaxpr as the module docstring counts them, over all its devices."""
  jaxpr = jaxpr.jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else jaxpr
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      total += _dot_flops(eqn)
    elif name == "conv_general_dilated":
      total += _conv_flops(eqn)
    elif name == "cond":  # One branch runs: the dearest.
      total += max(jaxpr_flops(b) for b in eqn.params["branches"])
    elif name == "scan":
      total += eqn.params["length"] * jaxpr_flops(eqn.params["jaxpr"])
    elif name == "shard_map":  # The body sees one device's shapes; it runs on each device.
      axes = eqn.params.get("newly_manual_axes", eqn.params.get("manual_axes"))  # By version.
      copies = math.prod(eqn.params["mesh"].shape[a] for a in axes)
      total += copies * jaxpr_flops(eqn.params["jaxpr"])
    else:  # pjit, remat, custom_jvp/vjp calls, while (once): their sub-programs.
      total += sum(jaxpr_flops(sub) for sub in core.jaxprs_in_params(eqn.params))
  return total


def traced_flops_per_device(traced, num_devices: int) -> float:
  """FLOPs per device of one call of `traced` (jax.jit(f).trace(...)), a step partitioned
  over `num_devices` devices."""
  return jaxpr_flops(traced.jaxpr) / num_devices
