"""`bigpretrain.tools.evaluate`: several test sets in one command, ReaL labels, class maps, and
submodels with residual blocks removed (cosub supplement D.2)."""
import dataclasses
import subprocess
import sys

import cv2
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bigpretrain import sharding
from bigpretrain.evaluators import classification
from bigpretrain.evaluators import evaluate
from bigpretrain import models
from bigpretrain import preprocess
from bigpretrain import train
from bigpretrain.models import pretrained
from bigpretrain.evaluators import mapped
from bigpretrain.models import submodel
from bigpretrain.objectives import multi_label
from bigpretrain.objectives import semantic_softmax
from bigpretrain.objectives import softmax
from bigpretrain.semantic import tree as semantic_tree
from input_pipeline import datasets
from input_pipeline import pipeline
from input_pipeline import subset
from tests import helpers

N = 40  # Eval images: not a multiple of the batch (16), so the last batch is padded.


class _Head:
  """'evalhead:N': the demo cut to its first N records per split; 'evalreal:N' adds ReaL-style
  'real_label' lists (see _real_labels)."""

  def __init__(self, name, data_dir):
    self.demo = datasets.get_dataset({"name": "demo", "dir": data_dir})
    self.real = name.startswith("evalreal")
    n = int(name.split(":")[1])
    features = {**self.demo.info.features, **({"real_label": None} if self.real else {})}
    self.info = dataclasses.replace(
        self.demo.info, name=name, features=features,
        num_examples={s: min(n, k) for s, k in self.demo.info.num_examples.items()})

  def source(self, split):
    src = subset.RangeSource(self.demo.source(split), 0, self.info.num_examples[split])
    return _WithReal(src, self.info.num_classes) if self.real else src


def _real_labels(k: int, label: int, num_classes: int) -> list[int]:
  """Record k's real labels: none, its label, its label and another, or only another."""
  return [[], [label], [label, (label + 1) % num_classes], [(label + 2) % num_classes]][k % 4]


class _WithReal:

  def __init__(self, source, num_classes):
    self.source, self.num_classes = source, num_classes

  def __len__(self):
    return len(self.source)

  def __getitem__(self, k):
    r = self.source[k]
    return {**r, "real_label": _real_labels(k, r["label"], self.num_classes)}


datasets.register_source("evalhead:", _Head)
datasets.register_source("evalreal:", _Head)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("run"))
  config = helpers.tiny_config("single_label", total_steps=3, **{"data.name": f"evalhead:{N}"})
  # The mapped evaluation scheduled in the run itself, at its end.
  config.evals.real = dict(type="mapped", dataset=f"evalreal:{N}", every_steps=0)
  results = train.train_and_evaluate(config, workdir)
  return workdir, results


def _dataset_logits(workdir, name, forward):
  """Logits of `forward(module, images)` over the first N validation images, with labels."""
  loaded = pretrained.load(workdir)
  module = loaded.module()
  data_cfg = {**loaded.meta["data"], "name": name}
  source = datasets.get_dataset(data_cfg).source("validation")
  logits, labels = [], []
  for batch in pipeline.eval_iterator(source, data_cfg, global_batch_size=16, process_index=0,
                                      process_count=1):
    images = preprocess.normalize(jnp.asarray(batch["image"]), data_cfg["normalize"])
    keep = batch["mask"] > 0
    logits.append(np.asarray(forward(module, images))[keep])
    labels.append(batch["label"][keep])
  return np.concatenate(logits), np.concatenate(labels)


def _vit_without(model, i, images):
  """The ViT's forward written out with block i skipped (x -> x)."""
  x = model._tokens(images)  # pylint: disable=protected-access
  for j, block in enumerate(model.blocks):
    if j != i:
      x = block(x)
  x = model.norm(x)[:, 0].astype(jnp.float32)
  return model.head(x)


