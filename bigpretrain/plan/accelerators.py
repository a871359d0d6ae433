"""The accelerators bigpretrain plans for and reports MFU on, and their compile-only devices.

One table, ACCELERATORS, keyed by a short name ('v5e', 'h100', ...): per chip, its memory,
its peak dense FLOP/s and the JAX `device_kind` strings it reports, so that the plan's fit
(bigpretrain.plan.aot_plan) and the trainer's perf/mfu (bigpretrain.runtime.goodput) read the same entry.

`topology_devices('tpu:v5e:4x4')` / `topology_devices('gpu:h100:4x8')` returns the devices of a
TPU slice or a GPU cluster without the hardware: jax.experimental.topologies with libtpu (TPU)
or the CUDA PJRT plugin and a shipped GpuTargetConfigProto (GPU, gpu_specs/). Such devices
compile (jit(...).lower(...).compile()) with the accelerator's own compiler and run nothing.
"""
import dataclasses
import importlib.metadata
import importlib.util
import os
import pathlib
import re

GiB = 2**30
_GPU_SPECS = pathlib.Path(__file__).parent / "gpu_specs"


@dataclasses.dataclass(frozen=True)
class Accelerator:
  """One chip. `peak_bf16` / `peak_f32`: dense FLOP/s at bfloat16 and at float32 under
  jax.lax.Precision.DEFAULT (TPUs compute it in bfloat16 passes, so the bf16 peak; A100,
  H100 and H200 in TensorFloat-32, so the TF32 Tensor Core peak). NVIDIA lists Tensor Core
  peaks "with sparsity": the dense figures here are half of those. `hbm_bytes` counts GiB as
  the runtime reports memory (nvidia-smi shows ~79.6 GiB on an H100, ~140.4 GiB on an H200:
  read the margin, not a zero-margin fit). `hbm_bandwidth`: bytes/s; `interconnect_bandwidth`:
  the chip's bidirectional ICI (TPU) or NVLink (GPU) bytes/s as the datasheets state it, 0
  where this table has none (the roofline of collectives in bigpretrain/plan/aot_plan.py)."""
  name: str
  platform: str  # 'tpu' or 'gpu'.
  hbm_bytes: int
  peak_bf16: float
  peak_f32: float
  device_kinds: tuple[str, ...]
  target: str = ""  # TPU: libtpu's topology prefix; GPU: the gpu_specs/ file, if shipped.
  hbm_bandwidth: float = 0.0
  interconnect_bandwidth: float = 0.0

  def peak(self, compute_dtype: str) -> float:
    """Peak dense FLOP/s at `compute_dtype` ('bfloat16'; anything else at float32's)."""
    return self.peak_bf16 if compute_dtype == "bfloat16" else self.peak_f32


ACCELERATORS = {a.name: a for a in (
    # Google Cloud TPU docs, per chip: v4 32 GiB HBM2, 275 TFLOP/s bf16, 1,200 GB/s; v5e 16
    # GiB, 197, 819 GB/s, ICI 400 GB/s bidirectional; v5p 95 GiB, 459, 2,765 GB/s, ICI 1,200
    # GB/s; v6e (Trillium) 32 GiB, 918, 1,638 GB/s, ICI 800 GB/s.
    # v4 has no compile target: libtpu's 'v4:2x2x2' topology lists 16 devices for 8 chips.
    Accelerator("v4", "tpu", 32 * GiB, 275e12, 275e12, ("TPU v4",), hbm_bandwidth=1200e9),
    Accelerator("v5e", "tpu", 16 * GiB, 197e12, 197e12, ("TPU v5 lite", "TPU v5e"), "v5e",
                819e9, 400e9),
    Accelerator("v5p", "tpu", 95 * GiB, 459e12, 459e12, ("TPU v5", "TPU v5p"), "v5p",
                2765e9, 1200e9),
    Accelerator("v6e", "tpu", 32 * GiB, 918e12, 918e12, ("TPU v6 lite", "TPU v6e"), "v6e",
                1638e9, 800e9),
    # NVIDIA H100 datasheet: SXM 80 GB, BF16 1,979 / TF32 989 TFLOP/s with sparsity, 3.35 TB/s,
    # NVLink 900 GB/s; PCIe 80 GB, 1,513 / 756, 2 TB/s, NVLink bridge 600 GB/s; NVL 94 GB,
    # 1,671 / 835, 3.9 TB/s, NVLink 600 GB/s.
    Accelerator("h100", "gpu", 80 * GiB, 989.5e12, 494.5e12, ("NVIDIA H100 80GB HBM3",),
                "h100_sxm.txtpb", 3.35e12, 900e9),
    Accelerator("h100-pcie", "gpu", 80 * GiB, 756.5e12, 378e12, ("NVIDIA H100 PCIe",),
                hbm_bandwidth=2.0e12, interconnect_bandwidth=600e9),
    Accelerator("h100-nvl", "gpu", 94 * GiB, 835.5e12, 417.5e12, ("NVIDIA H100 NVL",),
                hbm_bandwidth=3.9e12, interconnect_bandwidth=600e9),
    # NVIDIA H200 datasheet: SXM 141 GB, BF16 1,979 / TF32 989 with sparsity; NVL 1,671 / 835;
    # both 4.8 TB/s and NVLink 900 GB/s.
    Accelerator("h200", "gpu", 141 * GiB, 989.5e12, 494.5e12,
                ("NVIDIA H200", "NVIDIA H200 141GB HBM3e"), "h200.txtpb", 4.8e12, 900e9),
    Accelerator("h200-nvl", "gpu", 141 * GiB, 835.5e12, 417.5e12, ("NVIDIA H200 NVL",),
                hbm_bandwidth=4.8e12, interconnect_bandwidth=900e9),
    # NVIDIA A100 datasheet (40 and 80 GB, SXM and PCIe): BF16 312, TF32 156 dense; 40 GB
    # 1,555 GB/s, 80 GB SXM 2,039 GB/s (PCIe 1,935); NVLink 600 GB/s.
    Accelerator("a100-40", "gpu", 40 * GiB, 312e12, 156e12,
                ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"), hbm_bandwidth=1555e9,
                interconnect_bandwidth=600e9),
    Accelerator("a100-80", "gpu", 80 * GiB, 312e12, 156e12,
                ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"), "a100_sxm_80.txtpb",
                2039e9, 600e9),
)}
_BY_KIND = {kind: a for a in ACCELERATORS.values() for kind in a.device_kinds}


