"""Transfer the SWAG way: EMA of the weights, shorter-side eval crop, few-shot draws, the
zero-shot-initialised head and configs/swag_finetune.py."""
import shutil

from flax import nnx
import jax
import numpy as np
import pytest

from bigpretrain import checkpoint
from bigpretrain import config_lib
from bigpretrain.swag import head_init
from bigpretrain import models
from bigpretrain import sharding
from bigpretrain import train
from bigpretrain.swag import zero_shot
from bigpretrain.swag import vocabulary
from configs import swag_finetune
from input_pipeline import augment_spec
from input_pipeline import pipeline
from input_pipeline import subset
from tests import helpers

pytestmark = pytest.mark.slow  # end-to-end recipe runs


def _host(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(tree))


def _run_steps(config, steps):
  """The experiment and its states after 0..steps train steps (host copies)."""
  exp = train.build(config)
  state = exp.init_state()
  step_fn = exp.train_step()
  it = pipeline.train_iterator(exp.dataset.source("train"), config.data,
                               global_batch_size=config.batch_size, seed=config.seed,
                               process_index=0, process_count=1)
  states = [_host(state)]
  for _ in range(steps):
    batch = next(it)
    batch.pop("_skipped")
    state, _ = step_fn(state, sharding.global_batch(batch, exp.mesh), exp.frozen)
    states.append(_host(state))
  return exp, state, states


def test_ema_equals_numpy_average_and_survives_a_checkpoint(tmp_path):
  m = 0.6
  config = helpers.tiny_config("single_label", **{"ema.momentum": m})
  exp, state, states = _run_steps(config, 3)
  ema = {"params": states[0]["params"], "extra": states[0]["extra"]}
  for s in states[1:]:  # ema_k = m ema_{k-1} + (1 - m) w_k, from ema_0 = w_0.
    ema = jax.tree.map(lambda e, w: m * e + (1 - m) * w, ema,
                       {"params": s["params"], "extra": s["extra"]})
  got = _host(state["ema"])
  jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6), got, ema)
  last = states[-1]["params"]["head"]["kernel"]
  assert np.abs(got["params"]["head"]["kernel"] - last).max() > 1e-4  # Not the raw weights.
  # Evaluators see the EMA weights.
  np.testing.assert_array_equal(np.asarray(train.eval_weights(state)["params"]["head"]["bias"]),
                                np.asarray(state["ema"]["params"]["head"]["bias"]))

  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  ckpt.save(3, state)
  ckpt.wait()
  fresh = exp.init_state()
  restored, step = ckpt.restore(fresh)
  assert step == 3
  jax.tree.map(np.testing.assert_array_equal, _host(restored["ema"]), got)
  jax.tree.map(np.testing.assert_array_equal, _host(restored["params"]), states[-1]["params"])
  # Consumers of the weights (model_init, load_pretrained) read the EMA ones.
  abstract = {"params": exp.model_def.abstract_pure_params(),
              "extra": exp.model_def.abstract_pure_extra()}
  loaded = checkpoint.load_params(str(tmp_path / "ckpt"), abstract)
  jax.tree.map(np.testing.assert_array_equal, _host(loaded), got)


def test_resume_keeps_the_ema(tmp_path, capsys):
  """A 4-step run, then its step-4 checkpoint removed and the run resumed from step 2: the
  final EMA is the same."""
  config = helpers.tiny_config("single_label", total_steps=4, ckpt_every_steps=2,
                               **{"ema.momentum": 0.5})
  ckpts = tmp_path / "checkpoints"

  def final_ema():
    train.train_and_evaluate(config.copy_and_resolve_references(), str(tmp_path))
    exp = train.build(config.copy_and_resolve_references())
    restored, step = checkpoint.Checkpointer(str(ckpts), async_save=False).restore(
        exp.init_state())
    assert step == 4
    return _host(restored["ema"])

  straight = final_ema()
  assert (ckpts / "2" / "ema").is_dir()
  shutil.rmtree(ckpts / "4")
  capsys.readouterr()
  resumed = final_ema()
  assert "Resuming from step 2" in capsys.readouterr().out
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               resumed, straight)


def test_ema_config_is_checked():
  config = helpers.tiny_config("single_label", **{"ema.momentum": 1.0})
  with pytest.raises(ValueError, match="ema.momentum"):
    config_lib.validate(config)
  config = helpers.tiny_config("single_label", model_init_head="zero_shot")
  with pytest.raises(ValueError, match="needs config.model_init"):
    config_lib.validate(config)