def test_real_accuracy_by_hand():
  scores = jnp.array([[0.1, 0.9, 0.0],   # top-1 = 1, real {1, 2}: hit
                      [0.8, 0.1, 0.1],   # top-1 = 0, real {2}: miss
                      [0.2, 0.3, 0.5],   # real {}: not counted
                      [0.0, 0.0, 1.0],   # top-1 = 2, real {2}: hit, but a padding row
                      [0.3, 0.3, 0.4]])  # top-1 = 2, real {0, 1, 2}: hit
  real = jnp.array([[1, 2, -1], [2, -1, -1], [-1, -1, -1], [2, -1, -1], [0, 1, 2]])
  mask = jnp.array([1.0, 1, 1, 0, 1])
  hits, valid = mapped.real_accuracy(scores, real, mask)
  assert (float(hits), float(valid)) == (2.0, 3.0)


def test_parse_flags():
  assert evaluate.parse_datasets("demo:validation, tfds:imagenet_v2,tfds:imagenet_v2:test") == [
      ("demo", "validation"), ("tfds:imagenet_v2", ""), ("tfds:imagenet_v2", "test")]
  assert evaluate.parse_datasets("demo:validation[10:20],tfds:imagenet2012:validation[:500]") == [
      ("demo", "validation[10:20]"), ("tfds:imagenet2012", "validation[:500]")]
  assert evaluate.parse_drop_blocks("3,7") == (3, 7)
  assert evaluate.parse_drop_blocks("sweep") == "sweep"
  assert evaluate.parse_drop_blocks("") == ()
  with pytest.raises(ValueError, match="block indices"):
    evaluate.parse_drop_blocks("3,x")


def test_class_columns_by_name_and_by_map():
  model = ["n1", "n2", "n3", "n4"]
  # A model with more classes (a 21K model on 1K wnids): each class by name.
  assert mapped.class_columns(model, ["n3", "n1"], "d").tolist() == [[2], [0]]
  # A map with several model classes per dataset class, padded by the first one.
  cols = mapped.class_columns(model, ["chair", "cup"], "d",
                                {"chair": ["n2", "n4"], "cup": "n3"})
  assert cols.tolist() == [[1, 3], [2, 2]]
  with pytest.raises(ValueError, match="--class_map"):
    mapped.class_columns(model, ["chair"], "objectnet")
  with pytest.raises(ValueError, match="no entry for 1 classes"):
    mapped.class_columns(model, ["chair", "cup"], "d", {"chair": "n1"})
  with pytest.raises(ValueError, match="does not have"):
    mapped.class_columns(model, ["chair"], "d", {"chair": ["n9"]})


def _with_tree(cls, tree):
  objective = cls.__new__(cls)  # The scores read only the tree: no WordNet lookup here.
  objective.tree = tree
  return objective


