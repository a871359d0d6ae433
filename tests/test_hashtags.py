"""Tests for the SWAG hashtag vocabulary and head/tail resampling (bigpretrain.swag)."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from bigpretrain.swag import resampling
from bigpretrain.swag import vocabulary
from bigpretrain.semantic import wordnet
from input_pipeline import datasets
from input_pipeline import pipeline

ROOT = pathlib.Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------------ vocabulary

# Hand-checked against WordNet 3.0 (lexnames in comments; dropped senses after 'not').
_CANONICAL = {
    # eggplant.n.01 noun.food, eggplant.n.02 noun.plant; 'aubergine' is a lemma of both.
    "#eggplant": "eggplant.n.01+eggplant.n.02",
    "#aubergine": "eggplant.n.01+eggplant.n.02",
    # dog.n.01 animal, frank.n.02 food, pawl.n.01 and andiron.n.01 artifact; not frump.n.01,
    # dog.n.03, cad.n.01 (noun.person) or chase.v.01.
    "#dog": "andiron.n.01+dog.n.01+frank.n.02+pawl.n.01",
    "#dogs": "andiron.n.01+dog.n.01+frank.n.02+pawl.n.01",  # Regular plural.
    "#mice": "mouse.n.01+mouse.n.04",  # Irregular plural; not shiner.n.01 (noun.state).
    "#icecream": "ice_cream.n.01",  # Compound: 'ice_cream'.
    "#firetruck": "fire_engine.n.01",  # Only the split 'fire_truck' is in WordNet.
    "#birthdaycakes": "birthday_cake.n.01",  # Plural compound: morphy('birthday_cakes').
    "#hotdog": "frank.n.02+hotdog.n.02",  # Not hotdog.n.01 (noun.person).
    "#crane": "crane.n.04+crane.n.05+grus.n.01",  # artifact, animal, object; not 2 persons.
    "#beach": "beach.n.01",  # noun.object (the listing's missing comma would drop it).
    "#sunset": "sunset.n.03",  # noun.event; not noun.time, noun.phenomenon, adjectives.
}


@pytest.mark.parametrize("hashtag, label", sorted(_CANONICAL.items()))
def test_canonical_hashtag_hand_checked(hashtag, label):
  assert vocabulary.canonical_hashtag(hashtag) == label
  assert vocabulary.get_synsets(hashtag) == frozenset(label.split("+"))


def test_eggplant_and_aubergine_are_one_label():
  assert vocabulary.canonical_hashtag("#eggplant") == vocabulary.canonical_hashtag("aubergine")


@pytest.mark.parametrize("hashtag", ["#newyork", "#love", "#selfie", "#qwertyuiop"])
def test_hashtags_without_allowed_synsets_are_dropped(hashtag):
  assert vocabulary.get_synsets(hashtag) == frozenset()
  assert vocabulary.canonical_hashtag(hashtag) is None


def test_newyork_is_dropped_by_the_lexname_filter():
  """'new_york' is in WordNet, but only as noun.location."""
  senses = wordnet.load().synsets("new_york")
  assert senses and {s.lexname() for s in senses} == {"noun.location"}
  assert vocabulary.get_synsets("#newyork") == frozenset()


def test_all_six_lexnames_are_allowed():
  lexnames = {wordnet.load().synset(name).lexname()
              for tag in ("#eggplant", "#crane", "#sunset") for name in vocabulary.get_synsets(tag)}
  assert lexnames == {"noun.food", "noun.plant", "noun.artifact", "noun.animal",
                      "noun.object", "noun.event"} == vocabulary.ALLOWED_LEXNAMES


@pytest.mark.parametrize("hashtag", ["#EggPlant", "EGGPLANT", "#Aubergine", "eggplant"])
def test_mixed_case_and_optional_hash(hashtag):
  assert vocabulary.canonical_hashtag(hashtag) == "eggplant.n.01+eggplant.n.02"


@pytest.mark.parametrize("hashtag", ["", "#", "ab", "#ox", "#OX"])
def test_shorter_than_three_characters_maps_to_nothing(hashtag):
  # 'ox' is a noun.animal in WordNet: only the length rule drops it.
  assert wordnet.load().synsets("ox")
  assert vocabulary.get_synsets(hashtag) == frozenset()


def test_non_string_hashtag_is_a_clear_error():
  with pytest.raises(TypeError, match="hashtag must be a str"):
    vocabulary.get_synsets(["dog"])


_SCRIPT = """
import json, sys
from bigpretrain.swag import vocabulary
tags = json.loads(sys.argv[1])
print(json.dumps([[vocabulary.canonical_hashtag(t), sorted(vocabulary.get_synsets(t))]
                  for t in tags]))
