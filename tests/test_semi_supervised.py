"""The semi-supervised recipe: its schedules, the labelled draw, and the stage runner end to end
(with a SIGTERM in the middle of the student and a second self-training round)."""
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from bigpretrain import checkpoint
from bigpretrain import config_lib
from bigpretrain.semisup import pool_predictions
from bigpretrain import optim
from bigpretrain.runtime import preemption
from bigpretrain.semisup import semi_supervised
from bigpretrain import train
from configs import semi_supervised as recipe
from input_pipeline import datasets
from input_pipeline import selection_formats
from input_pipeline import subset
from tests import helpers

pytestmark = pytest.mark.slow  # end-to-end recipe runs


# ------------------------------------------------------------------------------------------
# Schedules (section 4.1).


def _lr(section, total: int):
  return optim.make_schedule(section.optim.schedule, lr=section.optim.lr, total_steps=total)


def test_paper_pretraining_schedule_halves_13_times():
  c = recipe.get_config("scale=paper")
  s = c.student
  assert (s.batch_size, s.optim.name, s.optim.momentum, s.optim.weight_decay) == (
      1536, "sgd", 0.9, 1e-4)
  assert s.optim.lr == pytest.approx(0.1 * 1536 / 256)  # 0.6.
  total = config_lib.resolve_total_steps(s)
  assert total == math.ceil(1e9 / 1536) == 651_042  # 1B processed images.
  warmup = round(5 * 1_281_167 / 1536)  # 5 ImageNet epochs (Goyal et al.).
  lr = _lr(s, total)
  assert float(lr(0)) == pytest.approx(0.1)  # Warm-up starts at the standard 0.1.
  assert float(lr(warmup)) == pytest.approx(0.6)
  rest = total - warmup
  bounds = [warmup + round(k * rest / 14) for k in range(1, 14)]  # 14 equal segments.
  for k, b in enumerate(bounds, 1):
    assert float(lr(b - 1)) == pytest.approx(0.6 * 0.5**(k - 1), rel=1e-5), k
    assert float(lr(b)) == pytest.approx(0.6 * 0.5**k, rel=1e-5), k
  assert float(lr(total)) == pytest.approx(0.6 / 2**13, rel=1e-5)
  # Equally spaced: segment lengths differ by at most the rounding.
  assert max(np.diff([warmup] + bounds + [total])) - min(np.diff([warmup] + bounds + [total])) <= 1


def test_paper_finetuning_schedule_three_tenfold_steps_over_30_epochs():
  f = recipe.get_config("scale=paper").finetune
  assert f.optim.lr == pytest.approx(0.00025 * 1536 / 256)
  total = config_lib.resolve_total_steps(f, 1_281_167)
  assert total == math.ceil(30 * 1_281_167 / 1536)
  lr = _lr(f, total)
  for k in range(4):
    start = round(k * total / 4)
    assert float(lr(start)) == pytest.approx(0.0015 * 0.1**k, rel=1e-5)
  assert float(lr(round(total / 4) - 1)) == pytest.approx(0.0015)


def test_paper_defaults_and_variants():
  c = recipe.get_config("scale=paper")
  assert (c.teacher.model.name, c.student.model.name) == ("resnext101_32x48d", "resnet50")
  assert (c.infer.top_p, c.selection.k, c.selection.variant) == (10, 16_000, "balanced_ranked")
  same = recipe.get_config("scale=paper,teacher=same,p=5,k=8000,variant=unbalanced_ranked")
  assert same.teacher.model.name == "resnet50"
  assert (same.infer.top_p, same.selection.k, same.selection.variant) == (
      5, 8000, "unbalanced_ranked")
  with pytest.raises(ValueError, match="scale"):
    recipe.get_config("scale=huge")


# ------------------------------------------------------------------------------------------
# The labelled draw (input_pipeline/subset.py, shared with SWAG fine-tuning).


