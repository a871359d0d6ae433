"""SWAG soft-target objective and the `hashtags:demo` data source, against numpy."""
import math

import cv2
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from bigpretrain.runtime import metric_writers
from bigpretrain import mixup
from bigpretrain import objectives
from bigpretrain import train
from bigpretrain.swag import vocabulary
from bigpretrain.objectives import multi_label
from bigpretrain.objectives import soft_target
from input_pipeline import datasets
from tests import helpers

C = 6
# Padded id lists: repeats, -1 padding, an image without labels, and a single label.
IDS = np.array([[2, 0, -1, -1],
                [5, 5, 1, 3],
                [-1, -1, -1, -1],
                [4, -1, -1, -1],
                [1, 2, 3, 4]], np.int32)
SETS = [{0, 2}, {1, 3, 5}, set(), {4}, {1, 2, 3, 4}]


def _info(num_classes=C):
  return datasets.DatasetInfo(name="toy", num_classes=num_classes, class_names=[],
                              num_examples={}, image_size=8, splits=("train",),
                              features={"hashtag_ids": 4})


def _objective(**cfg):
  return objectives.get_objective(ml_collections.ConfigDict(dict(name="soft_target", **cfg)),
                                  _info())


def _log_softmax(z):
  z = np.asarray(z, np.float64)
  m = z.max(-1, keepdims=True)
  return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def _fixed_model(logits):
  return lambda image, train=False, rng=None: jnp.asarray(logits)


def _logits(seed=0, rows=len(IDS)):
  return np.random.default_rng(seed).normal(size=(rows, C)).astype(np.float32)


def test_multi_hot_and_normalised_targets():
  obj = _objective()
  want = np.zeros((len(IDS), C))
  for b, s in enumerate(SETS):
    want[b, list(s)] = 1
  np.testing.assert_array_equal(obj.multi_hot(jnp.asarray(IDS)), want)
  t = np.asarray(obj.dense_targets({"hashtag_ids": jnp.asarray(IDS)}))
  np.testing.assert_allclose(t[1], [0, 1 / 3, 0, 1 / 3, 0, 1 / 3], rtol=1e-6)
  np.testing.assert_array_equal(t[2], 0)
  np.testing.assert_allclose(t.sum(1), [1, 1, 0, 1, 1], rtol=1e-6)


def test_loss_is_one_over_k_cross_entropy_averaged_over_labelled_images():
  logits = _logits()
  loss, _ = _objective().loss(_fixed_model(logits), {"image": None, "hashtag_ids": IDS}, None)
  log_p = _log_softmax(logits)
  per_image = [-np.mean([log_p[b, c] for c in s]) for b, s in enumerate(SETS) if s]
  np.testing.assert_allclose(float(loss), np.mean(per_image), rtol=1e-5)
  # The unlabelled row is not in the denominator: averaging over all 5 rows would differ.
  assert abs(float(loss) - np.sum(per_image) / len(IDS)) > 0.1


def test_loss_of_a_batch_without_labels_is_zero_with_zero_gradient():
  obj = _objective()
  ids = np.full((3, 4), -1, np.int32)
  fn = lambda z: obj.loss(_fixed_model(z), {"image": None, "hashtag_ids": ids}, None)[0]
  value, grad = jax.value_and_grad(fn)(jnp.asarray(_logits(rows=3)))
  assert float(value) == 0.0 and np.all(np.asarray(grad) == 0)


def test_mixed_targets_give_the_mixed_losses_over_labelled_images():
  """Mixing row b with row B-1-b: loss = sum_b [lam CE_b + (1 - lam) CE_flip(b)] / #labelled,
  an unlabelled partner contributing nothing."""
  obj = _objective()
  logits = _logits(1)
  hard = obj.dense_targets({"hashtag_ids": jnp.asarray(IDS)})
  images = jnp.zeros((len(IDS), 4, 4, 3))
  _, mixed = mixup.mix_batch(jax.random.key(3), images, hard, mixup_alpha=1.0,
                             cutmix_alpha=0.0)
  lam = float(np.asarray(mixed)[0, 0] / np.asarray(hard)[0, 0])  # Row 0: label 0 only in it.
  assert 0.05 < lam < 0.95
  loss, _ = obj.loss(_fixed_model(logits), {"image": None, "hashtag_ids": IDS,
                                            "targets": mixed}, None)
  log_p = _log_softmax(logits)
  ce = lambda b, row: -np.mean([log_p[row, c] for c in SETS[b]]) if SETS[b] else 0.0
  n = len(IDS)
  total = sum(lam * ce(b, b) + (1 - lam) * ce(n - 1 - b, b) for b in range(n))
  np.testing.assert_allclose(float(loss), total / sum(bool(s) for s in SETS), rtol=1e-5)


