"""The train step compiled by the accelerators' own compilers with no accelerator attached:
libtpu for a TPU v5e 2x2 slice, the CUDA plugin for two nodes of 4 H100s. Skipped, with the
install command, where the extras (bigpretrain[tpu], bigpretrain[cuda]) are absent."""
import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import pytest

from benchmarks import gpu_hlo
from bigpretrain.models import pallas_conv
from bigpretrain.plan import accelerators
from bigpretrain.plan import aot_plan
from bigpretrain.plan import hlo_collectives
from bigpretrain import sharding
from tests import helpers

pytestmark = pytest.mark.compile
# (topology, its compiler's name as the plan reports it).
TOPOLOGIES = [("tpu:v5e:2x2", "libtpu"), ("gpu:h100:2x4", "XLA:GPU")]


def _devices(topology: str) -> list:
  problem = accelerators.compiler_problem(accelerators.parse_topology(topology)
                                          .accelerator.platform)
  if problem:
    pytest.skip(problem)
  return accelerators.topology_devices(topology)


@pytest.mark.parametrize("topology,_", TOPOLOGIES)
def test_fsdp_gradient_is_one_reduce_scatter_of_the_shard(topology, _):
  """The gradient of an FSDP-sharded weight, kept sharded: each compiler reduce-scatters it
  (its own form), and the parser counts one reduce-scatter of one shard's bytes."""
  devices = _devices(topology)
  n = len(devices)
  mesh = Mesh(np.array(devices), ("fsdp",))
  fsdp = NamedSharding(mesh, P("fsdp"))
  w = jax.ShapeDtypeStruct((512, 256), jnp.float32, sharding=fsdp)
  x = jax.ShapeDtypeStruct((16 * n, 512), jnp.float32, sharding=fsdp)
  grad = jax.jit(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)), out_shardings=fsdp)
  out = hlo_collectives.collectives(grad.lower(w, x).compile().as_text())
  assert out["reduce-scatter"] == {"count": 1, "bytes": 512 // n * 256 * 4, "windowed": 0}, out
  assert out["all-reduce"]["count"] == 0, out  # Not an all-reduce and a slice.
  assert out["all-gather"]["count"] == 1, out  # The weight, gathered for the forward.


@pytest.fixture(scope="module")
def demo_config():
  config = helpers.tiny_config("semantic_softmax")
  config.data.image_size = 16
  config.batch_size = 8
  config.mesh = dict(data=1, fsdp=-1, tensor=1)
  return config


@pytest.mark.parametrize("topology,compiler", TOPOLOGIES)
def test_demo_recipe_plans_on_the_accelerator_compiler(demo_config, topology, compiler):
  devices = _devices(topology)
  p = aot_plan.plan(demo_config, devices=devices)
  cpu = aot_plan.plan(demo_config, devices=jax.devices("cpu")[:len(devices)])
  assert p["compiler"].startswith(compiler) and cpu["compiler"].startswith("XLA:CPU")
  assert p["accelerator"] == accelerators.parse_topology(topology).accelerator.name
  assert p["devices"] == len(devices) and p["mesh"]["fsdp"] == len(devices)
  # The state's shards are the shardings', whatever the compiler.
  for key in ("num_params", "params_bytes", "opt_state_bytes"):
    assert p[key] == cpu[key], key
  # FSDP gradients are reduce-scattered: most float32 parameter bytes leave as shards (at this
  # size as plain or fused reduce-scatters, not windowed-einsum loops).
  rs = p["collectives"]["reduce-scatter"]
  assert rs["count"] >= 1 and rs["bytes"] >= 0.5 * p["params_bytes"], p["collectives"]
  assert p["collectives"]["all-reduce"]["bytes"] < 0.5 * p["params_bytes"], p["collectives"]
  assert p["fits"] and p["margin_bytes"] == p["hbm_bytes"] - p["total_bytes"]
  if topology.startswith("tpu"):  # The TPU compiler's own roofline estimate of the step.
    assert 0 < p["optimal_seconds"] < 1 and p["flops_per_device"] > 0
  else:  # XLA:GPU gives none: the bound of its compiled kernels' traffic.
    acc = accelerators.get(p["accelerator"])
    k = p["kernel_bound"]
    assert k["matmul_seconds"] >= p["flops_per_device"] / acc.peak_f32 > 0  # float32 demo.
    assert k["bound_seconds"] == pytest.approx(
        k["matmul_seconds"] + k["bytes"]["memory"] / acc.hbm_bandwidth)
    # The optimizer's update alone reads and writes every byte of this device's state.
    assert k["bytes"]["memory"] >= 2 * (p["params_bytes"] + p["opt_state_bytes"]), k
    assert k["kernels"]["matmul"] > 0 and k["unknown_trip_counts"] == 0


@pytest.mark.parametrize("topology,compiler,data", [("gpu:h100:1x2", "XLA:GPU", 1),
                                                    ("tpu:v5e:2x2:2", "libtpu", 2)])
def test_cli_plans_with_the_accelerator_compiler(topology, compiler, data, tmp_path):
  """Two images per device: XLA:GPU's default Triton GEMM tiling failed on this step's
  f32[10,128] dot with no GPU to autotune on (aot_plan.GPU_COMPILE_ONLY_OPTIONS). A
  compile-only executable is kept out of the persistent cache (it cannot be read back: the
  next plan warned), and libtpu logs no errors about the TPU VM it is not on. The TPU case
  is two slices (Multislice), the 'data' axis across them."""
  n = len(_devices(topology))
  cache = tmp_path / "jax_cache"
  args = [sys.executable, "-m", "bigpretrain.tools.plan",
          f"--config={helpers.ROOT / 'configs' / 'semantic_softmax.py'}:model=vit_demo",
          f"--topology={topology}", f"--mesh=data:{data},fsdp:{n // data},tensor:1", "--json",
          f"--config.batch_size={2 * n}", "--config.data.image_size=16",
          f"--config.compilation_cache_dir={cache}"]
  out = subprocess.run(args, env=helpers.env(1), cwd=helpers.ROOT, capture_output=True,
                       text=True, timeout=600, check=True)
  p = json.loads(out.stdout.strip().splitlines()[-1])
  assert p["compiler"].startswith(compiler) and p["devices"] == n and p["fits"]
  assert p["accelerator"] == accelerators.parse_topology(topology).accelerator.name
  assert not cache.exists() or not list(cache.iterdir()), list(cache.iterdir())
  assert "E0000" not in out.stderr and "could not determine" not in out.stderr, out.stderr


def test_several_tpu_slices_take_the_data_axis_across_them(monkeypatch):
  devices = _devices("tpu:v5e:2x2:2")
  assert len(devices) == 8 and {d.slice_index for d in devices} == {0, 1}
  monkeypatch.setattr(jax, "devices", lambda *_: devices)  # As a Multislice run sees them.
  mesh = sharding.make_mesh(dict(data=4, fsdp=2, tensor=1))  # jax.make_mesh refuses them.
  slice_of = np.vectorize(lambda d: d.slice_index)(mesh.devices)
  np.testing.assert_array_equal(slice_of[:, :, 0], [[0, 0], [0, 0], [1, 1], [1, 1]])
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
  with pytest.raises(ValueError, match="data=1 must be a multiple of 2"):
    sharding.make_mesh(dict(data=1, fsdp=-1, tensor=1))


def test_kernel_counts_add_up_the_bytes_the_transposes_write():
  hlo = ("  %t.1 = f32[3024,1,1,1232]{3,2,1,0} transpose(%p.1), dimensions={3,0,1,2}\n"
         "  %t.2 = bf16[64,7,7]{2,1,0} transpose(%p.2), dimensions={0,2,1}\n"
         "  %c.3 = f32[8]{0} copy(%p.3)\n")
  counts = gpu_hlo.kernel_counts(hlo)
  assert counts["transposes"] == 2 and counts["copies"] == 1
  assert counts["transpose_bytes"] == 4 * 3024 * 1232 + 2 * 64 * 7 * 7


def test_h100_step_has_cudnn_attention_and_updates_the_state_in_place(demo_config):
  """model.attention_impl='auto' (the configs' default) on an H100 in bfloat16 is cuDNN's:
  each block's attention is one cuDNN flash attention call forward and one backward
  (vit_demo, 4 blocks; 5 tokens at 16 px, padded to an even 6), not GEMMs and a softmax; its
  FLOPs are the model's: those of XLA's attention on the unpadded tokens
  (train.Experiment.model_flops_per_device). The optimizer writes the parameters and its
  state over the old ones: the step copies almost none of them (with a reduction per norm in
  the update's kernels, 116 copies of the 56 parameters' shapes: optim.global_norms)."""
  devices = _devices("gpu:h100:1x1")
  from jax._src.lib import cuda_versions  # pylint: disable=import-outside-toplevel
  try:
    cuda_versions.cudnn_get_version()
  except RuntimeError as e:  # JAX checks the installed cuDNN when it traces the call.
    pytest.skip(f"{e}: pip install 'nvidia-cudnn-cu13>=9.12.0.46,<10' (bigpretrain[cuda]).")
  config = demo_config.copy_and_resolve_references()
  config.model.attention_impl = "auto"
  config.compute_dtype = "bfloat16"
  exp, state, compiled, fused_flops = aot_plan.compile_step(config, devices=devices)
  assert exp.model_def.kwargs["attention_impl"] == "cudnn"
  hlo = compiled.as_text()
  counts = gpu_hlo.kernel_counts(hlo)
  shapes = [x.shape for x in jax.tree.leaves(state["params"])]
  copied = [tuple(int(d) for d in dims.split(",") if d) for dims in
            re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} copy\(", hlo[hlo.index("ENTRY"):])]
  assert len(shapes) > 40 and sum(c in shapes for c in copied) < len(shapes) / 4, copied
  assert counts["custom_calls"]["__cudnn$fmhaSoftmax"] == 4, counts
  assert counts["custom_calls"]["__cudnn$fmhaSoftmaxBackward"] == 4, counts
  config.model.attention_impl = "xla"
  unfused = aot_plan.step_flops(config, devices=devices)["flops_per_device"]
  # The cuDNN step runs 6 tokens through every block, XLA's 5: the FLOPs are the model's.
  assert fused_flops == unfused


def test_pallas_grouped_conv_kernels_copy_16_bytes_at_a_time_and_never_spill(tmp_path):
  """grouped_conv_impl='pallas' on an H100 (a stride-2 layer of RegNetY's, 112 channels a
  group, default tiles): its three Triton kernels compile with XLA told to refuse any kernel
  that spills registers, and (where XLA dumps their PTX: jaxlib 0.10) each copies its
  operands into shared memory 16 bytes at a time (cp.async.cg), never loading an element
  alone (ld.global.b16): what a gather with clipped indices compiled to, 255 registers and
  spills."""
  devices = _devices("gpu:h100:1x1")

  def loss(x, w):
    y = pallas_conv.conv_pallas(x, w, (2, 2), ((1, 1), (1, 1)),
                                dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                feature_group_count=2)
    return 0.5 * jnp.sum(jnp.square(y.astype(jnp.float32)))

  one = jax.sharding.SingleDeviceSharding(devices[0])
  args = (jax.ShapeDtypeStruct((2, 16, 16, 224), jnp.bfloat16, sharding=one),
          jax.ShapeDtypeStruct((3, 3, 112, 224), jnp.bfloat16, sharding=one))
  with jax.set_mesh(Mesh(devices, ("data",))):  # Pallas reads the GPU's kind off the mesh.
    jax.jit(jax.grad(loss, (0, 1))).lower(*args).compile(compiler_options={
        "xla_gpu_fail_ptx_compilation_on_register_spilling": True,
        "xla_dump_to": str(tmp_path)})
  ptx = {re.search(r"\.entry (\w+)\(", text).group(1): text
         for text in (p.read_text() for p in tmp_path.glob("*.ptx")) if ".entry" in text}
  if ptx:
    kernels = {name: text for name, text in ptx.items() if name.startswith("conv_")}
    assert sorted(kernels) == ["conv_forward", "conv_input_grad", "conv_kernel_grad"], sorted(ptx)
    for name, text in kernels.items():
      assert "cp.async.cg.shared.global" in text, name
      assert not re.search(r"\bld\.global(\.nc)?\.b16\b", text), name
