"""The figures to take the day an accelerator is at hand, in one command: one JSON line per
figure, then a markdown table of them all.

  python benchmarks/accelerator.py              # on whatever accelerator JAX sees
  python benchmarks/accelerator.py --dry_run    # small sizes (the default on a CPU backend)

Figures (each line's `figure`):
  vit_b16_train          semantic softmax ViT-B/16 on ImageNet-21K-P's classes, bfloat16,
                         224 px, the paper's 64 images per device (512 on 8 V100s): img/s,
                         step time, perf/mfu
  regnety_16gf_train     SWAG's RegNetY-16GF, bfloat16, 224 px, 64 per device (8,192 on 128
                         GPUs), 27,000 hashtag classes: the same fields
  tresnet_m_vs_resnet50  TResNet-M / ResNet-50 step time under the semantic softmax recipe, in
                         alternated rounds (the ImageNet-21K paper: TResNet-M trains as fast)
  esd_memory_ratio       cosub's efficient stochastic depth: step memory ESD / masked for
                         ViT-B/16 at 224 (benchmarks/cosub.py)
  keep_up                the train pipeline's steady-state records/s on this host's cores
                         (all of them as grain workers; benchmarks/steady_state.py) over the
                         ViT-B/16 step's images/s, per host; the demo dataset's small PNGs
                         (or --keep_up_data_dir's imagenet21k_p JPEGs) at 224 px with the
                         recipe's augmentations
  plan_vs_measured       the plan's prediction for the ViT-B/16 step, compiled for these
                         devices (memory; step time at peak FLOP/s, and the compiler's own
                         estimate where the plan gives one) over what the device measured
`process_peak_bytes` is the device's peak memory since the process started (the runtime
keeps no per-step peak): it is the step's own for the first figure only.
Every line has the keys of KEYS: `value` is the headline number in `unit` (null when this
device cannot give it, e.g. memory on a CPU), the rest are the figure's details.
The dry run swaps in the demo models (vit_demo, regnety_demo; ViT vs RegNetY for the
TResNet-M/ResNet-50 pair) at 32 px, 2 images per device (16 for ESD, which drops whole rows),
one step, the demo's classes and 100 hashtags: it checks the command, not the speed.
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import gc  # pylint: disable=g-import-not-at-top
import json
import time

from absl import app
from absl import flags
from absl import logging
import jax

from benchmarks import common
from benchmarks import cosub
from benchmarks import keep_up
from benchmarks import train_step
from bigpretrain.plan import accelerators
from bigpretrain.plan import aot_plan
from bigpretrain.runtime import goodput
from bigpretrain import objectives
from configs import semantic_softmax
from configs import swag_regnety

_DRY_RUN = flags.DEFINE_bool("dry_run", None, "Small sizes (default: on when the backend is "
                             "the CPU).")
_STEPS = flags.DEFINE_integer("steps", None, "Timed steps per figure (default 10; dry run 1).")
_ROUNDS = flags.DEFINE_integer("rounds", None, "Alternated rounds of the model comparison "
                               "(default 3; dry run 1).")
_FIGURES = flags.DEFINE_list("figures", [], "Only these figures, in this order (default: "
                              "all).")

_KEEP_UP_DATA_DIR = flags.DEFINE_string(
    "keep_up_data_dir", None, "keep_up: read the train split of imagenet21k_p prepared here "
    "(224-px JPEGs; e.g. benchmarks/photo_set.py's crops) instead of the demo's PNGs.")

KEYS = ("figure", "value", "unit", "platform", "device_kind", "devices", "dry_run")
FIGURES = ("vit_b16_train", "regnety_16gf_train", "tresnet_m_vs_resnet50", "esd_memory_ratio",
           "keep_up", "plan_vs_measured")
PAPER_PER_DEVICE = 64  # Both papers: 512 on 8 V100s (ImageNet-21K), 8,192 on 128 (SWAG).
SWAG_CLASSES = 27_000  # SWAG's hashtag vocabulary (as README's plan rows take it).
def plan_prediction(config, num_classes=None) -> dict:
  """The plan's figures (bigpretrain/plan/aot_plan.py) for `config`'s train step compiled for this
  process's devices."""
  return aot_plan.plan(config, num_classes, devices=jax.devices())


def standin_dataset(config, num_classes=None):
  """The dataset stand-in the plan compiles with (class list and fields, no records)."""
  reads = objectives.get_objective(
      config.objective, aot_plan.planning_dataset(config, (), num_classes).info).reads
  return aot_plan.planning_dataset(config, reads, num_classes)


def accelerator(device, compute_dtype: str) -> dict:
  """Peak FLOP/s at `compute_dtype` and HBM bytes of `device` from the accelerator tables
  (None where unknown), and the memory its runtime reports."""
  chip = accelerators.by_device_kind(device.device_kind)
  stats = device.memory_stats() or {}
  return {"peak_flops": goodput.peak_flops(device.device_kind, compute_dtype),
          "hbm_bytes": chip.hbm_bytes if chip else None,
          "bytes_limit": stats.get("bytes_limit")}