def test_demo_labelled_draw_counts_and_determinism():
  full = datasets.get_dataset({"name": "demo"})
  cfg = {"name": "demo", "subset_frac": 0.1, "subset_seed": 7}
  d = datasets.train_sources(cfg, full)[0][0]
  labels = np.array([r["label"] for r in full.source("train").__getitems__(
      list(range(full.info.num_examples["train"])))])
  n = np.bincount(labels, minlength=full.info.num_classes)
  want = np.where(n > 0, np.maximum(np.floor(0.1 * n + 0.5), 1), 0)  # Per class, by hand.
  np.testing.assert_array_equal(np.bincount(labels[d.indices], minlength=len(n)), want)
  assert len(d) == want.sum() and np.all(np.diff(d.indices) > 0)
  again = datasets.train_sources(dict(cfg), datasets.get_dataset({"name": "demo"}))[0][0]
  np.testing.assert_array_equal(again.indices, d.indices)
  other = datasets.train_sources({**cfg, "subset_seed": 8}, full)[0][0]
  assert not np.array_equal(other.indices, d.indices)


def test_an_unreadable_record_is_left_out_of_the_draw():
  """As training skips a record it cannot read, the draw leaves it out (it stopped the run)."""
  from input_pipeline import decoding  # pylint: disable=import-outside-toplevel
  from input_pipeline import subset  # pylint: disable=import-outside-toplevel

  class Source:
    split = "train"

    def __len__(self):
      return 50

    def __getitem__(self, i):
      if i == 7:
        raise decoding.CorruptRecordError("record 7 of split 'train' cannot be read")
      return {"label": i % 5}

    def __getitems__(self, ids):
      return [self[i] for i in ids]  # Raises for record 7, as RecordSource does.

  got = subset.apply(Source(), {"subset_frac": 0.5, "subset_seed": 0}, "unreadable_test")
  labels = np.array([i % 5 for i in range(50)])
  readable = np.delete(np.arange(50), 7)
  want = readable[subset.per_class_draw(labels[readable], 0.5, 0)]
  np.testing.assert_array_equal(got.indices, want)
  assert 7 not in got.indices and len(got) == 25  # Class 2 keeps round(0.5 x 9) = 5.


# ------------------------------------------------------------------------------------------
# The stage runner on a tiny pool.


class _Strided:
  """'semisup_every:N': the demo with each split cut to N records spread over all classes."""

  def __init__(self, name, data_dir):
    self.demo = datasets.get_dataset({"name": "demo", "dir": data_dir})
    self.n = int(name.split(":")[1])
    sizes = {s: min(self.n, k) for s, k in self.demo.info.num_examples.items()}
    self.info = dataclasses.replace(self.demo.info, name=name, num_examples=sizes)

  def source(self, split):
    full = self.demo.source(split)
    step = len(full) // self.info.num_examples[split]
    return subset.SubsetSource(full, np.arange(self.info.num_examples[split]) * step)


datasets.register_source("semisup_every:", _Strided)


def _tiny_config(**overrides):
  c = recipe.get_config()
  c.data.name = "semisup_every:200"
  c.data.subset_frac = 0.5
  c.infer.batch_size, c.infer.shard_size = 16, 64
  c.selection.k = 3  # More than some classes can give: a shortfall, reported.
  for stage in (c.teacher, c.student, c.finetune, c.baseline):
    stage.batch_size = 16
    stage.total_steps = 6
    stage.log_every_steps = 1
    stage.ckpt_every_steps = 2
    stage.compilation_cache_dir = helpers.JAX_CACHE
    stage.optim = c.teacher.optim  # One train step to compile for every stage.
    stage.optim.schedule.warmup_steps = 1
    stage.evals.fewshot.shots = ()  # The demo's few-shot probe off, as helpers.tiny_config.
  c.baseline.total_steps = -1
  return helpers.set_overrides(c, overrides)


def _steps(folder) -> list[int]:
  rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
  return [r["step"] for r in rows if "train/loss" in r]


