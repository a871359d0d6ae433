"""Tests for the top-K selection rules (bigpretrain/selection) and the Beam selection job
(input_pipeline/jobs/selection_job.py).

The rules are checked against brute-force Python loops on random data with planted score ties;
the Beam job against topk.select / tags.select_with_tags on the same data, on one and two
workers, and against its naive Top.PerKey reference form.
"""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from bigpretrain.semisup import tags
from bigpretrain.semisup import topk
from bigpretrain.semantic import wordnet
from input_pipeline import prepare
from input_pipeline.jobs import selection_job
from input_pipeline import selection_formats

pytestmark = pytest.mark.beam  # Apache Beam jobs on the local FnApiRunner

ROOT = pathlib.Path(__file__).resolve().parent.parent
TWO_PROCESSES = ["--direct_num_workers=2", "--direct_running_mode=multi_processing"]
# Real wnids: golden retriever, dog, tench, crane (bird), crane (machine), tabby cat.
WNIDS = ["n02099601", "n02084071", "n01440764", "n02012849", "n03126707", "n02123045"]


def _random_top_p(rng, n, num_classes, p, levels=4):
  """ids (distinct, shuffled, some negative), classes [n, p] distinct per row, scores [n, p]
  on `levels` values so that ties are common."""
  ids = rng.choice(np.arange(-50, 10 * n), size=n, replace=False).astype(np.int64)
  classes = np.argsort(rng.random((n, num_classes)), axis=1)[:, :p].astype(np.int32)
  scores = (rng.integers(0, levels, (n, p)) / levels).astype(np.float32)
  return ids, classes, scores


def _brute_force(ids, classes, scores, k_of_class, num_classes):
  """{class: ids} by plain loops: candidates of each class sorted by (-score, id), first K."""
  out = {}
  for c in range(num_classes):
    candidates = []
    for row in range(len(ids)):
      for j in range(classes.shape[1]):
        if classes[row, j] == c:
          candidates.append((-float(scores[row, j]), int(ids[row])))
    out[c] = [i for _, i in sorted(candidates)[:k_of_class(c)]]
  return out


# ------------------------------------------------------------------------------------------
# The rules on arrays.


@pytest.mark.parametrize("seed,k", [(0, 3), (1, 7), (2, 1000)])
def test_balanced_ranked_matches_brute_force(seed, k):
  rng = np.random.default_rng(seed)
  ids, classes, scores = _random_top_p(rng, 200, 12, 3)
  got = topk.select(ids, classes, scores, k=k, num_classes=12)
  assert got == _brute_force(ids, classes, scores, lambda c: k, 12)
  # Ties really occur among the selected (so the id rule is exercised).
  assert any(len(set(scores[classes == c].tolist())) < (classes == c).sum() for c in range(12))
  # Input order does not matter.
  perm = rng.permutation(len(ids))
  assert topk.select(ids[perm], classes[perm], scores[perm], k=k, num_classes=12) == got
  # Class-size distribution: min(K, candidates) per class.
  candidates = np.bincount(classes.ravel(), minlength=12)
  assert [len(got[c]) for c in range(12)] == np.minimum(k, candidates).tolist()


def test_select_keys_and_image_in_several_classes():
  """Without num_classes the keys are the classes some image kept; an image may be chosen for
  several classes; equal scores go to the smaller id."""
  got = topk.select([5, 3, 9], [[0, 1], [1, 0], [4, 0]], [[0.5, 0.2], [0.5, 0.5], [0.9, 0.5]],
                    k=2)
  assert got == {0: [3, 5], 1: [3, 5], 4: [9]}


