"""The memory traffic of a compiled program's kernels, read off its optimized HLO text, and
the step time it bounds.

XLA:GPU's compile-only client gives no cost analysis, and the jaxpr's elementwise bytes are
those of the ops before fusion. After fusion, each kernel the device runs is one
instruction of the entry computation (or of a loop body it calls): a fusion, a cuBLAS or cuDNN
custom call, a copy. A kernel reads its operands from HBM and writes its result there, so the
step moves about the sum of those bytes. Each kernel is counted with its loop's known trip
count (a while loop without one: once, and said in 'unknown_trip_counts'); of a conditional,
its largest branch; cuBLAS's workspace output is scratch, not traffic; collectives are
counted by hlo_collectives, not here. The figure overstates where a kernel reads only part
of an operand (a fused dynamic slice) or updates a buffer in place, and ignores the L2
cache.

Classes: 'matmul' (cuBLAS GEMMs, cuDNN convolutions and attention, Triton GEMM and cuDNN
fusions, Pallas kernels) and 'memory' (the other fusions: elementwise work, normalisation,
reductions; copies and transposes). `bound_seconds` takes the matrix products at the chip's
peak (the model's FLOPs) or their bytes at the HBM bandwidth, whichever is longer, plus the
memory class at the HBM bandwidth, nothing overlapped: the fastest the step can run, unless
the caches hold what kernels reread or kernels read only part of what is counted.
"""
import dataclasses
import re

from bigpretrain.plan import hlo_text

_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
              "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain"}
_COLLECTIVE = re.compile(r"^(all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute|collective-broadcast|send|recv|async)")
_MATMUL_TARGETS = ("__cublas", "__cudnn$conv", "__cudnn$fmha", "__gpu$xla.gpu.triton")
_MATMUL_FUSIONS = ('"kind":"__triton_gemm"', '"kind":"__cudnn$fusion"')
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_TO_APPLY = re.compile(r"\bto_apply=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\b(?:branch_computations=\{([^}]*)\}|"
                       r"(?:true|false)_computation=%?([\w.\-]+))")


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One kernel of the program: its instruction, class, bytes per run, runs per step, and the
  jax op it came from (metadata op_name)."""
  name: str
  kind: str
  bytes: int
  runs: int
  op_name: str


@dataclasses.dataclass
class Traffic:
  """Kernels run and bytes moved per step, by class; loops without a known trip count."""
  kernels: dict = dataclasses.field(default_factory=lambda: {"matmul": 0, "memory": 0})
  bytes: dict = dataclasses.field(default_factory=lambda: {"matmul": 0, "memory": 0})
  unknown_trip_counts: int = 0


def _kernel_class(opcode: str, line: str) -> str:
  if opcode == "custom-call":
    target = _TARGET.search(line)
    if target and target.group(1).startswith(_MATMUL_TARGETS):
      return "matmul"
  if opcode in ("dot", "convolution") or (opcode == "fusion" and any(
      kind in line for kind in _MATMUL_FUSIONS)):
    return "matmul"
  return "memory"


def _result_bytes(shape: str, opcode: str, line: str) -> int:
  """What a kernel writes: its result, less a custom call's trailing scratch buffer (cuBLAS's
  s8 workspace, cuDNN's u8 one)."""
  parts = hlo_text.top_level(shape)
  if opcode == "custom-call" and len(parts) > 1 and re.match(r"[su]8\[", parts[-1]):
    parts = parts[:-1]
  return sum(hlo_text.shape_bytes(p) for p in parts)


def _walk(comps: dict, name: str, runs: int) -> tuple[list, int]:
  """The kernels of computation `name` run `runs` times, and its loops without a trip count."""
  found, unknown = [], 0
  shapes = {n: shape for n, shape, _, _ in comps[name]}
  for instr, shape, opcode, line in comps[name]:
    if opcode in _NO_KERNEL or _COLLECTIVE.match(opcode):
      continue
    if opcode == "while":
      trips = _TRIP_COUNT.search(line)
      body, inner = _walk(comps, _BODY.search(line).group(1),
                          runs * (int(trips.group(1)) if trips else 1))
      found += body
      unknown += inner + (0 if trips else 1)
      continue
    if opcode == "conditional":
      names = []
      for group, single in _BRANCHES.findall(line):
        names += re.findall(r"%?([\w.\-]+)", group) if group else [single]
      branches = [_walk(comps, b, runs) for b in names]
      body, inner = max(branches, key=lambda b: sum(k.bytes * k.runs for k in b[0]))
      found += body
      unknown += inner
      continue
    if opcode == "call":
      body, inner = _walk(comps, _TO_APPLY.search(line).group(1), runs)
      found += body
      unknown += inner
      continue
    read = sum(hlo_text.shape_bytes(shapes.get(o, "")) for o in hlo_text.operands(line, opcode))
    op_name = _OP_NAME.search(line)
    found.append(Kernel(instr, _kernel_class(opcode, line),
                        read + _result_bytes(shape, opcode, line), runs,
                        op_name.group(1) if op_name else ""))
  return found, unknown


def kernels(hlo: str) -> tuple[list[Kernel], int]:
  """The kernels of an optimized HLO module's entry computation, in program order, and the
  number of while loops without a known trip count (their bodies counted once)."""
  comps, entry = hlo_text.parse(hlo)
  if entry is None:
    raise ValueError("No ENTRY computation in the HLO text: pass a whole compiled module.")
  return _walk(comps, entry, 1)


def traffic(hlo: str) -> Traffic:
  """The kernels run and bytes moved per step of an optimized HLO module, by class."""
  return totals(*kernels(hlo))


def totals(found: list[Kernel], unknown: int) -> Traffic:
  """kernels()' list and loop count summed by class."""
  out = Traffic(unknown_trip_counts=unknown)
  for k in found:
    out.kernels[k.kind] += k.runs
    out.bytes[k.kind] += k.runs * k.bytes
  return out


def bound(t: Traffic, flops: float, peak_flops: float, hbm_bandwidth: float,
          work_flops: float | None = None) -> dict:
  """The step time `t`'s kernels allow (see the module docstring) and the MFU it implies for a
  step of `flops` model FLOPs per device; `work_flops` (default `flops`): what its kernels
  compute, more where a kernel computes padding (bigpretrain/models/pallas_conv.py)."""
  work = flops if work_flops is None else work_flops
  matmul = max(work / peak_flops, t.bytes["matmul"] / hbm_bandwidth)
  memory = t.bytes["memory"] / hbm_bandwidth
  seconds = matmul + memory
  return {"kernels": dict(t.kernels), "bytes": dict(t.bytes),
          "matmul_seconds": matmul, "memory_seconds": memory, "bound_seconds": seconds,
          "mfu_at_bound": flops / (seconds * peak_flops) if seconds else None,
          "unknown_trip_counts": t.unknown_trip_counts}
