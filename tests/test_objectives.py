"""Objectives beyond the loss math: multi-label targets, mAP, and semantic KD end to end."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bigpretrain.runtime import metric_writers
from bigpretrain import objectives
from bigpretrain import train
from bigpretrain.objectives import multi_label
from input_pipeline import datasets
from tests import helpers


def _sklearn_style_ap(scores, y):
  """AP = sum_n (R_n - R_{n-1}) P_n over distinct score thresholds, highest first."""
  order = np.argsort(-scores, kind="stable")
  s, y = scores[order], y[order]
  ap, tp, fp, prev_recall = 0.0, 0, 0, 0.0
  for thr in np.unique(s)[::-1]:
    sel = s == thr
    tp += int(y[sel].sum())
    fp += int((1 - y[sel]).sum())
    recall = tp / y.sum()
    ap += (recall - prev_recall) * tp / (tp + fp)
    prev_recall = recall
  return ap


def test_average_precision_from_histograms_matches_reference():
  rng = np.random.default_rng(0)
  num_classes, n, bins = 5, 200, 50
  y = (rng.random((n, num_classes)) < 0.3).astype(np.float64)
  scores = np.clip(0.6 * y + 0.7 * rng.random((n, num_classes)), 0, 0.999)
  q = np.floor(scores * bins).astype(int)
  pos = np.zeros((num_classes, bins))
  neg = np.zeros((num_classes, bins))
  for c in range(num_classes):
    np.add.at(pos[c], q[:, c], y[:, c])
    np.add.at(neg[c], q[:, c], 1 - y[:, c])
  got = multi_label.average_precision_from_histograms(pos, neg)
  want = [_sklearn_style_ap(q[:, c].astype(float), y[:, c]) for c in range(num_classes)]
  np.testing.assert_allclose(got, want, rtol=1e-12)
  assert np.isnan(multi_label.average_precision_from_histograms(
      np.zeros((1, bins)), np.ones((1, bins))))[0]


def test_multi_hot_is_label_plus_ancestors():
  from ml_collections import ConfigDict
  info = datasets.get_dataset(ConfigDict(dict(name="demo", dir=""))).info
  obj = multi_label.MultiLabel(ConfigDict(dict(name="multi_label")), info)
  labels = np.arange(info.num_classes)
  got = np.asarray(obj.multi_hot(jnp.asarray(labels)))
  parent = obj.tree.parent
  for c in labels:
    want = np.zeros(info.num_classes)
    node = c
    while node >= 0:
      want[node] = 1
      node = parent[node]
    np.testing.assert_array_equal(got[c], want)
  assert got.sum(1).max() == obj.tree.num_levels  # The deepest classes have every level.


def test_semantic_kd_trains_from_a_teacher_checkpoint(tmp_path, demo_run):
  from configs import semantic_kd
  config = semantic_kd.get_config(f"teacher={demo_run}")
  for key, value in helpers.tiny_config(total_steps=3).items():
    if key not in ("objective",):
      config[key] = value
  train.train_and_evaluate(config, str(tmp_path / "student"))
  rows = [r for r in metric_writers.read_metrics(str(tmp_path / "student")) if "train/kd_loss" in r]
  assert [r["step"] for r in rows] == [1, 2, 3]
  for r in rows:  # Total = semantic + 1.0 * KD, and KD is a real, positive distance.
    assert r["train/loss"] == pytest.approx(r["train/semantic_loss"] + r["train/kd_loss"],
                                            rel=1e-5)
    assert r["train/kd_loss"] > 0


def test_semantic_kd_teacher_logits_in_the_step_are_the_saved_teachers(demo_run):
  # The teacher's load path (checkpoint -> student mesh -> frozen input of the jitted step) is
  # what breaks silently: compare with the teacher rebuilt through the trainer's own restore.
  import jax
  from bigpretrain import checkpoint
  from bigpretrain import sharding
  from configs import semantic_kd
  teacher_dir = demo_run
  teacher_config = helpers.tiny_config(total_steps=2)  # What demo_run trained.
  t_exp = train.build(teacher_config)
  restored = checkpoint.Checkpointer(f"{teacher_dir}/checkpoints",
                                     async_save=False).restore(t_exp.init_state())
  assert restored is not None and restored[1] == 2
  t_state = restored[0]
  images = np.random.default_rng(0).random((16, 32, 32, 3), np.float32)
  teacher = t_exp.model_def.merge(t_state["params"], t_state["extra"])
  want = np.asarray(teacher(jnp.asarray(images), train=False))

  config = semantic_kd.get_config(f"teacher={teacher_dir}")
  for key, value in helpers.tiny_config(total_steps=3).items():
    if key != "objective":
      config[key] = value
  exp = train.build(config)
  batch = sharding.global_batch({"image": images}, exp.mesh)
  got = jax.jit(exp.objective.teacher_logits)(exp.frozen, batch["image"])
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  assert np.abs(want).max() > 0.1  # A trained head, not zeros that would match anything.


def test_semantic_kd_takes_the_class_tree_its_teacher_stores(demo_run, monkeypatch, capsys):
  # A teacher trained under an earlier tree rule keeps its levels' meaning: simulated by a
  # rule that now makes every class a root.
  from bigpretrain import checkpoint
  from bigpretrain.objectives import base
  from bigpretrain.semantic import tree as tree_lib
  from configs import semantic_kd
  stored = checkpoint.read_meta(demo_run)["class_tree"]["parent"]
  monkeypatch.setattr(base, "class_tree", lambda names, required=True: (
      tree_lib.SemanticTree.from_parents([-1] * len(names), list(names))))
  config = semantic_kd.get_config(f"teacher={demo_run}")
  for key, value in helpers.tiny_config(total_steps=3).items():
    if key != "objective":
      config[key] = value
  exp = train.build(config)
  assert exp.objective.tree.parent.tolist() == stored and exp.objective.tree.num_levels > 1
  assert exp.objective.meta() == {"class_tree": {"parent": stored}}  # The student stores it.
  assert (f"the teacher in {demo_run} was trained on another class tree than the one built "
          "now (teacher's -> now: level sizes ") in capsys.readouterr().out
  # A student checkpoint of another tree than its teacher's cannot be distilled on.
  flat = {"class_tree": {"parent": [-1] * len(stored)}}
  with pytest.raises(checkpoint.CheckpointMismatch, match="student's -> teacher's: level sizes"):
    exp.objective.restore_meta(flat)


def test_semantic_kd_without_teacher_is_a_clear_error(tmp_path):
  from configs import semantic_kd
  config = semantic_kd.get_config()
  with pytest.raises(ValueError, match="teacher_checkpoint is empty"):
    train.build(config)


@pytest.mark.parametrize("recipe,key,value,match", [
    ("semantic_softmax", "label_smoothing", 1.0, r"label_smoothing=1.0 must be in \[0, 1\)"),
    ("semantic_softmax", "label_smoothing", -0.1, r"label_smoothing=-0.1 must be in"),
    ("semantic_kd", "kd_weight", -1.0, r"kd_weight=-1.0 must be finite and >= 0"),
    ("semantic_kd", "kd_weight", float("nan"), r"kd_weight=nan must be finite"),
])
def test_objective_values_out_of_range_are_refused_by_name(recipe, key, value, match):
  config = importlib.import_module(f"configs.{recipe}").get_config()
  config.objective[key] = value
  if recipe == "semantic_kd":
    config.objective.teacher_checkpoint = "/nonexistent"  # Read only later, in load_frozen.
  with pytest.raises(ValueError, match=match):
    objectives.get_objective(config.objective, datasets.get_dataset(config.data).info)


def _reference_asl_sum(x, y, gamma_neg=4.0, gamma_pos=0.0, clip=0.05, eps=1e-8):
  """The ASL repo's AsymmetricLoss.forward in numpy: -loss.sum() over batch and classes."""
  xs_pos = 1 / (1 + np.exp(-x))
  xs_neg = np.minimum(1 - xs_pos + clip, 1)
  loss = y * np.log(np.maximum(xs_pos, eps)) + (1 - y) * np.log(np.maximum(xs_neg, eps))
  pt = xs_pos * y + xs_neg * (1 - y)
  loss = loss * (1 - pt) ** (gamma_pos * y + gamma_neg * (1 - y))
  return -loss.sum()


