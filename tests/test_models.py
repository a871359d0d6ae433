"""Tests for the model registry and the models (parameter counts, shapes, stochastic depth)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bigpretrain import models
from bigpretrain.models import layers
from bigpretrain.models import vit


def _abstract(name, **kw):
  return nnx.eval_shape(lambda: models.get_model(name, rngs=nnx.Rngs(0), **kw))


def _num_params(module) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def _images(batch, size, seed=0):
  return jax.random.normal(jax.random.key(seed), (batch, size, size, 3), jnp.float32)


def _layer_norm(x, eps=1e-6):
  x = np.asarray(x, np.float64)
  mu = x.mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)


# --- registry -------------------------------------------------------------------------------


def test_registry_lists_vit_family():
  names = models.list_models()
  assert names == sorted(names)
  for size in ("ti", "s", "b", "l", "h"):
    for patch in (14, 16, 32):
      assert f"vit_{size}{patch}" in names
  assert "vit_demo" in names


def test_unknown_model_name_lists_registered():
  with pytest.raises(ValueError, match=r"vit_nope.*vit_b16"):
    models.get_model("vit_nope", num_classes=10, rngs=nnx.Rngs(0))


def test_unknown_and_fixed_kwargs_are_named():
  with pytest.raises(TypeError, match=r"unknown option\(s\) \['colour'\]; accepted: .*'drop_path_rate'"):
    _abstract("vit_ti16", num_classes=10, colour="red")  # A class's options, from __init__.
  assert not models.accepts("vit_b16", "bn_group_size") and models.accepts("resnet50",
                                                                          "bn_group_size")
  with pytest.raises(TypeError, match="width"):
    _abstract("vit_ti16", num_classes=10, width=64)
  with pytest.raises(TypeError, match="colour"):
    _abstract("vit_demo", num_classes=10, colour="red")


def test_register_decorator_and_duplicate():
  @models.register("_test_linear")
  def _linear(*, num_classes, rngs, width=4):
    return nnx.Linear(width, num_classes, rngs=rngs)

  try:
    assert "_test_linear" in models.list_models()
    model = models.get_model("_test_linear", num_classes=3, rngs=nnx.Rngs(0), width=5)
    assert model.kernel.shape == (5, 3)
    with pytest.raises(TypeError, match="depth"):
      models.get_model("_test_linear", num_classes=3, rngs=nnx.Rngs(0), depth=2)
    models.register("_test_linear", _linear)  # The same factory again: a no-op.
    with pytest.raises(ValueError, match="already registered"):
      models.register("_test_linear", lambda **kw: None)
  finally:
    models.base.MODELS._items.pop("_test_linear")  # pylint: disable=protected-access


# --- ViT parameter counts and structure -----------------------------------------------------


@pytest.mark.parametrize("name,expected", [
    ("vit_b16", 86_567_656),  # the published 86.6M
    ("vit_ti16", 5_717_416),
    ("vit_s16", 22_050_664),
])
def test_vit_param_counts(name, expected):
  assert _num_params(_abstract(name, num_classes=1000)) == expected


def test_vit_gap_and_pos_embed_variants_param_counts():
  # 'gap' has no class token and no position embedding row for it: 2 * width fewer.
  assert _num_params(_abstract("vit_b16", num_classes=1000, head="gap")) == 86_567_656 - 2 * 768
  # DeiT-III style: the position embedding covers only the 196 patches.
  model = _abstract("vit_b16", num_classes=1000, pos_embed_cls=False)
  assert model.pos_embed.shape == (1, 196, 768)
  assert _num_params(model) == 86_567_656 - 768
  # LayerScale adds two width-sized vectors per block.
  model = _abstract("vit_s16", num_classes=1000, layerscale_init=1e-4)
  assert _num_params(model) == 22_050_664 + 12 * 2 * 384
  # DeiT-III's ViT-M (width 512, depth 12, 8 heads) as it builds it: 38.8M (38,849,512).
  model = _abstract("vit_m16", num_classes=1000, layerscale_init=1e-4, pos_embed_cls=False)
  assert model.blocks[0].attn.num_heads == 8
  assert _num_params(model) == 38_849_512
  # Larger models, by formula: 12*D^2 + 13*D per block, plus embeddings and head.
  d, depth, p = 1024, 24, 14
  tokens = (224 // p) ** 2 + 1
  want = (p * p * 3 * d + d) + d + tokens * d + depth * (12 * d * d + 13 * d) + 2 * d
  want += d * 1000 + 1000
  assert _num_params(_abstract("vit_l14", num_classes=1000)) == want


def test_vit_param_paths_and_logical_axes():
  model = _abstract("vit_b16", num_classes=1000)
  _, params, _ = nnx.split(model, nnx.Param, ...)
  flat = {jax.tree_util.keystr(path, simple=True, separator="/"): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(
              params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]}
  names = {k: v.get_metadata().get("out_sharding") for k, v in flat.items()}
  assert names["patch_embed/kernel"] == (None, None, None, "embed")
  assert names["cls_token"] == (None, None, "embed")
  assert names["pos_embed"] == (None, None, "embed")
  assert names["blocks/3/attn/qkv/kernel"] == ("embed", "heads")
  assert names["blocks/3/attn/proj/kernel"] == ("heads", "embed")
  assert names["blocks/11/mlp/fc1/kernel"] == ("embed", "mlp")
  assert names["blocks/11/mlp/fc2/kernel"] == ("mlp", "embed")
  assert names["head/kernel"] == ("embed", "classes")
  assert {"norm/scale", "norm/bias", "head/bias", "blocks/0/norm1/scale"} <= set(names)
  assert model.depth == model.num_blocks == 12
  pure = nnx.to_pure_dict(params)
  assert pure["blocks"][3]["mlp"]["fc1"]["kernel"].shape == (768, 3072)


# --- ViT forward ----------------------------------------------------------------------------


def test_vit_demo_forward_shape_dtype_and_features():
  model = models.get_model("vit_demo", num_classes=10, rngs=nnx.Rngs(0), head_zeroinit=False)
  x = _images(2, 32)
  logits = model(x)
  assert logits.shape == (2, 10) and logits.dtype == jnp.float32
  feats = model.features(x)
  assert feats.shape == (2, 128) and feats.dtype == jnp.float32
  want = feats @ model.head.kernel[...] + model.head.bias[...]
  np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
  # Zero-initialised head by default: every logit starts at 0.
  zero_head = models.get_model("vit_demo", num_classes=10, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(zero_head(x), np.zeros((2, 10), np.float32))
  with pytest.raises(ValueError, match="expected images"):
    model(_images(2, 48))


def test_vit_size_not_a_multiple_of_the_patch_leaves_the_last_pixels_out():
  """timm's PatchEmbed: 20 px at patch 8 is a 2 x 2 grid of the top-left 16 x 16 pixels."""
  big = models.get_model("vit_demo", num_classes=10, rngs=nnx.Rngs(0), image_size=20,
                         head_zeroinit=False)
  small = models.get_model("vit_demo", num_classes=10, rngs=nnx.Rngs(0), image_size=16,
                           head_zeroinit=False)
  assert big.grid == (2, 2) and big.pos_embed.shape == small.pos_embed.shape
  x = _images(2, 20)
  np.testing.assert_allclose(big(x), small(x[:, :16, :16]), rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="smaller than patch_size"):
    _abstract("vit_b16", num_classes=10, image_size=8)


