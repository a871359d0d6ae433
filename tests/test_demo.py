"""Tests for the demo dataset (input_pipeline/sources/demo.py) and dataset lookup (datasets.py)."""
import colorsys
import io
import os
import pathlib
import pickle
import subprocess
import sys
import textwrap

import ml_collections
import numpy as np
from PIL import Image
import pytest
import tensorflow_datasets as tfds

from bigpretrain.semantic import tree as tree_lib
from bigpretrain.semantic import wordnet
from input_pipeline import datasets
from input_pipeline.sources import demo

pytestmark = pytest.mark.slow  # end-to-end recipe runs

_ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = {"train": 6, "validation": 3, "unlabeled": 2}


def _decode(png: bytes) -> np.ndarray:
  return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


@pytest.fixture(scope="module")
def full():
  """The default demo in the shared test cache (generated once, then reused)."""
  return datasets.get_dataset(ml_collections.ConfigDict({"name": "demo", "dir": ""}))


@pytest.fixture(scope="module")
def full_records(full):
  sources = {s: full.source(s) for s in ("train", "validation")}
  return {s: src.__getitems__(range(len(src))) for s, src in sources.items()}


@pytest.fixture(scope="module")
def classes():
  return demo.DemoClasses()


def _wn_tags(wnid):
  """Lemma tags written independently of demo.hashtag: lower case, no separators."""
  return {l.name().lower().replace("_", "").replace("-", "")
          for l in wordnet.synset_from_wnid(wnid).lemmas()}


# ---------------------------------------------------------------------------- class list


def test_wnid_list_is_reproducible_hierarchical_and_closed_under_parent():
  shipped = demo.load_wnids()
  assert demo.select_wnids() == shipped  # The documented generator gives the shipped file.
  assert len(shipped) == sum(demo.LEVEL_COUNTS) == 100
  assert shipped == sorted(set(shipped))
  all_wnids = (_ROOT / "bigpretrain/semantic/data/imagenet21k_p_wnids.txt").read_text().split()
  assert set(shipped) <= set(all_wnids)
  sub = tree_lib.SemanticTree.from_wnids(shipped)
  assert sub.num_levels >= 4
  assert all(len(c) >= 2 for c in sub.level_classes)
  assert sub.level_sizes.tolist() == list(demo.LEVEL_COUNTS)
  # Each class's parent in the 11k-class tree is in the demo and is its demo parent.
  full = tree_lib.SemanticTree.from_wnids(all_wnids)
  index = {w: i for i, w in enumerate(all_wnids)}
  for c, w in enumerate(shipped):
    p_full = int(full.parent[index[w]])
    p_sub = int(sub.parent[c])
    assert (p_full == -1) == (p_sub == -1), w
    if p_full != -1:
      assert all_wnids[p_full] == shipped[p_sub], w


def test_class_attributes_by_hand():
  # 0 and 4 are roots; 1, 2 children of 0; 3 child of 1; 5 child of 3.
  parent = np.array([-1, 0, 0, 1, -1, 3])
  want = np.array([
      [0, -1, -1, -1, -1],
      [0, 0, -1, -1, -1],
      [0, 1, -1, -1, -1],
      [0, 0, 0, -1, -1],
      [1, -1, -1, -1, -1],
      [0, 0, 0, 0, -1],
  ])
  np.testing.assert_array_equal(demo.class_attributes(parent), want)
  with pytest.raises(ValueError, match="level 5"):
    demo.class_attributes(np.array([-1, 0, 1, 2, 3, 4]))


def test_hashtag_format():
  assert demo.hashtag("golden_retriever") == "goldenretriever"
  assert demo.hashtag("Dog") == "dog"
  assert demo.hashtag("self-propelled") == "selfpropelled"
  assert demo.hashtag("canis_familiaris_x") is None  # Three words.
  assert demo.hashtag("lady's_slipper") is None
  assert demo.hashtag("ox") is None  # Too short.


def test_truncation_changes_labels_only(classes):
  deep = int(np.flatnonzero(classes.tree.class_depth == 4)[0])
  index = deep * demo.SPLIT_SIZES["train"]
  exact = classes.example("train", index, truncation=0.0)
  always = classes.example("train", index, truncation=1.0)
  assert exact["image"] == always["image"] and exact["hashtags"] == always["hashtags"]
  assert exact["label"] == exact["true_label"] == deep
  assert always["label"] in classes.ancestors[deep]
  val = classes.example("validation", deep * demo.SPLIT_SIZES["validation"], truncation=1.0)
  assert val["label"] == deep  # Validation labels are never truncated.
  with pytest.raises(IndexError, match="outside split"):
    classes.example("validation", 100 * demo.SPLIT_SIZES["validation"])


