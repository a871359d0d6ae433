"""configs/semi_supervised.py against Yalniz et al. 2019: the standard ImageNet recipe of the
teacher and baseline, deduplication as a runner stage (supplement section 5), the semi-weakly
supervised variant (section 4.4), and the `step` schedule's decay_at. Config and file checks
only (the dedup search itself: test_dedup.py)."""
import math

import numpy as np
import pyarrow.parquet as pq
import pytest

from bigpretrain import config_lib
from bigpretrain.semisup import dedup
from bigpretrain import optim
from bigpretrain.semisup import semi_supervised
from configs import semi_supervised as recipe
from input_pipeline import datasets
from input_pipeline import exclusions
from input_pipeline import selection_formats

IN1K = 1_281_167


def _lr(section, total):
  return optim.make_schedule(section.optim.schedule, lr=section.optim.lr, total_steps=total)


def test_paper_batchnorm_is_per_24_images_in_every_convnet_stage():
  """Section 4.1: BatchNorm on each GPU's 24 images; SWAG keeps synchronised BN."""
  paper = recipe.get_config("scale=paper")
  for stage in ("teacher", "student", "finetune", "baseline"):
    assert paper[stage].model.bn_group_size == 24
    assert paper[stage].batch_size % 24 == 0
    config_lib.validate(paper[stage])
  vit_teacher = recipe.get_config("scale=paper,teacher=vit_b16")
  assert "bn_group_size" not in vit_teacher.teacher.model  # A ViT has no BatchNorm.
  assert vit_teacher.student.model.bn_group_size == 24
  assert "bn_group_size" not in recipe.get_config().student.model  # Demo: vit_demo.
  from configs import swag_regnety  # pylint: disable=import-outside-toplevel
  assert "bn_group_size" not in swag_regnety.get_config("dataset=hashtags:ig").model


@pytest.mark.parametrize("stage", ["teacher", "baseline"])
def test_paper_teacher_and_baseline_use_the_standard_imagenet_recipe(stage):
  c = recipe.get_config("scale=paper")[stage]
  optim.validate_optim_config(c.optim)
  total = config_lib.resolve_total_steps(c, IN1K)
  assert total == math.ceil(90 * IN1K / 1536)  # 90 epochs, not the student's 1B images.
  lr = _lr(c, total)
  warmup = round(5 * IN1K / 1536)
  assert float(lr(0)) == pytest.approx(0.1) and float(lr(warmup)) == pytest.approx(0.6)
  for epoch, value in ((30, 0.06), (60, 0.006), (80, 0.0006)):  # x0.1 at epochs 30, 60, 80.
    b = round(epoch / 90 * total)
    assert float(lr(b - 1)) == pytest.approx(value * 10, rel=1e-5), epoch
    assert float(lr(b)) == pytest.approx(value, rel=1e-5), epoch
  if stage == "baseline":
    assert c.model.name == "resnet50"


def test_long_baseline_is_the_student_recipe_for_pretraining_plus_finetuning_steps():
  c = recipe.get_config("scale=paper,baseline=long")
  assert c.baseline.total_steps == -1 and c.baseline.num_epochs == -1
  assert c.baseline.optim.schedule.to_dict() == c.student.optim.schedule.to_dict()
  assert recipe.get_config().baseline.total_steps == -1  # The demo keeps equal steps.
  with pytest.raises(ValueError, match="baseline="):
    recipe.get_config("baseline=short")


def test_dedup_is_on_at_paper_scale_against_the_validation_set():
  paper = recipe.get_config("scale=paper")
  assert paper.dedup.against == "tfds:imagenet2012:validation"
  assert paper.dedup.top_n == 5000 and paper.dedup.model == ""
  assert dedup.parse_sets(paper.dedup.against, "against") == [("tfds:imagenet2012",
                                                                "validation")]
  assert recipe.get_config().dedup.against == ""  # Off on the demo.
  assert recipe.get_config("dedup=demo:validation").dedup.against == "demo:validation"
  assert recipe.get_config("scale=paper,dedup=off").dedup.against == ""


