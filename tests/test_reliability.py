"""Nothing lost, nothing silently wrong: a re-run with another config, two runs on one
workdir, corrupt checkpoints and records, 16-bit images, and how faults are reported."""
import contextlib
import errno
import io
import json
import logging
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import types

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np
from PIL import Image
import pytest

from bigpretrain import checkpoint
from bigpretrain import config_lib
from bigpretrain import divergence
from bigpretrain import initial_state
from bigpretrain import objectives
from bigpretrain.objectives import base as objectives_base
from bigpretrain.runtime import metric_writers
from bigpretrain.runtime import process_zero
from bigpretrain.runtime import workdir_lock
from input_pipeline import datasets
from input_pipeline import decoding
from input_pipeline import pipeline
from tests import helpers


def _tree(folder) -> dict:
  """{relative path: bytes} of every file under `folder`."""
  folder = pathlib.Path(folder)
  return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
          if p.is_file()}


def _truncate_arrays(step_dir) -> None:
  """Halves every array data file of the step's 'params' item (an interrupted copy)."""
  for root, _, files in os.walk(os.path.join(step_dir, "params")):
    if os.path.basename(root) == "d":
      for f in files:
        path = os.path.join(root, f)
        data = pathlib.Path(path).read_bytes()
        pathlib.Path(path).write_bytes(data[:len(data) // 2])


@pytest.mark.multiprocess
def test_several_processes_need_a_workdir_and_one_that_fails_does_not_wait(tmp_path):
  env = {**helpers.env(), "XLA_FLAGS": helpers.TEST_XLA_FLAGS, "PYTHON": sys.executable}
  local = [str(helpers.ROOT / "launch" / "local.sh"), "2", "--"]
  args = [a for a in helpers.main_args(tmp_path) if not a.startswith("--workdir=")]
  r = subprocess.run([*local, *args], env=env, cwd=helpers.ROOT, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 1, r.stderr[-3000:]
  # Each process refuses; local.sh stops the other once the first has left, which may be
  # before the other's line.
  assert r.stderr.count("ERROR: --workdir is required for a run of several processes") in (1, 2)
  assert "--workdir not given" not in r.stdout
  # Process 1 alone cannot read its data: it leaves with status 1 at once (at the runtime's
  # 5-minute shutdown barrier it would wait, then abort), and local.sh then stops process 0.
  wrapper = tmp_path / "python"
  wrapper.write_text(f'#!/usr/bin/env bash\nfor a in "$@"; do [[ $a == --process_id=1 ]] && '
                     f'exec {sys.executable} "$@" --config.data.dir=/proc/no_such_dir; done\n'
                     f'exec {sys.executable} "$@"\n')
  wrapper.chmod(0o755)
  r = subprocess.run([*local, *helpers.main_args(tmp_path / "run")], cwd=helpers.ROOT,
                     env={**env, "PYTHON": str(wrapper)}, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 1 and "ERROR: [Errno 2] No such file or directory: '/proc/no_such_dir'" \
      in r.stderr, r.stderr[-3000:]
  assert "exited with status 1; stopping the others" in r.stderr


@pytest.mark.parametrize("process", [0, 1])
def test_work_that_fails_on_process_0_stops_every_process_naming_it(process, monkeypatch):
  """As process `process` of 2 (jax's process queries and broadcast stubbed): process 0 runs
  the work and tells the others whether it failed; they raise instead of waiting for it."""
  sent = []

  def broadcast(flag):  # Process 0's flag reaches everyone; here it failed.
    sent.append(int(flag))
    return np.int32(0)

  monkeypatch.setattr(jax, "process_index", lambda: process)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", broadcast)
  ran = []

  def work():
    ran.append(process)
    raise OSError(errno.ENOSPC, "No space left on device")

  expected = (OSError, "No space left") if process == 0 else (
      process_zero.FailedOnProcess0, r"\[selection\] failed on process 0")
  with pytest.raises(expected[0], match=expected[1]):
    process_zero.run("[selection]", work)
  assert ran == ([0] if process == 0 else [])
  assert sent == ([0] if process == 0 else [1])
  monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda flag: np.int32(1))
  assert process_zero.run("[selection]", lambda: 5) == (5 if process == 0 else None)


def test_a_log_file_that_cannot_be_written_is_said_once(capsys):
  from bigpretrain.runtime import console  # pylint: disable=import-outside-toplevel

  class FullDisk(io.StringIO):
    def write(self, text):
      raise OSError(errno.ENOSPC, "No space left on device")

  handler = logging.StreamHandler(FullDisk())
  console.report_log_errors_once(handler)
  logger = logging.getLogger("test_full_log")
  logger.addHandler(handler)
  try:
    for i in range(3):
      logger.warning("line %d", i)
  finally:
    logger.removeHandler(handler)
  assert capsys.readouterr().err == ("WARNING: the log cannot be written (OSError: [Errno 28] No "
                                     "space left on device); its later lines are lost.\n")


def test_a_full_file_system_is_one_line_naming_the_free_space(tmp_path, capsys, monkeypatch):
  """ENOSPC that no save names (a prepare job's output, /dev/shm's semaphores): the commands'
  one ERROR line, exit 1, with what is free on each file system in play; other OSErrors pass."""
  from bigpretrain import main  # pylint: disable=import-outside-toplevel
  from bigpretrain import train  # pylint: disable=import-outside-toplevel
  from bigpretrain.tools import cli  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(cli.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=1234567))
  shm_apart = os.path.exists("/dev/shm") and (
      os.stat("/dev/shm").st_dev != os.stat(tmp_path).st_dev)
  full = tmp_path / "out" / "train-00000.parquet"  # Its folder is not made yet.
  with pytest.raises(SystemExit) as stop, cli.user_errors():
    raise OSError(errno.ENOSPC, "No space left on device", str(full))
  err = capsys.readouterr().err
  assert stop.value.code == 1 and len(err.splitlines()) == 1, err
  assert err.startswith(f"ERROR: [Errno 28] No space left on device: '{full}': a file system is "
                        f"full (free: {tmp_path / 'out'} 1.23 MB"), err
  assert (", /dev/shm 1.23 MB" in err) == shm_apart, err
  assert err.endswith("). Free some space, or write elsewhere, and run the command again.\n")
  with pytest.raises(OSError, match="Input/output error"), cli.user_errors():
    raise OSError(errno.EIO, "Input/output error")
  with pytest.raises(SystemExit), cli.user_errors():  # A Beam job's error, from the OSError.
    try:
      raise OSError(errno.EDQUOT, "Disk quota exceeded", str(full))
    except OSError as quota:
      raise RuntimeError(f"{quota} [while running 'Write']") from quota
  assert capsys.readouterr().err.startswith(
      f"ERROR: [Errno {errno.EDQUOT}] Disk quota exceeded: '{full}': a file system is full")

  def fill(config, workdir, on_locked):
    del config, workdir, on_locked
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(train, "train_and_evaluate", fill)
  for flag, value in (("_CONFIG", None), ("_WORKDIR", str(tmp_path / "run")),
                      ("_COORDINATOR", None), ("_NUM_PROCESSES", None), ("_PROCESS_ID", None)):
    monkeypatch.setattr(main, flag, types.SimpleNamespace(value=value))
  with pytest.raises(SystemExit) as stop:
    main.main(["main"])
  err = capsys.readouterr().err
  assert stop.value.code == 1 and err.startswith(
      f"\nERROR: [Errno 28] No space left on device: a file system is full (free: "
      f"{tmp_path / 'run'} 1.23 MB"), err


def test_usage_a_folder_for_a_file_and_ctrl_c_are_one_line_each(tmp_path, capsys):
  """A missing or out-of-range flag: one ERROR line and status 2 (app.UsageError printed a
  page of help before it); a folder where a file was asked for, and Ctrl-C: one line too."""
  from bigpretrain.tools import cli  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit) as stop:
    cli.check_usage(["infer", "stray"])  # Every command's check of its arguments.
  assert stop.value.code == 2 and capsys.readouterr().err == (
      "ERROR: Unexpected arguments ['stray']. Pass --help for the flags.\n")
  with pytest.raises(SystemExit) as stop, cli.user_errors():
    open(tmp_path, encoding="utf-8")  # e.g. --class_map=/tmp
  assert stop.value.code == 1 and capsys.readouterr().err == (
      f"ERROR: [Errno 21] Is a directory: '{tmp_path}'\n")
  with pytest.raises(SystemExit) as stop, cli.user_errors():
    raise KeyboardInterrupt
  assert stop.value.code == 130 and capsys.readouterr().err == "\nInterrupted (Ctrl-C).\n"


def test_a_damaged_checkpoint_read_for_its_weights_or_meta_is_one_error(tmp_path):
  from bigpretrain.models import pretrained  # pylint: disable=import-outside-toplevel
  path = helpers.random_checkpoint(tmp_path / "run")
  step_dir = tmp_path / "run" / "checkpoints" / "1"
  _truncate_arrays(step_dir)
  expected = (rf"^checkpoint step 1 in {tmp_path}/run/checkpoints cannot be read "
              r"\(ValueError: .*\): damaged or incompletely copied\.$")
  with pytest.raises(checkpoint.CheckpointUnreadable, match=expected):
    pretrained.load(path)  # What predict, evaluate, infer and the teachers load with.
  for meta in (step_dir / "meta").rglob("*"):
    if meta.is_file():
      meta.write_text("{not json")
  with pytest.raises(checkpoint.CheckpointUnreadable, match=expected.replace("ValueError", ".*")):
    checkpoint.read_meta(path)
  assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["1"]  # Nothing moved.


# ------------------------------------------------------------------------------------------
# Checkpoints of another configuration are refused; nothing a user trained is deleted.


@pytest.mark.slow
def test_rerun_with_another_model_is_refused_and_loses_nothing(tmp_path):
  args = helpers.main_args(tmp_path, total_steps=4, ckpt_every_steps=2)
  r = helpers.run_main(args)
  assert r.returncode == 0, r.stderr[-3000:]
  before = _tree(tmp_path / "checkpoints")
  rows_before = (tmp_path / "metrics.jsonl").read_bytes()
  assert sorted(p for p in os.listdir(tmp_path / "checkpoints") if p.isdigit()) == ["2", "4"]

  # The same command without --config.model.name=vit_demo: the recipe's default model.
  other = [a for a in args if not a.startswith("--config.model.name=")]
  r = helpers.run_main(other)
  assert r.returncode != 0
  err = r.stderr.strip().splitlines()[-1]
  assert err.startswith("ERROR: checkpoint step 4 ") and "another configuration" in err
  assert "model.name: checkpoint 'vit_demo', this run 'regnety_demo'" in err
  assert "Traceback" not in r.stderr
  assert _tree(tmp_path / "checkpoints") == before  # Every checkpoint, byte for byte.
  assert not (tmp_path / "checkpoints_corrupt").exists()
  assert (tmp_path / "metrics.jsonl").read_bytes() == rows_before
  assert not (tmp_path / ".lock").exists()  # Released on the refusal.

  # The original command, longer: resumes from step 4 and appends to metrics.jsonl.
  r = helpers.run_main(helpers.main_args(tmp_path, total_steps=6, ckpt_every_steps=2,
                                         allow_schedule_change=True))
  assert r.returncode == 0, r.stderr[-3000:]
  assert "Resuming from step 4" in r.stdout
  assert (tmp_path / "metrics.jsonl").read_bytes().startswith(rows_before)
  steps = [row["step"] for row in metric_writers.read_metrics(str(tmp_path)) if "train/loss" in row]
  assert steps == [1, 2, 3, 4, 5, 6]


def _state(head_classes: int, value: float = 1.0) -> dict:
  return {"step": jnp.zeros((), jnp.int32), "opt_state": {},
          "skipped_records": jnp.zeros((), jnp.int32),
          "params": {"head": {"kernel": jnp.full((4, head_classes), value)},
                     "body": {"w": jnp.full((3,), value)}},
          "extra": {}}


def test_shape_mismatch_without_meta_is_refused_not_moved(tmp_path):
  saver = checkpoint.Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  saver.save(5, _state(head_classes=10))
  saver.close()
  before = _tree(tmp_path / "ckpt")
  reader = checkpoint.Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  with pytest.raises(checkpoint.CheckpointMismatch, match=r"params: params/head/kernel: "
                     r"shape \(4, 10\) in the checkpoint, \(4, 3\) in this run"):
    reader.restore(_state(head_classes=3))
  reader.close()
  assert _tree(tmp_path / "ckpt") == before
  assert not (tmp_path / "ckpt_corrupt").exists()


def test_meta_differences_name_the_keys():
  saved = {"model": {"name": "vit_demo", "depth": 2}, "num_classes": 10,
           "class_names": ["a", "b"], "objective": {"name": "softmax", "smoothing": 0.1},
           "dataset": "demo"}
  same = {**saved, "objective": {"name": "softmax", "smoothing": 0.2}, "dataset": "other"}
  assert checkpoint.meta_differences(saved, same) == []  # Objective settings may change.
  other = {**saved, "model": {"name": "regnety_demo"}, "class_names": ["a", "c"]}
  assert checkpoint.meta_differences(saved, other) == [
      "class_names: checkpoint 'another list', this run \"this dataset's\"",
      "model.depth: checkpoint 2, this run '(unset)'",
      "model.name: checkpoint 'vit_demo', this run 'regnety_demo'"]


def test_corrupt_copies_of_one_step_are_all_kept(tmp_path, capsys):
  directory = tmp_path / "ckpt"
  for value in (1.0, 2.0):  # The same step corrupted twice (e.g. two failed copies).
    saver = checkpoint.Checkpointer(str(directory), async_save=False)
    saver.save(5, _state(head_classes=3, value=value))
    saver.close()
    _truncate_arrays(directory / "5")
    reader = checkpoint.Checkpointer(str(directory), async_save=False)
    assert reader.restore(_state(head_classes=3)) is None
    reader.close()
  kept = sorted(os.listdir(tmp_path / "ckpt_corrupt"))
  assert kept == ["5", "5.1"]
  warning = capsys.readouterr().out.strip().splitlines()[-1]  # Why, in the storage's words.
  assert re.search(r"is unreadable \(ValueError: \.\.\..*Requested byte range \[0, \d+\) "
                   r"is not valid for value of size \d+\); moved to", warning), warning
  assert not (directory / "5").exists()
  # The restore's other failed reads, logged as asyncio collects their tasks (at exit, maybe
  # after the log's files are closed), echo that one warning: dropped; other errors are not.
  asyncio_log = logging.getLogger("asyncio")

  def logged(path, message="Task exception was never retrieved") -> bool:
    error = ValueError(f'OUT_OF_RANGE: Error reading Byte range of local file "{path}"')
    return bool(asyncio_log.filter(asyncio_log.makeRecord(
        "asyncio", logging.ERROR, __file__, 0, message, (), (ValueError, error, None))))

  assert not logged(directory / "5" / "params" / "d" / "a1")
  assert logged(directory / "50" / "params" / "d" / "a1")
  absl_log = logging.getLogger("absl")  # restore's own line naming the step is kept.
  assert absl_log.filter(absl_log.makeRecord("absl", logging.INFO, __file__, 0,
                                             f"{directory}/5/params cannot be restored", (),
                                             None))


def _save_steps(directory, steps) -> None:
  saver = checkpoint.Checkpointer(str(directory), async_save=False)
  for step in steps:
    saver.save(step, _state(head_classes=3, value=float(step)))
  saver.close()


def test_a_damaged_checkpoint_falls_back_after_the_divergence_window_changed(tmp_path):
  """A resume may change config.divergence.window (the saved record is read at its own size
  and dropped); a damaged newest checkpoint then still falls back, not 'another config'."""
  directory = tmp_path / "ckpt"
  saver = checkpoint.Checkpointer(str(directory), async_save=False)
  for step in (2, 4):
    saver.save(step, {**_state(head_classes=3, value=float(step)),
                      "health": divergence.init_health(4)})
  saver.close()
  _truncate_arrays(directory / "4")
  reader = checkpoint.Checkpointer(str(directory), async_save=False)
  restored, step = reader.restore({**_state(head_classes=3), "health": divergence.init_health(8)})
  reader.close()
  assert step == 2 and "health" not in restored
  assert float(restored["params"]["body"]["w"][0]) == 2.0
  assert (tmp_path / "ckpt_corrupt" / "4").is_dir()


@pytest.mark.parametrize("error", [
    OSError(errno.ETIMEDOUT, "Connection timed out"),
    ValueError("UNAVAILABLE: Error reading local file: read of 4096 bytes failed"),
    MemoryError()])
def test_a_storage_or_memory_error_stops_the_restore_and_moves_nothing(tmp_path, error):
  directory = tmp_path / "ckpt"
  _save_steps(directory, (2, 4))
  before = _tree(directory)
  reader = checkpoint.Checkpointer(str(directory), async_save=False)

  def fail(*args, **kwargs):
    raise ValueError("restore failed") from error

  reader.manager.restore = fail
  with pytest.raises(checkpoint.CheckpointReadError, match="step 4 .*nothing was moved"):
    reader.restore(_state(head_classes=3))
  reader.close()
  assert _tree(directory) == before and not (tmp_path / "ckpt_corrupt").exists()


def test_another_runs_checkpoints_are_read_only(tmp_path, capsys):
  # config.resume: an unreadable checkpoint there is passed over and left where it is.
  directory = tmp_path / "other"
  _save_steps(directory, (2, 4))
  _truncate_arrays(directory / "4")
  before = _tree(directory)
  reader = checkpoint.Checkpointer(str(directory), async_save=False, read_only=True)
  restored, step = reader.restore(_state(head_classes=3))
  reader.close()
  assert step == 2 and float(restored["params"]["body"]["w"][0]) == 2.0
  assert "step 4 " in capsys.readouterr().out
  assert _tree(directory) == before and not (tmp_path / "other_corrupt").exists()


def _experiment(total_steps: int, objective=None, **overrides):
  """What initial_state.restore_or_init reads of a train.Experiment."""
  config = helpers.set_overrides(config_lib.base_config(), overrides)
  return types.SimpleNamespace(config=config, total_steps=total_steps, shardings={},
                               objective=objective or objectives_base.Objective())


def _fresh_state() -> dict:
  return {**_state(head_classes=3), "health": divergence.init_health(4)}


def test_a_checkpoint_past_total_steps_is_refused_and_moves_nothing(tmp_path):
  ckpts = tmp_path / "checkpoints"
  _save_steps(ckpts, (2, 6))
  before = _tree(ckpts)
  reader = checkpoint.Checkpointer(str(ckpts), async_save=False)
  with pytest.raises(checkpoint.CheckpointMismatch) as e:
    initial_state.restore_or_init(_experiment(3), _fresh_state(), None, reader, str(tmp_path))
  assert str(e.value).startswith(f"checkpoint step 6 in {ckpts} is past total_steps=3: ")
  assert "--config.resume_step=N" in str(e.value) and "another --workdir" in str(e.value)
  assert _tree(ckpts) == before
  # Said before the schedule change that lowered total_steps (allowing it would not resume).
  (tmp_path / "config.json").write_text(json.dumps(
      helpers.set_overrides(config_lib.base_config(), {"total_steps": 6}).to_dict()))
  lowered = _experiment(3)
  lowered.config.total_steps = 3
  with pytest.raises(checkpoint.CheckpointMismatch, match="is past total_steps=3: "):
    initial_state.restore_or_init(lowered, _fresh_state(), None, reader, str(tmp_path))
  (tmp_path / "config.json").unlink()
  # Going back to a step at or before the end is the way on: step 6 is set aside.
  state, start = initial_state.restore_or_init(_experiment(3, resume_step=2), _fresh_state(),
                                               None, reader, str(tmp_path))
  reader.close()
  assert start == 2 and float(state["params"]["body"]["w"][0]) == 2.0
  assert sorted(os.listdir(tmp_path / "checkpoints_superseded")) == ["6"]
  # Another run's checkpoints (config.resume) alike, left as they are.
  other = checkpoint.Checkpointer(str(tmp_path / "empty"), async_save=False)
  with pytest.raises(checkpoint.CheckpointMismatch,
                     match=re.escape(f"checkpoint step 6 in {ckpts}_superseded is past "
                                     "total_steps=4: ") + ".* another --config.resume"):
    initial_state.restore_or_init(_experiment(4, resume=f"{ckpts}_superseded"), _fresh_state(),
                                  None, other, str(tmp_path / "run"))
  other.close()


def test_config_resume_takes_a_runs_workdir_as_model_init_does(tmp_path, capsys):
  _save_steps(tmp_path / "other" / "checkpoints", (2,))
  here = checkpoint.Checkpointer(str(tmp_path / "run" / "checkpoints"), async_save=False)
  state, start = initial_state.restore_or_init(
      _experiment(4, resume=str(tmp_path / "other")), _fresh_state(), None, here,
      str(tmp_path / "run"))
  assert start == 2 and float(state["params"]["body"]["w"][0]) == 2.0
  assert f"Resuming from step 2 in {tmp_path / 'other' / 'checkpoints'}" in (
      capsys.readouterr().out)
  with pytest.raises(FileNotFoundError, match="nope does not exist"):
    initial_state.restore_or_init(_experiment(4, resume=str(tmp_path / "nope")),
                                  _fresh_state(), None, here, str(tmp_path / "run"))
  here.close()


# Dog and cat under animal, hound under dog: a tree of 3 levels.
_WNIDS = ["n00015388", "n02084071", "n02121620", "n02087551"]


def test_a_resume_trains_on_the_class_tree_its_checkpoint_stores(tmp_path, capsys):
  # The rule that builds the tree may change between versions: a resumed semantic run keeps
  # the tree its level heads were trained for (here: all classes roots), says so, and stores
  # it again.
  cfg = ml_collections.ConfigDict({"name": "semantic_softmax"})
  info = types.SimpleNamespace(name="wnids", class_names=_WNIDS)
  built = objectives.get_objective(cfg, info).tree
  assert built.num_levels == 3
  stored = [-1] * len(_WNIDS)
  meta = {"class_names": _WNIDS, "objective": {"name": "semantic_softmax"},
          "version": checkpoint.META_VERSION}
  saver = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), async_save=False,
                                  meta={**meta, "class_tree": {"parent": stored}})
  saver.save(2, _state(head_classes=3))
  saver.close()
  objective = objectives.get_objective(cfg, info)
  reader = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), async_save=False,
                                   meta={**meta, **objective.meta()})
  _, start = initial_state.restore_or_init(_experiment(4, objective), _fresh_state(), None,
                                           reader, str(tmp_path))
  reader.close()
  assert start == 2
  assert objective.tree.parent.tolist() == stored and objective.tree.num_levels == 1
  assert objective.targets.shape == (len(_WNIDS), 1)  # The loss's targets follow it.
  assert reader.meta["class_tree"] == {"parent": stored}  # What the next checkpoints store.
  out = capsys.readouterr().out
  assert ("checkpoint step 2 was trained on another class tree than the one built now from "
          "its class list (checkpoint's -> now: level sizes [4] -> [1, 2, 1]; 3 classes with "
          "another parent, e.g. n02084071 under (root) -> n00015388") in out
  assert "training on with the checkpoint's tree" in out

  # A checkpoint written before trees were stored trains on the tree built now, unwarned.
  old = tmp_path / "old"
  saver = checkpoint.Checkpointer(str(old / "checkpoints"), async_save=False, meta=meta)
  saver.save(2, _state(head_classes=3))
  saver.close()
  objective = objectives.get_objective(cfg, info)
  reader = checkpoint.Checkpointer(str(old / "checkpoints"), async_save=False,
                                   meta={**meta, **objective.meta()})
  initial_state.restore_or_init(_experiment(4, objective), _fresh_state(), None, reader,
                                str(old))
  reader.close()
  assert objective.tree == built and reader.meta["class_tree"]["parent"] == built.parent.tolist()
  assert "class tree" not in capsys.readouterr().out

  # Initialised from the first checkpoint (model_init): the tree goes with the head it keeps,
  # and stays the one built now when the head starts fresh.
  for skip, tree in (("", stored), ("^params/head/", built.parent.tolist())):
    objective = objectives.get_objective(cfg, info)
    exp = _experiment(4, objective, model_init=str(tmp_path), model_init_skip=skip)
    exp.model_def = types.SimpleNamespace(param_adapter=lambda *args: None)
    exp.dataset = types.SimpleNamespace(info=info)
    writer = checkpoint.Checkpointer(str(tmp_path / f"init{len(skip)}"), async_save=False,
                                     meta={**meta, **objective.meta()})
    _, start = initial_state.restore_or_init(exp, _fresh_state(), None, writer,
                                             str(tmp_path / f"init{len(skip)}"))
    writer.close()
    assert start == 0 and objective.tree.parent.tolist() == tree, skip
    assert writer.meta["class_tree"] == {"parent": tree}
    assert ("was trained on another class tree" in capsys.readouterr().out) == (not skip)


