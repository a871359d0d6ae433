"""Tests for SWAG zero-shot transfer: class map, aggregation, Platt scaling."""
import json

import numpy as np
import pytest

from bigpretrain.swag import zero_shot
from bigpretrain.swag import vocabulary
from bigpretrain.semantic import wordnet

CRANE_BIRD, CRANE_MACHINE = "n02012849", "n03126707"
_TAGS = ["#crane", "#bird", "#truck", "#heron", "#machine", "#dog", "#hedgehog", "#porcupine",
         "#tractor", "#stork", "#forklift", "#cat", "#eggplant"]


@pytest.fixture(scope="module")
def labels():
  return sorted({vocabulary.canonical_hashtag(t) for t in _TAGS})


def test_crane_maps_to_both_crane_classes(labels):
  crane = labels.index(vocabulary.canonical_hashtag("#crane"))
  mapping = zero_shot.class_map([CRANE_BIRD, CRANE_MACHINE], labels)
  assert wordnet.synset_from_wnid(CRANE_BIRD).lexname() == "noun.animal"
  assert wordnet.synset_from_wnid(CRANE_MACHINE).lexname() == "noun.artifact"
  assert mapping == [(crane,), (crane,)]


def test_a_class_keeps_every_tied_hashtag(labels):
  """Appendix D: {porcupine, hedgehog} matches both #porcupine and #hedgehog."""
  porcupine = wordnet.load().synset("porcupine.n.01")
  mapping = zero_shot.class_map([wordnet.wnid(porcupine)], labels)
  assert [labels[i] for i in mapping[0]] == ["hedgehog.n.02+porcupine.n.01", "porcupine.n.01"]


def test_class_map_matches_nltk_path_similarity(labels):
  """Brute force with nltk's path_similarity: argmax over hashtags of the max over their
  synsets, ties kept."""
  wn = wordnet.load()
  wnids = [CRANE_BIRD, "n02084071", "n02123045", "n04465501", "n02002724", "n01503061",
           "n04490091", "n07753592", "n03000134"]  # ... truck, banana, chainlink fence.
  mapping = zero_shot.class_map(wnids, labels)
  for wnid, got in zip(wnids, mapping):
    cls = wordnet.synset_from_wnid(wnid)
    sims = [max(cls.path_similarity(wn.synset(n)) for n in label.split("+")) for label in labels]
    assert got == tuple(i for i, s in enumerate(sims) if s == max(sims)), wnid


@pytest.mark.parametrize("wnids, vocab, match", [
    (["n0201284"], ["crane.n.04"], "Malformed wnid"),
    (["n99999999"], ["crane.n.04"], "not a WordNet 3.0 synset"),
    (["v00028167"], ["crane.n.04"], "not a noun synset"),  # crane.v.01
    ([CRANE_BIRD, CRANE_BIRD], ["crane.n.04"], "distinct wnids"),
    ([], ["crane.n.04"], "non-empty"),
    ([CRANE_BIRD], ["crane.n.04", "crane.n.04"], "distinct canonical hashtags"),
    ([CRANE_BIRD], ["crane.n.04+kranich.n.01"], "'kranich.n.01' is not a WordNet 3.0 synset"),
    ([CRANE_BIRD], [""], "non-empty str"),
])
def test_class_map_bad_input(wnids, vocab, match):
  with pytest.raises(ValueError, match=match):
    zero_shot.class_map(wnids, vocab)


# ---------------------------------------------------------------------------- aggregation

# Hashtags 0..3; class 0 <- {0, 1}, class 1 <- {1}, class 2 <- {2, 3, 1}. Hashtag 1 maps to
# three classes, 0, 2 and 3 to one each.
_MAP = [[0, 1], [1], [2, 3, 1]]
_SCORES = np.array([[0.1, 0.6, 0.2, 0.1],
                    [0.4, 0.3, 0.0, 0.3]])


