"""Multi-controller start-up: one `jax.distributed.initialize` for TPU pods, SLURM and flags.

Detection order: explicit coordinator (flags, or BIGPRETRAIN_COORDINATOR_ADDRESS /
BIGPRETRAIN_NUM_PROCESSES / BIGPRETRAIN_PROCESS_ID), then a multi-host TPU slice, then a
multi-task SLURM job (JAX reads SLURM_* itself). A single process needs no initialisation.
On GPUs, the XLA/CUDA settings of gpu_flags are applied first, before the backend starts.

Before that, `select_platforms` starts JAX only on the platforms the host has: with the compile
extras installed (libtpu, the CUDA plugin: deviceless compiles for `plan --topology`), JAX
would otherwise initialise each plugin on every host and print a CUDA-plugin traceback and
libtpu errors on a machine that has neither device, which reads as a crash.
"""
import glob
import hashlib
import os
import socket

from absl import flags
from absl import logging
import jax
import numpy as np

from bigpretrain.plan import gpu_flags
from bigpretrain.runtime import console


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if value in (None, ""):
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"{name}={value!r} must be an integer.") from None


def detect() -> tuple[str, dict]:
  """Returns (kind, kwargs for jax.distributed.initialize) from the environment."""
  address = os.environ.get("BIGPRETRAIN_COORDINATOR_ADDRESS")
  if address:
    kwargs = {"coordinator_address": address,
              "num_processes": _env_int("BIGPRETRAIN_NUM_PROCESSES"),
              "process_id": _env_int("BIGPRETRAIN_PROCESS_ID")}
    if kwargs["num_processes"] is None or kwargs["process_id"] is None:
      raise ValueError("BIGPRETRAIN_COORDINATOR_ADDRESS is set: also set BIGPRETRAIN_NUM_PROCESSES "
                       "and BIGPRETRAIN_PROCESS_ID.")
    return "explicit", kwargs
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  if len([h for h in hosts.split(",") if h]) > 1 or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
    return "tpu_pod", {}
  if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
    if "SLURM_STEP_NODELIST" not in os.environ:  # What JAX reads the coordinator from.
      raise ValueError(
          f"SLURM_NTASKS={os.environ['SLURM_NTASKS']} but this process is not one of the "
          "job's tasks (no SLURM_STEP_NODELIST: it runs in the batch script itself). Start "
          "the tasks with srun (launch/slurm.sbatch does), one per GPU.")
    return "slurm", {}
  return "single", {}


