"""Tests for the Beam preparation jobs: imagenet21k_p.py, image_folder.py, prepare.py and their
lookup in datasets.py.

A small raw ImageNet-21K tree (real wnids, a few classes on each side of a tiny threshold, a
corrupt JPEG, a tiny image, a grayscale one, a wide one) is prepared in the winter21 folder
layout and again as one tar per class; every rule of the issue is checked against values
computed here independently (sha256 ranking, PIL resizing, the threshold by hand).
"""
import contextlib
import hashlib
import io
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

import apache_beam as beam
import ml_collections
import numpy as np
from PIL import Image
import pytest
import tensorflow_datasets as tfds

from bigpretrain import train
from bigpretrain.semantic import tree as tree_lib
from tests import helpers
from input_pipeline.jobs import beam_images
from input_pipeline import datasets
from input_pipeline.jobs import image_folder
from input_pipeline.jobs import imagenet21k_p as i21k
from input_pipeline import pipeline
from input_pipeline import prepare

pytestmark = pytest.mark.beam  # Apache Beam jobs on the local FnApiRunner

MIN_IMAGES = 5  # Keep a class only with at least 5 files.
VAL = 2
ANIMAL, BIRD, MAMMAL, DOG = "n00015388", "n01503061", "n01861778", "n02084071"
TENCH, TABLE, CAT = "n01440764", "n04379243", "n02121808"
# Files per class (corrupt ones included): dog has exactly 5 (kept), tench 4 (dropped).
COUNTS = {ANIMAL: 7, BIRD: 6, MAMMAL: 6, DOG: 5, TENCH: 4, TABLE: 2}
KEPT = sorted([ANIMAL, BIRD, MAMMAL, DOG])
CORRUPT = f"{ANIMAL}/{ANIMAL}_3.JPEG"
TINY = f"{MAMMAL}/{MAMMAL}_1.JPEG"  # 40 x 30: below 224, never upscaled.
WIDE = f"{MAMMAL}/{MAMMAL}_2.JPEG"  # 300 x 120: squished to 224 x 224.
GRAY = f"{BIRD}/{BIRD}_0.JPEG"  # Grayscale JPEG: stored as RGB.
BEAM_THREADS = ["--direct_num_workers=2", "--direct_running_mode=multi_threading"]


def _smooth_image(seed: int, width: int, height: int) -> np.ndarray:
  """uint8 [H, W, 3] smooth colour gradients (JPEG keeps them nearly exact)."""
  rng = np.random.default_rng(seed)
  y, x = np.mgrid[0:height, 0:width].astype(np.float32)
  base = rng.uniform(40, 200, size=3)
  slope = rng.uniform(-0.4, 0.4, size=(2, 3))
  img = base + x[..., None] * slope[0] * (120 / width) + y[..., None] * slope[1] * (120 / height)
  return np.clip(img, 0, 255).astype(np.uint8)


def _raw_files() -> dict[str, bytes]:
  """'wnid/name' -> file bytes of the raw tree."""
  files = {}
  for c, (wnid, n) in enumerate(sorted(COUNTS.items())):
    for i in range(n):
      key = f"{wnid}/{wnid}_{i}.JPEG"
      buf = io.BytesIO()
      if key == CORRUPT:
        files[key] = b"\xff\xd8\xff\xe0 this is not a JPEG"
        continue
      size = {TINY: (40, 30), WIDE: (300, 120)}.get(key, (256, 240))
      image = Image.fromarray(_smooth_image(100 * c + i, *size))
      if key == GRAY:
        image = image.convert("L")
      image.save(buf, format="JPEG", quality=95)
      files[key] = buf.getvalue()
  return files


def _expected_validation(wnid: str, names) -> set[str]:
  """The hash rule, computed here: smallest sha256('wnid/name') hex digests."""
  ranked = sorted(names, key=lambda n: (hashlib.sha256(f"{wnid}/{n}".encode()).hexdigest(), n))
  return set(ranked[:VAL])


def _expected_splits(files) -> dict[str, set[str]]:
  """Split -> file keys, corrupt file excluded, for the kept classes."""
  out = {"train": set(), "validation": set()}
  for wnid in KEPT:
    names = [k.split("/", 1)[1] for k in files if k.startswith(wnid + "/")]
    val = _expected_validation(wnid, names)
    for n in names:
      key = f"{wnid}/{n}"
      if key != CORRUPT:
        out["validation" if n in val else "train"].add(key)
  return out


def _records(builder, split: str) -> list[dict]:
  source = datasets.RecordSource(
      builder.as_data_source(split, decoders={"image": tfds.decode.SkipDecoding()}), split)
  return [source[i] for i in range(len(source))]


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
  """Both raw layouts of the same files: winter21 train/ folders and fall11 tars."""
  root = tmp_path_factory.mktemp("raw")
  files = _raw_files()
  for key, data in files.items():
    path = root / "folders" / "train" / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
  (root / "folders" / "train" / "README.txt").write_text("not a class")
  tars = root / "tars"
  tars.mkdir()
  for wnid in COUNTS:
    with tarfile.open(tars / f"{wnid}.tar", "w") as tar:
      for key in sorted(k for k in files if k.startswith(wnid + "/")):
        info = tarfile.TarInfo(("./" if wnid == BIRD else "") + key.split("/", 1)[1])
        info.size = len(files[key])
        tar.addfile(info, io.BytesIO(files[key]))
  (tars / f"{CAT}.tar").write_bytes(b"this is no tar archive" * 40)  # Unreadable class.
  return {"folders": root / "folders", "tars": tars, "files": files}


