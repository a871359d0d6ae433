"""The ahead-of-time plan: its figures against a real compile, flat per-device memory, the
HLO collective parser, topologies, CLI."""
import json
import math
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from bigpretrain.plan import accelerators
from bigpretrain.plan import aot_plan as plan_lib
from bigpretrain.runtime import goodput
from bigpretrain.plan import hlo_collectives
from bigpretrain import objectives
from bigpretrain import sharding
from bigpretrain import train
from input_pipeline import datasets
from tests import helpers

# The demo ViT on 16px images (4 patches): compiles in seconds, same step as the recipe.
_TINY_VIT = dict(name="vit_demo")


def _config(batch_size, mesh=(1, -1, 1), recipe="semantic_softmax", **overrides):
  config = helpers.tiny_config(recipe, **overrides)
  config.model = dict(_TINY_VIT)
  config.data.image_size = 16
  config.batch_size = batch_size
  config.mesh = dict(zip(sharding.MESH_AXES, mesh))
  return config


def test_collectives_are_counted_by_kind_with_result_bytes():
  hlo = "\n".join([
      "%all-reduce.1 = f32[16,8]{1,0} all-reduce(f32[16,8]{1,0} %p), replica_groups={}",
      "%ag = (bf16[4]{0}, bf16[32]{0}) all-gather-start(bf16[4]{0} %x), dimensions={0}",
      "%agd = bf16[32]{0} all-gather-done((bf16[4]{0}, bf16[32]{0}) %ag)",
      "ROOT %rs.2 = f32[2,3]{1,0} reduce-scatter(f32[16,3]{1,0} %y), dimensions={0}",
      "%t = (f32[5]{0}, s32[2]{0}) all-reduce(f32[5]{0} %a, s32[2]{0} %b)",
      "%f = f32[8]{0} fusion(f32[8]{0} %all-reduce.1), kind=kLoop",  # Not a collective.
  ])
  out = _counts(hlo_collectives.collectives(hlo))
  assert out["all-reduce"] == (2, 16 * 8 * 4 + 5 * 4 + 2 * 4)
  assert out["all-gather"] == (1, 32 * 2)  # The output, not the operand.
  assert out["reduce-scatter"] == (1, 2 * 3 * 4)
  assert out["all-to-all"] == out["collective-permute"] == (0, 0)


def _counts(out: dict) -> dict:
  return {kind: (c["count"], c["bytes"]) for kind, c in out.items()}