def test_attention_matches_numpy_reference():
  dim, heads, n = 8, 2, 5
  attn = vit.Attention(dim, heads, qkv_bias=True, dtype=jnp.float32,
                       param_dtype=jnp.float32, rngs=nnx.Rngs(3))
  attn.qkv.bias[...] = jax.random.normal(jax.random.key(4), (3 * dim,))
  x = np.asarray(jax.random.normal(jax.random.key(5), (2, n, dim)), np.float64)
  wqkv = np.asarray(attn.qkv.kernel[...], np.float64)
  bqkv = np.asarray(attn.qkv.bias[...], np.float64)
  qkv = (x @ wqkv + bqkv).reshape(2, n, 3, heads, dim // heads)
  q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # [B, heads, N, hd]
  logits = q @ k.transpose(0, 1, 3, 2) / np.sqrt(dim // heads)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = (probs @ v).transpose(0, 2, 1, 3).reshape(2, n, dim)
  want = out @ np.asarray(attn.proj.kernel[...]) + np.asarray(attn.proj.bias[...])
  np.testing.assert_allclose(attn(jnp.asarray(x, jnp.float32)), want, rtol=1e-4, atol=1e-5)


def test_zero_layerscale_blocks_are_identities():
  # With LayerScale 0 every block returns its input, so the class-token feature is
  # LayerNorm(cls_token + pos_embed[0]) (scale 1, bias 0 at init).
  model = models.get_model("vit_demo", num_classes=4, rngs=nnx.Rngs(0), layerscale_init=0.0)
  model.cls_token[...] = jax.random.normal(jax.random.key(9), (1, 1, 128))
  feats = model.features(_images(3, 32))
  want = _layer_norm(np.asarray(model.cls_token[...] + model.pos_embed[:, :1])[0, 0])
  np.testing.assert_allclose(feats, np.broadcast_to(want, (3, 128)), rtol=1e-4, atol=1e-4)
  assert model.blocks[2].ls2.gamma.shape == (128,)


def test_pos_embed_cls_placement():
  x = _images(2, 32)
  model = models.get_model("vit_demo", num_classes=4, rngs=nnx.Rngs(0))
  model.cls_token[...] = jnp.full((1, 1, 128), 0.5)
  tokens = model._tokens(x)  # pylint: disable=protected-access
  np.testing.assert_allclose(tokens[:, 0], np.broadcast_to(0.5 + model.pos_embed[0, 0], (2, 128)))
  deit3 = models.get_model("vit_demo", num_classes=4, rngs=nnx.Rngs(0), pos_embed_cls=False)
  deit3.cls_token[...] = jnp.full((1, 1, 128), 0.5)
  tokens = deit3._tokens(x)  # pylint: disable=protected-access
  assert tokens.shape == (2, 17, 128)  # (32 / 8)^2 patches + class token
  np.testing.assert_array_equal(tokens[:, 0], np.full((2, 128), 0.5, np.float32))
  patches = deit3.patch_embed(x).reshape(2, 16, 128)
  np.testing.assert_allclose(tokens[:, 1:], patches + deit3.pos_embed[...], rtol=1e-6)


def test_gap_head_pools_the_mean_token():
  model = models.get_model("vit_demo", num_classes=4, rngs=nnx.Rngs(0), head="gap")
  assert model.cls_token is None and model.pos_embed.shape == (1, 16, 128)
  x = _images(2, 32)
  tokens = model._tokens(x)  # pylint: disable=protected-access
  for block in model.blocks:
    tokens = block(tokens)
  normed = model.norm(tokens)
  np.testing.assert_allclose(model.features(x), normed.mean(axis=1), rtol=1e-5, atol=1e-5)
  assert not np.allclose(model.features(x), normed[:, 0], atol=1e-3)


def test_bfloat16_compute_gives_finite_float32_logits():
  kw = dict(num_classes=10, head_zeroinit=False)
  model32 = models.get_model("vit_demo", rngs=nnx.Rngs(0), **kw)
  model16 = models.get_model("vit_demo", rngs=nnx.Rngs(0), dtype=jnp.bfloat16, **kw)
  assert model16.blocks[0].mlp.fc1.kernel.dtype == jnp.float32  # params stay float32
  x = _images(2, 32)
  logits = model16(x, train=True, rng=jax.random.key(0))
  assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))
  np.testing.assert_allclose(model16(x), model32(x), atol=0.1)


