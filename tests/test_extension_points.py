"""Extension points: the objective/batch contract, evaluators, data sources and samplers
plug in without editing the trainer; checkpoints describe their model."""
import pathlib
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from bigpretrain import checkpoint
from bigpretrain import config_lib
from bigpretrain import evaluators
from bigpretrain import losses
from bigpretrain.runtime import metric_writers
from bigpretrain import mixup
from bigpretrain import models
from bigpretrain import objectives
from bigpretrain import preprocess
from bigpretrain import sharding
from bigpretrain import train
from bigpretrain.evaluators import base as evaluator_base
from bigpretrain.evaluators import classification
from bigpretrain.objectives import base as objective_base
from input_pipeline import datasets
from input_pipeline.sources import demo
from input_pipeline import pipeline
from tests import helpers

ROOT = pathlib.Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------- a toy plugin of each kind

_COLOURS = ((230, 30, 30), (30, 230, 30), (30, 30, 230), (230, 230, 30))


class _ToySource(datasets.Source):
  """Record i: an 8x8 image of colour i % 4, its label, and tags [c, c + 1 mod 4]."""

  def __init__(self, n: int, sampled: bool):
    self._n = n
    self._sampled = sampled

  def __len__(self):
    return self._n

  def __getitem__(self, i):
    c = i % 4
    image = np.broadcast_to(np.array(_COLOURS[c], np.uint8), (8, 8, 3))
    return {"image": demo.png_bytes(np.ascontiguousarray(image)), "label": c,
            "tags": [c, (c + 1) % 4], "note": f"record {i}"}

  def index_sampler(self, seed, process_index, process_count):
    return _Stride(seed, process_index, process_count) if self._sampled else None


class _Stride:
  """Host p's j-th record: (seed + 3 * (j * P + p)) mod 32 — a pure function of (seed, j)."""

  def __init__(self, seed, p, count):
    self.seed, self.p, self.count = seed, p, count

  def __getitem__(self, j):
    return (self.seed + 3 * (j * self.count + self.p)) % 32


class _ToyDataset(datasets.Dataset):
  def __init__(self, name: str, data_dir: str):
    del data_dir
    self.info = datasets.DatasetInfo(
        name=name, num_classes=4, class_names=["red", "green", "blue", "yellow"],
        num_examples={"train": 32, "validation": 8}, image_size=8,
        splits=("train", "validation"), features={"label": 0, "tags": 3, "note": None})
    self._sampled = name == "toy:sampled"

  def source(self, split):
    return _ToySource(self.info.num_examples[split], self._sampled and split == "train")


class _ToyTags(objective_base.Objective):
  """Soft-target CE against 1/K on each of an image's tags (a padded id list)."""
  reads = ("tags",)
  soft_targets = True

  def __init__(self, cfg, info):
    objective_base.check_keys(cfg, set())
    self.num_classes = info.num_classes

  def dense_targets(self, batch):
    return jnp.sum(jax.nn.one_hot(batch["tags"], self.num_classes), axis=1)

  def loss(self, model, batch, rng, frozen=None):
    logits = model(batch["image"], train=True, rng=rng)
    targets = batch.get("targets", self.dense_targets(batch))
    return losses.soft_target_cross_entropy(logits, targets), {}

  def eval_metrics(self, model, batch, topk):
    logits = model(batch["image"], train=False)
    mask = objective_base.eval_mask(batch, logits.shape[0])
    top = jnp.argmax(logits, axis=-1)
    hit = jnp.any(batch["tags"] == top[:, None], axis=-1)
    return {"tag_precision_at_1": (jnp.sum(hit * mask), jnp.sum(mask)),
            "tags_per_image": (jnp.sum(batch["num_tags"] * mask), jnp.sum(mask))}


class _ToyCount(evaluator_base.Evaluator):
  """Counts the examples of its split and sums their labels."""
  KEYS = ("scale",)

  def __init__(self, name, cfg, exp):
    super().__init__(name, cfg, exp)
    self.exp = exp
    self.scale = cfg.get("scale", 1.0)
    self.step = jax.jit(lambda p, e, b: {"n": (jnp.sum(b["mask"]), 1.0),
                                         "label_sum": (jnp.sum(b["label"] * b["mask"]), 1.0)})

  def run(self, state):
    totals, _, _ = classification.evaluate(
        self.step, state, self.dataset, self.exp.config.data, self.exp.mesh, split=self.split,
        batch_size=self.exp.config.batch_size, fields={"label": 0})
    return {f"{self.name}/{k}": self.scale * v for k, v in classification.ratios(totals).items()}