def installed_plugins() -> set[str]:
  """The accelerator platforms whose JAX plugin is installed: 'tpu' (libtpu), 'cuda' and
  'rocm' (jax_plugins.xla_cuda* / xla_rocm*)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import pkgutil  # pylint: disable=import-outside-toplevel
  found = {"tpu"} if importlib.util.find_spec("libtpu") is not None else set()
  try:
    import jax_plugins  # pylint: disable=import-outside-toplevel
  except ImportError:
    return found
  for module in pkgutil.iter_modules(jax_plugins.__path__):
    for platform in ("cuda", "rocm"):
      if module.name.startswith(f"xla_{platform}"):
        found.add(platform)
  return found


# The pip extra that brings each accelerator's JAX plugin.
_PLUGIN_PACKAGE = {"tpu": "jax[tpu]", "cuda": "jax[cuda12]", "rocm": "jax-rocm plugin"}


def host_platforms(dev: str = "/dev", installed: set[str] | None = None) -> str:
  """The JAX platforms of this host's devices, accelerators first: 'tpu' on a TPU VM (its
  chips are /dev/accel* or /dev/vfio/N), 'cuda' with an NVIDIA driver (/dev/nvidiactl) and
  some GPU visible (CUDA_VISIBLE_DEVICES not '' or -1), 'rocm' with an AMD one (/dev/kfd);
  'cpu' always. An accelerator whose JAX plugin is not installed (`installed`, default
  installed_plugins()) is left out with a warning: JAX could not start it, and the run goes
  on on the CPU instead of stopping."""
  found = []
  if glob.glob(os.path.join(dev, "accel*")) or glob.glob(os.path.join(dev, "vfio", "[0-9]*")):
    found.append("tpu")
  if (os.path.exists(os.path.join(dev, "nvidiactl"))
      and os.environ.get("CUDA_VISIBLE_DEVICES") not in ("", "-1")):
    found.append("cuda")
  if os.path.exists(os.path.join(dev, "kfd")):
    found.append("rocm")
  installed = installed_plugins() if installed is None else installed
  for platform in [p for p in found if p not in installed]:
    logging.warning("This host has %s devices but JAX's %s plugin is not installed (pip "
                    "install '%s'): running on the CPU.", platform, platform,
                    _PLUGIN_PACKAGE[platform])
    found.remove(platform)
  return ",".join(found + ["cpu"])


def select_platforms() -> str:
  """Sets jax_platforms to host_platforms() unless JAX_PLATFORMS (or the config) already
  says which, or a backend has started; logs the choice in one line; returns it."""
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  chosen = jax.config.jax_platforms
  if chosen or xla_bridge.backends_are_initialized():
    logging.info("JAX platforms: %s (as set).", chosen or "already started")
    return chosen or ""
  chosen = host_platforms()
  jax.config.update("jax_platforms", chosen)
  logging.info("JAX platforms: %s (the devices this host has; JAX_PLATFORMS overrides).",
               chosen)
  return chosen


INIT_TIMEOUT_S = 300  # jax.distributed.initialize's default.


def check_explicit(coordinator_address: str, num_processes: int, process_id: int) -> None:
  """ValueError unless the address is host:port and 0 <= process_id < num_processes."""
  host, _, port = coordinator_address.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"coordinator address {coordinator_address!r} must be host:port (process "
                     "0's host name or IP and a free port, e.g. 10.0.0.1:1234).")
  if num_processes < 1 or not 0 <= process_id < num_processes:
    raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes}).")


def maybe_initialize(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> str:
  """Initialises jax.distributed when running on several processes; returns what was found.
  First picks the platforms this host has (select_platforms)."""
  select_platforms()
  applied = gpu_flags.apply()
  if applied:
    logging.info("GPU settings added (user-set values kept): %s", applied)
  if coordinator_address:
    kind, kwargs = "explicit", {"coordinator_address": coordinator_address,
                                "num_processes": num_processes, "process_id": process_id}
    if num_processes is None or process_id is None:
      raise ValueError("--coordinator_address needs --num_processes and --process_id.")
  else:
    kind, kwargs = detect()
  if kind == "explicit":
    check_explicit(**kwargs)
  if kind != "single":
    # initialize blocks until every process has joined, and ends this one (no Python error)
    # when they have not within its timeout: said first, so a wait is not taken for a hang.
    console.say(f"Joining the run's processes ({kind}"
                + (f": process {kwargs['process_id']} of {kwargs['num_processes']}, "
                   f"coordinator {kwargs['coordinator_address']}" if kwargs else "")
                + f"); waiting up to {INIT_TIMEOUT_S} s for all of them to start.")
    jax.distributed.initialize(**kwargs, initialization_timeout=INIT_TIMEOUT_S)
  logging.info("distributed: %s, process %d of %d, %d local / %d global devices", kind,
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())
  return kind


def processes_on_this_host() -> tuple[int, bool]:
  """How many of the run's processes run on this host and share its /dev/shm (8 under
  launch/slurm.sbatch's one process per GPU, 1 on a TPU host), and whether this process is
  the first of them (the one to say what concerns the host): a collective, called by every
  process at the same point."""
  if jax.process_count() == 1:
    return 1, True
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  # 64 bits of the name's hash as two int32 (an int64 would reach the gather as int32).
  host = np.frombuffer(hashlib.sha256(socket.gethostname().encode()).digest()[:8], np.int32)
  hosts = np.asarray(multihost_utils.process_allgather(host)).reshape(-1, 2)
  same = np.flatnonzero((hosts == host).all(axis=1))
  return len(same), int(same[0]) == jax.process_index()


def define_flags() -> None:
  """--coordinator_address/--num_processes/--process_id, for commands that define their
  flags when they run (bigpretrain.main defines its own at import)."""
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
  flags.DEFINE_integer("num_processes", None, "Total number of processes.")
  flags.DEFINE_integer("process_id", None, "This process's index.")


def initialize_from_flags() -> str:
  """maybe_initialize with the values of define_flags' flags."""
  f = flags.FLAGS
  return maybe_initialize(f.coordinator_address, f.num_processes, f.process_id)