# --- stochastic depth -----------------------------------------------------------------------


def test_drop_path_rate_schedules():
  np.testing.assert_allclose(layers.drop_path_rates(0.3, 4, "linear"), [0.0, 0.1, 0.2, 0.3])
  assert layers.drop_path_rates(0.3, 4, "uniform") == [0.3] * 4
  assert layers.drop_path_rates(0.3, 1, "linear") == [0.0]  # torch.linspace(0, 0.3, 1).
  model = models.get_model("vit_demo", num_classes=4, rngs=nnx.Rngs(0), drop_path_rate=0.15)
  np.testing.assert_allclose([b.drop_path_rate for b in model.blocks], [0, 0.05, 0.1, 0.15])
  with pytest.raises(ValueError, match="drop_path_schedule"):
    layers.drop_path_rates(0.1, 4, "cosine")
  with pytest.raises(ValueError, match="drop_path_rate"):
    layers.drop_path_rates(1.5, 4)


def test_drop_path_per_row_statistics_and_scaling():
  x = jnp.ones((4000, 3, 2))
  y = np.asarray(layers.drop_path(x, 0.3, jax.random.key(0)))
  row = y[:, 0, 0]
  assert np.all(y == row[:, None, None])  # one decision per row
  assert set(np.unique(row).tolist()) <= {0.0, np.float32(1 / 0.7)}
  assert abs(np.mean(row == 0) - 0.3) < 0.03  # binomial std ~0.007
  np.testing.assert_array_equal(layers.drop_path(x, 1.0, jax.random.key(0)), np.zeros_like(x))
  np.testing.assert_array_equal(layers.drop_path(x, 0.0, None), x)
  # In bfloat16 too a kept row is scaled by 1 / 0.9 as near as bfloat16 has it (1.109375, the
  # scale rounded first, would bias every row low by 0.16%).
  x16 = jnp.full((64, 1), 3.0, jnp.bfloat16)
  kept = np.asarray(layers.drop_path(x16, 0.1, jax.random.key(0)), np.float32)
  assert set(np.unique(kept).tolist()) <= {0.0, float(jnp.bfloat16(3.0 / 0.9))}


