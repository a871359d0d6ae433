"""Seconds to import a module in a fresh Python process, alternated across package folders.

  pip install --no-deps --target=/tmp/ml_dtypes_0_6 ml_dtypes==0.6.0
  python benchmarks/import_time.py --module=ml_dtypes --paths=,/tmp/ml_dtypes_0_6 --rounds=5

Each entry of --paths is put first on PYTHONPATH of its processes ('' = the installed
packages), so one run compares versions of a package. numpy is imported before the clock
starts. Every command, test worker and spawned worker that imports jax is such a process, so a
package's import cost is paid once per process. The line reports, per path, the version imported and the
median wall and CPU seconds over the rounds, and the median of the per-round CPU ratios to the
first path.
"""
import json
import os
import statistics
import subprocess
import sys

from absl import app
from absl import flags

_MODULE = flags.DEFINE_string("module", "ml_dtypes", "Module to import.")
_PATHS = flags.DEFINE_list("paths", [""], "PYTHONPATH prefixes to compare ('' = installed).")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Alternated rounds.")

_PROBE = """
import json, time, numpy
t, c = time.perf_counter(), time.process_time()
import {module} as m
print(json.dumps({{"wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - c,
                  "version": getattr(m, "__version__", None)}}))
"""


def _measure(path: str) -> dict:
  env = dict(os.environ)
  if path:
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
  out = subprocess.run([sys.executable, "-c", _PROBE.format(module=_MODULE.value)], env=env,
                       check=True, capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def main(argv):
  del argv
  runs = {path: [] for path in _PATHS.value}
  for _ in range(_ROUNDS.value):
    for path in runs:
      runs[path].append(_measure(path))
  first = runs[_PATHS.value[0]]
  settings = []
  for path, rows in runs.items():
    settings.append({
        "path": path, "version": rows[0]["version"],
        "wall_s": statistics.median(r["wall_s"] for r in rows),
        "cpu_s": statistics.median(r["cpu_s"] for r in rows),
        "cpu_ratio_to_first": statistics.median(
            r["cpu_s"] / f["cpu_s"] for r, f in zip(rows, first))})
  print(json.dumps({"benchmark": "import_time", "module": _MODULE.value,
                    "rounds": _ROUNDS.value, "settings": settings}), flush=True)


if __name__ == "__main__":
  app.run(main)