def test_the_divergence_record_is_resumed_when_it_fits(tmp_path):
  # A resumed run judges spikes against the same window of recent losses as the
  # uninterrupted run, and keeps counting skipped steps.
  def with_health(window, losses=(), skipped=0, bad_run=0):
    values = np.full((window,), np.nan, np.float32)
    values[:len(losses)] = losses
    return {**_state(head_classes=3), "health": {"losses": jnp.asarray(values),
                                                 "skipped_steps": jnp.int32(skipped),
                                                 "bad_run": jnp.int32(bad_run)}}

  saver = checkpoint.Checkpointer(str(tmp_path / "new"), async_save=False)
  saver.save(3, with_health(4, (2.5, 2.0), skipped=1, bad_run=1))
  saver.close()
  reader = checkpoint.Checkpointer(str(tmp_path / "new"), async_save=False)
  restored, _ = reader.restore(with_health(4))
  np.testing.assert_array_equal(restored["health"]["losses"], [2.5, 2.0, np.nan, np.nan])
  assert int(restored["health"]["skipped_steps"]) == 1
  # Step 3 was bad (a run of one), so step 2's state diverged: only states up to step 1 count
  # as good for rotation until a later good loss says otherwise.
  assert int(restored["health"]["bad_run"]) == 1 and reader._good_through == 1
  assert "health" not in reader.restore(with_health(8))[0]  # Another window: none to restore.
  reader.close()
  old = checkpoint.Checkpointer(str(tmp_path / "old"), async_save=False)
  old.save(3, _state(head_classes=3))  # Saved without a record.
  old.close()
  reader = checkpoint.Checkpointer(str(tmp_path / "old"), async_save=False)
  assert "health" not in reader.restore(with_health(4))[0]
  reader.close()


