"""Device mesh, logical-axis -> mesh-axis rules, and placement of params and batches.

Parameters carry logical axis names (`nnx.with_partitioning`); `config.sharding_rules` maps
logical names to mesh axes with flax.linen's (and MaxText's) semantics: rules in order of
priority, a name's later rules tried where its earlier ones' axes are taken. A dimension
whose size does not divide its mesh axis stays replicated rather than failing, so small
heads and odd widths still work.
"""
from collections.abc import Mapping, Sequence
import math

from absl import logging
from flax import nnx
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

MESH_AXES = ("data", "fsdp", "tensor")
# The batch is split over every data-parallel axis: FSDP is data parallelism too.
BATCH_AXES = ("data", "fsdp")


def mesh_shape(mesh_cfg: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
  """Resolves `-1` in {'data','fsdp','tensor'} to the remaining devices; checks the product."""
  sizes = [int(mesh_cfg[a]) for a in MESH_AXES]
  if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
    raise ValueError(f"config.mesh={dict(zip(MESH_AXES, sizes))}: each axis must be a positive "
                     "int, with at most one -1 (= all remaining devices).")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(f"config.mesh={dict(zip(MESH_AXES, sizes))}: {num_devices} devices are not "
                       f"divisible by the fixed axes' product {known}.")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(f"config.mesh={dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                     f"but {num_devices} are available.")
  return tuple(sizes)


def make_mesh(mesh_cfg: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ('data', 'fsdp', 'tensor') mesh over all (or the given) devices.

  Over several TPU slices (Multislice) the 'data' axis spans them, as MaxText's data
  parallelism over the data-center network: only the gradients' reduction crosses it,
  'fsdp' and 'tensor' stay inside a slice (jax.make_mesh refuses such devices)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(mesh_cfg, len(devices))
  auto = (jax.sharding.AxisType.Auto,) * 3
  slices = len({getattr(d, "slice_index", 0) for d in devices})
  if slices > 1:
    if shape[0] % slices:
      raise ValueError(
          f"config.mesh={dict(zip(MESH_AXES, shape))}: the devices are {slices} TPU slices and "
          f"the 'data' axis spans them, so data={shape[0]} must be a multiple of {slices} "
          "('fsdp' and 'tensor' stay inside a slice).")
    from jax.experimental import mesh_utils  # pylint: disable=import-outside-toplevel
    grid = mesh_utils.create_hybrid_device_mesh(
        (shape[0] // slices, *shape[1:]), (slices, 1, 1), devices,
        allow_split_physical_axes=True)
    return Mesh(grid, MESH_AXES, axis_types=auto)
  if devices == jax.devices():
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


_FREE = object()  # A dimension no rule has taken yet.


def logical_to_mesh(logical: Sequence[str | None], shape: Sequence[int],
                    rules: Sequence[tuple[str, str | None]], mesh: Mesh) -> P:
  """PartitionSpec for one array from its logical axis names and the rules.

  flax.linen's logical_to_mesh_axes semantics: the rules are read in order, and each one
  gives the (first) dimension of its logical name its mesh axis, unless an earlier rule took
  that dimension (a None rule takes it unsharded) or the axis already shards another
  dimension of the array. A name may so have several rules, tried in order:
  ('embed', 'fsdp'), ('embed', 'tensor') puts 'embed' on 'tensor' where 'fsdp' is taken.
  A size-1 axis takes its dimension as in flax, and shards nothing (None in the spec); a rule
  whose axis does not divide the dimension is passed over (the dimension stays free for a
  later rule, the axis for another dimension), so odd widths stay replicated, not failing.
  """
  logical = tuple(logical)
  spec, used = [_FREE if name is not None else None for name in logical], set()
  for name, axis in rules:
    if name not in logical or spec[logical.index(name)] is not _FREE:
      continue
    pos = logical.index(name)
    if axis is None:
      spec[pos] = None
    elif axis not in used and shape[pos] % mesh.shape[axis] == 0:
      used.add(axis)
      spec[pos] = axis if mesh.shape[axis] > 1 else None
  return P(*(None if a is _FREE else a for a in spec))


def state_shardings(abstract_state: nnx.State, rules, mesh: Mesh):
  """Pure-dict pytree of NamedShardings for an (abstract) nnx.State with logical metadata."""
  def one(var):
    names = var.get_metadata().get("out_sharding") or ()
    names = tuple(names) + (None,) * (var.value.ndim - len(names))
    return NamedSharding(mesh, logical_to_mesh(names, var.value.shape, rules, mesh))
  shardings = jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.to_pure_dict(shardings)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_processes(mesh: Mesh) -> list[int]:
  """The process that feeds each shard of the batch, in the global batch's row order."""
  return [d.process_index for d in mesh.devices[:, :, 0].flat]


def check_batch_size(global_batch_size: int, mesh: Mesh) -> None:
  """The global batch must split evenly over data-parallel devices and over processes."""
  dp = mesh.shape["data"] * mesh.shape["fsdp"]
  if global_batch_size % dp:
    raise ValueError(f"config.batch_size={global_batch_size} is not divisible by the "
                     f"{dp} data-parallel devices (mesh data={mesh.shape['data']} x "
                     f"fsdp={mesh.shape['fsdp']}).")
  if global_batch_size % jax.process_count():
    raise ValueError(f"config.batch_size={global_batch_size} is not divisible by the "
                     f"{jax.process_count()} processes.")
  if dp % jax.process_count():  # Each process loads rows of its own: shards of its own.
    raise ValueError(f"the mesh splits the batch over {dp} data-parallel devices (data="
                     f"{mesh.shape['data']} x fsdp={mesh.shape['fsdp']}), fewer than or not a "
                     f"multiple of the {jax.process_count()} processes: processes sharing a "
                     "batch shard would feed it different rows. Give data x fsdp a multiple "
                     "of the process count (config.mesh).")


def global_batch(local_batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Stitches each host's rows into global arrays sharded along the batch axes.

  A scalar '_skipped' (the corrupt records this host skipped making its rows) becomes a
  column holding the count in the host's first row and 0 elsewhere, so that its sum over the
  global batch counts every host's."""
  sharding = batch_sharding(mesh)
  if np.ndim(local_batch.get("_skipped", ())) == 0:
    skipped = np.zeros(len(local_batch["image"]), np.int32)
    skipped[0] = local_batch["_skipped"]
    local_batch = {**local_batch, "_skipped": skipped}
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in local_batch.items()}


def log_shardings(shardings, abstract) -> None:
  """Logs each parameter's shape and PartitionSpec once (the 'golden' view of a run)."""
  flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
  shapes = jax.tree.leaves(abstract)
  for (path, s), a in zip(flat, shapes):
    logging.info("param %-60s %-20s %s", jax.tree_util.keystr(path, simple=True, separator="/"),
                 str(a.shape), s.spec)
