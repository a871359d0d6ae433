"""Resuming on another topology: the global stream position (stream_position.py), the train
iterators continued from it on other process and worker counts, a whole run preempted on 2
processes, resumed on 1 and preempted again, then finished on 2, and the refusal of a changed
schedule on resume."""
import collections
import io
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
from PIL import Image
import pytest

from bigpretrain import config_lib
from bigpretrain.runtime import metric_writers
from input_pipeline import pipeline
from input_pipeline import stream_position as sp
from tests import helpers

pytestmark = pytest.mark.multiprocess  # several trainer processes



# ------------------------------------------------------------------------------------------
# Position arithmetic against brute force.


def _remaining(position, n):
  """The first n remaining global positions, by enumeration."""
  out, g, consumed = [], position.start, set(position.consumed)
  while len(out) < n:
    if g not in consumed:
      out.append(g)
    g += 1
  return out


@pytest.mark.parametrize("start,consumed", [(0, ()), (5, ()), (5, (5,)), (5, (6, 7, 9)),
                                            (3, (3, 4, 10, 11, 40))])
def test_global_index_skips_consumed_positions(start, consumed):
  position = sp.Position(start, consumed)
  want = _remaining(position, 60)
  assert [position.global_index(q) for q in range(60)] == want
  assert position.global_index(np.arange(60)).tolist() == want


def _read_sets(states, P):
  """Global positions read, by enumerating each host and worker substream."""
  read = set()
  for p, counts in enumerate(states):
    W = len(counts)
    for w, n in enumerate(counts):
      read |= {p + P * (w + W * j) for j in range(n)}
  return read


def _state(counts):
  """A grain state with these per-worker next indices (the shapes grain writes)."""
  if counts is None:
    return None
  if len(counts) == 1:
    return {"next_index": counts[0]}
  return {"next_index_in_cycle": 0, "iterators_in_use_indices": list(range(len(counts))),
          "iterators_in_use_states": [{"next_index": n} for n in counts]}


@pytest.mark.parametrize("counts", [[[6], [6]], [[4, 2], [4, 2]], [[3], [5], [4]],
                                    [[0, 0], [2, 1]], [[7]]])
def test_continue_from_matches_enumerated_reads(counts):
  P = len(counts)
  # Twice: from the stream's start, then from a position that already skips records.
  previous = sp.Position()
  history = set()
  for _ in range(2):
    position = sp.continue_from([_state(c) for c in counts], previous)
    read_now = {previous.global_index(q) for q in _read_sets(counts, P)}
    history |= read_now
    # Everything before start was read; after it exactly the positions read are skipped.
    assert set(range(position.start)) <= history
    assert set(position.consumed) == {g for g in history if g >= position.start}
    assert position.start not in history
    previous = position
  assert sp.num_workers_of(_state([1, 2, 3])) == 3 and sp.num_workers_of(_state([1])) == 0


def test_bad_positions_and_states_are_refused():
  with pytest.raises(ValueError, match="consumed"):
    sp.Position(5, (4,))
  with pytest.raises(ValueError, match="consumed"):
    sp.Position(5, (7, 6))
  with pytest.raises(ValueError, match="unrecognised grain iterator state"):
    sp.worker_next_indices({"foo": 1})


# ------------------------------------------------------------------------------------------
# The train iterators continued on other process / worker counts.


class _Source:
  """100 PNG records; the label is the record index."""

  def __len__(self):
    return 100

  def __getitem__(self, i):
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 5 * i % 256, np.uint8)).save(buf, format="PNG")
    return {"image": buf.getvalue(), "label": i}


def _iterators(P, W, position=None):
  cfg = {"image_size": 8, "train_augment": "flip", "num_workers": W}
  return [pipeline.train_iterator(_Source(), cfg, global_batch_size=6, seed=3, process_index=p,
                                  process_count=P, position=position) for p in range(P)]


def _take(iterators, steps):
  """{label: image} of `steps` global batches, and the labels in order (with repeats)."""
  images, labels = {}, []
  for _ in range(steps):
    for it in iterators:
      batch = next(it)
      for label, image in zip(batch["label"].tolist(), batch["image"]):
        images[label] = image
        labels.append(label)
  return images, labels


# (Processes, grain workers). Other worker counts take the same path (continue_from reads
# per-worker states, tested above); worker processes take a minute to start on 2 cores.
@pytest.mark.parametrize("before,after", [((2, 0), (1, 0)), ((1, 0), (2, 0)),
                                          ((3, 0), (2, 0))])
def test_iterator_continues_global_stream_on_another_topology(before, after):
  ref_images, ref_labels = _take(_iterators(1, 0), 6)  # 36 of the 100 records.
  first = _iterators(*before)
  images, labels = _take(first, 3)
  position = sp.continue_from([it.get_state() for it in first])
  more_images, more_labels = _take(_iterators(*after, position), 3)
  assert collections.Counter(labels + more_labels) == collections.Counter(ref_labels)
  for label, image in {**images, **more_images}.items():  # Same augmentation per record.
    np.testing.assert_array_equal(image, ref_images[label])


# ------------------------------------------------------------------------------------------
# Whole runs: preempted on one topology, resumed on another.

_STEPS = 8  # 8 steps x 8 images = the 64 records of 'ids:64' once each.


def _args(workdir, **overrides):
  base = {"batch_size": 8, "total_steps": _STEPS, "ckpt_every_steps": 0,
          "data.name": "ids:64", "data.image_size": 8, "mesh.data": 1, "mesh.fsdp": -1,
          "eval_every_steps": 0}
  base.update(overrides)
  return helpers.main_args(workdir, recipe="single_label", **base)


