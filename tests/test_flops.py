"""bigpretrain/plan/flops.py: FLOPs counted on the jaxpr, against hand formulas and XLA:CPU's own
count (which, unlike XLA:GPU's, includes matrix products and convolutions)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bigpretrain.plan import flops


def _count(f, *args):
  return flops.jaxpr_flops(jax.jit(f).trace(*args).jaxpr)


def _xla_cpu(f, *args):
  cost = jax.jit(f).lower(*args).compile().cost_analysis()
  return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


def _conv(x, k, groups=1):
  return jax.lax.conv_general_dilated(x, k, (1, 1), "VALID", feature_group_count=groups,
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
