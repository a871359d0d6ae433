"""The ahead-of-time plan of a config's train step: memory, FLOPs and collectives per device,
from the compiler of the devices it targets, with nothing allocated and no dataset read.

plan(config, devices=...) compiles the real train step (the config's objective, model,
optimizer, shardings and batch) with abstract state (jax.ShapeDtypeStruct with shardings)
for the given devices; a distillation's frozen teacher is abstract too, described by its
checkpoint's meta or by `teacher_model` before it exists. step='infer' compiles the inference
engine's pool step instead (the eval-mode forward and its top-P scores, as a semi-supervised
teacher ranks the unlabelled pool: pool_predictions.make_step) with the model's variables
only. Devices: fake CPU devices (XLA:CPU), or the compile-only devices of a TPU slice
(libtpu) or a GPU cluster (the CUDA PJRT plugin) from bigpretrain.plan.accelerators. The class
lists of the known datasets ship with the package (DatasetInfo is fabricated from them),
others take num_classes. Per device: parameter and optimizer-state bytes (each leaf's shard),
the parameter bytes if every array split over all the rules' mesh axes, and the arrays the
rules leave whole on an axis, a dimension they name not dividing it (sharding.param_report),
the compiler's memory analysis (arguments, outputs, aliased, temporaries, generated code),
FLOPs per step (matrix products and convolutions counted on the step's jaxpr, the same on
every compiler: bigpretrain/plan/flops.py; step_flops gives them without compiling) and, where the
compiler gives them (the TPU compiler does), its roofline step time `optimal_seconds` and
`bytes accessed` (for XLA:GPU, which gives none, the bytes its compiled kernels move and the
step time they bound: bigpretrain.plan.hlo_traffic); the collectives of the compiled HLO by kind
(bigpretrain.plan.hlo_collectives); the fit against the accelerator's HBM. `compiler` names the
compiler (and version) every figure comes from; `remat` the config's model.remat (the
residual blocks' rematerialisation policy, which trades temporaries for recompute FLOPs).

How the compilers differ, measured (jax 0.10.2, libtpu 0.0.42.1; vit_demo, semantic softmax,
batch 64 at 32 px, mesh fsdp:4; `python benchmarks/pod_plans.py --compare`): parameter and
optimizer-state bytes are equal (the shardings' shard shapes). XLA:CPU all-reduces the
gradients of FSDP-sharded weights in full and slices them: 3 all-reduces of 2.28 MB (the
float32 parameter bytes, whatever the device count), 20 all-gathers, no reduce-scatter,
15.0 MB of temporaries. libtpu (v5e:2x2) reduce-scatters them: one combined reduce-scatter
(its AllReduceScatterFusion) of 0.54 MB, the 17 sharded gradients' shards, 4 small
all-reduces (0.13 MB: replicated biases and norms), 34 all-gathers (each weight gathered
for the forward and again for the backward, as async start/done pairs), and 17.9 MB of
temporaries: at this width its tiled layouts pad dimensions to 128, so tiny models read
larger on TPU; the CPU gradient all-reduce grows with the model instead. Treat XLA:CPU
figures as an estimate of an accelerator's; plan with --topology for the real ones.
"""
import dataclasses
import math
import pathlib
import re
import time

import jax
import numpy as np

from bigpretrain.plan import accelerators
from bigpretrain.plan import flops
from bigpretrain.plan import hlo_collectives
from bigpretrain.plan import hlo_traffic
from bigpretrain import objectives
from bigpretrain.semisup import pool_predictions
from bigpretrain import sharding
from bigpretrain import train
from bigpretrain.models import base as models_base
from bigpretrain.models import pretrained
from input_pipeline import datasets
from input_pipeline.sources import demo
from input_pipeline.sources import demo_coarse

# XLA:GPU with no GPU cannot autotune, and its default Triton GEMM tiling fails on some
# shapes ("Couldn't find output tile sizes", e.g. ViT-B/16's bf16[12608,768] dot): a
# compile-only plan emits GEMMs as cuBLAS calls instead (memory and collectives unchanged).
GPU_COMPILE_ONLY_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
# Known datasets' class lists, shipped with the package.
_SEMANTIC_DATA = pathlib.Path(__file__).parent.parent / "semantic" / "data"