def test_block_drops_each_branch_per_row_independently():
  p, batch = 0.5, 512
  block = vit.Block(8, 2, 16, qkv_bias=True, layerscale_init=None, drop_path_rate=p,
                    dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(1))
  x = jax.random.normal(jax.random.key(2), (batch, 3, 8))
  out = np.asarray(block(x, train=True, rng=jax.random.key(3)))
  # Every row must equal one of the four keep/drop combinations, with kept branches x1/(1-p).
  attn_out = block.attn(block.norm1(x))
  after_attn = {0: x, 1: x + attn_out / (1 - p)}
  combos = {}
  for a in (0, 1):
    h = after_attn[a]
    mlp_out = block.mlp(block.norm2(h))
    for m in (0, 1):
      combos[(a, m)] = np.asarray(h + m * mlp_out / (1 - p))
  which = np.full((batch, 2), -1)
  for (a, m), want in combos.items():
    match = np.all(np.isclose(out, want, rtol=1e-5, atol=1e-5), axis=(1, 2))
    assert not np.any(match & (which[:, 0] >= 0)), "a row matched two combinations"
    which[match] = (a, m)
  assert np.all(which >= 0), "some rows match no keep/drop combination"
  kept_attn, kept_mlp = which[:, 0], which[:, 1]
  assert abs(kept_attn.mean() - (1 - p)) < 0.08 and abs(kept_mlp.mean() - (1 - p)) < 0.08
  # Independent branches: the decisions disagree on about 2p(1-p) = half of the rows.
  assert abs(np.mean(kept_attn != kept_mlp) - 2 * p * (1 - p)) < 0.08
  # Eval ignores stochastic depth.
  h = x + attn_out
  np.testing.assert_allclose(block(x), h + block.mlp(block.norm2(h)), rtol=1e-5, atol=1e-5)


def test_vit_train_without_drop_path_equals_eval():
  model = models.get_model("vit_demo", num_classes=10, rngs=nnx.Rngs(0), head_zeroinit=False)
  x = _images(2, 32)
  np.testing.assert_array_equal(model(x, train=True), model(x))
  np.testing.assert_array_equal(model(x, train=True, rng=jax.random.key(1)), model(x))


def test_vit_stochastic_depth_needs_rng_and_is_deterministic_given_rng():
  model = models.get_model("vit_demo", num_classes=10, rngs=nnx.Rngs(0), head_zeroinit=False,
                           drop_path_rate=0.5, drop_path_schedule="uniform")
  x = _images(8, 32)
  with pytest.raises(ValueError, match="rng"):
    model(x, train=True)
  a = model(x, train=True, rng=jax.random.key(1))
  np.testing.assert_array_equal(a, model(x, train=True, rng=jax.random.key(1)))
  assert not np.allclose(a, model(x, train=True, rng=jax.random.key(2)))
  assert not np.allclose(a, model(x))
  np.testing.assert_array_equal(model(x), model(x, train=False, rng=jax.random.key(1)))


