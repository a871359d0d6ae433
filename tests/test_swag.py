"""SWAG pretraining configs (swag_regnety.py, swag_vit.py), synchronised BatchNorm, the
zero-shot command and the per-host resampler."""
import json
import math
import subprocess
import sys

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bigpretrain import checkpoint
from bigpretrain.runtime import metric_writers
from bigpretrain import optim
from bigpretrain import sharding
from bigpretrain import train
from bigpretrain.swag import zero_shot
from bigpretrain.swag import resampling
from bigpretrain.models import regnet
from tests import helpers

pytestmark = pytest.mark.slow  # end-to-end recipe runs


def _config(recipe, arg=None):
  module = __import__(f"configs.{recipe}", fromlist=["get_config"])
  return module.get_config(arg)


# ---------------------------------------------------------------- configs


def test_paper_scale_configs_hold_the_papers_recipe():
  rg = _config("swag_regnety", "dataset=hashtags:ig")
  assert rg.model.name == "regnety_128gf" and rg.batch_size == 8192
  assert (rg.optim.name, rg.optim.momentum, rg.optim.nesterov) == ("sgd", 0.9, True)
  assert rg.optim.lr == pytest.approx(0.1 * 8192 / 256)
  assert rg.optim.weight_decay == 1e-5
  vit = _config("swag_vit", "dataset=hashtags:ig,model=vit_b16")
  assert vit.model.name == "vit_b16" and vit.model.pre_logits
  assert (vit.optim.name, vit.optim.b1, vit.optim.b2) == ("adamw", 0.9, 0.95)
  assert vit.optim.lr == pytest.approx(4e-4) and vit.optim.weight_decay == 0.1
  vit.batch_size = 4096  # The lr follows the batch linearly.
  assert vit.optim.lr == pytest.approx(2e-4)
  for c in (rg, vit):
    s = c.optim.schedule
    assert (s.name, s.end_factor, s.warmup_frac, s.warmup_init_factor) == (
        "cosine", 0.0, 0.05, 0.1)
    assert c.compute_dtype == "bfloat16" and c.data.image_size == 224
    assert c.data.train_augment == "inception_crop|flip"
    assert c.objective.name == "soft_target" and c.data.name == "hashtags:ig"
    assert c.num_examples == 10_000_000_000
    assert c.mixup.mixup_alpha == 0 and c.mixup.cutmix_alpha == 0
    assert c.model.get("drop_path_rate", 0.0) == 0.0
  assert _config("swag_vit", "samples=5000").num_examples == 5000
  with pytest.raises(ValueError, match="unknown"):
    _config("swag_vit", "epochs=3")


def _regnet_tiny(num_classes=5, seed=0):
  """A two-stage RegNetY small enough to compile in seconds."""
  return regnet.RegNet(num_classes=num_classes, rngs=nnx.Rngs(seed), depth=3, w_0=16,
                       w_a=8.0, w_m=2.0, group_width=8, stem_width=8,
                       zero_init_residual=False)


def _batchnorm_param_paths(model) -> set[str]:
  """'a/b/scale' paths of every nnx.BatchNorm's params, found from the module graph."""
  out = set()
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.BatchNorm):
      prefix = "/".join(str(p) for p in path)
      out |= {f"{prefix}/scale", f"{prefix}/bias"}
  return out


def test_regnety_weight_decay_skips_exactly_the_batchnorm_params():
  config = _config("swag_regnety")
  model = _regnet_tiny()
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  mask = optim.weight_decay_mask(params, config.optim.wd_exclude,
                                 decay_1d=config.optim.wd_1d)
  flat = {jax.tree_util.keystr(p, simple=True, separator="/"): m
          for p, m in jax.tree_util.tree_leaves_with_path(mask)}
  bn = _batchnorm_param_paths(model)
  assert bn and bn <= set(flat)
  assert not any(flat[p] for p in bn)
  others = set(flat) - bn
  assert all(flat[p] for p in others)  # Conv/linear kernels and biases (SE, head) decay.
  assert {"head/bias", "blocks/0/se/fc1/bias"} <= others
  # The update itself: SGD with wd 1e-5 moves a BN scale only by its gradient.
  tx, _ = optim.make_optimizer(config.optim, total_steps=100)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  assert float(jnp.abs(updates["stem_bn"]["scale"]).max()) == 0.0
  assert float(jnp.abs(updates["head"]["bias"]).max()) == 0.0  # Zero-initialised.
  kernel = params["stem_conv"]["kernel"]
  # First step: lr = lr0 / 10 (warm-up start); Nesterov's first update is (1 + 0.9) g.
  lr0 = 0.1 * config.batch_size / 256
  np.testing.assert_allclose(updates["stem_conv"]["kernel"],
                             -lr0 / 10 * 1.9 * 1e-5 * kernel, rtol=1e-5)


