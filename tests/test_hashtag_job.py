"""The SWAG hashtag dataset job (input_pipeline/jobs/hashtag_job.py, crawl_inputs.py) and reading
its output as `hashtags:NAME` (hashtag_source.py).

One small crawl: a WebDataset shard (json, txt and caption tags, a truncated JPEG, a
decompression bomb, '..' and absolute member names, non-UTF-8 tags), a JSONL manifest (a
missing image, a broken line), a Parquet manifest with inline bytes and a validation manifest.
Every count below is worked out by hand in the comments.
"""
import io
import json
import os
import pathlib
import struct
import tarfile
import zlib

import numpy as np
from PIL import Image
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bigpretrain.swag import resampling
from input_pipeline.jobs import crawl_inputs
from input_pipeline import datasets
from input_pipeline.jobs import hashtag_job
from input_pipeline import pipeline
from input_pipeline import prepare

pytestmark = pytest.mark.beam  # Apache Beam jobs on the local FnApiRunner

EGGPLANT = "eggplant.n.01+eggplant.n.02"  # #eggplant and #aubergine (appendix A).
DOG = "andiron.n.01+dog.n.01+frank.n.02+pawl.n.01"  # #dog and #dogs.
NAME = "crawl"
BEAM = ["--direct_num_workers=1"]


def _jpeg(seed: int, size=(24, 16)) -> bytes:
  pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), np.uint8)
  buf = io.BytesIO()
  Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
  return buf.getvalue()


def _bomb(width: int, height: int) -> bytes:
  """A ~70-byte PNG whose header declares width x height (its data is a 1x1 image's)."""
  buf = io.BytesIO()
  Image.new("RGB", (1, 1)).save(buf, format="PNG")
  data = bytearray(buf.getvalue())
  ihdr = bytes(data[12:16]) + struct.pack(">II", width, height) + bytes(data[24:29])
  data[16:24] = struct.pack(">II", width, height)
  data[29:33] = struct.pack(">I", zlib.crc32(ihdr))
  return bytes(data)


def _add(tar, name: str, data: bytes):
  info = tarfile.TarInfo(name)
  info.size = len(data)
  tar.addfile(info, io.BytesIO(data))


def _write_raw(raw: pathlib.Path) -> dict[str, bytes]:
  """The crawl; returns the bytes of the images that must be written, by file_name."""
  (raw / "train").mkdir(parents=True)
  (raw / "validation").mkdir()
  (raw / "images").mkdir()
  kept = {}
  tags = lambda *t: json.dumps({"hashtags": list(t)}).encode()
  with tarfile.open(raw / "train" / "00000.tar", "w") as tar:
    for key, image, ext, meta in [
        ("000", _jpeg(0), "json", tags("eggplant", "dog")),
        ("001", _jpeg(1), "json", json.dumps({"tags": ["#Aubergine"]}).encode()),
        ("002", _jpeg(2), "txt", b"a walk in #NewYork with my #dog"),
        ("003", _jpeg(3)[:300], "json", tags("eggplant")),  # Truncated JPEG.
        ("004", _bomb(12000, 12000), "json", tags("dog")),  # 144M pixels: PIL only warns.
        ("005", _jpeg(5), "txt", b"dog \xff\xfeoops"),  # A non-UTF-8 tag.
        ("006", _jpeg(6), "json", tags("newyork")),  # No label.
        ("007", _jpeg(7), "json", tags("dog", "love")),
    ]:
      _add(tar, f"{key}.{'png' if key == '004' else 'jpg'}", image)
      _add(tar, f"{key}.{ext}", meta)
      if key in ("000", "001", "002", "005", "007"):
        kept[f"train/00000.tar/{key}"] = image
    _add(tar, "../evil.jpg", _jpeg(8))
    _add(tar, "/abs.json", tags("dog"))
  for name, seed in (("a.jpg", 10), ("b.jpg", 11), ("v1.jpg", 12), ("v2.jpg", 13)):
    (raw / "images" / name).write_bytes(_jpeg(seed))
  lines = [json.dumps({"id": "m1", "image": "../images/a.jpg", "hashtags": ["eggplant", "dogs"]}),
           json.dumps({"id": "m2", "image": "../images/missing.jpg", "hashtags": ["dog"]}),
           json.dumps({"id": "m3", "image": "../images/b.jpg", "hashtags": "#cat #eggplant"}),
           "{not json"]
  (raw / "train" / "manifest.jsonl").write_text("\n".join(lines) + "\n")
  kept["train/manifest.jsonl:m1"] = _jpeg(10)
  kept["train/manifest.jsonl:m3"] = _jpeg(11)
  pq.write_table(pa.table({"id": ["p1"], "image": [_jpeg(20)], "tags": [["dog"]]}),
                 raw / "train" / "inline.parquet")
  kept["train/inline.parquet:p1"] = _jpeg(20)
  (raw / "validation" / "val.jsonl").write_text(
      json.dumps({"id": "v1", "image": "../images/v1.jpg", "hashtags": ["eggplant"]}) + "\n"
      + json.dumps({"id": "v2", "image": "../images/v2.jpg", "hashtags": ["newyork"]}) + "\n")
  kept["validation/val.jsonl:v1"] = _jpeg(12)
  kept["validation/val.jsonl:v2"] = _jpeg(13)
  return kept


