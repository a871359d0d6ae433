"""benchmarks/accelerator.py's dry run on the CPU: one JSON line per figure with the documented
keys, then the markdown table of the same figures."""
import json
import subprocess
import sys

import pytest

from benchmarks import accelerator
from tests import helpers

pytestmark = pytest.mark.slow  # Seven small compiles in a subprocess.


def test_dry_run_prints_every_figure_and_the_table():
  env = helpers.env(num_devices=1)
  r = subprocess.run([sys.executable, "benchmarks/accelerator.py"], env=env, cwd=helpers.ROOT,
                     capture_output=True, text=True, timeout=900)  # A loaded machine; the dry run itself is short.
  assert r.returncode == 0, r.stderr[-3000:]
  lines = r.stdout.splitlines()
  rows = [json.loads(l) for l in lines if l.startswith("{")]  # Each must parse.
  assert [row["figure"] for row in rows] == list(accelerator.FIGURES)
  for row in rows:
    assert set(accelerator.KEYS) <= set(row), row
    assert row["dry_run"] is True and row["platform"] == "cpu" and row["devices"] == 1
    assert row["value"] is None or isinstance(row["value"], float), row
  by = {row["figure"]: row for row in rows}
  # The trained figures ran the demo models at the dry run's sizes.
  assert by["vit_b16_train"]["model"] == "vit_demo"
  assert by["vit_b16_train"]["batch_size"] == 2 and by["vit_b16_train"]["image_size"] == 32
  assert by["vit_b16_train"]["value"] > 0
  assert by["regnety_16gf_train"]["model"] == "regnety_demo"
  assert by["regnety_16gf_train"]["num_classes"] == 100  # The dry run's hashtags.
  assert 0 < by["esd_memory_ratio"]["value"] < 1  # ESD keeps only the kept rows' activations.
  keep = by["keep_up"]
  assert keep["value"] == keep["pipeline_records_per_sec"] / keep["train_images_per_sec"]
  # The steady-state method: two batches from the one worker first, then whole rounds.
  assert (keep["workers"], keep["warmup_batches"], keep["timed_batches"]) == (1, 2, 3)
  assert keep["records_per_sec_per_worker"] == keep["pipeline_records_per_sec"]
  assert keep["worker_cpu_s_per_record"] >= 0 and keep["consumer_cpu_s_per_record"] >= 0
  # The plan compiles the very step the ViT figure ran: the same FLOPs.
  plan = by["plan_vs_measured"]
  assert plan["planned_flops_per_device"] == plan["measured_flops_per_device"] > 0
  assert plan["measured_step_time_ms"] == by["vit_b16_train"]["step_time_ms"]
  # The table: a header, one row per figure in order, the device named.
  start = lines.index("| figure | value | unit | details |")
  table = lines[start + 2:start + 2 + len(rows)]
  assert [t.split("|")[1].strip() for t in table] == list(accelerator.FIGURES)
  assert lines[-1].startswith("1 x cpu (dry run")
