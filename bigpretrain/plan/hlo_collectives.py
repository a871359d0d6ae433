"""The collectives of compiled HLO text, by kind, as XLA:CPU, XLA:GPU and the TPU compiler
write them.

Forms counted (each collective once, its bytes the op's result per device):
  plain ops            'all-reduce(', 'all-gather(', ... (a combined op's tuple result: all
                       of its outputs);
  async pairs          '<kind>-start(' ... '<kind>-done(': the start counts, the done does not;
                       the start's result holds the operands too, so only the outputs count;
  async wrappers       'async-start(' with calls= a computation holding the collective: the
                       wrapped op counts (it is scanned like any instruction);
  fused collectives    the TPU compiler's fusions whose called computation is an all-reduce
                       whose result is then dynamic-sliced to this device's part (its
                       AllReduceScatterFusion): a reduce-scatter, the fusion's result its
                       bytes (the all-reduce inside is not counted again);
  collective matmuls   SPMD's windowed einsum: a while loop whose body is
                       'windowed_dot_general_body_ag' (an all-gather) or '..._rs' (a
                       reduce-scatter) overlaps a dot with a ring of collective-permutes; each
                       loop counts once under its kind and in its 'windowed' count, its bytes
                       under collective-permute (the ring's ops, counted as written). The TPU
                       compiler turns large FSDP gathers and gradient reduce-scatters into these.
  TPU async calls      a fused computation ending in an AsyncCollectiveStart custom call
                       holds the collective; the one ending in its AsyncCollectiveDone holds
                       a clone of it (the same channel_id): an op is counted once per
                       channel_id (collectives without one, each time).
"""
import re

from bigpretrain.plan import hlo_text

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_WINDOWED = re.compile(r"\bbody=%?[\w.\-]*windowed_dot_general_body_(ag|rs)\b")
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_CALLS = re.compile(r"\b(?:calls|called_computations)=\{?%?([\w.\-]+)")


def _start_output_bytes(kind: str, result: str) -> int:
  """Output bytes of an async '<kind>-start': all-reduce-start returns its outputs; the
  others return (operands, outputs[, context...]), so the second element."""
  if kind == "all-reduce":
    return hlo_text.shape_bytes(result)
  parts = hlo_text.top_level(result)
  return hlo_text.shape_bytes(parts[1] if len(parts) > 1 else parts[0])


def _collective_kind(opcode: str) -> str | None:
  for kind in COLLECTIVES:
    if opcode in (kind, f"{kind}-start"):
      return kind
  return None


def _is_scatter_fusion(body) -> bool:
  """A fused computation that all-reduces and then keeps a dynamic slice of the result."""
  ops = [op for _, _, op, _ in body]
  return "all-reduce" in ops and "dynamic-slice" in ops


def collectives(hlo: str) -> dict:
  """{kind: {'count', 'bytes', 'windowed'}} of the collectives in compiled HLO text (see the
  module docstring for the forms); bytes are each op's result per device; 'windowed' is how
  many of 'count' are collective-matmul loops."""
  out = {k: {"count": 0, "bytes": 0, "windowed": 0} for k in COLLECTIVES}
  comps, _ = hlo_text.parse(hlo)
  fused_scatter = set()  # Computations counted through the fusion that calls them.
  for body in comps.values():
    for _, result, opcode, line in body:
      windowed = _WINDOWED.search(line) if opcode == "while" else None
      if windowed:
        kind = {"ag": "all-gather", "rs": "reduce-scatter"}[windowed.group(1)]
        out[kind]["count"] += 1
        out[kind]["windowed"] += 1
      called = _CALLS.search(line)
      if opcode == "fusion" and called and _is_scatter_fusion(comps.get(called.group(1), ())):
        fused_scatter.add(called.group(1))
        out["reduce-scatter"]["count"] += 1
        out["reduce-scatter"]["bytes"] += hlo_text.shape_bytes(result)
  seen_channels = set()
  for comp, body in comps.items():
    if comp in fused_scatter:
      continue
    for _, result, opcode, line in body:
      kind = _collective_kind(opcode)
      if kind is None:
        continue
      channel = _CHANNEL.search(line)
      if channel:  # A clone of a counted op (the TPU compiler's AsyncCollectiveDone side).
        if channel.group(1) in seen_channels:
          continue
        seen_channels.add(channel.group(1))
      out[kind]["count"] += 1
      out[kind]["bytes"] += (_start_output_bytes(kind, result) if opcode.endswith("-start")
                             else hlo_text.shape_bytes(result))
  return out