def _tree(root: pathlib.Path) -> set[str]:
  return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture(scope="module")
def crawl(tmp_path_factory):
  root = tmp_path_factory.mktemp("crawl")
  kept = _write_raw(root / "raw")
  before = _tree(root)
  # tail_threshold 6: #dog's label (6 images) is head, #eggplant's (4) tail.
  assert prepare.main(["hashtags", f"--manual_dir={root / 'raw'}",
                       f"--data_dir={root / 'out'}", f"--name={NAME}", "--min_count=2",
                       "--min_raw_count=1", "--tail_threshold=6"] + BEAM) == 0
  new = _tree(root) - before
  dataset = datasets.get_dataset({"name": f"hashtags:{NAME}", "dir": str(root / "out")})
  return {"root": root, "kept": kept, "new": new, "dataset": dataset,
          "meta": dict(dataset.builder.info.metadata)}


def test_vocabulary_and_counts_by_hand(crawl):
  meta = crawl["meta"]
  # Train images with a label and a good image: 000 (eggplant, dog), 001 (aubergine),
  # 002 (dog), 005 (dog), 007 (dog), m1 (eggplant, dogs), m3 (cat, eggplant), p1 (dog).
  # #cat's label is in 1 image < min_count 2: dropped; #newyork has no synset.
  assert [v["label"] for v in meta["vocabulary"]] == [DOG, EGGPLANT]
  dog, eggplant = meta["vocabulary"]
  assert dog["images"] == 6 and eggplant["images"] == 4
  assert dog["synsets"] == DOG.split("+")
  # Raw counts are over every train sample read: #dog also in 004 (bomb) and m2 (missing).
  assert dog["raw_hashtags"] == {"dog": 7, "dogs": 1}
  assert eggplant["raw_hashtags"] == {"aubergine": 1, "eggplant": 4}  # 000, 003, m1, m3.
  # Distinct train tags: aubergine, cat, dog, dogs, eggplant (labelled), love, newyork (not);
  # the non-UTF-8 tag is dropped when read. Labels: cat's, dog's, eggplant's.
  assert meta["raw_tags"] == {"distinct_train_tags": 7, "kept_train_tags": 7,
                              "labelled_train_tags": 5, "canonical_labels": 3}
  assert meta["head_tail"] == {"tail_threshold": 6, "head_labels": 1, "tail_labels": 1,
                               "head_images": 4, "tail_images": 4}
  assert meta["max_lengths"] == {"hashtag_ids": 2}
  assert meta["skipped"] == {"bad_manifest_row": 1, "corrupt_image": 1,
                             "decompression_bomb": 1, "missing_image": 1, "no_label": 1,
                             "unsafe_tar_member": 2}
  assert meta["dropped_tags"] == {"non_utf8_tag": 1}  # 005's bad tag; 005 itself is kept.
  # Each rejected sample under one reason: written + skipped = the 17 samples of the crawl
  # (tar: 8 keys and 2 unsafe members; manifest: 4 lines; parquet: 1; validation: 2).
  written = sum(s.num_examples for s in crawl["dataset"].builder.info.splits.values())
  assert written == len(crawl["kept"]) == 10
  assert written + sum(meta["skipped"].values()) == 17
  assert meta["skipped_examples"]["unsafe_tar_member"] == ["train/00000.tar/../evil.jpg",
                                                           "train/00000.tar//abs.json"]
  assert meta["skipped_examples"]["decompression_bomb"] == ["train/00000.tar/004"]
  assert meta["skipped_examples"]["corrupt_image"] == ["train/00000.tar/003"]
  assert meta["skipped_examples"]["missing_image"] == ["train/manifest.jsonl:m2"]


