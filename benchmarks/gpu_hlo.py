"""Which kernels XLA:GPU picks for a train step, from a deviceless compile (no GPU needed):
one JSON line of counts read off the optimized HLO.

  python benchmarks/gpu_hlo.py \
      --config=configs/semantic_softmax.py:dataset=imagenet21k_p,model=vit_b16 \
      --config.batch_size=64 --config.data.image_size=224 --config.compute_dtype=bfloat16 \
      --config.model.attention_impl=cudnn

Counts: custom calls by target (cuBLAS GEMMs `__cublas$...`, cuDNN convolutions
`__cudnn$conv...` and fused attention `__cudnn$fmha...`), fusions by kind (Triton GEMMs are
kCustom fusions), convolutions XLA left as plain `convolution` ops, the cuDNN convolutions'
layouts (dim_labels) and group counts, and the transposes (with the bytes they write), copies
and gathers anywhere in the program (inside fusions too: a layout change between kernels
shows up there); `kernel_bound`, the bytes the kernels move and the step time they bound on
the topology's GPU (bigpretrain.plan.hlo_traffic), and the memory-class kernels that move the
most. The compile is XLA:GPU's with no GPU to autotune on
(bigpretrain.plan.aot_plan.GPU_COMPILE_ONLY_OPTIONS): on a device, autotuning may pick other
GEMM backends, not other convolution layouts.
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import collections  # pylint: disable=g-import-not-at-top
import json
import re

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from bigpretrain.plan import accelerators
from bigpretrain.plan import aot_plan
from bigpretrain.plan.hlo_text import shape_bytes
from bigpretrain.plan import hlo_traffic

_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
_FUSION_KIND = re.compile(r"\bfusion\(.*?kind=(k\w+)")
_OP = re.compile(r"=\s*\S+\s+([a-z][\w-]*)\(")  # '%x = f32[2]{0} op(' -> op.
_DIM_LABELS = re.compile(r"dim_labels=(\S+?)[,}\s]")
_GROUPS = re.compile(r"feature_group_count=(\d+)")
_RESULT = re.compile(r"=\s*[a-z]\w*\[[\d,]*\]")  # '%x = bf16[2,3]{1,0} op(' -> '= bf16[2,3]'.


def kernel_counts(hlo_text: str) -> dict:
  """Counts of what an optimized XLA:GPU HLO module runs (see the module docstring)."""
  custom = collections.Counter()
  fusions = collections.Counter()
  ops = collections.Counter()
  conv_layouts = collections.Counter()
  conv_groups = collections.Counter()
  transpose_bytes = 0
  for line in hlo_text.splitlines():
    target = _CUSTOM_CALL.search(line)
    if target:
      custom[target.group(1)] += 1
      if target.group(1).startswith("__cudnn$conv"):
        labels = _DIM_LABELS.search(line)
        groups = _GROUPS.search(line)
        conv_layouts[labels.group(1) if labels else "?"] += 1
        conv_groups[int(groups.group(1)) if groups else 1] += 1
    kind = _FUSION_KIND.search(line)
    if kind:
      fusions[kind.group(1)] += 1
    op = _OP.search(line)
    if op:
      ops[op.group(1)] += 1
      result = _RESULT.search(line) if op.group(1) == "transpose" else None
      if result:
        transpose_bytes += shape_bytes(result.group(0))
  return {
      "custom_calls": dict(sorted(custom.items())),
      "gemm_custom_calls": sum(n for t, n in custom.items() if "cublas" in t),
      "cudnn_conv_calls": sum(n for t, n in custom.items() if t.startswith("__cudnn$conv")),
      "cudnn_fmha_calls": sum(n for t, n in custom.items() if "fmha" in t),
      "fusions": dict(sorted(fusions.items())),
      "triton_gemm_fusions": hlo_text.count('"kind":"__triton_gemm"'),
      "plain_convolutions": ops["convolution"],
      "cudnn_conv_layouts": dict(sorted(conv_layouts.items())),
      "cudnn_conv_groups": {str(g): n for g, n in sorted(conv_groups.items())},
      "transposes": ops["transpose"], "transpose_bytes": transpose_bytes,
      "copies": ops["copy"], "gathers": ops["gather"],
  }


def top_memory_kernels(found: list, n: int = 10) -> list[dict]:
  """The `n` memory-class kernels of hlo_traffic.kernels' list `found` that move the most bytes
  per step, with their jax op."""
  memory = sorted((k for k in found if k.kind == "memory"), key=lambda k: -k.bytes * k.runs)
  return [{"kernel": k.name, "bytes": k.bytes * k.runs, "op_name": k.op_name}
          for k in memory[:n]]


def compile_hlo(config, topology: str = "gpu:h100:1x1", num_classes=None) -> tuple[str, float]:
  """The optimized HLO of `config`'s train step compiled for `topology` with no device, and
  the step's model FLOPs per device."""
  _, _, compiled, flops = aot_plan.compile_step(
      config, num_classes, devices=accelerators.topology_devices(topology))
  return compiled.as_text(), flops


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # Not the per-parameter sharding lines.
  jax.config.update("jax_platforms", "cpu")  # Compile-only devices: no CUDA device to start.
  f = flags.FLAGS
  config = f.config
  out = {"model": config.model.name, "topology": f.topology, "batch_size": config.batch_size,
         "image_size": config.data.image_size, "compute_dtype": config.compute_dtype,
         "attention_impl": config.model.get("attention_impl", "xla"),
         "head_dtype": config.model.get("head_dtype", "float32"),
         "grouped_conv_impl": config.model.get("grouped_conv_impl", "xla"),
         "pointwise_conv_impl": config.model.get("pointwise_conv_impl", "xla")}
  hlo, step_flops = compile_hlo(config, f.topology, f.num_classes)
  if f.hlo_out:
    with open(f.hlo_out, "w") as out_file:
      out_file.write(hlo)
  acc = accelerators.parse_topology(f.topology).accelerator
  found, unknown = hlo_traffic.kernels(hlo)
  # What the kernels compute (a Pallas kernel's padding included), for the products' time.
  roofline = aot_plan.step_flops(config, f.num_classes, accelerator=acc.name,
                                 devices=accelerators.topology_devices(f.topology))["roofline"]
  bound = hlo_traffic.bound(hlo_traffic.totals(found, unknown), step_flops,
                            acc.peak(config.compute_dtype), acc.hbm_bandwidth,
                            work_flops=roofline["matmul"]["flops"] + roofline["attention"]["flops"])
  print(json.dumps({**out, **kernel_counts(hlo), "kernel_bound": bound,
                    "top_memory_kernels": top_memory_kernels(found)}), flush=True)


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", None, "Recipe config.", lock_config=True)
  flags.DEFINE_string("topology", "gpu:h100:1x1", "A GPU topology (bigpretrain.plan.accelerators).")
  flags.DEFINE_integer("num_classes", None, "Classes of a dataset without a class list "
                       "(e.g. 27000 for SWAG's hashtags).")
  flags.DEFINE_string("hlo_out", "", "Also write the optimized HLO text to this file.")
  sys.exit(app.run(main))