def _subtree_leaves(parent: np.ndarray, c: int) -> set[int]:
  """Classes under c (or c) that are nobody's parent, from the parent array alone."""
  parent = np.asarray(parent)
  leaves = set()
  for k in range(len(parent)):
    if (parent == k).any():
      continue
    a = k
    while a != -1 and a != c:
      a = int(parent[a])
    if a == c:
      leaves.add(k)
  return leaves


def test_inner_classes_picture_a_leaf_of_their_subtree(classes):
  """The `members` rule: an inner class's image is exactly the look of one leaf of its
  subtree (rendered with the example's own rng), its label stays the inner class, and the
  drawn leaf depends on the data seed only through (seed, split, index)."""
  depth, parent = classes.tree.class_depth, classes.tree.parent
  has_child = np.isin(np.arange(classes.num_classes), parent)
  # An inner class at each of levels 0, 1 and 3.
  inner = [int(np.flatnonzero((depth == d) & has_child)[0]) for d in (0, 1, 3)]
  for split in ("train", "validation"):
    per_class = demo.SPLIT_SIZES[split]
    for c in inner:
      leaves = sorted(_subtree_leaves(parent, c))
      assert len(leaves) >= 2
      members = set()
      for index in range(c * per_class, c * per_class + 12):
        record = classes.example(split, index)
        image = _decode(record["image"])
        # Which leaf looks are this image? Render every leaf of the subtree with the
        # example's rng and compare pixels.
        same = [leaf for leaf in leaves if np.array_equal(image, _decode(demo.png_bytes(
            demo.render(classes.attrs[leaf], classes.num_roots,
                        np.random.default_rng([0, demo.SPLIT_IDS[split], index])))))]
        assert same == [record["member"]], (c, index, same)
        members.add(record["member"])
        assert record["true_label"] == c
        if split == "validation":
          assert record["label"] == c
        else:
          assert record["label"] == c or record["label"] in classes.ancestors[c]
        assert classes.example(split, index) == record  # Deterministic.
        # The plain look draws the class itself.
        plain = classes.example(split, index, look="plain")
        assert plain["member"] == c and plain["image"] != record["image"]
      assert len(members) >= 2, (c, members)  # Different examples, different members.
  # Another data seed draws other members for the same examples.
  c, per_class = inner[0], demo.SPLIT_SIZES["validation"]
  seeds = [[classes.example("validation", i, seed=s)["member"]
            for i in range(c * per_class, c * per_class + 12)] for s in (0, 1)]
  assert seeds[0] != seeds[1]
  # A leaf's examples are the same under both looks.
  leaf = int(np.flatnonzero(~has_child)[0])
  index = leaf * demo.SPLIT_SIZES["train"] + 5
  assert classes.example("train", index) == classes.example("train", index, look="plain")
  assert classes.example("train", index)["member"] == leaf


def test_members_are_uniform_over_the_subtree_leaves(classes):
  """Over many examples of a root, every leaf under it is pictured about equally often."""
  root = int(classes.tree.level_classes[0][0])
  leaves = _subtree_leaves(classes.tree.parent, root)
  draws = [classes.member(root, "train", i) for i in range(4000)]
  counts = np.array([draws.count(leaf) for leaf in sorted(leaves)])
  assert counts.sum() == len(draws)  # Nothing outside the subtree's leaves.
  expected = len(draws) / len(leaves)
  assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected)), counts
  with pytest.raises(ValueError, match="Unknown demo look"):
    classes.member(root, "train", 0, look="fancy")


# ----------------------------------------------------------------------- the built demo


def test_full_demo_sizes_classes_and_records(full):
  info = full.info
  assert info.name == "demo" and info.image_size == 32
  assert info.num_classes == 100 and info.class_names == demo.load_wnids()
  assert info.num_examples == {s: n * 100 for s, n in demo.SPLIT_SIZES.items()}
  assert set(info.splits) == {"train", "validation", "unlabeled"}
  src = full.source("unlabeled")
  assert len(src) == 5000
  rec = src[17]
  assert isinstance(rec["image"], bytes) and rec["image"][:8] == b"\x89PNG\r\n\x1a\n"
  assert _decode(rec["image"]).shape == (32, 32, 3)
  assert isinstance(rec["label"], int) and rec["label"] == rec["true_label"]
  assert rec["hashtags"] and all(isinstance(t, str) for t in rec["hashtags"])
  clone = pickle.loads(pickle.dumps(src))  # grain workers receive the source pickled.
  assert clone[17] == rec and len(clone) == len(src)
  assert [r["label"] for r in src.__getitems__([3, 1])] == [src[3]["label"], src[1]["label"]]