def _np_average_precision(scores, positive):
  """AP of one class without ties: mean over positives of the precision at their rank."""
  order = np.argsort(-scores)
  hits = positive[order]
  precision = np.cumsum(hits) / np.arange(1, len(hits) + 1)
  return float((precision * hits).sum() / hits.sum())


def test_eval_metrics_against_numpy_with_padding_rows_and_unlabelled_images():
  obj = _objective(map_bins=100_000)
  rng = np.random.default_rng(4)
  ids = np.concatenate([IDS, IDS[:3]])  # Rows 5..7 are padding (mask 0).
  mask = np.array([1, 1, 1, 1, 1, 0, 0, 0], np.float32)
  logits = rng.normal(size=(8, C)).astype(np.float32) * 3
  out = jax.device_get(obj.eval_metrics(
      _fixed_model(logits), {"image": None, "hashtag_ids": ids, "mask": mask}, (1, 2, 10)))
  rows = [b for b in range(5) if SETS[b]]  # Labelled, real rows: 0, 1, 3, 4.
  top = np.argsort(-logits, axis=1)
  p1 = np.mean([top[b, 0] in SETS[b] for b in rows])
  assert out["precision_at_1"][1] == 4
  np.testing.assert_allclose(out["precision_at_1"][0] / 4, p1)
  for k in (1, 2, C):
    recall = np.mean([len(set(top[b, :k]) & SETS[b]) / len(SETS[b]) for b in rows])
    np.testing.assert_allclose(out[f"recall_at_{k}"][0] / out[f"recall_at_{k}"][1], recall,
                               rtol=1e-6)
  assert "recall_at_10" not in out  # k is capped at C.
  np.testing.assert_allclose(out["recall_at_6"][0] / 4, 1.0, rtol=1e-6)
  assert tuple(out["labelled_share"]) == (4, 5)
  # mAP over classes with a positive among the labelled rows, on softmax probabilities.
  p = np.exp(_log_softmax(logits))[rows]
  y = np.array([[c in SETS[b] for c in range(C)] for b in rows], np.float64)
  want = np.mean([_np_average_precision(p[:, c], y[:, c]) for c in range(C) if y[:, c].any()])
  got = obj.finalize_eval({"ap_hist": out["ap_hist"]})["mAP"]
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_map_scores_spread_chance_level_over_the_bins():
  obj = _objective()
  uniform = np.asarray(obj.scores(jnp.zeros((1, C))))
  np.testing.assert_allclose(uniform, 0.5, rtol=1e-6)  # p = 1/C sits mid-range.
  sure = np.asarray(obj.scores(jnp.array([[30.0, 0, 0, 0, 0, 0]])))
  assert sure[0, 0] > 0.99 and np.all(sure[0, 1:] == 0)  # p < 1/C^2 clipped to 0.
  # The same histograms through the multi-label helper: reused, not a copy.
  assert soft_target.multi_label.ap_histograms is multi_label.ap_histograms


def test_objective_settings_are_checked():
  with pytest.raises(ValueError, match=r"unknown keys \['fild'\]"):
    _objective(fild="tags")
  assert _objective(field="tags").reads == ("tags",)
  with pytest.raises(ValueError, match="at least 2 classes"):
    objectives.get_objective(ml_collections.ConfigDict(dict(name="soft_target")), _info(1))


# ---------------------------------------------------------------- hashtags:demo


def _decode(png: bytes) -> np.ndarray:
  return cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_UNCHANGED)


@pytest.fixture(scope="module")
def hashtags_demo():
  return datasets.get_dataset({"name": "hashtags:demo", "dir": ""})


