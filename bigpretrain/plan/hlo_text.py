"""Reading compiled HLO text: shapes and their bytes, instructions, computations.

What the HLO readers (hlo_collectives, hlo_traffic) share. An instruction line is
'%name = <shape> <opcode>(<operands>), <attributes>'; a computation starts with an unindented
header '%name (params) -> shape {' ('ENTRY %name ...' for the module's entry) and ends with '}'.
"""
import math
import re

# Bytes per element of HLO element types.
DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
               "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
               "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([0-9,]*)\]")
# '%name = <shape> <opcode>(': the opcode is the first lower-case word followed by '(' after
# '= ' (layouts' tiling, e.g. '{1,0:T(8,128)}', is upper-case).
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\(")
# A computation's header, unindented: '%name (params) -> shape {' or 'ENTRY %name ... {'.
COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_NAME = re.compile(r"%([\w.\-]+)")


def shape_bytes(text: str) -> int:
  """Total bytes of the array shapes in an HLO shape string, e.g. '(f32[8,4]{1,0}, s32[])'."""
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return int(total)


def top_level(shape: str) -> list[str]:
  """The top-level elements of a tuple shape '(a, (b, c), d)' -> ['a', '(b, c)', 'd']; a
  non-tuple shape is its own single element."""
  shape = shape.strip()
  if not shape.startswith("("):
    return [shape]
  parts, depth, start = [], 0, 1
  for i, ch in enumerate(shape):
    if ch in "({[":
      depth += 1
    elif ch in ")}]":
      depth -= 1
      if depth == 0:
        parts.append(shape[start:i])
        break
    elif ch == "," and depth == 1:
      parts.append(shape[start:i])
      start = i + 1
  return [p.strip() for p in parts if p.strip()]


def operands(line: str, opcode: str) -> list[str]:
  """The operand names of an instruction line: the '%names' inside its opcode's parentheses."""
  start = line.index(f" {opcode}(") + len(opcode) + 2
  depth = 1
  for end in range(start, len(line)):
    depth += {"(": 1, ")": -1}.get(line[end], 0)
    if depth == 0:
      return _NAME.findall(line[start:end])
  return _NAME.findall(line[start:])


def parse(hlo_text: str) -> tuple[dict, str | None]:
  """({computation: [(name, result shape, opcode, line)]} in text order, the entry's name).
  Instructions before any header (a snippet, not a module) go under ''."""
  comps, current, entry = {"": []}, "", None
  for line in hlo_text.splitlines():
    m = INSTRUCTION.match(line)
    if m:
      comps[current].append((m.group(1), m.group(2), m.group(3), line))
      continue
    h = COMPUTATION.match(line)
    if h:
      current = h.group(2)
      comps[current] = []
      if h.group(1):
        entry = current
  return comps, entry