def test_read_metrics_reads_appended_resumes_as_one_run(tmp_path):
  rows = [{"step": s, "train/loss": float(s)} for s in (1, 2, 3)]
  rows += [{"step": 3, "eval/top1": 0.5}]
  rows += [{"step": 2, "train/loss": 12.0}, {"step": 2, "eval/top1": 0.7}]  # Resumed at 1,
  rows += [{"step": s, "train/loss": 10.0 + s} for s in (3, 4)]  # its step 2 row pair kept.
  (tmp_path / "metrics.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "tr')  # A torn last line.
  got = metric_writers.read_metrics(str(tmp_path))
  assert [(r["step"], r.get("train/loss"), r.get("eval/top1")) for r in got] == [
      (1, 1.0, None), (2, 12.0, None), (2, None, 0.7), (3, 13.0, None), (4, 14.0, None)]


def test_read_metrics_replaces_a_resumed_runs_rows_of_the_last_step_logged(tmp_path):
  rows = [{"step": s, "train/loss": float(s)} for s in (10, 20, 30)]
  rows += [{"step": 30, "eval/top1": 0.5}]
  # Resumed from step 25: its first row is at step 30 again, its evaluation follows it.
  rows += [{"step": 30, "train/loss": 33.0}, {"step": 30, "eval/top1": 0.6},
           {"step": 40, "train/loss": 44.0}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  got = metric_writers.read_metrics(str(tmp_path))
  assert [(r["step"], r.get("train/loss"), r.get("eval/top1")) for r in got] == [
      (10, 10.0, None), (20, 20.0, None), (30, 33.0, None), (30, None, 0.6), (40, 44.0, None)]


def test_rows_appended_after_a_torn_last_line_start_on_their_own_line(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/loss": 1.0}\n{"step": 2, "tr')
  writer = metric_writers.MetricWriter(str(tmp_path))
  writer.write(2, {"train/loss": 2.5})
  writer.write(3, {"train/loss": 3.5})
  writer.close()
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert lines[1:] == ['{"step": 2, "tr', '{"step": 2, "train/loss": 2.5}',
                       '{"step": 3, "train/loss": 3.5}']
  assert [r["step"] for r in metric_writers.read_metrics(str(tmp_path))] == [1, 2, 3]


def test_a_full_disk_under_metrics_jsonl_is_one_error(tmp_path):
  writer = metric_writers.MetricWriter(str(tmp_path))
  os.symlink("/dev/full", tmp_path / "metrics.jsonl")  # Every write: ENOSPC.
  with pytest.raises(metric_writers.MetricWriteError) as e:
    writer.write(1, {"train/loss": 1.0})
  writer.close()
  assert str(e.value).startswith(f"writing {tmp_path / 'metrics.jsonl'} failed (OSError: "
                                 "[Errno 28] No space left on device). Free space")


# ------------------------------------------------------------------------------------------
# One run per workdir.


@pytest.mark.multiprocess
def test_second_run_on_a_workdir_refuses_and_a_killed_run_does_not_block(tmp_path):
  first = helpers.popen_main(helpers.main_args(tmp_path, total_steps=100000))
  try:
    deadline = time.time() + 300
    while not (tmp_path / "metrics.jsonl").exists():
      assert first.poll() is None and time.time() < deadline, first.stdout.read()[-3000:]
      time.sleep(0.2)
    owner = json.loads((tmp_path / ".lock").read_text())
    assert owner["pid"] == first.pid and owner["host"] == socket.gethostname()
    logs = sorted(tmp_path.glob("log*"))
    second = helpers.run_main(helpers.main_args(tmp_path, total_steps=2), timeout=300)
    assert second.returncode != 0
    err = second.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"ERROR: workdir {tmp_path} is in use by another run") and f"pid {first.pid}" in err[0]
    # The refused run writes no log there: log.INFO still points at the first run's.
    assert sorted(tmp_path.glob("log*")) == logs
    assert os.readlink(tmp_path / "log.INFO").endswith(f".{first.pid}")
    assert first.poll() is None  # The first run goes on.
    assert len(list(tmp_path.glob("events.out.tfevents*"))) == 1
  finally:
    first.send_signal(signal.SIGKILL)
    first.wait()
  assert (tmp_path / ".lock").exists()  # SIGKILL leaves the file behind...
  third = helpers.run_main(helpers.main_args(tmp_path, total_steps=2))
  assert third.returncode == 0, third.stderr[-3000:]  # ...which does not block.
  assert f"taking over the lock {tmp_path / '.lock'} left by host" in third.stdout
  assert not (tmp_path / ".lock").exists()


def test_lock_staleness_rules(tmp_path, monkeypatch):
  path = tmp_path / workdir_lock.LOCK_NAME
  dead = subprocess.Popen(["true"])
  dead.wait()

  def owner(host, pid):
    path.write_text(json.dumps({"host": host, "pid": pid, "job": "", "started": "x"}))

  owner(socket.gethostname(), dead.pid)  # This host, process gone: taken over.
  with workdir_lock.WorkdirLock(str(tmp_path)):
    mine = json.loads(path.read_text())
    space = workdir_lock._pid_space()  # pylint: disable=protected-access
    assert mine["pid"] == os.getpid() and mine["pid_space"] == space
  assert not path.exists()

  owner("another-host", 1)  # Another host, fresh heartbeat: refused.
  with pytest.raises(workdir_lock.WorkdirLocked, match="in use by another run"):
    with workdir_lock.WorkdirLock(str(tmp_path)):
      pass
  old = time.time() - workdir_lock.STALE_S - 10  # Another host, no heartbeat: taken over.
  os.utime(path, (old, old))
  with workdir_lock.WorkdirLock(str(tmp_path)):
    assert json.loads(path.read_text())["host"] == socket.gethostname()

  # This host name, but another pid namespace (a container sharing the host's network),
  # fresh heartbeat: its pids mean nothing here, refused even though this one is dead.
  path.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "job": "",
                              "started": "x", "pid_space": "another-boot:1"}))
  with pytest.raises(workdir_lock.WorkdirLocked, match="in use by another run"):
    with workdir_lock.WorkdirLock(str(tmp_path)):
      pass
  owner(socket.gethostname(), os.getpid())  # A live process of this host: refused.
  with pytest.raises(workdir_lock.WorkdirLocked):
    with workdir_lock.WorkdirLock(str(tmp_path)):
      pass

  monkeypatch.setattr(workdir_lock, "HEARTBEAT_S", 0.05)
  path.unlink()
  with workdir_lock.WorkdirLock(str(tmp_path)):
    os.utime(path, (old, old))
    time.sleep(0.5)
    assert time.time() - path.stat().st_mtime < 5  # The holder's heartbeat refreshed it.