class Suite:
  """Sizes by mode, the figures measured so far, and the lines printed."""

  def __init__(self, dry_run: bool, steps: int, rounds: int):
    self.dry_run, self.steps, self.rounds = dry_run, steps, rounds
    self.per_device = 2 if dry_run else PAPER_PER_DEVICE
    self.image_size = 32 if dry_run else 224
    # The dry run's classes: the demo's (a small WordNet tree) and 100 hashtags.
    self.ss_data = "dataset=demo" if dry_run else "dataset=imagenet21k_p"
    self.swag_classes = 100 if dry_run else SWAG_CLASSES
    self.lines = []
    self.vit = None  # The ViT-B/16 step's measurements, for keep_up and plan_vs_measured.

  def emit(self, figure: str, value, unit: str, **details):
    dev = jax.devices()[0]
    line = {"figure": figure, "value": value, "unit": unit, "platform": dev.platform,
            "device_kind": dev.device_kind, "devices": jax.device_count(),
            "dry_run": self.dry_run, **details}
    self.lines.append(line)
    print(json.dumps(line), flush=True)

  def sized(self, config, model: str):
    """`config` with `model` (its demo stand-in in a dry run) at this mode's sizes."""
    if config.model.name == model:  # Keep the recipe's model options.
      config = config.copy_and_resolve_references()
    else:
      config = train_step.with_model(config, model)
    config.batch_size = self.per_device * jax.device_count()
    config.data.image_size = self.image_size
    config.compute_dtype = "bfloat16"
    return config

  def train_figure(self, figure: str, config, num_classes=None) -> dict:
    dataset = standin_dataset(config, num_classes)
    runner = common.Runner(config, dataset)
    step_s = runner.run(self.steps)
    rep = common.report(config, step_s, runner.compile_s)
    flops = runner.flops
    acc = accelerator(jax.devices()[0], config.compute_dtype)
    perf = goodput.interval_metrics(wall_s=step_s, data_wait_s=0.0, steps=1, flops=flops,
                                    peak=acc["peak_flops"])
    stats = jax.devices()[0].memory_stats() or {}
    out = {"model": config.model.name, "batch_size": config.batch_size,
           "batch_per_device": self.per_device, "image_size": config.data.image_size,
           "compute_dtype": config.compute_dtype, "num_classes": dataset.info.num_classes,
           "step_time_ms": rep["step_time_ms"], "compile_time_s": rep["compile_time_s"],
           "flops_per_device": flops, "tflops_per_device": perf.get("perf/tflops_per_device"),
           "mfu": perf.get("perf/mfu"), "peak_flops": acc["peak_flops"],
           "process_peak_bytes": stats.get("peak_bytes_in_use"), "steps": self.steps}
    self.emit(figure, rep["images_per_sec"], "images/s", **out)
    del runner
    gc.collect()
    return out

  def vit_b16(self):
    config = semantic_softmax.get_config(f"{self.ss_data},model=vit_b16")
    config = self.sized(config, "vit_demo" if self.dry_run else "vit_b16")
    self.vit = {"config": config, **self.train_figure("vit_b16_train", config)}

  def regnety_16gf(self):
    config = swag_regnety.get_config("dataset=hashtags:ig,model=regnety_16gf")
    config = self.sized(config, "regnety_demo" if self.dry_run else "regnety_16gf")
    self.train_figure("regnety_16gf_train", config, self.swag_classes)

  def tresnet_vs_resnet(self):
    names = ["vit_demo", "regnety_demo"] if self.dry_run else ["resnet50", "tresnet_m"]
    config = self.sized(semantic_softmax.get_config(self.ss_data), names[0])
    out = train_step.compare(config, names, self.steps, self.rounds, standin_dataset(config))
    ratio = out["models"][names[1]][f"time_ratio_to_{names[0]}"]
    self.emit("tresnet_m_vs_resnet50", ratio, f"{names[1]}/{names[0]} step time",
              models=names, batch_size=config.batch_size, image_size=config.data.image_size,
              compute_dtype=config.compute_dtype, rounds=self.rounds, steps=self.steps,
              step_time_ms={n: m["step_time_ms"] for n, m in out["models"].items()})
    gc.collect()

  def esd_memory(self):
    model = "vit_demo" if self.dry_run else "vit_b16"
    # ESD drops whole rows of each device's batch: 2 rows would keep as much as masking.
    batch = (16 if self.dry_run else self.per_device) * jax.device_count()
    out = cosub.measure(model, self.image_size, batch, 0.5, self.steps, 1)
    self.emit("esd_memory_ratio", out["esd_memory_ratio"], "ESD/masked bytes", model=model,
              batch_size=batch, image_size=self.image_size, tau=0.5, compute_dtype="float32",
              esd_temp_memory_ratio=out["esd_temp_memory_ratio"],
              memory_mb_by_variant=out["memory_mb_by_variant"],
              esd_time_ratio=out["esd_time_ratio"])
    gc.collect()

  def keep_up(self):
    if self.vit is None:
      self.vit_b16()
    # The demo data, or imagenet21k_p prepared in --keep_up_data_dir; the paper's augmentations.
    data_dir = _KEEP_UP_DATA_DIR.value
    config = semantic_softmax.get_config("dataset=imagenet21k_p" if data_dir else None)
    config.data.dir = data_dir or config.data.dir
    paper = semantic_softmax.get_config("dataset=imagenet21k_p")
    config.batch_size = self.vit["batch_size"]
    config.data.image_size = self.image_size
    config.data.train_augment = paper.data.train_augment
    workers = 1 if self.dry_run else os.cpu_count()
    config.data.num_workers = workers
    # Steady state (benchmarks/steady_state.py); the dry run: 3 timed batches after 2.
    pipe = keep_up.pipeline_rate(config, batches_per_worker=3 if self.dry_run else None)
    records = pipe.pop("records_per_sec")
    train_rate = self.vit["batch_size"] / (self.vit["step_time_ms"] / 1e3) / jax.process_count()
    self.emit("keep_up", records / train_rate, "pipeline/train records per s",
              pipeline_records_per_sec=records, train_images_per_sec=train_rate,
              dataset=config.data.name, augment=config.data.train_augment,
              host_cpus=os.cpu_count(), image_size=self.image_size, **pipe)

  def plan_vs_measured(self):
    if self.vit is None:
      self.vit_b16()
    config = self.vit["config"]
    t0 = time.perf_counter()
    p = plan_prediction(config)
    plan_s = time.perf_counter() - t0
    measured_s = self.vit["step_time_ms"] / 1e3
    peak = self.vit["peak_flops"]
    at_peak_s = p["flops_per_device"] / peak if peak else None
    compiler_s = p.get("optimal_seconds")
    measured_bytes = self.vit["process_peak_bytes"]
    ratio = lambda a, b: a / b if a and b else None
    self.emit("plan_vs_measured", ratio(p["total_bytes"], measured_bytes),
              "planned/measured bytes", model=config.model.name,
              batch_size=config.batch_size, planned_total_bytes=p["total_bytes"],
              planned_temp_bytes=p["temp_bytes"], measured_peak_bytes=measured_bytes,
              planned_flops_per_device=p["flops_per_device"],
              measured_flops_per_device=self.vit["flops_per_device"],
              step_time_at_peak_ms=1e3 * at_peak_s if at_peak_s else None,
              compiler_step_time_ms=1e3 * compiler_s if compiler_s else None,
              measured_step_time_ms=1e3 * measured_s,
              at_peak_over_measured_time=ratio(at_peak_s, measured_s),
              compiler_over_measured_time=ratio(compiler_s, measured_s),
              plan_compile_s=plan_s)