def test_a_class_with_subclasses_is_credited_with_them():
  # Model classes: roots A (0), B (1); a1 (2), a2 (3) under A. Dataset classes A and B (an
  # ImageNet-1k class with ImageNet-21K subclasses), then A, a1 and B (one nested in another).
  tree = semantic_tree.SemanticTree.from_parents([-1, -1, 0, 0])
  two, three = np.array([[0], [1]]), np.array([[0], [2], [1]])
  # Semantic softmax: P(A) = 0.8 at level 0, P(a1) = 0.9 at level 1, so the walk passes
  # through A with 0.8 and never stops there (level 1 has only A's children).
  logits = jnp.log(jnp.array([[0.8, 0.2, 0.9, 0.1]]))
  semantic = _with_tree(semantic_softmax.SemanticSoftmax, tree)
  np.testing.assert_allclose(semantic.answer(logits), [[0, 0.2, 0.72, 0.08]], atol=1e-6)
  for columns, want in [(two, [0.8, 0.2]), (three, [0.8 - 0.72, 0.72, 0.2])]:
    got = mapped.mapped_scores(semantic, logits, columns, mapped.nested_pairs(tree, columns))
    np.testing.assert_allclose(got, [want], atol=1e-6)
  # A softmax over all four classes: A's subtree sums its own and its children's.
  probs = np.array([[0.1, 0.3, 0.4, 0.2]])
  single = _with_tree(softmax.Softmax, tree)
  for columns, want in [(two, [0.7, 0.3]), (three, [0.1 + 0.2, 0.4, 0.3])]:
    got = mapped.mapped_scores(single, jnp.log(probs), columns,
                               mapped.nested_pairs(tree, columns))
    np.testing.assert_allclose(got, [want], atol=1e-6)
  # Sigmoids trained on label + ancestors already score the subtree.
  sig = np.array([[0.6, 0.5, 0.7, 0.1]])
  multi = _with_tree(multi_label.MultiLabel, tree)
  for columns, want in [(two, [0.6, 0.5]), (three, [0.0, 0.7, 0.5])]:  # 0.6 - 0.7 < 0.
    got = mapped.mapped_scores(multi, jnp.log(sig / (1 - sig)), columns,
                               mapped.nested_pairs(tree, columns))
    np.testing.assert_allclose(got, [want], atol=1e-6)
  # One dataset class mapped to A and its child a1: the best of the two memberships, nothing
  # taken off A (A's subtree for semantic and single softmax, as if mapped to A alone).
  same_row = np.array([[0, 2], [1, 1]])
  for objective in (semantic, single, multi):
    got = mapped.mapped_scores(objective, logits, same_row,
                               mapped.nested_pairs(tree, same_row))
    member = np.asarray(objective.membership(logits))
    np.testing.assert_allclose(got, [[member[0, [0, 2]].max(), member[0, 1]]], atol=1e-6)
    if objective is not multi:
      np.testing.assert_allclose(got, mapped.mapped_scores(objective, logits, two,
                                                           mapped.nested_pairs(tree, two)),
                                 atol=1e-6)
  # Every model class mapped: the scores are the answer (exactly that class) again.
  every = np.arange(4)[:, None]
  for objective in (semantic, single, multi):
    got = mapped.mapped_scores(objective, logits, every, mapped.nested_pairs(tree, every))
    np.testing.assert_allclose(got, objective.answer(logits), atol=1e-6)


def test_original_label_is_read_as_label():
  # tfds imagenet2012_real keeps the ImageNet label as 'original_label'.
  assert datasets._clean({"original_label": np.int64(7)}) == {"label": 7}  # pylint: disable=protected-access


def test_a_saved_run_evaluates_to_the_trainers_final_eval(run):
  workdir, trained = run
  out = evaluate.evaluate(workdir, run_config=evaluate.read_run_config(workdir))
  got = out[f"evalhead:{N}:validation{helpers.EVAL_RECORDS}"]  # The run's own eval split.
  for key in ("top1", "top5", "num_examples"):
    assert got[key] == trained[f"eval/{key}"], key
  assert got["num_examples"] == N
  logits, labels = _dataset_logits(workdir, f"evalhead:{N}",
                                   lambda m, x: m(x, train=False))
  np.testing.assert_allclose(got["top1"], np.mean(np.argmax(logits, -1) == labels))
  # A run that evaluated a slice of its split: that slice again, not the whole split.
  sliced = evaluate.read_run_config(workdir)
  sliced["data"]["eval_split"] = "validation[:8]"
  out = evaluate.evaluate(workdir, run_config=sliced)
  got = out[f"evalhead:{N}:validation[:8]"]
  assert got["num_examples"] == 8
  np.testing.assert_allclose(got["top1"], np.mean(np.argmax(logits[:8], -1) == labels[:8]))