def test_vit_esd_mode_train_eval_and_full_drop():
  kw = dict(num_classes=10, head_zeroinit=False, drop_path_schedule="uniform")
  esd = models.get_model("vit_demo", rngs=nnx.Rngs(0), drop_path_rate=0.5,
                         stochastic_depth="esd", **kw)
  masked = models.get_model("vit_demo", rngs=nnx.Rngs(0), drop_path_rate=0.5, **kw)
  x = _images(8, 32)
  np.testing.assert_array_equal(esd(x), masked(x))  # Same weights; eval ignores the mode.
  with pytest.raises(ValueError, match="rng"):
    esd(x, train=True)
  a = esd(x, train=True, rng=jax.random.key(1))
  np.testing.assert_allclose(jax.jit(lambda v, k: esd(v, train=True, rng=k))(x, jax.random.key(1)),
                             a, rtol=1e-5, atol=1e-5)
  assert not np.allclose(a, esd(x, train=True, rng=jax.random.key(2)))
  assert not np.allclose(a, esd(x), atol=1e-3)
  # Rate 1 keeps no rows: every block is the identity in both modes, so the class-token
  # feature is LayerNorm(cls_token + 0) (DeiT-III: no position embedding on the class token).
  for mode in ("esd", "mask"):
    model = models.get_model("vit_demo", rngs=nnx.Rngs(0), drop_path_rate=1.0,
                             stochastic_depth=mode, pos_embed_cls=False, **kw)
    model.cls_token[...] = jax.random.normal(jax.random.key(9), (1, 1, 128))
    want = _layer_norm(np.asarray(model.cls_token[...])[0, 0])
    np.testing.assert_allclose(model.features(x, train=True, rng=jax.random.key(0)),
                               np.broadcast_to(want, (8, 128)), rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="stochastic_depth"):
    models.get_model("vit_demo", rngs=nnx.Rngs(0), stochastic_depth="fast", **kw)


def test_vit_under_jit_with_split_params():
  model = models.get_model("vit_demo", num_classes=5, rngs=nnx.Rngs(0), head_zeroinit=False,
                           drop_path_rate=0.1)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  pure = nnx.to_pure_dict(params)

  @jax.jit
  def apply(pure_params, images, rng):
    state = nnx.state(nnx.merge(graphdef, params, rest), nnx.Param)
    nnx.replace_by_pure_dict(state, pure_params)
    return nnx.merge(graphdef, state, rest)(images, train=True, rng=rng)

  x = _images(2, 32)
  np.testing.assert_allclose(apply(pure, x, jax.random.key(0)),
                             model(x, train=True, rng=jax.random.key(0)), rtol=1e-5, atol=1e-5)


def test_resize_pos_embed_keeps_prefix_and_constant_grid():
  pos = jnp.concatenate([jnp.full((1, 1, 4), 7.0), jnp.full((1, 4, 4), 2.0)], axis=1)
  out = vit.resize_pos_embed(pos, (2, 2), (3, 3), num_prefix=1)
  assert out.shape == (1, 10, 4)
  np.testing.assert_allclose(out[0, 0], np.full(4, 7.0))
  np.testing.assert_allclose(out[0, 1:], np.full((9, 4), 2.0), rtol=1e-6)


def test_position_embedding_resize_kernels_by_hand():
  """Keys' cubic convolution with a = -0.75 (torch's bicubic), 2 -> 4 samples, taps clamped at
  the border. align_corners: output 1 samples x = 1/3, taps -1, 0, 1, 2 (clamped to 0, 0, 1,
  1) weigh W(4/3) = -1/9, W(1/3) = 43/54, W(2/3) = 10/27, W(5/3) = -1/18. Half-pixel: output 0
  samples x = -1/4, taps -2..1 (clamped to 0, 0, 0, 1) weigh -9/256, 67/256, 225/256, -27/256."""
  np.testing.assert_allclose(vit.resize_matrix(2, 4, "bicubic_align_corners"),
                             [[1, 0], [37 / 54, 17 / 54], [17 / 54, 37 / 54], [0, 1]], atol=1e-12)
  np.testing.assert_allclose(vit.resize_matrix(2, 4, "bicubic")[0], [283 / 256, -27 / 256],
                             atol=1e-12)
  # On a grid, the resize is separable: a 2x2 grid's sample (1, 1) weighs its corners by the
  # outer product of the row above.
  grid = np.array([[1.0, 2.0], [3.0, 5.0]], np.float32)
  out = vit.resize_pos_embed(grid.reshape(1, 4, 1), (2, 2), (4, 4),
                             method="bicubic_align_corners")
  r = np.array([37, 17]) / 54
  assert float(out[0, 5, 0]) == pytest.approx(r @ grid @ r, rel=1e-6)
  # The antialiased method (timm's) is jax.image.resize's bicubic: Keys a = -0.5, widened
  # when shrinking, weights renormalised at the border.
  x = np.random.RandomState(0).normal(size=(7, 5)).astype(np.float32)
  for new in ((14, 12), (3, 2)):
    got = (vit.resize_matrix(7, new[0], "bicubic_antialias") @ x
           @ vit.resize_matrix(5, new[1], "bicubic_antialias").T)
    np.testing.assert_allclose(got, jax.image.resize(x, new, "bicubic"), atol=1e-5)
  with pytest.raises(ValueError, match="resize method 'bilinear' must be one of"):
    vit.resize_matrix(2, 4, "bilinear")