def shard_bytes(abstract_tree) -> int:
  """Per-device bytes of a tree of ShapeDtypeStructs with shardings (the largest shard)."""
  total = 0
  for leaf in jax.tree.leaves(abstract_tree):
    shape = leaf.sharding.shard_shape(leaf.shape)
    total += math.prod(shape) * leaf.dtype.itemsize
  return int(total)


def known_class_names(data_name: str) -> list[str] | None:
  """The class list of a dataset the package knows by name, or None."""
  if demo.is_demo_name(data_name):
    return demo.load_wnids()
  if data_name in demo_coarse.FINE:  # The demo's classes one level up.
    return demo_coarse.coarse_map(demo.load_wnids(),
                                  leaves_only=demo_coarse.leaves_only(data_name))[1]
  files = {datasets.IMAGENET21K_P: "imagenet21k_p_wnids.txt",
           "tfds:imagenet2012": "imagenet1k_wnids.txt"}
  if data_name in files:
    return (_SEMANTIC_DATA / files[data_name]).read_text().split()
  return None


@dataclasses.dataclass
class StandIn:
  """A dataset with only its `info`: what the trainer's build reads before any record."""
  info: object


def planning_dataset(config, objective_reads, num_classes: int | None = None,
                     list_length: int = 16) -> StandIn:
  """A stand-in dataset for `config.data`: its class list if the package knows it (else
  `num_classes` classes named 'class_i'), the fields the objective reads (id lists padded to
  `list_length`: the step's shapes need one; the run length's split sizes do not matter to
  the step, so every split has one global batch)."""
  name = str(config.data.name)
  if name not in datasets.SOURCES:  # A misspelt name, which the run would meet at its start.
    raise ValueError(datasets.SOURCES.unknown_message(name))
  names = known_class_names(name)
  if names is None:
    if not num_classes:
      raise ValueError(f"Dataset {name!r} has no class list in the package: pass "
                       "--num_classes=K to plan it.")
    names = [f"class_{i}" for i in range(num_classes)]
  elif num_classes and num_classes != len(names):
    raise ValueError(f"--num_classes={num_classes} but dataset {name!r} has {len(names)} "
                     "classes; drop --num_classes.")
  splits = tuple(sorted({config.data.get("train_split", "train"),
                         config.data.get("eval_split", "validation")}))
  features = {"label": 0, **{f: (0 if f == "label" else list_length) for f in objective_reads}}
  return StandIn(datasets.DatasetInfo(
      name=name, num_classes=len(names), class_names=list(names),
      num_examples={s: int(config.batch_size) for s in splits},
      image_size=int(config.data.image_size), splits=splits, features=features))


def abstract_batch(exp) -> dict:
  """The global batch the step takes, as ShapeDtypeStructs sharded over the batch axes
  (fields as input_pipeline.pipeline.record_fields ships them, plus the trainer's '_skipped')."""
  b, size = int(exp.config.batch_size), int(exp.config.data.image_size)
  spec = sharding.batch_sharding(exp.mesh)
  one = lambda shape, dtype: jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=spec)
  batch = {"image": one((b, size, size, 3), np.uint8), "_skipped": one((b,), np.int32)}
  for name, length in exp.fields.items():
    if length == 0:
      batch[name] = one((b,), np.int32)
    else:
      batch[name], batch[f"num_{name}"] = one((b, length), np.int32), one((b,), np.int32)
  return batch


STEPS = ("train", "infer")
# How a plan's flops_per_device is counted (bigpretrain/plan/flops.py); plans without the key
# carry XLA's cost analysis of the compiled step, which on GPUs leaves out cuBLAS/cuDNN.
FLOPS_FROM = "jaxpr"


