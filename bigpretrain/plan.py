r"""Memory and compile plan of a config's train step, ahead of time, on fake CPU devices.

  python -m bigpretrain.plan --config=configs/semantic_softmax.py:model=vit_b16,dataset=imagenet21k_p \
      --devices=64 --mesh=data:1,fsdp:64,tensor:1 --accelerator=h100 [--json]

Compiles the real train step (the config's objective, model, optimizer, shardings and batch)
for `--devices` fake CPU devices with abstract state (jax.ShapeDtypeStruct with shardings:
nothing is allocated) and without the dataset: the class lists of the known datasets ship
with the package (DatasetInfo is fabricated from them), others take --num_classes. Prints,
per device: parameter and optimizer-state bytes (each leaf's shard), XLA's memory analysis
(arguments, outputs, aliased, temporaries, generated code), FLOPs per step from its cost
analysis, the collectives of the compiled HLO by kind (count and result bytes), and whether
the step fits the named accelerator's memory, with the margin.

The figures are XLA:CPU's: a GPU or TPU compile fuses and schedules differently (temporaries
especially), so treat them as an estimate of the accelerator's, not its measurement. One
known CPU difference: XLA:CPU all-reduces the gradients of FSDP-sharded weights in full and
then slices them (the all-reduce bytes equal the float32 parameter bytes, whatever the device
count), so temp_bytes holds a full gradient per device that a reduce-scatter would not.
"""
import dataclasses
import json
import math
import pathlib
import re
import sys

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags
import numpy as np

from bigpretrain import goodput
from bigpretrain import objectives
from bigpretrain import sharding
from bigpretrain import train
from input_pipeline import datasets
from input_pipeline import demo

# Per-chip HBM, in bytes. Vendors' figures: Google Cloud TPU docs (v5e: 16 GiB HBM2 per chip;
# v5p: 95 GiB HBM2e per chip); NVIDIA datasheets (H100 SXM 80 GB HBM3, H200 141 GB HBM3e,
# A100 80 GB HBM2e), counted here as GiB as the memory the runtime reports is (nvidia-smi
# shows ~79.6 GiB on an H100, ~140.4 GiB on an H200: use the margin, not a zero-margin fit).
HBM_BYTES = {
    "v5e": 16 * 2**30,
    "v5p": 95 * 2**30,
    "h100": 80 * 2**30,
    "h200": 141 * 2**30,
    "a100-80": 80 * 2**30,
}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# Bytes per element of HLO element types.
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
                "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
                "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
# One HLO instruction: '%name = <result shape(s)> <opcode>(' (async collectives as '-start').
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+("
                          + "|".join(COLLECTIVES) + r")(?:-start)?\(")
# Known datasets' class lists, shipped with the package.
_SEMANTIC_DATA = pathlib.Path(__file__).parent / "semantic" / "data"


def shape_bytes(text: str) -> int:
  """Total bytes of the array shapes in an HLO shape string, e.g. '(f32[8,4]{1,0}, s32[])'."""
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return int(total)


def collectives(hlo_text: str) -> dict:
  """{kind: {'count', 'bytes'}} of the collectives in compiled HLO text; bytes are each op's
  result per device (an async '-start' counts once, its '-done' not; for an async start the
  result tuple also holds the operand, so only its last element, the output, is counted)."""
  out = {k: {"count": 0, "bytes": 0} for k in COLLECTIVES}
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    result, kind = m.group(1), m.group(2)
    if f"{kind}-start(" in line:
      shapes = _SHAPE.findall(result)
      result = f"{shapes[-1][0]}[{shapes[-1][1]}]" if shapes else ""
    out[kind]["count"] += 1
    out[kind]["bytes"] += shape_bytes(result)
  return out


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


def compile_step(config, num_classes: int | None = None, devices=None):
  """(Experiment, abstract state, compiled train step) of `config` on the available (or the
  given) devices, with nothing allocated and no dataset read."""
  config = config.copy_and_resolve_references()
  if config.data.get("subset_frac", 1.0) != 1.0:  # A few-shot draw reads the records.
    with config.unlocked():
      config.data.subset_frac = 1.0
  # The objective's fields, read off an objective built on a label-only stand-in.
  probe = planning_dataset(config, (), num_classes)
  reads = objectives.get_objective(config.objective, probe.info).reads
  exp = train.build(config, devices, dataset=planning_dataset(config, reads, num_classes))
  state = exp.abstract_state()
  with jax.set_mesh(exp.mesh):
    compiled = exp.train_step().lower(state, abstract_batch(exp), exp.frozen).compile()
  return exp, state, compiled