def test_unbalanced_ranked_matches_brute_force():
  rng = np.random.default_rng(3)
  ids, classes, scores = _random_top_p(rng, 300, 10, 4)
  sizes = {0: 5, 1: 0, 2: 40, 7: 1, 9: 100}  # Absent classes get 0.
  got = topk.select(ids, classes, scores, k=sizes, num_classes=10)
  assert got == _brute_force(ids, classes, scores, lambda c: sizes.get(c, 0), 10)
  zipf = topk.zipf_sizes(10, 300, seed=4)
  got = topk.select(ids, classes, scores, k=zipf, num_classes=10)
  assert got == _brute_force(ids, classes, scores, lambda c: int(zipf[c]), 10)
  candidates = np.bincount(classes.ravel(), minlength=10)
  assert [len(got[c]) for c in range(10)] == np.minimum(zipf, candidates).tolist()


def test_zipf_sizes_by_hand():
  # Quotas 100 * (1, 1/2, 1/3, 1/4) / (25/12) = 48, 24, 16, 12 exactly.
  assert topk.zipf_sizes(4, 100).tolist() == [48, 24, 16, 12]
  # Quotas 10 * (1, 1/2, 1/3) / (11/6) = 5.45, 2.73, 1.82: floors 5, 2, 1, then the two largest
  # remainders (rank 3: .82, rank 2: .73) get one more.
  assert topk.zipf_sizes(3, 10).tolist() == [5, 3, 2]
  # Equal quotas 3.33: the remainder goes to the better ranks.
  assert topk.zipf_sizes(3, 10, exponent=0).tolist() == [4, 3, 3]
  # Exponent 2: 1, 1/4, 1/9 over 49/36; total 1000 -> 734.69, 183.67, 81.63 -> 735, 184, 81.
  assert topk.zipf_sizes(3, 1000, exponent=2.0).tolist() == [735, 184, 81]


def test_zipf_sizes_total_and_seeded_order():
  by_rank = topk.zipf_sizes(1000, 8_000_000)
  assert by_rank.sum() == 8_000_000 and (np.diff(by_rank) <= 0).all()
  shuffled = topk.zipf_sizes(1000, 8_000_000, seed=7)
  assert sorted(shuffled.tolist(), reverse=True) == by_rank.tolist()
  assert (shuffled == topk.zipf_sizes(1000, 8_000_000, seed=7)).all()
  assert not (shuffled == by_rank).all()
  assert topk.zipf_sizes(5, 3).sum() == 3


def test_top_k_pairs_merges_in_any_grouping():
  """Top-K of the union == top-K of the union of top-Ks, for any split and order (what the Beam
  combiner relies on); also through TopKCombineFn's add/merge/extract."""
  rng = np.random.default_rng(5)
  m = 3000
  classes = rng.integers(0, 6, m)
  ids = rng.permutation(m).astype(np.int64)
  scores = (rng.integers(0, 5, m) / 5).astype(np.float32)
  k = np.array([0, 1, 10, 50, 400, 5000])
  want = topk.top_k_pairs(classes, ids, scores, k)
  parts = np.array_split(rng.permutation(m), 7)
  partial = [topk.top_k_pairs(classes[p], ids[p], scores[p], k) for p in parts]
  merged = topk.top_k_pairs(*(np.concatenate(x) for x in zip(*partial)), k)
  for a, b in zip(want, merged):
    assert (a == b).all()
  preds = selection_formats.Predictions("p", tuple("abcdef"), 1, "d", ("s",), ("x",), None)
  fn = selection_job.TopKCombineFn(k, preds)
  for c in range(6):
    accs = []
    for p in parts:
      acc = fn.create_accumulator()
      for chunk in np.array_split(p[classes[p] == c], 3):
        acc = fn.add_input(acc, (c, ids[chunk], scores[chunk]))
      accs.append(acc)
    got_ids, got_scores = fn.extract_output(fn.merge_accumulators(accs[::-1]))
    assert got_ids.tolist() == want[1][want[0] == c].tolist()
    assert got_scores.tolist() == want[2][want[0] == c].tolist()