def test_hashtag_demo_vocabulary_and_records(hashtags_demo):
  info = hashtags_demo.info
  base = datasets.get_dataset({"name": "demo", "dir": ""})
  assert info.class_names == sorted(set(info.class_names)) and info.num_classes > 50
  assert all(vocabulary.label_synsets(c) for c in info.class_names)
  assert set(info.features) == {"hashtag_ids"}  # The wnid 'label' is another class space.
  train = hashtags_demo.source("train")
  base_train = base.source("train")
  dropped = info.stats["dropped_unlabelled_train"]
  assert len(train) == info.num_examples["train"] == len(base_train) - dropped and dropped > 0
  # A record's ids are the sorted distinct vocabulary ids of its canonicalised raw tags.
  index = {c: i for i, c in enumerate(info.class_names)}
  for i in (0, 1, 777, len(train) - 1):
    record = train[i]
    labels = {vocabulary.canonical_hashtag(t) for t in record["hashtags"]} - {None}
    assert record["hashtag_ids"] == sorted(index[c] for c in labels) and labels
  validation = hashtags_demo.source("validation")
  assert len(validation) == len(base.source("validation")) == info.num_examples["validation"]
  lengths = [len(validation[i]["hashtag_ids"]) for i in range(0, len(validation), 50)]
  assert max(lengths) <= info.features["hashtag_ids"] and max(lengths) >= 2
  assert validation.index_sampler(0, 0, 1) is None
  # Its images are the current demo version's (an inner class's image pictures a member).
  inner = 0
  for i in range(0, len(validation), 100):
    record = validation[i]
    demo_record = base.source("validation")[int(record["file_name"].rsplit("/", 1)[1])]
    np.testing.assert_array_equal(_decode(record["image"]), _decode(demo_record["image"]))
    inner += demo_record["member"] != demo_record["label"]
  assert inner > 0


def test_hashtag_demo_train_is_resampled_per_host(hashtags_demo):
  train = hashtags_demo.source("train")
  assert 0 < hashtags_demo.info.stats["tail_train_images"] < len(train)  # A real head/tail.
  whole = train.resampler(7)
  assert whole.alpha == 0.7 and len(whole) == len(train)
  # One host: the whole-dataset resampler itself.
  np.testing.assert_array_equal(train.index_sampler(7, 0, 1)[np.arange(50)],
                                whole[np.arange(50)])
  # Two hosts: each draws its half of an epoch from its own half of the images.
  hosts = [train.index_sampler(7, p, 2) for p in range(2)]
  half = len(train) // 2
  assert [len(h) for h in hosts] == [(len(train) + 1) // 2, len(train) // 2]
  assert hosts[0][np.arange(2000)].max() < half <= hosts[1][np.arange(2000)].min()
  np.testing.assert_array_equal(train.index_sampler(7, 1, 2)[np.arange(50)],
                                hosts[1][np.arange(50)])  # Deterministic by seed.
  assert not np.array_equal(train.index_sampler(8, 0, 1)[np.arange(50)], whole[np.arange(50)])


def test_soft_target_trains_and_evaluates_on_hashtags_demo(tmp_path):
  config = helpers.tiny_config("single_label", **{
      "data.name": "hashtags:demo", "objective": {"name": "soft_target"}, "total_steps": 3,
      "eval_every_steps": 3})
  config.data.eval_split = "validation"
  results = train.train_and_evaluate(config, str(tmp_path))
  rows = metric_writers.read_metrics(str(tmp_path))
  losses = [r["train/loss"] for r in rows if "train/loss" in r]
  assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses)
  # Near log C at the start: the head is zero-initialised.
  assert abs(losses[0] - math.log(train.build(config).dataset.info.num_classes)) < 0.5
  evals = [r for r in rows if "eval/precision_at_1" in r]
  assert evals and evals[-1]["step"] == 3
  for key in ("eval/precision_at_1", "eval/recall_at_1", "eval/recall_at_5", "eval/mAP"):
    assert 0.0 <= results[key] <= 1.0, key
  assert results["eval/recall_at_5"] >= results["eval/recall_at_1"]