def test_an_empty_or_unreadable_lock_is_not_a_live_run(tmp_path):
  path = tmp_path / workdir_lock.LOCK_NAME
  for left in ("", '{"host": "h'):  # A full disk; a starter killed mid-write. Fresh mtimes.
    path.write_text(left)
    with workdir_lock.WorkdirLock(str(tmp_path)):
      assert json.loads(path.read_text())["pid"] == os.getpid()
    assert not path.exists()


def test_a_lock_that_cannot_be_written_is_one_error_and_leaves_no_file(tmp_path, monkeypatch):
  def full_disk(*args, **kwargs):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(workdir_lock.json, "dump", full_disk)
  with pytest.raises(workdir_lock.WorkdirUnwritable,
                     match=r"cannot write the workdir lock .* \(No space left on device\)"):
    with workdir_lock.WorkdirLock(str(tmp_path)):
      pass
  assert not (tmp_path / workdir_lock.LOCK_NAME).exists()  # No empty lock blocks a re-run.


def _racer(workdir, barrier, results, trials):
  """Takes over the same stale lock as another process, `trials` times."""
  for _ in range(trials):
    barrier.wait(timeout=60)
    try:
      got = workdir_lock.WorkdirLock(workdir)._acquire() == ""  # pylint: disable=protected-access
    except Exception as e:  # pylint: disable=broad-except
      got = repr(e)
    results.put((os.getpid(), got))
    barrier.wait(timeout=60)