"""
_TAGS = sorted(_CANONICAL) + ["#newyork", "#cats", "#Apple", "#applepie", "#christmastree",
                              "#teddybear", "#sunflowers", "#seashells", "#mouse", "#geese",
                              "#catwalk", "#football", "#pizza", "#carrots", "#bananas"]


def test_canonicalisation_is_identical_under_two_hash_seeds():
  procs = [subprocess.Popen([sys.executable, "-c", _SCRIPT, json.dumps(_TAGS)], cwd=ROOT,
                            env=dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.PIPE, text=True)
           for seed in ("0", "1")]  # Side by side: each spends its time loading WordNet.
  outputs = [json.loads(proc.communicate(timeout=300)[0]) for proc in procs]
  assert [proc.returncode for proc in procs] == [0, 0]
  assert outputs[0] == outputs[1]
  here = [[vocabulary.canonical_hashtag(t), sorted(vocabulary.get_synsets(t))] for t in _TAGS]
  assert outputs[0] == here
  assert sum(label is not None for label, _ in here) >= len(_TAGS) - 2


# ------------------------------------------------------------------------------ importance


def test_importance_by_hand():
  # f(0) = 3, f(1) = 2, f(2) = 2 (image 4 lists label 2 twice: counted once).
  imp, tail = resampling.importance([[0], [0, 1], [1, 2], [0], [2, 2]], tail_threshold=3)
  np.testing.assert_allclose(imp, [3**-0.5, 2**-0.5, 2**-0.5, 3**-0.5, 2**-0.5])
  np.testing.assert_array_equal(tail, [False, True, True, False, True])
  assert imp.dtype == np.float64 and tail.dtype == np.bool_


def test_importance_head_is_at_least_the_threshold():
  labels = [[7], [7], [1000000], [1000000, 7]]  # Sparse ids; f = 3 and 2.
  _, tail = resampling.importance(labels, tail_threshold=2)
  assert not tail.any()  # f = 2 reaches the threshold: head.
  _, tail = resampling.importance(labels, tail_threshold=3)
  np.testing.assert_array_equal(tail, [False, False, True, True])
  _, tail = resampling.importance(labels, tail_threshold=0)
  assert not tail.any()


def test_importance_takes_numpy_label_arrays():
  imp, _ = resampling.importance([np.array([0, 1], np.int32), np.array([1])], 1)
  np.testing.assert_allclose(imp, [1.0, 2**-0.5])


@pytest.mark.parametrize("labels, threshold, match", [
    ([], 5, "empty"),
    ([[0], []], 5, "1 images have no labels"),
    ([[0], [-1]], 5, "-1 padding"),
    ([[0], [1.5]], 5, "must be ints"),
    ([[0]], -1, "tail_threshold must be an int >= 0"),
    ([[0]], True, "tail_threshold"),
    ([[0]], 2.5, "tail_threshold"),
])
def test_importance_bad_input(labels, threshold, match):
  with pytest.raises(ValueError, match=match):
    resampling.importance(labels, threshold)


# ------------------------------------------------------------------------------ sampling


def _toy(n=40, seed=0):
  rng = np.random.default_rng(seed)
  imp = rng.uniform(0.1, 1.0, n)
  tail = np.zeros(n, bool)
  tail[rng.permutation(n)[: n // 3]] = True
  return imp, tail


def test_head_share_within_one_percent_over_100k_draws():
  imp, tail = _toy()
  sampler = resampling.ResampledIndices(imp, tail, alpha=0.7, num_samples=10**9, seed=3)
  drawn = sampler[np.arange(100_000)]
  assert abs((~tail[drawn]).mean() - 0.7) < 0.01 * 0.7


@pytest.mark.parametrize("alpha, num_samples", [(0.7, 1000), (0.3, 997), (0.5, 1)])
def test_every_epoch_has_exactly_round_alpha_m_head_samples(alpha, num_samples):
  imp, tail = _toy()
  sampler = resampling.ResampledIndices(imp, tail, alpha=alpha, num_samples=num_samples,
                                        seed=0)
  for epoch in (0, 1, 5):
    drawn = sampler[np.arange(epoch * num_samples, (epoch + 1) * num_samples)]
    assert (~tail[drawn]).sum() == round(alpha * num_samples)


def test_every_host_gets_the_head_share():
  """Head and tail samples are spread at random, so no host's stride sees only one group
  (a periodic rule like floor((j + 1) alpha) > floor(j alpha) has period 10 at alpha 0.7)."""
  imp, tail = _toy()
  sampler = resampling.ResampledIndices(imp, tail, alpha=0.7, num_samples=10**9, seed=1)
  for p in range(10):
    host = sampler.for_host(p, 10)
    share = (~tail[host[np.arange(10_000)]]).mean()
    assert abs(share - 0.7) < 0.025, (p, share)


def test_draws_are_proportional_to_importance_within_each_group():
  imp, tail = _toy(n=30)
  imp[5] = 0.0  # Zero importance: never drawn.
  sampler = resampling.ResampledIndices(imp, tail, alpha=0.6, num_samples=200_000, seed=7)
  counts = np.bincount(sampler[np.arange(200_000)], minlength=30)
  assert counts[5] == 0
  for group, total in ((~tail, 120_000), (tail, 80_000)):
    group = group & (imp > 0)
    expected = total * imp[group] / imp[group].sum()
    assert counts[group].sum() == total
    assert stats.chisquare(counts[group], expected).pvalue > 1e-3
  # And not proportional to anything else: uniform draws would be rejected.
  head = ~tail & (imp > 0)
  uniform = np.full(head.sum(), 120_000 / head.sum())
  assert stats.chisquare(counts[head], uniform).pvalue < 1e-6


def test_deterministic_by_seed_and_position_and_resumes_mid_epoch():
  imp, tail = _toy()
  kw = {"alpha": 0.7, "num_samples": 1000}
  a = resampling.ResampledIndices(imp, tail, seed=5, **kw)
  epoch = a[np.arange(3000)]  # Three epochs.
  resumed = resampling.ResampledIndices(imp, tail, seed=5, **kw)  # A restarted process.
  np.testing.assert_array_equal(resumed[np.arange(1234, 3000)], epoch[1234:])
  np.testing.assert_array_equal(resumed[np.arange(2999, 499, -1)], epoch[500:][::-1])
  assert [resumed[j] for j in range(700, 720)] == epoch[700:720].tolist()  # Scalar = batch.
  assert isinstance(resumed[np.int64(3)], int)
  assert resumed[np.arange(12).reshape(3, 4)].shape == (3, 4)
  other = resampling.ResampledIndices(imp, tail, seed=6, **kw)
  assert (other[np.arange(1000)] != epoch[:1000]).mean() > 0.5
  assert (epoch[1000:2000] != epoch[:1000]).mean() > 0.5  # Each epoch is a new draw.
  assert len(a) == 1000 and list(a) == epoch[:1000].tolist()


def test_for_host_reads_global_sample_j_times_p_plus_p():
  imp, tail = _toy()
  sampler = resampling.ResampledIndices(imp, tail, alpha=0.7, num_samples=100, seed=2)
  everything = sampler[np.arange(300)]
  hosts = [sampler.for_host(p, 3) for p in range(3)]
  for p, host in enumerate(hosts):
    np.testing.assert_array_equal(host[np.arange(100)], everything[p::3])
    assert host[7] == everything[7 * 3 + p]
  assert sum(len(h) for h in hosts) == 100 and [len(h) for h in hosts] == [34, 33, 33]
  with pytest.raises(ValueError, match="process_index 3 must be < process_count 3"):
    sampler.for_host(3, 3)


def test_pipeline_reads_the_host_sampler_order():
  """input_pipeline's sampler hook: host p's stream position j reads source[host[j]]."""

  class Source(datasets.Source):
    def __init__(self, sampler):
      self.sampler = sampler

    def __len__(self):
      return 40

    def __getitem__(self, i):
      return {"id": i}

    def index_sampler(self, seed, process_index, process_count):
      return resampling.ResampledIndices(*_toy(), alpha=0.7, num_samples=100,
                                         seed=seed).for_host(process_index, process_count)

  source = Source(None)
  host = pipeline._host_sampler(source, 11, 1, 2)
  stream = pipeline._SampledStream(source, host)
  want = resampling.ResampledIndices(*_toy(), alpha=0.7, num_samples=100, seed=11)
  for j in range(5):
    index, record = stream[j]
    assert index == want[2 * j + 1] == record["id"]


def test_alpha_zero_or_one_needs_only_one_group():
  imp, tail = _toy()
  only_tail = resampling.ResampledIndices(imp[tail], tail[tail], alpha=0.0, num_samples=50,
                                          seed=0)
  assert len(set(only_tail[np.arange(50)].tolist())) > 1
  only_head = resampling.ResampledIndices(imp, np.zeros_like(tail), alpha=1.0,
                                          num_samples=50, seed=0)
  assert only_head[3] == int(only_head[np.array([3])][0])


@pytest.mark.parametrize("change, match", [
    ({"alpha": -0.1}, r"alpha \(the head share\) must be in \[0, 1\]"),
    ({"alpha": 1.5}, "alpha"),
    ({"alpha": float("nan")}, "alpha"),
    ({"alpha": True}, "alpha"),
    ({"num_samples": 0}, "num_samples must be an int >= 1"),
    ({"num_samples": 2**63}, "num_samples must be <= 2"),
    ({"seed": -1}, "seed must be an int >= 0"),
    ({"seed": 2**64}, "seed must be < 2"),
    ({"is_tail": np.zeros(40, bool)}, "no tail images"),
    ({"is_tail": np.ones(40, bool)}, "no head images"),
    ({"is_tail": np.zeros(40, int)}, "is_tail must be a bool array"),
    ({"is_tail": np.zeros(39, bool)}, "is_tail must be a bool array of shape"),
    ({"importance": -np.ones(40)}, "finite and >= 0"),
    ({"importance": np.full(40, np.nan)}, "finite and >= 0"),
    ({"importance": np.zeros(40)}, "positive importance"),
    ({"importance": np.ones((40, 1))}, "1-D"),
])
def test_sampler_bad_input(change, match):
  imp, tail = _toy()
  kw = {"importance": imp, "is_tail": tail, "alpha": 0.7, "num_samples": 10, "seed": 0}
  kw.update(change)
  with pytest.raises(ValueError, match=match):
    resampling.ResampledIndices(kw.pop("importance"), kw.pop("is_tail"), **kw)


def test_bad_sample_ids():
  sampler = resampling.ResampledIndices(*_toy(), alpha=0.7, num_samples=10, seed=0)
  with pytest.raises(IndexError, match="sample id must be in"):
    sampler[-1]
  with pytest.raises(IndexError, match="sample ids must be in"):
    sampler[np.array([0, -2])]
  with pytest.raises(TypeError, match="sample ids must be ints"):
    sampler[np.array([0.5])]
  with pytest.raises(IndexError, match=">= 0"):
    sampler.for_host(0, 2)[-1]


def test_resample_alpha_is_a_config_value():
  """SWAG appendix A's head share, config.data.resample_alpha (Table 4 ablates 0.5, 0.3)."""
  from configs import swag_regnety  # pylint: disable=import-outside-toplevel
  config = swag_regnety.get_config()
  assert config.data.resample_alpha == 0.7
  ds = datasets.get_dataset(config.data)
  for alpha in (0.7, 0.5, 0.3):
    cfg = {**config.data.to_dict(), "resample_alpha": alpha}
    source = datasets.train_sources(cfg, ds)[0][0]
    sampler = source.resampler(seed=0)
    assert sampler.num_head_samples == round(alpha * len(source))
  with pytest.raises(ValueError, match="resample_alpha"):
    datasets.train_sources({**config.data.to_dict(), "resample_alpha": 1.5}, ds)