@pytest.mark.parametrize("method, want", [
    ("sum", [[0.7, 0.6, 0.9], [0.7, 0.3, 0.6]]),
    ("mean", [[0.35, 0.6, 0.3], [0.35, 0.3, 0.2]]),
    ("max_split", [[0.2, 0.2, 0.2], [0.4, 0.1, 0.3]]),
])
def test_aggregation_by_hand(method, want):
  got = zero_shot.aggregate(_SCORES, _MAP, method)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


@pytest.mark.parametrize("scores, mapping, method, match", [
    (_SCORES, _MAP, "median", "unknown aggregation"),
    (_SCORES[0], _MAP, "sum", r"\[N, H\]"),
    (_SCORES, [[0], []], "sum", "at least one hashtag"),
    (_SCORES, [[0], [4]], "sum", r"in \[0, 4\)"),
])
def test_aggregation_bad_input(scores, mapping, method, match):
  with pytest.raises(ValueError, match=match):
    zero_shot.aggregate(scores, mapping, method)


# ---------------------------------------------------------------------------- Platt


def _toy(prior, n=1500, c=10, seed=0):
  """Gaussian classes, uniform true labels; the model's probabilities carry `prior` (like a
  hashtag model's Zipfian label frequencies). Returns probs, labels, Bayes log-likelihoods."""
  rng = np.random.default_rng(seed)
  labels = np.arange(n) % c
  centers = rng.normal(size=(c, 8))
  x = centers[labels] + 0.9 * rng.normal(size=(n, 8))
  loglik = -0.5 * ((x[:, None, :] - centers[None]) ** 2).sum(-1)
  logp = loglik + np.log(prior)
  probs = np.exp(logp - logp.max(axis=1, keepdims=True))
  return probs / probs.sum(axis=1, keepdims=True), labels, loglik


def test_platt_restores_accuracy_under_a_class_prior_shift():
  c = 10
  prior = 0.5 ** np.arange(c)  # Class 0 is 512x as frequent as class 9.
  probs, labels, loglik = _toy(prior / prior.sum())
  before = zero_shot.top1(probs, labels)
  bayes = zero_shot.top1(loglik, labels)  # The accuracy the true prior would give.
  w, b = zero_shot.platt_fit(probs)
  after_probs = zero_shot.platt_apply(probs, w, b)
  after = zero_shot.top1(after_probs, labels)
  assert before < bayes - 0.15
  assert after > before + 0.12 and after > bayes - 0.1, (before, after, bayes)
  # The paper's goal: the mean prediction is uniform.
  np.testing.assert_allclose(after_probs.mean(axis=0), 1 / c, rtol=1e-3)
  # No collapse: every class predicted, none dominating; predictions stay confident.
  predicted = np.bincount(after_probs.argmax(axis=1), minlength=c) / len(labels)
  assert predicted.min() > 0.05 and predicted.max() < 0.3
  entropy = -(after_probs * np.log(after_probs)).sum(axis=1).mean()
  assert entropy < 0.6 * np.log(c)
  assert w.min() > 1.0  # Not the degenerate w = 0.
  assert abs(b.mean()) < 1e-9


def test_platt_keeps_accuracy_without_a_shift():
  probs, labels, _ = _toy(np.full(10, 0.1))
  w, b = zero_shot.platt_fit(probs)
  before = zero_shot.top1(probs, labels)
  assert abs(zero_shot.top1(zero_shot.platt_apply(probs, w, b), labels) - before) < 0.02


