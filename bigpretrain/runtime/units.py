"""Byte counts as people read them, for the messages of the trainer and the data pipeline."""


def size(n: float) -> str:
  """Decimal units, as `df -H` and the plan: 1.08 kB, 4.50 MB, 2.15 GB."""
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{int(n)} B"
