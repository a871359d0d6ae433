"""Device mesh, logical-axis -> mesh-axis rules, and placement of params and batches.

Parameters carry logical axis names (`nnx.with_partitioning`); `config.sharding_rules` maps
logical names to mesh axes with flax.linen's (and MaxText's) semantics: rules in order of
priority, a name's later rules tried where its earlier ones' axes are taken. A dimension
whose size does not divide its mesh axis stays replicated rather than failing, so small
heads and odd widths still work; param_report says which arrays, and what they cost each
device (the trainer warns of them, the plan prints them). Model code may pin a dimension of
an activation or of a reshaped weight by its logical name too (`constrain`), under the rules
a step is traced with (`with_rules`, `use_rules`; MaxText's logical constraints alike).
"""
from collections.abc import Mapping, Sequence
import contextlib
import contextvars
import dataclasses
import functools
import math

from absl import logging
from flax import nnx
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from bigpretrain.runtime import units

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
  return _logical_to_mesh(logical, shape, rules, mesh)[0]


def _logical_to_mesh(logical, shape, rules, mesh
                     ) -> tuple[P, set[str], dict[str, tuple[int, ...]]]:
  """logical_to_mesh's spec; the mesh axes a rule names for the array that shard none of its
  dimensions; and {axis: the sizes of the dimensions a rule named for it that do not divide
  it}, whether the axis then went to another dimension or not (a dimension that did not get
  its own axis may take the one another dimension's rule wanted, which then goes unused).
  The one place the decision is made, so that reports of it agree."""
  logical = tuple(logical)
  spec, used, indivisible = [_FREE if name is not None else None for name in logical], set(), {}
  named = set()
  for name, axis in rules:
    if name not in logical:
      continue
    named.add(axis)
    if spec[logical.index(name)] is not _FREE:
      continue
    pos = logical.index(name)
    if axis is None:
      spec[pos] = None
    elif axis not in used and shape[pos] % mesh.shape[axis] == 0:
      used.add(axis)
      spec[pos] = axis if mesh.shape[axis] > 1 else None
    elif axis not in used:
      indivisible[axis] = indivisible.get(axis, ()) + (shape[pos],)
  spec = P(*(None if a is _FREE else a for a in spec))
  return spec, named - used - {None}, indivisible


def _logical_names(var: nnx.Variable) -> tuple[str | None, ...]:
  """A variable's logical axis names, one per dimension (None where it names none)."""
  names = var.get_metadata().get("out_sharding") or ()
  return tuple(names) + (None,) * (var.value.ndim - len(names))


_RULES = contextvars.ContextVar("logical_rules", default=None)


@contextlib.contextmanager
def use_rules(rules):
  """The logical `rules` in force for `constrain` calls in what is traced inside."""
  token = _RULES.set(tuple(tuple(r) for r in rules))
  try:
    yield
  finally:
    _RULES.reset(token)