def _newton_platt(p, q):
  """Reference (w, b) = argmin mean_n CE(q_n, softmax(w p_n + b)): scipy's trust-region
  Newton with the exact Hessian, in raw coordinates (platt_fit uses L-BFGS, standardised)."""
  import scipy.optimize  # pylint: disable=import-outside-toplevel
  n, c = p.shape

  def probs(x):
    z = p * x[:c] + x[c:]
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)

  def loss(x):
    return -np.mean((q * np.log(probs(x))).sum(axis=1))

  def grad(x):
    d = (probs(x) - q) / n
    return np.concatenate([(d * p).sum(0), d.sum(0)])

  def hess(x):
    s = probs(x)
    a = s * p
    hww = np.diag((a * p).mean(0)) - a.T @ a / n
    hwb = np.diag(a.mean(0)) - a.T @ s / n
    hbb = np.diag(s.mean(0)) - s.T @ s / n
    return np.block([[hww, hwb], [hwb.T, hbb]])

  x0 = np.concatenate([np.ones(c), np.zeros(c)])
  x = scipy.optimize.minimize(loss, x0, jac=grad, hess=hess, method="trust-exact",
                              options={"gtol": 1e-11}).x
  return x[:c], x[c:], loss


def test_platt_fit_reaches_the_minimum_on_near_flat_scores():
  # An untrained model: near-flat probabilities with a class prior. Each class's scores vary
  # little around their mean, so in raw (w, b) the problem is ill-conditioned; a fit that
  # stops on a stalled loss lands short of the minimum, wherever its path happened to be.
  rng = np.random.default_rng(0)
  n, c = 1000, 20
  labels = np.arange(n) % c
  logits = 0.05 * rng.normal(size=(n, c)) + rng.normal(size=c)
  logits[np.arange(n), labels] += 0.05
  p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
  q = zero_shot._uniform_prior_targets(p, 1e-12, 10_000)  # pylint: disable=protected-access
  w_ref, b_ref, loss = _newton_platt(p, q)
  w, b = zero_shot.platt_fit(p)
  assert loss(np.concatenate([w, b])) == pytest.approx(loss(np.concatenate([w_ref, b_ref])),
                                                       abs=1e-9)
  np.testing.assert_allclose(w, w_ref, rtol=1e-3)
  ref = zero_shot.platt_apply(p, w_ref, b_ref - b_ref.mean()).argmax(1)
  np.testing.assert_array_equal(zero_shot.platt_apply(p, w, b).argmax(1), ref)
  # The same fit from the scores rounded to float32 (as another device batching gives them).
  w32, b32 = zero_shot.platt_fit(p.astype(np.float32))
  np.testing.assert_array_equal(zero_shot.platt_apply(p, w32, b32).argmax(1), ref)


def test_platt_apply_is_softmax_of_diag_w_p_plus_b():
  p = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
  w, b = np.array([2.0, -1.0, 0.5]), np.array([0.0, 0.3, -0.2])
  z = p * w + b
  want = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
  np.testing.assert_allclose(zero_shot.platt_apply(p, w, b), want, rtol=1e-12)
  np.testing.assert_allclose(zero_shot.platt_apply(p, np.zeros(3), np.zeros(3)), 1 / 3)


@pytest.mark.parametrize("probs, match", [
    (np.ones(4), r"\[N, C\]"),
    (np.ones((4, 1)), "C >= 2"),
    (np.array([[0.5, np.nan]]), "finite"),
    (np.array([[0.5, -0.1]]), ">= 0"),
    (np.array([[0.5, 0.5], [0.0, 0.0]]), "row 1 is all zeros"),
    (np.array([[0.5, 0.0], [1.0, 0.0]]), "class 1 has zero probability on every example"),
])
def test_platt_fit_bad_input(probs, match):
  with pytest.raises(ValueError, match=match):
    zero_shot.platt_fit(probs)


def test_platt_apply_bad_shapes():
  with pytest.raises(ValueError, match="w and b must be"):
    zero_shot.platt_apply(np.ones((2, 3)), np.ones(2), np.ones(3))


