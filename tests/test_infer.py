"""Teacher inference (bigpretrain.tools.infer) and the 'selection:DIR' data source on the demo."""
import dataclasses
import json
import pathlib
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bigpretrain import inference
from bigpretrain import models
from bigpretrain import sharding
from bigpretrain.semisup import pool_predictions
from input_pipeline import augment_spec
from input_pipeline import datasets
from input_pipeline import decoding
from input_pipeline import pipeline
from input_pipeline.jobs import selection_job
from input_pipeline import selection_formats
from input_pipeline import subset
from tests import helpers

DATA, SPLIT, N = "demo_head:50", "unlabeled", 50
KW = dict(top_p=3, batch_size=16, shard_size=20, progress=False)  # Shards of 20, 20, 10.


class _HeadDataset:
  """'demo_head:N': the demo with each split cut to its first N records (small and fast)."""

  def __init__(self, name, data_dir):
    self.demo = datasets.get_dataset({"name": "demo", "dir": data_dir})
    n = int(name.split(":")[1])
    self.info = dataclasses.replace(
        self.demo.info, name=name,
        num_examples={s: min(n, k) for s, k in self.demo.info.num_examples.items()})

  def source(self, split):
    return subset.RangeSource(self.demo.source(split), 0, self.info.num_examples[split])


datasets.register_source("demo_head:", _HeadDataset)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
  """A demo ViT checkpoint with random (not zero) weights in every layer, head included."""
  return helpers.random_checkpoint(tmp_path_factory.mktemp("teacher"), noise=0.3)


@pytest.fixture(scope="module")
def predictions(teacher, tmp_path_factory):
  out = tmp_path_factory.mktemp("preds")
  info = pool_predictions.run(teacher, DATA, SPLIT, str(out), **KW)
  return out, info


def _rows(out) -> pa.Table:
  shards = sorted(out.glob("*.parquet"))
  return pa.concat_tables([pq.read_table(p) for p in shards])


def _direct_logits(teacher) -> np.ndarray:
  """The teacher's logits on the split's images, decoded and resized outside the pipeline."""
  source = datasets.get_dataset({"name": "demo"}).source(SPLIT)
  images = np.stack([np.asarray(augment_spec.EVAL_RESIZES["squish"](
      decoding.open_image(source[i]["image"]), 32)) for i in range(N)])
  model = models.load_pretrained(teacher)
  return np.asarray(model(images.astype(np.float32) / 255.0), np.float64)  # normalize '0_1'.


def test_predictions_are_the_teachers_top_p(teacher, predictions):
  out, info = predictions
  classes_names = datasets.get_dataset({"name": "demo"}).info.class_names
  assert info == {"class_names": classes_names, "top_p": 3, "dataset": DATA,
                  "splits": [SPLIT], "scores": "softmax", "num_records": N}
  assert [p.name for p in sorted(out.glob("*.parquet"))] == [
      f"{SPLIT}-0000{s}-of-00003.parquet" for s in range(3)]
  assert [pq.read_metadata(p).num_rows for p in sorted(out.glob("*.parquet"))] == [20, 20, 10]
  rows = _rows(out)
  assert rows.column("index").to_pylist() == list(range(N))
  assert set(rows.column("dataset").to_pylist()) == {DATA}
  assert set(rows.column("split").to_pylist()) == {SPLIT}
  logits = _direct_logits(teacher)
  probs = np.exp(logits - logits.max(1, keepdims=True))
  probs /= probs.sum(1, keepdims=True)
  want = np.argsort(-probs, axis=1, kind="stable")[:, :3]
  got = np.array(rows.column("classes").to_pylist())
  np.testing.assert_array_equal(got, want)
  np.testing.assert_allclose(np.array(rows.column("scores").to_pylist()),
                             np.take_along_axis(probs, want, 1), rtol=1e-4, atol=1e-6)
  # The selection job reads the folder as it is.
  preds = selection_formats.load_predictions(out, classes_names)
  assert preds.num_records == N and len(preds.shards) == 3


def test_logits_option_writes_raw_logits(teacher, tmp_path):
  info = pool_predictions.run(teacher, DATA, SPLIT, str(tmp_path), **{**KW, "shard_size": 64},
                   logits=True)
  assert info["scores"] == "logits"
  logits = _direct_logits(teacher)
  rows = _rows(tmp_path)
  want = np.argsort(-logits, axis=1, kind="stable")[:, :3]
  np.testing.assert_array_equal(np.array(rows.column("classes").to_pylist()), want)
  np.testing.assert_allclose(np.array(rows.column("scores").to_pylist()),
                             np.take_along_axis(logits, want, 1), rtol=1e-4, atol=1e-5)