def test_records_label_ids_and_images(crawl):
  dataset = crawl["dataset"]
  info = dataset.info
  assert info.class_names == [DOG, EGGPLANT] and info.num_classes == 2
  assert info.features == {"hashtag_ids": 2}
  assert info.num_examples == {"train": 8, "validation": 2}
  expected = {"000": [0, 1], "001": [1], "002": [0], "005": [0], "007": [0],
              "m1": [0, 1], "m3": [1], "p1": [0], "v1": [1], "v2": []}
  seen = {}
  for split in ("train", "validation"):
    source = dataset.source(split)
    for i in range(len(source)):
      record = source[i]
      seen[record["file_name"]] = record
      key = record["file_name"].rsplit("/", 1)[-1].rsplit(":", 1)[-1]
      assert record["hashtag_ids"] == expected[key], record["file_name"]
  assert set(seen) == set(crawl["kept"])
  for name, data in crawl["kept"].items():
    assert seen[name]["image"] == data  # Kept as they are (no --image_size).
  assert seen["train/00000.tar/005"]["hashtags"] == ["dog"]  # The bad tag is gone.
  assert seen["train/00000.tar/002"]["hashtags"] == ["dog", "newyork"]


def test_nothing_written_outside_the_output_dir(crawl):
  assert crawl["new"] and all(p.startswith("out") for p in crawl["new"]), crawl["new"]
  assert not (crawl["root"] / "evil.jpg").exists()


def test_train_is_resampled_with_the_dataset_threshold(crawl):
  train = crawl["dataset"].source("train")
  assert crawl["dataset"].info.stats["tail_threshold"] == 6
  labels = [train[i]["hashtag_ids"] for i in range(len(train))]
  weights, is_tail = resampling.importance(labels, 6)
  # Tail images are the ones with #eggplant's label (id 1); importance 1/sqrt(min count).
  np.testing.assert_array_equal(is_tail, [1 in ids for ids in labels])
  np.testing.assert_allclose(weights, [4 ** -0.5 if 1 in ids else 6 ** -0.5 for ids in labels])
  whole = train.resampler(3)
  reference = resampling.ResampledIndices(weights, is_tail, alpha=0.7, num_samples=8, seed=3)
  np.testing.assert_array_equal(whole[np.arange(40)], reference[np.arange(40)])
  assert crawl["dataset"].source("validation").index_sampler(3, 0, 1) is None


def test_batches_ship_padded_label_ids(crawl):
  cfg = pipeline.data_defaults()
  cfg.image_size = 8
  cfg.train_augment = "squish"
  train = crawl["dataset"].source("train")
  it = pipeline.train_iterator(train, cfg, global_batch_size=4, seed=0, process_index=0,
                               process_count=1, fields={"hashtag_ids": 2})
  batch = next(it)
  assert batch["image"].shape == (4, 8, 8, 3) and batch["hashtag_ids"].shape == (4, 2)
  sampler = train.index_sampler(0, 0, 1)
  for row in range(4):
    ids = train[int(sampler[row])]["hashtag_ids"]
    assert batch["num_hashtag_ids"][row] == len(ids)
    assert batch["hashtag_ids"][row].tolist() == ids + [-1] * (2 - len(ids))


def test_empty_vocabulary_is_an_error_naming_min_count(crawl, tmp_path):
  with pytest.raises(Exception, match=r"vocabulary is empty.*min_count=100"):
    hashtag_job.prepare(crawl["root"] / "raw", tmp_path, "empty", min_count=100,
                        min_raw_count=1, beam_options=BEAM)


