"""Tests for input_pipeline/pipeline.py: host slicing, eval padding, state, corrupt records,
repeated augmentation and weighted mixing of sources."""
import gc
import io
import json
import os

import cv2
import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from PIL import Image
import threadpoolctl

from input_pipeline import pipeline
from input_pipeline import stream_position


def _png(image: np.ndarray) -> bytes:
  buf = io.BytesIO()
  Image.fromarray(image).save(buf, format="PNG")
  return buf.getvalue()


def _constant_source(n, corrupt=(), shape=(6, 9)):
  """Record i: a constant image of value 10 * i + 5 (survives any resize) and label i."""
  records = []
  for i in range(n):
    data = b"not an image" if i in corrupt else _png(np.full(shape + (3,), 10 * i + 5, np.uint8))
    records.append({"image": data, "label": i, "other": "ignored"})
  return records


def _noise_source(n):
  """Record i: a random image (so crops and flips show) with label i."""
  rng = np.random.default_rng(0)
  return [{"image": _png(rng.integers(0, 256, (7 + i % 3, 9, 3), dtype=np.uint8)), "label": i}
          for i in range(n)]


def _blas_threads() -> int:
  """Threads of the largest BLAS/OpenMP pool loaded in this process."""
  return max(p["num_threads"] for p in threadpoolctl.threadpool_info())


class _ThreadReport(list):
  """Records that also carry the thread counts of OpenCV's pool and of the largest BLAS pool
  in the process that reads them."""

  def __getitem__(self, index):
    return {**super().__getitem__(index), "cv2_threads": cv2.getNumThreads(),
            "blas_threads": _blas_threads()}


def _cfg(**overrides):
  cfg = pipeline.data_defaults()
  cfg.image_size = 4
  cfg.train_augment = "squish|flip"
  cfg.update(overrides)
  return cfg


def _train(source, cfg, *, gbs=4, seed=0, p=0, count=1, **kw):
  return pipeline.train_iterator(source, cfg, global_batch_size=gbs, seed=seed,
                                 process_index=p, process_count=count, **kw)


def _take(it, k):
  return [next(it) for _ in range(k)]


def _rows(batches):
  """Flattens batches to a list of (label, image) rows."""
  return [(int(l), img) for b in batches for l, img in zip(b["label"], b["image"])]