def _mtimes(folder) -> dict:
  return {str(p): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


def test_stages_end_to_end_with_sigterm_resume_and_a_second_round(tmp_path, monkeypatch,
                                                                      capsys):
  config = _tiny_config()
  real_train = train.train_and_evaluate

  def sigterm_student_at_step_3(cfg, workdir):
    if workdir.endswith("student"):
      calls = {"n": 0}

      def agreed(self, log_step):
        del log_step
        calls["n"] += 1
        if calls["n"] == 3:
          os.kill(os.getpid(), signal.SIGTERM)  # The trainer's own handler catches it.
        return self.requested

      monkeypatch.setattr(preemption.Preemption, "agreed", agreed)
    return real_train(cfg, workdir)

  monkeypatch.setattr(train, "train_and_evaluate", sigterm_student_at_step_3)
  with pytest.raises(semi_supervised.Interrupted, match="stopped at step 3 of 6"):
    semi_supervised.run(config, str(tmp_path))
  monkeypatch.undo()
  r1 = tmp_path / "round1"
  assert not (r1 / "student" / semi_supervised.DONE_FILE).exists()
  assert not (r1 / "finetune").exists()
  before = {d: _mtimes(r1 / d) for d in ("teacher", "predictions", "pool", "selection")}
  capsys.readouterr()

  results = semi_supervised.run(_tiny_config(), str(tmp_path))
  out = capsys.readouterr().out
  for stage in ("[teacher] done already", "[infer unlabeled] done already",
                "[infer train] done already", "[pool] done already",
                "[selection] done already"):
    assert stage in out, stage
  assert "Resuming from step 3" in out
  assert "shortfall" in out  # K = 3 is more than some classes' candidates.
  for d, times in before.items():
    assert _mtimes(r1 / d) == times, d  # Skipped stages wrote nothing.
  assert _steps(r1 / "student") == [1, 2, 3, 4, 5, 6]  # No step lost or repeated.
  assert checkpoint.read_meta(str(r1 / "finetune"))["class_names"] == (
      datasets.get_dataset({"name": "demo"}).info.class_names)

  # U: the unlabeled split and train without D's records.
  cfg = {"name": "semisup_every:200", "subset_frac": 0.5}
  d = datasets.train_sources(cfg, datasets.get_dataset(cfg))[0][0]
  rest = np.setdiff1d(np.arange(200), d.indices)
  pool = pa.concat_tables([pq.read_table(p) for p in sorted((r1 / "pool").glob("*.parquet"))])
  train_rows = pool.filter(pc.equal(pool.column("split"), "train"))
  np.testing.assert_array_equal(np.sort(train_rows.column("index").to_numpy()), rest)
  assert pool.num_rows == 200 + len(rest)
  info = json.loads((r1 / "pool" / selection_formats.INFO_FILE).read_text())
  assert info["num_records"] == pool.num_rows and info["splits"] == ["train", "unlabeled"]

  # The baseline ran as many steps as pretraining plus fine-tuning, on D alone.
  assert _steps(tmp_path / "baseline")[-1] == 12
  assert results["rounds"][0]["steps"] == 12
  saved = json.loads((tmp_path / semi_supervised.RESULTS_FILE).read_text())
  assert saved["baseline"]["eval/top1"] == pytest.approx(results["baseline"]["eval/top1"])
  for key in ("teacher", "baseline"):
    assert 0 <= results[key]["eval/top1"] <= 1

  # A second round: round 1 is skipped, the fine-tuned student is the new teacher.
  results = semi_supervised.run(_tiny_config(rounds=2), str(tmp_path))
  out = capsys.readouterr().out
  assert "[round 1 fine-tuning] done already" in out
  assert results["rounds"][1]["teacher"] == str(r1 / "finetune")
  params = json.loads((tmp_path / "round2" / "predictions" / "unlabeled" /
                       pool_predictions.PARAMS_FILE).read_text())
  assert params["workdir"] == str(r1 / "finetune")
  assert _steps(tmp_path / "round2" / "finetune")[-1] == 6
  with pytest.raises(ValueError, match=r"\[teacher\] .* another config \(keys \['total_steps'\]\)"):
    semi_supervised.run(_tiny_config(**{"teacher.total_steps": 7}), str(tmp_path))

  # A stage whose inputs changed is refused, never reused: another top_p for inference, a
  # student trained again (its marker differs) under a fine-tuning that read the old one.
  with pytest.raises(ValueError, match=r"\[infer unlabeled\] .*round1/predictions/unlabeled was "
                                       r"built from another infer than now"):
    semi_supervised.run(_tiny_config(**{"infer.top_p": 5}), str(tmp_path))
  with pytest.raises(ValueError, match=r"\[selection\] .*round1/selection was built from "
                                       r"another selection than now"):
    semi_supervised.run(_tiny_config(**{"selection.k": 4}), str(tmp_path))
  marker = r1 / "student" / semi_supervised.DONE_FILE
  done = json.loads(marker.read_text())
  done["results"]["eval/top1"] = -1.0
  marker.write_text(json.dumps(done))
  with pytest.raises(ValueError, match=r"\[round 1 fine-tuning\] .* built from another "
                                       r"model_init than now .* delete it and the folders"):
    semi_supervised.run(_tiny_config(rounds=2), str(tmp_path))


def test_bad_input_gets_clear_errors(tmp_path):
  with pytest.raises(ValueError, match=r"pool_splits names \['nope'\]"):
    semi_supervised.run(_tiny_config(**{"data.pool_splits": ("nope",)}), str(tmp_path))
  with pytest.raises(ValueError, match="pool_train_rest needs config.data.subset_frac"):
    semi_supervised.run(_tiny_config(**{"data.subset_frac": 1.0}), str(tmp_path / "b"))
  with pytest.raises(ValueError, match="balanced_with_tags draws by the images' tags"):
    semi_supervised.run(_tiny_config(**{"selection.variant": "balanced_with_tags"}),
                        str(tmp_path / "c"))
  from configs import single_label  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="The config is not the semi-supervised runner's: it has "
                                       "no teacher/student/finetune/infer/selection sections"):
    semi_supervised.run(single_label.get_config(), str(tmp_path / "d"))
  assert not list(tmp_path.rglob("round1"))  # Nothing ran.

  # Predictions of a teacher with another class list: refused before selection.
  names = datasets.get_dataset({"name": "demo"}).info.class_names
  preds = tmp_path / "preds"
  preds.mkdir()
  selection_formats.write_predictions(preds / "a.parquet", "demo", "unlabeled", [0, 1],
                                      [[0, 1], [1, 0]], [[0.6, 0.4], [0.7, 0.3]])
  other = list(reversed(names))
  selection_formats.write_info(preds, class_names=other, top_p=2, dataset="demo",
                               splits=["unlabeled"], num_records=2)
  with pytest.raises(ValueError, match="another class list"):
    semi_supervised.pool_stage({"unlabeled": preds}, {}, names, tmp_path / "pool")
  with pytest.raises(ValueError, match="another class list"):
    semi_supervised.selection_stage(_tiny_config(), preds, names, tmp_path / "sel")
  (tmp_path / "sizes.json").write_text("{n01: 3}")
  with pytest.raises(ValueError, match=r"config.selection.class_sizes=\S+sizes.json is not "
                                       r"valid JSON"):
    semi_supervised.selection_stage(
        _tiny_config(**{"selection.variant": "unbalanced_ranked", "selection.k": None,
                        "selection.class_sizes": str(tmp_path / "sizes.json")}),
        preds, names, tmp_path / "sel2")


