"""XLA and CUDA settings for (multi-host) GPU training, applied only when JAX will run on GPUs.

The one place for the flags the field uses on H100 clusters: JAX's GPU performance tips,
NVIDIA's JAX-Toolbox, MaxText's H100 (A3) runs. `distributed.maybe_initialize` calls `apply()`
before the backend starts, so every entry point and launcher gets them. A flag already in
XLA_FLAGS or a variable already in the environment is the user's choice and wins;
BIGPRETRAIN_GPU_FLAGS=off sets nothing (XLA's own defaults, e.g. for an A/B of flag sets).

Where they act: the latency-hiding scheduler orders every asynchronous op (on one GPU: cuDNN
and cuBLAS calls, host transfers; on 8: the collectives too), Triton GEMMs act on one GPU as
on many; the collective settings (stream priority, combine thresholds) do nothing without
collectives, i.e. on one GPU. SCOPES says which is which, and FLAG_SETS names the sets
benchmarks/accelerator.py compares (its `xla_flags` figure).

Not set here, on purpose:
- NCCL network settings (NCCL_SOCKET_IFNAME, NCCL_IB_*, the GPUDirect-TCPX/TCPXO or EFA plugin
  variables): they depend on the cluster's fabric and come with its image or module.
- NCCL_NVLS_ENABLE: left to NCCL's default (NVLink SHARP on NVSwitch H100 nodes); JAX-Toolbox
  images set it to 0 for a while and have since dropped that.
- Pipelined collectives and while-loop double buffering: they act on scanned layer loops, and
  the models here unroll their blocks.
"""
import importlib.util
import os
from typing import MutableMapping

# (flag, value, why). All exist in current XLA; tests/test_gpu_flags.py has XLA parse them.
XLA_FLAGS = (
    # Schedule the asynchronous collectives (FSDP all-gathers / reduce-scatters, gradient
    # all-reduces) to overlap with compute instead of running them where they are issued.
    ("--xla_gpu_enable_latency_hiding_scheduler", "true"),
    # Matmuls through cuBLAS(Lt) instead of Triton GEMM fusions: faster for the large dense
    # layers of these models (MaxText's and JAX-Toolbox's H100 setting).
    ("--xla_gpu_enable_triton_gemm", "false"),
    # Collectives on the highest-priority CUDA stream, so compute kernels do not delay them.
    ("--xla_gpu_enable_highest_priority_async_stream", "true"),
    # Combine small collectives into few large ones (fewer NCCL launches, better bandwidth);
    # thresholds of MaxText's H100 runs: 128 MiB all-reduce, 1 GiB all-gather, 32 MiB
    # reduce-scatter.
    ("--xla_gpu_all_reduce_combine_threshold_bytes", "134217728"),
    ("--xla_gpu_all_gather_combine_threshold_bytes", "1073741824"),
    ("--xla_gpu_reduce_scatter_combine_threshold_bytes", "33554432"),
    # Let the combiners merge collectives over differently shaped parameters (FSDP shards
    # every kernel along its own dimension).
    ("--xla_gpu_enable_all_gather_combine_by_dim", "false"),
    ("--xla_gpu_enable_reduce_scatter_combine_by_dim", "false"),
)
# MaxText's GPU runs also turn CUDA graphs (command buffers) off, for steps of large kernels
# that are not launch-bound and for the device memory graphs keep. Not set here: the
# convnets' steps at 64 images per GPU are thousands of small kernels, and with it set one
# H200 ran ResNet-50 at 26.1 ms and TResNet-M at 41.2 ms per step, against 14.9 and 16.5 ms
# without it in an earlier run (docs/benchmarks.md). FLAG_SETS keeps it as an A/B arm.
NO_COMMAND_BUFFERS = ("--xla_gpu_enable_command_buffer", "")
# cuDNN convolutions recorded into the CUDA graphs too (XLA's default set lacks CONVOLUTION):
# on one H200 the convnets' steps at 64 images wait on launches, each cuDNN call between two
# graph launches (docs/benchmarks.md). Not set here until a device measures it: FLAG_SETS
# keeps it as an A/B arm.
CONVOLUTION_COMMAND_BUFFERS = ("--xla_gpu_enable_command_buffer", "+CONVOLUTION")