@pytest.mark.parametrize("recipe", ["swag_regnety", "swag_vit"])
def test_warmup_starts_at_a_tenth_and_cosine_ends_at_zero(recipe):
  config = _config(recipe)
  _, schedule = optim.make_optimizer(config.optim, total_steps=1000)
  lr = config.optim.lr
  assert float(schedule(0)) == pytest.approx(lr / 10)
  assert float(schedule(25)) == pytest.approx(lr / 10 + (lr - lr / 10) * 25 / 50)
  assert float(schedule(50)) == pytest.approx(lr)  # 5% of 1000 updates.
  assert float(schedule(50 + 475)) == pytest.approx(lr / 2, rel=1e-3)  # Half-cosine middle.
  assert float(schedule(1000)) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("recipe", ["swag_regnety", "swag_vit"])
def test_demo_config_trains_a_step_on_hashtags_demo(recipe, tmp_path):
  config = helpers.tiny_config(recipe, total_steps=40, batch_size=8)  # Warm-up: 2 steps.
  exp = train.build(config)
  assert exp.dataset.info.name == "hashtags:demo"
  assert exp.model_def.name == ("regnety_demo" if recipe == "swag_regnety" else "vit_demo")
  state = exp.init_state()
  batch = next(train.make_train_iterator(exp))
  assert batch["image"].shape == (8, 32, 32, 3) and batch["hashtag_ids"].shape[0] == 8
  batch.pop("_skipped")
  with jax.set_mesh(exp.mesh):
    state, m = exp.train_step()(state, sharding.global_batch(batch, exp.mesh), exp.frozen)
  m = jax.device_get(m)
  # The head starts at zero: every hashtag equally likely, the loss is log C.
  assert m["train/loss"] == pytest.approx(math.log(exp.dataset.info.num_classes), rel=1e-3)
  assert m["train/lr"] == pytest.approx(config.optim.lr / 10)
  assert int(state["step"]) == 1


# ---------------------------------------------------------------- synchronised BatchNorm