def test_a_split_without_head_or_tail_images_is_refused_at_configure():
  """A dataset prepared with a tail_threshold above every hashtag's count has no head images:
  any head share is refused by name when the run is configured, not when the sampler starts."""
  from input_pipeline.sources import hashtag_source  # pylint: disable=import-outside-toplevel
  no_head = hashtag_source.HashtagSource(_Split(4), None, tail_threshold=5000,
                                         head_tail=(0, 4))
  with pytest.raises(ValueError, match=r"resample_alpha=0.7 draws head images.*"
                     r"tail_threshold=5000.*a lower --tail_threshold, or set resample_alpha=0"):
    no_head.configure({"resample_alpha": 0.7})
  assert no_head.configure({"resample_alpha": 0.0}).alpha == 0.0
  no_tail = hashtag_source.HashtagSource(_Split(4), None, tail_threshold=1, head_tail=(4, 0))
  with pytest.raises(ValueError, match=r"draws tail images.*a higher --tail_threshold.*=1\."):
    no_tail.configure({"resample_alpha": 0.5})
  assert no_tail.configure({"resample_alpha": 1.0}).alpha == 1.0


class _Split(list):
  """A stand-in record source: `n` records of split 'train'."""

  def __init__(self, n):
    super().__init__({"hashtag_ids": [0]} for _ in range(n))
    self.split = "train"