def trace_step(config, num_classes: int | None = None, devices=None,
               teacher_model: str | None = None, step: str = "train", top_p: int = 10):
  """(Experiment, abstract state, traced step) of `config` on the available (or the given)
  devices, with nothing allocated and no dataset read. The state of step='infer' is the
  model's {'params', 'extra'}; `teacher_model` names a distillation teacher's model."""
  if step not in STEPS:
    raise ValueError(f"step={step!r} must be one of {STEPS}.")
  if teacher_model is not None and teacher_model not in models_base.MODELS:
    raise ValueError(models_base.MODELS.unknown_message(teacher_model, "--teacher_model"))
  config = config.copy_and_resolve_references()
  with config.unlocked():
    if config.data.get("subset_frac", 1.0) != 1.0:  # A few-shot draw reads the records.
      config.data.subset_frac = 1.0
    # A compile-only executable cannot be loaded back from the persistent cache (no client to
    # load it into): every later plan would warn on reading it. jax decides once per process
    # whether it uses the cache, so it must never be set up here.
    if _compile_only(devices):
      config.compilation_cache_dir = "none"
  # The objective's fields, read off an objective built on a label-only stand-in.
  probe = planning_dataset(config, (), num_classes)
  reads = objectives.get_objective(config.objective, probe.info).reads
  exp = train.build(config, devices, dataset=planning_dataset(config, reads, num_classes),
                    load_frozen=False)
  frozen, frozen_shardings = exp.objective.abstract_frozen(
      exp.mesh, train.rules_of(config), config.compute_dtype, config.data,
      None if teacher_model is None else {"name": teacher_model})
  if teacher_model is not None and frozen is None:
    raise ValueError(f"--teacher_model={teacher_model!r}: objective "
                     f"{config.objective.name!r} has no teacher.")
  exp = dataclasses.replace(exp, frozen=frozen, frozen_shardings=frozen_shardings)
  with jax.set_mesh(exp.mesh):
    if step == "train":
      state = exp.abstract_state()
      traced = exp.train_step().trace(state, abstract_batch(exp), exp.frozen)
    else:
      pool_predictions.check_top_p(top_p, exp.dataset.info.num_classes)
      state, shardings = pretrained.abstract_variables(exp.model_def, exp.mesh,
                                                       train.rules_of(config))
      forward = pool_predictions.make_step(exp.model_def, shardings, exp.mesh,
                                           config.data.normalize, top_p, logits=False)
      traced = forward.trace(state["params"], state["extra"], abstract_infer_batch(exp))
  return exp, state, traced


def _compile_only(devices) -> bool:
  """Devices of a deviceless compile (another platform than this process runs on)."""
  return devices is not None and devices[0].platform != jax.default_backend()


def _compile(exp, traced):
  platform = exp.mesh.devices.flat[0].platform
  compile_only = _compile_only(exp.mesh.devices.flat)
  options = GPU_COMPILE_ONLY_OPTIONS if platform in ("gpu", "cuda") and compile_only else None
  with jax.set_mesh(exp.mesh):
    return traced.lower().compile(compiler_options=options)


def compile_step(config, num_classes: int | None = None, devices=None,
                 teacher_model: str | None = None, step: str = "train", top_p: int = 10):
  """trace_step's (experiment, abstract state), the compiled step and its FLOPs per device
  (bigpretrain/plan/flops.py; a train step's as its model defines them:
  train.Experiment.model_flops_per_device)."""
  exp, state, traced = trace_step(config, num_classes, devices, teacher_model, step, top_p)
  return exp, state, _compile(exp, traced), _flops_per_device(exp, state, traced, step)


def _flops_per_device(exp, state, traced, step: str) -> float:
  """A train step's FLOPs as MFU counts them (train.Experiment.model_flops_per_device: XLA's
  kernels, no rematerialisation), an inference step's as traced."""
  if step == "train":
    return exp.model_flops_per_device(state, abstract_batch(exp), traced)
  return flops.traced_flops_per_device(traced, exp.mesh.size)


def step_flops(config, num_classes: int | None = None, devices=None,
               teacher_model: str | None = None, step: str = "train", top_p: int = 10,
               accelerator: str | None = None) -> dict:
  """The step's FLOPs per device without compiling it (a trace only: seconds); with
  `accelerator`, its roofline (`roofline`: collectives unknown on more than one device)."""
  exp, state, traced = trace_step(config, num_classes, devices, teacher_model, step, top_p)
  out = {"flops_per_device": _flops_per_device(exp, state, traced, step),
         "devices": exp.mesh.size, "flops_from": FLOPS_FROM}
  if accelerator:
    acc = accelerators.get(accelerator)
    peak = acc.peak(config.compute_dtype)
    out.update(accelerator=accelerator, roofline=roofline(
        flops.jaxpr_costs(traced.jaxpr, acc), None, acc, exp.mesh.size))
    out["mfu_at_roofline"] = out["flops_per_device"] / (out["roofline"]["step_seconds"] * peak)
  return out


