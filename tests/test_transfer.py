"""Transfer: ridge solve, k-shot draws, the few-shot / linear evaluators, configs/transfer.py
end to end on the demo, demo_coarse."""
import functools
import json

import numpy as np
import pytest

from bigpretrain.evaluators import linear_probe
from bigpretrain import train
from configs import transfer
from input_pipeline import datasets
from input_pipeline.sources import demo_coarse
from tests import helpers

pytestmark = pytest.mark.slow  # end-to-end recipe runs


def _lstsq_ridge(x, y, num_classes, l2):
  """Ridge by hand: whiten, append the bias feature, then least squares of the stacked system
  [X; sqrt(l2) I] W = [T; 0]."""
  mean, std = x.mean(0), x.std(0) + 1e-5
  xb = np.pad((x - mean) / std, ((0, 0), (0, 1)), constant_values=100.0)
  t = 2.0 * np.eye(num_classes)[y] - 1.0
  d = xb.shape[1]
  a = np.concatenate([xb, np.sqrt(l2) * np.eye(d)])
  b = np.concatenate([t, np.zeros((d, num_classes))])
  return np.linalg.lstsq(a, b, rcond=None)[0], mean, std


@pytest.mark.parametrize("n", [40, 6])  # Primal (N >= D) and dual (N < D) solves.
def test_ridge_fit_equals_lstsq_by_hand(n):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 8)) * 3 + 1
  y = np.arange(n) % 3
  for l2 in (0.5, 2.0 ** 10):
    got = linear_probe.ridge_fit(x, y, 3, l2)
    w, mean, std = _lstsq_ridge(x, y, 3, l2)
    np.testing.assert_allclose(got["w"], w, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(got["mean"], mean)
    np.testing.assert_allclose(got["std"], std)


def test_ridge_separates_separable_classes():
  x = np.array([[0.0, 0.0], [0.1, 0.0], [5.0, 5.0], [5.1, 5.0]])
  y = np.array([0, 0, 1, 1])
  assert linear_probe.ridge_accuracy(x, y, x, y, 2, l2=1e-3) == 1.0


def test_kshot_draw_is_seeded_class_balanced_and_nested():
  labels = np.array([2, 0, 1, 0, 2, 1, 0, 2, 1, 0, 0, 2])
  a = linear_probe.kshot_draw(labels, 3, 3, seed=1)
  np.testing.assert_array_equal(a, linear_probe.kshot_draw(labels, 3, 3, seed=1))
  np.testing.assert_array_equal(np.bincount(labels[a]), [3, 3, 3])
  assert len(set(a.tolist())) == 9
  # The draw is numpy's default_rng(seed) permuting each class's members in class order.
  rng = np.random.default_rng(1)
  want = [rng.permutation(np.flatnonzero(labels == c))[:3] for c in range(3)]
  np.testing.assert_array_equal(a, np.concatenate(want))
  one = linear_probe.kshot_draw(labels, 3, 1, seed=1)
  assert set(one.tolist()) <= set(a.tolist())  # 1-shot inside 3-shot, same seed.
  assert not np.array_equal(a, linear_probe.kshot_draw(labels, 3, 3, seed=2))


def test_kshot_larger_than_a_class_errors():
  with pytest.raises(ValueError, match="class 1 has only 3 examples"):
    linear_probe.kshot_draw(np.array([0, 0, 0, 0, 1, 1, 1]), 2, 4, seed=0)


def test_fewshot_accuracies_from_drawn_features_only():
  rng = np.random.default_rng(0)
  y = np.repeat(np.arange(4), 12)
  x = rng.normal(size=(48, 5)) + y[:, None]
  xt, yt = rng.normal(size=(20, 5)) + np.arange(20)[:, None] % 4, np.arange(20) % 4
  drawn = linear_probe.drawn_indices(y, 4, (1, 5), 2)
  got = linear_probe.fewshot_accuracies(x[drawn], drawn, y, xt, yt, 4, shots=(1, 5), seeds=2)
  for k in (1, 5):
    want = np.mean([linear_probe.ridge_accuracy(x[i], y[i], xt, yt, 4) for i in
                    (linear_probe.kshot_draw(y, 4, k, s) for s in range(2))])
    assert got[k] == pytest.approx(want)


def test_demo_coarse_labels_are_level1_ancestors():
  info = datasets.get_dataset({"name": "demo_coarse"}).info
  assert info.splits == ("train", "validation")
  fine = datasets.get_dataset({"name": "demo"})
  from bigpretrain.semantic import tree as tree_lib
  tree = tree_lib.SemanticTree.from_wnids(fine.info.class_names)
  # Every image pictures a leaf; the leaves' level-1 ancestors are all 12 level-1 classes.
  level1 = [fine.info.class_names[c] for c in np.flatnonzero(tree.class_depth == 1)]
  assert info.num_classes == 12 and info.class_names == level1
  mapping, names = demo_coarse.coarse_map(fine.info.class_names, leaves_only=True)
  assert names == info.class_names
  is_parent = np.isin(np.arange(tree.num_classes), tree.parent)
  for c in range(tree.num_classes):
    if is_parent[c]:
      assert mapping[c] == -1
      continue
    node = c
    while tree.class_depth[node] > 1:
      node = tree.parent[node]
    assert names[mapping[c]] == fine.info.class_names[node]
  # A validation image of a root class pictures a member with a shape; its coarse label is
  # that member's level-1 ancestor.
  source = datasets.get_dataset({"name": "demo_coarse"}).source("validation")
  labels = []
  for i in range(len(source)):
    record = source[i]
    labels.append(record["label"])
    if tree.class_depth[record["true_label"]] == 0:
      assert tree.class_depth[record["member"]] > 1
      assert record["label"] == mapping[record["member"]]
  assert sorted(set(labels)) == list(range(12))  # Every coarse class has images.
  # Without leaves_only (demo_plain_coarse) the roots are classes too.
  _, plain_names = demo_coarse.coarse_map(fine.info.class_names)
  assert len(plain_names) == 16


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
  """A 2-step single-label demo run (vit_demo): the checkpoint the transfers start from."""
  workdir = tmp_path_factory.mktemp("pretrain")
  config = helpers.tiny_config("single_label", total_steps=2)
  config.evals.fewshot.datasets = {}
  train.train_and_evaluate(config, str(workdir))
  return str(workdir)


def _transfer(arg, workdir, **overrides):
  config = transfer.get_config(arg)
  config.batch_size = 16
  config.compilation_cache_dir = helpers.JAX_CACHE
  config.data.eval_split += helpers.EVAL_RECORDS
  helpers.set_overrides(config, overrides)
  results = train.train_and_evaluate(config, str(workdir))
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  return config, results, rows


@functools.cache
def _forward(checkpoint):
  """The loaded model's features(), jitted (loaded and compiled once per checkpoint)."""
  import jax
  from bigpretrain.models import pretrained
  model = pretrained.load(checkpoint).module()
  return jax.jit(lambda images: model.features(images, train=False))


def _features(checkpoint, data_cfg, source):
  """Features and labels of `source`, computed apart from bigpretrain.evaluators.linear_probe: the loaded
  model's features() on the eval pipeline's images, one device."""
  from bigpretrain import preprocess
  from input_pipeline import pipeline
  forward = _forward(str(checkpoint))
  out, labels = [], []
  for b in pipeline.eval_iterator(source, data_cfg, global_batch_size=256, process_index=0,
                                  process_count=1, fields={"label": 0}):
    keep = b["mask"] > 0
    images = preprocess.normalize(b["image"], data_cfg.normalize)
    out.append(np.asarray(forward(images))[keep])
    labels.append(b["label"][keep])
  return np.concatenate(out), np.concatenate(labels)


def test_fewshot_evaluator_equals_numpy_on_the_same_features(tiny_checkpoint, tmp_path):
  from input_pipeline import subset
  config, results, rows = _transfer(f"mode=fewshot,init={tiny_checkpoint}", tmp_path)
  assert config.evals.fewshot.l2_reg == 1.0  # The demo's value (configs/common_fewshot.py).
  assert config.total_steps == 0 and rows[-1]["step"] == 0
  keys = {f"fewshot/demo_coarse_{k}shot" for k in (1, 5, 10, 25)}
  assert keys <= set(rows[-1]) and keys <= set(results)
  ds = datasets.get_dataset({"name": "demo_coarse"})
  train_source = ds.source("train")
  y = np.array([train_source[i]["label"] for i in range(len(train_source))])
  xt, yt = _features(tiny_checkpoint, config.data, ds.source("validation"))
  for k in (1, 25):
    accs = []
    for seed in range(3):
      rng = np.random.default_rng(seed)  # big_vision's draw, written out.
      idx = np.concatenate([rng.permutation(np.flatnonzero(y == c))[:k] for c in range(16)])
      x, yk = _features(tiny_checkpoint, config.data, subset.SubsetSource(train_source, idx))
      np.testing.assert_array_equal(yk, y[idx])
      w, mean, std = _lstsq_ridge(x, yk, 16, config.evals.fewshot.l2_reg)
      xb = np.pad((xt - mean) / std, ((0, 0), (0, 1)), constant_values=100.0)
      accs.append(np.mean(np.argmax(xb @ w, 1) == yt))
    assert results[f"fewshot/demo_coarse_{k}shot"] == pytest.approx(np.mean(accs), abs=2e-3)


def test_linear_and_finetune_modes_run_on_the_demo(tiny_checkpoint, tmp_path):
  config, results, rows = _transfer(f"mode=linear,init={tiny_checkpoint}", tmp_path / "lin",
                                    **{"evals.linear.train_records": 400})
  assert rows[-1]["step"] == 0 and results["linear/num_train"] == 400
  ds = datasets.get_dataset({"name": "demo_coarse"})
  from input_pipeline import subset
  x, y = _features(tiny_checkpoint, config.data, subset.RangeSource(ds.source("train"), 0, 400))
  xt, yt = _features(tiny_checkpoint, config.data,  # The eval split, validation[:256].
                     subset.RangeSource(ds.source("validation"), 0, 256))
  w, mean, std = _lstsq_ridge(x, y, 16, 2.0 ** 10)
  xb = np.pad((xt - mean) / std, ((0, 0), (0, 1)), constant_values=100.0)
  assert results["linear/top1"] == pytest.approx(np.mean(np.argmax(xb @ w, 1) == yt), abs=2e-3)
  config, results, rows = _transfer(f"mode=finetune,init={tiny_checkpoint},steps=2",
                                    tmp_path / "ft", **{"evals.fewshot.datasets": {}})
  assert config.model_init_skip == "^params/head/" and config.ema.momentum == 0.995
  assert "eval/top1" in results and rows[-1]["step"] == 2
  _, results, _ = _transfer(f"mode=finetune,init={tiny_checkpoint},steps=2,multi_label",
                            tmp_path / "ml", **{"evals.fewshot.datasets": {}})
  assert 0.0 <= results["eval/mAP"] <= 1.0


@pytest.mark.parametrize("arg,match", [
    ("mode=zeroshot,init=X", "mode='zeroshot' must be one of"),
    ("mode=finetune,init=X,recipe=bit", "recipe='bit' must be one of"),
    ("mode=fewshot", "needs init=CHECKPOINT"),
])
def test_bad_transfer_args(arg, match):
  with pytest.raises(ValueError, match=match):
    transfer.get_config(arg)


def test_recipes_and_fewshot_probe_in_every_config(tiny_checkpoint):
  import importlib, pathlib
  for path in sorted(pathlib.Path(helpers.ROOT, "configs").glob("*.py")):
    module = importlib.import_module(f"configs.{path.stem}")
    if not hasattr(module, "get_config") or path.stem == "transfer":
      continue
    config = module.get_config()
    stages = [config[s] for s in ("teacher", "student", "finetune") if s in config]
    for c in stages or [config]:
      assert c.evals.fewshot.type == "fewshot", path.stem
  swag = transfer.get_config(f"mode=finetune,init={tiny_checkpoint},recipe=swag")
  assert swag.optim.name == "sgd" and swag.optim.weight_decay == 0.0
  cosub = transfer.get_config(f"mode=finetune,init={tiny_checkpoint},recipe=cosub")
  assert cosub.optim.layer_decay > 0 and cosub.model.stochastic_depth == "esd"
  assert cosub.model.name == "vit_demo" and cosub.data.name == "demo_coarse"


def test_fewshot_eval_k_larger_than_pool_errors(tiny_checkpoint, tmp_path):
  config = transfer.get_config(f"mode=fewshot,init={tiny_checkpoint}")
  config.evals.fewshot.train_records = 100
  with pytest.raises(ValueError, match=r"demo_coarse:train\): \d+-shot draw: class \d+ has only"):
    train.train_and_evaluate(config, str(tmp_path))



def test_swag_finetune_of_a_real_checkpoint_at_a_larger_resolution(tiny_checkpoint, tmp_path,
                                                                  capsys):
  """The 32 px demo ViT (a 4x4 grid and the class token's row) fine-tuned at 64 px, one step:
  the model is built at the run's resolution and its position embedding resized to the 8x8
  grid (the first step used to stop on the checkpoint's image size)."""
  import ml_collections
  from bigpretrain import checkpoint
  from configs import swag_finetune
  config = swag_finetune.get_config(f"init={tiny_checkpoint},res=64")
  assert checkpoint.read_meta(tiny_checkpoint)["model"]["image_size"] == 32
  assert "image_size" not in config.model and config.data.image_size == 64
  assert config.model_init_resize == "bicubic_align_corners"  # SWAG's trainer's.
  config.batch_size, config.total_steps = 16, 1
  config.evals = ml_collections.ConfigDict()
  config.compilation_cache_dir = helpers.JAX_CACHE
  trained = checkpoint.read_meta(tiny_checkpoint)["data"]["normalize"]
  assert config.data.normalize == trained  # The recipe takes the checkpoint's preset.
  config.data.normalize = "0_1" if trained != "0_1" else "minus1_1"  # A hand-set other one.
  capsys.readouterr()
  train.train_and_evaluate(config, str(tmp_path))
  out = capsys.readouterr().out
  assert "resized: ['params/pos_embed (1, 17, 128) -> (1, 65, 128)']" in out
  assert (f"WARNING: {tiny_checkpoint} was trained on inputs normalised as {trained!r}; this "
          f"run feeds it config.data.normalize={config.data.normalize!r}") in out
  assert checkpoint.read_meta(str(tmp_path))["model"]["image_size"] == 64


def _initialised_logits(config, num_classes):
  """What a run of `config` starts from, as its trainer builds it: the model at
  config.data.image_size, model_init's weights adapted by the model; its logits on zeros."""
  import jax
  import jax.numpy as jnp
  from bigpretrain import checkpoint
  from bigpretrain import models
  model_def = models.ModelDef.from_config(config.model, num_classes,
                                          image_size=config.data.image_size)
  params, extra = model_def.create(jax.random.key(0))
  loaded, _, resized, _ = checkpoint.init_from(
      config.model_init, {"params": params, "extra": extra}, skip=config.model_init_skip,
      adapt=model_def.param_adapter(config.model_init_resize))
  size = config.data.image_size
  logits = model_def.merge(loaded["params"], loaded["extra"])(jnp.zeros((1, size, size, 3)))
  return logits, resized


@pytest.mark.parametrize("recipe", ["in21k", "cosub"])
def test_transfer_of_a_real_checkpoint_at_a_larger_resolution(tiny_checkpoint, recipe):
  config = transfer.get_config(f"mode=finetune,init={tiny_checkpoint},recipe={recipe},res=64")
  assert "image_size" not in config.model and config.data.image_size == 64
  # timm's resize for the in21k recipe (a timm run), DeiT's for cosub.
  method = {"in21k": "bicubic_antialias", "cosub": "bicubic"}[recipe]
  assert config.model_init_resize == method
  logits, resized = _initialised_logits(config, 12)
  assert logits.shape == (1, 12) and resized == ["params/pos_embed (1, 17, 128) -> (1, 65, 128)"]


def test_cosub_finetune_from_a_checkpoint_at_a_larger_resolution(tmp_path):
  """cosub_finetune_in1k from a demo checkpoint of its own architecture (DeiT-III's ViT: no
  position-embedding row for the class token), at 64 px."""
  from configs import cosub_common
  from configs import cosub_finetune_in1k
  init = helpers.random_checkpoint(tmp_path, model=cosub_common.cosub_model("vit_demo", 0.1))
  config = cosub_finetune_in1k.get_config(f"init={init},res=64")
  assert config.data.image_size == 64 and config.model_init_resize == "auto"
  logits, resized = _initialised_logits(config, 100)
  assert logits.shape == (1, 100) and resized == ["params/pos_embed (1, 16, 128) -> (1, 64, 128)"]