def test_plan_matches_the_compiled_step_of_the_allocated_state():
  """Plan with abstract state and no dataset vs the trainer's step compiled on real arrays."""
  config = _config(batch_size=16, mesh=(2, 4, 1))
  p = plan_lib.plan(config, accelerator="v5e")
  exp = train.build(config)
  state = exp.init_state()
  from benchmarks import common  # pylint: disable=import-outside-toplevel
  rows = common.synthetic_batch(exp)
  rows["_skipped"] = np.zeros(len(rows["image"]), np.int32)  # As the trainer adds it.
  batch = sharding.global_batch(rows, exp.mesh)
  with jax.set_mesh(exp.mesh):
    compiled = exp.train_step().lower(state, batch, exp.frozen).compile()
  mem = compiled.memory_analysis()
  assert p["temp_bytes"] == mem.temp_size_in_bytes
  assert p["argument_bytes"] == mem.argument_size_in_bytes
  assert p["output_bytes"] == mem.output_size_in_bytes
  assert p["alias_bytes"] == mem.alias_size_in_bytes
  # Shard bytes from the real arrays on device 0.
  dev = jax.devices()[0]

  def on_device(tree):
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
               if s.device == dev)

  assert p["params_bytes"] == on_device(state["params"])
  # Every dimension the rules name divides fsdp=4: nothing replicated for want of it.
  assert p["replicated_params"] == [] and "replicated_params_advice" not in p
  assert p["params_ideal_bytes"] == sum(x.nbytes for x in jax.tree.leaves(state["params"])) // 4
  assert "stay replicated" not in plan_lib.describe(p)
  odd = {**p, "replicated_params": [{"name": "head/kernel", "shape": [128, 100], "bytes": 51200,
                                     "device_bytes": 51200, "axes": {"tensor": 8}}],
         "replicated_params_advice": "Choose mesh axis sizes."}
  assert "1 parameter array(s),    0.000 GB per device, stay" in plan_lib.describe(odd)
  assert "head/kernel (128, 100) 0.05 MB on tensor=8" in plan_lib.describe(odd)
  assert p["opt_state_bytes"] == on_device(state["opt_state"])
  assert p["num_params"] == sum(x.size for x in jax.tree.leaves(state["params"]))
  assert p["argument_bytes"] >= p["params_bytes"] + p["opt_state_bytes"]
  assert p["total_bytes"] == (mem.argument_size_in_bytes + mem.output_size_in_bytes
                              - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
  assert p["fits"] and p["margin_bytes"] == 16 * 2**30 - p["total_bytes"]
  # FLOPs are per device: at least the forward+backward matmuls of this device's 2 images.
  assert p["flops_per_device"] > 0 and p["flops_from"] == "jaxpr"
  assert plan_lib.step_flops(config)["flops_per_device"] == p["flops_per_device"]  # Traced.
  assert p["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1} and p["batch_per_device"] == 2
  # The roofline on v5e: its classes hold the step's FLOPs (attention's batched products
  # among them); the collectives' bytes sent by each of 8 devices (ring), at one direction
  # of the 400 GB/s bidirectional ICI; the step the sum of the classes.
  r = p["roofline"]
  assert r["matmul"]["flops"] + r["attention"]["flops"] == pytest.approx(p["flops_per_device"])
  assert r["attention"]["flops"] > 0 and r["elementwise"]["bytes"] > 0
  c = {kind: v["bytes"] for kind, v in p["collectives"].items()}
  sent = (7 / 8 * (c["all-gather"] + c["all-to-all"]) + 7 * c["reduce-scatter"]
          + 14 / 8 * c["all-reduce"] + c["collective-permute"])
  assert r["collectives"]["bytes"] == pytest.approx(sent) and sent > 0
  assert r["collectives"]["seconds"] == pytest.approx(sent / 200e9)
  assert r["step_seconds"] == pytest.approx(sum(
      r[k]["seconds"] for k in ("matmul", "attention", "elementwise", "collectives")))
  assert p["mfu_at_roofline"] == pytest.approx(p["flops_per_device"] / (r["step_seconds"]
                                                                        * 197e12))
  assert "roofline per step" in plan_lib.describe(p)


def test_distillation_plans_an_abstract_teacher_and_inference_plans_the_pool_step():
  """A semantic KD step with its teacher (the student's own model here, so its bytes are
  the student's params') as an extra step input; the inference engine's pool step: the
  model's variables only, no optimizer, the forward alone."""
  plain = plan_lib.plan(_config(batch_size=16))
  kd_config = _config(batch_size=16, recipe="semantic_kd",
                      **{"objective.teacher_checkpoint": "/not/read"})
  kd = plan_lib.plan(kd_config, teacher_model="vit_demo")
  assert kd["teacher_model"] == "vit_demo" and "frozen_bytes" not in plain
  assert kd["frozen_bytes"] == plain["params_bytes"]  # vit_demo keeps no BatchNorm stats.
  assert kd["argument_bytes"] - plain["argument_bytes"] == kd["frozen_bytes"]
  assert kd["flops_per_device"] > plain["flops_per_device"]  # The teacher's forward pass.
  infer = plan_lib.plan(_config(batch_size=16), step="infer", top_p=5)
  with pytest.raises(ValueError, match=r"--top_p=101 must be an integer in \[1, 100\]"):
    plan_lib.plan(_config(batch_size=16), step="infer", top_p=101)
  assert infer["step"] == "infer" and infer["opt_state_bytes"] == 0
  assert infer["params_bytes"] == infer["state_bytes"] == plain["params_bytes"]
  # Forward only: about a third of the train step's forward + backward.
  assert 0.15 < infer["flops_per_device"] / plain["flops_per_device"] < 0.5
  assert infer["collectives"]["reduce-scatter"]["count"] == 0  # No gradients.
  with pytest.raises(ValueError, match="has no teacher"):
    plan_lib.plan(_config(batch_size=16), teacher_model="vit_demo")
  with pytest.raises(ValueError, match=r"--teacher_model='vit_dem' is not a known model\. "
                     r"Did you mean 'vit_demo'\?"):
    plan_lib.plan(kd_config, teacher_model="vit_dem")
  with pytest.raises(ValueError, match="step='eval' must be one of"):
    plan_lib.plan(_config(batch_size=16), step="eval")


@pytest.mark.parametrize("model,size", [("vit_demo", 16), ("regnety_demo", 32)])
def test_per_device_memory_is_flat_when_devices_and_batch_grow_together(model, size):
  """Golden: FSDP over n devices, 4 images per device: temporaries per device must not grow
  with n (replicated activations would), and parameters must shard (ViT on 'embed', convnets
  on their kernels' input channels)."""
  def config(n):
    c = _config(4 * n)
    c.model, c.data.image_size = dict(name=model), size
    return c
  plans = {n: plan_lib.plan(config(n), devices=jax.devices()[:n]) for n in (2, 8)}
  small, large = plans[2], plans[8]
  assert large["batch_per_device"] == small["batch_per_device"] == 4
  # Tolerance: 10% for XLA's per-program buffer choices (layouts, fusion of small arrays).
  assert large["temp_bytes"] <= 1.10 * small["temp_bytes"], plans
  # 4x the shards: at most half the bytes (norms, biases and odd widths stay replicated).
  assert large["params_bytes"] < 0.5 * small["params_bytes"], plans
  # Per-device FLOPs stay the step's work on 4 images (within 10%): no device computes
  # another's rows (grouped convolutions once did, see layers.batch_local_conv).
  assert math.isclose(large["flops_per_device"], small["flops_per_device"], rel_tol=0.10)


def test_unknown_dataset_needs_num_classes():
  config = _config(16, recipe="single_label")
  config.data.name = "tfds:my_dataset"
  with pytest.raises(ValueError, match="--num_classes"):
    plan_lib.planning_dataset(config, ("label",))
  info = plan_lib.planning_dataset(config, ("label",), num_classes=7).info
  assert info.num_classes == 7 and info.features == {"label": 0}
  config.data.name = "imagenet21k"  # No loader serves it (imagenet21k_p does).
  with pytest.raises(ValueError, match="'imagenet21k' is not a known dataset. Did you mean "
                                       "'imagenet21k_p'"):
    plan_lib.planning_dataset(config, ("label",), num_classes=7)


def test_known_class_lists_ship_with_the_package():
  config = _config(16)
  coarse = datasets.get_dataset({"name": "demo_coarse", "dir": ""}).info.class_names
  assert plan_lib.known_class_names("demo_coarse") == coarse and len(coarse) == 12
  config.data.name = "imagenet21k_p"
  info = plan_lib.planning_dataset(config, ("label",)).info
  # ImageNet-21K-P (fall11): "12,358,688 images from 11,221 classes" (Ridnik et al., sec. 2.1).
  assert info.num_classes == 11221 and info.class_names[0] == "n00005787"
  with pytest.raises(ValueError, match="drop --num_classes"):
    plan_lib.planning_dataset(config, ("label",), num_classes=1000)


def test_bad_mesh_and_accelerator_are_clear_errors():
  with pytest.raises(ValueError, match="AXIS:SIZE"):
    plan_lib.parse_mesh("data=2")
  assert plan_lib.parse_mesh("fsdp:-1") == {"data": 1, "fsdp": -1, "tensor": 1}
  with pytest.raises(ValueError, match="unknown"):
    plan_lib.plan(_config(16), accelerator="tpu9")


def test_cli_sets_its_device_count_and_prints_one_json_line():
  args = [sys.executable, "-m", "bigpretrain.tools.plan",
          f"--config={helpers.ROOT / 'configs' / 'single_label.py'}", "--devices=4",
          "--mesh=data:1,fsdp:4,tensor:1", "--accelerator=h100", "--json",
          "--config.batch_size=8", "--config.data.image_size=16",
          "--config.model.name=vit_demo", "--config.model.remat=dots_saveable",
          f"--config.compilation_cache_dir={helpers.JAX_CACHE}"]
  env = helpers.env(1)  # The CLI, not XLA_FLAGS, decides the device count.
  out = subprocess.run(args, env=env, cwd=helpers.ROOT, capture_output=True, text=True,
                       timeout=300, check=True)
  lines = out.stdout.strip().splitlines()
  assert len(lines) == 1, out.stdout
  p = json.loads(lines[0])
  assert p["devices"] == 4 and p["mesh"]["fsdp"] == 4 and p["batch_per_device"] == 2
  assert p["accelerator"] == "h100" and p["fits"] is True
  assert np.isclose(p["margin_bytes"], 80 * 2**30 - p["total_bytes"])
  assert p["compiler"].startswith("XLA:CPU")
  assert p["remat"] == "dots_saveable"  # The recipe keeps model.remat settable.
  assert "remat dots_saveable" in plan_lib.describe(p)


def test_cli_plans_a_config_that_reads_its_checkpoint_while_it_loads(tmp_path):
  """transfer.py with init= reads the checkpoint's meta while the config loads, which starts
  JAX: --devices must be set before (it failed on the fixed device count); its dataset,
  demo_coarse, has a class list the plan knows."""
  init = helpers.random_checkpoint(tmp_path)
  args = [sys.executable, "-m", "bigpretrain.tools.plan",
          f"--config={helpers.ROOT / 'configs' / 'transfer.py'}:mode=finetune,init={init}",
          "--devices=2", "--flops_only", "--config.batch_size=4"]
  out = subprocess.run(args, env=helpers.env(1), cwd=helpers.ROOT, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert json.loads(out.stdout.strip().splitlines()[-1])["devices"] == 2


# The forms the TPU and GPU compilers write, as in their compiled HLO (layouts trimmed).
_ACCELERATOR_HLO = """
%all-reduce-scatter.17 (input_0: f32[16,8], input_1: f32[8]) -> (f32[4,8], f32[2]) {
  %input_0 = f32[16,8]{1,0:T(8,128)} parameter(0)
  %input_1 = f32[8]{0} parameter(1)
  %all-reduce.160 = (f32[16,8]{1,0:T(8,128)}, f32[8]{0}) all-reduce(%input_0, %input_1), channel_id=9, replica_groups={{0,1,2,3}}, to_apply=%add
  %gte.0 = f32[16,8]{1,0} get-tuple-element(%all-reduce.160), index=0
  %ds.0 = f32[4,8]{1,0:T(8,128)S(1)} dynamic-slice(%gte.0, %o, %z), dynamic_slice_sizes={4,8}
  %gte.1 = f32[8]{0} get-tuple-element(%all-reduce.160), index=1
  %ds.1 = f32[2]{0} dynamic-slice(%gte.1, %o), dynamic_slice_sizes={2}
  ROOT %tuple.77 = (f32[4,8]{1,0:T(8,128)S(1)}, f32[2]{0}) tuple(%ds.0, %ds.1)
}

%fused_computation.1242 (param_0.4022: bf16[32,256]) -> (bf16[32,256], bf16[128,256], /*index=2*/u32[]) {
  %param_0.4022 = bf16[32,256]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %all-gather.193 = bf16[128,256]{1,0:T(8,128)(2,1)} all-gather(%param_0.4022), channel_id=7, dimensions={0}
  ROOT %custom-call.41 = (bf16[32,256]{1,0}, bf16[128,256]{1,0}, /*index=2*/u32[]{:S(2)}) custom-call(%all-gather.193), custom_call_target="AsyncCollectiveStart"
}

%fused_computation.1244 (param_0.4032: bf16[32,256], param_1.5225: bf16[128,256]) -> bf16[128,256] {
  %param_0.4032 = bf16[32,256]{1,0} parameter(0)
  %all-gather.197 = bf16[128,256]{1,0:T(8,128)(2,1)} all-gather(%param_0.4032), channel_id=7, dimensions={0}
  ROOT %custom-call.43 = bf16[128,256]{1,0} custom-call(%param_0.4032, %param_1.5225, %all-gather.197), custom_call_target="AsyncCollectiveDone"
}

%wrapped_all_to_all (p: f32[4,4]) -> f32[4,4] {
  %p = f32[4,4]{1,0} parameter(0)
  ROOT %a2a = f32[4,4]{1,0} all-to-all(%p), channel_id=11, dimensions={0}
}

ENTRY %main.1 (p0: f32[16,8], p1: f32[8], p2: bf16[32,256], p3: f32[4,4], p4: f32[256,64]) -> f32[64,64] {
  %fusion.524 = (f32[4,8]{1,0:T(8,128)S(1)}, f32[2]{0}) fusion(%p0, %p1), kind=kCustom, calls=%all-reduce-scatter.17, backend_config={"collective_algorithm_config":{"emitter":"AllReduceScatterFusion"}}
  %start = (bf16[32,256]{1,0}, bf16[128,256]{1,0}, u32[]) fusion(%p2), kind=kCustom, calls=%fused_computation.1242
  %done = bf16[128,256]{1,0} fusion(%p2, %start), kind=kCustom, calls=%fused_computation.1244
  %as = ((f32[4,4]{1,0}), f32[4,4]{1,0}) async-start(%p3), calls=%wrapped_all_to_all
  %ad = f32[4,4]{1,0} async-done(%as)
  %rs = ((f32[256,64]{1,0}), f32[64,64]{1,0}) reduce-scatter-start(%p4), channel_id=3, dimensions={0}
  %rsd = f32[64,64]{1,0} reduce-scatter-done(%rs)
  %w = (f32[64,64]{1,0}, u32[]) tuple(%rsd, %i)
  ROOT %loop = (f32[64,64]{1,0}, u32[]) while(%w), condition=%wide.windowed_dot_general_cond_rs.2.clone, body=%wide.windowed_dot_general_body_rs.2.clone.sunk
}

%wide.windowed_dot_general_body_rs.2.clone.sunk (wide.param: (f32[64,64], u32[])) -> (f32[64,64], u32[]) {
  %wide.param = (f32[64,64]{1,0}, u32[]) parameter(0)
  %acc = f32[64,64]{1,0} get-tuple-element(%wide.param), index=0
  %cp = (f32[64,64]{1,0}, f32[64,64]{1,0}, u32[], u32[]) collective-permute-start(%acc), channel_id=21, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[64,64]{1,0} collective-permute-done(%cp)
  ROOT %t = (f32[64,64]{1,0}, u32[]) tuple(%cpd, %i)
}
"""


def test_tpu_and_gpu_collective_forms_are_counted_once():
  out = hlo_collectives.collectives(_ACCELERATOR_HLO)
  # The fused all-reduce + slice is one (combined) reduce-scatter of the fusion's outputs; its
  # inner all-reduce is not an all-reduce; XLA:GPU's async reduce-scatter counts its output;
  # the windowed-einsum loop is one more, its bytes under its ring's collective-permute.
  assert out["reduce-scatter"] == {"count": 3, "bytes": (4 * 8 + 2) * 4 + 64 * 64 * 4,
                                   "windowed": 1}
  assert out["collective-permute"] == {"count": 1, "bytes": 64 * 64 * 4, "windowed": 0}
  counts = _counts(out)
  assert counts["all-reduce"] == (0, 0)
  # The start and done sides hold the same all-gather (channel 7): one op.
  assert counts["all-gather"] == (1, 128 * 256 * 2)
  assert counts["all-to-all"] == (1, 4 * 4 * 4)


def test_topology_spellings_and_errors():
  t = accelerators.parse_topology("tpu:v5p:4x4x4")
  assert t.accelerator.name == "v5p" and t.num_devices == 64 and t.spec == "tpu:v5p:4x4x4"
  m = accelerators.parse_topology("tpu:v5e:16x16:4")
  assert (m.slices, m.devices_per_slice, m.num_devices, m.spec) == (4, 256, 1024,
                                                                     "tpu:v5e:16x16:4")
  g = accelerators.parse_topology("gpu:h100:4x8")
  assert g.accelerator.platform == "gpu" and g.num_devices == 32
  for bad in ("v5e:2x2", "tpu:v5e:2by2", "gpu:v5e:2x2", "tpu:h100:2x2", "tpu:tpu9:2x2",
              "gpu:h100:32", "gpu:h100:4x8:2", "tpu:v5e:2x2:0", "tpu:v5e:2x2:two"):
    with pytest.raises(ValueError, match="topology"):
      accelerators.parse_topology(bad)


def test_one_accelerator_table_for_fit_and_mfu():
  """The plan's HBM and perf/mfu's peak come from the same entry, found by device kind."""
  v5e = accelerators.by_device_kind("TPU v5 lite")
  assert v5e is accelerators.get("v5e") and v5e.hbm_bytes == 16 * 2**30
  assert goodput.peak_flops("TPU v5 lite", "bfloat16") == v5e.peak_bf16 == 197e12
  h100 = accelerators.by_device_kind("NVIDIA H100 80GB HBM3")
  assert goodput.peak_flops(h100.device_kinds[0], "float32") == h100.peak_f32 == 494.5e12
  assert accelerators.by_device_kind("cpu") is None


@pytest.mark.parametrize("recipe,model,size,classes", [("semantic_softmax", "vit_demo", 16, None),
                                                       ("swag_regnety", "regnety_demo", 32, 10)])
def test_the_step_is_made_and_compiled_without_a_device_op(recipe, model, size, classes):
  """Compile-only devices (a TPU slice or GPU cluster from accelerators.topology_devices) run
  nothing: making and compiling the step must not transfer to or run on a device (its RNG key
  was once made eagerly: under a topology mesh, AttributeError 'local_devices')."""
  config = _config(batch_size=16, recipe=recipe)
  config.model, config.data.image_size = dict(name=model), size
  probe = plan_lib.planning_dataset(config, (), classes)
  reads = objectives.get_objective(config.objective, probe.info).reads
  exp = train.build(config, dataset=plan_lib.planning_dataset(config, reads, classes))
  state, batch = exp.abstract_state(), plan_lib.abstract_batch(exp)
  with jax.transfer_guard("disallow"), jax.set_mesh(exp.mesh):
    compiled = exp.train_step().lower(state, batch, exp.frozen).compile()
  assert compiled.memory_analysis().temp_size_in_bytes > 0


def test_a_compiler_that_does_not_match_jax_says_what_to_install(monkeypatch):
  pin = accelerators._jax_requirement("tpu", "libtpu")  # jax's own: 'libtpu==0.0.42.*' for 0.10.2.
  assert pin and pin.startswith("libtpu==")
  monkeypatch.setattr(accelerators, "_version", lambda p: {"jax": "0.10.2"}.get(p, "0.0.1"))
  assert f"pip install '{pin}'" in accelerators.compiler_problem("tpu")
  problem = accelerators.compiler_problem("gpu")
  assert "'jax-cuda13-plugin==0.10.2'" in problem and "'jax-cuda13-pjrt==0.10.2'" in problem
  monkeypatch.setattr(accelerators, "_version", lambda p: None)
  assert "libtpu is not installed" in accelerators.compiler_problem("tpu")


def test_max_batch_is_the_largest_per_device_batch_whose_plan_fits(monkeypatch):
  """Doubling then bisection on the compiled memory: with a cap between the plans of 3 and 4
  images per device, the search plans 1, 2, 4, then 3, and answers 3; below the plan of one
  image, 0."""
  config = _config(batch_size=1, mesh=(1, 1, 1))
  one = jax.devices()[:1]
  plans, real_plan = {}, plan_lib.plan

  def plan_once(c, *args, **kwargs):  # Each batch's plan compiled once in this test.
    if c.batch_size not in plans:
      plans[c.batch_size] = real_plan(c, *args, **kwargs)
    return plans[c.batch_size]

  monkeypatch.setattr(plan_lib, "plan", plan_once)
  totals = {b: plan_lib.plan(_config(b, mesh=(1, 1, 1)), devices=one)["total_bytes"]
            for b in (3, 4)}
  cap = (totals[3] + totals[4]) // 2
  out = plan_lib.max_batch(config, cap, devices=one)
  assert out["max_batch_per_device"] == 3 and out["remat"] == "none"
  assert list(out["probes"]) == [1, 2, 3, 4] and out["probes"][3] == totals[3]
  assert out["probes"][4] == totals[4] > cap >= out["total_bytes"]
  assert plan_lib.max_batch(config, out["probes"][1] - 1, devices=one)[
      "max_batch_per_device"] == 0



def test_max_batch_steps_in_whole_batchnorm_groups(monkeypatch):
  """With BatchNorm groups of 6 rows over 4 batch shards, per-device batches go in steps of
  lcm(4, 6) / 4 = 3: every probed global batch splits into whole groups."""
  config = _config(batch_size=4, mesh=(4, 1, 1))
  with config.unlocked():
    config.model.bn_group_size = 6
  seen = []

  def fake_plan(c, *args, **kwargs):  # Memory linear in the batch: 10 bytes per image.
    del args, kwargs
    assert c.batch_size % c.model.bn_group_size == 0, c.batch_size
    seen.append(c.batch_size)
    return {"total_bytes": 10 * c.batch_size}

  monkeypatch.setattr(plan_lib, "plan", fake_plan)
  out = plan_lib.max_batch(config, 10 * 4 * 20, devices=jax.devices()[:4])
  assert out["max_batch_per_device"] == 18  # The largest multiple of 3 with 4 x b <= 80.
  assert all(b % 3 == 0 for b in out["probes"]) and seen


@pytest.mark.parametrize("memory_gib", [0.0, -1.0])
def test_max_batch_refuses_a_memory_that_is_not_positive(memory_gib):
  from bigpretrain.tools import plan as plan_tool  # pylint: disable=import-outside-toplevel
  f = types.SimpleNamespace(memory_gib=memory_gib, remat=["none"], num_classes=None,
                            teacher_model=None)
  with pytest.raises(ValueError, match=rf"--memory_gib={memory_gib} must be > 0"):
    plan_tool._max_batch(f, _config(batch_size=1, mesh=(1, 1, 1)), jax.devices()[:1], None)  # pylint: disable=protected-access
