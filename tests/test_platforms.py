"""JAX starts only on the platforms the host has (distributed.select_platforms): with libtpu
and the CUDA plugin installed, a CPU-only machine prints no plugin errors, from the trainer or
the benchmarks; with torch installed, the trainer does not import it."""
import importlib.util
import subprocess
import sys

import pytest

from bigpretrain.runtime import distributed
from tests import helpers


@pytest.mark.parametrize("devices, want", [
    ((), "cpu"),
    (("nvidiactl", "nvidia0"), "cuda,cpu"),
    (("accel0", "accel1"), "tpu,cpu"),  # TPU v4 and earlier.
    (("vfio/0",), "tpu,cpu"),  # TPU v5e and later.
    (("vfio/vfio",), "cpu"),  # The VFIO control node alone is no TPU.
    (("kfd",), "rocm,cpu"),
])
def test_host_platforms_follow_the_device_nodes(tmp_path, devices, want, monkeypatch):
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  for name in devices:
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).touch()
  every = {"tpu", "cuda", "rocm"}
  assert distributed.host_platforms(str(tmp_path), installed=every) == want
  # Without the accelerator's JAX plugin (a plain install), or with no GPU made visible: the
  # CPU, as plain JAX falls back, instead of a run that stops on the missing backend.
  assert distributed.host_platforms(str(tmp_path), installed=set()) == "cpu"
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
  assert distributed.host_platforms(str(tmp_path), installed=every) == want.replace("cuda,", "")


_PROBE = ("from absl import logging\n"
          "logging.set_verbosity(logging.INFO)\n"
          "from bigpretrain.runtime import distributed\n"
          "print(distributed.select_platforms())\n"
          "import jax\n"
          "print(jax.devices()[0].platform)\n")


def test_a_cpu_host_starts_jax_without_plugin_errors():
  env = helpers.env()
  del env["JAX_PLATFORMS"]
  r = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=helpers.ROOT,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and r.stdout.split() == ["cpu", "cpu"], r.stderr[-3000:]
  assert r.stderr.strip().splitlines() == [
      "INFO:absl:JAX platforms: cpu (the devices this host has; JAX_PLATFORMS overrides)."]


def test_a_benchmark_on_a_cpu_host_prints_no_plugin_errors():
  env = helpers.env()
  del env["JAX_PLATFORMS"]
  r = subprocess.run([sys.executable, "benchmarks/accelerator.py", "--figures=gelu"], env=env,
                     cwd=helpers.ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and "| gelu |" in r.stdout, r.stderr[-3000:]
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].endswith(
      "] JAX platforms: cpu (the devices this host has; JAX_PLATFORMS overrides)."), lines


def test_a_platform_choice_already_made_is_kept():
  assert distributed.select_platforms() == "cpu"  # conftest's (as JAX_PLATFORMS would).


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_the_trainer_does_not_import_torch_and_torch_still_imports():
  probe = ("import sys\n"
           "from bigpretrain import train\n"
           "print('torch' in sys.modules)\n"
           "import torch\n"
           "print(torch.__name__ in sys.modules)\n")
  r = subprocess.run([sys.executable, "-c", probe], env=helpers.env(), cwd=helpers.ROOT,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and r.stdout.split() == ["False", "True"], r.stderr[-3000:]