def test_label_index_is_read_by_host_slice_and_pickles_as_its_path(tmp_path):
  import pickle  # pylint: disable=import-outside-toplevel
  from input_pipeline.sources import hashtag_source  # pylint: disable=import-outside-toplevel
  lists = [np.array([3, 5]), np.array([1]), np.array([0, 2, 4]), np.array([5])]
  ids = np.concatenate(lists).astype(np.int32)
  offsets = np.array([0, 2, 3, 6, 7], np.int64)
  for save in (np.savez, np.savez_compressed):
    path = tmp_path / f"{save.__name__}.npz"
    save(path, ids=ids, offsets=offsets)
    index = hashtag_source.LabelIndex(path)
    assert len(index) == 4
    part = index.slice(1, 3)  # Images 1 and 2.
    np.testing.assert_array_equal(part.ids, [1, 0, 2, 4])
    np.testing.assert_array_equal(part.offsets, [0, 1, 4])
    assert len(pickle.dumps(index)) < 200 + len(str(path))
  # np.savez stores the arrays whole: they are mapped, not read.
  assert isinstance(hashtag_source.LabelIndex(tmp_path / "savez.npz")._load()[0], np.memmap)


def test_demo_vocabulary_counts_are_the_label_indexs_image_counts():
  """The resampler's f(h) comes from the vocabulary's 'images': the label index's count."""
  ds = datasets.get_dataset({"name": "hashtags:demo", "dir": ""})
  source = ds.source("train")
  labels = source._labels.slice(0, len(source))
  per_image = np.repeat(np.arange(len(labels)), np.diff(labels.offsets))
  distinct = np.unique(per_image * len(ds.label_counts) + labels.ids) % len(ds.label_counts)
  np.testing.assert_array_equal(np.bincount(distinct, minlength=len(ds.label_counts)),
                                ds.label_counts)