def _assert_same_batches(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert set(x) == set(y)
    for key in x:
      np.testing.assert_array_equal(np.asarray(x[key]), np.asarray(y[key]), err_msg=key)


def test_data_defaults():
  cfg = pipeline.data_defaults()
  assert (cfg.name, cfg.image_size, cfg.train_augment, cfg.eval_resize, cfg.normalize) == (
      "demo", 224, "flip", "squish", "0_1")
  assert (cfg.num_workers, cfg.prefetch, cfg.fail_on_corrupt) == (0, 2, False)
  assert cfg.repeated_augment == 1


def test_train_batch_format_and_image_label_pairs():
  source = _constant_source(10)
  it = _train(source, _cfg(normalize="minus1_1"), gbs=4)  # Normalised on device, not here.
  for batch in _take(it, 5):
    assert batch["image"].shape == (4, 4, 4, 3) and batch["image"].dtype == np.uint8
    assert batch["label"].shape == (4,) and batch["label"].dtype == np.int32
    assert batch["_skipped"].dtype == np.int32 and batch["_skipped"].shape == ()
    assert batch["_skipped"] == 0
    expected = 10 * batch["label"] + 5  # Record i is filled with 10 i + 5.
    np.testing.assert_array_equal(batch["image"], np.broadcast_to(
        expected[:, None, None, None], batch["image"].shape))


def test_scalar_fields_keep_floats_whatever_their_python_type():
  record = {"label": np.int64(3), "score": np.float32(1.75), "weight": 0.5}
  out = pipeline.record_fields(record, {"label": 0, "score": 0, "weight": 0}, 0)
  assert out["label"].dtype == np.int32 and int(out["label"]) == 3
  assert out["score"].dtype == np.float32 and float(out["score"]) == 1.75  # Not truncated.
  assert out["weight"].dtype == np.float32 and float(out["weight"]) == 0.5


def test_train_epochs_are_shuffled_permutations():
  it = _train(_constant_source(12), _cfg(), gbs=4)
  labels = np.concatenate([b["label"] for b in _take(it, 6)])
  first, second = labels[:12], labels[12:]
  assert sorted(first) == list(range(12)) and sorted(second) == list(range(12))
  assert list(first) != list(range(12)) and list(first) != list(second)


@pytest.mark.parametrize("count", [2, 3])
def test_train_hosts_share_one_shuffle_and_split_it(count):
  n, gbs = 12, 6
  source = _noise_source(n)
  cfg = _cfg(train_augment="inception_crop|flip")
  stream = _rows(_take(_train(source, cfg, gbs=gbs), 2 * n // gbs))  # One host: 2 epochs.
  per_host = [_rows(_take(_train(source, cfg, gbs=gbs, p=p, count=count), 2 * n // gbs))
              for p in range(count)]
  # Host p takes global positions p, p + count, ...: same labels and same augmented pixels.
  for p, rows in enumerate(per_host):
    for k, (label, image) in enumerate(rows):
      ref_label, ref_image = stream[p + k * count]
      assert label == ref_label
      np.testing.assert_array_equal(image, ref_image)
  # In the first epoch the hosts' shares are disjoint and together are the whole dataset.
  shares = [{label for label, _ in rows[:n // count]} for rows in per_host]
  assert sum(len(s) for s in shares) == n
  assert set().union(*shares) == set(range(n))


def test_train_seed_determinism():
  source = _noise_source(10)
  cfg = _cfg(train_augment="inception_crop|flip")
  a = _take(_train(source, cfg, seed=7), 4)
  b = _take(_train(source, cfg, seed=7), 4)
  c = _take(_train(source, cfg, seed=8), 4)
  _assert_same_batches(a, b)
  assert not all(np.array_equal(x["label"], y["label"]) for x, y in zip(a, c))


def test_train_state_restore_in_process():
  source = _noise_source(10)
  cfg = _cfg(train_augment="resize_crop|flip")
  it = _train(source, cfg, gbs=4)
  _take(it, 3)
  state = json.loads(json.dumps(it.get_state()))  # What a checkpoint stores.
  expected = _take(it, 4)
  resumed = _train(source, cfg, gbs=4)
  resumed.set_state(state)
  _assert_same_batches(_take(resumed, 4), expected)


def test_train_state_restore_through_orbax(tmp_path):
  source = _noise_source(10)
  cfg = _cfg()
  it = _train(source, cfg, gbs=4)
  _take(it, 2)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
  expected = _take(it, 3)
  resumed = _train(source, cfg, gbs=4)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.restore(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(resumed)))
  _assert_same_batches(_take(resumed, 3), expected)


def test_train_workers_same_records_and_state_restore():
  source = _ThreadReport(_noise_source(8))
  fields = {"label": 0, "cv2_threads": 0, "blas_threads": 0}
  cfg = _cfg(train_augment="inception_crop|flip")
  in_process = _rows(_take(_train(source, cfg, gbs=4), 6))
  cfg.num_workers = 2
  own_blas = _blas_threads()
  it = _train(source, cfg, gbs=4, fields=fields)
  try:
    batches = _take(it, 6)
    with_workers = _rows(batches)
    # Workers regroup rows into batches, but each stream position keeps its augmentation.
    key = lambda row: (row[0], row[1].tobytes())
    assert sorted(map(key, with_workers)) == sorted(map(key, in_process))
    # Each worker process runs OpenCV and BLAS on one thread (W workers fill W cores);
    # this process keeps its own pools.
    for b in batches:
      assert b["cv2_threads"].tolist() == b["blas_threads"].tolist() == [1] * 4
    assert _blas_threads() == own_blas
    state = json.loads(json.dumps(it.get_state()))
    expected = _take(it, 3)
  finally:
    it.close()
  resumed = _train(source, cfg, gbs=4, fields=fields)
  try:
    resumed.set_state(state)
    _assert_same_batches(_take(resumed, 3), expected)
  finally:
    resumed.close()


def test_train_skips_and_counts_corrupt_records():
  n, b, corrupt = 8, 3, 5
  clean = _take(_train(_constant_source(n), _cfg(), gbs=b), 12)
  stream = [int(l) for batch in clean for l in batch["label"]]  # Same shuffle: same seed, n.
  # Expected batches: drop label 5, count drops since the previous emitted batch.
  want_labels, want_skipped, row, skipped = [], [], [], 0
  for label in stream:
    if label == corrupt:
      skipped += 1
      continue
    row.append(label)
    if len(row) == b:
      want_labels.append(row)
      want_skipped.append(skipped)
      row, skipped = [], 0
  assert sum(want_skipped) >= 3  # The test exercises several skips.
  it = _train(_constant_source(n, corrupt=(corrupt,)), _cfg(), gbs=b)
  got = _take(it, len(want_labels))
  assert [list(x["label"]) for x in got] == want_labels
  assert [int(x["_skipped"]) for x in got] == want_skipped


def test_train_fail_on_corrupt_names_the_record():
  it = _train(_constant_source(6, corrupt=(4,)), _cfg(fail_on_corrupt=True), gbs=2)
  with pytest.raises(ValueError, match="corrupt image in record 4"):
    _take(it, 6)


def test_train_all_corrupt_raises(monkeypatch):
  monkeypatch.setattr(pipeline, "_MAX_CONSECUTIVE_CORRUPT", 5)
  it = _train(_constant_source(3, corrupt=(0, 1, 2)), _cfg(), gbs=2)
  with pytest.raises(RuntimeError, match="5 corrupt records in a row"):
    next(it)


def test_train_ops_must_produce_image_size():
  it = _train(_constant_source(4), _cfg(train_augment="flip"), gbs=2)
  with pytest.raises(ValueError, match=r"made a \(6, 9, 3\) image"):
    next(it)


def _eval_batches(source, cfg, gbs, p, count):
  return list(pipeline.eval_iterator(source, cfg, global_batch_size=gbs, process_index=p,
                                     process_count=count))


@pytest.mark.parametrize("count", [1, 2, 3])
def test_eval_every_example_once_and_equal_batch_counts(count):
  n, gbs = 10, 6  # ceil(10 / 6) = 2 batches per host, the last one partly padding.
  source = _constant_source(n)
  seen = []
  for p in range(count):
    batches = _eval_batches(source, _cfg(), gbs, p, count)
    assert len(batches) == pipeline.num_eval_batches(n, gbs) == 2
    for batch in batches:
      assert batch["image"].shape == (gbs // count, 4, 4, 3)
      assert batch["mask"].dtype == np.float32 and batch["label"].dtype == np.int32
      assert batch["image"].dtype == np.uint8
      real = batch["mask"] == 1
      assert set(np.unique(batch["mask"])) <= {0.0, 1.0}
      np.testing.assert_array_equal(batch["index"][real], batch["label"][real])
      np.testing.assert_array_equal(batch["index"][~real], -1)
      np.testing.assert_array_equal(batch["image"][~real], 0)
      np.testing.assert_array_equal(batch["image"][real][:, 0, 0, 0],
                                    10 * batch["label"][real] + 5)
      seen.extend(int(i) for i in batch["label"][real])
  assert sorted(seen) == list(range(n))


def test_eval_padding_keeps_a_float_fields_dtype():
  # 3 records over 2 hosts, 2 rows each per batch: host 1's second batch is padding alone.
  source = [{**r, "weight": np.float32(0.5 + i)} for i, r in enumerate(_constant_source(3))]
  fields = {"label": 0, "weight": 0}
  for p in range(2):
    batches = list(pipeline.eval_iterator(source, _cfg(), global_batch_size=4, process_index=p,
                                          process_count=2, fields=fields))
    for batch in batches:
      assert batch["weight"].dtype == np.float32 and batch["label"].dtype == np.int32
      real = batch["mask"] == 1
      np.testing.assert_array_equal(batch["weight"][real], batch["label"][real] + 0.5)


def test_eval_is_reiterable_and_center_crops():
  # Image 8 x 12 and image_size 7: the shorter side is already round(7 / 0.875) = 8.
  rng = np.random.default_rng(1)
  images = [rng.integers(0, 256, (8, 12, 3), dtype=np.uint8) for _ in range(3)]
  source = [{"image": _png(im), "label": i} for i, im in enumerate(images)]
  cfg = _cfg(image_size=7, eval_resize="center_crop")
  ds = pipeline.eval_iterator(source, cfg, global_batch_size=4, process_index=0,
                              process_count=1)
  first, second = list(ds), list(ds)
  _assert_same_batches(first, second)
  assert len(first) == 1
  for i, im in enumerate(images):
    np.testing.assert_array_equal(first[0]["image"][i], im[0:7, 2:9])
  assert list(first[0]["mask"]) == [1, 1, 1, 0]


def test_eval_reads_a_parametrised_center_crop():
  # center_crop(0.875) at 7: shorter side floor(7 / 0.875) = 8, already the case; on 8 x 14
  # the window starts at column round(7 / 2) = 4 (torchvision's rule; 'center_crop': 3).
  image = np.random.default_rng(2).integers(0, 256, (8, 14, 3), dtype=np.uint8)
  source = [{"image": _png(image), "label": 0}]
  (batch,) = _eval_batches(source, _cfg(image_size=7, eval_resize="center_crop(0.875)"), 2, 0,
                           1)
  np.testing.assert_array_equal(batch["image"][0], image[0:7, 4:11])
  (batch,) = _eval_batches(source, _cfg(image_size=7, eval_resize="center_crop"), 2, 0, 1)
  np.testing.assert_array_equal(batch["image"][0], image[0:7, 3:10])


def test_eval_corrupt_record_is_masked_and_counted():
  source = _constant_source(5, corrupt=(2,))
  batches = _eval_batches(source, _cfg(), 4, 0, 1)
  mask = np.concatenate([b["mask"] for b in batches])
  labels = np.concatenate([b["label"] for b in batches])
  np.testing.assert_array_equal(mask, [1, 1, 0, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(labels[mask == 1], [0, 1, 3, 4])
  assert [int(b["_skipped"]) for b in batches] == [1, 0]
  with pytest.raises(ValueError, match="corrupt image in record 2"):
    _eval_batches(source, _cfg(fail_on_corrupt=True), 4, 0, 1)


def test_eval_workers_match_in_process():
  source = _constant_source(11)
  expected = _eval_batches(source, _cfg(), 4, 1, 2)
  got = _eval_batches(source, _cfg(num_workers=2), 4, 1, 2)
  _assert_same_batches(got, expected)


def test_shared_memory_shortfall_counts_every_workers_buffer(tmp_path):
  stat = os.statvfs(tmp_path)
  free = stat.f_bavail * stat.f_frsize
  # 2 iterators x 3 workers x (prefetch 2 + 1) = 18 batches; a batch of a ninth of the free
  # space does not fit (a little is written meanwhile, so not exactly at the limit).
  def shortfall(workers, batch_bytes, path=tmp_path):  # Batches of 1-px images: 3 bytes each.
    return pipeline.shared_memory_shortfall(_cfg(num_workers=workers, prefetch=2, image_size=1),
                                            batch_bytes // 3, 2, path=str(path))
  message = shortfall(3, free // 9)
  assert message.startswith(f"{tmp_path} has ") and "(18 batches of " in message
  assert "2 x 3 workers x (data.prefetch=2 + 1)); a worker that finds it full dies of SIGBUS" in (
      message)
  assert shortfall(3, free // 36) is None
  assert shortfall(0, free) is None
  assert shortfall(3, free, tmp_path / "no") is None
  # 8 processes on the host (one per GPU) share it: 144 batches of a 72nd do not fit.
  eight = pipeline.shared_memory_shortfall(_cfg(num_workers=3, prefetch=2, image_size=1),
                                           free // 72 // 3, 2, processes=8, path=str(tmp_path))
  assert "(144 batches of " in eight and (
      ": 8 processes on this host x 2 x 3 workers x (data.prefetch=2 + 1))" in eight)


def test_eval_workers_free_their_last_batches():
  # grain holds an exhausted worker iterator's last batches (shared memory) in a reference
  # cycle; each pass over the eval batches frees them at its end, not at a later collection.
  gc.disable()
  try:
    batches = pipeline.eval_iterator(_constant_source(11), _cfg(num_workers=2),
                                     global_batch_size=4, process_index=0, process_count=1)
    labels = [b["label"].tolist() for b in batches]
    alive = [type(o).__name__ for o in gc.get_objects()
             if type(o).__name__ == "SharedMemoryArray"]
  finally:
    gc.enable()
  assert labels == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 0]] and alive == []


def test_a_closed_train_stream_frees_the_batches_it_handed_out():
  # On the host platform a batch's device arrays share the workers' shared memory and are
  # freed by the cyclic collector: the trainer's last batch would wait for a collection
  # after the process has stopped unlinking (reported as leaked at exit).
  from bigpretrain import sharding  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  gc.disable()
  try:
    stream = stream_position.TrainStream(
        lambda pos: _train(_constant_source(11), _cfg(num_workers=2), position=pos), 2)
    sizes = [sharding.global_batch(next(stream), mesh)["label"].shape for _ in range(3)]
    stream.close()
    alive = [type(o).__name__ for o in gc.get_objects()
             if type(o).__name__ == "SharedMemoryArray"]
  finally:
    gc.enable()
  assert sizes == [(4,)] * 3 and alive == []


@pytest.mark.parametrize("overrides,match", [
    (dict(train_augment="squish|rotate"), "'rotate'"),
    (dict(train_augment="squish|randaugment(2, 12)"), "'randaugment'"),
    (dict(repeated_augment=0), "repeated_augment"),
    (dict(eval_resize="crop"), "eval_resize='crop'"),
    (dict(eval_resize="center_crop(1.5)"), r"eval_resize='center_crop\(1\.5\)'.*\(0, 1\]"),
    (dict(eval_resize="center_crop(0.9, lanczos)"), "unknown interpolation 'lanczos'"),
    (dict(normalize="0_255"), "normalize='0_255'"),
    (dict(image_size=0), "image_size"),
    (dict(num_workers=-1), "num_workers"),
    (dict(prefetch=0), "prefetch"),
])
def test_bad_config_values(overrides, match):
  with pytest.raises(ValueError, match=match):
    _train(_constant_source(2), _cfg(**overrides))
  with pytest.raises(ValueError, match=match):
    _eval_batches(_constant_source(2), _cfg(**overrides), 2, 0, 1)


def test_bad_batch_and_host_arguments():
  with pytest.raises(ValueError, match="global_batch_size=6 is not divisible by process_count=4"):
    _train(_constant_source(2), _cfg(), gbs=6, count=4)
  with pytest.raises(ValueError, match="not divisible"):
    _eval_batches(_constant_source(2), _cfg(), 6, 0, 4)
  with pytest.raises(ValueError, match="process_index"):
    _train(_constant_source(2), _cfg(), gbs=4, p=2, count=2)
  with pytest.raises(ValueError, match="seed"):
    _train(_constant_source(2), _cfg(), seed=-1)


def test_train_papers_augmentations_run_in_the_pipeline():
  cfg = _cfg(image_size=8, train_augment="inception_crop|flip|randaugment(2, 9)|cutout|"
             "three_augment|color_jitter(0.3)", normalize="imagenet")
  batches = _take(_train(_noise_source(6), cfg, gbs=3), 4)
  for batch in batches:
    assert batch["image"].shape == (3, 8, 8, 3) and batch["image"].dtype == np.uint8
  src = _cfg(image_size=6, train_augment="simple_random_crop(2)|flip")
  assert next(_train(_noise_source(4), src, gbs=2))["image"].shape == (2, 6, 6, 3)


def _copy_groups(batch, k):
  """Copy-major rows -> [(label, [k images])] per distinct record."""
  b = len(batch["label"]) // k
  return [(int(batch["label"][j]), [batch["image"][c * b + j] for c in range(k)])
          for j in range(b)
          if all(batch["label"][c * b + j] == batch["label"][j] for c in range(k))]


@pytest.mark.parametrize("workers", [0, 2])
def test_repeated_augmentation_copies_share_a_batch_with_own_augmentation(workers):
  n, k, gbs = 8, 3, 6
  source = _noise_source(n)
  cfg = _cfg(train_augment="inception_crop|flip", repeated_augment=k, num_workers=workers)
  steps = 2 * n * k // gbs  # Two passes over the distinct records.
  it = _train(source, cfg, gbs=gbs)
  try:
    batches = _take(it, steps)
  finally:
    if workers:
      it.close()
  distinct = []
  for batch in batches:
    assert batch["image"].shape == (gbs, 4, 4, 3)
    groups = _copy_groups(batch, k)
    assert len(groups) == gbs // k  # Rows j, j + 2, j + 4 hold the copies of one record.
    for label, copies in groups:
      for a in range(k):
        for b in range(a + 1, k):
          assert not np.array_equal(copies[a], copies[b])  # Own augmentation per copy.
      distinct.append(label)
  if workers:  # Workers regroup records into batches; the records are the same.
    assert sorted(distinct[:n]) == sorted(distinct[n:]) == list(range(n))
    return
  # One epoch of n rows shows n / k records; a pass over all n records takes k epochs.
  assert sorted(distinct[:n]) == list(range(n)) and sorted(distinct[n:]) == list(range(n))
  assert distinct[:n] != distinct[n:]  # Reshuffled every pass.


def test_repeated_augmentation_host_slicing_without_overlap():
  n, k, gbs, count = 8, 2, 8, 2
  source = _noise_source(n)
  cfg = _cfg(train_augment="inception_crop|flip", repeated_augment=k)
  one_host = [g for b in _take(_train(source, cfg, gbs=gbs), 4) for g in _copy_groups(b, k)]
  per_host = [[g for b in _take(_train(source, cfg, gbs=gbs, p=p, count=count), 4)
               for g in _copy_groups(b, k)] for p in range(count)]
  for p, groups in enumerate(per_host):
    assert len(groups) == 8  # 4 batches of 4 rows = 2 records x 2 copies.
    for i, (label, copies) in enumerate(groups):  # Host p: records p, p + 2, ... of the stream.
      ref_label, ref_copies = one_host[p + i * count]
      assert label == ref_label
      for a, b in zip(copies, ref_copies):
        np.testing.assert_array_equal(a, b)
  first_pass = [{label for label, _ in groups[:n // count]} for groups in per_host]
  assert not first_pass[0] & first_pass[1] and first_pass[0] | first_pass[1] == set(range(n))


def test_repeated_augmentation_state_restore_corrupt_and_batch_check():
  source = _noise_source(7)
  cfg = _cfg(train_augment="resize_crop|flip", repeated_augment=2)
  it = _train(source, cfg, gbs=4)
  _take(it, 3)
  state = json.loads(json.dumps(it.get_state()))
  expected = _take(it, 3)
  resumed = _train(source, cfg, gbs=4)
  resumed.set_state(state)
  _assert_same_batches(_take(resumed, 3), expected)
  # A corrupt record drops all its copies and counts once.
  cfg = _cfg(repeated_augment=2)
  clean = _take(_train(_constant_source(5), cfg, gbs=4), 12)
  stream = [int(l) for b in clean for l in b["label"][:2]]  # Copy 0 of each record.
  good = [i for i, label in enumerate(stream) if label != 3]
  batches = _take(_train(_constant_source(5, corrupt=(3,)), cfg, gbs=4), 5)
  labels = [int(l) for b in batches for l in b["label"][:2]]
  assert labels == [stream[i] for i in good[:10]]
  assert sum(int(b["_skipped"]) for b in batches) == stream[:good[9]].count(3) >= 2
  with pytest.raises(ValueError, match="repeated_augment=3 must divide the per-host batch 4"):
    _train(source, _cfg(repeated_augment=3), gbs=4)
  with pytest.raises(ValueError, match="repeated_augment=2 must divide the per-host batch 3"):
    _train(source, _cfg(repeated_augment=2), gbs=6, count=2)


def _mixed(sources, weights, cfg=None, *, gbs=4, seed=0, p=0, count=1):
  return pipeline.mixed_train_iterator(sources, weights, cfg or _cfg(), global_batch_size=gbs,
                                       seed=seed, process_index=p, process_count=count)


def _labelled_source(labels, corrupt=()):
  return [{"image": b"bad" if i in corrupt else _png(np.full((5, 5, 3), i % 250, np.uint8)),
           "label": label} for i, label in enumerate(labels)]


def test_mixed_sources_realise_the_weights():
  a = _labelled_source(range(10))  # Labels 0..9.
  b = _labelled_source(range(100, 106))  # Labels 100..105.
  c = _labelled_source(range(200, 203))
  it = _mixed([a, b, c], [0.5, 0.3, 0.2], gbs=10)
  labels = np.concatenate([x["label"] for x in _take(it, 60)])  # 600 records.
  shares = [np.mean(labels < 100), np.mean((labels >= 100) & (labels < 200)),
            np.mean(labels >= 200)]
  np.testing.assert_allclose(shares, [0.5, 0.3, 0.2], atol=0.01)
  # Also in a short window (the mix is interleaved, not drawn at random).
  window = labels[:50]
  assert abs(np.mean(window < 100) - 0.5) <= 0.04
  # Within a source, each epoch is a shuffled permutation.
  from_a = labels[labels < 100]
  assert sorted(from_a[:10]) == list(range(10)) and list(from_a[:10]) != list(range(10))


def test_mixed_sources_determinism_state_and_host_slicing():
  a, b = _noise_source(6), [{**r, "label": r["label"] + 50} for r in _noise_source(5)]
  cfg = _cfg(train_augment="inception_crop|flip")
  first = _take(_mixed([a, b], [2, 1], cfg, seed=3), 5)
  _assert_same_batches(_take(_mixed([a, b], [2, 1], cfg, seed=3), 5), first)
  other = _take(_mixed([a, b], [2, 1], cfg, seed=4), 5)
  assert not all(np.array_equal(x["label"], y["label"]) for x, y in zip(first, other))
  it = _mixed([a, b], [2, 1], cfg, seed=3)
  _take(it, 2)
  state = json.loads(json.dumps(it.get_state()))
  resumed = _mixed([a, b], [2, 1], cfg, seed=3)
  resumed.set_state(state)
  _assert_same_batches(_take(resumed, 3), first[2:])
  stream = _rows(first)
  for p in range(2):
    rows = _rows(_take(_mixed([a, b], [2, 1], cfg, seed=3, p=p, count=2), 5))
    for i, (label, image) in enumerate(rows[:len(stream) // 2]):
      assert label == stream[p + 2 * i][0]
      np.testing.assert_array_equal(image, stream[p + 2 * i][1])


def test_mixed_corrupt_record_names_its_source_and_bad_weights():
  a = _labelled_source(range(4))
  b = _labelled_source(range(10, 14), corrupt=(2,))
  it = _mixed([a, b], [1, 1], _cfg(fail_on_corrupt=True), gbs=2)
  with pytest.raises(ValueError, match="corrupt image in record 2 of source 1"):
    _take(it, 8)
  skipped = sum(int(x["_skipped"]) for x in _take(_mixed([a, b], [1, 1], gbs=2), 8))
  assert skipped == 2  # 16 records cover each record of b twice; record 2 is bad.
  with pytest.raises(ValueError, match="2 sources but 1 weights"):
    _mixed([a, b], [1])
  with pytest.raises(ValueError, match="weight 1 must be a positive"):
    _mixed([a, b], [1, 0])
  with pytest.raises(ValueError, match="train source 1 is empty"):
    _mixed([a, []], [1, 1])
