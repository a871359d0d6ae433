"""The figures to take the day an accelerator is at hand, in one command: one JSON line per
figure, then a markdown table of them all.

  python benchmarks/accelerator.py              # on whatever accelerator JAX sees
  python benchmarks/accelerator.py --dry_run    # small sizes (the default on a CPU backend)

Figures (each line's `figure`):
  vit_b16_train          semantic softmax ViT-B/16 on ImageNet-21K-P's classes, bfloat16,
                         224 px, the paper's 64 images per device (512 on 8 V100s), the
                         recipe's kernels (attention 'auto': cuDNN's on a GPU): img/s, step
                         time, perf/mfu
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
The levers, each an A/B of config values in alternated rounds (value: the best arm's
speed-up over the first, the recipes' default; every arm's step time and MFU in `arms`):
  attention              ViT-B/16, model.attention_impl 'xla' vs 'cudnn' (cuDNN flash attention)
  attention_loss         vit_demo trained a few dozen steps from one seed with each attention
                         implementation: the largest relative loss difference (bf16 noise)
  head_vit_b16,          model.head_dtype 'float32' vs 'bfloat16' (float32 accumulation) for
  head_regnety_16gf      11,221 / 27,000 classes, with the head's share of the step's FLOPs
                         counted on the jaxpr (`head_flops_share`)
  grouped_conv           RegNetY-16GF, model.grouped_conv_impl 'xla' (cuDNN's grouped kernels on
                         a GPU) vs 'gemm' (one batched GEMM over the groups per convolution)
                         vs 'split' (a dense convolution per group) vs 'pallas' (implicit-GEMM
                         Triton kernels, models/pallas_conv.py)
  grouped_conv_layers    each of RegNetY-16GF's grouped convolution shapes alone, forward and
                         backward, per grouped_conv_impl and Pallas tiling (pallas_conv.Tiles):
                         ms and TFLOP/s per layer, the model's grouped convolutions in all;
                         each form's values against XLA's (`error`: one off by more than
                         CONV_ERROR_LIMIT is reported in `failed`, not timed)
  pointwise_conv         RegNetY-16GF, model.pointwise_conv_impl 'xla' (1x1 convolutions as
                         cuDNN calls on a GPU) vs 'gemm' (cuBLAS GEMMs over the channels)
  batch_vit_b16,         per-device batch: the papers' 64, then doubled until it no longer fits
  batch_regnety_16gf     (RESOURCE_EXHAUSTED), that size again under remat policies (none
                         where every size tried fits)
  gelu                   the exact GELU's forward and backward on ViT-B/16's MLP activations
                         ([images, 197, 3,072] bf16 per device), as layers.gelu computes it
                         (erf) vs jax.nn.gelu (erfc), and the step time it saves (12 blocks)
  combined_vit_b16,      every lever above at the arm that won its figure in this run, at
  combined_regnety_16gf  once: images/s, MFU, speed-up over the recipe's settings; its step's
                         top ops and op families go in the profile tables
  xla_flags              ViT-B/16 (--flag_sets_figure=regnety_16gf_train: RegNetY-16GF) under
                         each gpu_flags.FLAG_SETS entry, each in a fresh process (XLA reads
                         XLA_FLAGS once) but the one this process runs with (`this_process`:
                         its own line of that figure)
  profile                per trained figure, the top 10 device ops and op families (ops of
                         one kind, e.g. every cuDNN filter gradient) of a jax.profiler trace
                         of a few steps, read back from the trace (benchmarks/profile_ops.py)
--quick runs vit_b16_train and ViT-B/16's levers only. The table ends with the best measured
configuration of each model, and names the device, jax, jaxlib, CUDA and cuDNN versions and
the XLA_FLAGS in force; --out_dir also writes the lines (accelerator.jsonl) and the tables
(accelerator.md) there, after each figure; --budget_s starts no figure past that time (counted
from the start, the xla_flags children's included; a child still running then is stopped, and
the xla_flags figure still reports those that ran).
`process_peak_bytes` is the device's peak memory since the process started (the runtime
keeps no per-step peak): it is the step's own for the first figure only.
Every line has the keys of KEYS: `value` is the headline number in `unit` (null when this
device cannot give it, e.g. memory on a CPU), `figure_s` the seconds the figure had run when
it printed the line (its compiles included: what a device lease pays for it; the xla_flags
children's, run first, are that line's `children_s`), the rest are the figure's details.
The dry run swaps in the demo models (vit_demo, regnety_demo; ViT vs RegNetY for the
TResNet-M/ResNet-50 pair) at 32 px, 2 images per device (16 for ESD, which drops whole rows),
one step, the demo's classes and 100 hashtags: it checks the command, not the speed. cuDNN
attention needs a GPU: off one, its arms run 'xla' (`ran_as` says so).
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import collections  # pylint: disable=g-import-not-at-top
import functools
import gc
import importlib.metadata
import json
import math
import pathlib
import statistics
import subprocess
import tempfile
import time

from absl import app
from absl import flags
from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp

from benchmarks import common
from benchmarks import cosub
from benchmarks import keep_up
from benchmarks import profile_ops
from benchmarks import train_step
from bigpretrain.plan import accelerators
from bigpretrain.plan import aot_plan
from bigpretrain.plan import gpu_flags
from bigpretrain.runtime import goodput
from bigpretrain import models
from bigpretrain import objectives
from bigpretrain import sharding
from bigpretrain.models import base as models_base
from bigpretrain.models import layers
from bigpretrain.models import pallas_conv
from bigpretrain.runtime import distributed
from configs import semantic_softmax
from configs import swag_regnety
from input_pipeline import pipeline

_DRY_RUN = flags.DEFINE_bool("dry_run", None, "Small sizes (default: on when the backend is "
                             "the CPU).")
_STEPS = flags.DEFINE_integer("steps", None, "Timed steps per figure (default 10; dry run 1).")
_ROUNDS = flags.DEFINE_integer("rounds", None, "Alternated rounds of the model comparison "
                               "(default 3; dry run 1).")
_FIGURES = flags.DEFINE_list("figures", [], "Only these figures, in this order (default: "
                              "all).")
_QUICK = flags.DEFINE_bool("quick", False, "Only QUICK_FIGURES (ViT-B/16 and its levers).")
_OUT_DIR = flags.DEFINE_string("out_dir", "", "Also write accelerator.jsonl and accelerator.md "
                               "here (again after each figure, so a run cut short keeps them).")
_PER_DEVICE = flags.DEFINE_integer(
    "per_device", None, "Images per device of the trained figures and the first arm of the "
    "batch figures (default: the papers' 64; dry run 2); the xla_flags children get it too.")
_FLAG_SETS = flags.DEFINE_list("flag_sets", [], "xla_flags: these of gpu_flags.FLAG_SETS "
                                "(default: FLAG_SETS on a GPU, else and with --quick its first "
                                "two).")
_FLAG_SETS_FIGURE = flags.DEFINE_enum(
    "flag_sets_figure", "vit_b16_train", ["vit_b16_train", "regnety_16gf_train"],
    "xla_flags: the trained figure each flag set runs (RegNetY-16GF's for the flags that act "
    "on convolutions, e.g. conv_command_buffers).")
_BUDGET_S = flags.DEFINE_float("budget_s", None, "Start no figure after this many seconds; the "
                               "ones left are listed as skipped (a device lease's time).")

_GROUPED_CONV_IMPL = flags.DEFINE_enum(
    "grouped_conv_impl", None, list(layers.GROUPED_CONV_IMPLS), "RegNetY-16GF's grouped "
    "convolutions in its figures but grouped_conv's (default: the recipe's; regnety_16gf_train "
    "runs it, so combined_regnety_16gf's speedup_over_recipe is over it).")
_POINTWISE_CONV_IMPL = flags.DEFINE_enum(
    "pointwise_conv_impl", None, list(layers.POINTWISE_CONV_IMPLS), "RegNetY-16GF's 1x1 "
    "convolutions in its figures but pointwise_conv's (default: the recipe's; as "
    "--grouped_conv_impl, the baseline of combined_regnety_16gf's speedup_over_recipe).")

_KEEP_UP_DATA_DIR = flags.DEFINE_string(
    "keep_up_data_dir", None, "keep_up: read the train split of imagenet21k_p prepared here "
    "(224-px JPEGs; e.g. benchmarks/photo_set.py's crops) instead of the demo's PNGs.")

KEYS = ("figure", "value", "unit", "platform", "device_kind", "devices", "dry_run", "figure_s")
FIGURES = ("vit_b16_train", "regnety_16gf_train", "tresnet_m_vs_resnet50", "profile",
           "esd_memory_ratio", "keep_up", "plan_vs_measured", "attention", "attention_loss",
           "head_vit_b16", "head_regnety_16gf", "grouped_conv", "grouped_conv_layers",
           "pointwise_conv", "batch_vit_b16",
           "batch_regnety_16gf", "gelu", "combined_vit_b16", "combined_regnety_16gf", "xla_flags")
QUICK_FIGURES = ("vit_b16_train", "profile", "attention", "attention_loss", "head_vit_b16",
                 "batch_vit_b16", "gelu", "combined_vit_b16", "xla_flags")
# Per combined figure: its model's lever figures and the settings each one's winning arm sets.
LEVERS = {"combined_vit_b16": {"attention": ("attention_impl",), "head_vit_b16": ("head_dtype",),
                               "batch_vit_b16": ("batch_per_device", "remat")},
          "combined_regnety_16gf": {"head_regnety_16gf": ("head_dtype",),
                                    "grouped_conv": ("grouped_conv_impl",),
                                    "pointwise_conv": ("pointwise_conv_impl",),
                                    "batch_regnety_16gf": ("batch_per_device", "remat")}}
PAPER_PER_DEVICE = 64  # Both papers: 512 on 8 V100s (ImageNet-21K), 8,192 on 128 (SWAG).
# grouped_conv_layers' Pallas tilings beside pallas_conv.TILES, on GPUs (pixels, k, warps,
# stages).
PALLAS_TILES = (pallas_conv.Tiles(128, 64, 8, 3), pallas_conv.Tiles(256, 32, 8, 3),
                pallas_conv.Tiles(64, 16, 4, 4))
SWAG_CLASSES = 27_000  # SWAG's hashtag vocabulary (as README's plan rows take it).
# The per-device batch search: doublings of the papers' 64 (the dry run: once, of 2) it tries
# at most per model (64 -> 1,024 images), and the remat policies it tries, in turn until one
# fits, at the first size that does not fit. RegNetY-16GF's 256 takes about a third of an
# H100 (plan), so it doubles as far as ViT-B/16 to reach a size that does not fit.
BATCH_DOUBLINGS = {"vit_b16": 4, "regnety_16gf": 4}
BATCH_REMATS = ("dots_saveable", "nothing_saveable")
LOSS_STEPS = 30  # attention_loss's train steps (the dry run: 3).
PROFILE_STEPS = 3  # Steps per profile trace.
# grouped_conv_layers: the most a form's bfloat16 loss and gradients may differ from XLA's
# (relative to their largest value) and still be timed: bfloat16 rounding is 2^-8 of a value.
CONV_ERROR_LIMIT = 0.05
# The flag sets the xla_flags figure runs by default (of gpu_flags.FLAG_SETS; --quick: the
# first two); --flag_sets names others, e.g. conv_command_buffers with RegNetY-16GF.
FLAG_SETS = ("xla_defaults", "bigpretrain", "no_command_buffers", "triton_gemm")


def out_of_memory(error: Exception) -> bool:
  """Whether `error` is the runtime's out-of-memory (a batch that does not fit)."""
  return "RESOURCE_EXHAUSTED" in str(error) or "out of memory" in str(error).lower()