datasets.register_source("toy:", _ToyDataset)
objectives.register("toy_tags", _ToyTags)
evaluators.register("toy_count", _ToyCount)


def _toy_config(**overrides):
  config = config_lib.base_config()
  config.data = pipeline.data_defaults()
  config.data.name = "toy:plain"
  config.data.image_size = 8
  config.model = dict(name="vit_demo")
  config.objective = dict(name="toy_tags")
  config.batch_size = 8
  config.total_steps = 4
  config.log_every_steps = 1
  config.eval_every_steps = 2
  config.ckpt_every_steps = 0
  config.compilation_cache_dir = helpers.JAX_CACHE
  config.evals = ml_collections.ConfigDict({
      "eval": dict(type="classification"),
      "counts": dict(type="toy_count", every_steps=4, scale=2.0)})
  return helpers.set_overrides(config, overrides)


def test_plugins_train_and_evaluate_without_touching_the_trainer(tmp_path):
  results = train.train_and_evaluate(_toy_config(), str(tmp_path))
  rows = metric_writers.read_metrics(str(tmp_path))
  assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4]
  assert all(np.isfinite(r["train/loss"]) for r in rows if "train/loss" in r)
  # Each evaluator on its own period, under its own name.
  assert [r["step"] for r in rows if "eval/tag_precision_at_1" in r] == [2, 4]
  assert [r["step"] for r in rows if "counts/n" in r] == [4]
  # The toy evaluator saw the 8 validation records (labels 0..3 twice): x2 by its setting.
  assert results["counts/n"] == 16.0 and results["counts/label_sum"] == 2.0 * 12
  # The padded id lists arrived with their lengths: every toy image has 2 tags.
  assert results["eval/tags_per_image"] == 2.0


def test_pipeline_ships_only_the_declared_fields():
  exp = train.build(_toy_config())
  batch = next(train.make_train_iterator(exp))
  assert set(batch) == {"image", "tags", "num_tags", "_skipped"}
  assert batch["tags"].shape == (8, 3) and batch["tags"].dtype == np.int32
  np.testing.assert_array_equal(batch["num_tags"], 2)
  np.testing.assert_array_equal(batch["tags"][:, 2], -1)  # Padding.
  # The demo's single-label recipes get 'label' only ('true_label', 'hashtags' stay home).
  demo_exp = train.build(helpers.tiny_config("single_label"))
  assert set(next(train.make_train_iterator(demo_exp))) == {"image", "label", "_skipped"}


def test_a_source_with_its_own_sampler_is_read_in_the_samplers_order():
  exp = train.build(_toy_config(**{"data.name": "toy:sampled", "seed": 5}))
  it = train.make_train_iterator(exp)
  sampler = _Stride(5, 0, 1)
  for _ in range(3):  # Into the second pass over the 32 records.
    got = next(it)
  want = [sampler[j] % 4 for j in range(16, 24)]
  np.testing.assert_array_equal(got["tags"][:, 0], want)
  # Deterministic by seed and position: resuming from the state gives the same batches.
  state = it.get_state()
  after = [next(it)["tags"] for _ in range(2)]
  fresh = train.make_train_iterator(exp)
  fresh.set_state(state)
  for want_batch in after:
    np.testing.assert_array_equal(next(fresh)["tags"], want_batch)


def test_an_objective_reading_a_missing_field_is_refused_before_compiling():
  config = _toy_config(**{"data.name": "demo", "data.image_size": 32})
  with pytest.raises(ValueError, match=r"reads batch fields \['tags'\] that dataset 'demo'"):
    train.build(config)