@pytest.fixture(scope="module")
def prepared(raw, tmp_path_factory):
  """imagenet21k_p prepared from each layout: folders by the command line, tars through the
  Python API with two Beam worker threads and a stale incomplete folder left in OUT."""
  out = tmp_path_factory.mktemp("out")
  folder_dir, tar_dir = out / "from_folders", out / "from_tars"
  assert prepare.main([
      "imagenet21k_p", f"--manual_dir={raw['folders']}", f"--data_dir={folder_dir}",
      f"--min_images={MIN_IMAGES}", f"--val_per_class={VAL}"]) == 0
  stale = tar_dir / "imagenet21k_p" / "incomplete.ABC123_1.0.0"
  stale.mkdir(parents=True)
  (stale / "imagenet21k_p-train.array_record-00000-of-00001").write_bytes(b"half written")
  tar_builder = i21k.prepare(raw["tars"], tar_dir, min_images=MIN_IMAGES, val_per_class=VAL,
                             beam_options=BEAM_THREADS)
  return {"folders": (folder_dir, datasets.get_dataset({"name": "imagenet21k_p",
                                                        "dir": str(folder_dir)})),
          "tars": (tar_dir, tar_builder), "stale": stale}


# ------------------------------------------------------------------------------------------
# Pure pieces (no Beam).


def test_validation_names_rule_and_independence_of_order():
  names = [f"img_{i}.JPEG" for i in range(20)]
  digests = {n: hashlib.sha256(f"n01440764/{n}".encode()).hexdigest() for n in names}
  expected = set(sorted(names, key=digests.get)[:5])
  assert beam_images.validation_names("n01440764", names, 5) == expected
  assert beam_images.validation_names("n01440764", list(reversed(names)), 5) == expected
  assert beam_images.validation_names("n01440764", names, 0) == set()
  # The class is part of the hashed string: another wnid ranks the same names differently.
  assert beam_images.validation_names("n04379243", names, 5) != expected


@pytest.mark.parametrize("size, expected", [
    ((300, 120), (224, 224)),  # Squished, aspect ratio not kept.
    ((224, 100), (224, 224)),  # Longer side not below 224: squished.
    ((223, 50), (223, 50)),  # Longer side below 224: kept.
    ((1000, 900), (224, 224)),  # Big: decoded at reduced scale (draft), then squished.
])
def test_squish_jpeg_sizes(size, expected):
  buf = io.BytesIO()
  Image.fromarray(_smooth_image(0, *size)).save(buf, format="PNG")
  out = beam_images.squish_jpeg(buf.getvalue(), 224, 80)
  with Image.open(io.BytesIO(out)) as image:
    assert (image.format, image.mode, image.size) == ("JPEG", "RGB", expected)


def test_squish_jpeg_matches_pil_resize_and_quality_matters():
  buf = io.BytesIO()
  Image.fromarray(_smooth_image(3, 1000, 700)).save(buf, format="PNG")
  reference = np.asarray(Image.open(io.BytesIO(buf.getvalue())).resize(
      (224, 224), Image.Resampling.BICUBIC), dtype=np.float32)
  out = np.asarray(Image.open(io.BytesIO(beam_images.squish_jpeg(buf.getvalue(), 224, 95))),
                   dtype=np.float32)
  assert np.abs(out - reference).mean() < 2.0
  noisy = io.BytesIO()
  Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 300, 3), np.uint8)).save(
      noisy, format="PNG")
  assert len(beam_images.squish_jpeg(noisy.getvalue(), 224, 30)) < len(
      beam_images.squish_jpeg(noisy.getvalue(), 224, 95))


def test_corrupt_bytes_raise():
  with pytest.raises(Exception):
    beam_images.squish_jpeg(b"\xff\xd8\xff garbage", 224, 75)
  with pytest.raises(Exception):
    beam_images.verified_image(b"GIF89a garbage")


def test_choose_classes_keeps_500_or_more():
  # Paper 001 section 2.1: "removing infrequent classes, with less than 500 labels".
  sources = [beam_images.ClassSource(w, f"/x/{w}", "dir")
             for w in ("n1", "n2", "n3", "n4", "n5")]
  counts = [(501, ""), (500, ""), (0, "ReadError: bad tar"), (900, ""), (499, "")]
  kept, dropped, unreadable = beam_images.choose_classes(sources, counts, 500)
  assert kept == ["n1", "n2", "n4"]
  assert dropped == {"n3": 0, "n5": 499}
  assert unreadable == {"n3": "ReadError: bad tar"}