ENV = (
    # Share of GPU memory JAX preallocates (default 0.75); 0.9 leaves room for cuDNN/cuBLAS
    # workspaces and NCCL buffers (JAX-Toolbox's and MaxText's value range).
    ("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9"),
    # One hardware work queue: kernels reach the GPU in XLA's scheduled order, which the
    # latency-hiding scheduler relies on (Hopper; JAX-Toolbox advises against it on Blackwell,
    # where setting the variable yourself wins).
    ("CUDA_DEVICE_MAX_CONNECTIONS", "1"),
)

# Flags that act only where devices exchange data (collectives): a no-op on one GPU.
MULTI_DEVICE_ONLY = (
    "--xla_gpu_enable_highest_priority_async_stream",
    "--xla_gpu_all_reduce_combine_threshold_bytes",
    "--xla_gpu_all_gather_combine_threshold_bytes",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes",
    "--xla_gpu_enable_all_gather_combine_by_dim",
    "--xla_gpu_enable_reduce_scatter_combine_by_dim",
)
SCOPES = {name: "multi_device" if name in MULTI_DEVICE_ONLY else "every_device"
          for name, _ in XLA_FLAGS + (NO_COMMAND_BUFFERS, CONVOLUTION_COMMAND_BUFFERS)}


def _without(name: str) -> tuple:
  """XLA_FLAGS less `name` (which then takes XLA's default)."""
  return tuple((n, v) for n, v in XLA_FLAGS if n != name)


# The sets the `xla_flags` A/B compares: XLA's defaults, these settings, these settings with
# one choice undone (back to XLA's default), with MaxText's command buffers off added, and
# with cuDNN convolutions in the command buffers.
FLAG_SETS = {
    "xla_defaults": (),
    "bigpretrain": XLA_FLAGS,
    "no_command_buffers": XLA_FLAGS + (NO_COMMAND_BUFFERS,),
    "conv_command_buffers": XLA_FLAGS + (CONVOLUTION_COMMAND_BUFFERS,),
    "triton_gemm": _without("--xla_gpu_enable_triton_gemm"),
    "no_latency_hiding": _without("--xla_gpu_enable_latency_hiding_scheduler"),
}
OFF_VARIABLE = "BIGPRETRAIN_GPU_FLAGS"


def flags_string(flag_set: tuple) -> str:
  """A FLAG_SETS entry as XLA_FLAGS text."""
  return " ".join(f"{name}={value}" for name, value in flag_set)


_CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")


def target_platform(environ: MutableMapping[str, str] | None = None) -> str:
  """'gpu' when JAX will start on NVIDIA GPUs, else 'other', without starting a backend.

  JAX_PLATFORMS decides when set (its first entry); otherwise a CUDA plugin must be installed
  and an NVIDIA device visible."""
  environ = os.environ if environ is None else environ
  platforms = environ.get("JAX_PLATFORMS", "").strip()
  if platforms:
    return "gpu" if platforms.split(",")[0].strip().lower() in ("cuda", "gpu") else "other"
  has_plugin = any(importlib.util.find_spec(name) for name in _CUDA_PLUGINS)
  return "gpu" if has_plugin and os.path.exists("/dev/nvidiactl") else "other"


def _flag_names(xla_flags: str) -> set[str]:
  return {token.split("=", 1)[0] for token in xla_flags.split() if token.startswith("--")}


def apply(environ: MutableMapping[str, str] | None = None, platform: str | None = None) -> dict:
  """Adds the GPU settings the environment lacks; returns {name: value} of what it set.

  A no-op unless the platform (given, or `target_platform`) is 'gpu', and with
  BIGPRETRAIN_GPU_FLAGS=off. Must run before JAX starts its backend: XLA reads XLA_FLAGS once,
  when the first client is created."""
  environ = os.environ if environ is None else environ
  if environ.get(OFF_VARIABLE, "").lower() == "off":
    return {}
  platform = target_platform(environ) if platform is None else platform
  if platform != "gpu":
    return {}
  applied = {}
  user_flags = environ.get("XLA_FLAGS", "")
  present = _flag_names(user_flags)
  added = [f"{name}={value}" for name, value in XLA_FLAGS if name not in present]
  if added:
    environ["XLA_FLAGS"] = " ".join([user_flags] + added).strip()
    applied["XLA_FLAGS"] = " ".join(added)
  for name, value in ENV:
    if name not in environ:
      environ[name] = value
      applied[name] = value
  return applied