def abstract_infer_batch(exp) -> dict:
  """The inference engine's global batch: images, each row's 'index' and 'mask'."""
  b, size = int(exp.config.batch_size), int(exp.config.data.image_size)
  spec = sharding.batch_sharding(exp.mesh)
  return {"image": jax.ShapeDtypeStruct((b, size, size, 3), np.uint8, sharding=spec),
          "index": jax.ShapeDtypeStruct((b,), np.int64 if jax.config.jax_enable_x64
                                        else np.int32, sharding=spec),
          "mask": jax.ShapeDtypeStruct((b,), np.int32, sharding=spec)}


def cost_estimate(compiled) -> dict:
  """The compiler's own step estimate where it gives one (libtpu does, for small steps and
  ViT-B/16 on v5p; for ViT-B/16 on v5e it returns a negative optimal_seconds, kept as
  'invalid_optimal_seconds'; XLA:CPU and XLA:GPU give none): 'optimal_seconds', its roofline
  time for the compiled step, 'bytes_accessed', the HBM traffic it assumes, and
  'compiler_flops', its FLOPs. Absent keys mean no estimate."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  out = {}
  if cost and "optimal_seconds" in cost:
    seconds = float(cost["optimal_seconds"])
    out["optimal_seconds" if seconds > 0 else "invalid_optimal_seconds"] = seconds
  if cost and cost.get("bytes accessed", 0) > 0:
    out["bytes_accessed"] = float(cost["bytes accessed"])
  if cost and cost.get("flops", 0) > 0:  # Elementwise work included; XLA:GPU's lacks GEMMs.
    out["compiler_flops"] = float(cost["flops"])
  return out


# Bytes each device sends per byte of a collective's result, over n devices (ring
# algorithms): a gather sends all but its own shard, a reduce-scatter all but its own share
# of the n-times larger input, an all-reduce both, a permute its whole buffer.
_WIRE = {"all-gather": lambda n: (n - 1) / n, "reduce-scatter": lambda n: n - 1,
         "all-reduce": lambda n: 2 * (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
         "collective-permute": lambda n: 1.0}


def roofline(costs: dict, collectives: dict, acc, num_devices: int) -> dict:
  """The step's roofline time per device by op class, from bigpretrain/plan/flops.py's per-op
  costs of the traced step (over all devices) and the compiled step's collectives: each op
  takes the longer of its FLOPs at the chip's peak (its operands' dtype's: float32 at
  peak_f32) and its bytes at the HBM bandwidth; elementwise ops their unfused bytes (XLA
  fuses chains of them, so this class is an upper estimate); collectives the bytes each
  device sends (_WIRE; the group taken as all devices) at one direction of the chip's
  interconnect (None where the table has no figure; across GPU nodes the network is slower
  still; unknown without a compiled step, `collectives` None). step_seconds adds the classes
  up, nothing overlapped; mfu_at_roofline is the MFU a step that fast would have."""
  n = num_devices
  out = {c: {"flops": costs[c].flops / n, "bytes": costs[c].bytes / n,
             "seconds": costs[c].seconds / n} for c in flops.CLASSES}
  if n == 1:
    wire = seconds = 0.0
  elif collectives is None:  # Not compiled (step_flops): unknown, left out of the step.
    wire = seconds = None
  else:
    wire = sum(_WIRE[kind](n) * c["bytes"] for kind, c in collectives.items())
    link = acc.interconnect_bandwidth / 2
    seconds = wire / link if link else None
  out["collectives"] = {"bytes": wire, "seconds": seconds}
  known = [v["seconds"] for v in out.values()]
  out["step_seconds"] = (None if None in known and collectives is not None
                         else sum(s for s in known if s is not None))
  return out


def plan(config, num_classes: int | None = None, accelerator: str | None = None,
         devices=None, teacher_model: str | None = None, step: str = "train",
         top_p: int = 10) -> dict:
  """The plan of `config`'s train step (or inference step) on `devices` (default:
  jax.devices()), as a JSON-ready dict (see the module docstring); all `_bytes` per device.
  `accelerator` (a key of accelerators.ACCELERATORS) defaults to the table's entry for the
  devices' kind, if any; with one, the plan has the step's roofline (see `roofline`), the
  MFU at it and at the compiler's optimal_seconds."""
  if accelerator is not None:
    accelerators.get(accelerator)  # A clear error before a long compile.
  start = time.perf_counter()
  exp, state, traced = trace_step(config, num_classes, devices, teacher_model, step, top_p)
  compiled = _compile(exp, traced)
  compile_s = time.perf_counter() - start
  device = exp.mesh.devices.flat[0]
  if accelerator is None:
    known = accelerators.by_device_kind(device.device_kind)
    accelerator = known.name if known else None
  acc = accelerators.get(accelerator) if accelerator else None
  costs = flops.jaxpr_costs(traced.jaxpr, acc)  # The kernels' own work: the roofline's.
  flops_per_device = _flops_per_device(exp, state, traced, step)
  mem = compiled.memory_analysis()
  hlo = compiled.as_text()
  report = sharding.param_report(exp.model_def.abstract_params, train.rules_of(exp.config),
                                 exp.mesh)
  out = {
      "config": config.objective.name, "model": config.model.name, "step": step,
      "compiler": accelerators.compiler_name(device), "device_kind": device.device_kind,
      "devices": exp.mesh.size, "mesh": dict(exp.mesh.shape),
      "batch_size": int(config.batch_size),
      "batch_per_device": int(config.batch_size) // (exp.mesh.shape["data"]
                                                     * exp.mesh.shape["fsdp"]),
      "image_size": int(config.data.image_size), "compute_dtype": config.compute_dtype,
      "remat": config.model.get("remat", "") or "none",
      "num_classes": exp.dataset.info.num_classes,
      "num_params": sum(math.prod(x.shape) for x in jax.tree.leaves(state["params"])),
      "params_bytes": shard_bytes(state["params"]),
      # What params_bytes would be if the rules split every array over all their mesh axes,
      # and the arrays they leave whole on an axis none of their dimensions divides.
      "params_ideal_bytes": report.ideal_bytes,
      "replicated_params": [{"name": r.name, "shape": r.shape, "bytes": r.bytes,
                             "device_bytes": r.device_bytes, "axes": r.axes}
                            for r in report.replicated],
      "opt_state_bytes": shard_bytes(state["opt_state"]) if "opt_state" in state else 0,
      "state_bytes": shard_bytes(state),
      "argument_bytes": int(mem.argument_size_in_bytes),
      "output_bytes": int(mem.output_size_in_bytes),
      "alias_bytes": int(mem.alias_size_in_bytes),
      "temp_bytes": int(mem.temp_size_in_bytes),
      "generated_code_bytes": int(mem.generated_code_size_in_bytes),
      "flops_per_device": flops_per_device, "flops_from": FLOPS_FROM,
      **cost_estimate(compiled),
      "collectives": hlo_collectives.collectives(hlo),
      "compile_seconds": round(compile_s, 1),
  }
  if report.replicated:
    out["replicated_params_advice"] = report.advice()
  if exp.frozen is not None:  # A distillation teacher: an input of every step.
    out["frozen_bytes"] = shard_bytes(exp.frozen)
    if teacher_model is not None:
      out["teacher_model"] = teacher_model
  # Live at the peak: the inputs, the outputs not written in place of a donated input, and
  # the temporaries (XLA's own total, as jax's memory_analysis tests count it).
  out["total_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"]
                        + out["temp_bytes"])
  if accelerator is not None:
    hbm = accelerators.get(accelerator).hbm_bytes
    out.update(accelerator=accelerator, hbm_bytes=hbm, fits=out["total_bytes"] <= hbm,
               margin_bytes=hbm - out["total_bytes"])
    peak = acc.peak(config.compute_dtype)
    out["roofline"] = roofline(costs, out["collectives"], acc, exp.mesh.size)
    bound = out["roofline"]["step_seconds"]
    if bound:
      out["mfu_at_roofline"] = flops_per_device / (bound * peak)
    if "optimal_seconds" in out:
      out["mfu_at_optimal_seconds"] = flops_per_device / (out["optimal_seconds"] * peak)
    if device.platform == "tpu" and "bytes_accessed" in out and "compiler_flops" in out:
      # libtpu's own FLOPs and fused HBM traffic bound the step from below.
      out["compiler_bound_seconds"] = max(out["compiler_flops"] / peak,
                                          out["bytes_accessed"] / acc.hbm_bandwidth)
      out["mfu_at_compiler_bound"] = flops_per_device / (out["compiler_bound_seconds"] * peak)
    if device.platform == "gpu":  # XLA:GPU gives no cost analysis: its kernels' traffic.
      work = (costs["matmul"].flops + costs["attention"].flops) / exp.mesh.size
      out["kernel_bound"] = hlo_traffic.bound(hlo_traffic.traffic(hlo), flops_per_device, peak,
                                              acc.hbm_bandwidth, work_flops=work)
  return out