def test_detect_layout(raw, tmp_path):
  layout, sources, ignored = i21k.detect_layout(raw["folders"])
  assert layout == "folders" and ignored == ["README.txt"]
  assert [s.class_name for s in sources] == sorted(COUNTS)
  assert all(s.kind == "dir" and s.split == "" for s in sources)
  layout, sources, _ = i21k.detect_layout(raw["tars"])
  assert layout == "tars" and [s.class_name for s in sources] == sorted([*COUNTS, CAT])
  mixed = tmp_path / "mixed"
  (mixed / TENCH).mkdir(parents=True)
  (mixed / f"{TABLE}.tar").write_bytes(b"")
  with pytest.raises(ValueError, match="both wnid folders"):
    i21k.detect_layout(mixed)
  (tmp_path / "empty" / "cats").mkdir(parents=True)
  with pytest.raises(ValueError, match="No class found"):
    i21k.detect_layout(tmp_path / "empty")
  with pytest.raises(FileNotFoundError, match="does not exist"):
    i21k.detect_layout(tmp_path / "nowhere")


def test_list_files_tar_offsets(raw):
  source = beam_images.ClassSource(BIRD, str(raw["tars"] / f"{BIRD}.tar"), "tar")
  files = beam_images.list_files(source)
  assert [f[0] for f in files] == [f"{BIRD}_{i}.JPEG" for i in range(COUNTS[BIRD])]  # './' gone.
  for name, offset, size in files:
    assert beam_images.read_file(source.path, offset, size) == raw["files"][f"{BIRD}/{name}"]


def test_a_class_folder_is_listed_at_any_depth_as_imagefolder_does(tmp_path):
  """torchvision's ImageFolder walks a class's sub-folders; they were dropped unsaid."""
  folder = tmp_path / "n01"
  (folder / "batch2" / "deeper").mkdir(parents=True)
  (folder / ".cache").mkdir()
  for name in ("b.jpg", "batch2/a.jpg", "batch2/deeper/c.png", ".cache/d.jpg", ".e.jpg"):
    (folder / name).write_bytes(name.encode())
  files = beam_images.list_files(beam_images.ClassSource("n01", str(folder), "dir"))
  assert files == [("b.jpg", -1, -1), ("batch2/a.jpg", -1, -1), ("batch2/deeper/c.png", -1, -1)]
  assert beam_images.read_file(str(folder / files[2][0]), -1, -1) == b"batch2/deeper/c.png"


def test_a_tar_member_name_held_twice_is_read_from_its_last_copy(tmp_path):
  # As `tar -x` leaves it; the earlier copy is skipped and reported, so that no two examples
  # share a key at the write.
  path = tmp_path / f"{TENCH}.tar"
  with tarfile.open(path, "w") as tar:
    for name, data in (("a.JPEG", b"first"), ("b.JPEG", b"b"), ("./a.JPEG", b"last")):
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
  source = beam_images.ClassSource(TENCH, str(path), "tar")
  files = beam_images.list_files(source)
  assert [f[0] for f in files] == ["a.JPEG", "b.JPEG"]
  assert beam_images.read_file(source.path, *files[0][1:]) == b"last"
  list_class = beam_images._ListClass({TENCH: 0}, 0)  # pylint: disable=protected-access
  out = list(list_class.process(source))
  assert [o[2] for o in out if isinstance(o, tuple)] == [f"{TENCH}/a.JPEG", f"{TENCH}/b.JPEG"]
  [skipped] = [o.value for o in out if isinstance(o, beam.pvalue.TaggedOutput)]
  assert skipped["file"] == f"{TENCH}/a.JPEG" and skipped["split"] == "train"
  assert skipped["error"].startswith(f"duplicate tar member: an earlier copy in {path}")


def test_bad_parameters(tmp_path):
  with pytest.raises(ValueError, match="val_per_class=5 >= min_images=5"):
    i21k.prepare(tmp_path, tmp_path, min_images=5, val_per_class=5)
  with pytest.raises(ValueError, match="jpeg_quality"):
    i21k.prepare(tmp_path, tmp_path, jpeg_quality=0)
  with pytest.raises(ValueError, match="must be letters"):
    image_folder.check_name("bad/name")


# ------------------------------------------------------------------------------------------
# The prepared imagenet21k_p.


@pytest.mark.parametrize("layout", ["folders", "tars"])
def test_splits_classes_and_labels(prepared, raw, layout):
  _, builder = prepared[layout]
  builder = builder.builder if isinstance(builder, datasets.TfdsDataset) else builder
  assert sorted(builder.info.splits.keys()) == ["train", "validation"]
  assert builder.info.features["label"].names == KEPT
  expected = _expected_splits(raw["files"])
  for split in ("train", "validation"):
    records = _records(builder, split)
    assert {r["file_name"] for r in records} == expected[split]
    for r in records:
      assert r["label"] == KEPT.index(r["file_name"].split("/")[0])
      assert isinstance(r["image"], bytes) and r["image"][:2] == b"\xff\xd8"  # JPEG.
  val_records = _records(builder, "validation")
  for wnid in KEPT:  # 2 per class, minus the corrupt file if the rule put it in validation.
    want = VAL - (wnid == ANIMAL and CORRUPT in _hash_validation_keys(raw))
    assert sum(r["label"] == KEPT.index(wnid) for r in val_records) == want