def test_shorter_center_crop_resizes_the_shorter_side_to_the_image_size():
  image = np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8)
  out = np.asarray(augment_spec.EVAL_RESIZES["shorter_center_crop"](image, 32))
  np.testing.assert_array_equal(out, image[:, 8:40])  # Shorter side already 32: a crop.
  standard = np.asarray(augment_spec.EVAL_RESIZES["center_crop"](image, 32))
  assert standard.shape == (32, 32, 3) and not np.array_equal(standard, out)  # 87.5% crop.
  tall = np.repeat(np.arange(64, dtype=np.uint8)[:, None, None], 16, axis=1).repeat(3, 2)
  out = np.asarray(augment_spec.EVAL_RESIZES["shorter_center_crop"](tall, 8))  # 64x16 -> 32x8.
  assert out.shape == (8, 8, 3)
  assert 12 * 2 <= out[0, 0, 0] <= 13 * 2 + 1 and 19 * 2 <= out[-1, 0, 0] <= 20 * 2 + 1


def test_per_class_draw_counts_determinism_and_nesting():
  sizes = [1300, 732, 50, 7, 1]
  labels = np.random.default_rng(0).permutation(np.repeat(np.arange(5), sizes))
  one = subset.per_class_draw(labels, 0.01, seed=3)
  # k_c = max(1, round_half_up(0.01 n_c)): 13, 7, 1 (0.5 rounds up), 1, 1.
  np.testing.assert_array_equal(np.bincount(labels[one], minlength=5), [13, 7, 1, 1, 1])
  ten = subset.per_class_draw(labels, 0.1, seed=3)
  np.testing.assert_array_equal(np.bincount(labels[ten], minlength=5), [130, 73, 5, 1, 1])
  assert set(one) <= set(ten)  # 1% inside 10% for one seed.
  np.testing.assert_array_equal(one, subset.per_class_draw(labels, 0.01, seed=3))
  assert not np.array_equal(one, subset.per_class_draw(labels, 0.01, seed=4))
  assert np.all(np.diff(one) > 0)
  np.testing.assert_array_equal(subset.per_class_draw(labels, 1.0, seed=3),
                                np.arange(len(labels)))
  with pytest.raises(ValueError, match="subset_frac"):
    subset.per_class_draw(labels, 0.0, seed=0)


def test_subset_source_through_the_data_config():
  records = [{"image": b"", "label": int(c)} for c in np.repeat(np.arange(3), [40, 20, 10])]
  cfg = {"name": "toy", "subset_frac": 0.1, "subset_seed": 1}
  src = subset.apply(records, cfg, "toy")
  assert len(src) == 4 + 2 + 1
  got = sorted(src[i]["label"] for i in range(len(src)))
  assert got == [0, 0, 0, 0, 1, 1, 2]
  assert subset.apply(records, {"subset_frac": 1.0}, "toy") is records
  with pytest.raises(ValueError, match="int 'label'"):
    subset.apply([{"label": [1, 2]}], {"subset_frac": 0.5}, "multi")


HASHTAG_WORDS = ["crane", "heron", "dog", "puppy", "cat", "eggplant", "tractor", "porcupine",
                 "hedgehog"]
# Crane (bird), crane (machine), dog, domestic cat, porcupine (#porcupine and #hedgehog tie).
CLASS_WNIDS = ["n02012849", "n03126707", "n02084071", "n02121808", "n02346627"]


def test_zero_shot_head_math():
  kernel = np.arange(12, dtype=np.float32).reshape(3, 4)
  bias = np.array([1, 2, 3, 4], np.float32)
  k, b = head_init.zero_shot_head(kernel, bias, [(0, 2), (3,)])
  np.testing.assert_array_equal(k, [[1, 3], [5, 7], [9, 11]])
  np.testing.assert_array_equal(b, [2, 4])
  with pytest.raises(ValueError, match="non-empty"):
    head_init.zero_shot_head(kernel, bias, [()])


