"""Deduplication of a pool against evaluation sets (bigpretrain.tools.dedup) and the exclusion list
that inference and selection honour.

The data: demo validation images (the evaluation set) and a pool of demo `unlabeled` images
into which re-encoded copies (JPEG re-compressed, resized) of some validation images are
planted. Only classes below the roots are used: a root class's picture is its background hue
plus noise, so any two root-class images are near-duplicates by construction.

The model: a randomly initialised vit_ti16 reading 16x16 images, i.e. one patch: its pooled
features are a random (near distance-preserving) projection of the pixels, so a re-encoded
copy stays much closer to its original than any other image (the test asserts the gap). A
32x32 random vit_demo or resnet18 does not separate them: in a quick check their random
features put some same-class demo images closer than copies.
"""
import dataclasses
import io
import json
import subprocess
import sys

import faiss
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image
from tensorflow_datasets.core import hashing
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bigpretrain.semisup import dedup
from bigpretrain.semisup import pool_predictions
from bigpretrain import models
from input_pipeline import augment_spec
from input_pipeline import datasets
from input_pipeline import decoding
from input_pipeline import exclusions
from input_pipeline.jobs import selection_job
from input_pipeline.sources import demo
from tests import helpers

pytestmark = pytest.mark.slow  # end-to-end recipe runs

NAME = "dedup_test:v1"
POOL, AGAINST = f"{NAME}:unlabeled", f"{NAME}:validation"
NUM_EVAL, NUM_OTHERS = 24, 90
# (validation position, pool position, resize side or None, JPEG quality or None (PNG)).
PLANTED = ((0, 3, None, 75), (5, 17, 36, None), (9, 40, 36, 75), (14, 41, 28, 90),
           (20, 77, None, 50), (23, 95, 40, 85))
IMAGE_SIZE = 16
KW = dict(batch_size=16, progress=False)


def _reencode(data: bytes, side, quality) -> bytes:
  image = Image.open(io.BytesIO(data)).convert("RGB")
  if side:
    image = image.resize((side, side), Image.BICUBIC)
  out = io.BytesIO()
  image.save(out, "JPEG", quality=quality) if quality else image.save(out, "PNG")
  return out.getvalue()