def _hash_validation_keys(raw) -> set[str]:
  keys = set()
  for wnid in KEPT:
    names = [k.split("/", 1)[1] for k in raw["files"] if k.startswith(wnid + "/")]
    keys |= {f"{wnid}/{n}" for n in _expected_validation(wnid, names)}
  return keys


@pytest.mark.parametrize("layout", ["folders", "tars"])
def test_metadata_report(prepared, raw, layout):
  _, builder = prepared[layout]
  builder = builder.builder if isinstance(builder, datasets.TfdsDataset) else builder
  meta = i21k.report(builder)
  assert meta["classes"] == KEPT
  assert meta["names"][KEPT.index(BIRD)] == "bird"
  assert meta["names"][KEPT.index(MAMMAL)] == "mammal, mammalian"
  dropped = {TENCH: 4, TABLE: 2} | ({CAT: 0} if layout == "tars" else {})
  assert meta["dropped_classes"] == dropped
  assert meta["listed_counts"] == [COUNTS[w] for w in KEPT]
  if layout == "tars":
    assert list(meta["unreadable_classes"]) == [CAT]
    assert "ReadError" in meta["unreadable_classes"][CAT]
  else:
    assert meta["ignored_entries"] == ["README.txt"]
  split_of_corrupt = "validation" if CORRUPT in _hash_validation_keys(raw) else "train"
  assert meta["num_corrupt_files"] == 1
  [corrupt] = meta["corrupt_files"]
  assert corrupt["file"] == CORRUPT and corrupt["split"] == split_of_corrupt
  assert corrupt["error"].startswith("OSError") and " at 0x" not in corrupt["error"]
  assert meta["counters"]["corrupt_files"] == 1
  assert meta["counters"]["images_written"] == sum(COUNTS[w] for w in KEPT) - 1
  expected = _expected_splits(raw["files"])
  for split, keys in expected.items():
    per_class = [sum(k.startswith(w + "/") for k in keys) for w in KEPT]
    assert meta["class_counts"][split] == per_class
    assert builder.info.splits[split].num_examples == len(keys)
  assert meta["params"] == {"raw_dir": str(raw[layout]), "min_images": MIN_IMAGES,
                            "class_rule": "files >= min_images", "val_per_class": VAL,
                            "image_size": 224, "jpeg_quality": 75}


def test_semantic_tree(prepared):
  _, builder = prepared["tars"]
  tree = i21k.semantic_tree(builder)
  assert tree == tree_lib.SemanticTree.from_wnids(KEPT)
  # By hand: mammal and bird hang under animal, which is a root.
  assert tree.parent[KEPT.index(MAMMAL)] == KEPT.index(ANIMAL)
  assert tree.parent[KEPT.index(BIRD)] == KEPT.index(ANIMAL)
  assert tree.parent[KEPT.index(ANIMAL)] == -1


def test_image_sizes_modes_and_pixels(prepared, raw):
  _, builder = prepared["tars"]
  records = {r["file_name"]: r for s in ("train", "validation") for r in _records(builder, s)}
  for key, r in records.items():
    with Image.open(io.BytesIO(r["image"])) as image:
      assert image.format == "JPEG" and image.mode == "RGB"
      assert image.size == ((40, 30) if key == TINY else (224, 224)), key
  # Pixels: the squish of the original by PIL, up to JPEG error.
  original = Image.open(io.BytesIO(raw["files"][WIDE])).convert("RGB")
  reference = np.asarray(original.resize((224, 224), Image.Resampling.BICUBIC), np.float32)
  stored = np.asarray(Image.open(io.BytesIO(records[WIDE]["image"])), np.float32)
  assert np.abs(stored - reference).mean() < 3.0
  tiny = np.asarray(Image.open(io.BytesIO(records[TINY]["image"])), np.float32)
  tiny_ref = np.asarray(Image.open(io.BytesIO(raw["files"][TINY])).convert("RGB"), np.float32)
  assert np.abs(tiny - tiny_ref).mean() < 3.0


def test_layouts_and_worker_counts_give_identical_data(prepared):
  """Folders (1 worker) and tars (2 worker threads) hold the same records in the same order."""
  folder_builder = prepared["folders"][1].builder
  _, tar_builder = prepared["tars"]
  for split in ("train", "validation"):
    a, b = _records(folder_builder, split), _records(tar_builder, split)
    assert [r["file_name"] for r in a] == [r["file_name"] for r in b]
    assert all(x["image"] == y["image"] and x["label"] == y["label"] for x, y in zip(a, b))