@pytest.mark.multiprocess
def test_two_starters_taking_over_one_stale_lock_never_both_get_it(tmp_path):
  import multiprocessing  # pylint: disable=import-outside-toplevel
  trials = 30
  dead = subprocess.Popen(["true"])
  dead.wait()
  ctx = multiprocessing.get_context("spawn")
  barrier, results = ctx.Barrier(3), ctx.Queue()
  racers = [ctx.Process(target=_racer, args=(str(tmp_path), barrier, results, trials))
            for _ in range(2)]
  for r in racers:
    r.start()
  path = tmp_path / workdir_lock.LOCK_NAME
  winners = []
  try:
    for _ in range(trials):
      path.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
      barrier.wait(timeout=120)
      got = [results.get(timeout=60) for _ in racers]
      assert all(isinstance(won, bool) for _, won in got), got
      winners.append([pid for pid, won in got if won])
      assert len(winners[-1]) == 1 and json.loads(path.read_text())["pid"] == winners[-1][0]
      path.unlink()
      barrier.wait(timeout=60)
  finally:
    for r in racers:
      r.join(timeout=10)
      r.kill()
  assert [len(w) for w in winners] == [1] * trials


def test_a_read_only_workdir_is_named_before_anything_is_written(tmp_path, monkeypatch):
  (tmp_path / "checkpoints").mkdir()
  with _read_only(tmp_path / "checkpoints"):
    with pytest.raises(workdir_lock.WorkdirUnwritable,
                       match=f"cannot write to {tmp_path / 'checkpoints'} "):
      workdir_lock.check_writable(str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == ["checkpoints"]  # The probe is gone.
  workdir_lock.check_writable(str(tmp_path))
  # A URL is no local folder: refused, and no ./gs: folder is made.
  monkeypatch.chdir(tmp_path)
  with pytest.raises(workdir_lock.WorkdirUnwritable, match=r"--workdir=gs://b/run is a URL"):
    workdir_lock.check_writable("gs://b/run")
  assert sorted(os.listdir(tmp_path)) == ["checkpoints"]
  (tmp_path / "notes.txt").write_text("x")  # A file where the folder should be.
  with pytest.raises(workdir_lock.WorkdirUnwritable, match=r"--workdir=notes\.txt is a file"):
    workdir_lock.check_writable("notes.txt")


@contextlib.contextmanager
def _read_only(folder):
  """`folder` refuses new files, also to root (immutable attribute; as another user: mode)."""
  if os.geteuid() == 0:
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:
      pytest.skip("running as root on a file system without chattr +i")
    try:
      yield
    finally:
      subprocess.run(["chattr", "-i", str(folder)], check=True)
  else:
    folder.chmod(0o555)
    try:
      yield
    finally:
      folder.chmod(0o755)


# ------------------------------------------------------------------------------------------
# Data: unreadable records are skipped and counted; 16-bit PNGs; non-image files.


def _png16(values: np.ndarray) -> bytes:
  """A 16-bit PNG (grey [H, W] or RGB [H, W, 3] uint16), encoded here by the PNG spec,
  not by PIL."""
  import struct  # pylint: disable=import-outside-toplevel
  import zlib  # pylint: disable=import-outside-toplevel
  height, width = values.shape[:2]
  color = 0 if values.ndim == 2 else 2
  rows = values.astype(">u2").reshape(height, -1).tobytes()
  stride = len(rows) // height
  raw = b"".join(b"\x00" + rows[i * stride:(i + 1) * stride] for i in range(height))

  def chunk(kind, data):
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

  header = struct.pack(">IIBBBBB", width, height, 16, color, 0, 0, 0)
  return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw))
          + chunk(b"IEND", b""))