def with_rules(fn, rules):
  """`fn` run (and so traced) with the logical `rules` in force (use_rules)."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with use_rules(rules):
      return fn(*args, **kwargs)
  return wrapped


def constrained_axis(logical: Sequence[str | None], shape: Sequence[int],
                     name: str) -> str | None:
  """The mesh axis `constrain` would pin the dimension named `name` of an array of `shape` to:
  the one the rules in force (with_rules) give it, if of size > 1 and Auto (explicit axes
  carry the sharding in the type); None without rules or outside a mesh."""
  rules, mesh = _RULES.get(), jax.sharding.get_abstract_mesh()
  if rules is None or mesh.empty:
    return None
  axis = logical_to_mesh(logical, shape, rules, mesh)[list(logical).index(name)]
  if axis is None or dict(zip(mesh.axis_names, mesh.axis_types))[axis] != (
      jax.sharding.AxisType.Auto):
    return None
  return axis


def constrain(x: jax.Array, logical: Sequence[str | None], name: str) -> jax.Array:
  """`x` with the dimension that logical name `name` labels pinned to constrained_axis, the
  other dimensions left to the compiler (a no-op where that axis is None)."""
  axis = constrained_axis(logical, x.shape, name)
  if axis is None:
    return x
  spec = [P.UNCONSTRAINED] * x.ndim
  spec[list(logical).index(name)] = axis
  return jax.lax.with_sharding_constraint(x, P(*spec))


def state_shardings(abstract_state: nnx.State, rules, mesh: Mesh):
  """Pure-dict pytree of NamedShardings for an (abstract) nnx.State with logical metadata."""
  def one(var):
    return NamedSharding(mesh, logical_to_mesh(_logical_names(var), var.value.shape, rules,
                                               mesh))
  shardings = jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.to_pure_dict(shardings)


@dataclasses.dataclass(frozen=True)
class Replicated:
  """A parameter that the rules put on mesh axes of size > 1 but that stays whole on some,
  because a dimension the rules named for an axis does not divide its size: none of them
  divides that axis, or one took another's axis in its place (6 input channels not on
  fsdp=4, the outputs on fsdp then, and not on tensor)."""
  name: str  # Its path in the params, '/'-separated.
  shape: tuple[int, ...]
  bytes: int  # The whole array's.
  device_bytes: int  # What each device holds of it.
  axes: dict[str, int]  # {mesh axis: size} it stays replicated on.
  # {mesh axis: the sizes of the dimensions named for it that do not divide it}: what a
  # smaller axis size (fitting_sizes) or padding would have to divide.
  dims: dict[str, tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class ParamReport:
  """How far the rules shard the parameters on a mesh: what each device holds against the
  ideal (every array split over all the mesh axes the rules name), and the arrays left
  replicated on an axis because their dimensions do not divide it (largest first). Rules
  pass such arrays over without failing, so that odd widths still run, but on a large mesh
  they can hold most of each device's parameter memory."""
  device_bytes: int  # The parameter bytes each device holds.
  ideal_bytes: int  # The total bytes over the product of the rules' mesh axes' sizes.
  total_bytes: int
  shard_axes: dict[str, int]  # {mesh axis the rules name: size}.
  replicated: tuple[Replicated, ...]

  @property
  def replicated_device_bytes(self) -> int:
    return sum(r.device_bytes for r in self.replicated)

  def fitting_sizes(self) -> dict[str, int]:
    """{axis: the largest size dividing the axis's current size at which every replicated
    array's dimensions named for it would divide it} (1: none does; pad those dimensions)."""
    out = {}
    for axis in sorted({a for r in self.replicated for a in r.dims}):
      size, dims = self.shard_axes[axis], [r.dims[axis] for r in self.replicated
                                           if axis in r.dims]
      out[axis] = max(d for d in range(1, size + 1) if size % d == 0 and all(
          any(n % d == 0 for n in named) for named in dims))
    return out

  def describe(self, top: int = 3) -> str:
    """One line: the replicated arrays if any, and the per-device bytes against the ideal."""
    axes = " x ".join(f"{a}={n}" for a, n in self.shard_axes.items()) or "no axis"
    held = (f"{units.size(self.device_bytes)} of parameters per device, "
            f"{self.device_bytes / max(self.ideal_bytes, 1):.1f}x the ideal "
            f"{units.size(self.ideal_bytes)} (all split over {axes})")
    if not self.replicated:
      return held
    n = len(self.replicated)
    largest = ", ".join(
        f"{r.name} {r.shape} {units.size(r.device_bytes)} on "
        + "+".join(f"{a}={k}" for a, k in r.axes.items()) for r in self.replicated[:top])
    return (f"{n} parameter array{'s' if n > 1 else ''} stay replicated on a mesh axis, a "
            "dimension the rules name not dividing its axis, "
            f"{units.size(self.replicated_device_bytes)} per device (largest: {largest}): {held}")

  def advice(self) -> str:
    """What to do about the replicated arrays: the axis sizes that would divide them, or
    padding where no smaller size does."""
    out = []
    for axis, size in self.fitting_sizes().items():
      if size > 1:
        out.append(f"{axis}={size} divides them all (its other factor "
                   f"{self.shard_axes[axis] // size} can go to 'data')")
      else:
        out.append(f"no {axis} size above 1 dividing {self.shard_axes[axis]} divides them all: "
                   f"pad those dimensions to a multiple of {self.shard_axes[axis]}")
    return ("Choose mesh axis sizes (config.mesh) that divide the model's channel and class "
            "counts, or pad those dimensions: " + "; ".join(out) + ".")