def test_dask_runner_writes_the_local_runners_dataset(prepared, raw, tmp_path, dask_beam):
  """The command line on two dask worker processes (tar reads, the unreadable class, the
  corrupt file) writes the records and report of the local runner's run from the same tars."""
  runner, options = dask_beam
  assert prepare.main(["imagenet21k_p", f"--manual_dir={raw['tars']}", f"--data_dir={tmp_path}",
                       f"--min_images={MIN_IMAGES}", f"--val_per_class={VAL}",
                       f"--beam_runner={runner}"] + options) == 0
  builder = datasets.get_dataset({"name": "imagenet21k_p", "dir": str(tmp_path)}).builder
  _, direct = prepared["tars"]
  for split in ("train", "validation"):
    got = sorted((r["file_name"], r["label"], r["image"]) for r in _records(builder, split))
    want = sorted((r["file_name"], r["label"], r["image"]) for r in _records(direct, split))
    assert got == want and got
  meta, direct_meta = i21k.report(builder), i21k.report(direct)
  assert meta.pop("counters") == {}  # Beam's Dask runner reports no metrics.
  del direct_meta["counters"]
  assert meta == direct_meta


def test_dataset_lookup(prepared):
  out, ds = prepared["folders"]
  assert ds.info.class_names == KEPT and ds.info.num_classes == 4
  assert ds.info.splits == ("train", "validation")
  assert ds.info.image_size is None  # Tiny images keep their size.
  record = ds.source("validation")[0]
  assert set(record) == {"image", "label", "file_name"}
  assert isinstance(record["label"], int) and isinstance(record["file_name"], str)
  with pytest.raises(FileNotFoundError, match="input_pipeline.prepare imagenet21k_p"):
    datasets.get_dataset(ml_collections.ConfigDict({"name": "imagenet21k_p",
                                                   "dir": str(out.parent)}))


def test_rerun_reuses_and_checks_parameters(prepared, tmp_path, caplog):
  out, builder = prepared["tars"]
  shard = next(pathlib.Path(builder.data_dir).glob("*train.array_record*"))
  before = shard.stat().st_mtime_ns
  # The raw folder is not even looked at when the finished dataset is reused.
  with caplog.at_level(logging.INFO, logger="absl"):
    again = i21k.prepare(tmp_path / "gone", out, min_images=MIN_IMAGES, val_per_class=VAL)
  assert f"Reusing the finished dataset in {builder.data_dir}" in caplog.text
  assert shard.stat().st_mtime_ns == before
  assert again.info.splits["train"].num_examples == builder.info.splits["train"].num_examples
  with pytest.raises(ValueError, match="jpeg_quality"):
    i21k.prepare(tmp_path / "gone", out, min_images=MIN_IMAGES, val_per_class=VAL,
                 jpeg_quality=90)


def test_stale_incomplete_folder_is_reported_and_ignored(prepared, caplog):
  stale = prepared["stale"]
  with caplog.at_level(logging.WARNING):
    found = beam_images.note_incomplete(stale.parent)
  assert found == [str(stale)]
  assert "interrupted runs" in caplog.text
  # The run that found it finished in its own folder; the stale one was not read or renamed.
  assert (stale / "imagenet21k_p-train.array_record-00000-of-00001").read_bytes() == (
      b"half written")
  assert (stale.parent / "1.0.0" / "dataset_info.json").exists()