def test_zero_shot_reads_images_at_pretraining_size_shorter_side_then_centre_crop():
  """SWAG sections 4.1/4.4: pre-training resolution, shorter side resized to the final size
  and a centre crop, whatever crop the hashtag run evaluated with (not 87.5%)."""
  from PIL import Image
  from input_pipeline import augment_spec
  from configs import swag_regnety, swag_vit
  meta_data = {"image_size": 32, "normalize": "imagenet", "eval_resize": "center_crop"}
  cfg = zero_shot.eval_data_config(meta_data, num_workers=2)
  assert cfg["image_size"] == 32 and cfg["normalize"] == "imagenet" and cfg["num_workers"] == 2
  rng = np.random.default_rng(0)
  image = rng.integers(0, 256, (40, 60, 3), np.uint8)
  got = np.asarray(augment_spec.EVAL_RESIZES[cfg["eval_resize"]](image, 32))
  # By hand: 40x60 -> 32x48 (shorter side 32), then columns 8..40.
  want = np.asarray(Image.fromarray(image).resize((48, 32), Image.BILINEAR))[:, 8:40]
  assert got.shape == (32, 32, 3)
  assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
  for recipe in (swag_regnety, swag_vit):
    assert recipe.get_config().data.eval_resize == "shorter_center_crop"


def test_bad_eval_resize_flag_is_refused_before_any_work(tmp_path):
  with pytest.raises(ValueError, match=r"--eval_resize='center_crop\(2\)': the crop fraction"):
    zero_shot.run(str(tmp_path / "no_run"), "demo", eval_resize="center_crop(2)")
  assert not (tmp_path / "no_run").exists()


def test_real_labels_are_scored_and_unlabelled_splits_refused(caplog):
  """ReaL top-1 (Table 3's ReaL-IN column): the top class is one of the image's real labels,
  over the images that have any. A split whose labels are withheld (-1) is refused."""
  scores = np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])
  rows = {"sum": scores, "label": np.array([0, 0, 2, 1]),
          "real_label": np.array([[0, 1], [0, -1], [-1, -1], [1, 2]])}
  out = zero_shot.top1_from_rows(rows, {False: "sum"})
  assert out["top1_no_platt"] == 0.5  # Images 0 and 2.
  # Image 0's 0 is real, 1's 1 is not, 2 has none (left out), 3's 0 is not: 1 of 3.
  assert out["real_top1_no_platt"] == pytest.approx(1 / 3) and out["num_real_examples"] == 3
  with caplog.at_level("WARNING"):  # 4 images for 3 classes: no warning; 2 for 3: one.
    zero_shot.top1_from_rows({"sum": scores, "label": rows["label"]}, {True: "sum"})
    assert "Platt scaling fitted on" not in caplog.text
    zero_shot.top1_from_rows({"sum": scores[:2], "label": rows["label"][:2]}, {True: "sum"})
    assert "Platt scaling fitted on 2 images for 3 classes" in caplog.text
  with pytest.raises(ValueError, match=r"2 of 4 images have no label of the 3 classes \(e.g. "
                     r"-1: a test split whose labels are withheld\?\)"):
    zero_shot.top1_from_rows({"sum": scores, "label": np.array([0, -1, -1, 1])},
                             {False: "sum"})


def test_a_class_map_that_cannot_be_written_is_warned_and_not_fatal(tmp_path, capsys):
  """A read-only run folder (a shared bucket): the scores do not depend on the saved map."""
  path = tmp_path / "run" / "zero_shot" / "demo-class_map.json"
  assert zero_shot.save_class_map(str(path), ["n1", "n2"], ["dog", "cat"], [[1], [0, 1]]) == (
      str(path))
  assert json.loads(path.read_text()) == {"n1": ["cat"], "n2": ["dog", "cat"]}
  (tmp_path / "file").write_text("")
  blocked = tmp_path / "file" / "zero_shot" / "demo-class_map.json"  # Under a file: OSError.
  assert zero_shot.save_class_map(str(blocked), ["n1"], ["dog"], [[0]]) is None
  assert f"WARNING: The class map cannot be written to {blocked}" in capsys.readouterr().out