def test_unknown_evaluator_type_and_keys_are_clear_errors(tmp_path):
  config = _toy_config()
  config.evals.counts.type = "nope"
  with pytest.raises(ValueError, match=r"config.evals.counts.type='nope' is not a known "
                     r"evaluator type\. Known: .*toy_count"):
    train.train_and_evaluate(config, str(tmp_path))
  config = _toy_config()
  config.evals.counts.scael = 1.0
  with pytest.raises(ValueError, match=r"evals.counts has unknown keys \['scael'\]"):
    train.train_and_evaluate(config, str(tmp_path))


def test_unknown_dataset_names_list_the_registered_sources():
  with pytest.raises(ValueError, match=r"config.data.name='nope:x' is not a known dataset.*toy:"):
    datasets.get_dataset({"name": "nope:x", "dir": ""})


def test_trainer_names_no_recipe_objective_evaluator_or_dataset():
  code = "\n".join(line.split("#")[0] for line in
                   (ROOT / "bigpretrain" / "train.py").read_text().splitlines())
  words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code))
  names = (objectives.names() + evaluators.names() + datasets.SOURCES.keys()
           + models.list_models() + ["semantic", "cosub", "swag", "hashtag", "teacher",
                                     "student", "imagenet", "demo", "label"])
  for name in names:
    name = name.rstrip(":/")
    assert name not in words, f"bigpretrain/train.py names {name!r}"


# ---------------------------------------------------------------- mixup and soft targets


@pytest.mark.parametrize("recipe", ["semantic_softmax", "semantic_kd"])
def test_objectives_without_soft_targets_reject_mixup(recipe, tmp_path):
  overrides = {"mixup.mixup_alpha": 0.8}
  if recipe == "semantic_kd":  # The check comes before the teacher is read.
    overrides["objective.teacher_checkpoint"] = str(tmp_path)
  config = helpers.tiny_config(recipe, **overrides)
  with pytest.raises(ValueError, match="does not take soft targets"):
    train.build(config)


def test_objective_label_smoothing_with_mixup_is_refused():
  config = helpers.tiny_config("single_label", **{"mixup.cutmix_alpha": 1.0,
                                                  "objective.label_smoothing": 0.1})
  with pytest.raises(ValueError, match="set that instead"):
    train.build(config)


def _first_step(config):
  """(metrics of step 1, the exp, the batch, the state before the step)."""
  exp = train.build(config)
  state = exp.init_state()
  before = jax.device_get(state)
  batch = next(train.make_train_iterator(exp))
  batch.pop("_skipped")
  _, m = exp.train_step()(state, sharding.global_batch(batch, exp.mesh), exp.frozen)
  return jax.device_get(m), exp, batch, before


@pytest.mark.parametrize("recipe,copies", [("single_label", 1), ("multi_label", 1),
                                           ("single_label", 2)])
def test_mixup_trains_against_the_mixed_targets(recipe, copies):
  """The step's loss equals the loss recomputed outside on the mixed images and targets;
  with repeated augmentation each copy's block is mixed on its own."""
  overrides = {"mixup.mixup_alpha": 0.8, "model.head_zeroinit": False,  # Non-uniform logits.
               "data.repeated_augment": copies}
  if copies > 1:
    overrides["mixup.cutmix_alpha"] = 1.0
  if recipe == "single_label":
    overrides["objective.label_smoothing"] = 0.0
  config = helpers.tiny_config(recipe, **overrides)
  m, exp, batch, state = _first_step(config)
  assert train.mixup_layout(config, exp.mesh) == (copies, copies)  # One process.
  rng = jax.random.fold_in(jax.random.key(config.seed), 0)
  rng, mix_rng = jax.random.split(rng)
  images = preprocess.normalize(jnp.asarray(batch["image"]), config.data.normalize)
  hard = exp.objective.dense_targets({"label": jnp.asarray(batch["label"])})
  images, targets = mixup.mix_batch(mix_rng, images, hard, mixup_alpha=0.8,
                                    cutmix_alpha=config.mixup.cutmix_alpha,
                                    switch_prob=config.mixup.switch_prob,
                                    blocks=copies, copies=copies)
  logits = np.asarray(exp.model_def.merge(state["params"], state["extra"])(
      images, train=True, rng=rng), np.float64)
  t = np.asarray(targets, np.float64)
  assert np.any((t > 0) & (t < 1))  # Really mixed.
  if recipe == "single_label":
    log_p = logits - logits.max(1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(1, keepdims=True))
    want = float(np.mean(-(t / t.sum(1, keepdims=True) * log_p).sum(1)))
    unmixed = float(np.mean(-log_p[np.arange(len(t)), batch["label"]]))
  else:
    p = 1 / (1 + np.exp(-logits))
    pm = np.maximum(p - 0.05, 0)
    asl = lambda y: float(np.mean(-(y * np.log(np.maximum(p, 1e-8)) + (1 - y) * pm ** 4
                                    * np.log(np.maximum(1 - pm, 1e-8))).sum(1)))
    want, unmixed = asl(t), asl(np.asarray(hard, np.float64))
  # Far closer to the mixed-target loss than the unmixed one is.
  assert abs(want - unmixed) > 1e-5
  assert abs(m["train/loss"] - want) < 0.05 * abs(want - unmixed)