def parse_mesh(spec: str) -> dict:
  """'data:2,fsdp:4,tensor:1' -> {'data': 2, 'fsdp': 4, 'tensor': 1} (missing axes: 1)."""
  out = dict.fromkeys(sharding.MESH_AXES, 1)
  for part in (p.strip() for p in spec.split(",") if p.strip()):
    axis, _, size = part.partition(":")
    if axis not in sharding.MESH_AXES or not re.fullmatch(r"-?\d+", size):
      raise ValueError(f"--mesh={spec!r}: each entry must be AXIS:SIZE with AXIS in "
                       f"{sharding.MESH_AXES} and SIZE an int (-1 = the remaining devices).")
    out[axis] = int(size)
  return out


def _gb(x: int) -> str:
  return f"{x / 1e9:8.3f} GB"


def _replicated_lines(p: dict, top: int = 3) -> list[str]:
  """The plan's parameters left replicated on a mesh axis: how many, their bytes per device,
  the largest, and what to do."""
  rep = sorted(p["replicated_params"], key=lambda r: -r["device_bytes"])
  lines = [f"    {len(rep)} parameter array(s), {_gb(sum(r['device_bytes'] for r in rep))} per "
           "device, stay replicated on a mesh axis, a dimension the rules name not dividing "
           "its axis; the largest:"]
  for r in rep[:top]:
    axes = "+".join(f"{a}={n}" for a, n in r["axes"].items())
    lines.append(f"      {r['name']} {tuple(r['shape'])} {r['device_bytes'] / 1e6:.2f} MB "
                 f"on {axes}")
  return lines + [f"    {p['replicated_params_advice']}"]