def test_multi_label_loss_scale_gives_the_reference_asl_sum():
  # The reference sums ASL over each GPU's images and DDP averages the GPUs' gradients: with
  # 2 devices of 4 images, that is 4 x the batch mean, which loss_scale=4 reproduces.
  from ml_collections import ConfigDict
  info = datasets.get_dataset(ConfigDict(dict(name="demo", dir=""))).info
  rng = np.random.default_rng(0)
  labels = rng.integers(0, info.num_classes, 8)
  logits = rng.normal(size=(8, info.num_classes)) * 3
  batch = {"image": jnp.zeros((8, 1)), "label": jnp.asarray(labels)}
  model = lambda images, train, rng: jnp.asarray(logits, jnp.float32)  # noqa: E731
  mean = multi_label.MultiLabel(ConfigDict(dict(name="multi_label")), info)
  scaled = multi_label.MultiLabel(ConfigDict(dict(name="multi_label", loss_scale=4.0)), info)
  y = np.asarray(mean.multi_hot(jnp.asarray(labels)))
  per_device = [_reference_asl_sum(logits[i:i + 4], y[i:i + 4]) for i in (0, 4)]
  reference = np.mean(per_device)
  np.testing.assert_allclose(float(scaled.loss(model, batch, None)[0]), reference, rtol=1e-5)
  np.testing.assert_allclose(float(mean.loss(model, batch, None)[0]), reference / 4, rtol=1e-5)
  with pytest.raises(ValueError, match="loss_scale"):
    multi_label.MultiLabel(ConfigDict(dict(name="multi_label", loss_scale=0.0)), info)