def test_two_datasets_in_one_call_with_real_labels(run):
  workdir, results = run
  out = evaluate.evaluate(workdir, [(f"evalhead:{N}", ""), (f"evalreal:{N}", "validation")],
                          run_config=evaluate.read_run_config(workdir))
  own = f"evalhead:{N}:validation{helpers.EVAL_RECORDS}"  # No split: the run's eval split.
  assert sorted(out) == [own, f"evalreal:{N}:validation"]
  real = out[f"evalreal:{N}:validation"]
  logits, labels = _dataset_logits(workdir, f"evalreal:{N}", lambda m, x: m(x, train=False))
  pred = np.argmax(logits, -1)
  sets = [_real_labels(k, int(y), logits.shape[1]) for k, y in enumerate(labels)]
  counted = [k for k, s in enumerate(sets) if s]
  assert real["num_real_examples"] == len(counted) == N * 3 // 4
  expected = np.mean([pred[k] in sets[k] for k in counted])
  np.testing.assert_allclose(real["real_top1"], expected)
  # Its original labels give the same top-1 as the same images without ReaL labels.
  np.testing.assert_allclose(real["top1"], out[own]["top1"])
  # The run's own 'mapped' evaluator, on the same final weights, gave the same numbers.
  for key in ("real_top1", "top1", "num_real_examples"):
    np.testing.assert_allclose(results[f"real/{key}"], real[key], atol=1e-6)


@pytest.mark.parametrize("i", [0, 2])
def test_removing_a_vit_block_equals_the_forward_that_skips_it(i):
  model = models.get_model("vit_demo", num_classes=10, rngs=nnx.Rngs(0), head_zeroinit=False)
  images = jax.random.normal(jax.random.key(1), (3, 32, 32, 3))
  expected = _vit_without(model, i, images)
  full = model(images)
  got = submodel.remove_blocks(nnx.clone(model), [i])(images)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  assert np.max(np.abs(np.asarray(full) - np.asarray(got))) > 1e-3  # The block mattered.


def test_removing_a_resnet_block_keeps_its_relu_and_refuses_projection_blocks():
  model = models.get_model("resnet18", num_classes=10, rngs=nnx.Rngs(0),
                           zero_init_residual=False)
  model.head.kernel[...] = jax.random.normal(jax.random.key(2), model.head.kernel.shape)
  images = jax.random.normal(jax.random.key(1), (2, 32, 32, 3))
  # resnet18: blocks 0-7; 2, 4 and 6 open stages 2-4 with a projection shortcut.
  assert submodel.removable(model) == [True, True, False, True, False, True, False, True]
  x = jax.nn.relu(model.stem_bn(model.stem_conv(images), use_running_average=True))
  x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
  for j, block in enumerate(model.blocks):
    x = jax.nn.relu(x) if j == 3 else block(x, train=False)
  expected = model.head(jnp.mean(x, axis=(1, 2)))
  got = submodel.remove_blocks(nnx.clone(model), [3])(images)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="block 2 of ResNet changes the width"):
    submodel.remove_blocks(nnx.clone(model), [2])
  with pytest.raises(ValueError, match="block 8 does not exist: ResNet has 8 blocks"):
    submodel.check(model, [8])


def test_drop_blocks_and_sweep_on_a_run(run):
  workdir, trained = run
  ev = evaluate.Evaluation(workdir, run_config=evaluate.read_run_config(workdir))
  test_sets = [ev.test_set(f"evalhead:{N}")]
  name = test_sets[0].name
  dropped = ev.run(test_sets, (1,))[name]
  logits, labels = _dataset_logits(workdir, f"evalhead:{N}",
                                   lambda m, x: _vit_without(m, 1, x))
  np.testing.assert_allclose(dropped["top1"], np.mean(np.argmax(logits, -1) == labels))
  top5 = np.mean([y in np.argsort(-row)[:5] for row, y in zip(logits, labels)])
  np.testing.assert_allclose(dropped["top5"], top5)
  sweep = ev.sweep(test_sets)  # Reuses the step compiled for block 1.
  assert sweep["num_blocks"] == 4 and sweep["not_removable"] == []
  assert sorted(sweep["drop"]) == ["0", "1", "2", "3"]
  assert sweep["drop"]["1"][name] == dropped
  assert sweep["full"][name]["top1"] == trained["eval/top1"]
  table = evaluate.sweep_table(sweep)
  assert len(table.splitlines()) == 1 + 1 + 4  # Header, the whole model, one row per block.