def test_model_init_resize_auto_follows_the_checkpoints_origin():
  """'auto': a converted checkpoint's library's resize (timm, torchvision), else bicubic;
  only the model's own size-dependent array is adapted."""
  model_def = models.ModelDef.from_config({"name": "vit_demo"}, 10, image_size=48)
  saved = np.random.RandomState(0).normal(size=(1, 17, 128)).astype(np.float32)
  for origin, method in (("timm:vit_base_patch16_224", "bicubic_antialias"),
                         ("torchvision:vit_b_16", "bicubic_align_corners"), ("", "bicubic")):
    got = model_def.param_adapter("auto", lambda o=origin: o)("params/pos_embed", saved)
    want = vit.resize_pos_embed(saved, (4, 4), (6, 6), num_prefix=1, method=method)
    np.testing.assert_array_equal(got, want)
  adapt = model_def.param_adapter("bicubic")
  assert adapt("params/cls_token", saved) is None and adapt("extra/pos_embed", saved) is None
  with pytest.raises(ValueError, match="model_init_resize='nearest' must be auto or one of"):
    model_def.param_adapter("nearest")


# --- convnets and mixer ---------------------------------------------------------------------


def _materialize(build, seed=0):
  """Builds a module abstractly, then fills it with cheap numpy values (no XLA init compiles).

  Kernels get N(0, 1/fan_in); BatchNorm/LayerNorm scales and running variances 1; the rest 0.
  """
  abstract = nnx.eval_shape(build)
  graphdef, state = nnx.split(abstract)
  rs = np.random.RandomState(seed)

  def fill(path, x):
    if len(x.shape) >= 2:
      fan_in = int(np.prod(x.shape[:-1]))
      return rs.normal(0, 1 / np.sqrt(fan_in), x.shape).astype(x.dtype)
    ones = path[-1].key in ("scale", "var")
    return (np.ones if ones else np.zeros)(x.shape, x.dtype)

  pure = jax.tree_util.tree_map_with_path(fill, nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state)


def _logical_names(module):
  _, params, _ = nnx.split(module, nnx.Param, ...)
  flat = jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
  return {jax.tree_util.keystr(path, simple=True, separator="/"):
          leaf.get_metadata().get("out_sharding") for path, leaf in flat}


@pytest.mark.parametrize("name,expected", [
    ("resnet50", 25_557_032),
    ("resnet101", 44_549_160),
    ("mobilenetv3_large_100", 5_483_032),  # timm's count
    ("mixer_b16", 59_880_472),
    ("mixer_s16", 18_528_264),
])
def test_convnet_and_mixer_param_counts(name, expected):
  assert _num_params(_abstract(name, num_classes=1000)) == expected


def test_resnet50_structure_batch_stats_and_axes():
  model = _abstract("resnet50", num_classes=1000)
  # Running mean + variance for every BatchNorm: stem 64, each bottleneck w + w + 4w,
  # plus 4w for each stage's projection shortcut.
  channels = 64 + sum(n * 6 * w + 4 * w for n, w in zip((3, 4, 6, 3), (64, 128, 256, 512)))
  stats = jax.tree.leaves(nnx.state(model, nnx.BatchStat))
  assert sum(int(np.prod(x.shape)) for x in stats) == 2 * channels
  first_of_stage2 = model.blocks[3]  # v1.5: the stride is on the 3x3 conv
  assert first_of_stage2.conv1.kernel.shape == (1, 1, 256, 128)
  assert first_of_stage2.conv1.strides == 1
  assert first_of_stage2.conv2.kernel.shape == (3, 3, 128, 128)
  assert first_of_stage2.conv2.strides == 2
  assert first_of_stage2.downsample_conv.strides == 2
  assert model.blocks[4].downsample_conv is None
  names = _logical_names(model)
  assert names["blocks/3/conv2/kernel"] == (None, None, "conv_in", "conv_out")
  assert names["stem_conv/kernel"] == (None, None, None, "conv_out")
  assert names["head/kernel"] == ("embed", "classes")
  assert "blocks/0/bn1/mean" not in names  # batch statistics are not parameters