@pytest.mark.parametrize("k", [0, 1, 7, 50, 299, 300, 301])
def test_top_k_unsorted_is_the_sorted_selection(k):
  """The O(M) partition path keeps exactly the set the sort keeps, ties at the K-th score
  included."""
  rng = np.random.default_rng(k)
  ids = rng.permutation(300) * 3 - 100
  scores = (rng.integers(0, 6, 300) / 6).astype(np.float32)
  keep = topk.top_k_unsorted(ids, scores, k)
  _, want_ids, _ = topk.top_k_pairs(np.zeros(300, np.int64), ids, scores, k)
  assert sorted(ids[keep].tolist()) == sorted(want_ids.tolist())
  assert len(keep) == min(k, 300)


def test_bad_arrays_are_rejected():
  with pytest.raises(ValueError, match="lists a class twice"):
    topk.select([1, 2], [[0, 0], [1, 2]], [[0.5, 0.4], [0.5, 0.4]], k=1)
  with pytest.raises(ValueError, match="id 1 appears twice"):
    topk.select([1, 1], [[0, 1], [1, 2]], [[0.5, 0.4], [0.5, 0.4]], k=1)
  with pytest.raises(ValueError, match="outside 0..2"):
    topk.select([1, 2], [[0, 3], [1, 2]], [[0.5, 0.4], [0.5, 0.4]], k=1, num_classes=3)
  with pytest.raises(ValueError, match="non-finite"):
    topk.select([1, 2], [[0, 1], [1, 2]], [[np.nan, 0.4], [0.5, 0.4]], k=1)
  with pytest.raises(ValueError, match="k=-1"):
    topk.select([1], [[0]], [[0.5]], k=-1)
  with pytest.raises(ValueError, match="num_classes"):
    topk.zipf_sizes(0, 10)


# ------------------------------------------------------------------------------------------
# Balanced-with-tags.


def _splitmix(x: int) -> int:
  mask = (1 << 64) - 1
  x = (x + 0x9E3779B97F4A7C15) & mask
  x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
  x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
  return x ^ (x >> 31)


def _brute_force_tags(ids, image_tags, wnids, k, seed):
  """Lemma matching and the seeded priority, written out with WordNet and Python ints."""
  wn = wordnet.load()
  lemmas = [{n.lower().replace("_", "") for n in wn.synset_from_pos_and_offset(
      "n", int(w[1:])).lemma_names()} for w in wnids]
  out = {}
  for c in range(len(wnids)):
    ranked = []
    for i, ts in zip(ids, image_tags):
      if any(t.lower().lstrip("#").replace("_", "") in lemmas[c] for t in ts):
        h = _splitmix(_splitmix(_splitmix(seed) ^ c) ^ (int(i) & ((1 << 64) - 1)))
        ranked.append((-(h >> 11), int(i)))
    out[c] = [i for _, i in sorted(ranked)[:k]]
  return out


def _random_tags(rng, n):
  vocab = ["#GoldenRetriever", "golden_retriever", "dog", "#Dog", "domestic_dog", "tench",
           "Tinca_tinca", "crane", "tabby", "#TabbyCat", "sunset", "beach", "#nofilter"]
  return [list(rng.choice(vocab, size=rng.integers(0, 4), replace=False)) for _ in range(n)]


def test_tag_lemma_matching():
  lemmas = tags.class_lemmas(WNIDS)
  assert lemmas["goldenretriever"] == (0,)
  assert lemmas["dog"] == (1,) and lemmas["domesticdog"] == (1,)
  assert lemmas["crane"] == (3, 4)  # The bird and the machine: an ambiguous tag maps to both.
  classes, ids = tags.tag_pairs([7, 8, 9], [["#GoldenRetriever", "beach"], ["Crane", "crane"],
                                            []], lemmas)
  assert list(zip(classes.tolist(), ids.tolist())) == [(0, 7), (3, 8), (4, 8)]
  with pytest.raises(ValueError, match="not a WordNet 3.0 synset"):
    tags.class_lemmas(["n99999999"])


