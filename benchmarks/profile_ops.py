"""The device ops a step spends its time in, read back from a jax.profiler trace.

`trace(run, log_dir)` records a trace of `run()` (e.g. a few train steps) into `log_dir`;
`top_ops(log_dir)` reads the trace's Chrome-format `<host>.trace.json.gz` back and ranks
the XLA ops (the `hlo_op` of each event) by their total time. On a GPU or TPU those are the
events of the device's own timelines (`/device:...`: kernels, cuBLAS and cuDNN calls, copies,
each tagged with the HLO op it runs: a GPU's "Stream" lines, a TPU's "XLA Ops" line, not the
summary lines that would count the time twice); on the CPU, where every op runs on the host,
the XLA runtime's events that name an HLO op. Several kernels of one op (a cuDNN convolution's
launches) add up under the op's name; `kernel` is the first kernel name seen.

A kernel that an XLA command buffer (a CUDA graph: XLA:GPU's default) launches is tagged with
the command buffer's op, which holds most of a step: such a kernel counts under its own name
(`input_transpose_fusion_234`, `nvjet_sm90_tst_128x128_...`), and its family is its name
without the `_N` suffix, or one of KERNEL_FAMILIES (every cuBLAS GEMM kernel as one family).

`families` sums the ops by their name without XLA's numeric suffix (`cudnn-conv-bw-filter.80`
-> `cudnn-conv-bw-filter`, `loop_add_fusion.3` -> `loop_add_fusion`, a kernel's `_234`): a ViT
step's time is spread over hundreds of GEMMs and fusions of a few ms each, so its top ops alone
say little of where the time goes.
"""
import collections
import gzip
import json
import pathlib
import re

import jax


def trace(run, log_dir) -> None:
  """Runs `run()` under jax.profiler.trace into `log_dir`."""
  with jax.profiler.trace(str(log_dir)):
    run()


def _trace_file(log_dir) -> pathlib.Path:
  files = sorted(pathlib.Path(log_dir).glob("plugins/profile/*/*.trace.json.gz"))
  if not files:
    raise FileNotFoundError(f"No plugins/profile/*/*.trace.json.gz under {log_dir}: was it "
                            "written by jax.profiler.trace?")
  return files[-1]


def top_ops(log_dir, n: int = 10) -> dict:
  """{'total_ms', 'source', 'ops': [{'op', 'ms', 'share', 'count', 'kernel'}], 'families':
  [{'family', 'ms', 'share', 'ops'}]}: the n ops and the n op families with the most time in
  the latest trace under `log_dir`. `share` is of all ops' time; `ms` is summed over every
  traced call (divide by the steps traced for a per-step figure)."""
  data = json.loads(gzip.decompress(_trace_file(log_dir).read_bytes()))
  events = data["traceEvents"] if isinstance(data, dict) else data
  names = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  spans = [e for e in events if e.get("ph") == "X"]
  on_device = [e for e in spans if names.get(e["pid"], "").startswith("/device:")]
  # A device's timelines hold its kernels (GPU: the "Stream #..." lines) or its XLA ops (TPU:
  # "XLA Ops"), and summaries of them ("XLA Modules", "Steps") that would count time twice.
  for line in ("Stream", "XLA Ops"):
    kept = [e for e in on_device if threads.get((e["pid"], e.get("tid")), "").startswith(line)]
    if kept:
      on_device = kept
      break
  if on_device:
    ops, source = on_device, "device"
  else:
    ops, source = [e for e in spans if "hlo_op" in e.get("args", {})], "host"
  time_us = collections.Counter()
  count = collections.Counter()
  kernel = {}
  graphed = set()  # Ops named by their kernel: launched by a command buffer.
  for e in ops:
    op = e.get("args", {}).get("hlo_op", e["name"])  # A device event without one: its kernel.
    if op.startswith("command_buffer"):
      op = e["name"]
      graphed.add(op)
    time_us[op] += float(e.get("dur", 0.0))
    count[op] += 1
    kernel.setdefault(op, e["name"])
  total = sum(time_us.values())
  share = lambda us: us / total if total else None
  family_us, family_ops = collections.Counter(), collections.Counter()
  for op, us in time_us.items():
    family = kernel_family(op) if op in graphed else family_of(op)
    family_us[family] += us
    family_ops[family] += 1
  return {"total_ms": total / 1e3, "source": source,
          "ops": [{"op": op, "ms": us / 1e3, "share": share(us), "count": count[op],
                   "kernel": kernel[op]} for op, us in time_us.most_common(n)],
          "families": [{"family": f, "ms": us / 1e3, "share": share(us), "ops": family_ops[f]}
                       for f, us in family_us.most_common(n)]}


def family_of(op: str) -> str:
  """An HLO op's name without XLA's numeric suffix (`.N`), which numbers its instances."""
  return re.sub(r"\.\d+$", "", op)


# (substring of a kernel's name, its family): cuBLAS's GEMM kernels (`nvjet_...` on Hopper,
# `..._gemm_...`), cuDNN's fused attention (`..._sdpa_...`, `..._fmha_...`).
KERNEL_FAMILIES = (("nvjet", "cublas gemm kernels"), ("gemm", "cublas gemm kernels"),
                   ("sdpa", "cudnn attention kernels"), ("fmha", "cudnn attention kernels"))


def kernel_family(kernel: str) -> str:
  """A kernel's family: KERNEL_FAMILIES' where its name matches, else the name without the
  `_N` suffix XLA numbers its fusion kernels with."""
  lower = kernel.lower()
  for part, family in KERNEL_FAMILIES:
    if part in lower:
      return family
  return re.sub(r"_\d+$", "", kernel)
