r"""Every recipe at paper scale, compiled for the hardware its users would rent: docs/pod_plans.md.

  python benchmarks/pod_plans.py                       # the rows not yet in the results
  python benchmarks/pod_plans.py --rows=ss_vit_b16@v5e-16,ss_vit_b16@8xh100 --redo
  python benchmarks/pod_plans.py --list                # row names and their commands
  python benchmarks/pod_plans.py --compare             # vit_demo: TPU vs GPU vs CPU plan
  python benchmarks/pod_plans.py --refresh_flops       # kept rows' FLOPs, traced again

Each row runs `python -m bigpretrain.tools.plan --topology=... --json` (the real train step,
or for the semi-supervised teacher the inference engine's pool step, compiled by libtpu or the
CUDA plugin with no accelerator attached; a distillation's teacher planned from its model, see
bigpretrain.plan.aot_plan), prints one JSON line, and is kept in docs/pod_plans.jsonl; the
markdown table is rewritten from all kept rows after each one, with the rows not yet
compiled listed with their command.

Cost to reproduce, per row:
  steps = the paper's total training samples / the batch;
  at 40% MFU: steps x per-chip step FLOPs / (chip bf16 peak x 0.40), in wall hours and chip
  hours (x chips). The FLOPs are counted on the step's jaxpr (bigpretrain/plan/flops.py), the same
  on every compiler; a row kept from before that (XLA's cost analysis: none on GPUs) shows
  n/a until --refresh_flops traces its step again, a minute, no compile;
  the compiler's estimate (TPU rows): steps x its optimal_seconds, a roofline bound of the
  compiled step, not a measurement.
next to the paper's reported hardware time where it gives one.
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import argparse
import dataclasses
import json
import math
import pathlib
import subprocess
import time

from bigpretrain.plan import accelerators

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "pod_plans.jsonl"
DOC = ROOT / "docs" / "pod_plans.md"
MFU = 0.40  # The stated MFU of the first cost column.
# ImageNet-21K-P: 12,358,688 images of 11,221 classes, 50 per class held out for validation
# (Ridnik et al., section 2.1).
IN21K_P_TRAIN = 12_358_688 - 50 * 11_221
IN1K_TRAIN = 1_281_167  # ImageNet-1k train split (tfds imagenet2012).
YFCC100M = 90_000_000  # "about 90 million images" (paper 002, section 4.1).


@dataclasses.dataclass(frozen=True)
class Recipe:
  name: str
  label: str
  config: str  # configs/FILE.py:ARGS
  batch: int
  samples: int  # Paper's total training samples (images inferred, for an inference row).
  samples_note: str
  paper_time: str = ""  # The paper's reported hardware time, if any.
  flags: tuple = ()  # Extra plan flags (--num_classes, --config.X=Y).


RECIPES = [
    Recipe("ss_vit_b16", "semantic softmax ViT-B/16, ImageNet-21K-P",
           "configs/semantic_softmax.py:dataset=imagenet21k_p,model=vit_b16", 512,
           80 * IN21K_P_TRAIN, "80 epochs from a 1K init (sec. 3.1)"),
    Recipe("ss_tresnet_m", "semantic softmax TResNet-M, ImageNet-21K-P",
           "configs/semantic_softmax.py:dataset=imagenet21k_p,model=tresnet_m", 512,
           80 * IN21K_P_TRAIN, "80 epochs (sec. 3.1)",
           "8x V100, 40 min/epoch, 54 h in all = 432 V100-hours (sec. 3.1)"),
    Recipe("kd_tresnet_m", "semantic KD TResNet-M from a TResNet-L teacher, ImageNet-21K-P",
           "configs/semantic_kd.py:dataset=imagenet21k_p,model=tresnet_m,teacher=unused", 512,
           80 * IN21K_P_TRAIN, "80 epochs (sec. 3.1); the teacher's forward in every step",
           flags=("--teacher_model=tresnet_l",)),
    Recipe("cosub_vit_b16", "cosub ViT-B, ImageNet-21k",
           "configs/cosub_in21k.py:dataset=imagenet21k_p,model=vit_b16", 2048,
           90 * IN21K_P_TRAIN, "90 epochs (supp. Table B.2)"),
    Recipe("cosub_vit_l16", "cosub ViT-L, ImageNet-21k",
           "configs/cosub_in21k.py:dataset=imagenet21k_p,model=vit_l16", 2048,
           90 * IN21K_P_TRAIN, "90 epochs (supp. Table B.2)"),
    Recipe("cosub_vit_h14", "cosub ViT-H, ImageNet-21k",
           "configs/cosub_in21k.py:dataset=imagenet21k_p,model=vit_h14", 2048,
           90 * IN21K_P_TRAIN, "90 epochs (supp. Table B.2)"),
    Recipe("swag_vit_l16", "SWAG ViT-L/16, IG-3.6B",
           "configs/swag_vit.py:dataset=hashtags:ig,model=vit_l16", 8192,
           10_000_000_000, "10B samples, 2 epochs of IG-3.6B (sec. 3.2)",
           flags=("--num_classes=27000",)),
    Recipe("swag_vit_h14", "SWAG ViT-H/14, IG-3.6B",
           "configs/swag_vit.py:dataset=hashtags:ig,model=vit_h14", 8192,
           10_000_000_000, "10B samples (sec. 3.2)",
           "128 V100 32GB (16 nodes of 8); no time given (sec. 3.2)",
           flags=("--num_classes=27000",)),
    Recipe("swag_regnety_128gf", "SWAG RegNetY-128GF, IG-3.6B",
           "configs/swag_regnety.py:dataset=hashtags:ig,data_dir=/data/tfds,model=regnety_128gf",
           8192, 10_000_000_000, "10B samples (sec. 3.2)",
           flags=("--num_classes=27000", "--config.batch_size=8192")),
    Recipe("semisup_resnet50", "semi-supervised ResNet-50 student pre-training",
           "configs/single_label.py:dataset=tfds:imagenet2012,model=resnet50", 1536,
           1_000_000_000, "1B images (sec. 4.4)",
           "64 GPUs, 8 machines (sec. 4.1); no time given",
           flags=("--config.batch_size=1536",)),
    Recipe("semisup_teacher_infer",
           "semi-supervised ResNeXt-101 32x48d teacher ranking YFCC100M (inference, top-10)",
           "configs/single_label.py:dataset=tfds:imagenet2012,model=resnext101_32x48d", 4096,
           YFCC100M, "one pass over YFCC100M, about 90M images (sec. 4.1)",
           "not given", flags=("--step=infer", "--top_p=10", "--config.batch_size=4096")),
]
# (row suffix, topology, mesh[, flags]) per recipe; cheapest first. `flags` are the row's own
# extra plan flags after the recipe's, e.g. ("--config.model.remat=nothing_saveable",) for a
# chip whose HBM the recipe fits only with its residual blocks rematerialised.
HARDWARE = {
    "ss_vit_b16": [("v5e-16", "tpu:v5e:4x4", "fsdp:-1"), ("8xh100", "gpu:h100:1x8", "fsdp:-1")],
    "ss_tresnet_m": [("v5e-16", "tpu:v5e:4x4", "fsdp:-1"),
                     ("8xh100", "gpu:h100:1x8", "fsdp:-1")],
    "kd_tresnet_m": [("8xh100", "gpu:h100:1x8", "fsdp:-1"), ("v5e-16", "tpu:v5e:4x4", "fsdp:-1")],
    "semisup_teacher_infer": [("v5e-64", "tpu:v5e:8x8", "fsdp:-1"),
                              ("64xh100", "gpu:h100:8x8", "fsdp:-1")],
    "semisup_resnet50": [("v5e-64", "tpu:v5e:8x8", "fsdp:-1"),
                         ("64xh100", "gpu:h100:8x8", "fsdp:-1")],
    "cosub_vit_b16": [("v5e-64", "tpu:v5e:8x8", "fsdp:-1"),
                      ("32xh100", "gpu:h100:4x8", "fsdp:-1")],
    "cosub_vit_l16": [("v5p-64", "tpu:v5p:4x4x4", "fsdp:-1"),
                      ("64xh100", "gpu:h100:8x8", "fsdp:-1")],
    "cosub_vit_h14": [("v5p-64", "tpu:v5p:4x4x4", "fsdp:-1"),
                      ("64xh100", "gpu:h100:8x8", "fsdp:-1")],
    "swag_vit_l16": [("v5p-64", "tpu:v5p:4x4x4", "fsdp:-1"),
                     ("v5e-256", "tpu:v5e:16x16", "fsdp:-1"),
                     ("256xh100", "gpu:h100:32x8", "fsdp:-1")],
    "swag_vit_h14": [("v5p-256", "tpu:v5p:8x8x4", "fsdp:-1"),
                     ("256xh100", "gpu:h100:32x8", "fsdp:-1")],
    "swag_regnety_128gf": [("v5p-256", "tpu:v5p:8x8x4", "data:32,fsdp:8"),
                           ("256xh100", "gpu:h100:32x8", "data:32,fsdp:8")],
}


def rows():
  """(row name, recipe with the row's flags added, topology, mesh) per row."""
  by_name = {r.name: r for r in RECIPES}
  for name, hw in HARDWARE.items():
    for suffix, topology, mesh, *flags in hw:
      recipe = by_name[name]
      if flags:
        recipe = dataclasses.replace(recipe, flags=recipe.flags + tuple(flags[0]))
      yield f"{name}@{suffix}", recipe, topology, mesh


def command(recipe: Recipe, topology: str, mesh: str) -> list[str]:
  mesh_flag = ",".join(["data:1", "tensor:1"] + [mesh] if "data" not in mesh else [mesh])
  return [sys.executable, "-m", "bigpretrain.tools.plan", f"--config={recipe.config}",
          f"--topology={topology}", f"--mesh={mesh_flag}", "--json", *recipe.flags]


def _run(cmd: list[str], timeout=None) -> subprocess.CompletedProcess:
  """`cmd` (a tools.plan command) run from the repository, its output captured."""
  return subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                        capture_output=True, text=True, timeout=timeout)