def test_zero_shot_initialised_logits_equal_the_mean_aggregation(tmp_path):
  hashtags = sorted({vocabulary.canonical_hashtag(w) for w in HASHTAG_WORDS} - {None})
  mapping = zero_shot.class_map(CLASS_WNIDS, hashtags)
  crane = [i for i, h in enumerate(hashtags) if "crane" in h]
  assert mapping[0] == mapping[1] == tuple(crane)  # Both crane classes take #crane.
  assert len(mapping[4]) == 2  # Porcupine averages two hashtags.
  kw = dict(image_size=16, head_zeroinit=False, pre_logits=True)  # As SWAG's ViTs.
  source = models.get_model("vit_demo", num_classes=len(hashtags), rngs=nnx.Rngs(0), **kw)
  _, params, extra = nnx.split(source, nnx.Param, ...)
  state = {"params": nnx.to_pure_dict(params), "extra": nnx.to_pure_dict(extra)}
  meta = {"version": checkpoint.META_VERSION, "model": {"name": "vit_demo", **kw},
          "compute_dtype": "float32", "num_classes": len(hashtags), "class_names": hashtags,
          "dataset": "hashtags:toy", "data": {}, "objective": {}}
  ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False, meta=meta)
  ckpt.save(1, {**state, "step": 0, "opt_state": {}, "skipped_records": 0})
  ckpt.wait()

  target = models.get_model("vit_demo", num_classes=len(CLASS_WNIDS), rngs=nnx.Rngs(1), **kw)
  graphdef, tparams, textra = nnx.split(target, nnx.Param, ...)
  fresh = {"params": nnx.to_pure_dict(tparams), "extra": nnx.to_pure_dict(textra)}
  loaded, kept_fresh, _, dropped = checkpoint.init_from(str(tmp_path), fresh)
  assert kept_fresh == ["params/head/bias", "params/head/kernel"] and dropped == []
  new_params = head_init.zero_shot_init(str(tmp_path), loaded["params"], CLASS_WNIDS)

  images = np.random.default_rng(0).normal(size=(5, 16, 16, 3)).astype(np.float32)
  hashtag_logits = np.asarray(source(images))
  got = np.asarray(nnx.merge(graphdef, new_params, loaded["extra"])(images))
  want = np.asarray(zero_shot.aggregate(hashtag_logits, mapping, "mean"))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="not canonical hashtags"):
    meta_bad = {**meta, "class_names": ["dog", "cat"] + hashtags[2:]}
    bad = checkpoint.Checkpointer(str(tmp_path / "bad"), async_save=False, meta=meta_bad)
    bad.save(1, {**state, "step": 0, "opt_state": {}, "skipped_records": 0})
    bad.wait()
    head_init.zero_shot_init(str(tmp_path / "bad"), loaded["params"], CLASS_WNIDS)


def test_swag_finetune_config():
  config = config_lib.validate(swag_finetune.get_config())
  assert config.optim.name == "sgd" and config.optim.weight_decay == 0.0
  assert config.optim.schedule.name == "cosine" and config.optim.schedule.end_factor == 0.0
  assert config.optim.schedule.warmup_steps == -1 and config.optim.schedule.warmup_frac == 0
  assert config.mixup.mixup_alpha == 0.1 and config.mixup.cutmix_alpha == 0.0
  assert config.data.eval_resize == "shorter_center_crop"
  assert config.ema.momentum == pytest.approx(1 - 2 / config.total_steps)
  assert config.model_init == "" and config.model.name == "regnety_demo"
  assert not config.model.zero_init_residual  # As the hashtag model it is compared with.
  few = swag_finetune.get_config("fewshot=0.01,fewshot_seed=2")
  assert few.data.subset_frac == 0.01 and few.data.subset_seed == 2
  assert [swag_finetune.size_of(n) for n in (20_000, 20_001, 500_000, 500_001)] == [
      "small", "medium", "medium", "large"]
  assert swag_finetune.size_of(round(1_281_167 * 0.01)) == "small"  # 1% of ImageNet-1k.
  paper = swag_finetune.get_config("dataset=tfds:x,size=large,task=other")
  assert paper.total_steps == 20_000 and paper.ema.momentum == 0.0  # EMA: ImageNet-1k's.
  assert swag_finetune.get_config("dataset=tfds:x,size=large,task=in1k").ema.momentum == 0.9999
  assert paper.batch_size == 512 and paper.optim.lr == pytest.approx(6e-3)
  with pytest.raises(ValueError, match="size="):
    swag_finetune.get_config("size=huge")