# ---------------------------------------------------------------- self-describing checkpoints


def test_checkpoints_describe_their_model_and_load_from_the_path_alone(demo_run):
  config = helpers.tiny_config(total_steps=2)  # What demo_run trained.
  meta = checkpoint.read_meta(demo_run)
  info = datasets.get_dataset(config.data).info
  assert meta["model"]["name"] == "vit_demo" and meta["num_classes"] == info.num_classes
  assert meta["class_names"] == info.class_names and meta["dataset"] == "demo"
  assert meta["data"] == {"image_size": 32, "normalize": "0_1", "eval_resize": "squish"}
  assert meta["objective"]["name"] == "semantic_softmax"
  model = models.load_pretrained(demo_run)
  # The same weights through the config-based path.
  model_def = models.ModelDef.from_config(config.model, info.num_classes)
  variables = checkpoint.load_params(demo_run, {
      "params": model_def.abstract_pure_params(), "extra": model_def.abstract_pure_extra()})
  images = jax.random.uniform(jax.random.key(1), (4, 32, 32, 3))
  want = model_def.merge(variables["params"], variables["extra"])(images, train=False)
  np.testing.assert_array_equal(np.asarray(model(images)), np.asarray(want))
  assert float(jnp.abs(want).max()) > 0  # Trained, not the zero-initialised head.


def test_kd_teacher_in_the_step_is_the_saved_teacher(demo_run):
  teacher_dir = demo_run
  config = helpers.tiny_config("semantic_kd", **{"objective.teacher_checkpoint": teacher_dir})
  exp = train.build(config)
  images = jax.random.uniform(jax.random.key(2), (16, 32, 32, 3))
  with jax.set_mesh(exp.mesh):
    inside = jax.jit(exp.objective.teacher_logits)(
        exp.frozen, jax.device_put(images, sharding.batch_sharding(exp.mesh)))
  own = models.load_pretrained(teacher_dir)(images)
  np.testing.assert_allclose(np.asarray(inside), np.asarray(own), rtol=1e-5, atol=1e-5)


def test_kd_teacher_with_other_classes_is_refused(tmp_path):
  teacher_dir = tmp_path / "teacher"
  train.train_and_evaluate(_toy_config(total_steps=1, **{"evals": {}}), str(teacher_dir))
  config = helpers.tiny_config("semantic_kd", **{"objective.teacher_checkpoint":
                                                     str(teacher_dir)})
  with pytest.raises(ValueError, match="trained on 4 classes of 'toy:plain'"):
    train.build(config)


def test_kd_teacher_with_another_normalisation_or_size_is_refused(demo_run):
  config = helpers.tiny_config("semantic_kd", **{"objective.teacher_checkpoint": demo_run,
                                                 "data.normalize": "imagenet"})
  with pytest.raises(ValueError, match="normalised by '0_1'"):
    train.build(config)
  config = helpers.tiny_config("semantic_kd", **{"objective.teacher_checkpoint": demo_run,
                                                 "data.image_size": 48})
  with pytest.raises(ValueError, match=r"trained at 32 px, but config.data.image_size=48"):
    train.build(config)


def test_model_setup_builds_no_optimizer_state():
  setup = train.build_model(helpers.tiny_config())
  assert set(setup.shardings) == {"params", "extra"}
  assert not hasattr(setup, "tx")