def _launch(workdir, processes, devices, **overrides):
  """Starts `processes` x `devices` through launch/local.sh; stdout+stderr in the pipe."""
  cmd = [str(helpers.ROOT / "launch" / "local.sh"), str(processes),
         f"--devices_per_process={devices}", "--module=tests.topology_run", "--"]
  env = helpers.env()
  env["XLA_FLAGS"] = helpers.TEST_XLA_FLAGS  # local.sh adds the device count.
  env["PYTHON"] = sys.executable
  env["TOPOLOGY_RUN_PACE"] = "0.3"
  return subprocess.Popen(cmd + _args(workdir, **overrides), env=env, cwd=helpers.ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)


def _finish(proc, timeout=300):
  out, _ = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, out[-4000:]
  return out


def _preempt_after(workdir, proc, step):
  """SIGTERM to the run's processes once `step` is logged (each saves and exits 0)."""
  from tests import test_resume  # pylint: disable=import-outside-toplevel
  test_resume._wait_for_step(workdir, step, proc)  # pylint: disable=protected-access
  children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
  for pid in children.stdout.split():
    os.kill(int(pid), signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  assert out.count("Preempted: saved checkpoint") >= 1, out[-4000:]
  return out


def _trained_labels(workdir):
  labels = []
  for name in os.listdir(workdir):
    if name.startswith("ids_"):
      with open(os.path.join(workdir, name)) as f:
        labels += [l for line in f for l in json.loads(line)]
  return collections.Counter(labels)


def _losses(workdir):
  return {r["step"]: r["train/loss"] for r in metric_writers.read_metrics(str(workdir))
          if "train/loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """Uninterrupted, 1 process x 4 devices."""
  workdir = tmp_path_factory.mktemp("topology_ref")
  _finish(_launch(workdir, 1, 4))
  return workdir


def test_preempted_run_resumes_on_another_process_count(reference, tmp_path):
  """2 processes x 2 devices, preempted; resumed on 1 x 4, preempted again; finished on 2 x 2."""
  topologies = [(2, 2), (1, 4), (2, 2)]
  out = _preempt_after(tmp_path, _launch(tmp_path, *topologies[0]), 2)
  stopped = 0
  for i, (before, after) in enumerate(zip(topologies, topologies[1:])):
    stopped_before, stopped = stopped, max(_losses(tmp_path))
    assert stopped_before + 1 <= stopped < _STEPS, out[-2000:]
    proc = _launch(tmp_path, *after)
    out = (_preempt_after(tmp_path, proc, stopped + 1) if i + 2 < len(topologies)
           else _finish(proc))
    assert f"Resuming from step {stopped}" in out
    assert (f"written by {before[0]} processes x 0 grain workers, this run has {after[0]} x 0"
            in out)
  want = _trained_labels(reference)
  assert want == collections.Counter(range(64))  # The reference saw each record once.
  assert _trained_labels(tmp_path) == want
  ref, got = _losses(reference), _losses(tmp_path)
  assert sorted(got) == list(range(1, _STEPS + 1))
  for step in got:  # Same global batches, params and optimizer state re-sharded.
    assert got[step] == pytest.approx(ref[step], rel=2e-5, abs=2e-5), step


# ------------------------------------------------------------------------------------------
# Schedule changes on resume.


def test_schedule_changes_name_the_keys():
  config = helpers.tiny_config("single_label")
  saved = json.loads(config.to_json_best_effort())
  assert config_lib.schedule_changes(saved, config) == []
  config.optim.lr = 0.5
  config.optim.schedule.warmup_steps = 3
  config.batch_size = 32
  config.seed = saved["seed"] + 1  # The data position counts records of the seed's order.
  config.optim.layer_decay_lr_scale = 4.0  # The applied lr with LayerDecay.
  config.data.mix = "demo_plain:0.5"  # The data position indexes the mixed stream.
  config.data.subset_frac = 0.5
  assert config_lib.schedule_changes(saved, config) == [
      "batch_size: 16 -> 32", f"optim.lr: {saved['optim']['lr']!r} -> 0.5",
      "optim.schedule.warmup_steps: -1 -> 3",
      f"optim.layer_decay_lr_scale: {saved['optim']['layer_decay_lr_scale']!r} -> 4.0",
      f"seed: {saved['seed']} -> {saved['seed'] + 1}",
      f"data.mix: {saved['data']['mix']!r} -> 'demo_plain:0.5'",
      f"data.subset_frac: {saved['data']['subset_frac']!r} -> 0.5"]


def _run_one(args):
  return subprocess.run([sys.executable, "-m", "tests.topology_run"] + args,
                        env=helpers.env(4), cwd=helpers.ROOT, capture_output=True, text=True,
                        timeout=300)


def test_changed_schedule_is_refused_unless_allowed(reference, tmp_path):
  shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
  for name in os.listdir(tmp_path):
    if name.startswith("ids_"):
      os.remove(tmp_path / name)
  r = _run_one(_args(tmp_path, total_steps=_STEPS + 2))
  assert r.returncode == 1
  assert f"total_steps: {_STEPS} -> {_STEPS + 2}" in r.stderr
  assert "allow_schedule_change" in r.stderr
  assert max(_losses(tmp_path)) == _STEPS  # Nothing trained.
  r = _run_one(_args(tmp_path, total_steps=_STEPS + 2, allow_schedule_change=True))
  assert r.returncode == 0, r.stderr[-3000:]
  assert f"Resuming from step {_STEPS}" in r.stdout
  assert max(_losses(tmp_path)) == _STEPS + 2