def test_a_killed_run_resumes_without_duplicates_or_gaps(teacher, predictions, tmp_path,
                                                          monkeypatch, capsys):
  reference, _ = predictions
  written = []
  real_write = pool_predictions._write_shard

  def write_then_die(out, name, *args):
    if written:  # Killed while writing the second shard: only its temporary file is left.
      (out / f".{name}.tmp-dead").write_bytes(b"partial")
      raise KeyboardInterrupt
    written.append(name)
    real_write(out, name, *args)

  monkeypatch.setattr(pool_predictions, "_write_shard", write_then_die)
  capsys.readouterr()
  try:
    pool_predictions.run(teacher, DATA, SPLIT, str(tmp_path), **{**KW, "progress": True})
  except KeyboardInterrupt:
    # What is printed by the time a command's error handler runs (the traceback alive): the
    # progress bar's line is ended, so the error line starts on a line of its own.
    bar = capsys.readouterr().out
  else:
    raise AssertionError("the run was not interrupted")
  assert f"{DATA}:{SPLIT}:" in bar and bar.endswith("\n"), repr(bar[-200:])
  assert [p.name for p in tmp_path.glob("*.parquet")] == [f"{SPLIT}-00000-of-00003.parquet"]
  assert not (tmp_path / selection_formats.INFO_FILE).exists()

  written.clear()
  monkeypatch.setattr(pool_predictions, "_write_shard",
                      lambda out, name, *a: (written.append(name), real_write(out, name, *a)))
  capsys.readouterr()
  info = pool_predictions.run(teacher, DATA, SPLIT, str(tmp_path), **KW)
  assert written == [f"{SPLIT}-00001-of-00003.parquet", f"{SPLIT}-00002-of-00003.parquet"]
  # What the resume has left to do is said (20 + 10 of the 50 records).
  assert f"{DATA}:{SPLIT}: 3 shards, 2 pending (30 records, 0 excluded in all)." in (
      capsys.readouterr().out)
  assert info["num_records"] == N
  for ref in sorted(reference.glob("*.parquet")):
    assert pq.read_table(tmp_path / ref.name).equals(pq.read_table(ref)), ref.name
  # A lost shard (and predictions.json) is redone alone; a finished folder writes nothing.
  (tmp_path / f"{SPLIT}-00001-of-00003.parquet").unlink()
  (tmp_path / selection_formats.INFO_FILE).unlink()
  written.clear()
  pool_predictions.run(teacher, DATA, SPLIT, str(tmp_path), **KW)
  written_after_loss = list(written)
  written.clear()
  assert pool_predictions.run(teacher, DATA, SPLIT, str(tmp_path), **KW) == info
  assert written_after_loss == [f"{SPLIT}-00001-of-00003.parquet"] and written == []
  assert _rows(tmp_path).equals(_rows(reference))


def test_host_slices_cover_each_record_of_a_shard_once():
  """What each of 2 processes reads of shard [20, 40): disjoint halves, together the range
  (the forward pass then gathers their rows; a real 2-process run is not part of this test)."""
  source = subset.RangeSource(datasets.get_dataset({"name": DATA}).source(SPLIT), 20, 40)
  seen = []
  for p in range(2):
    for batch in pipeline.eval_iterator(source, {"image_size": 32}, global_batch_size=16,
                                        process_index=p, process_count=2, fields={}):
      seen.append(batch["index"][batch["mask"] > 0] + source.start)
  seen = np.concatenate(seen)
  assert sorted(seen.tolist()) == list(range(20, 40))


def test_forward_rows_come_in_record_order_whatever_order_the_hosts_rows_arrive_in():
  """The global batch holds host 0's rows, then host 1's...: forward_rows sorts them, so dedup's
  index positions and ties follow record order on any process count (here: a step that
  reverses its rows, one process)."""
  source = subset.RangeSource(datasets.get_dataset({"name": DATA}).source(SPLIT), 0, 20)
  mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})

  def step(params, extra, batch):
    del params, extra
    return {"index": batch["index"][::-1], "mask": batch["mask"][::-1]}

  rows = [r["index"] for r, _ in inference.forward_rows(
      step, {"params": {}, "extra": {}}, source, {"image_size": 32}, batch_size=16, mesh=mesh)]
  assert [len(r) for r in rows] == [16, 4]
  assert np.concatenate(rows).tolist() == list(range(20))