def test_multi_label_config_scales_asl_at_paper_scale_only():
  from configs import multi_label as multi_label_config
  paper = multi_label_config.get_config("dataset=imagenet21k_p,data_dir=/data")
  assert paper.objective.loss_scale == 64.0  # 512 images on 8 GPUs: 64 per reference sum.
  assert paper.batch_size == 512
  assert multi_label_config.get_config().objective.loss_scale == 1.0  # The demo: unchanged.
  bce = multi_label_config.get_config("dataset=imagenet21k_p,data_dir=/data,loss=bce")
  assert bce.objective.loss_scale == 1.0


# ------------------------------------------------ multi_label on an id-list field (field=NAME)
C_ML = 5
# Padded id lists (-1 = padding): repeats, an image without labels, all classes.
ML_IDS = np.array([[2, 0, -1], [4, 4, 1], [-1, -1, -1], [3, -1, -1], [0, 1, 2]], np.int32)
ML_SETS = [{0, 2}, {1, 4}, set(), {3}, {0, 1, 2}]


def _ml_field_objective(**cfg):
  from ml_collections import ConfigDict
  info = datasets.DatasetInfo(name="voc_like", num_classes=C_ML,
                              class_names=["cat", "dog", "car", "bus", "cow"], num_examples={},
                              image_size=8, splits=("train",), features={"labels": 3})
  return multi_label.MultiLabel(ConfigDict(dict(name="multi_label", field="labels", **cfg)),
                                info)