def test_batchnorm_statistics_are_those_of_the_global_batch_under_the_sharded_step():
  """Under the trainer's jit with the batch split over 8 devices, BatchNorm normalises with
  the statistics of the whole (global) batch: sync BN, as SWAG trains RegNetY."""
  model = _regnet_tiny()
  graphdef, params, extra = nnx.split(model, nnx.Param, ...)
  params, extra = nnx.to_pure_dict(params), nnx.to_pure_dict(extra)

  def step(params, extra, x):
    m = nnx.merge(graphdef, params, extra)
    feats = m.features(x, train=True)  # The head is zero-initialised: compare its input.
    return feats, nnx.to_pure_dict(nnx.state(m, nnx.Not(nnx.Param)))

  x = jax.random.normal(jax.random.key(1), (16, 16, 16, 3)) * 2 + 0.5
  mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
  assert mesh.devices.size == 8
  repl, split = sharding.replicated(mesh), sharding.batch_sharding(mesh)
  sharded = jax.jit(step, in_shardings=(repl, repl, split), out_shardings=(split, repl))
  logits, stats = sharded(params, extra, jax.device_put(x, split))
  whole_logits, whole_stats = jax.jit(step)(params, extra, x)  # One device, whole batch.
  np.testing.assert_allclose(logits, whole_logits, rtol=1e-4, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               stats, whole_stats)
  # Independently: the stem BN's running mean/var after one step from (0, 1) with
  # momentum 0.9 are 0.1 x the stem conv output's batch mean and biased variance (+ 0.9).
  conv = np.asarray(model.stem_conv(x), np.float64)
  np.testing.assert_allclose(stats["stem_bn"]["mean"], 0.1 * conv.mean(axis=(0, 1, 2)),
                             rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(stats["stem_bn"]["var"], 0.9 + 0.1 * conv.var(axis=(0, 1, 2)),
                             rtol=1e-4)
  # Per-device statistics (what unsynchronised BN would use) give other outputs.
  shards = [jax.jit(step)(params, extra, x[2 * i:2 * i + 2]) for i in range(8)]
  local_logits = np.concatenate([s[0] for s in shards])
  assert np.abs(local_logits - np.asarray(whole_logits)).max() > 1e-3
  local_var = np.mean([s[1]["stem_bn"]["var"] for s in shards], axis=0)
  assert np.abs(local_var - np.asarray(whole_stats["stem_bn"]["var"])).max() > 1e-3


# ---------------------------------------------------------------- zero-shot command


@pytest.fixture(scope="module")
def hashtag_run(tmp_path_factory):
  """A SWAG ViT demo run of a few steps on hashtags:demo (a real hashtag checkpoint)."""
  workdir = tmp_path_factory.mktemp("swag_vit")
  config = helpers.tiny_config("swag_vit", total_steps=4, batch_size=32, eval_every_steps=0,
                               ckpt_every_steps=0)
  config.optim.lr = 1e-2
  # Zero-shot scheduled as an evaluator of the run itself, at its end, on the split the
  # command reads.
  config.evals.zs = dict(type="zero_shot", dataset="demo", split="validation", every_steps=0)
  train.train_and_evaluate(config, str(workdir))
  return str(workdir)


def _zero_shot_cli(*args, num_devices=2):
  return subprocess.run([sys.executable, "-m", "bigpretrain.tools.zero_shot", *args],
                        env=helpers.env(num_devices), cwd=helpers.ROOT, capture_output=True,
                        text=True, timeout=600)


def test_zero_shot_command_end_to_end_json(hashtag_run):
  # The run's mesh (8 devices) and batch (32): the same scores as its evaluator, bit for bit.
  proc = _zero_shot_cli(f"--workdir={hashtag_run}", "--dataset=demo", "--json",
                        "--batch_size=32", num_devices=8)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result["num_examples"] == 2500 and result["num_classes"] == 100
  assert result["aggregation_platt"] == result["aggregation_no_platt"] == "max_split"  # ViT.
  # The run's own zero-shot evaluator, at its end on the same weights, gave the same figures.
  last = [r for r in metric_writers.read_metrics(hashtag_run) if "zs/top1_platt" in r][-1]
  assert last["zs/top1_platt"] == result["top1_platt"]
  assert last["zs/top1_no_platt"] == result["top1_no_platt"]
  # The same numbers computed here from the model's own outputs.
  meta = checkpoint.read_meta(hashtag_run)
  from input_pipeline import augment_spec, datasets, decoding  # pylint: disable=g-import-not-at-top
  from bigpretrain import models, preprocess  # pylint: disable=g-import-not-at-top
  data = datasets.get_dataset({"name": "demo"})
  source = data.source("validation")
  images = np.stack([np.asarray(augment_spec.EVAL_RESIZES[meta["data"]["eval_resize"]](
      decoding.open_image(source[i]["image"]), 32)) for i in range(len(source))])
  labels = np.array([source[i]["label"] for i in range(len(source))])
  model = models.load_pretrained(hashtag_run)
  probs = np.concatenate([np.asarray(jax.nn.softmax(model(preprocess.normalize(
      images[i:i + 500], meta["data"]["normalize"])))) for i in range(0, len(images), 500)])
  saved = json.load(open(result["class_map"]))
  assert sorted(saved) == sorted(data.info.class_names)
  index = {h: i for i, h in enumerate(meta["class_names"])}
  mapping = [[index[h] for h in saved[w]] for w in data.info.class_names]
  scores = np.asarray(zero_shot.aggregate(probs, mapping, "max_split"))
  assert result["top1_no_platt"] == pytest.approx(zero_shot.top1(scores, labels), abs=2e-3)
  w, b = zero_shot.platt_fit(scores)
  platt = zero_shot.top1(zero_shot.platt_apply(scores, w, b), labels)
  # This one-device pass rounds differently from the sharded batches (scores differ by ~1e-7
  # relative); the fit is its minimum, so at most an image or two on a near-tie may flip.
  assert result["top1_platt"] == pytest.approx(platt, abs=2e-3)


def test_zero_shot_text_output_and_paper_aggregation(hashtag_run):
  proc = _zero_shot_cli(f"--workdir={hashtag_run}", "--dataset=demo", "--platt=off",
                        "--aggregation=mean", "--batch_size=250", "--split=validation[:500]")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Zero-shot on demo:validation[:500] (500 images, 100 classes" in proc.stdout
  assert "without Platt scaling" in proc.stdout and "with Platt scaling:" not in proc.stdout
  assert "(mean aggregation)" in proc.stdout
  assert zero_shot.paper_aggregation("regnety_16gf", True) == "sum"
  assert zero_shot.paper_aggregation("regnety_16gf", False) == "mean"
  assert zero_shot.paper_aggregation("vit_b16", False) == "max_split"


def test_zero_shot_refuses_a_non_hashtag_model_and_non_wordnet_classes(hashtag_run, tmp_path):
  with pytest.raises(ValueError, match="not a hashtag model.*softmax"):
    zero_shot.check_hashtag_model({"objective": {"name": "softmax"}, "dataset": "demo",
                                   "class_names": ["n00007846"]}, "RUN")
  with pytest.raises(ValueError, match="class 'n00007846' is not a canonical hashtag"):
    zero_shot.check_hashtag_model({"objective": {"name": "soft_target"},
                                   "class_names": ["n00007846"]}, "RUN")
  with pytest.raises(ValueError, match="'cat' is not WordNet synsets|not WordNet synsets"):
    zero_shot.check_wordnet_classes(["n02084071", "cat"], "folder:pets")
  with pytest.raises(ValueError, match="n99999999"):
    zero_shot.check_wordnet_classes(["n99999999"], "x")
  # The command: the hashtag dataset's own classes are hashtags, not wnids.
  proc = _zero_shot_cli(f"--workdir={hashtag_run}", "--dataset=hashtags:demo")
  assert proc.returncode == 1
  assert "not WordNet synsets" in proc.stderr and "hashtags:demo" in proc.stderr


# ---------------------------------------------------------------- per-host resampling


def _labels(n=3000, num_labels=60, seed=0):
  rng = np.random.default_rng(seed)
  p = 1.0 / np.arange(1, num_labels + 1)
  first = rng.choice(num_labels, n, p=p / p.sum())
  return [sorted({int(a), int(b)}) for a, b in zip(first, rng.integers(0, num_labels, n))]


def test_host_samplers_draw_from_their_slice_with_global_importance():
  lists = _labels()
  counts = np.bincount(np.concatenate([np.asarray(l) for l in lists]))
  whole_imp, whole_tail = resampling.importance(lists, 100)
  hosts = []
  for p in range(3):
    start, stop = resampling.host_slice(len(lists), p, 3)
    imp, tail = resampling.importance(lists[start:stop], 100, label_counts=counts)
    np.testing.assert_array_equal(imp, whole_imp[start:stop])  # Global f(h), local images.
    np.testing.assert_array_equal(tail, whole_tail[start:stop])
    host = resampling.host_sampler(lists[start:stop], num_images=len(lists),
                                   label_counts=counts, tail_threshold=100, alpha=0.7,
                                   num_samples=3001, seed=4, process_index=p, process_count=3)
    drawn = host[np.arange(len(host))]
    assert start <= drawn.min() and drawn.max() < stop
    assert (~whole_tail[drawn]).sum() == round(0.7 * len(host))  # Its own head share.
    assert [host[j] for j in range(5)] == drawn[:5].tolist()  # Scalar = vectorised.
    hosts.append(host)
  assert [len(h) for h in hosts] == [1001, 1000, 1000]
  with pytest.raises(ValueError, match="owns images \\[1000, 2000\\)"):
    resampling.host_sampler(lists, num_images=len(lists), label_counts=counts,
                            tail_threshold=100, alpha=0.7, num_samples=10, seed=0,
                            process_index=1, process_count=3)
  with pytest.raises(ValueError, match="must count the whole dataset"):
    resampling.importance(lists, 100, label_counts=np.ones_like(counts))


def test_epoch_stats_count_samples_unique_images_and_head_share(caplog):
  lists = _labels(n=500)
  imp, tail = resampling.importance(lists, 30)
  sampler = resampling.ResampledIndices(imp, tail, alpha=0.7, num_samples=800, seed=1,
                                        log_epochs=True)
  for epoch in (0, 2):
    drawn = sampler[np.arange(epoch * 800, (epoch + 1) * 800)]
    want = {"epoch": epoch, "samples": 800, "unique_images": len(np.unique(drawn)),
            "head_share": float((~tail[drawn]).mean())}
    assert sampler.epoch_stats(epoch, chunk=128) == want
  caplog.set_level("INFO")
  sampler[799]  # pylint: disable=pointless-statement
  assert "epoch 0: 800 samples" in caplog.text and "head share 0.7000" in caplog.text