def _gradients():
  """16-bit grey and RGB gradients over the whole 16-bit range."""
  ramp = np.linspace(0, 65535, 24 * 32).astype(np.uint16).reshape(24, 32)
  rgb = np.stack([ramp, ramp[::-1], np.full_like(ramp, 30000)], axis=-1)
  return ramp, rgb


def test_a_record_read_that_fails_for_the_storage_is_read_again(monkeypatch):
  monkeypatch.setattr(datasets, "READ_RETRY_WAITS_S", (0.0, 0.0))

  class Flaky:
    def __init__(self, errors):
      self.errors = list(errors)

    def __len__(self):
      return 1

    def __getitem__(self, index):
      if self.errors:
        raise self.errors.pop(0)
      return {"label": np.int64(4)}

  timeout = OSError(errno.ETIMEDOUT, "Connection timed out")
  assert datasets.RecordSource(Flaky([timeout, timeout]), "train")[0] == {"label": 4}
  # Never came back: an outage, not a corrupt record. It stops the run (not skipped, so no
  # record is lost to it), and pipeline._ReadGuard passes it on.
  with pytest.raises(decoding.StorageUnavailableError,
                     match=r"record 0 of split 'train' could not be read in 3 tries .*timed out"):
    _ = pipeline._ReadGuard(  # pylint: disable=protected-access
        datasets.RecordSource(Flaky([timeout] * 3), "train"))[0]
  assert not issubclass(decoding.StorageUnavailableError, decoding.CorruptRecordError)
  with pytest.raises(decoding.StorageUnavailableError):  # Nor does the eval dtype probe.
    pipeline._scalar_dtypes(  # pylint: disable=protected-access
        datasets.RecordSource(Flaky([timeout] * 3), "validation"), {"label": 0})
  flaky = Flaky([ValueError("DATA_LOSS: checksum mismatch"), timeout])
  with pytest.raises(decoding.CorruptRecordError, match="checksum"):  # Bad bytes: no retry.
    _ = datasets.RecordSource(flaky, "train")[0]
  assert flaky.errors == [timeout]


def test_an_empty_or_non_image_file_is_told_without_the_stream_object():
  from input_pipeline import decoding  # pylint: disable=import-outside-toplevel
  from input_pipeline import pipeline  # pylint: disable=import-outside-toplevel
  with pytest.raises(decoding.CorruptImageError) as e:
    pipeline.decode_image(b"")
  assert str(e.value) == "empty (0 bytes), not an image"
  with pytest.raises(decoding.CorruptImageError) as e:
    pipeline.decode_image(b"<html>not found</html>")
  assert str(e.value) == "UnidentifiedImageError: cannot identify image file (22 bytes)"