def test_cli_rejects_stray_arguments(tmp_path):
  with pytest.raises(ValueError, match=r"Unexpected arguments \['stray'\]"):
    prepare.main(["imagenet21k_p", "--manual_dir=x", f"--data_dir={tmp_path}", "stray"])
  with pytest.raises(SystemExit):
    prepare.main(["imagenet21k_p", f"--data_dir={tmp_path}"])  # --manual_dir is required.
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match=r"--data_dir=\S+file is a file"):
    prepare.main(["folder", "--manual_dir=x", f"--data_dir={tmp_path / 'file'}", "--name=n"])
  # A misspelt Beam option or runner is an error before anything runs, not a warning.
  with pytest.raises(ValueError, match=r"defines \['--dask_npartition'\]; docs/data.md"):
    prepare.main(["folder", "--manual_dir=x", f"--data_dir={tmp_path}", "--name=n",
                  "--beam_runner=input_pipeline.jobs.dask_runner.DaskRunner", "--dask_npartition=2"])
  (tmp_path / "sizes.json").write_text("{n01: 3}")
  with pytest.raises(ValueError, match=r"--class_sizes=\S+sizes.json is not valid JSON: "):
    prepare.main(["selection", "--predictions=x", f"--data_dir={tmp_path}",
                  "--variant=unbalanced_ranked", f"--class_sizes={tmp_path / 'sizes.json'}"])
  (tmp_path / "a_file").write_text("")  # A path that exists is not said to be missing.
  with pytest.raises(FileNotFoundError, match=r"ImageFolder root .*a_file \(--manual_dir\) is "
                                              r"a file, not a folder\."):
    prepare.main(["folder", f"--manual_dir={tmp_path / 'a_file'}", f"--data_dir={tmp_path}",
                  "--name=n"])
  with pytest.raises(ValueError, match="--beam_runner=FlinkRuner: Unexpected pipeline runner"):
    prepare.main(["selection", "--predictions=x", f"--data_dir={tmp_path}",
                  "--beam_runner=FlinkRuner"])
  # The command: absl's flags too (--verbosity after the subcommand), a user error in one line.
  r = subprocess.run([sys.executable, "-m", "input_pipeline.prepare", "folder",
                      f"--manual_dir={tmp_path / 'missing'}", f"--data_dir={tmp_path}",
                      "--name=n", "--verbosity=1"], env=helpers.env(), cwd=helpers.ROOT,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 1
  assert r.stderr.strip().splitlines()[-1] == (
      f"ERROR: ImageFolder root {tmp_path / 'missing'} (--manual_dir) does not exist.")
  assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------
# ImageFolder conversion.


def _png(seed: int, size=(20, 16)) -> bytes:
  buf = io.BytesIO()
  Image.fromarray(_smooth_image(seed, *size)).save(buf, format="PNG")
  return buf.getvalue()


@pytest.fixture(scope="module")
def folder_tree(tmp_path_factory):
  """RAW/{train,val}/{cat_a,cat_b,empty}/...: PNG, JPEG, BMP and a corrupt file."""
  root = tmp_path_factory.mktemp("imagefolder")
  files = {}
  for split, n in (("train", 3), ("val", 1)):
    for c, name in enumerate(("cat_a", "cat_b")):
      for i in range(n):
        files[f"{split}/{name}/{i}.png"] = _png(10 * c + i + (100 if split == "val" else 0))
  bmp = io.BytesIO()
  Image.fromarray(_smooth_image(7, 24, 18)).save(bmp, format="BMP")
  files["train/cat_b/odd.bmp"] = bmp.getvalue()
  files["train/cat_a/broken.jpg"] = b"\xff\xd8\xff not really"
  for key, data in files.items():
    (root / key).parent.mkdir(parents=True, exist_ok=True)
    (root / key).write_bytes(data)
  (root / "train" / "empty").mkdir()
  (root / "LICENSE").write_text("ignored")
  return root, files


@pytest.fixture(scope="module")
def folder_toy(folder_tree, tmp_path_factory):
  """folder:toy prepared from folder_tree by the command line: (data dir, what it printed)."""
  out, printed = tmp_path_factory.mktemp("toy"), io.StringIO()
  with contextlib.redirect_stdout(printed):
    assert prepare.main(["folder", f"--manual_dir={folder_tree[0]}", f"--data_dir={out}",
                         "--name=toy"]) == 0
  return out, printed.getvalue()


def test_image_folder_with_split_folders(folder_tree, folder_toy):
  _, files = folder_tree
  data_dir, printed = folder_toy
  assert "corrupt/unreadable files skipped: 1" in printed
  ds = datasets.get_dataset({"name": "folder:toy", "dir": str(data_dir)})
  assert ds.info.class_names == ["cat_a", "cat_b"]
  assert ds.info.num_examples == {"train": 7, "validation": 2}  # 3 + (3 + bmp); 1 + 1.
  meta = i21k.report(ds.builder)
  assert meta["dropped_classes"] == {"empty": 0}
  assert meta["ignored_entries"] == ["LICENSE"]
  assert [c["file"] for c in meta["corrupt_files"]] == ["cat_a/broken.jpg"]
  for split, folder in (("train", "train"), ("validation", "val")):
    source = ds.source(split)
    for i in range(len(source)):
      r = source[i]
      cls, name = r["file_name"].split("/")
      assert r["label"] == ["cat_a", "cat_b"].index(cls)
      raw = files[f"{folder}/{r['file_name']}"]
      if name.endswith(".png"):
        assert r["image"] == raw  # Kept byte for byte.
      else:  # BMP: re-encoded as JPEG, same picture.
        assert r["image"][:2] == b"\xff\xd8"
        got = np.asarray(Image.open(io.BytesIO(r["image"])), np.float32)
        want = np.asarray(Image.open(io.BytesIO(raw)), np.float32)
        assert np.abs(got - want).mean() < 3.0


def test_image_folder_carves_validation_by_hash(folder_tree, tmp_path):
  root, files = folder_tree
  builder = image_folder.prepare(root / "train", tmp_path, "carved", val_per_class=1,
                                 image_size=8)
  ds = datasets.get_dataset({"name": "folder:carved", "dir": str(tmp_path)})
  assert ds.info.splits == ("train", "validation")
  names = {}
  for key in files:
    if key.startswith("train/"):
      _, cls, name = key.split("/")
      names.setdefault(cls, []).append(name)
  for split in ("train", "validation"):
    got = {r["file_name"] for r in (ds.source(split)[i] for i in range(len(ds.source(split))))}
    want = set()
    for cls, ns in names.items():
      ranked = sorted(ns, key=lambda n, c=cls: hashlib.sha256(f"{c}/{n}".encode()).hexdigest())
      chosen = ranked[:1] if split == "validation" else ranked[1:]
      want |= {f"{cls}/{n}" for n in chosen if n != "broken.jpg"}
    assert got == want, split
  record = ds.source("train")[0]
  assert Image.open(io.BytesIO(record["image"])).size == (8, 8)  # --image_size squishes.
  assert builder.info.features["label"].names == ["cat_a", "cat_b"]
  # A K that takes every train file leaves no train split: said before the job runs.
  most = max(len(ns) for ns in names.values())
  with pytest.raises(ValueError, match=rf"--val_per_class={most} moves every train image to "
                     rf"validation \(the largest class has {most} files\)"):
    image_folder.prepare(root / "train", tmp_path, "all_val", val_per_class=most)
  # Every file corrupt: said as such (tfds' own check said "0 examples ... should be >0").
  for cls in ("a", "b"):
    (tmp_path / "bad" / cls).mkdir(parents=True)
    (tmp_path / "bad" / cls / "1.jpg").write_bytes(b"not an image")
  with pytest.raises(ValueError, match=rf"No image of split 'train' under {tmp_path / 'bad'} "
                                       r"could be read: every one was skipped as corrupt"):
    image_folder.prepare(tmp_path / "bad", tmp_path / "out", "bad")


def test_image_folder_on_dask_equals_local_runner(folder_tree, folder_toy, tmp_path, dask_beam):
  runner, options = dask_beam
  direct = datasets.get_dataset({"name": "folder:toy", "dir": str(folder_toy[0])}).builder
  dask = image_folder.prepare(folder_tree[0], tmp_path, "toy", beam_runner=runner,
                              beam_options=options)
  for split in ("train", "validation"):
    got = sorted((r["file_name"], r["label"], r["image"]) for r in _records(dask, split))
    assert got == sorted((r["file_name"], r["label"], r["image"])
                         for r in _records(direct, split)) and got
  assert ({**i21k.report(dask), "counters": None}
          == {**i21k.report(direct), "counters": None})  # Dask reports no Beam counters.


def test_image_folder_lookup_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="--name=nothing"):
    datasets.get_dataset({"name": "folder:nothing", "dir": str(tmp_path)})
  with pytest.raises(ValueError, match="folder:NAME"):
    datasets.get_dataset({"name": "folder:../x", "dir": str(tmp_path)})
  both = tmp_path / "both"
  (both / "val" / "a").mkdir(parents=True)
  (both / "validation" / "a").mkdir(parents=True)
  with pytest.raises(ValueError, match="both val/ and validation/"):
    image_folder.detect_layout(both)
  with_val = tmp_path / "withval"
  (with_val / "train" / "a").mkdir(parents=True)
  (with_val / "val" / "a").mkdir(parents=True)
  with pytest.raises(ValueError, match="already has a validation folder"):
    image_folder.detect_layout(with_val, val_per_class=2)
  layout, sources, _ = image_folder.detect_layout(with_val)
  assert layout == "splits"
  assert [(s.class_name, s.split) for s in sources] == [("a", "train"), ("a", "validation")]