def get(name: str) -> Accelerator:
  """The table's entry for `name`, or a ValueError naming the known ones."""
  if name not in ACCELERATORS:
    raise ValueError(f"Accelerator {name!r} is unknown; known: {sorted(ACCELERATORS)}.")
  return ACCELERATORS[name]


def by_device_kind(device_kind: str) -> Accelerator | None:
  """The entry of a JAX device_kind (e.g. 'TPU v5 lite', 'NVIDIA H100 80GB HBM3'), or None."""
  return _BY_KIND.get(device_kind)


@dataclasses.dataclass(frozen=True)
class Topology:
  """A parsed --topology: 'tpu:v5p:4x4x4' (chips along the slice's axes, as libtpu names
  slices; 'tpu:v5e:16x16:4' is four such slices over the data-center network, Multislice) or
  'gpu:h100:4x8' (nodes x GPUs per node)."""
  accelerator: Accelerator
  shape: tuple[int, ...]
  slices: int = 1

  @property
  def devices_per_slice(self) -> int:
    n = 1
    for d in self.shape:
      n *= d
    return n

  @property
  def num_devices(self) -> int:
    return self.devices_per_slice * self.slices

  @property
  def spec(self) -> str:
    return (f"{self.accelerator.platform}:{self.accelerator.name}:" + "x".join(
        map(str, self.shape)) + (f":{self.slices}" if self.slices > 1 else ""))


def parse_topology(spec: str) -> Topology:
  """'tpu:v5e:2x2' / 'tpu:v5e:2x2:2' / 'gpu:h100:4x8' -> Topology, or a ValueError saying
  what is accepted."""
  parts = spec.split(":")
  compilable = sorted(n for n, a in ACCELERATORS.items() if a.target)
  usage = (f"--topology={spec!r}: expected PLATFORM:CHIP:SHAPE[:SLICES], e.g. tpu:v5e:2x2, "
           f"tpu:v5p:4x4x4 (chips per slice axis), tpu:v5e:16x16:4 (four slices) or "
           f"gpu:h100:4x8 (nodes x GPUs per node); CHIP one of {compilable}.")
  if (len(parts) not in (3, 4) or not re.fullmatch(r"\d+(x\d+)*", parts[2])
      or not re.fullmatch(r"\d+", (parts + ["1"])[3])):
    raise ValueError(usage)
  platform, name, shape = parts[0], parts[1], tuple(int(d) for d in parts[2].split("x"))
  slices = int((parts + ["1"])[3])
  acc = ACCELERATORS.get(name)
  if (acc is None or not acc.target or acc.platform != platform or min(shape) < 1
      or slices < 1):
    raise ValueError(usage)
  if platform == "gpu" and (len(shape) != 2 or len(parts) == 4):
    raise ValueError(f"--topology={spec!r}: a GPU cluster is NODESxGPUS_PER_NODE, e.g. 4x8.")
  return Topology(acc, shape, slices)