def test_16bit_pngs_are_scaled_to_8_bits():
  from input_pipeline.jobs import beam_images  # pylint: disable=import-outside-toplevel
  from input_pipeline import pipeline  # pylint: disable=import-outside-toplevel
  grey, rgb = _gradients()
  want_grey = np.repeat((grey // 256).astype(np.uint8)[..., None], 3, axis=-1)
  want_rgb = (rgb // 256).astype(np.uint8)
  for values, want in ((grey, want_grey), (rgb, want_rgb)):
    data = _png16(values)
    got = pipeline.decode_image(data)  # The train/eval pipelines and predict decode so.
    np.testing.assert_array_equal(got, want)
    # The folder and ImageNet-21K-P jobs' squish (JPEG, lossy): the same picture.
    squished = np.asarray(Image.open(io.BytesIO(beam_images.squish_jpeg(data, size=16))))
    assert abs(squished.mean() - want.mean()) < 3.0, (squished.mean(), want.mean())
  assert abs(want_grey.mean() - 127.5) < 1  # What clipping at 255 turned into ~254.


@pytest.fixture(scope="module")
def folder_dataset(tmp_path_factory):
  """A prepared ImageFolder dataset of 40 small PNGs in two classes (with a 16-bit PNG and
  a notes.txt among them)."""
  from input_pipeline.jobs import image_folder  # pylint: disable=import-outside-toplevel
  raw = tmp_path_factory.mktemp("raw")
  rng = np.random.default_rng(0)
  for c in ("cat_a", "cat_b"):
    (raw / c).mkdir()
    for i in range(20):
      buf = io.BytesIO()
      Image.fromarray(rng.integers(0, 255, (12, 12, 3), np.uint8)).save(buf, format="PNG")
      (raw / c / f"{i:02d}.png").write_bytes(buf.getvalue())
  (raw / "cat_a" / "20_deep.png").write_bytes(_png16(_gradients()[0]))
  (raw / "cat_a" / "notes.txt").write_text("where these came from")
  out = tmp_path_factory.mktemp("prepared")
  builder = image_folder.prepare(raw, out, "toy")
  return raw, out, builder


@pytest.mark.beam
def test_folder_job_ignores_non_image_files_and_keeps_16bit_pngs(folder_dataset):
  from input_pipeline import datasets  # pylint: disable=import-outside-toplevel
  from input_pipeline import decoding  # pylint: disable=import-outside-toplevel
  from input_pipeline.jobs import imagenet21k_p  # pylint: disable=import-outside-toplevel
  raw, out, builder = folder_dataset
  meta = imagenet21k_p.report(builder)
  assert meta["corrupt_files"] == []  # notes.txt is not a corrupt image...
  ds = datasets.get_dataset({"name": "folder:toy", "dir": str(out)})
  assert ds.info.num_examples == {"train": 41}  # ...nor an example.
  assert decoding.is_non_image("a/notes.TXT") and not decoding.is_non_image("x.JPEG")
  source = ds.source("train")
  deep = next(source[i] for i in range(len(source)) if source[i]["file_name"].endswith("deep.png"))
  want = np.repeat((_gradients()[0] // 256).astype(np.uint8)[..., None], 3, axis=-1)
  from input_pipeline import pipeline  # pylint: disable=import-outside-toplevel
  np.testing.assert_array_equal(pipeline.decode_image(deep["image"]), want)


def _shard(out) -> pathlib.Path:
  (shard,) = pathlib.Path(out).rglob("*-train.array_record-*")
  return shard


def _unreadable_positions(shard) -> list[int]:
  """Records the ArrayRecord reader itself cannot read (independent of the pipeline)."""
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  reader = array_record_module.ArrayRecordReader(str(shard))
  bad = []
  for i in range(reader.num_records()):
    try:
      reader.read([i])
    except Exception:  # pylint: disable=broad-except
      bad.append(i)
  return bad


@pytest.mark.beam
def test_an_unreadable_record_is_skipped_and_counted(folder_dataset, tmp_path):
  import shutil  # pylint: disable=import-outside-toplevel
  from input_pipeline import datasets  # pylint: disable=import-outside-toplevel
  from input_pipeline import pipeline  # pylint: disable=import-outside-toplevel
  _, out, _ = folder_dataset
  shutil.copytree(out, tmp_path / "data")
  shard = _shard(tmp_path / "data")
  data = bytearray(shard.read_bytes())
  at = 5000  # Inside the records (~28 KB; the file is padded to 128 KiB).
  data[at:at + 64] = bytes(range(64))  # 64 bytes overwritten in one shard.
  shard.write_bytes(bytes(data))
  bad = _unreadable_positions(shard)
  assert 1 <= len(bad) <= 3, bad
  source = datasets.get_dataset({"name": "folder:toy", "dir": str(tmp_path / "data")}
                                ).source("train")
  cfg = {"image_size": 8, "train_augment": "squish"}
  # Eval reads every record once: the unreadable ones are masked and counted.
  batches = list(pipeline.eval_iterator(source, cfg, global_batch_size=8, process_index=0,
                                        process_count=1))
  assert sum(int(b["_skipped"]) for b in batches) == len(bad)
  assert sum(float(b["mask"].sum()) for b in batches) == len(source) - len(bad)
  assert sorted(set(range(len(source))) - {int(i) for b in batches for i in b["index"]
                                           if i >= 0}) == bad
  # Training goes on over more than one epoch, counting each unreadable record it meets.
  it = pipeline.train_iterator(source, cfg, global_batch_size=8, seed=0, process_index=0,
                               process_count=1)
  skipped = sum(int(next(it)["_skipped"]) for _ in range(12))  # 96 records: 2+ epochs.
  assert skipped >= 2 * len(bad)


@pytest.mark.beam
def test_a_shard_unreadable_as_a_whole_is_named(folder_dataset, tmp_path):
  import shutil  # pylint: disable=import-outside-toplevel
  from input_pipeline import datasets  # pylint: disable=import-outside-toplevel
  from input_pipeline import decoding  # pylint: disable=import-outside-toplevel
  from input_pipeline import pipeline  # pylint: disable=import-outside-toplevel
  _, out, _ = folder_dataset
  shutil.copytree(out, tmp_path / "data")
  shard = _shard(tmp_path / "data")
  data = shard.read_bytes()
  shard.write_bytes(data[:len(data) - 200])  # Its footer (the record index) is gone.
  source = datasets.get_dataset({"name": "folder:toy", "dir": str(tmp_path / "data")}
                                ).source("train")
  it = pipeline.train_iterator(source, {"image_size": 8, "train_augment": "squish"},
                               global_batch_size=8, seed=0,
                               process_index=0, process_count=1)
  with pytest.raises(decoding.UnreadableShardError, match=f"shard {shard} of split 'train'"):
    next(it)


# ------------------------------------------------------------------------------------------
# Faults are reported once, clearly, and when they happen.


def test_failed_async_save_is_reported_when_it_fails_and_not_counted(tmp_path, monkeypatch):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  def full_disk(self, *args, **kwargs):
    raise OSError(28, "No space left on device")

  saver = checkpoint.Checkpointer(str(tmp_path / "ckpt"), async_save=True)
  saver.save(1, _state(head_classes=3))
  saver.wait()
  # Inside the save's background thread, where a write hitting a full disk fails.
  monkeypatch.setattr(ocp.CheckpointManager, "_finalize_checkpoint", full_disk)
  saver.save(2, _state(head_classes=3))
  deadline = time.time() + 60
  with pytest.raises(checkpoint.CheckpointSaveError) as failure:
    while time.time() < deadline:  # What the trainer does after every step.
      saver.check()
      time.sleep(0.01)
  message = str(failure.value)
  assert message.startswith("saving checkpoint step 2 ") and "No space left on device" in message
  assert "(latest: 1)" in message
  monkeypatch.undo()
  assert saver.manager.all_steps() == [1]  # Step 2 is not counted as saved...
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["1"]  # ...nor its partial folder kept.
  # The next save, before any check: the error is the failed save's, not the new one's.
  monkeypatch.setattr(ocp.CheckpointManager, "_finalize_checkpoint", full_disk)
  saver.save(3, _state(head_classes=3))
  with pytest.raises(checkpoint.CheckpointSaveError, match="^saving checkpoint step 3 "):
    saver.save(4, _state(head_classes=3))
  monkeypatch.undo()
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["1"]
  saver.close()


@pytest.mark.slow
def test_full_disk_in_the_data_iterator_save_is_one_error_line(tmp_path):
  # grain's iterator state is written synchronously inside the save; make it hit ENOSPC.
  code = (
      "import sys\n"
      "from grain._src.python.checkpoint import handler\n"
      "def full(*a, **k):\n"
      "  raise OSError(28, 'No space left on device')\n"
      "handler.CheckpointHandler.save = full\n"
      "from absl import app\n"
      "from bigpretrain import main\n"
      "from bigpretrain.tools import cli\n"
      "app.run(main.main, argv=['main'] + sys.argv[1:], flags_parser=cli.parse_flags)\n")
  r = subprocess.run(
      [sys.executable, "-c", code] + helpers.main_args(tmp_path, total_steps=50,
                                                        ckpt_every_steps=3),
      env=helpers.env(), cwd=helpers.ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 1
  lines = r.stderr.strip().splitlines()
  assert lines[-1].startswith("ERROR: saving checkpoint step 3 ") and (
      "OSError: [Errno 28] No space left on device" in lines[-1]), r.stderr[-3000:]
  assert "Traceback" not in r.stderr, r.stderr[-3000:]
  assert max(row["step"] for row in metric_writers.read_metrics(str(tmp_path))) == 3  # Stopped there.
  assert not [p for p in os.listdir(tmp_path / "checkpoints") if p.isdigit()]


def test_unknown_config_key_prints_only_the_suggestion(tmp_path):
  r = helpers.run_main(helpers.main_args(tmp_path) + ["--config.batchsize=3"], timeout=120)
  assert r.returncode == 2
  assert r.stderr.strip() == ('ERROR: unknown config key --config.batchsize. '
                              'Did you mean "batch_size" instead of "batchsize"?')
  assert os.listdir(tmp_path) == []  # Refused before training: nothing written.


def test_a_config_file_that_does_not_load_is_one_error_line(tmp_path):
  # ml_collections defers a missing file's error to the config's first use (inside the run)
  # and puts get_config's traceback in its flag error: both are one line, before any run.
  missing = tmp_path / "nonexistent.py"
  for override in ([], ["--config.batch_size=8"]):  # Applied to the failed load, it raises.
    r = helpers.run_main([f"--config={missing}", f"--workdir={tmp_path / 'run'}"] + override,
                         timeout=120)
    assert (r.returncode, r.stderr.strip()) == (
        2, f"ERROR: --config={missing}: [Errno 2] No such file or directory: '{missing}'")
  recipe = helpers.ROOT / "configs" / "semantic_softmax.py"
  r = helpers.run_main([f"--config={recipe}:bogus=1", f"--workdir={tmp_path / 'run'}"],
                       timeout=120)
  assert r.returncode == 2 and r.stderr.strip() == (
      f"ERROR: --config={recipe}:bogus=1: ValueError: config arg 'bogus' is unknown; valid "
      "keys: ['data_dir', 'dataset', 'epochs', 'init', 'model']"), r.stderr[-2000:]
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("source, override, message", [
    ("def get_config(:\n  pass\n", False, r"cfg\.py:1: SyntaxError: invalid syntax"),
    ("import nosuchmod\n", False,
     r"cfg\.py:1: ModuleNotFoundError: No module named 'nosuchmod'"),
    ("import nosuchmod\n", True,
     r"cfg\.py:1: ModuleNotFoundError: No module named 'nosuchmod'"),
    ("X = 1\n", False, r"--config=\S+cfg\.py: the file defines no get_config\(\)"),
])
def test_a_config_file_that_fails_to_load_is_one_line_with_or_without_overrides(
    tmp_path, capsys, source, override, message):
  """Its import error with the file's line, or a missing get_config: one ERROR line, exit 2."""
  from bigpretrain import main  # pylint: disable=import-outside-toplevel,unused-import
  from bigpretrain.tools import cli  # pylint: disable=import-outside-toplevel
  path = tmp_path / "cfg.py"
  if source is not None:
    path.write_text(source)
  argv = ["main", f"--config={path}", f"--workdir={tmp_path / 'run'}"] + (
      ["--config.batch_size=8"] if override else [])
  with pytest.raises(SystemExit) as stop:
    cli.parse_flags(argv)
  err = capsys.readouterr().err.strip()
  assert stop.value.code == 2 and len(err.splitlines()) == 1, err
  assert re.fullmatch(r"ERROR: \S*" + message + ".*", err), err


@pytest.mark.parametrize("key, value, message", [
    ("data.eval_resize", "bogus", "data.eval_resize='bogus'"),
    ("data.train_augment", "flip|nonsense", "nonsense"),
    ("data.num_workers", -1, "data.num_workers must be an int >= 0"),
    ("data.mix", "no_weight", "no_weight"),
])
def test_data_settings_are_validated_with_the_other_keys(key, value, message):
  from bigpretrain import config_lib  # pylint: disable=import-outside-toplevel
  config = helpers.tiny_config(**{key: value})
  with pytest.raises(ValueError, match=message.replace("|", r"\|")):
    config_lib.validate(config)  # Before any dataset is opened (train.build_model's first step).


_FALLBACK = """
import sys
from absl import app, logging
import jax.numpy as jnp
from bigpretrain import checkpoint, train
from tests import helpers, test_reliability

def main(argv):  # Logging set up as bigpretrain.main sets it up.
  logging.get_absl_handler().use_absl_log_file("log", argv[1])
  config = helpers.tiny_config()
  config.model = {"name": "regnety_demo"}
  exp = train.build(config)
  state = exp.init_state()
  saver = checkpoint.Checkpointer(argv[1] + "/ckpt", async_save=False)
  for step in (1, 2):
    saver.save(step, {**state, "step": jnp.asarray(step, jnp.int32)})
  saver.close()
  test_reliability._truncate_arrays(argv[1] + "/ckpt/2")
  print("RESTORE", flush=True)
  print("RESTORE", file=sys.stderr, flush=True)
  reader = checkpoint.Checkpointer(argv[1] + "/ckpt", async_save=False)
  restored, step = reader.restore(exp.init_state())
  reader.close()
  print("RESTORED", step, int(restored["step"]), flush=True)

app.run(main)
"""


@pytest.mark.slow
def test_corrupt_checkpoint_of_the_default_model_gives_one_warning_line(tmp_path):
  # The recipe's own model (regnety_demo, many arrays): Orbax fails each array's read, and
  # asyncio reports the failed tasks, up to the process's exit.
  r = subprocess.run([sys.executable, "-c", _FALLBACK, str(tmp_path)], env=helpers.env(),
                     cwd=helpers.ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "RESTORED 1 1" in r.stdout
  after = (r.stdout.split("RESTORE\n", 1)[1] + r.stderr.split("RESTORE\n", 1)[1]
           ).strip().splitlines()
  after = [l for l in after if not l.startswith("RESTORED")]
  assert len(after) == 1 and after[0].startswith("WARNING: checkpoint step 2 "), after[:30]
  assert "is unreadable" in after[0]