@pytest.mark.beam
def test_a_pool_rebuilt_with_other_exclusions_is_not_read_through_the_old_selection(tmp_path):
  names = datasets.get_dataset({"name": "demo"}).info.class_names
  preds = tmp_path / "preds"
  preds.mkdir()
  selection_formats.write_predictions(preds / "a.parquet", "demo", "unlabeled", [0, 1, 2, 3],
                                      [[0, 1], [1, 0], [0, 2], [2, 1]],
                                      [[0.6, 0.4], [0.7, 0.3], [0.8, 0.2], [0.9, 0.1]])
  selection_formats.write_info(preds, class_names=names, top_p=2, dataset="demo",
                               splits=["unlabeled"], num_records=4)
  pool, sel = tmp_path / "pool", tmp_path / "sel"
  semi_supervised.pool_stage({"unlabeled": preds}, {"unlabeled": np.array([0])}, names, pool)
  semi_supervised.selection_stage(_tiny_config(), pool, names, sel)
  # The pool deleted and built again without another record: the same size, other images.
  shutil.rmtree(pool)
  semi_supervised.pool_stage({"unlabeled": preds}, {"unlabeled": np.array([3])}, names, pool)
  with pytest.raises(ValueError, match=r"\[selection\] .*sel was built from another "
                                       r"pool_excluded than now"):
    semi_supervised.selection_stage(_tiny_config(), pool, names, sel)