def test_an_empty_vocabulary_from_unreadable_inputs_names_the_skips(tmp_path):
  raw = tmp_path / "raw" / "train"
  raw.mkdir(parents=True)
  (raw / "shard.tar").write_bytes(b"not a tar file at all" * 100)
  with pytest.raises(Exception, match=r"vocabulary is empty.*Skipped on the way \(by reason\): "
                     r"\{'unreadable_input': 1\}"):
    hashtag_job.prepare(tmp_path / "raw", tmp_path / "out", "unreadable", min_count=1,
                        min_raw_count=1, beam_options=BEAM)


def test_reserved_and_missing_names(tmp_path):
  with pytest.raises(ValueError, match="reserved"):
    prepare.main(["hashtags", "--manual_dir=x", f"--data_dir={tmp_path}", "--name=demo"])
  with pytest.raises(FileNotFoundError, match="prepare hashtags"):
    datasets.get_dataset({"name": "hashtags:nothere", "dir": str(tmp_path)})
  with pytest.raises(ValueError, match="Bad dataset name"):
    datasets.get_dataset({"name": "hashtags:../x", "dir": str(tmp_path)})


def test_tag_parsing_and_member_names():
  assert crawl_inputs.split_text("sun at the #Beach, #dog") == ["Beach", "dog"]
  assert crawl_inputs.split_text("dog, cat  eggplant") == ["dog", "cat", "eggplant"]
  tags, skips = crawl_inputs.parse_tags(b"#Dog dog #\xffbad #cat", "k")
  assert tags == ("cat", "dog") and [s.reason for s in skips] == ["non_utf8_tag"]
  for bad in ("../x.jpg", "/x.jpg", "a/../../x.jpg", "C:x.jpg", "\\x.jpg"):
    assert crawl_inputs.unsafe_member_name(bad), bad
  assert not crawl_inputs.unsafe_member_name("dir/x..y.jpg")


def test_a_sample_with_an_oversized_tag_file_is_rejected_under_one_reason(tmp_path,
                                                                          monkeypatch):
  monkeypatch.setattr(crawl_inputs, "MAX_TAG_BYTES", 100)
  with tarfile.open(tmp_path / "s.tar", "w") as tar:
    _add(tar, "a.jpg", _jpeg(0))
    _add(tar, "a.txt", b"#dog " * 50)  # 250 bytes: over the (patched) limit.
    _add(tar, "b.jpg", _jpeg(1))
    _add(tar, "b.txt", b"#dog #\xffbad")  # A non-UTF-8 tag: dropped, the sample kept.
  items = list(crawl_inputs.read_tar(crawl_inputs.InputFile(str(tmp_path / "s.tar"), "s.tar",
                                                            "train")))
  assert [(type(i).__name__, i.reason if hasattr(i, "reason") else i.name) for i in items] == [
      ("Skip", "bad_tags"), ("DroppedTag", "non_utf8_tag"), ("Sample", "s.tar/b")]
  assert items[2].tags == ("dog",)


def test_img2dataset_metadata_json_leaves_the_tags_to_the_caption_txt(tmp_path):
  """img2dataset writes KEY.json (url, status, ...) beside KEY.txt (the caption): the tags come
  from the .txt unless the .json holds a tag key."""
  with tarfile.open(tmp_path / "s.tar", "w") as tar:
    _add(tar, "a.jpg", _jpeg(0))
    _add(tar, "a.json", b'{"url": "http://x/a.jpg", "caption": "sunset", "status": "success"}')
    _add(tar, "a.txt", b"at the #beach #sunset")
    _add(tar, "b.jpg", _jpeg(1))
    _add(tar, "b.json", b'{"hashtags": ["dog"]}')
    _add(tar, "b.txt", b"#cat")
    _add(tar, "c.jpg", _jpeg(2))
    _add(tar, "c.json", b'{"url": "http://x/c.jpg"}')
  items = list(crawl_inputs.read_tar(crawl_inputs.InputFile(str(tmp_path / "s.tar"), "s.tar",
                                                            "train")))
  assert [(i.name, i.tags) for i in items] == [
      ("s.tar/a", ("beach", "sunset")), ("s.tar/b", ("dog",)), ("s.tar/c", ())]