@pytest.mark.parametrize("layout", ["folder", "tar"])
def test_a_file_name_that_is_not_utf8_is_read_and_stored_escaped(tmp_path, layout):
  # b'caf\xe9.png' is latin-1, not UTF-8: the OS and tarfile give it as 'caf\udce9.png', a
  # lone surrogate that tfds text and Beam's string coder refuse.
  images = {name: _png(i) for i, name in enumerate((b"a.png", b"b.png", b"caf\xe9.png"))}
  raw, out = tmp_path / "raw", tmp_path / "out"
  if layout == "folder":
    folder = os.path.join(os.fsencode(raw), TENCH.encode())
    os.makedirs(folder)
    for name, data in images.items():
      with open(os.path.join(folder, name), "wb") as f:
        f.write(data)
    builder = image_folder.prepare(raw, out, "latin1", val_per_class=1)
    os.makedirs(os.path.join(os.fsencode(tmp_path / "classes"), b"caf\xe9s"))
    _, sources, _ = image_folder.detect_layout(tmp_path / "classes")
    assert [s.class_name for s in sources] == ["caf\\xe9s"]  # A class name alike.
  else:
    raw.mkdir()
    with tarfile.open(raw / f"{TENCH}.tar", "w", format=tarfile.GNU_FORMAT) as tar:
      for name, data in images.items():
        info = tarfile.TarInfo(os.fsdecode(name))
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    builder = i21k.prepare(raw, out, min_images=3, val_per_class=1)
  # The hash rule on the name's own bytes; the stored name has them as \xNN.
  first = min(images, key=lambda n: hashlib.sha256(TENCH.encode() + b"/" + n).hexdigest())
  text = {n: f"{TENCH}/{n.decode('utf-8', 'backslashreplace')}" for n in images}
  assert text[b"caf\xe9.png"] == TENCH + "/caf\\xe9.png"
  records = {s: {r["file_name"]: r["image"] for r in _records(builder, s)}
             for s in ("train", "validation")}
  assert set(records["validation"]) == {text[first]}
  assert set(records["train"]) == {text[n] for n in images if n != first}
  if layout == "folder":  # PNGs are kept byte for byte.
    assert {**records["train"], **records["validation"]} == {text[n]: d for n, d in images.items()}
  assert i21k.report(builder)["corrupt_files"] == []


