"""A config's train step on the CPU with and without XLA CPU flags, alternated: one JSON line.

  python benchmarks/xla_cpu_flags.py --config=configs/semantic_softmax.py --rounds=4

XLA reads XLA_FLAGS once per process, so each measurement is a fresh benchmarks/train_step.py
process; the two settings alternate round by round (noise and drift hit both alike) and the
line reports each setting's median step time and the median of the per-round ratios. The
baseline is the environment's XLA_FLAGS without its `--xla_cpu_*` entries.
"""
import json
import os
import statistics
import subprocess
import sys

from absl import app
from absl import flags

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIG = flags.DEFINE_string("config", "configs/semantic_softmax.py", "Recipe config.")
_FLAGS = flags.DEFINE_string("flags", "--xla_cpu_experimental_ynn_fusion_type=-individual_dot",
                             "XLA flags to measure, against the same environment without them.")
_MODEL = flags.DEFINE_string("model", "", "Registered model instead of the config's.")
_ROUNDS = flags.DEFINE_integer("rounds", 4, "Alternated rounds.")
_STEPS = flags.DEFINE_integer("steps", 30, "Timed steps per process.")


def _step_ms(xla_flags: str) -> float:
  env = dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu")
  args = [f"--config={_CONFIG.value}", f"--steps={_STEPS.value}"]
  if _MODEL.value:
    args.append(f"--config.model.name={_MODEL.value}")
  out = subprocess.run(
      [sys.executable, os.path.join(_ROOT, "benchmarks", "train_step.py")] + args, env=env,
      check=True, capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])["step_time_ms"]


def main(argv):
  del argv
  measured = _FLAGS.value
  user = " ".join(t for t in os.environ.get("XLA_FLAGS", "").split()
                  if not t.startswith("--xla_cpu_"))
  settings = {"without": user, "with": f"{user} {measured}".strip()}
  times = {name: [] for name in settings}
  for _ in range(_ROUNDS.value):
    for name, value in settings.items():
      times[name].append(_step_ms(value))
  ratio = statistics.median(w / wo for w, wo in zip(times["with"], times["without"]))
  print(json.dumps({
      "benchmark": "xla_cpu_flags", "config": _CONFIG.value, "model": _MODEL.value,
      "flags": measured,
      "step_time_ms_with": statistics.median(times["with"]),
      "step_time_ms_without": statistics.median(times["without"]),
      "time_ratio_with_to_without": ratio, "rounds": times}), flush=True)


if __name__ == "__main__":
  app.run(main)