def param_report(abstract_params: nnx.State, rules, mesh: Mesh) -> ParamReport:
  """The ParamReport of (abstract) params with logical metadata under `rules` on `mesh`,
  from the same decision state_shardings makes."""
  shard_axes = {a: mesh.shape[a] for a in MESH_AXES
                if any(r[1] == a for r in rules) and mesh.shape[a] > 1}
  device = total = 0
  replicated = []
  for path, var in nnx.to_flat_state(abstract_params):
    shape, itemsize = tuple(var.value.shape), np.dtype(var.value.dtype).itemsize
    spec, lost, indivisible = _logical_to_mesh(_logical_names(var), shape, rules, mesh)
    nbytes = math.prod(shape) * itemsize
    held = math.prod(NamedSharding(mesh, spec).shard_shape(shape)) * itemsize
    device, total = device + held, total + nbytes
    axes = {a: mesh.shape[a] for a in sorted(lost) if mesh.shape[a] > 1}
    if axes and any(mesh.shape[a] > 1 for a in indivisible):  # Else no rule could shard more.
      replicated.append(Replicated(
          name="/".join(str(k) for k in path), shape=shape, bytes=nbytes, device_bytes=held,
          axes=axes, dims={a: d for a, d in indivisible.items() if mesh.shape[a] > 1}))
  replicated.sort(key=lambda r: -r.device_bytes)
  return ParamReport(device_bytes=device, ideal_bytes=total // math.prod(shard_axes.values()),
                     total_bytes=total, shard_axes=shard_axes, replicated=tuple(replicated))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_processes(mesh: Mesh) -> list[int]:
  """The process that feeds each shard of the batch, in the global batch's row order."""
  return [d.process_index for d in mesh.devices[:, :, 0].flat]


def check_batch_size(global_batch_size: int, mesh: Mesh, name: str = "config.batch_size") -> None:
  """The global batch must split evenly over data-parallel devices and over processes;
  `name`: the setting's, for the message."""
  dp = mesh.shape["data"] * mesh.shape["fsdp"]
  if global_batch_size % dp:
    raise ValueError(f"{name}={global_batch_size} is not divisible by the "
                     f"{dp} data-parallel devices (mesh data={mesh.shape['data']} x "
                     f"fsdp={mesh.shape['fsdp']}).")
  if global_batch_size % jax.process_count():
    raise ValueError(f"{name}={global_batch_size} is not divisible by the "
                     f"{jax.process_count()} processes.")
  if dp % jax.process_count():  # Each process loads rows of its own: shards of its own.
    raise ValueError(f"the mesh splits the batch over {dp} data-parallel devices (data="
                     f"{mesh.shape['data']} x fsdp={mesh.shape['fsdp']}), fewer than or not a "
                     f"multiple of the {jax.process_count()} processes: processes sharing a "
                     "batch shard would feed it different rows. Give data x fsdp a multiple "
                     "of the process count (config.mesh).")


def inference_mesh(fsdp: int, batch_size: int, name: str = "--{}") -> Mesh:
  """The mesh of the inference commands (pool predictions, dedup, zero-shot): the batch over
  every device, `fsdp` of them sharding the weights. Refuses an fsdp or global batch the
  devices cannot take, naming the settings as `name` formats them ('--{}': flags,
  'config.infer.{}': the semi-supervised runner's sections)."""
  n = jax.device_count()
  if isinstance(fsdp, bool) or not isinstance(fsdp, int) or fsdp < 1 or n % fsdp:
    raise ValueError(f"{name.format('fsdp')}={fsdp!r} must be a positive divisor of the {n} "
                     "devices.")
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"{name.format('batch_size')}={batch_size!r} must be a positive integer.")
  mesh = make_mesh({"data": -1, "fsdp": fsdp, "tensor": 1})
  check_batch_size(batch_size, mesh, name.format("batch_size"))
  return mesh


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