def test_command_line_output_is_identical_under_another_hash_seed(prepared, raw, tmp_path):
  """The exact documented command, in a fresh process with a fixed PYTHONHASHSEED, writes the
  same records in the same order and the same report as the in-process run. (Shard bytes may
  differ: protobuf serialises the Example feature map in hash-dependent order.)"""
  out = tmp_path / "out"
  env = dict(os.environ, PYTHONHASHSEED="12345")
  run = subprocess.run(
      [sys.executable, "-m", "input_pipeline.prepare", "imagenet21k_p",
       f"--manual_dir={raw['folders']}", f"--data_dir={out}", f"--min_images={MIN_IMAGES}",
       f"--val_per_class={VAL}"],
      cwd=pathlib.Path(__file__).resolve().parent.parent, env=env, capture_output=True,
      text=True, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  assert "examples: {'train': 15, 'validation': 8}" in run.stdout
  here = prepared["folders"][1].builder
  there = datasets.get_dataset({"name": "imagenet21k_p", "dir": str(out)}).builder
  for split in ("train", "validation"):
    assert _records(here, split) == _records(there, split)
  for name in ("metadata.json", "label.labels.txt"):
    assert (pathlib.Path(here.data_dir) / name).read_bytes() == (
        pathlib.Path(there.data_dir) / name).read_bytes()


def test_semantic_softmax_recipe_trains_on_the_prepared_dir(prepared, tmp_path):
  """The recipe's paper-scale config, pointed at the prepared folder, trains and evaluates
  (tiny model and images; its augmentations, epochs-based length and bfloat16 as configured)."""
  out, ds = prepared["folders"]
  workdir = tmp_path / "run"
  config = (f"--config={helpers.ROOT / 'configs' / 'semantic_softmax.py'}:"
            f"dataset=imagenet21k_p,data_dir={out},model=vit_demo,epochs=2")
  overrides = {"batch_size": 4, "data.image_size": 32, "data.num_workers": 0,
               "eval_every_steps": 0, "log_every_steps": 1, "ckpt_every_steps": 0,
               "compilation_cache_dir": helpers.JAX_CACHE}
  result = helpers.run_main([config, f"--workdir={workdir}"] +
                            [f"--config.{k}={v}" for k, v in overrides.items()])
  assert result.returncode == 0, result.stderr[-3000:]
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  n_train = ds.info.num_examples["train"]
  steps = -(-2 * n_train // 4)  # epochs=2: ceil(2 * N / batch).
  train_rows = [r for r in rows if "train/loss" in r]
  assert [r["step"] for r in train_rows] == list(range(1, steps + 1))
  assert all(np.isfinite(r["train/loss"]) for r in train_rows)
  final = [r for r in rows if "eval/semantic_top1" in r]
  assert final and final[-1]["eval/num_examples"] == ds.info.num_examples["validation"]
  saved = json.loads((workdir / "config.json").read_text())
  assert saved["data"]["train_augment"] == "squish|cutout|randaugment(2, 9)"
  assert saved["data"]["name"] == "imagenet21k_p" and saved["compute_dtype"] == "bfloat16"


def test_parse_mix():
  assert datasets.parse_mix("") == []
  assert datasets.parse_mix(" tfds:extra/v2=0.25 ; folder:web=0.1;") == [
      ("tfds:extra/v2", 0.25), ("folder:web", 0.1)]
  for bad in ("tfds:extra", "=0.2", "x=0", "x=1.5", "x=abc"):
    with pytest.raises(ValueError, match="Bad data.mix entry"):
      datasets.parse_mix(bad)
  with pytest.raises(ValueError, match="sum to 1"):
    datasets.parse_mix("a=0.5;b=0.5")


def test_trainer_mixes_the_data_mix_sources(prepared, monkeypatch, tmp_path):
  out, ds = prepared["folders"]
  calls = []
  real = pipeline.mixed_train_iterator

  def spy(sources, weights, *args, **kwargs):
    calls.append(([len(s) for s in sources], list(weights)))
    return real(sources, weights, *args, **kwargs)

  monkeypatch.setattr(pipeline, "mixed_train_iterator", spy)
  config = helpers.tiny_config("single_label", total_steps=2, batch_size=8, **{
      "data.name": "imagenet21k_p", "data.dir": str(out), "data.image_size": 32,
      "data.train_augment": "squish|flip",
      "data.mix": "imagenet21k_p=0.25", "model.name": "vit_demo"})
  train.train_and_evaluate(config, str(tmp_path / "run"))
  n = ds.info.num_examples["train"]
  assert calls == [([n, n], [0.75, 0.25])]


def test_mixed_datasets_need_the_same_classes(prepared, folder_tree, tmp_path):
  out, ds = prepared["folders"]
  both = tmp_path / "both"
  shutil.copytree(out, both)
  assert prepare.main(["folder", f"--manual_dir={folder_tree[0]}", f"--data_dir={both}",
                       "--name=toy"]) == 0
  cfg = ml_collections.ConfigDict({"name": "imagenet21k_p", "dir": str(both),
                                   "mix": "folder:toy=0.5", "train_split": "train"})
  with pytest.raises(ValueError, match="same class list"):
    datasets.train_sources(cfg, datasets.get_dataset(cfg))
  cfg.mix = "folder:nothere=0.5"
  with pytest.raises(FileNotFoundError, match="folder:nothere"):
    datasets.train_sources(cfg, datasets.get_dataset(cfg))