def test_bad_input_errors_clearly(run, tmp_path):
  workdir, _ = run
  cfg = evaluate.read_run_config(workdir)
  with pytest.raises(ValueError, match="block 4 does not exist: VisionTransformer has 4"):
    evaluate.evaluate(workdir, run_config=cfg, drop_blocks=(1, 4))
  with pytest.raises(FileNotFoundError, match="imagenet_v2"):
    evaluate.evaluate(workdir, [("tfds:imagenet_v2", "")], run_config=cfg,
                      data_dir=str(tmp_path))
  with pytest.raises(ValueError, match="no split 'test'"):
    evaluate.evaluate(workdir, [(f"evalhead:{N}", "test")], run_config=cfg)
  with pytest.raises(ValueError, match="--batch_size=12 is not divisible by the 8 "):
    evaluate.evaluate(workdir, run_config=cfg, batch_size=12)
  with pytest.raises(FileNotFoundError, match="needs a run folder"):
    evaluate.read_run_config(str(tmp_path))
  # The command: one error line, exit status 1.
  out = subprocess.run([sys.executable, "-m", "bigpretrain.tools.evaluate", f"--workdir={workdir}",
                        "--datasets=demo", "--drop_blocks=7"], env=helpers.env(),
                       cwd=helpers.ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1
  # The error is the one line the command writes: no INFO log of the checkpoint restore
  # before it (--verbosity brings the log back).
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("ERROR: block 7 does not exist"), lines[:5]


def test_a_split_with_no_readable_record_is_an_error_not_an_empty_metric_row():
  records = [{"image": b"not an image", "label": 0}] * 3
  dataset = type("Corrupt", (), {"info": type("Info", (), {"name": "corrupt"})(),
                                 "source": staticmethod(lambda split: records)})()
  step = jax.jit(lambda p, e, b: {"top1": (jnp.sum(b["mask"]), jnp.sum(b["mask"]))})
  data_cfg = {**pipeline.data_defaults(), "image_size": 8}
  mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
  with pytest.raises(ValueError, match=r"No record of split 'validation' of 'corrupt' could "
                                       r"be read \(3 corrupt"):
    classification.evaluate(step, {"params": {}, "extra": {}}, dataset, data_cfg, mesh,
                            split="validation", batch_size=8, fields={"label": 0})
  records[1] = {"image": cv2.imencode(".png", np.zeros((8, 8, 3), np.uint8))[1].tobytes(),
                "label": 0}
  totals, skipped, _ = classification.evaluate(
      step, {"params": {}, "extra": {}}, dataset, data_cfg, mesh, split="validation",
      batch_size=8, fields={"label": 0})
  assert (float(totals["top1"][0]), skipped) == (1.0, 2)


def test_a_broken_json_file_is_named(tmp_path):
  broken = tmp_path / "map.json"
  broken.write_text("{chair: 'n1'}")
  with pytest.raises(ValueError, match=rf"--class_map={broken} is not valid JSON: Expecting "):
    mapped.load_class_map(str(broken))
  broken.write_bytes(b'{"chair": "\xff"}')  # Not UTF-8.
  with pytest.raises(ValueError, match=rf"--class_map={broken} is not valid JSON: 'utf-8'"):
    mapped.load_class_map(str(broken))
  with pytest.raises(FileNotFoundError, match=r"--class_map=\S+none.json: no such file\.$"):
    mapped.load_class_map(str(tmp_path / "none.json"))
  broken.write_text("[1]")
  with pytest.raises(ValueError, match=r"a JSON object \{dataset class: model class or \[model "
                                       r"classes\]\}\.$"):
    mapped.load_class_map(str(broken))
  (tmp_path / "config.json").write_text('{"batch_size": 8,')
  with pytest.raises(ValueError, match=r"config\.json is not valid JSON .*--checkpoint"):
    evaluate.read_run_config(str(tmp_path))