def _predictions(folder, split, n, exist_ok=False):
  folder.mkdir(parents=True, exist_ok=exist_ok)
  index = np.arange(n)
  selection_formats.write_predictions(folder / "a.parquet", "demo", split, index,
                                      np.zeros((n, 1)), np.full((n, 1), 0.5))
  selection_formats.write_info(folder, class_names=["a", "b"], top_p=1, dataset="demo",
                               splits=[split], num_records=n)


def test_dedup_stage_removes_its_records_from_the_pool(tmp_path, monkeypatch):
  config = recipe.get_config("dedup=demo:validation")
  calls = []

  def fake_run(model, pool, against, out, **kw):  # The search is test_dedup.py's.
    calls.append((model, pool, against, kw["top_n"], kw["max_distance"]))
    exclusions.write(f"{out}/{dedup.EXCLUSIONS_FILE}",
                     [("demo", "unlabeled", 3), ("demo", "unlabeled", 7), ("other", "x", 1)])
    return {}

  monkeypatch.setattr(dedup, "run", fake_run)
  monkeypatch.setattr(semi_supervised, "model_identity", lambda workdir: f"id of {workdir}")
  removed = semi_supervised.dedup_stage(config, "/teacher", "unlabeled",
                                        tmp_path / "dedup" / "unlabeled")
  assert calls == [("/teacher", "demo:unlabeled", "demo:validation", 20, None)]
  np.testing.assert_array_equal(removed, [3, 7])

  preds = tmp_path / "preds"
  _predictions(preds, "unlabeled", 10)
  semi_supervised.pool_stage({"unlabeled": preds}, {"unlabeled": removed}, ["a", "b"],
                             tmp_path / "pool")
  kept = pq.read_table(tmp_path / "pool" / "a.parquet").column("index").to_numpy()
  np.testing.assert_array_equal(kept, [0, 1, 2, 4, 5, 6, 8, 9])
  # The same exclusions: reused; others (dedup switched off): refused, not silently reused.
  semi_supervised.pool_stage({"unlabeled": preds}, {"unlabeled": removed}, ["a", "b"],
                             tmp_path / "pool")
  with pytest.raises(ValueError, match="other exclusions"):
    semi_supervised.pool_stage({"unlabeled": preds}, {}, ["a", "b"], tmp_path / "pool")
  # Predictions made again (another teacher): the pool built from the old ones is refused.
  _predictions(preds, "unlabeled", 9, exist_ok=True)
  with pytest.raises(ValueError, match=r"\[pool\] .* built from another predictions than now"):
    semi_supervised.pool_stage({"unlabeled": preds}, {"unlabeled": removed}, ["a", "b"],
                               tmp_path / "pool")
  # The dedup folder records its model: another teacher is refused there too.
  with pytest.raises(ValueError, match=r"\[dedup unlabeled\] .* built from another model"):
    semi_supervised.dedup_stage(config, "/other", "unlabeled", tmp_path / "dedup" / "unlabeled")


def test_step_schedule_decay_at_is_checked():
  cfg = optim.optim_defaults()
  cfg.schedule.name = "step"
  cfg.schedule.decay_at = (0.5, 0.25)
  with pytest.raises(ValueError, match="decay_at"):
    optim.validate_optim_config(cfg)
  cfg.schedule.decay_at = (0.5, 1.0)
  with pytest.raises(ValueError, match="decay_at"):
    optim.validate_optim_config(cfg)
  cfg.schedule.decay_at = (0.05,)
  cfg.schedule.warmup_steps = 10
  optim.validate_optim_config(cfg)
  with pytest.raises(ValueError, match="inside the 10-step warm-up"):
    optim.make_schedule(cfg.schedule, lr=1.0, total_steps=100)


def test_resume_check_reads_decay_at_as_saved():
  """config.json stores the tuple as a list: the same decay_at is no schedule change."""
  import json  # pylint: disable=import-outside-toplevel
  c = recipe.get_config("scale=paper").teacher
  saved = json.loads(json.dumps(c.to_dict()))
  assert config_lib.schedule_changes(saved, c) == []
  c.optim.schedule.decay_at = (0.5,)
  assert config_lib.schedule_changes(saved, c) == [
      "optim.schedule.decay_at: [0.3333333333333333, 0.6666666666666666, 0.8888888888888888]"
      " -> (0.5,)"]