def test_bottleneck_starts_as_identity():
  from bigpretrain.models import resnet  # pylint: disable=g-import-not-at-top
  block = resnet.Bottleneck(16, 4, stride=1, dtype=jnp.float32, param_dtype=jnp.float32,
                            rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 5, 5, 16))
  np.testing.assert_array_equal(block.bn3.scale[...], np.zeros(16))
  np.testing.assert_allclose(block(x, train=False), np.maximum(x, 0), atol=1e-6)


def test_small_resnet_forward_and_batch_norm_modes():
  from bigpretrain.models import resnet  # pylint: disable=g-import-not-at-top
  model = _materialize(lambda: resnet.ResNet(num_classes=6, rngs=nnx.Rngs(0),
                                             stage_sizes=(1, 1, 1, 1)))
  x = _images(4, 32)
  logits = nnx.jit(lambda m, v: m(v))(model, x)
  assert logits.shape == (4, 6) and logits.dtype == jnp.float32
  np.testing.assert_array_equal(model.stem_bn.mean[...], np.zeros(64))  # eval: no update
  conv_out = np.asarray(model.stem_conv(x), np.float64)
  nnx.jit(lambda m, v: m(v, train=True))(model, x)
  # One training step moves the running mean 10% of the way to the batch mean.
  np.testing.assert_allclose(model.stem_bn.mean[...], 0.1 * conv_out.mean(axis=(0, 1, 2)),
                             rtol=1e-4, atol=1e-6)
  with pytest.raises(ValueError, match="'mask' only"):
    resnet.ResNet(num_classes=6, rngs=nnx.Rngs(0), stage_sizes=(1,), drop_path_rate=0.1,
                  stochastic_depth="esd")
  bf16 = _materialize(lambda: resnet.ResNet(num_classes=6, rngs=nnx.Rngs(0),
                                            stage_sizes=(1, 1), dtype=jnp.bfloat16,
                                            drop_path_rate=0.0))
  out = nnx.jit(lambda m, v: m(v, train=True))(bf16, x)
  assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))


def test_make_divisible_by_hand():
  from bigpretrain.models import mobilenet_v3  # pylint: disable=g-import-not-at-top
  # 72/4 = 18 -> 16 is more than 10% below 18, so 24; 120/4 = 30 -> 32; 480/4 = 120 -> 120.
  assert [mobilenet_v3.make_divisible(v) for v in (18, 30, 120, 168, 3)] == [24, 32, 120, 168, 8]


def test_mobilenet_v3_squeeze_excite_widths_and_forward():
  model = _abstract("mobilenetv3_large_100", num_classes=1000)
  se_widths = [(b.se.conv_reduce.kernel.shape[2], b.se.conv_reduce.kernel.shape[3])
               for b in model.blocks[1:] if b.se is not None]
  assert se_widths == [(72, 24), (120, 32), (120, 32), (480, 120), (672, 168), (672, 168),
                       (960, 240), (960, 240)]
  assert [b.has_skip for b in model.blocks[1:]] == [
      False, True, False, True, True, False, True, True, True, False, True, False, True, True]
  assert _logical_names(model)["blocks/4/conv_dw/kernel"] == (None, None, None, "conv_out")
  small = _materialize(lambda: models.get_model("mobilenetv3_large_100", num_classes=5,
                                                rngs=nnx.Rngs(0), image_size=64,
                                                drop_path_rate=0.0))
  x = _images(2, 64)
  outs = nnx.jit(lambda m, v: (m(v), m.features(v), m(v, train=True)))(small, x)
  for out in (outs[0], outs[2]):
    assert out.shape == (2, 5) and out.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(out)))
  assert outs[1].shape == (2, 1280)
  assert not np.allclose(outs[0], outs[2])  # batch vs running statistics


def test_squeeze_excite_matches_numpy():
  from bigpretrain.models import mobilenet_v3  # pylint: disable=g-import-not-at-top
  ops = mobilenet_v3._Ops(jnp.float32, jnp.float32, nnx.Rngs(0))  # pylint: disable=protected-access
  se = mobilenet_v3.SqueezeExcite(16, ops)
  se.conv_reduce.bias[...] = jnp.linspace(-1, 1, 8)
  se.conv_expand.bias[...] = jnp.linspace(-4, 4, 16)
  x = np.asarray(jax.random.normal(jax.random.key(0), (2, 3, 3, 16)), np.float64)
  w1 = np.asarray(se.conv_reduce.kernel[...])[0, 0]
  w2 = np.asarray(se.conv_expand.kernel[...])[0, 0]
  s = x.mean(axis=(1, 2))
  r = np.maximum(s @ w1 + np.asarray(se.conv_reduce.bias[...]), 0)
  gate = np.clip(r @ w2 + np.asarray(se.conv_expand.bias[...]) + 3, 0, 6) / 6
  np.testing.assert_allclose(se(jnp.asarray(x, jnp.float32)), x * gate[:, None, None, :],
                             rtol=1e-5, atol=1e-6)


