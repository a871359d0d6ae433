"""GPU settings: set only for GPUs, exactly the documented flags, never over the user's."""
import os
import subprocess
import sys

from bigpretrain.runtime import distributed
from bigpretrain.plan import gpu_flags

EXPECTED_XLA = [
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_triton_gemm=false",
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",  # 128 MiB
    "--xla_gpu_all_gather_combine_threshold_bytes=1073741824",  # 1 GiB
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=33554432",  # 32 MiB
    "--xla_gpu_enable_all_gather_combine_by_dim=false",
    "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
]


def test_nothing_is_set_off_gpu():
  for platforms in ("cpu", "tpu", "cpu,cuda"):
    env = {"JAX_PLATFORMS": platforms, "XLA_FLAGS": "--xla_dump_to=/d"}
    assert gpu_flags.apply(env) == {}
    assert env == {"JAX_PLATFORMS": platforms, "XLA_FLAGS": "--xla_dump_to=/d"}
  env = {}
  assert gpu_flags.apply(env, platform="other") == {} and env == {}


def test_target_platform(monkeypatch):
  assert gpu_flags.target_platform({"JAX_PLATFORMS": "cuda"}) == "gpu"
  assert gpu_flags.target_platform({"JAX_PLATFORMS": "gpu,cpu"}) == "gpu"
  assert gpu_flags.target_platform({"JAX_PLATFORMS": "cpu"}) == "other"
  # Unset: a CUDA plugin and an NVIDIA device must both be there.
  for plugin, device, expected in [(True, True, "gpu"), (True, False, "other"),
                                   (False, True, "other")]:
    monkeypatch.setattr(gpu_flags.importlib.util, "find_spec",
                        lambda name, plugin=plugin: object() if plugin else None)
    monkeypatch.setattr(gpu_flags.os.path, "exists",
                        lambda path, device=device: device and path == "/dev/nvidiactl")
    assert gpu_flags.target_platform({}) == expected


def test_gpu_sets_the_documented_settings():
  env = {}
  applied = gpu_flags.apply(env, platform="gpu")
  assert env["XLA_FLAGS"].split(" ") == EXPECTED_XLA
  assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"
  assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
  assert applied == env


def test_user_values_are_kept():
  env = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/d",
         "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5", "JAX_PLATFORMS": "cuda"}
  applied = gpu_flags.apply(env)
  flags = env["XLA_FLAGS"].split(" ")
  assert flags[:2] == ["--xla_gpu_enable_triton_gemm=true", "--xla_dump_to=/d"]
  assert flags[2:] == [f for f in EXPECTED_XLA if "triton_gemm" not in f]
  assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in applied
  assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
  # A second call (another entry point in the same process) adds nothing.
  before = dict(env)
  assert gpu_flags.apply(env) == {} and env == before


def test_every_flag_exists_in_the_installed_xla():
  """XLA parses XLA_FLAGS for every backend and aborts on an unknown flag: a CPU process
  checks the GPU flags' names. A misspelled one must fail the same way."""
  code = "import jax; jax.numpy.zeros(2).block_until_ready()"
  run = lambda flags: subprocess.run(
      [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
      env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags})
  for name in ("no_command_buffers", "conv_command_buffers"):  # Every flag and value.
    r = run(gpu_flags.flags_string(gpu_flags.FLAG_SETS[name]))
    assert r.returncode == 0, r.stderr[-2000:]
  r = run("--xla_gpu_enable_command_buffer=+CONVOLUTIONS")  # A value XLA does not know.
  assert r.returncode != 0 and "Illegal value" in r.stderr
  r = run("--xla_gpu_enable_latency_hiding_schedular=true")
  assert r.returncode != 0 and "Unknown flag" in r.stderr


def test_maybe_initialize_applies_them_first(monkeypatch):
  for name in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "CUDA_DEVICE_MAX_CONNECTIONS"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")  # read by apply() only; this backend is up
  assert distributed.maybe_initialize() == "single"
  assert os.environ["XLA_FLAGS"].split(" ") == EXPECTED_XLA
  assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def test_off_sets_nothing_even_on_gpu():
  env = {"BIGPRETRAIN_GPU_FLAGS": "off", "JAX_PLATFORMS": "cuda"}
  assert gpu_flags.apply(env) == {} and set(env) == {"BIGPRETRAIN_GPU_FLAGS", "JAX_PLATFORMS"}


def test_flag_sets_undo_one_choice_each():
  """The A/B's sets: XLA's defaults, the documented flags, the flags less exactly one, and
  the flags with MaxText's command buffers off (CUDA graphs are XLA's default and ours)."""
  sets = {name: gpu_flags.flags_string(s).split() for name, s in gpu_flags.FLAG_SETS.items()}
  assert sets["xla_defaults"] == [] and sets["bigpretrain"] == EXPECTED_XLA
  assert sets["no_command_buffers"] == EXPECTED_XLA + ["--xla_gpu_enable_command_buffer="]
  # XLA's default commands plus cuDNN convolutions.
  assert sets["conv_command_buffers"] == EXPECTED_XLA + [
      "--xla_gpu_enable_command_buffer=+CONVOLUTION"]
  for name, dropped in [("triton_gemm", "--xla_gpu_enable_triton_gemm=false"),
                        ("no_latency_hiding",
                         "--xla_gpu_enable_latency_hiding_scheduler=true")]:
    assert sets[name] == [f for f in EXPECTED_XLA if f != dropped], name
  # On one GPU only the scheduler, Triton GEMMs and command buffers act.
  every = sorted(n for n, scope in gpu_flags.SCOPES.items() if scope == "every_device")
  assert every == ["--xla_gpu_enable_command_buffer",
                   "--xla_gpu_enable_latency_hiding_scheduler", "--xla_gpu_enable_triton_gemm"]