def test_semi_weak_variant_takes_section_4_4_values():
  """Section 4.4 / Table 6: a hashtag-pretrained teacher fine-tuned on ImageNet ranks the
  hashtag data itself, K = 64k; P, the student and its schedules stay section 4.1's."""
  plain = recipe.get_config("scale=paper")
  c = recipe.get_config("scale=paper,semi_weak,pool=hashtags:ig,data_dir=/data")
  assert (c.selection.k, c.infer.top_p) == (64_000, 10)
  assert (c.data.pool, c.data.pool_splits, c.data.pool_train_rest) == (
      "hashtags:ig", ("train",), False)
  assert c.student.to_dict() == plain.student.to_dict()
  assert c.finetune.to_dict() == plain.finetune.to_dict()
  pre = c.teacher_pretrain
  assert (pre.model.name, pre.data.name, pre.data.dir) == ("resnext101_32x48d", "hashtags:ig",
                                                          "/data")
  assert pre.objective.name == "soft_target" and c.teacher_pretrained == ""
  # The teacher: SWAG fine-tuning (SGD + Nesterov, no weight decay, Table 8's 6e-3 at batch
  # 512, 20,000 steps for a "large" set) of the pretraining's architecture.
  t = c.teacher
  assert t.model.to_dict() == pre.model.to_dict()
  assert (t.optim.name, t.optim.nesterov, t.optim.weight_decay) == ("sgd", True, 0.0)
  assert (t.batch_size, t.optim.lr, t.total_steps) == (512, pytest.approx(6e-3), 20_000)
  assert t.data.image_size == 224 and t.model_init == ""  # Set by the runner.
  for stage in (pre, t):
    config_lib.validate(stage)
  with pytest.raises(ValueError, match="semi_weak at paper scale needs pool="):
    recipe.get_config("scale=paper,semi_weak")
  demo = recipe.get_config("semi_weak")
  assert demo.data.pool == "hashtags:demo" and demo.selection.k == 100
  assert demo.teacher_pretrain.model.pre_logits and not demo.teacher.model.pre_logits
  assert recipe.get_config().data.pool == ""  # The plain recipe reads D's own dataset.


def test_a_pool_from_another_dataset_excludes_pool_train_rest():
  c = recipe.get_config("pool=hashtags:demo")
  assert (c.data.pool_splits, c.data.pool_train_rest) == (("train",), False)
  info = datasets.DatasetInfo(name="hashtags:demo", num_classes=3, class_names=[],
                              num_examples={"train": 9}, image_size=32, splits=("train",))
  assert semi_supervised.check_pool(c, info) == ["train"]
  c.data.pool_train_rest = True
  with pytest.raises(ValueError, match="pool_train_rest is set and the pool is another"):
    semi_supervised.check_pool(c, info)


@pytest.mark.parametrize("args", ["", "scale=paper", "semi_weak",
                                  "scale=paper,semi_weak,pool=hashtags:ig"])
def test_a_misspelt_key_of_the_runners_sections_is_refused(args):
  """The runner's own sections are read by key: a typo in a config file would be ignored
  (the command line refuses it), so it is named with its close match; the recipe passes."""
  c = recipe.get_config(args)
  semi_supervised.check_keys(c)
  c.dedup.againts = "tfds:imagenet2012:validation"
  with pytest.raises(ValueError, match=r"config\.dedup\.againts is not a known key \(did you "
                     r"mean 'against'\?\)"):
    semi_supervised.check_keys(c)
  del c.dedup["againts"]
  c.data.pool_split = ("train",)
  with pytest.raises(ValueError, match=r"config\.data\.pool_split is not a known key \(did "
                     r"you mean 'pool_splits'\?\)"):
    semi_supervised.check_keys(c)
  del c.data["pool_split"]
  c.round = 2
  with pytest.raises(ValueError, match=r"config\.round is not a known key \(did you mean "
                     r"'rounds'\?\)"):
    semi_supervised.check_keys(c)