def test_truncated_labels_are_ancestors_at_the_configured_share(full_records, classes):
  parent = classes.tree.parent
  truncated = eligible = 0
  for r in full_records["train"]:
    c, label = r["true_label"], r["label"]
    ancestors = []
    a = int(parent[c])
    while a != -1:
      ancestors.append(a)
      a = int(parent[a])
    if ancestors:
      eligible += 1
      truncated += label != c
      assert label == c or label in ancestors
    else:
      assert label == c
  share = truncated / eligible
  # Binomial std at p=0.2, n~19k is 0.003.
  assert abs(share - demo.DEFAULT_TRUNCATION) < 0.015, share
  assert all(r["label"] == r["true_label"] for r in full_records["validation"])


def test_hashtags_name_the_class_or_an_ancestor(full_records, classes):
  wnids = classes.wnids
  for r in full_records["validation"]:
    c = r["true_label"]
    lineage = {c}
    a = int(classes.tree.parent[c])
    while a != -1:
      lineage.add(a)
      a = int(classes.tree.parent[a])
    allowed = set().union(*(_wn_tags(wnids[k]) for k in lineage))
    assert allowed & set(r["hashtags"]), (wnids[c], r["hashtags"])
    assert len(r["hashtags"]) == len(set(r["hashtags"]))


def test_background_hue_follows_the_root_and_shape_colour_the_level2_ancestor(
    full_records, classes):
  """Corner pixels are background: hue = root rank / #roots. Depth-2 leaves (no texture or
  bar) have their palette colour at the centre."""
  by_class = {}
  for r in full_records["validation"]:
    by_class.setdefault(r["true_label"], []).append(_decode(r["image"]).astype(np.float64))
  num_roots = len(classes.tree.level_classes[0])
  roots = classes.tree.target_table[:, 0]
  palette = np.array(demo._COLOURS, dtype=np.float64)  # pylint: disable=protected-access
  for c, images in by_class.items():
    images = np.stack(images)
    corners = images[:, [0, 0, -2, -2], [0, -2, 0, -2]].mean(axis=(0, 1)) / 255.0
    hue = colorsys.rgb_to_hsv(*corners)[0]
    rank = int(np.flatnonzero(classes.tree.level_classes[0] == roots[c])[0])
    want = rank / num_roots
    assert min(abs(hue - want), 1 - abs(hue - want)) < 0.04, (c, hue, want)
    if classes.tree.class_depth[c] == 2 and classes.leaves[c] == [c]:
      centre = images[:, 15:17, 15:17].mean(axis=(0, 1, 2))
      sibling_rank = classes.attrs[c, 2]
      nearest = np.argmin(((palette - centre) ** 2).sum(-1))
      assert nearest == sibling_rank + 1, (c, centre)
  # Different roots -> clearly different backgrounds.
  assert num_roots >= 2


def test_learnable_nearest_class_mean_well_above_chance(full_records):
  """Nearest class mean on raw pixels, trained on the (truncated) train labels, scored on the
  validation images of leaf classes (an inner class's image pictures a leaf, so its exact
  label cannot be read off the picture)."""
  def arrays(records):
    x = np.stack([_decode(r["image"]) for r in records]).reshape(len(records), -1) / 255.0
    return x.astype(np.float32), np.array([r["label"] for r in records])
  xt, yt = arrays(full_records["train"][:8000])
  xv, yv = arrays([r for r in full_records["validation"] if r["member"] == r["true_label"]])
  means = np.stack([xt[yt == c].mean(0) for c in range(100)])
  dist = (xv ** 2).sum(1, keepdims=True) - 2 * xv @ means.T + (means ** 2).sum(1)
  accuracy = (dist.argmin(1) == yv).mean()
  assert accuracy > 0.3, accuracy  # Chance is 0.01.


# -------------------------------------------- small builds: lock, determinism, tfds: names


_PREPARE = textwrap.dedent("""
    import sys
    from input_pipeline.sources import demo
    real = demo.BigpretrainDemo.download_and_prepare
    def counted(self, *a, **k):
      with open(sys.argv[2], "a") as f:
        f.write("generated\\n")
      return real(self, *a, **k)
    demo.BigpretrainDemo.download_and_prepare = counted
    b = demo.prepare(sys.argv[1], truncation=0.5, split_sizes={split_sizes!r})
    print(b.info.splits["train"].num_examples)
""").format(split_sizes=SMALL)