def table(lines: list[dict]) -> str:
  """The figures as a markdown table."""
  def fmt(v):
    text = "n/a" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
    return text.replace("|", "\\|")  # A cell's own bars (e.g. an augment chain) escaped.

  skip = set(KEYS)
  rows = ["| figure | value | unit | details |", "|---|---|---|---|"]
  for line in lines:
    details = ", ".join(f"{k}={fmt(v)}" for k, v in line.items()
                        if k not in skip and not isinstance(v, (dict, list)))
    rows.append(f"| {line['figure']} | {fmt(line['value'])} | {line['unit']} | {details} |")
  dev = lines[0] if lines else {"device_kind": jax.devices()[0].device_kind, "devices": 0}
  rows.append(f"\n{dev['devices']} x {dev['device_kind']}"
              + (" (dry run: small sizes, not a measurement)" if lines and lines[0]["dry_run"]
                 else ""))
  return "\n".join(rows)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # Not the per-parameter sharding lines.
  unknown = set(_FIGURES.value) - set(FIGURES)
  if unknown:
    raise app.UsageError(f"--figures: unknown {sorted(unknown)}; known: {FIGURES}.")
  dry_run = _DRY_RUN.value
  if dry_run is None:
    dry_run = jax.default_backend() == "cpu"
  steps = _STEPS.value or (1 if dry_run else 10)
  rounds = _ROUNDS.value or (1 if dry_run else 3)
  suite = Suite(dry_run, steps, rounds)
  run = {"vit_b16_train": suite.vit_b16, "regnety_16gf_train": suite.regnety_16gf,
         "tresnet_m_vs_resnet50": suite.tresnet_vs_resnet, "esd_memory_ratio": suite.esd_memory,
         "keep_up": suite.keep_up, "plan_vs_measured": suite.plan_vs_measured}
  failed = {}
  # In the order given (default FIGURES': vit_b16_train first, its peak memory is the plan's
  # to compare). A figure that fails is reported and the others still run: one device
  # session should not lose every figure to one.
  for figure in _FIGURES.value or FIGURES:
    if figure == "vit_b16_train" and suite.vit is not None:
      continue
    try:
      run[figure]()
    except Exception as e:  # pylint: disable=broad-exception-caught
      logging.exception("Figure %s failed.", figure)
      failed[figure] = f"{type(e).__name__}: {e}"
      print(json.dumps({"figure": figure, "error": failed[figure]}), flush=True)
  print(table(suite.lines), flush=True)
  if failed:
    raise SystemExit(f"Failed figures: {sorted(failed)}.")


if __name__ == "__main__":
  sys.exit(app.run(main))