def describe(p: dict) -> str:
  """The plan as a few readable lines."""
  teacher = f" (teacher {p['teacher_model']})" if "teacher_model" in p else ""
  lines = [f"{p['model']} / {p['config']}{teacher}, {p['step']} step: {p['devices']} devices, "
           f"mesh {p['mesh']}, batch "
           f"{p['batch_size']} ({p['batch_per_device']} per device), {p['image_size']}px, "
           f"{p['compute_dtype']}, {p['num_params'] / 1e6:.1f}M params, remat "
           f"{p.get('remat', 'none')}",
           f"compiler: {p['compiler']}", "per device:"]
  for key in ("params_bytes", "params_ideal_bytes", "opt_state_bytes", "state_bytes",
              "frozen_bytes", "argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
              "generated_code_bytes", "total_bytes"):
    if key in p:
      ratio = (f"  (params_bytes {p['params_bytes'] / max(p[key], 1):.1f}x)"
               if key == "params_ideal_bytes" else "")
      lines.append(f"  {key:22s}{_gb(p[key])}{ratio}")
    if key == "params_ideal_bytes" and p.get("replicated_params"):
      lines.extend(_replicated_lines(p))
  lines.append(f"  {'flops_per_device':22s}{p['flops_per_device'] / 1e12:8.3f} TFLOP per step")
  if "optimal_seconds" in p:
    lines.append(f"  {'optimal_seconds':22s}{p['optimal_seconds'] * 1e3:8.3f} ms per step "
                 f"(the compiler's roofline estimate: MFU {p['mfu_at_optimal_seconds']:.1%})")
  if "compiler_bound_seconds" in p:
    lines.append(f"  {'compiler bound':22s}{p['compiler_bound_seconds'] * 1e3:8.3f} ms per step "
                 f"(its FLOPs at peak or bytes accessed at the HBM bandwidth: MFU "
                 f"{p['mfu_at_compiler_bound']:.1%})")
  if "invalid_optimal_seconds" in p:
    lines.append(f"  {'optimal_seconds':22s}{p['invalid_optimal_seconds']:8.3f} s: the "
                 "compiler gave no valid estimate")
  if "roofline" in p:
    r = p["roofline"]
    lines.append("  roofline per step (each op at peak FLOP/s or HBM bandwidth):")
    for c in (*flops.CLASSES, "collectives"):
      ms = "n/a" if r[c]["seconds"] is None else f"{r[c]['seconds'] * 1e3:8.3f} ms"
      tflop = f", {r[c]['flops'] / 1e12:.3f} TFLOP" if r[c].get("flops") else ""
      lines.append(f"    {c:20s}{ms:>11s}  ({r[c]['bytes'] / 1e9:.3f} GB{tflop})")
    if r["step_seconds"] is not None:
      lines.append(f"    {'step':20s}{r['step_seconds'] * 1e3:8.3f} ms  (MFU at this bound "
                   f"{p['mfu_at_roofline']:.1%})")
  if "kernel_bound" in p:
    k = p["kernel_bound"]
    lines.append("  compiled kernels per step (hlo_traffic: operands read, results written):")
    for c, seconds in (("matmul", k["matmul_seconds"]), ("memory", k["memory_seconds"])):
      lines.append(f"    {c:20s}{seconds * 1e3:8.3f} ms  ({k['kernels'][c]} kernels, "
                   f"{k['bytes'][c] / 1e9:.3f} GB)")
    lines.append(f"    {'step':20s}{k['bound_seconds'] * 1e3:8.3f} ms  (MFU at this bound "
                 f"{k['mfu_at_bound']:.1%})")
  for kind, c in p["collectives"].items():
    if c["count"]:
      windowed = f" ({c['windowed']} as collective matmuls)" if c.get("windowed") else ""
      lines.append(f"  {kind:22s}{c['count']:5d} ops {_gb(c['bytes'])}{windowed}")
  if "accelerator" in p:
    verdict = "fits" if p["fits"] else "does NOT fit"
    lines.append(f"{p['accelerator']} ({p['hbm_bytes'] / 2**30:.0f} GiB): {verdict}, margin "
                 f"{p['margin_bytes'] / 2**30:.2f} GiB")
  return "\n".join(lines)