@pytest.mark.parametrize("seed,k", [(0, 2), (11, 5), (3, 1000)])
def test_balanced_with_tags_matches_brute_force(seed, k):
  rng = np.random.default_rng(seed)
  ids = rng.choice(np.arange(-20, 2000), size=150, replace=False)
  image_tags = _random_tags(rng, 150)
  got = tags.select_with_tags(ids, image_tags, WNIDS, k=k, seed=seed)
  assert got == _brute_force_tags(ids, image_tags, WNIDS, k, seed)
  perm = rng.permutation(150)
  assert tags.select_with_tags(ids[perm], [image_tags[i] for i in perm], WNIDS, k=k,
                               seed=seed) == got
  # Class-size distribution: min(K, images whose tags map to the class).
  lemmas = tags.class_lemmas(WNIDS)
  have = [sum(any(c in lemmas.get(tags.normalize(t), ()) for t in ts) for ts in image_tags)
          for c in range(len(WNIDS))]
  assert [len(got[c]) for c in range(len(WNIDS))] == np.minimum(k, have).tolist()


def test_tags_draw_depends_on_the_seed_and_is_uniform():
  ids = np.arange(400)
  image_tags = [["dog"]] * 400
  a = tags.select_with_tags(ids, image_tags, WNIDS, k=100, seed=0)[1]
  b = tags.select_with_tags(ids, image_tags, WNIDS, k=100, seed=1)[1]
  assert a != b and len(set(a)) == 100
  # Uniform without replacement: about a quarter of each quarter of the ids (sd ~ 4.3).
  per_quarter = np.bincount(np.asarray(a) // 100, minlength=4)
  assert (np.abs(per_quarter - 25) < 15).all(), per_quarter


# ------------------------------------------------------------------------------------------
# The Beam job.

C, P = 9, 3
SPLITS = ("unlabeled", "train")


@pytest.fixture(scope="module")
def predictions(tmp_path_factory):
  """Three shards over two splits (the same record indices in both, with equal scores on some
  rows, so ties cross splits), and their in-memory arrays keyed by packed ids."""
  root = tmp_path_factory.mktemp("predictions")
  rng = np.random.default_rng(0)
  all_ids, all_classes, all_scores, all_tags = [], [], [], []
  names = sorted(SPLITS)  # Key order: 'train' < 'unlabeled'.
  for shard, (split, start, n) in enumerate([("unlabeled", 0, 150), ("train", 1000, 120),
                                             ("unlabeled", 150, 90)]):
    index = rng.permutation(np.arange(start, start + n))
    classes = np.argsort(rng.random((n, C)), axis=1)[:, :P].astype(np.int32)
    scores = (rng.integers(0, 4, (n, P)) / 4).astype(np.float32)
    if split == "train":  # Rows that duplicate unlabeled rows' predictions: cross-split ties.
      u_classes, u_scores = all_classes[0], all_scores[0]
      order = np.argsort(all_ids[0])[:40]
      classes[:40], scores[:40] = u_classes[order], u_scores[order]
      index[:40] = selection_job.unpack_ids(all_ids[0][order])[1]
    image_tags = _random_tags(rng, n)
    selection_formats.write_predictions(root / f"shard-{shard}.parquet", "demo", split, index, classes,
                                scores, image_tags)
    all_ids.append(selection_job.pack_ids(names.index(split), index))
    all_classes.append(classes)
    all_scores.append(scores)
    all_tags.extend(image_tags)
  class_names = list(WNIDS) + ["n02124075", "n02123159", "n02123394"]  # Cats.
  selection_formats.write_info(root, class_names=class_names, top_p=P, dataset="demo", splits=SPLITS,
                       num_records=360)
  return {"dir": str(root), "ids": np.concatenate(all_ids), "tags": all_tags,
          "classes": np.concatenate(all_classes), "scores": np.concatenate(all_scores),
          "class_names": class_names}


def _keys(selected: dict) -> dict:
  """{class: packed ids} -> {class: [(dataset, split, index)]}."""
  names = sorted(SPLITS)
  out = {}
  for c, ids in selected.items():
    rank, index = selection_job.unpack_ids(np.asarray(ids, np.int64))
    out[c] = [("demo", names[r], i) for r, i in zip(rank.tolist(), index.tolist())]
  return out


def _run(predictions, out, **kwargs):
  kwargs.setdefault("batch_size", 16)  # Many partial top-Ks to merge.
  info = selection_job.prepare(predictions["dir"], out, **kwargs)
  return info, selection_job.read_index(out)[1]


@pytest.mark.parametrize("options", [None, TWO_PROCESSES], ids=["1_worker", "2_processes"])
def test_beam_balanced_equals_select(predictions, tmp_path, options, monkeypatch):
  # With no runner named the job runs on the FnApiRunner; the DirectRunner would first try
  # Prism (a binary fetched from GitHub) and fall back to it after an error.
  from apache_beam.runners.portability import prism_runner  # pylint: disable=import-outside-toplevel
  tried = []

  def no_prism(*args):
    tried.append(args)
    raise RuntimeError("Prism is not the jobs' local runner")
  monkeypatch.setattr(prism_runner.PrismRunner, "run_pipeline", no_prism)
  k = 30
  info, table = _run(predictions, tmp_path / "out", k=k, beam_options=options)
  assert not tried
  want = topk.select(predictions["ids"], predictions["classes"], predictions["scores"], k=k,
                     num_classes=C)
  assert want == _brute_force(predictions["ids"], predictions["classes"], predictions["scores"],
                              lambda c: k, C)
  assert selection_job.selected_ids(info, table) == _keys(want)
  # Planted cross-split ties were selected and ordered by the key: 'train' before 'unlabeled'.
  tied = [(v.index(("demo", "train", i)), v.index(("demo", "unlabeled", i)))
          for v in selection_job.selected_ids(info, table).values() for (_, s, i) in v
          if s == "train" and ("demo", "unlabeled", i) in v]
  assert tied and all(a < b for a, b in tied)
  # Index rows: sorted by (label, rank), scores the teacher's.
  label, rank = table.column("label").to_numpy(), table.column("rank").to_numpy()
  assert (np.diff(label) >= 0).all() and (rank == topk.ranks(label)).all()
  score_of = {(int(i), int(c)): s for i, cs, ss in zip(
      predictions["ids"], predictions["classes"], predictions["scores"]) for c, s in zip(cs, ss)}
  ids = selection_job.pack_ids([sorted(SPLITS).index(s) for s in table.column("split").to_pylist()],
                           table.column("index").to_numpy())
  assert table.column("score").to_numpy().tolist() == [
      score_of[(i, c)] for i, c in zip(ids.tolist(), label.tolist())]
  report = info["report"]
  candidates = np.bincount(predictions["classes"].ravel(), minlength=C)
  assert report["num_records"] == 360
  assert report["candidates"] == candidates.tolist()
  assert report["counts"] == [len(want[c]) for c in range(C)]
  assert report["num_selected"] == len(table) == sum(report["counts"])
  assert report["thresholds"] == [score_of[(want[c][-1], c)] for c in range(C)]


def test_beam_naive_reference_equals_combiner(predictions, tmp_path):
  k = np.array([0, 1, 2, 5, 30, 60, 100, 200, 400])
  sizes = {n: int(v) for n, v in zip(predictions["class_names"], k)}
  info, table = _run(predictions, tmp_path / "fast", variant="unbalanced_ranked",
                     class_sizes=sizes)
  naive_info, naive_table = _run(predictions, tmp_path / "naive", variant="unbalanced_ranked",
                                 class_sizes=sizes, naive=True)
  assert naive_table.equals(table)
  assert naive_info["report"] == info["report"]
  want = topk.select(predictions["ids"], predictions["classes"], predictions["scores"], k=k)
  assert selection_job.selected_ids(info, table) == _keys({c: want.get(c, []) for c in range(C)})


def test_beam_zipf_and_shortfall_report(predictions, tmp_path):
  """K larger than some classes can give: reported as the shortfall, not an error."""
  total = 900
  info, table = _run(predictions, tmp_path / "out", variant="unbalanced_ranked",
                     zipf_total=total, seed=3)
  k = topk.zipf_sizes(C, total, seed=3)
  want = topk.select(predictions["ids"], predictions["classes"], predictions["scores"], k=k,
                     num_classes=C)
  assert selection_job.selected_ids(info, table) == _keys(want)
  report = info["report"]
  candidates = np.bincount(predictions["classes"].ravel(), minlength=C)
  counts = np.minimum(k, candidates)
  assert report["requested"] == k.tolist() and report["num_requested"] == total
  assert report["counts"] == counts.tolist()
  short = np.flatnonzero(k > candidates)
  assert short.size  # Zipf's head asks for more than 360 * 3 / 9 candidates.
  assert report["shortfall"]["num_classes"] == short.size
  assert report["shortfall"]["num_missing"] == int((k - counts)[short].sum())
  assert report["shortfall"]["classes"] == {
      predictions["class_names"][c]: {"requested": int(k[c]), "selected": int(counts[c]),
                                      "candidates": int(candidates[c])} for c in short}
  assert report["num_full_classes"] == C - short.size
  hist = report["class_size_histogram"]
  edges = np.linspace(0, k.max(), 11)
  assert np.allclose(hist["edges"], edges)
  assert hist["num_classes"] == np.histogram(counts, bins=edges)[0].tolist()
  assert selection_job.summary(info, tmp_path / "out").count("shortfall:") == 1


def test_beam_with_tags_equals_select_with_tags(predictions, tmp_path):
  info, table = _run(predictions, tmp_path / "out", variant="balanced_with_tags", k=20, seed=5)
  want = tags.select_with_tags(predictions["ids"], predictions["tags"],
                               predictions["class_names"], k=20, seed=5)
  assert selection_job.selected_ids(info, table) == _keys(want)
  assert info["report"]["counts"] == [len(want[c]) for c in range(C)]


def test_cli_under_another_hash_seed_writes_the_same_selection(predictions, tmp_path):
  """The documented command in a fresh process (another PYTHONHASHSEED, default batch size)
  writes the same index and report as the in-process run (batches of 16 rows); a second run
  reuses it."""
  _run(predictions, tmp_path / "here", variant="balanced_with_tags", k=20, seed=5)
  env = dict(os.environ, PYTHONHASHSEED="12345")
  command = [sys.executable, "-m", "input_pipeline.prepare", "selection",
             f"--predictions={predictions['dir']}", f"--data_dir={tmp_path / 'there'}",
             "--variant=balanced_with_tags", "--k=20", "--seed=5"]
  run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  assert "|D-hat| = " in run.stdout
  here = json.loads((tmp_path / "here" / "selection.json").read_text())
  there = json.loads((tmp_path / "there" / "selection.json").read_text())
  assert here["report"] == there["report"] and here["index_files"] == there["index_files"]
  for name in here["index_files"]:
    assert pq.read_table(tmp_path / "here" / name).equals(pq.read_table(tmp_path / "there" / name))
  assert prepare.main(command[3:]) == 0  # Reused: same parameters.


def test_bad_input_gets_clear_errors(predictions, tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    selection_job.prepare(tmp_path / "nowhere", tmp_path / "out", k=1)
  with pytest.raises(ValueError, match="another class list: 9 classes, 9 expected; first "
                     "difference: label 2 is 'n01440764' there, 'n01443537' expected"):
    expected = list(predictions["class_names"])
    expected[2] = "n01443537"
    selection_job.prepare(predictions["dir"], tmp_path / "out", k=1,
                      expected_class_names=expected)
  with pytest.raises(ValueError, match="takes exactly one of --class_sizes"):
    selection_job.prepare(predictions["dir"], tmp_path / "out", variant="unbalanced_ranked", k=3)
  for k in (0, -1, 2.5):  # K = 0 selected nothing and reported success.
    with pytest.raises(ValueError, match=rf"k={k}: K images per class must be an integer >= 1"):
      selection_job.prepare(predictions["dir"], tmp_path / "out", k=k)
  with pytest.raises(ValueError, match=r"zipf_total=0 must be an integer >= 1"):
    selection_job.prepare(predictions["dir"], tmp_path / "out", variant="unbalanced_ranked",
                          zipf_total=0)
  with pytest.raises(ValueError, match="teacher does not have"):
    selection_job.prepare(predictions["dir"], tmp_path / "out", variant="unbalanced_ranked",
                      class_sizes={"n00000000": 3})
  first = predictions["class_names"][0]
  with pytest.raises(ValueError, match=rf"each K must be an int >= 0; got \{{'{first}': -4\}}"):
    selection_job.prepare(predictions["dir"], tmp_path / "out", variant="unbalanced_ranked",
                          class_sizes={first: -4})  # Named as written, not by its index.
  # Fewer records than predictions.json announces: unfinished inference.
  partial = tmp_path / "partial"
  partial.mkdir()
  (partial / selection_formats.INFO_FILE).write_text(
      (pathlib.Path(predictions["dir"]) / selection_formats.INFO_FILE).read_text())
  selection_formats.write_predictions(partial / "a.parquet", "demo", "train", [0, 1], [[0, 1, 2]] * 2,
                              [[0.5, 0.3, 0.2]] * 2)
  with pytest.raises(ValueError, match="num_records=360"):
    selection_job.prepare(partial, tmp_path / "out_partial", k=1)
  # The same image twice (e.g. an inference shard written twice).
  selection_formats.write_predictions(partial / "b.parquet", "demo", "train", [1], [[2, 1, 0]],
                              [[0.5, 0.3, 0.2]])
  with pytest.raises(Exception, match=r"Image \(demo, train, 1\) appears more than once"):
    selection_job.prepare(partial, tmp_path / "out_twice", k=3)
  # A row of a split predictions.json does not list.
  selection_formats.write_predictions(partial / "b.parquet", "demo", "validation", [1], [[2, 1, 0]],
                              [[0.5, 0.3, 0.2]])
  with pytest.raises(Exception, match="row of split 'validation'"):
    selection_job.prepare(partial, tmp_path / "out_split", k=1)


def test_tags_variant_needs_wnids_and_tags(tmp_path):
  pred = tmp_path / "pred"
  pred.mkdir()
  selection_formats.write_predictions(pred / "a.parquet", "demo", "train", [0, 1], [[0, 1]] * 2,
                              [[0.6, 0.4]] * 2)  # No tags column.
  selection_formats.write_info(pred, class_names=["cat", "dog"], top_p=2, dataset="demo",
                       splits=["train"])
  with pytest.raises(ValueError, match="class names must be wnids"):
    selection_job.prepare(pred, tmp_path / "out", variant="balanced_with_tags", k=1)
  selection_formats.write_info(pred, class_names=WNIDS[:2], top_p=2, dataset="demo", splits=["train"])
  with pytest.raises(Exception, match=r"has no column\(s\) \['tags'\]"):
    selection_job.prepare(pred, tmp_path / "out", variant="balanced_with_tags", k=1)


def test_rerun_with_other_parameters_is_an_error(predictions, tmp_path):
  _run(predictions, tmp_path / "out", k=2)
  with pytest.raises(ValueError, match="other parameters"):
    _run(predictions, tmp_path / "out", k=3)


def test_beam_on_dask_equals_local_runner(predictions, tmp_path, dask_beam):
  """Two dask worker processes write the local runner's index and report."""
  runner, options = dask_beam
  info, table = _run(predictions, tmp_path / "direct", variant="balanced_with_tags", k=20,
                     seed=5)
  dask_info, dask_table = _run(predictions, tmp_path / "dask", variant="balanced_with_tags",
                               k=20, seed=5, beam_runner=runner, beam_options=options)
  assert dask_table.equals(table) and len(table)
  assert dask_info == info