def test_multi_label_field_loss_is_asl_on_the_listed_classes():
  from tests.test_losses import _np_asl
  obj = _ml_field_objective()  # Class names are not wnids: no tree needed.
  assert obj.reads == ("labels",) and obj.tree is None
  logits = np.random.default_rng(0).normal(size=(len(ML_IDS), C_ML)).astype(np.float32) * 2
  y = np.zeros((len(ML_IDS), C_ML))
  for b, s in enumerate(ML_SETS):
    y[b, sorted(s)] = 1
  np.testing.assert_array_equal(obj.dense_targets({"labels": jnp.asarray(ML_IDS)}), y)
  model = lambda images, train, rng: jnp.asarray(logits)  # noqa: E731
  loss, _ = obj.loss(model, {"image": None, "labels": ML_IDS}, None)
  np.testing.assert_allclose(float(loss), _np_asl(logits, y, 4.0, 0.0, 0.05), rtol=1e-5)
  bce = _ml_field_objective(loss="bce", loss_scale=3.0)
  p = 1 / (1 + np.exp(-logits.astype(np.float64)))
  want = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
  np.testing.assert_allclose(float(bce.loss(model, {"image": None, "labels": ML_IDS}, None)[0]),
                             3.0 * want, rtol=1e-5)
  np.testing.assert_allclose(obj.answer(jnp.asarray(logits)), p, rtol=1e-5)
  np.testing.assert_allclose(obj.membership(jnp.asarray(logits)), p, rtol=1e-5)


def test_multi_label_field_eval_map_and_topk_against_numpy():
  obj = _ml_field_objective(map_bins=100_000)
  rng = np.random.default_rng(1)
  ids = np.concatenate([ML_IDS, ML_IDS[:2]])  # Rows 5, 6: padding (mask 0).
  mask = np.array([1, 1, 1, 1, 1, 0, 0], np.float32)
  logits = rng.normal(size=(len(ids), C_ML)).astype(np.float32) * 3
  model = lambda images, train: jnp.asarray(logits)  # noqa: E731
  out = jax.device_get(obj.eval_metrics(model, {"image": None, "labels": ids, "mask": mask},
                                        (1, 2)))
  assert "top1" not in out and "semantic_top1" not in out  # No single label, no tree.
  rows = [b for b in range(5) if ML_SETS[b]]  # Labelled real rows: 0, 1, 3, 4.
  top = np.argsort(-logits, axis=1)
  assert tuple(out["labelled_share"]) == (4, 5)
  np.testing.assert_allclose(out["precision_at_1"][0] / out["precision_at_1"][1],
                             np.mean([top[b, 0] in ML_SETS[b] for b in rows]))
  np.testing.assert_allclose(
      out["recall_at_2"][0] / out["recall_at_2"][1],
      np.mean([len(set(top[b, :2]) & ML_SETS[b]) / len(ML_SETS[b]) for b in rows]), rtol=1e-6)
  # mAP over the 5 real rows (the unlabelled one a negative of every class), sigmoid scores,
  # exact AP of the unbinned scores; 1e5 bins separate these scores (within 1e-5 of exact).
  p = 1 / (1 + np.exp(-logits[:5].astype(np.float64)))
  y = np.array([[c in ML_SETS[b] for c in range(C_ML)] for b in range(5)], np.float64)
  want = np.mean([_sklearn_style_ap(p[:, c], y[:, c]) for c in range(C_ML) if y[:, c].any()])
  got = obj.finalize_eval({"ap_hist": out["ap_hist"]})["mAP"]
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert 0 < got < 1


def test_multi_label_without_field_still_needs_the_tree():
  from ml_collections import ConfigDict
  info = datasets.DatasetInfo(name="voc_like", num_classes=2, class_names=["cat", "dog"],
                              num_examples={}, image_size=8, splits=("train",))
  with pytest.raises(ValueError, match="objective.field"):
    multi_label.MultiLabel(ConfigDict(dict(name="multi_label")), info)


def test_a_tree_that_only_adds_metrics_is_dropped_with_a_warning(capsys):
  """wnid-shaped names outside WordNet 3.0: softmax trains without semantic metrics, semantic
  softmax, which needs the tree, refuses."""
  from ml_collections import ConfigDict
  info = datasets.DatasetInfo(name="odd", num_classes=2, class_names=["n02084071", "n00000001"],
                              num_examples={}, image_size=8, splits=("train",))
  plain = objectives.get_objective(ConfigDict(dict(name="softmax")), info)
  assert plain.tree is None
  assert "WARNING: no semantic metrics: wnid 'n00000001'" in capsys.readouterr().out
  with pytest.raises(ValueError, match="'n00000001' is not a WordNet 3.0 synset"):
    objectives.get_objective(ConfigDict(dict(name="semantic_softmax")), info)