def _all_records(builder):
  """Every record of every split, in file order, image bytes undecoded."""
  out = {}
  for split in demo.SPLIT_SIZES:
    src = builder.as_data_source(split, decoders={"image": tfds.decode.SkipDecoding()})
    out[split] = [{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in r.items()}
                  for r in src.__getitems__(range(len(src)))]
  return out


def test_concurrent_prepare_generates_once_and_bytes_are_reproducible(tmp_path):
  shared = tmp_path / "shared"
  log = tmp_path / "generations.txt"
  procs = []
  for seed in ("1", "2"):  # Different hash seeds must not change a single byte.
    env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(_ROOT))
    procs.append(subprocess.Popen(
        [sys.executable, "-c", _PREPARE, str(shared), str(log)], env=env, cwd=_ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  for p in procs:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    assert out.split()[-1] == str(SMALL["train"] * 100)
  assert log.read_text().count("generated") == 1
  # The same dataset again, in this process and another folder: identical records in the
  # same order. (The files' bytes are not compared: protobuf orders the tf.Example feature
  # map differently in each process.)
  here = demo.prepare(tmp_path / "again", truncation=0.5, split_sizes=SMALL)
  there = demo.prepare(shared, truncation=0.5, split_sizes=SMALL)
  assert _all_records(here) == _all_records(there)
  assert here.builder_config.name == "trunc50_train6_validation3_unlabeled2"
  # Read through `tfds:` lookup: a prepared dataset in a given dir.
  ds = datasets.get_dataset({"name": f"tfds:bigpretrain_demo/{here.builder_config.name}",
                             "dir": str(tmp_path / "again")})
  assert ds.info.num_examples == {"train": 600, "validation": 300, "unlabeled": 200}
  train = ds.source("train")
  labels = np.array([train[i]["label"] for i in range(len(train))])
  true = np.array([train[i]["true_label"] for i in range(len(train))])
  assert 0.25 < (labels != true).mean() < 0.7  # 50% of the 96% non-root examples.


def test_demo_variant_names(tmp_path):
  small = demo.prepare(tmp_path, truncation=0.0, split_sizes=SMALL)
  recs = small.as_data_source("train")
  assert all(recs[i]["label"] == recs[i]["true_label"] for i in range(len(recs)))
  assert demo.config_name(0.2) == "trunc20"
  assert demo.config_name(0.125) == "trunc12.5"
  assert demo.config_name(0.2, look="plain") == "plain_trunc20"
  with pytest.raises(ValueError, match="Unknown demo look"):
    demo.config_name(0.2, look="fancy")
  with pytest.raises(ValueError, match="demo_plain/truncNN"):
    datasets.get_dataset({"name": "demo_plain/half", "dir": str(tmp_path)})
  assert demo.is_demo_name("demo_plain/trunc35") and not demo.is_demo_name("demo_coarse")
  with pytest.raises(ValueError, match="truncation must be in"):
    demo.config_name(1.5)
  with pytest.raises(ValueError, match="split_sizes needs exactly"):
    demo.config_name(0.2, {"train": 3})
  with pytest.raises(ValueError, match="demo/truncNN"):
    datasets.get_dataset({"name": "demo/half", "dir": str(tmp_path)})


# -------------------------------------------------------------------------------- errors


def test_unknown_name_lists_known_names():
  with pytest.raises(ValueError, match=r"data.name='imagenet' is not a known dataset.*demo.*"
                     r"tfds:NAME"):
    datasets.get_dataset({"name": "imagenet", "dir": ""})


def test_missing_dir_and_unprepared_dataset(tmp_path):
  missing = tmp_path / "nope"
  with pytest.raises(FileNotFoundError, match=f"{missing}.*does not exist.*tfds build"):
    datasets.get_dataset({"name": "tfds:mnist", "dir": str(missing)})
  with pytest.raises(FileNotFoundError, match="not prepared in.*array_record"):
    datasets.get_dataset({"name": "tfds:mnist", "dir": str(tmp_path)})
  with pytest.raises(FileNotFoundError, match="No prepared dataset 'no_such_set'"):
    datasets.get_dataset({"name": "tfds:no_such_set", "dir": str(tmp_path)})


def test_unknown_split_lists_splits(full):
  with pytest.raises(ValueError, match=r"Unknown split 'test'.*'train'.*'validation'"):
    full.source("test")