def test_names_that_are_not_utf8_are_read_and_stored_escaped(tmp_path):
  # Latin-1 names (b'caf\xe9', not UTF-8) of a shard, its members, a manifest's image and id:
  # the OS, tarfile and the manifest reader give them with lone surrogates, which tfds text
  # and Beam's string coder refuse.
  raw = tmp_path / "raw"
  (raw / "train").mkdir(parents=True)
  shard = os.path.join(os.fsencode(raw / "train"), b"caf\xe9.tar")
  with tarfile.open(os.fsdecode(shard), "w", format=tarfile.GNU_FORMAT) as tar:
    for key, seed in (("a", 0), (os.fsdecode(b"caf\xe9"), 1)):
      _add(tar, f"{key}.jpg", _jpeg(seed))
      _add(tar, f"{key}.json", json.dumps({"hashtags": ["dog"]}).encode())
  with open(os.path.join(os.fsencode(raw), b"caf\xe9.jpg"), "wb") as f:
    f.write(_jpeg(2))
  (raw / "train" / "m.jsonl").write_bytes(
      b'{"id": "m\xe9", "image": "../caf\xe9.jpg", "hashtags": ["dog"]}\n')
  hashtag_job.prepare(raw, tmp_path / "out", NAME, min_raw_count=1, beam_options=BEAM)
  source = datasets.get_dataset({"name": f"hashtags:{NAME}", "dir": str(tmp_path / "out")}
                                ).source("train")
  assert {source[i]["file_name"]: source[i]["image"] for i in range(len(source))} == {
      "train/caf\\xe9.tar/a": _jpeg(0), "train/caf\\xe9.tar/caf\\xe9": _jpeg(1),
      "train/m.jsonl:m\\xe9": _jpeg(2)}


def test_a_manifest_row_whose_split_is_not_its_folders_is_skipped_not_lost(tmp_path):
  # The job writes the splits that splits_of finds, which for an input in a split folder is
  # that folder's: a 'test' row in train/ went to a split never written.
  for folder, rows in (("train", [("same", "train"), ("other", "test"), ("none", None)]),
                       ("val", [("v", "val")])):
    (tmp_path / folder).mkdir()
    (tmp_path / folder / "m.jsonl").write_text("".join(
        json.dumps({"id": i, "image": "x.jpg", "hashtags": ["dog"], "split": s}) + "\n"
        for i, s in rows))
  samples, skips = {}, []
  for f in crawl_inputs.find_inputs(tmp_path):
    for item in crawl_inputs.read_input(f):
      if isinstance(item, crawl_inputs.Sample):
        assert item.split in crawl_inputs.splits_of(f)
        samples[item.name] = item.split
      else:
        skips.append(item)
  assert samples == {"train/m.jsonl:same": "train", "train/m.jsonl:none": "train",
                     "val/m.jsonl:v": "validation"}
  assert [(s.reason, s.where) for s in skips] == [("split_mismatch", "train/m.jsonl:other")]
  assert "'test' is not its folder's 'train'" in skips[0].error


def _records(dataset) -> dict[str, set]:
  """Split -> every record as the repr of its sorted (field, value) pairs (order-free)."""
  out = {}
  for split in ("train", "validation"):
    source = dataset.source(split)
    out[split] = {repr(sorted((k, v if isinstance(v, (bytes, str)) else np.asarray(v).tolist())
                              for k, v in source[i].items())) for i in range(len(source))}
  return out


def test_dask_runner_writes_the_local_runners_dataset(crawl, tmp_path, dask_beam):
  runner, options = dask_beam
  out = tmp_path / "dask"
  hashtag_job.prepare(crawl["root"] / "raw", out, NAME, min_count=2, min_raw_count=1,
                      tail_threshold=6, beam_runner=runner, beam_options=options)
  dataset = datasets.get_dataset({"name": f"hashtags:{NAME}", "dir": str(out)})
  records = _records(dataset)
  assert records == _records(crawl["dataset"])
  assert len(records["train"]) == 8 and len(records["validation"]) == 2
  meta = dict(dataset.builder.info.metadata)
  assert meta.pop("counters") == {}  # Beam's Dask runner reports no metrics.
  assert meta == {k: v for k, v in crawl["meta"].items() if k != "counters"}