def run_row(name, recipe, topology, mesh, timeout) -> dict:
  start = time.perf_counter()
  out = _run(command(recipe, topology, mesh), timeout)
  if out.returncode:
    tail = [l for l in out.stderr.strip().splitlines() if "ERROR" in l or "Error" in l][-3:]
    return {"row": name, "topology": topology, "error": " | ".join(tail)[-600:],
            "wall_seconds": round(time.perf_counter() - start, 1)}
  plan = json.loads(out.stdout.strip().splitlines()[-1])
  return {"row": name, "recipe": recipe.name, "topology": topology,
          "wall_seconds": round(time.perf_counter() - start, 1), "plan": plan}


def refresh_flops(name, recipe, topology, mesh, timeout) -> dict:
  """The row's step FLOPs per device, traced again (tools.plan --flops_only)."""
  out = _run(command(recipe, topology, mesh) + ["--flops_only"], timeout)
  if out.returncode:
    raise RuntimeError(f"{name}: {out.stderr.strip().splitlines()[-1:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def costs(row: dict, recipe: Recipe) -> dict:
  """The cost-to-reproduce columns of a row (see the module docstring)."""
  p = row["plan"]
  acc = accelerators.get(p["accelerator"])
  steps = recipe.samples / recipe.batch
  out = {"steps": steps}
  if p.get("flops_from") == "jaxpr":
    flops = p["flops_per_device"]
    wall_h = steps * flops / (acc.peak_bf16 * MFU) / 3600
    out.update(flops_per_chip=flops, mfu_wall_hours=wall_h,
               mfu_chip_hours=wall_h * p["devices"])
  if p.get("optimal_seconds"):
    wall_h = steps * p["optimal_seconds"] / 3600
    out.update(compiler_wall_hours=wall_h, compiler_chip_hours=wall_h * p["devices"])
  return out


def load() -> dict:
  if not RESULTS.exists():
    return {}
  return {r["row"]: r for r in map(json.loads, RESULTS.read_text().splitlines()) if r}


def save(results: dict) -> None:
  RESULTS.parent.mkdir(exist_ok=True)
  order = [name for name, *_ in rows()]
  RESULTS.write_text("".join(json.dumps(results[n]) + "\n" for n in order if n in results))


def _gib(x):
  return f"{x / 2**30:.1f}"


def _advice(p: dict) -> str:
  """What would fit a row that does not."""
  ratio = p["total_bytes"] / p["hbm_bytes"]
  return (f"needs {ratio:.1f}x the HBM: ~{math.ceil(ratio) * p['devices']} chips of FSDP "
          f"(the per-chip batch, and its activations, shrink), or activation remat "
          f"(`--config.model.remat=nothing_saveable`)")


def _collectives(col: dict) -> str:
  short = {"all-gather": "AG", "all-reduce": "AR", "reduce-scatter": "RS", "all-to-all": "A2A",
           "collective-permute": "CP"}
  parts = []
  for kind, name in short.items():
    c = col[kind]
    if c["count"]:
      w = f" ({c['windowed']} windowed)" if c.get("windowed") else ""
      parts.append(f"{name} {c['count']}{w}")
  if any("windowed" not in c for c in col.values()):  # Kept from an older parser.
    parts.append("counted before collective matmuls were recognised (their reduce-scatters "
                 "are in CP): rerun the row with --redo")
  return ", ".join(parts) or "none"


def render(results: dict) -> str:
  lines = [
      "# Every recipe at paper scale, compiled for pods and GPU clusters",
      "",
      "Regenerate: `python benchmarks/pod_plans.py` (one JSON line per row; results kept in",
      "`docs/pod_plans.jsonl`). Each row compiles the recipe's real train step at the paper's",
      "batch (the KD row with its frozen teacher in the step; the teacher-inference row the",
      "inference engine's pool step: eval-mode forward and top-10 scores, no optimizer) with",
      "the accelerator's own compiler and no accelerator attached",
      "(`python -m bigpretrain.tools.plan --topology=...`): libtpu for TPU slices, the CUDA",
      "PJRT plugin with XLA's H100 target description for GPU nodes (GEMMs as cuBLAS calls:",
      "with no GPU to autotune on, XLA's default Triton GEMM tiling fails on ViT-B's shapes).",
      "Memory is per chip, from",
      "the compiler's memory analysis (arguments + outputs - aliased + temporaries); margin is",
      "against the chip's HBM (bigpretrain.plan.accelerators). Collectives: counts in the compiled",
      "HLO (AG all-gather, AR all-reduce, RS reduce-scatter, A2A all-to-all, CP",
      "collective-permute; 'windowed': collective matmuls, the TPU compiler's large FSDP",
      "gathers and gradient reduce-scatters as loops of collective-permutes overlapping the",
      "dot, see bigpretrain/plan/hlo_collectives.py).",
      "",
      f"Cost to reproduce: steps = the paper's samples / batch. **At {MFU:.0%} MFU** (a stated",
      "assumption): steps x per-chip step FLOPs / (chip bf16 peak x MFU), the FLOPs of the",
      "step's matrix products and convolutions counted on its jaxpr (bigpretrain/plan/flops.py; XLA's",
      "own cost analysis counts none of the cuBLAS/cuDNN calls on GPUs). **Compiler's",
      "estimate** (TPU only): steps x the compiled step's `optimal_seconds`,",
      "the TPU compiler's own roofline time for the step: a lower bound, not a measurement",
      "(libtpu 0.0.42 gave a negative, i.e. no, estimate for the paper-scale steps: n/a).",
      "Hours are wall-clock for the whole slice; chip-hours multiply by the chips.",
      "",
      "| recipe | hardware | batch/chip | compiler | GiB per chip (HBM) | fits, margin | "
      "collectives | compile s | TFLOP/chip/step | cost at 40% MFU: h "
      "(chip-h) | compiler's estimate: h (chip-h) | paper's samples | paper's hardware time |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  missing = []
  for name, recipe, topology, mesh in rows():
    r = results.get(name)
    if r is None or "plan" not in r:
      missing.append((name, recipe, topology, mesh, (r or {}).get("error")))
      continue
    p, c = r["plan"], costs(r, recipe)
    counts = _collectives(p["collectives"])
    fit = (f"yes, {_gib(p['margin_bytes'])} GiB" if p["fits"] else
           f"**no** ({_advice(p)})")
    mfu = (f"{c['mfu_wall_hours']:,.0f} ({c['mfu_chip_hours']:,.0f})"
           if "mfu_wall_hours" in c else "n/a")
    est = (f"{c['compiler_wall_hours']:,.0f} ({c['compiler_chip_hours']:,.0f})"
           if "compiler_wall_hours" in c else "n/a")
    tflop = f"{c['flops_per_chip'] / 1e12:.2f}" if "flops_per_chip" in c else "n/a"
    mesh_s = ",".join(f"{k}:{v}" for k, v in p["mesh"].items() if v > 1)
    if p.get("remat", "none") != "none":
      mesh_s += f", remat {p['remat']}"
    lines.append(
        f"| {recipe.label} | {name.split('@')[1]} (`{topology}`, {mesh_s}) | "
        f"{p['batch_per_device']} | {p['compiler']} | {_gib(p['total_bytes'])} "
        f"({_gib(p['hbm_bytes'])}) | {fit} | {counts} | {p['compile_seconds']:.0f} | {tflop} | "
        f"{mfu} | {est} | {recipe.samples / 1e9:.2f}B: {recipe.samples_note} | "
        f"{recipe.paper_time or 'not given'} |")
  if missing:
    lines += ["", "## Not yet compiled", "",
              "Rows whose compile has not been run here (each takes minutes to tens of minutes",
              "on a small CPU host); run them with the command shown:", ""]
    for name, recipe, topology, mesh, error in missing:
      cmd = " ".join(command(recipe, topology, mesh)[1:]).replace(sys.executable, "python")
      note = f" Last attempt failed: {error}" if error else ""
      lines.append(f"- `{name}`: `python {cmd}` (or `python benchmarks/pod_plans.py "
                   f"--rows={name}`).{note}")
  return "\n".join(lines) + "\n"


def compare() -> None:
  """vit_demo at batch 64, fsdp 4, on libtpu (v5e:2x2) vs XLA:CPU (4 devices): one JSON line."""
  cmd = [sys.executable, "-m", "bigpretrain.tools.plan",
         "--config=configs/semantic_softmax.py:model=vit_demo",
         "--mesh=data:1,fsdp:4,tensor:1", "--json", "--config.batch_size=64",
         "--config.data.image_size=32"]
  plans = {}
  for name, extra in (("tpu", ["--topology=tpu:v5e:2x2"]), ("cpu", ["--devices=4"])):
    out = _run(cmd + extra)
    out.check_returncode()
    plans[name] = json.loads(out.stdout.strip().splitlines()[-1])
  keys = ("compiler", "params_bytes", "opt_state_bytes", "temp_bytes", "total_bytes",
          "flops_per_device", "collectives")
  print(json.dumps({"compare": "vit_demo batch 64 fsdp 4",
                    **{f"{k}_{n}": plans[n][k] for k in keys for n in plans}}), flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rows", default="", help="Comma-separated row names (default: all).")
  parser.add_argument("--redo", action="store_true", help="Recompile rows already kept.")
  parser.add_argument("--list", action="store_true", help="List rows and commands.")
  parser.add_argument("--render", action="store_true", help="Only rewrite the markdown.")
  parser.add_argument("--compare", action="store_true", help="TPU vs CPU plan of vit_demo.")
  parser.add_argument("--refresh_flops", action="store_true",
                      help="Trace the kept rows' steps again for their FLOPs (no compile).")
  parser.add_argument("--timeout", type=int, default=3600, help="Seconds per row.")
  args = parser.parse_args()
  if args.compare:
    return compare()
  wanted = set(filter(None, args.rows.split(",")))
  known = {name for name, *_ in rows()}
  if wanted - known:
    parser.error(f"Unknown rows {sorted(wanted - known)}; known: {sorted(known)}.")
  results = load()
  for name, recipe, topology, mesh in rows():
    if args.list:
      print(name, " ".join(command(recipe, topology, mesh)[1:]))
      continue
    if args.render or (wanted and name not in wanted):
      continue
    if args.refresh_flops:
      if "plan" in results.get(name, {}):
        flops = refresh_flops(name, recipe, topology, mesh, args.timeout)
        results[name]["plan"].update(flops)
        print(json.dumps({"row": name, **flops}), flush=True)
        save(results)
      continue
    if not args.redo and "plan" in results.get(name, {}):
      continue
    try:
      results[name] = run_row(name, recipe, topology, mesh, args.timeout)
    except subprocess.TimeoutExpired:
      results[name] = {"row": name, "topology": topology,
                       "error": f"compile exceeded {args.timeout} s"}
    print(json.dumps(results[name]), flush=True)
    save(results)
    DOC.write_text(render(results))
  if not args.list:
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(render(results))


if __name__ == "__main__":
  main()