def first_line(error: Exception) -> str:
  """The first line of `error`'s message, at most 200 characters (a figure's `did_not_fit`)."""
  return str(error).splitlines()[0][:200]


def head_flops(jaxpr, num_classes: int) -> float:
  """FLOPs (2 x multiply-adds) of the matrix products with a `num_classes` dimension in an
  operand or result, in a step's jaxpr and its sub-programs: the classifier head's forward
  ([B, D] x [D, C]) and backward (the kernel's and the features' gradients), and any product
  of the loss over the classes."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  total = 0.0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      lhs, out = eqn.invars[0].aval, eqn.outvars[0].aval
      if any(num_classes in v.aval.shape for v in (*eqn.invars[:2], *eqn.outvars)):
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        total += 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in lhs_contract)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      total += head_flops(sub, num_classes)
  return total


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


def settings(config, model_def=None) -> dict:
  """The lever values of `config` a figure's arm is known by; with its built `model_def`, the
  attention kernel it runs ('auto' resolved)."""
  attention = (model_def.kwargs["attention_impl"] if model_def
               else config.model.get("attention_impl", "xla"))
  return {"attention_impl": attention,
          "head_dtype": config.model.get("head_dtype", "float32"),
          "grouped_conv_impl": config.model.get("grouped_conv_impl", "xla"),
          "pointwise_conv_impl": config.model.get("pointwise_conv_impl", "xla"),
          "remat": config.model.get("remat", "") or "none"}


def with_model_options(config, **options):
  """A copy of `config` with `options` set in config.model."""
  out = config.copy_and_resolve_references()
  with out.unlocked():
    for key, value in options.items():
      out.model[key] = value
  return out


def with_batch(config, batch_size: int, remat: str = ""):
  """A copy of `config` with the global `batch_size` and model.remat `remat`."""
  out = with_model_options(config, remat=remat)
  out.batch_size = batch_size
  return out


class Suite:
  """Sizes by mode, the figures measured so far, and the lines printed."""

  def __init__(self, dry_run: bool, steps: int, rounds: int):
    self.dry_run, self.steps, self.rounds = dry_run, steps, rounds
    self.per_device = _PER_DEVICE.value or (2 if dry_run else PAPER_PER_DEVICE)
    self.image_size = 32 if dry_run else 224
    # The dry run's classes: the demo's (a small WordNet tree) and 100 hashtags.
    self.ss_data = "dataset=demo" if dry_run else "dataset=imagenet21k_p"
    self.swag_classes = 100 if dry_run else SWAG_CLASSES
    self.lines = []
    self.vit = None  # The ViT-B/16 step's measurements, for keep_up and plan_vs_measured.
    # The trained figures' runners by model (the levers' first arms, the profile's steps),
    # and every configuration timed, for the best-configuration table.
    self.runners = {}
    self.measured = []
    self.profiles = {}  # Model -> profile_ops.top_ops of its step.
    self.flag_lines = None  # The xla_flags figure's child lines (run before this process's
    # backend starts: see main).
    self.flag_set = "none"  # The gpu_flags.FLAG_SETS entry this process runs with.
    self.flag_sets_s = 0.0  # The xla_flags children's wall seconds.
    self.figure_start = time.perf_counter()  # When the running figure started (main sets it).
    self.deadline = None  # --budget_s's end (time.perf_counter's), if given.
    self.failed = {}  # Figure -> its error, as main() reports it.

  def past_deadline(self) -> bool:
    return self.deadline is not None and time.perf_counter() > self.deadline

  def emit(self, figure: str, value, unit: str, **details):
    dev = jax.devices()[0]
    line = {"figure": figure, "value": value, "unit": unit, "platform": dev.platform,
            "device_kind": dev.device_kind, "devices": jax.device_count(),
            "dry_run": self.dry_run,
            "figure_s": round(time.perf_counter() - self.figure_start, 1), **details}
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

  def runnable(self, config):
    """`config` as this backend can run it: cuDNN attention only on GPUs (elsewhere 'xla',
    which the figure's `ran_as` reports)."""
    if jax.default_backend() != "gpu" and config.model.get("attention_impl") == "cudnn":
      return with_model_options(config, attention_impl="xla")
    return config

  def measure(self, figure: str, runner, step_s: float) -> dict:
    """One timed configuration: its step time, images/s, MFU (recorded for the best-config
    table)."""
    config = runner.config
    peak = accelerator(jax.devices()[0], config.compute_dtype)["peak_flops"]
    perf = goodput.interval_metrics(wall_s=step_s, data_wait_s=0.0, steps=1,
                                    flops=runner.flops, peak=peak)
    row = {"model": config.model.name, "figure": figure,
           **settings(config, runner.exp.model_def),
           "batch_per_device": config.batch_size // jax.device_count(),
           "step_time_ms": 1e3 * step_s, "images_per_sec": config.batch_size / step_s,
           "mfu": perf.get("perf/mfu"), "xla_flags": self.flag_set}
    self.measured.append(row)
    return row

  def alternate(self, runners: dict) -> dict:
    """{name: [seconds per step, one per round]}, the runners timed in turn each round."""
    times = {name: [] for name in runners}
    for _ in range(self.rounds):
      for name, runner in runners.items():
        times[name].append(runner.run(self.steps))
    return times

  def ab(self, figure: str, arms: dict, num_classes=None, built=None, **details) -> dict:
    """Times the configs `arms` ({name: config}, the recipes' default first) in alternated
    rounds (runners in `built` are reused) and emits the best arm's speed-up over the first
    (images/s; the median over rounds)."""
    built = built or {}
    runners = {name: built.get(name) or common.Runner(
        self.runnable(config), standin_dataset(config, num_classes))
               for name, config in arms.items()}
    times = self.alternate(runners)
    rows = {name: self.measure(figure, runners[name], statistics.median(times[name]))
            for name in arms}
    first = next(iter(arms))
    best = max(rows, key=lambda name: rows[name]["images_per_sec"])
    rate = lambda name, i: runners[name].config.batch_size / times[name][i]
    speedup = statistics.median(rate(best, i) / rate(first, i) for i in range(self.rounds))
    ran = {name: settings(arms[name], runners[name].exp.model_def) for name in arms}
    ran_as = {name: ran[name] for name in arms if ran[name] != settings(arms[name])}
    self.emit(figure, speedup, f"speed-up of {best} over {first}", model=arms[first].model.name,
              arms=rows, best=best, rounds=self.rounds, steps=self.steps,
              **({"ran_as": ran_as} if ran_as else {}), **details)
    del runners
    gc.collect()
    return rows

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
           "process_peak_bytes": stats.get("peak_bytes_in_use"), "steps": self.steps,
           **settings(config, runner.exp.model_def)}
    self.emit(figure, rep["images_per_sec"], "images/s", **out)
    self.measure(figure, runner, step_s)
    self.runners[figure] = runner  # The levers' first arm, the profile's step.
    return out

  def vit_config(self):
    config = semantic_softmax.get_config(f"{self.ss_data},model=vit_b16")
    return self.sized(config, "vit_demo" if self.dry_run else "vit_b16")

  def regnety_config(self):
    config = swag_regnety.get_config("dataset=hashtags:ig,model=regnety_16gf")
    config = self.sized(config, "regnety_demo" if self.dry_run else "regnety_16gf")
    if _GROUPED_CONV_IMPL.value:
      config = with_model_options(config, grouped_conv_impl=_GROUPED_CONV_IMPL.value)
    if _POINTWISE_CONV_IMPL.value:
      config = with_model_options(config, pointwise_conv_impl=_POINTWISE_CONV_IMPL.value)
    return config

  def vit_b16(self):
    config = self.vit_config()
    self.vit = {"config": config, **self.train_figure("vit_b16_train", config)}

  def regnety_16gf(self):
    self.train_figure("regnety_16gf_train", self.regnety_config(), self.swag_classes)

  def tresnet_vs_resnet(self):
    names = ["vit_demo", "regnety_demo"] if self.dry_run else ["resnet50", "tresnet_m"]
    config = self.sized(semantic_softmax.get_config(self.ss_data), names[0])
    dataset = standin_dataset(config)
    runners = {n: common.Runner(train_step.with_model(config, n), dataset) for n in names}
    times = self.alternate(runners)
    step_ms = {n: 1e3 * statistics.median(times[n]) for n in names}
    ratio = statistics.median(t / r for t, r in zip(times[names[1]], times[names[0]]))
    for n in names:
      self.measure("tresnet_m_vs_resnet50", runners[n], statistics.median(times[n]))
      self.runners[f"tresnet_m_vs_resnet50:{n}"] = runners[n]
    self.emit("tresnet_m_vs_resnet50", ratio, f"{names[1]}/{names[0]} step time",
              models=names, batch_size=config.batch_size, image_size=config.data.image_size,
              compute_dtype=config.compute_dtype, rounds=self.rounds, steps=self.steps,
              step_time_ms=step_ms)

  def profile(self):
    """The top device ops of each trained figure's step (ViT-B/16's at least), per step."""
    if not self.runners:
      self.vit_b16()
    per_step = {key: self.trace_ops(key, runner)["total_ms"]
                for key, runner in self.runners.items()}
    self.emit("profile", per_step.get("vit_b16_train"), "ViT-B/16 traced op ms per step",
              traced_ms_per_step=per_step, steps=PROFILE_STEPS,
              source={k: p["source"] for k, p in self.profiles.items()},
              top_ops={k: p["ops"] for k, p in self.profiles.items()},
              top_families={k: p["families"] for k, p in self.profiles.items()})
    # The levers' first arms (the trained figures') stay; other runners ('figure:arm') are done.
    for key in list(self.runners):
      if ":" in key:
        del self.runners[key]
    gc.collect()

  def trace_ops(self, key: str, runner) -> dict:
    """The top device ops and op families of `runner`'s step, per step, from a jax.profiler
    trace of PROFILE_STEPS steps (for the tables under `key`)."""
    with tempfile.TemporaryDirectory() as log_dir:
      profile_ops.trace(lambda: runner.run(PROFILE_STEPS), log_dir)
      top = profile_ops.top_ops(log_dir)
    for op in top["ops"] + top["families"]:
      op["ms"] /= PROFILE_STEPS
    top["total_ms"] /= PROFILE_STEPS
    self.profiles[f"{key} ({runner.config.model.name})"] = top
    return top

  def attention(self):
    config = self.vit_config()
    trained = self.runners.get("vit_b16_train")  # The arm of the kernel 'auto' picked.
    self.ab("attention", {impl: with_model_options(config, attention_impl=impl)
                          for impl in layers.ATTENTION_IMPLS},
            built={trained.exp.model_def.kwargs["attention_impl"]: trained} if trained else {})

  def attention_loss(self):
    """vit_demo trained LOSS_STEPS steps on one fixed batch from one seed with each attention
    implementation: the largest relative difference of the per-step losses."""
    config = self.sized(semantic_softmax.get_config(f"{self.ss_data},model=vit_demo"),
                        "vit_demo")
    steps = 3 if self.dry_run else LOSS_STEPS
    config.total_steps = steps + 1  # The schedule spans the run (one warm-up step first).
    config.batch_size = 16 * jax.device_count()
    losses, ran_as = {}, {}
    for impl in layers.ATTENTION_IMPLS:
      runner = common.Runner(self.runnable(with_model_options(config, attention_impl=impl)),
                             standin_dataset(config))
      losses[impl] = []
      for _ in range(steps):
        runner.state, metrics = runner.step(runner.state, runner.batch, runner.exp.frozen)
        losses[impl].append(float(metrics["train/loss"]))
      ran_as[impl] = runner.config.model.attention_impl
      del runner
    ref, other = layers.ATTENTION_IMPLS
    worst = max(abs(a - b) / abs(a) for a, b in zip(losses[ref], losses[other]))
    self.emit("attention_loss", worst, f"max |loss {other} - loss {ref}| / loss {ref}",
              model=config.model.name, batch_size=config.batch_size,
              compute_dtype=config.compute_dtype, steps=steps, losses=losses, ran_as=ran_as)
    gc.collect()

  def head(self, figure: str, trained: str, config, num_classes=None):
    """model.head_dtype float32 vs bfloat16, and the head's share of the step's FLOPs
    (`trained`: the figure whose runner is the float32 arm, if it ran)."""
    first = (self.runners.get(trained)
             or common.Runner(config, standin_dataset(config, num_classes)))
    classes = first.exp.dataset.info.num_classes
    with jax.set_mesh(first.exp.mesh):
      traced = first.exp.train_step().trace(first.state, first.batch, first.exp.frozen)
    share = head_flops(traced.jaxpr, classes) / (first.flops * first.exp.mesh.size)
    self.ab(figure, {"float32": config,
                     "bfloat16": with_model_options(config, head_dtype="bfloat16")},
            num_classes, built={"float32": first}, classes=classes, head_flops_share=share)

  def head_vit_b16(self):
    self.head("head_vit_b16", "vit_b16_train", self.vit_config())

  def head_regnety_16gf(self):
    self.head("head_regnety_16gf", "regnety_16gf_train", self.regnety_config(),
              self.swag_classes)

  def grouped_conv(self):
    """RegNetY-16GF's grouped convolutions as XLA lowers them against the other
    layers.GROUPED_CONV_IMPLS (the regnety_16gf_train figure's runner, if it ran, is its
    arm; a profile still to come traces the others beside it). An arm that fails to build
    is reported in `failed`, and the others still run."""
    config = self.regnety_config()
    arms = {impl: with_model_options(config, grouped_conv_impl=impl)
            for impl in layers.GROUPED_CONV_IMPLS}
    trained = self.runners.get("regnety_16gf_train")
    prior = {trained.config.model.get("grouped_conv_impl", "xla"): trained} if trained else {}
    dataset = standin_dataset(config, self.swag_classes)
    built, failed = _build_arms({impl: lambda impl=impl: prior.get(impl) or common.Runner(
        arms[impl], dataset) for impl in arms})
    self.ab("grouped_conv", {impl: arms[impl] for impl in built}, self.swag_classes,
            built=built, **({"failed": failed} if failed else {}))
    if not self.profiles:
      self.runners.update({f"grouped_conv:{impl}": runner for impl, runner in built.items()
                           if runner is not trained})

  def grouped_conv_layers(self):
    """Each grouped convolution shape of RegNetY-16GF's step (the dry run: regnety_demo's
    first two) alone: forward and both gradients per layers.GROUPED_CONV_IMPLS (on GPUs also
    other PALLAS_TILES), alternated; the value is the best arm's speed-up over 'xla' on the
    model's grouped convolutions in all (each shape's time times its layers)."""
    config = self.regnety_config()
    shapes = grouped_conv_shapes(config.model.name, self.per_device, self.image_size)
    shapes = list(shapes.items())[:2] if self.dry_run else list(shapes.items())
    impls = dict(models_base.GROUPED_CONVS)  # One device: each form itself.
    if jax.default_backend() == "gpu":
      impls.update({"pallas:" + "/".join(map(str, t)): functools.partial(
          pallas_conv.conv_pallas, tiles=t) for t in PALLAS_TILES})
    rows, total, failed = [], dict.fromkeys(impls, 0.0), {}
    for (lhs, rhs, strides, padding, groups), count in shapes:
      runners, new_failed = _build_arms({
          name: functools.partial(ConvRunner, conv, lhs, rhs, strides, padding, groups)
          for name, conv in impls.items() if name not in failed})
      # Each form's loss and gradients against XLA's: a kernel that computes wrong values
      # on this device is reported, not timed.
      errors = {name: relative_error(r.result, runners["xla"].result)
                for name, r in runners.items()}
      for runner in runners.values():
        runner.result = None
      new_failed.update({name: f"values off XLA's by {e:.3g} (max |difference| / max |XLA's|)"
                         for name, e in errors.items() if not e <= CONV_ERROR_LIMIT})
      runners = {name: r for name, r in runners.items() if name not in new_failed}
      failed.update(new_failed)
      ms = {name: 1e3 * statistics.median(t) for name, t in self.alternate(runners).items()}
      n, h, w, _ = runners["xla"].y_shape
      flops = 3 * 2 * n * h * w * rhs[3] * rhs[0] * rhs[1] * rhs[2]  # Forward, 2 gradients.
      rows.append({"input": list(lhs), "kernel": list(rhs), "strides": list(strides),
                   "groups": groups, "layers": count, "ms": ms, "error": errors,
                   "tflops_per_sec": {k: flops / v / 1e9 for k, v in ms.items()}})
      for name in ms:
        total[name] += count * ms[name]
    total = {name: t for name, t in total.items() if name not in failed}
    best = min(total, key=total.get)
    self.emit("grouped_conv_layers", total["xla"] / total[best],
              f"speed-up of {best} over xla", model=config.model.name,
              batch_per_device=self.per_device, image_size=self.image_size, best=best,
              total_ms=total, layers=rows, rounds=self.rounds, steps=self.steps,
              **({"failed": failed} if failed else {}))
    gc.collect()

  def pointwise_conv(self):
    """RegNetY-16GF's 1x1 convolutions as XLA lowers them (cuDNN calls on GPUs) against one
    GEMM over the channels each (layers.POINTWISE_CONV_IMPLS; the regnety_16gf_train
    figure's runner, if it ran, is its arm)."""
    config = self.regnety_config()
    arms = {impl: with_model_options(config, pointwise_conv_impl=impl)
            for impl in layers.POINTWISE_CONV_IMPLS}
    trained = self.runners.get("regnety_16gf_train")
    prior = {trained.config.model.get("pointwise_conv_impl", "xla"): trained} if trained else {}
    self.ab("pointwise_conv", arms, self.swag_classes, built=prior)

  def batch(self, figure: str, trained: str, config, num_classes=None):
    """Images/s at the papers' per-device batch, then doubled while it fits; at the first
    size that does not fit, the remat policies until one fits (none where every size fits:
    remat buys memory with step time, which a size that fits does not need). One
    size at a time (no alternation: two sizes near the memory limit do not fit together);
    the `trained` figure's runner, if it ran, is the first size's, then freed. Past
    --budget_s no further size is tried (`not_tried`)."""
    devices = jax.device_count()
    rows, failed, not_tried = {}, {}, []

    def attempt(per_device: int, remat: str = "", runner=None) -> bool:
      name = f"{per_device}" + (f"+{remat}" if remat else "")
      if rows and self.past_deadline():
        not_tried.append(name)
        return False
      try:
        runner = runner or common.Runner(with_batch(config, per_device * devices, remat),
                                         standin_dataset(config, num_classes))
        times = [runner.run(self.steps) for _ in range(self.rounds)]
        rows[name] = self.measure(figure, runner, statistics.median(times))
        return True
      except Exception as e:  # pylint: disable=broad-exception-caught
        if not out_of_memory(e):
          raise
        failed[name] = first_line(e)
        return False
      finally:
        gc.collect()

    per_device = self.per_device
    sizes = [per_device * 2 ** k  # The dry run's demo models: one doubling.
             for k in range(1, 1 + BATCH_DOUBLINGS.get(config.model.name, 1))]
    if attempt(per_device, runner=self.runners.pop(trained, None)):
      for i, size in enumerate(sizes):
        per_device = size
        if not attempt(size):
          if not_tried:  # Past --budget_s: none of the larger sizes either.
            not_tried.extend(str(s) for s in sizes[i + 1:])
          break
    if str(per_device) in failed:
      for remat in BATCH_REMATS:
        if attempt(per_device, remat):
          break
    first = str(self.per_device)  # Without it (it did not fit), no speed-up: value null.
    best = max(rows, key=lambda name: rows[name]["images_per_sec"]) if rows else None
    self.emit(figure, rows[best]["images_per_sec"] / rows[first]["images_per_sec"]
              if first in rows else None,
              f"speed-up of {best} over {first} per device", model=config.model.name,
              arms=rows, best=best, did_not_fit=failed, not_tried=not_tried,
              rounds=self.rounds, steps=self.steps)

  def batch_vit_b16(self):
    self.batch("batch_vit_b16", "vit_b16_train", self.vit_config())

  def batch_regnety_16gf(self):
    self.batch("batch_regnety_16gf", "regnety_16gf_train", self.regnety_config(),
               self.swag_classes)

  def combined(self, figure: str, trained: str, config, num_classes=None):
    """The model with every lever at the arm that won its figure in this run (LEVERS): its
    images/s and MFU, and its speed-up over the `trained` figure (the recipe's settings,
    measured earlier in this process; not alternated: the two may not fit in memory at once)."""
    won, picked = {}, {}
    for line in self.lines:
      keys = LEVERS[figure].get(line["figure"], ())
      if keys and line.get("best") is not None:  # None: no arm of that figure ran.
        won.update({k: line["arms"][line["best"]][k] for k in keys})
        picked[line["figure"]] = line["best"]
    if not picked:
      raise RuntimeError(f"{figure}: none of its levers' figures ({sorted(LEVERS[figure])}) "
                         "ran before it.")
    per_device = won.pop("batch_per_device", self.per_device)
    remat = won.pop("remat", "none")
    # The batch figure's size fit under the recipe's kernels; other winners (e.g. the GEMM
    # form's gathered windows) may need more memory there: then half the size, down to the
    # papers'.
    did_not_fit = {}
    config = with_model_options(config, **won)
    while True:
      config = with_batch(config, per_device * jax.device_count(),
                          "" if remat == "none" else remat)
      try:
        runner = common.Runner(self.runnable(config), standin_dataset(config, num_classes))
        break
      except Exception as e:  # pylint: disable=broad-exception-caught
        if not out_of_memory(e) or per_device <= self.per_device:
          raise
        did_not_fit[str(per_device)] = first_line(e)
      per_device //= 2
      gc.collect()  # Out of the handler: the error's traceback no longer holds the runner.
    row = self.measure(figure, runner, statistics.median(
        runner.run(self.steps) for _ in range(self.rounds)))
    base = next((l["value"] for l in self.lines if l["figure"] == trained), None)
    self.trace_ops(figure, runner)  # Where the best configuration's step spends its time.
    self.emit(figure, row["images_per_sec"], "images/s", levers=picked,
              **{k: v for k, v in row.items() if k not in ("figure", "images_per_sec")},
              speedup_over_recipe=row["images_per_sec"] / base if base else None,
              did_not_fit=did_not_fit, rounds=self.rounds, steps=self.steps)
    del runner
    gc.collect()

  def combined_vit_b16(self):
    self.combined("combined_vit_b16", "vit_b16_train", self.vit_config())

  def combined_regnety_16gf(self):
    self.combined("combined_regnety_16gf", "regnety_16gf_train", self.regnety_config(),
                  self.swag_classes)

  def xla_flags(self):
    """The --flag_sets_figure figure under each flag set, measured in child processes by
    main()."""
    if self.flag_lines is None:
      raise RuntimeError("xla_flags runs its children before this process's backend starts: "
                         "main() runs them.")
    figure = _FLAG_SETS_FIGURE.value
    config, run = ((self.vit_config(), self.vit_b16) if figure == "vit_b16_train"
                   else (self.regnety_config(), self.regnety_16gf))
    rows, failed = {}, {}
    this_process = [name for name, line in self.flag_lines.items() if line is _THIS_PROCESS]
    ran = lambda: any(l["figure"] == figure for l in self.lines)
    if this_process and not ran() and figure not in self.failed and not self.past_deadline():
      try:  # The children's lines are reported whatever becomes of this arm.
        run()
      except Exception as e:  # pylint: disable=broad-exception-caught
        logging.exception("Figure %s failed.", figure)
        self.failed[figure] = f"{type(e).__name__}: {e}"
    for name, line in self.flag_lines.items():
      if line is _THIS_PROCESS:
        line = (next(l for l in self.lines if l["figure"] == figure) if ran()
                else {"error": self.failed.get(figure, "not run: --budget_s spent")})
      if "error" in line:
        failed[name] = line["error"]
        continue
      rows[name] = {k: line[k] for k in ("step_time_ms", "mfu", "batch_per_device")}
      rows[name]["images_per_sec"] = line["value"]
      self.measured.append({"model": line["model"], "figure": "xla_flags",
                            **{k: line[k] for k in settings(config)},
                            "xla_flags": name, **rows[name]})
    first = next(iter(self.flag_lines))
    best = max(rows, key=lambda name: rows[name]["images_per_sec"]) if rows else None
    value = (rows[best]["images_per_sec"] / rows[first]["images_per_sec"]
             if first in rows else None)
    self.emit("xla_flags", value, f"speed-up of {best} over {first}",
              model=config.model.name, trained_figure=figure, arms=rows, best=best,
              failed=failed,
              this_process=this_process, children_s=round(self.flag_sets_s, 1),
              flags={n: gpu_flags.flags_string(gpu_flags.FLAG_SETS[n]) for n in self.flag_lines})

  def gelu(self):
    """layers.gelu (erf) against jax.nn.gelu(approximate=False) (erfc): the same function;
    forward and backward of one block's MLP activations, alternated."""
    tokens, hidden, depth = (17, 256, 4) if self.dry_run else (197, 3072, 12)
    x = jax.random.normal(jax.random.key(0), (self.per_device, tokens, hidden), "bfloat16")
    arms = {"erfc": lambda v: jax.nn.gelu(v, approximate=False), "erf": layers.gelu}
    runners = {name: ElementwiseRunner(f, x) for name, f in arms.items()}
    times = self.alternate(runners)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    self.emit("gelu", statistics.median(a / b for a, b in zip(times["erfc"], times["erf"])),
              "speed-up of erf over erfc", shape=list(x.shape), dtype="bfloat16",
              ms_per_block=ms, step_ms_saved=depth * (ms["erfc"] - ms["erf"]),
              blocks=depth, rounds=self.rounds, steps=self.steps)

  def esd_memory(self):
    model = "vit_demo" if self.dry_run else "vit_b16"
    # ESD drops whole rows of each device's batch: 2 rows would keep as much as masking.
    batch = (16 if self.dry_run else self.per_device) * jax.device_count()
    # The recipe's dataset stood in for (its info only): no records, no WordNet to read.
    dataset = standin_dataset(cosub.variant_config(*cosub.VARIANTS["plain"], model,
                                                   self.image_size, batch, 0.5))
    out = cosub.measure(model, self.image_size, batch, 0.5, self.steps, 1, cosub=False,
                        dataset=dataset)
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
    shortfall = pipeline.shared_memory_shortfall(config.data,
                                                 config.batch_size // jax.process_count())
    if shortfall:  # A worker may die of SIGBUS: the figure's error names it.
      logging.warning("%s", shortfall)
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


class ElementwiseRunner:
  """`run(steps)` as common.Runner's, for an activation `f`'s forward and backward on `x`."""

  def __init__(self, f, x):
    self.x = x
    self.step = jax.jit(jax.value_and_grad(lambda v: f(v).astype("float32").sum()))
    jax.block_until_ready(self.step(x))  # Compiled and run once.

  def run(self, steps: int) -> float:
    return common.seconds_per_call(lambda: self.step(self.x), steps)


def _build_arms(builders: dict) -> tuple[dict, dict]:
  """({name: built runner}, {name: its error}) of `builders` ({name: () -> runner}): an arm
  that fails (a kernel that does not compile on this device, say) is logged and reported,
  and does not take the figure's other arms with it."""
  built, failed = {}, {}
  for name, build in builders.items():
    try:
      built[name] = build()
    except Exception as e:  # pylint: disable=broad-exception-caught
      logging.exception("Arm %s failed.", name)
      failed[name] = f"{type(e).__name__}: {e}"[:500]
  return built, failed


class ConvRunner:
  """`run(steps)` as common.Runner's: a convolution's forward and both gradients (of half its
  squared output's sum) on bfloat16 operands of the given shapes."""

  def __init__(self, conv, lhs_shape, rhs_shape, strides, padding, groups):
    self.args = (jax.random.normal(jax.random.key(0), lhs_shape, "bfloat16"),
                 jax.random.normal(jax.random.key(1), rhs_shape, "bfloat16"))

    def forward(x, w):
      return conv(x, w, strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC"),
                  feature_group_count=groups)

    self.y_shape = jax.eval_shape(forward, *self.args).shape
    self.step = jax.jit(jax.value_and_grad(
        lambda x, w: jnp.sum(jnp.square(forward(x, w).astype("float32"))) / 2, (0, 1)))
    # Compiled and run once; the loss and both gradients, to check against another form's.
    self.result = jax.block_until_ready(self.step(*self.args))

  def run(self, steps: int) -> float:
    return common.seconds_per_call(lambda: self.step(*self.args), steps)


def relative_error(got, want) -> float:
  """The largest of max |got - want| / max |want| over the leaves of two pytrees of arrays,
  in float32."""
  return max(float(jnp.max(jnp.abs(a.astype("float32") - b.astype("float32")))
                   / jnp.max(jnp.abs(b.astype("float32"))))
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def grouped_conv_shapes(model: str, batch: int, image_size: int) -> dict:
  """{(input shape, kernel shape, strides, padding, groups): how many layers} of the grouped
  convolutions (more than one channel per group) of `model` on `batch` images, as its
  forward calls them (traced abstractly, nothing computed)."""
  found = collections.Counter()

  def record(lhs, rhs, strides, padding, **kwargs):
    found[(lhs.shape, rhs.shape, tuple(strides), tuple(map(tuple, padding)),
           kwargs["feature_group_count"])] += 1
    return jax.lax.conv_general_dilated(lhs, rhs, strides, padding, **kwargs)

  def forward():
    net = models.get_model(model, num_classes=10, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    for _, m in nnx.iter_graph(net):
      if isinstance(m, nnx.Conv) and 1 < m.feature_group_count < m.in_features:
        m.conv_general_dilated = record
    return net(jnp.zeros((batch, image_size, image_size, 3), jnp.bfloat16), train=False)

  jax.eval_shape(forward)
  return dict(found)


def versions() -> dict:
  """The software the figures ran on: jax, jaxlib and, on GPUs, CUDA and cuDNN."""
  out = {"jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
         "cuda": None, "cudnn": None}
  if jax.default_backend() == "gpu":
    try:  # A private module of jaxlib's: named in the table if a jaxlib moves it.
      from jax._src.lib import cuda_versions  # pylint: disable=import-outside-toplevel
      out["cuda"] = cuda_versions.cuda_runtime_get_version()
      out["cudnn"] = cuda_versions.cudnn_get_version()
    except (ImportError, AttributeError) as e:
      out["cuda"] = out["cudnn"] = f"unknown ({type(e).__name__})"
  return out


def table(lines: list[dict], measured: tuple = (), env: dict | None = None) -> str:
  """The figures as a markdown table, the best measured configuration of each model (most
  images/s), and a last line naming the devices, the software and the XLA flags."""
  def fmt(v):
    text = "n/a" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
    return text.replace("|", "\\|")  # A cell's own bars (e.g. an augment chain) escaped.

  skip = set(KEYS) - {"figure_s"}  # Shown among the details.
  rows = ["| figure | value | unit | details |", "|---|---|---|---|"]
  for line in lines:
    details = ", ".join(f"{k}={fmt(v)}" for k, v in line.items()
                        if k not in skip and not isinstance(v, (dict, list)))
    rows.append(f"| {line['figure']} | {fmt(line['value'])} | {line['unit']} | {details} |")
  best = {}
  for row in measured:
    if row["images_per_sec"] > best.get(row["model"], {"images_per_sec": 0})["images_per_sec"]:
      best[row["model"]] = row
  if best:
    rows += ["", "Best configuration per model:", "",
             "| model | batch/device | attention | head | grouped convs | 1x1 convs | remat | "
             "XLA flags | images/s | step ms | MFU | figure |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows += [f"| {m} | {r['batch_per_device']} | {r['attention_impl']} | {r['head_dtype']} | "
             f"{r['grouped_conv_impl']} | {r['pointwise_conv_impl']} | {r['remat']} | "
             f"{r['xla_flags']} | "
             f"{fmt(r['images_per_sec'])} | "
             f"{fmt(r['step_time_ms'])} | {fmt(r['mfu'])} | {r['figure']} |"
             for m, r in best.items()]
  dev = lines[0] if lines else {"device_kind": jax.devices()[0].device_kind, "devices": 0}
  env = env or {}
  software = ", ".join(f"{k} {fmt(v)}" for k, v in env.items() if k != "xla_flags")
  rows.append(f"\n{dev['devices']} x {dev['device_kind']}"
              + (" (dry run: small sizes, not a measurement)" if lines and lines[0]["dry_run"]
                 else "")
              + (f"; {software}; XLA_FLAGS: {env.get('xla_flags') or 'none'}" if env else ""))
  return "\n".join(rows)


def profile_tables(profiles: dict) -> str:
  """Each profiled step's top op families and top device ops as markdown tables."""
  out = []
  for name, top in profiles.items():
    out += [f"\nTop op families of {name} ({top['source']} trace, per step):", "",
            "| family | ms | share | ops |", "|---|---|---|---|"]
    out += [f"| {f['family'][:60]} | {f['ms']:.3f} | {f['share']:.1%} | {f['ops']} |"
            for f in top["families"]]
    out += [f"\nTop device ops of {name} ({top['source']} trace, per step):", "",
            "| op | ms | share | calls | first kernel |", "|---|---|---|---|---|"]
    out += [f"| {o['op']} | {o['ms']:.3f} | {o['share']:.1%} | {o['count']} | "
            f"{o['kernel'][:60].replace('|', '/')} |" for o in top["ops"]]
  return "\n".join(out)


_THIS_PROCESS = {"this_process": True}  # run_flag_sets: the arm this process itself runs.


def _flag_tokens(xla_flags: str) -> set:
  return set(xla_flags.split())


def run_flag_sets(names, steps: int | None, deadline: float | None = None) -> dict:
  """The --flag_sets_figure line of a child process per gpu_flags.FLAG_SETS entry in `names`
  (XLA reads XLA_FLAGS once per process), or {'error': ...} for a child that failed or
  was still running at `deadline` (time.perf_counter's; --budget_s). Runs before this
  process's backend starts: a GPU's memory is the child's while it runs. The entry whose
  XLA_FLAGS are the ones this process will run with (after gpu_flags.apply) is not run
  again: _THIS_PROCESS, filled from this process's own line of that figure. Every child has
  the environment variables this process runs with (gpu_flags.ENV on GPUs): the sets
  differ in their XLA flags only."""
  ours = set(name for name, _ in gpu_flags.XLA_FLAGS)
  base = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in ours]
  own = dict(os.environ)
  gpu_flags.apply(own)
  figure = _FLAG_SETS_FIGURE.value
  out = {}
  for name in names:
    xla_flags = " ".join(base + gpu_flags.flags_string(gpu_flags.FLAG_SETS[name]).split())
    if _flag_tokens(xla_flags) == _flag_tokens(own.get("XLA_FLAGS", "")):
      out[name] = _THIS_PROCESS
      continue
    timeout = None if deadline is None else deadline - time.perf_counter()
    if timeout is not None and timeout <= 0:
      out[name] = {"error": "not run: --budget_s spent"}
      continue
    env = {**own, gpu_flags.OFF_VARIABLE: "off", "XLA_FLAGS": xla_flags}
    args = [sys.executable, os.path.abspath(__file__), f"--figures={figure}"]
    args += [f"--steps={steps}"] if steps else []
    args += [f"--per_device={_PER_DEVICE.value}"] if _PER_DEVICE.value else []
    args += [f"--{f.name}={f.value}" for f in (_GROUPED_CONV_IMPL, _POINTWISE_CONV_IMPL)
             if f.value]
    args += [] if _DRY_RUN.value is None else [f"--dry_run={_DRY_RUN.value}"]
    try:
      r = subprocess.run(args, env=env, capture_output=True, text=True, check=False,
                         timeout=timeout)
    except subprocess.TimeoutExpired:
      out[name] = {"error": f"stopped after {timeout:.0f} s: --budget_s spent"}
      continue
    found = [json.loads(l) for l in r.stdout.splitlines()
             if l.startswith(f'{{"figure": "{figure}"')]
    if r.returncode or not found:
      out[name] = {"error": f"exit {r.returncode}: {r.stderr.strip()[-300:]}"}
      logging.error("Flag set %s failed: %s", name, r.stderr[-3000:])
    else:
      out[name] = found[0]
  return out


def main(argv):
  del argv
  distributed.select_platforms()  # No plugin errors on a host without their devices.
  logging.set_verbosity(logging.WARNING)  # Not the per-parameter sharding lines.
  figures = _FIGURES.value or (QUICK_FIGURES if _QUICK.value else FIGURES)
  unknown = set(figures) - set(FIGURES)
  if unknown:
    raise app.UsageError(f"--figures: unknown {sorted(unknown)}; known: {FIGURES}.")
  flag_lines, flag_sets_s = None, 0.0
  # --budget_s counts from here: the xla_flags children run first.
  deadline = None if _BUDGET_S.value is None else time.perf_counter() + _BUDGET_S.value
  if "xla_flags" in figures:  # Before this process's backend starts (run_flag_sets).
    every = gpu_flags.target_platform() == "gpu" and not _QUICK.value
    names = _FLAG_SETS.value or (FLAG_SETS if every else FLAG_SETS[:2])
    unknown = set(names) - set(gpu_flags.FLAG_SETS)
    if unknown:
      raise app.UsageError(f"--flag_sets: unknown {sorted(unknown)}; known: "
                           f"{list(gpu_flags.FLAG_SETS)}.")
    t0 = time.perf_counter()
    flag_lines = run_flag_sets(names, _STEPS.value, deadline)
    flag_sets_s = time.perf_counter() - t0
  gpu_flags.apply()  # The settings training runs with (bigpretrain.runtime.distributed applies them).
  flag_set = ("bigpretrain" if gpu_flags.target_platform() == "gpu"
              and os.environ.get(gpu_flags.OFF_VARIABLE, "").lower() != "off" else "none")
  dry_run = _DRY_RUN.value
  if dry_run is None:
    dry_run = jax.default_backend() == "cpu"
  steps = _STEPS.value or (1 if dry_run else 10)
  rounds = _ROUNDS.value or (1 if dry_run else 3)
  suite = Suite(dry_run, steps, rounds)
  suite.flag_lines, suite.flag_set, suite.flag_sets_s = flag_lines, flag_set, flag_sets_s
  suite.deadline = deadline
  run = {"vit_b16_train": suite.vit_b16, "regnety_16gf_train": suite.regnety_16gf,
         "tresnet_m_vs_resnet50": suite.tresnet_vs_resnet, "esd_memory_ratio": suite.esd_memory,
         "keep_up": suite.keep_up, "plan_vs_measured": suite.plan_vs_measured,
         "profile": suite.profile, "attention": suite.attention,
         "attention_loss": suite.attention_loss, "head_vit_b16": suite.head_vit_b16,
         "head_regnety_16gf": suite.head_regnety_16gf, "grouped_conv": suite.grouped_conv,
         "grouped_conv_layers": suite.grouped_conv_layers,
         "pointwise_conv": suite.pointwise_conv,
         "batch_vit_b16": suite.batch_vit_b16,
         "batch_regnety_16gf": suite.batch_regnety_16gf,
         "combined_vit_b16": suite.combined_vit_b16, "gelu": suite.gelu,
         "combined_regnety_16gf": suite.combined_regnety_16gf, "xla_flags": suite.xla_flags}
  failed, skipped = suite.failed, []
  # In the order given (default FIGURES': vit_b16_train first, its peak memory is the plan's
  # to compare). A figure that fails is reported and the others still run: one device
  # session should not lose every figure to one.
  for figure in figures:
    if figure == "vit_b16_train" and suite.vit is not None:
      continue
    # xla_flags' children ran first and are paid for: their figure still reports them.
    if suite.past_deadline() and figure != "xla_flags":
      skipped.append(figure)
      continue
    suite.figure_start = time.perf_counter()
    try:
      run[figure]()
    except Exception as e:  # pylint: disable=broad-exception-caught
      logging.exception("Figure %s failed.", figure)
      failed[figure] = pipeline.worker_death(e) or f"{type(e).__name__}: {e}"
      print(json.dumps({"figure": figure, "error": failed[figure]}), flush=True)
    write_out(suite)
  if skipped:
    print(json.dumps({"skipped": skipped, "budget_s": _BUDGET_S.value}), flush=True)
  print(write_out(suite), flush=True)
  if failed:
    raise SystemExit(f"Failed figures: {sorted(failed)}.")


def write_out(suite) -> str:
  """The figures so far as the markdown table; also into --out_dir's two files."""
  env = {**versions(), "xla_flags": os.environ.get("XLA_FLAGS", "")}
  text = table(suite.lines, suite.measured, env)
  if _OUT_DIR.value:
    out = pathlib.Path(_OUT_DIR.value)
    out.mkdir(parents=True, exist_ok=True)
    (out / "accelerator.jsonl").write_text("".join(json.dumps(l) + "\n" for l in suite.lines))
    (out / "accelerator.md").write_text(text + "\n" + profile_tables(suite.profiles) + "\n")
  return text


if __name__ == "__main__":
  sys.exit(app.run(main))