def _fake_builder(features):
  import types
  import tensorflow_datasets as tfds
  split = types.SimpleNamespace(num_examples=3)
  return types.SimpleNamespace(info=types.SimpleNamespace(
      features=tfds.features.FeaturesDict(features), splits={"train": split}, metadata=None))


def test_tfds_dataset_reads_voc_style_labels_lists():
  """tfds voc's features (voc.py): no 'label', a top-level Sequence(ClassLabel) 'labels'."""
  import tensorflow_datasets as tfds
  from input_pipeline import pipeline
  names = ["aeroplane", "bicycle", "bird"]
  voc = datasets.TfdsDataset("tfds:voc_like", _fake_builder({
      "image": tfds.features.Image(),
      "image/filename": tfds.features.Text(),
      "objects": tfds.features.Sequence({"label": tfds.features.ClassLabel(names=names),
                                         "bbox": tfds.features.BBoxFeature()}),
      "labels": tfds.features.Sequence(tfds.features.ClassLabel(names=names)),
      "labels_no_difficult": tfds.features.Sequence(tfds.features.ClassLabel(names=names))}))
  info = voc.info
  assert info.num_classes == 3 and info.class_names == names
  assert info.features["labels"] == 3  # Distinct classes per image: padded to C.
  assert info.features["labels_no_difficult"] == 3
  assert info.features["objects"] is None and info.features["image/filename"] is None
  assert "label" not in info.features
  got = pipeline.record_fields({"labels": np.array([0, 2])}, {"labels": 3}, 0)
  np.testing.assert_array_equal(got["labels"], [0, 2, -1])
  assert got["num_labels"] == 2
  # A dataset with 'label' is read as before; COCO-style per-object labels only: refused.
  single = datasets.TfdsDataset("tfds:single", _fake_builder({
      "image": tfds.features.Image(), "label": tfds.features.ClassLabel(names=names),
      "labels": tfds.features.Sequence(tfds.features.ClassLabel(names=names))}))
  assert single.info.features["label"] == 0 and single.info.features["labels"] is None
  with pytest.raises(ValueError, match="'labels' Sequence"):
    datasets.TfdsDataset("tfds:coco_like", _fake_builder({
        "image": tfds.features.Image(),
        "objects": tfds.features.Sequence({"label": tfds.features.ClassLabel(names=names)})}))


def test_multi_label_transfer_trains_on_hashtag_id_lists(tmp_path):
  """configs/transfer.py's multi_label on a dataset without 'label' (hashtags:demo): the
  objective reads its id lists; a few steps log a finite loss and eval/mAP."""
  import math
  from configs import transfer
  config = transfer.get_config(
      "mode=finetune,model=vit_demo,dataset=hashtags:demo,multi_label,steps=3")
  assert config.objective.field == "hashtag_ids" and config.batch_size == transfer.DEMO_BATCH
  helpers.set_overrides(config, {
      "batch_size": 16, "eval_every_steps": 3, "log_every_steps": 1,
      "compilation_cache_dir": helpers.JAX_CACHE, "evals.fewshot.datasets": {},
      "data.eval_split": f"validation{helpers.EVAL_RECORDS}"})
  results = train.train_and_evaluate(config, str(tmp_path))
  rows = metric_writers.read_metrics(str(tmp_path))
  losses = [r["train/loss"] for r in rows if "train/loss" in r]
  assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses)
  assert math.isfinite(results["eval/mAP"]) and 0.0 < results["eval/mAP"] <= 1.0
  assert 0.0 <= results["eval/precision_at_1"] <= 1.0