# ------------------------------------------------------------------------------------------
# Inference on two processes.


def _teacher(folder) -> str:
  """A random-weight demo teacher checkpoint (inference needs no training)."""
  return helpers.random_checkpoint(folder, noise=0.3)


def _table(folder) -> pa.Table:
  return pa.concat_tables([pq.read_table(p) for p in sorted(folder.glob("*.parquet"))])


@pytest.mark.multiprocess
def test_inference_on_two_processes_matches_one(tmp_path):
  teacher = _teacher(tmp_path / "teacher")
  args = [f"--workdir={teacher}", "--data=demo", "--split=validation", "--top_p=3",
          "--batch_size=250", "--shard_size=1000"]
  env = helpers.env(2)
  one = subprocess.run([sys.executable, "-m", "bigpretrain.tools.infer"] + args +
                       [f"--out={tmp_path / 'one'}"], env=env, cwd=helpers.ROOT,
                       capture_output=True, text=True, timeout=600)
  assert one.returncode == 0, one.stderr[-3000:]
  env["XLA_FLAGS"] = helpers.TEST_XLA_FLAGS  # local.sh adds the device count.
  env["PYTHON"] = sys.executable
  cmd = [str(helpers.ROOT / "launch" / "local.sh"), "2", "--devices_per_process=1",
         "--module=bigpretrain.tools.infer", "--"] + args + [f"--out={tmp_path / 'two'}"]
  two = subprocess.run(cmd, env=env, cwd=helpers.ROOT, capture_output=True, text=True,
                       timeout=600)
  assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
  a, b = _table(tmp_path / "one"), _table(tmp_path / "two")
  assert a.num_rows == b.num_rows == 2500
  np.testing.assert_array_equal(a.column("index").to_numpy(), np.arange(2500))
  np.testing.assert_array_equal(b.column("index").to_numpy(), np.arange(2500))
  np.testing.assert_array_equal(np.stack(a.column("classes").to_numpy(zero_copy_only=False)),
                                np.stack(b.column("classes").to_numpy(zero_copy_only=False)))
  np.testing.assert_allclose(np.stack(a.column("scores").to_numpy(zero_copy_only=False)),
                             np.stack(b.column("scores").to_numpy(zero_copy_only=False)),
                             rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------
# The semi-weakly supervised variant (section 4.4): a hashtag-pretrained teacher, the pool
# from another dataset.


class _LabelRead(Exception):
  """A pool label was read."""


class _ImageOnly(dict):
  """A pool record whose fields other than 'image' raise when read."""

  def __getitem__(self, key):
    if key != "image" and key in self:
      raise _LabelRead(key)
    return super().__getitem__(key)

  def get(self, key, default=None):
    return self[key] if key in self else default

  def items(self):
    raise _LabelRead("items")

  def values(self):
    raise _LabelRead("values")


class _Unlabelled:
  """'semiweak_pool:N': N demo 'unlabeled' images in a 5-class list of its own; reading any
  record field but 'image' raises."""

  def __init__(self, name, data_dir):
    self.demo = datasets.get_dataset({"name": "demo", "dir": data_dir})
    n = int(name.split(":")[1])
    self.info = datasets.DatasetInfo(name=name, num_classes=5,
                                     class_names=[f"tag{i}" for i in range(5)],
                                     num_examples={"train": n}, image_size=32,
                                     splits=("train",), features={"label": 0})

  def source(self, split):
    assert split == "train"
    demo, n = self.demo.source("unlabeled"), self.info.num_examples["train"]

    class Source(datasets.Source):
      def __len__(self):
        return n

      def __getitem__(self, i):
        record = demo[i]
        return _ImageOnly(image=record["image"], label=record["label"], hashtags=["x"])

    return Source()


datasets.register_source("semiweak_pool:", _Unlabelled)


def test_semi_weak_teacher_from_hashtags_and_a_pool_whose_labels_are_never_read(tmp_path):
  c = recipe.get_config("semi_weak")  # Its teacher pretraining on hashtags:demo.
  c.data.pool = "semiweak_pool:48"
  c.data.name = "semisup_every:200"
  c.data.subset_frac = 0.5
  c.run_baseline = False
  c.infer.batch_size, c.infer.shard_size = 16, 64
  c.selection.k = 3
  for stage in (c.teacher_pretrain, c.teacher, c.student, c.finetune):
    helpers.set_overrides(stage, {"batch_size": 16, "total_steps": 2, "log_every_steps": 1,
                                  "ckpt_every_steps": 2, "eval_every_steps": 0,
                                  "compilation_cache_dir": helpers.JAX_CACHE})
    if "fewshot" in stage.evals:
      stage.evals.fewshot.shots = ()
  # The teacher trains as the student does: one train step to compile for three stages.
  c.student.optim.schedule.warmup_steps = 1
  c.teacher.optim, c.teacher.mixup, c.teacher.ema = c.student.optim, c.student.mixup, c.student.ema
  results = semi_supervised.run(c, str(tmp_path))

  r1 = tmp_path / "round1"
  teacher = json.loads((r1 / "teacher" / semi_supervised.DONE_FILE).read_text())
  assert teacher["config"]["model_init"] == str(r1 / "teacher_pretrain")
  assert checkpoint.read_meta(str(r1 / "teacher_pretrain"))["dataset"] == "hashtags:demo"
  assert checkpoint.read_meta(str(r1 / "teacher"))["class_names"] == (
      datasets.get_dataset({"name": "demo"}).info.class_names)
  assert "teacher_pretrain" in results and "teacher" in results
  # U: the whole pool, scored in the teacher's classes; D-hat its images, the teacher's labels.
  pool = _table(r1 / "pool")
  assert pool.num_rows == 48 and set(pool.column("dataset").to_pylist()) == {"semiweak_pool:48"}
  selected = datasets.get_dataset({"name": f"selection:{r1 / 'selection'}"})
  assert selected.info.splits == ("train",) and selected.info.num_classes == 100
  record = selected.source("train")[0]
  assert sorted(record) == ["image", "label"]
  # The student is evaluated on the labelled dataset's validation split.
  assert results["rounds"][0]["student"]["eval/num_examples"] == 200
  assert _steps(r1 / "finetune") == [1, 2]


@pytest.mark.parametrize("overrides, message", [
    ({"selection.k": 0}, r"config\.selection: k=0: K images per class must be an integer >= 1"),
    ({"infer.top_p": 0}, r"config\.infer\.top_p=0 must be an integer in \[1, 100\]"),
    ({"selection.variant": "unbalanced_ranked"},
     r"config\.selection: unbalanced_ranked takes exactly one of --class_sizes"),
    ({"infer.batch_size": 12}, r"config\.infer\.batch_size=12 is not divisible by the 8 "),
    ({"infer.shard_size": 0}, r"config\.infer\.shard_size=0 must be a positive integer"),
    ({"dedup.against": "demo:validation", "dedup.fsdp": 3},
     r"config\.dedup\.fsdp=3 must be a positive divisor of the 8 devices"),
])
def test_inference_and_selection_settings_are_refused_before_the_teacher_trains(
    tmp_path, monkeypatch, overrides, message):
  monkeypatch.setattr(semi_supervised, "train_stage",
                      lambda *a, **k: pytest.fail("a stage trained before the refusal"))
  with pytest.raises(ValueError, match=message):
    semi_supervised.run(_tiny_config(**overrides), str(tmp_path))