def _gelu_np(x):
  from scipy.special import erf  # pylint: disable=g-import-not-at-top
  return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def test_gelu_is_the_exact_gelu_and_its_gradient():
  """layers.gelu is x * Phi(x) with Phi(x) + x phi(x) as its gradient: in float32 jax.nn.gelu's
  erfc form, bit for bit; in bfloat16 the erf form, within bfloat16 rounding of the exact values
  (computed here in float64 on the bfloat16 inputs) plus a float32 cancellation in the far
  negative tail, and nowhere further from them than jax.nn.gelu's bfloat16 result."""
  from scipy.special import erf  # pylint: disable=g-import-not-at-top
  x = np.linspace(-8, 8, 2001)
  got = layers.gelu(jnp.asarray(x, jnp.float32))
  np.testing.assert_array_equal(got, jax.nn.gelu(jnp.asarray(x, jnp.float32), approximate=False))
  np.testing.assert_allclose(got, _gelu_np(x), rtol=1e-6, atol=1e-7)
  xb = jnp.asarray(x, jnp.bfloat16)
  x16 = np.asarray(xb, np.float64)
  got = np.asarray(layers.gelu(xb), np.float64)
  err = np.abs(got - _gelu_np(x16))
  np.testing.assert_array_less(err, 2 ** -7 * np.abs(_gelu_np(x16)) + 2 ** -15)
  jax_err = np.abs(np.asarray(jax.nn.gelu(xb, approximate=False), np.float64) - _gelu_np(x16))
  assert err.max() <= jax_err.max()
  grad = np.asarray(jax.vmap(jax.grad(layers.gelu))(xb), np.float64)
  want = 0.5 * (1 + erf(x16 / np.sqrt(2))) + x16 * np.exp(-x16 * x16 / 2) / np.sqrt(2 * np.pi)
  np.testing.assert_allclose(grad, want, rtol=2 ** -6, atol=2 ** -8)


def test_mixer_block_matches_numpy():
  from bigpretrain.models import mixer  # pylint: disable=g-import-not-at-top
  block = mixer.MixerBlock(4, 6, 5, 7, dtype=jnp.float32, param_dtype=jnp.float32,
                           rngs=nnx.Rngs(0))
  x = np.asarray(jax.random.normal(jax.random.key(1), (2, 4, 6)), np.float64)
  p = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(block, nnx.Param)))

  def mlp(v, q):
    return _gelu_np(v @ q["fc1"]["kernel"] + q["fc1"]["bias"]) @ q["fc2"]["kernel"] + \
        q["fc2"]["bias"]

  y = _layer_norm(x).transpose(0, 2, 1)  # LN scale 1, bias 0 at init
  h = x + mlp(y, p["token_mixing"]).transpose(0, 2, 1)
  want = h + mlp(_layer_norm(h), p["channel_mixing"])
  np.testing.assert_allclose(block(jnp.asarray(x, jnp.float32)), want, rtol=1e-4, atol=1e-5)


def test_small_mixer_forward_and_axes():
  from bigpretrain.models import mixer  # pylint: disable=g-import-not-at-top
  model = mixer.MlpMixer(num_classes=3, rngs=nnx.Rngs(0), patch_size=8, width=16, depth=2,
                         tokens_mlp_dim=8, channels_mlp_dim=32, image_size=32)
  x = _images(2, 32)
  out = model(x, train=True)
  assert out.shape == (2, 3) and out.dtype == jnp.float32
  np.testing.assert_array_equal(out, np.zeros((2, 3)))  # zero-initialised head
  assert model.features(x).shape == (2, 16)
  names = _logical_names(model)
  assert names["blocks/1/channel_mixing/fc1/kernel"] == ("embed", "mlp")
  assert names["blocks/1/token_mixing/fc1/kernel"] == (None, None)
  assert names["patch_embed/kernel"] == (None, None, None, "embed")
  with pytest.raises(TypeError, match="patch_size"):
    _abstract("mixer_b16", num_classes=3, patch_size=32)
  with pytest.raises(ValueError, match="drop_path_rate"):
    _abstract("mixer_b16", num_classes=3, drop_path_rate=0.1)