def plan(config, num_classes: int | None = None, accelerator: str | None = None,
         devices=None) -> dict:
  """The plan of `config`'s train step (see the module docstring); all `_bytes` per device."""
  if accelerator is not None and accelerator not in HBM_BYTES:
    raise ValueError(f"--accelerator={accelerator!r} is unknown; known: {sorted(HBM_BYTES)}.")
  exp, state, compiled = compile_step(config, num_classes, devices)
  mem = compiled.memory_analysis()
  out = {
      "config": config.objective.name, "model": config.model.name,
      "devices": exp.mesh.size, "mesh": dict(exp.mesh.shape),
      "batch_size": int(config.batch_size),
      "batch_per_device": int(config.batch_size) // (exp.mesh.shape["data"]
                                                     * exp.mesh.shape["fsdp"]),
      "image_size": int(config.data.image_size), "compute_dtype": config.compute_dtype,
      "num_classes": exp.dataset.info.num_classes,
      "num_params": sum(math.prod(x.shape) for x in jax.tree.leaves(state["params"])),
      "params_bytes": shard_bytes(state["params"]),
      "opt_state_bytes": shard_bytes(state["opt_state"]),
      "state_bytes": shard_bytes(state),
      "argument_bytes": int(mem.argument_size_in_bytes),
      "output_bytes": int(mem.output_size_in_bytes),
      "alias_bytes": int(mem.alias_size_in_bytes),
      "temp_bytes": int(mem.temp_size_in_bytes),
      "generated_code_bytes": int(mem.generated_code_size_in_bytes),
      "flops_per_device": goodput.compiled_flops(compiled),
      "collectives": collectives(compiled.as_text()),
  }
  # Live at the peak: the inputs, the outputs not written in place of a donated input, and
  # the temporaries (XLA's own total, as jax's memory_analysis tests count it).
  out["total_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"]
                        + out["temp_bytes"])
  if accelerator is not None:
    hbm = HBM_BYTES[accelerator]
    out.update(accelerator=accelerator, hbm_bytes=hbm, fits=out["total_bytes"] <= hbm,
               margin_bytes=hbm - out["total_bytes"])
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


def describe(p: dict) -> str:
  """The plan as a few readable lines."""
  lines = [f"{p['model']} / {p['config']}: {p['devices']} devices, mesh {p['mesh']}, batch "
           f"{p['batch_size']} ({p['batch_per_device']} per device), {p['image_size']}px, "
           f"{p['compute_dtype']}, {p['num_params'] / 1e6:.1f}M params",
           "per device:"]
  for key in ("params_bytes", "opt_state_bytes", "state_bytes", "argument_bytes",
              "output_bytes", "alias_bytes", "temp_bytes", "generated_code_bytes",
              "total_bytes"):
    lines.append(f"  {key:22s}{_gb(p[key])}")
  lines.append(f"  {'flops_per_device':22s}{p['flops_per_device'] / 1e12:8.3f} TFLOP per step")
  for kind, c in p["collectives"].items():
    if c["count"]:
      lines.append(f"  {kind:22s}{c['count']:5d} ops {_gb(c['bytes'])}")
  if "accelerator" in p:
    verdict = "fits" if p["fits"] else "does NOT fit"
    lines.append(f"{p['accelerator']} ({p['hbm_bytes'] / 2**30:.0f} GiB): {verdict}, margin "
                 f"{p['margin_bytes'] / 2**30:.2f} GiB")
  return "\n".join(lines)


def define_flags() -> None:
  """The command's flags, defined only when it runs (no clash with other commands' flags when
  modules are imported together, e.g. by the tests)."""
  config_flags.DEFINE_config_file("config", None, "Recipe config file (and :args).",
                                  lock_config=True)
  flags.DEFINE_integer("devices", None, "Fake CPU devices to plan for.")
  flags.DEFINE_string("mesh", "", "data:A,fsdp:B,tensor:C (wins over config.mesh).")
  flags.DEFINE_enum("accelerator", None, sorted(HBM_BYTES),
                    "Accelerator whose memory the plan is checked against.")
  flags.DEFINE_integer("num_classes", None, "Classes of a dataset whose class list does not "
                       "ship with the package.")
  flags.DEFINE_bool("json", False, "Print one JSON line instead of text.")
  flags.mark_flags_as_required(["config", "devices"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  if f.devices < 1:
    raise app.UsageError(f"--devices={f.devices} must be >= 1.")
  # Fake CPU devices; must be set before jax's backend starts (nothing above touched it).
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", f.devices)
  if jax.device_count() != f.devices:
    raise RuntimeError(f"jax started with {jax.device_count()} devices, not --devices="
                       f"{f.devices} (XLA_FLAGS' xla_force_host_platform_device_count?).")
  logging.set_verbosity(logging.WARNING)  # Not the per-parameter sharding lines.
  config = f.config
  try:
    if f.mesh:
      config = config.copy_and_resolve_references()
      with config.unlocked():
        config.mesh.update(parse_mesh(f.mesh))
    p = plan(config, f.num_classes, f.accelerator)
  except (ValueError, FileNotFoundError) as e:
    print(f"ERROR: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
  print(json.dumps(p) if f.json else describe(p), flush=True)


if __name__ == "__main__":
  define_flags()
  app.run(main)