def test_bad_input_is_refused_clearly(teacher, predictions, tmp_path, monkeypatch):
  with pytest.raises(ValueError, match="no split 'nope'.*unlabeled"):
    pool_predictions.run(teacher, DATA, "nope", str(tmp_path / "a"), **KW)
  with pytest.raises(ValueError, match=r"no split 'unlabeled\[:8\]'.*scores whole splits"):
    pool_predictions.run(teacher, DATA, "unlabeled[:8]", str(tmp_path / "a"), **KW)
  with pytest.raises(ValueError, match=r"--top_p=0 must be an integer in \[1, "):
    pool_predictions.run(teacher, DATA, SPLIT, str(tmp_path / "b"), **{**KW, "top_p": 0})
  with pytest.raises(FileNotFoundError, match="Exclusion list .*none.tsv does not exist"):
    pool_predictions.run(teacher, DATA, SPLIT, str(tmp_path / "e"),
                         **{**KW, "exclude": str(tmp_path / "none.tsv")})
  assert not (tmp_path / "a").exists() and not (tmp_path / "e").exists()  # Nothing made.
  (tmp_path / "a_file").write_text("")
  with pytest.MonkeyPatch.context() as patch:  # Refused before the model is loaded.
    patch.setattr(pool_predictions.pretrained, "load", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ValueError, match="--out=.*a_file cannot be written as a folder"):
      pool_predictions.run(teacher, DATA, SPLIT, str(tmp_path / "a_file"), **KW)
  # A started folder resumes only with the same parameters, and the same teacher checkpoint:
  # shards scored by the step recorded, not by one the teacher has trained since.
  out, _ = predictions
  with pytest.raises(ValueError, match="other parameters.*top_p"):
    pool_predictions.run(teacher, DATA, SPLIT, str(out), **{**KW, "top_p": 5})
  params = json.loads((out / pool_predictions.PARAMS_FILE).read_text())
  ckpts = pathlib.Path(teacher) / "checkpoints"
  assert params["checkpoint_step"] == max(int(p.name) for p in ckpts.iterdir()
                                          if p.name.isdigit())
  older = tmp_path / "older"
  shutil.copytree(out, older)
  (older / pool_predictions.PARAMS_FILE).write_text(
      json.dumps({**params, "checkpoint_step": params["checkpoint_step"] - 1}))
  with pytest.raises(ValueError, match=r"other parameters \{'checkpoint_step': .*the teacher "
                                       r"has a newer checkpoint .*use another --out"):
    pool_predictions.run(teacher, DATA, SPLIT, str(older), **KW)
  real = datasets.get_dataset

  def fewer_classes(cfg):
    ds = real(cfg)
    ds.info = dataclasses.replace(ds.info, num_classes=ds.info.num_classes - 1,
                                  class_names=ds.info.class_names[:-1])
    return ds

  monkeypatch.setattr(datasets, "get_dataset", fewer_classes)
  with pytest.raises(ValueError, match="predicts .* classes .* the pool must be labelled"):
    pool_predictions.run(teacher, DATA, SPLIT, str(tmp_path / "c"), **KW)


# ---------------------------------------------------------------- the selection:DIR source


@pytest.fixture(scope="module")
def selected(predictions, tmp_path_factory):
  out = tmp_path_factory.mktemp("dhat")
  selection_job.prepare(predictions[0], out, k=2)
  return out


def test_selection_source_reads_the_selected_images_and_labels(selected):
  info, table = selection_job.read_index(selected)
  assert len(table) == info["report"]["num_selected"] > 0
  demo = datasets.get_dataset({"name": "demo"})
  dhat = datasets.get_dataset({"name": f"selection:{selected}"})
  assert dhat.info.class_names == demo.info.class_names
  # D-hat is 'train'; the source's other splits pass through.
  assert dhat.info.num_examples == {"train": len(table), "unlabeled": N, "validation": N}
  assert dhat.info.splits == ("train", "unlabeled", "validation")
  source = dhat.source("train")
  pool = demo.source(SPLIT)
  assert len(source) == len(table)
  for i, (split, index, label) in enumerate(zip(*(table.column(c).to_pylist()
                                                  for c in ("split", "index", "label")))):
    assert split == SPLIT
    assert source[i]["image"] == pool[index]["image"]
    assert source[i]["label"] == label
  val, demo_val = dhat.source("validation"), demo.source("validation")
  assert [val[i]["image"] for i in range(N)] == [demo_val[i]["image"] for i in range(N)]
  # The ordinary train pipeline reads it.
  batch = next(iter(pipeline.train_iterator(source, {"image_size": 32}, global_batch_size=8,
                                            seed=0, process_index=0, process_count=1)))
  assert batch["image"].shape == (8, 32, 32, 3)
  assert set(batch["label"].tolist()) <= set(table.column("label").to_pylist())


def test_selection_source_bad_input(selected, tmp_path):
  with pytest.raises(FileNotFoundError, match="No finished selection"):
    datasets.get_dataset({"name": f"selection:{tmp_path}"})
  with pytest.raises(ValueError, match="Unknown split 'test'"):
    datasets.get_dataset({"name": f"selection:{selected}"}).source("test")
  broken = tmp_path / "broken"
  shutil.copytree(selected, broken)
  meta = json.loads((broken / "selection.json").read_text())
  path = broken / meta["index_files"][0]
  table = pq.read_table(path)
  index = table.column("index").to_numpy().copy()
  index[0] = N  # One past the split's end.
  pq.write_table(table.set_column(2, "index", pa.array(index)), path)
  with pytest.raises(ValueError, match=f"points at record {N} of split 'unlabeled', which "
                                       f"has {N} records"):
    datasets.get_dataset({"name": f"selection:{broken}"})