class _DedupDataset:
  """'dedup_test:v1': 'validation' = NUM_EVAL demo validation images of classes below the
  roots; 'unlabeled' = NUM_OTHERS such demo unlabeled images with PLANTED copies inserted at
  their pool positions. Demo class list (a teacher's pool)."""

  def __init__(self, name, data_dir):
    info = datasets.get_dataset({"name": "demo", "dir": data_dir}).info
    # The earlier look: in 'demo' an inner class's images repeat leaf looks, so the pool would
    # hold natural near-duplicates of validation images. The images are those a prepared
    # 'demo_plain' holds first, rendered on their own (demo.DemoClasses.example) in the order
    # tfds stores a split (by the md5 of each example's key, salted with the split's name),
    # instead of generating all 27,500 of that dataset.
    classes = demo.DemoClasses(info.class_names)
    depth = classes.tree.class_depth

    def below_roots(split, n):
      per_class = demo.SPLIT_SIZES[split]  # Example i is of class i // per_class.
      order = sorted(range(per_class * classes.num_classes), key=hashing.Hasher(split).hash_key)
      kept = [i for i in order if depth[i // per_class] >= 1][:n]
      return [{"image": r["image"], "label": r["label"]}
              for r in (classes.example(split, i, look="plain") for i in kept)]

    val = below_roots("validation", NUM_EVAL)
    pool = below_roots("unlabeled", NUM_OTHERS)
    for v, p, side, quality in sorted(PLANTED, key=lambda t: t[1]):
      pool.insert(p, {"image": _reencode(val[v]["image"], side, quality),
                      "label": val[v]["label"]})
    self.records = {"validation": val, "unlabeled": pool}
    self.info = dataclasses.replace(
        info, name=name, splits=("unlabeled", "validation"),
        num_examples={s: len(r) for s, r in self.records.items()}, features={"label": 0})

  def source(self, split):
    if split not in self.records:
      raise ValueError(f"Unknown split {split!r}.")
    return self.records[split]


class _NoFeatures(nnx.Module):
  """A classifier without features(): dedup must refuse it."""

  def __init__(self, *, num_classes, rngs, dtype=jnp.float32, image_size=IMAGE_SIZE):
    self.head = nnx.Linear(image_size * image_size * 3, num_classes, dtype=dtype, rngs=rngs)

  def __call__(self, images, *, train=False, rng=None):
    return self.head(images.reshape(images.shape[0], -1))


datasets.register_source("dedup_test:", _DedupDataset)


def _checkpoint(workdir, model_name: str) -> str:
  """A demo checkpoint of `model_name` at IMAGE_SIZE with its random initial weights."""
  return helpers.random_checkpoint(workdir, **{"model.name": model_name,
                                               "data.image_size": IMAGE_SIZE})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  return _checkpoint(tmp_path_factory.mktemp("model"), "vit_ti16")


@pytest.fixture(scope="module")
def report(model, tmp_path_factory):
  out = tmp_path_factory.mktemp("dedup")
  return dedup.run(model, POOL, AGAINST, str(out), top_n=len(PLANTED), **KW), out


def _direct_features(model, split) -> np.ndarray:
  """Unit features of a split's images, decoded and resized outside the pipeline."""
  records = datasets.get_dataset({"name": NAME}).source(split)
  images = np.stack([np.asarray(augment_spec.EVAL_RESIZES["squish"](
      decoding.open_image(r["image"]), IMAGE_SIZE)) for r in records])
  f = np.asarray(models.load_pretrained(model).features(images.astype(np.float32) / 255.0),
                 np.float64)  # normalize '0_1'.
  return f / np.linalg.norm(f, axis=1, keepdims=True)


def _planted_keys():
  return [(NAME, "unlabeled", p) for _, p, _, _ in sorted(PLANTED, key=lambda t: t[1])]


def test_removes_exactly_the_planted_copies(model, report):
  rep, out = report
  assert rep["num_removed"] == len(PLANTED) and rep["index"] == {"type": "IndexFlatIP"}
  assert rep["pool"] == {"dataset": NAME, "split": "unlabeled",
                         "num_records": NUM_OTHERS + len(PLANTED),
                         "num_indexed": NUM_OTHERS + len(PLANTED)}
  assert rep["num_queries"] == NUM_EVAL and rep["model"]["feature_dim"] == 192
  # Each planted copy is removed, paired with the validation image it was made from.
  pairs = {r["pool"]["index"]: r["nearest"]["index"] for r in rep["removed"]}
  assert pairs == {p: v for v, p, _, _ in PLANTED}
  distances = [r["distance"] for r in rep["removed"]]
  assert distances == sorted(distances)
  # The exclusion list holds exactly those pool records.
  listed = exclusions.read(out / dedup.EXCLUSIONS_FILE)
  assert list(listed.records) == [(NAME, "unlabeled")]
  assert listed.indices(NAME, "unlabeled").tolist() == [k[2] for k in _planted_keys()]
  assert json.loads((out / dedup.REPORT_FILE).read_text()) == rep

  # Against a numpy brute force over every (validation, pool) pair: the global order of pool
  # images by their closest validation image, the distances, and the first one kept.
  val, pool = _direct_features(model, "validation"), _direct_features(model, "unlabeled")
  d = np.sqrt(np.maximum(0, 2 - 2 * val @ pool.T))
  closest = d.min(axis=0)
  order = np.lexsort((np.arange(len(closest)), closest))
  got = [r["pool"]["index"] for r in rep["removed"]] + [rep["first_kept"]["pool"]["index"]]
  assert got == order[:len(PLANTED) + 1].tolist()
  np.testing.assert_allclose(distances + [rep["first_kept"]["distance"]],
                             closest[order[:len(PLANTED) + 1]], atol=2e-3)
  # The copies are well separated from every other pair (what makes the cut unambiguous).
  assert rep["first_kept"]["distance"] > 1.5 * distances[-1]


def test_max_distance_and_ivf_find_the_same_copies(model, report, tmp_path, capsys):
  rep, _ = report
  cut = (rep["removed"][-1]["distance"] + rep["first_kept"]["distance"]) / 2
  by_distance = dedup.run(model, POOL, AGAINST, str(tmp_path / "d"), max_distance=cut, **KW)
  assert by_distance["removed"] == rep["removed"] and by_distance["first_kept"] is None
  ivf = dedup.run(model, POOL, AGAINST, str(tmp_path / "ivf"), top_n=len(PLANTED),
                  ivf_threshold=10, nlist=2, nprobe=2, **KW)
  assert ivf["index"] == {"type": "IndexIVFFlat", "nlist": 2, "nprobe": 2,
                          "train_points": NUM_OTHERS + len(PLANTED)}
  assert [r["pool"] for r in ivf["removed"]] == [r["pool"] for r in rep["removed"]]
  np.testing.assert_allclose([r["distance"] for r in ivf["removed"]],
                             [r["distance"] for r in rep["removed"]], atol=1e-4)
  # A finished folder is reused with the same flags, refused with others.
  capsys.readouterr()
  assert dedup.run(model, POOL, AGAINST, str(tmp_path / "d"), max_distance=cut,
                   **KW) == by_distance
  assert f"Reusing the finished deduplication in {tmp_path / 'd'}." in capsys.readouterr().out
  with pytest.raises(ValueError, match="other parameters"):
    dedup.run(model, POOL, AGAINST, str(tmp_path / "d"), top_n=3, **KW)


@pytest.mark.parametrize("mode", ["top_n", "max_distance"])
def test_closest_pool_images_is_the_global_brute_force_order(mode, monkeypatch):
  """Several query batches merged; each pool image once, with its closest query."""
  monkeypatch.setattr(dedup, "QUERY_BATCH", 7)
  rng = np.random.default_rng(0)
  pool = rng.normal(size=(300, 8)).astype(np.float32)
  pool /= np.linalg.norm(pool, axis=1, keepdims=True)
  queries = np.concatenate([pool[[5, 5, 60, 299]] + 0.01 * rng.normal(size=(4, 8)),
                            rng.normal(size=(26, 8))]).astype(np.float32)
  queries /= np.linalg.norm(queries, axis=1, keepdims=True)
  index = faiss.IndexFlatIP(8)
  index.add(pool)
  ip = queries.astype(np.float64) @ pool.T.astype(np.float64)
  best_ip, best_query = ip.max(axis=0), ip.argmax(axis=0)
  order = np.lexsort((np.arange(300), -best_ip))
  if mode == "top_n":
    got = dedup.closest_pool_images(index, queries, top_n=20)
    want = order[:21]
  else:
    limit = float(dedup.distance(best_ip[order[30]]))
    got = dedup.closest_pool_images(index, queries, max_distance=limit)
    want = order[dedup.distance(best_ip[order]) <= limit]
    assert 30 <= len(want) < 300
  assert got["pool"].tolist() == want.tolist()
  assert got["query"].tolist() == best_query[want].tolist()
  np.testing.assert_allclose(got["ip"], best_ip[want], atol=1e-5)


def test_exclusion_list_is_honoured_by_inference_and_selection(model, report, tmp_path):
  _, out = report
  listed = out / dedup.EXCLUSIONS_FILE
  planted = {k[2] for k in _planted_keys()}
  everyone = set(range(NUM_OTHERS + len(PLANTED)))

  def indices(table):
    return set(table.column("index").to_pylist())

  info = pool_predictions.run(model, NAME, "unlabeled", str(tmp_path / "preds_excl"), top_p=1,
                   shard_size=40, exclude=str(listed), **KW)
  assert info["num_excluded"] == len(PLANTED)
  assert info["num_records"] == NUM_OTHERS
  rows = pa.concat_tables([pq.read_table(p)
                           for p in sorted((tmp_path / "preds_excl").glob("*.parquet"))])
  assert indices(rows) == everyone - planted

  # Selection over predictions of the whole pool: with k = the pool size every image is
  # selected for its top-1 class, unless it is on the list.
  preds = tmp_path / "preds"
  pool_predictions.run(model, NAME, "unlabeled", str(preds), top_p=1, **KW)
  k = NUM_OTHERS + len(PLANTED)
  plain = selection_job.prepare(preds, tmp_path / "all", k=k)
  _, table = selection_job.read_index(tmp_path / "all")
  assert indices(table) == everyone and plain["report"]["num_excluded"] == 0
  kept = selection_job.prepare(preds, tmp_path / "kept", k=k, exclude=str(listed))
  _, table = selection_job.read_index(tmp_path / "kept")
  assert indices(table) == everyone - planted
  assert kept["report"]["num_excluded"] == len(PLANTED)
  assert kept["report"]["num_records"] == k
  assert kept["params"]["exclude"]["num_records"] == len(PLANTED)


def test_exclusion_list_file(tmp_path):
  path = tmp_path / "x.tsv"
  assert exclusions.write(path, [("folder:a", "train", 7), ("demo", "unlabeled", 3),
                                 ("folder:a", "train", 2), ("demo", "unlabeled", 3)]) == 3
  assert path.read_text() == ("dataset\tsplit\tindex\ndemo\tunlabeled\t3\n"
                              "folder:a\ttrain\t2\nfolder:a\ttrain\t7\n")
  listed = exclusions.read(path)
  assert len(listed) == 3 and listed.indices("folder:a", "train").tolist() == [2, 7]
  assert listed.indices("demo", "train").tolist() == []
  path.write_text("dataset\tsplit\tindex\ndemo\tunlabeled\tthree\n")
  with pytest.raises(ValueError, match="line 2: expected"):
    exclusions.read(path)
  path.write_text("demo\tunlabeled\t3\n")
  with pytest.raises(ValueError, match="first line must be"):
    exclusions.read(path)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    exclusions.read(tmp_path / "none.tsv")


def test_bad_input_is_refused_clearly(model, tmp_path):
  out = str(tmp_path / "out")
  with pytest.raises(ValueError, match="exactly one of --top_n .* and --max_distance"):
    dedup.run(model, POOL, AGAINST, out, top_n=3, max_distance=0.1, **KW)
  with pytest.raises(ValueError, match="exactly one of --top_n"):
    dedup.run(model, POOL, AGAINST, out, **KW)
  with pytest.raises(ValueError, match=r"no split 'test'; its splits: \['unlabeled', "):
    dedup.run(model, POOL, f"{AGAINST},{NAME}:test", out, top_n=3, **KW)
  with pytest.raises(ValueError, match="expected NAME:SPLIT"):
    dedup.run(model, "demo", AGAINST, out, top_n=3, **KW)
  with pytest.raises(ValueError, match=r"'demo:validation\[:50\]' is a slice of a split; "
                     "deduplication compares whole splits"):
    dedup.run(model, POOL, "demo:validation[:50]", out, top_n=3, **KW)
  with pytest.raises(ValueError, match="holds the pool"):
    dedup.run(model, POOL, f"{AGAINST},{POOL}", out, top_n=3, **KW)
  with pytest.raises(ValueError, match=r"--max_distance=3.0 must be in \[0, 2\]"):
    dedup.run(model, POOL, AGAINST, out, max_distance=3.0, **KW)
  # An --out that cannot be a folder is refused before any image is read.
  (tmp_path / "a_file").write_text("")
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(dedup, "_faiss", lambda: pytest.fail("the work started"))
    with pytest.raises(ValueError, match="--out=.*a_file cannot be written as a folder"):
      dedup.run(model, POOL, AGAINST, str(tmp_path / "a_file"), top_n=3, **KW)
  models.register("test_no_features", _NoFeatures)
  try:  # Registered only here: every other test may assume all registered models have it.
    no_features = _checkpoint(tmp_path / "nofeat", "test_no_features")
    with pytest.raises(ValueError, match=r"\(test_no_features\) has no features\(\) method"):
      dedup.run(no_features, POOL, AGAINST, out, top_n=3, **KW)
  finally:
    models.base.MODELS._items.pop("test_no_features")  # pylint: disable=protected-access
  # An exclusion list made for another split size is refused by inference.
  bad = tmp_path / "bad.tsv"
  exclusions.write(bad, [(NAME, "unlabeled", NUM_OTHERS + len(PLANTED))])
  with pytest.raises(ValueError, match="names record 96 of dedup_test:v1:unlabeled, which has "
                                       "96 records"):
    pool_predictions.run(model, NAME, "unlabeled", str(tmp_path / "p"), exclude=str(bad), **KW)


def test_command_line_refuses_contradictory_flags(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "bigpretrain.tools.dedup", f"--workdir={tmp_path}",
       "--pool=demo:unlabeled",
       "--against=demo:validation", "--top_n=5", "--max_distance=0.1", f"--out={tmp_path}"],
      env=helpers.env(), cwd=helpers.ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  assert "ERROR: Give exactly one of --top_n" in result.stderr