def _jax_requirement(extra: str, package: str) -> str | None:
  """jax's own requirement for `package` under its extra `extra`, e.g. 'libtpu==0.0.42.*'."""
  for req in importlib.metadata.requires("jax") or ():
    name, _, marker = req.partition(";")
    if f'extra == "{extra}"' in marker and re.match(rf"{re.escape(package)}\b", name.strip()):
      return re.sub(r"\[.*?\]", "", name.strip())
  return None


def _version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def compiler_problem(platform: str) -> str | None:
  """Why the `platform` ('tpu'/'gpu') compiler cannot be used with the installed jax (with
  the exact pip command that fixes it), or None when it can: libtpu must match jax's own
  'tpu' extra pin, the CUDA plugin and its PJRT library jax's version, and the deviceless
  GPU compile needs ptxas and libdevice (the nvidia-cuda-nvcc wheel, see setup.py)."""
  jax_version = _version("jax")
  if platform == "tpu":
    want = _jax_requirement("tpu", "libtpu") or f"libtpu  # the pin of jax[tpu]=={jax_version}"
    have = _version("libtpu")
    pin = re.fullmatch(r"libtpu==([\w.]+?)(\.\*)?", want)
    if have is None:
      return f"libtpu is not installed: pip install '{want}' (or pip install 'bigpretrain[tpu]')."
    if pin and not (have == pin.group(1) or (pin.group(2) and have.startswith(pin.group(1) + "."))):
      return f"libtpu {have} does not match jax {jax_version}'s pin: pip install '{want}'."
    return None
  if platform == "gpu":
    wanted = [f"jax-cuda13-plugin=={jax_version}", f"jax-cuda13-pjrt=={jax_version}"]
    bad = [w for w in wanted if _version(w.split("==")[0]) != jax_version]
    if importlib.util.find_spec("nvidia") is None or not _nvidia_tool("bin/ptxas"):
      bad.append("nvidia-cuda-nvcc>=13.0.48,<14")
    if bad:
      return ("The deviceless GPU compile needs " + ", ".join(bad) + ": pip install "
              + " ".join(f"'{b}'" for b in bad) + " (or pip install 'bigpretrain[cuda]').")
    return None
  raise ValueError(f"Unknown platform {platform!r}.")


def _nvidia_tool(rel: str) -> bool:
  spec = importlib.util.find_spec("nvidia")
  return any((pathlib.Path(p) / "cu13" / rel).exists()
             for p in (spec.submodule_search_locations or ()))


def compiler_name(device) -> str:
  """Which compiler a plan on `device` comes from, with its version (every figure says so)."""
  if device.platform == "tpu":
    return f"libtpu {_version('libtpu')} ({device.device_kind})"
  if device.platform in ("gpu", "cuda"):
    return f"XLA:GPU, jax-cuda13-plugin {_version('jax-cuda13-plugin')} ({device.device_kind})"
  return f"XLA:CPU, jaxlib {_version('jaxlib')}"


# Cloud TPU's accelerator-type names (e.g. v5p-8 is a 2x2x1 slice): target -> (prefix, cores
# per chip).
_CLOUD_TPU_TYPES = {"v5e": ("v5litepod", 1), "v5p": ("v5p", 2), "v6e": ("v6e", 1)}


def topology_devices(topology: Topology | str) -> list:
  """The compile-only devices of `topology` (see the module docstring), in the order JAX
  lists them. Raises RuntimeError with the install command when the compiler is missing."""
  topo = parse_topology(topology) if isinstance(topology, str) else topology
  acc = topo.accelerator
  problem = compiler_problem(acc.platform)
  if problem:
    raise RuntimeError(problem)
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  if acc.platform == "tpu":
    # A deviceless compile touches no chip: it need not wait for (or take) the libtpu lock
    # that a training process on the same host holds.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # Off a TPU VM libtpu cannot look up the slice's hosts or chip type and logs errors
    # (E0000 ... TPU_WORKER_HOSTNAMES) although the compile succeeds; a compile needs neither.
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    prefix, cores_per_chip = _CLOUD_TPU_TYPES[acc.target]
    os.environ.setdefault("TPU_ACCELERATOR_TYPE",
                          f"{prefix}-{cores_per_chip * topo.devices_per_slice}")
    desc = topologies.get_topology_desc(
        platform="tpu", topology_name=f"{acc.target}:" + "x".join(map(str, topo.shape)),
        **({"num_slices": topo.slices} if topo.slices > 1 else {}))
  else:
    nodes, per_node = topo.shape
    desc = topologies.get_topology_desc(
        platform="cuda", topology_name=acc.name,
        target_config=(_GPU_SPECS / acc.target).read_text(), topology=f"1x{nodes}x{per_node}")
  devices = list(desc.devices)
  if len(devices) != topo.num_devices:
    raise RuntimeError(f"--topology={topo.spec} gave {len(devices)} devices, expected "
                       f"{topo.num_devices}.")
  return devices