def max_batch(config, memory_bytes: int, remat: str = "none", num_classes: int | None = None,
              devices=None, teacher_model: str | None = None, limit: int = 4096) -> dict:
  """The largest per-device batch of `config`'s train step whose planned memory (the compiled
  step's total_bytes) fits in `memory_bytes`, with the model's `remat` policy: doubling from
  one image per device until a batch does not fit (or `limit`), then bisecting; assumes
  memory grows with the batch. Every probe is a full compile (minutes for a large step on an
  accelerator's compiler). Returns {'remat', 'max_batch_per_device' (0: not even one),
  'total_bytes' (of that batch), 'probes': {batch per device: total_bytes}}."""
  config = config.copy_and_resolve_references()
  devices = jax.devices() if devices is None else devices
  shape = dict(zip(sharding.MESH_AXES, sharding.mesh_shape(config.mesh, len(devices))))
  shards = shape["data"] * shape["fsdp"]  # The batch axes.
  # Per-device batches in steps of `unit`, so that the global batch splits into the
  # BatchNorm groups of config.model.bn_group_size.
  unit = math.lcm(shards, config.model.get("bn_group_size", 0) or 1) // shards
  probes = {}

  def fits(k: int) -> bool:
    b = k * unit
    with config.unlocked():
      config.model.remat = remat
      config.batch_size = b * shards
    probes[b] = plan(config, num_classes, devices=devices,
                     teacher_model=teacher_model)["total_bytes"]
    return probes[b] <= memory_bytes

  lo, hi, top = 0, 1, max(limit // unit, 1)
  while hi <= top and fits(hi):
    lo, hi = hi, hi * 2
  hi = min(hi, top + 1)
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
  return {"remat": remat, "max_batch_per_device": lo * unit,
          "total_bytes": probes.get(lo * unit), "memory_bytes": memory_bytes,
          "probes": dict(sorted(probes.items()))}
