"""Tests for input_pipeline/augment.py: crops, flips, resizes, the papers' augmentations,
op-string parsing and normalisation."""
import io
import math

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image, ImageEnhance, ImageFilter, ImageOps

from bigpretrain import preprocess
from input_pipeline import augment
from input_pipeline import augment_spec
from input_pipeline import decoding


def _noise(h, w, seed=0):
  return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_random_flip_matches_numpy_and_generator_draw():
  image = _noise(5, 7)
  outcomes = set()
  for seed in range(20):
    out = augment.random_flip(image, np.random.default_rng(seed))
    flipped = np.random.default_rng(seed).random() < 0.5  # The same draw, made independently.
    np.testing.assert_array_equal(out, image[:, ::-1] if flipped else image)
    outcomes.add(flipped)
  assert outcomes == {True, False}


def test_squish_shape_dtype_and_constant_colour():
  image = np.zeros((6, 10, 3), np.uint8)
  image[..., 0], image[..., 1], image[..., 2] = 10, 128, 250
  out = augment.squish(image, 4)
  assert out.shape == (4, 4, 3) and out.dtype == np.uint8
  np.testing.assert_array_equal(out[..., 0], 10)
  np.testing.assert_array_equal(out[..., 2], 250)


def test_squish_keeps_left_to_right_gradient():
  ramp = np.tile(np.linspace(0, 255, 12).astype(np.uint8)[None, :, None], (9, 1, 3))
  out = augment.squish(ramp, 5).astype(int)
  assert np.all(np.diff(out[2, :, 0]) > 0)  # Still increasing left to right.
  np.testing.assert_array_equal(out[0], out[4])  # Rows stay identical.


@pytest.mark.parametrize("shape,expected", [((6, 10, 3), (8, 13, 3)), ((12, 4, 3), (24, 8, 3)),
                                            ((5, 5, 3), (8, 8, 3))])
def test_resize_shorter(shape, expected):
  # round(10 * 8 / 6) = 13; round(12 * 8 / 4) = 24.
  assert augment.resize_shorter(np.zeros(shape, np.uint8), 8).shape == expected


def test_center_crop_is_the_central_window():
  # image_size 7 -> shorter side round(7 / 0.875) = 8, already the case, so no resampling.
  image = _noise(8, 12)
  out = augment.center_crop(image, 7)
  np.testing.assert_array_equal(out, image[0:7, 2:9])  # top (8-7)//2, left (12-7)//2.


@pytest.mark.parametrize("spec,size,scale", [
    ("center_crop(0.9, bicubic)", 224, 248),  # timm's ViTs / DeiT-III: floor(248.9)
    ("center_crop(0.95, bicubic)", 224, 235),  # timm's ResNets: floor(235.8)
    ("center_crop(1.0, bicubic)", 384, 384),
    ("center_crop(0.875)", 224, 256),
    ("center_crop(0.875)", 32, 36),  # floor(36.57); the bare 'center_crop' rounds to 37
    ("center_crop(224/232)", 224, 232),  # torchvision's V2 weights: Resize(232)
    ("center_crop(224/242, bilinear)", 224, 242),  # torchvision's vit_l_16: Resize(242)
    ("center_crop(224/232)", 448, 464),  # the same proportion at another size
    ("center_crop(1)", 7, 7),
])
def test_parametrised_center_crop_scale_size(spec, size, scale):
  assert augment_spec.eval_resize_op(spec).scale_size(size) == scale


def test_parametrised_center_crop_takes_torchvisions_central_window():
  """Shorter side already the scale size (no resampling): the window is at round((side -
  crop) / 2), halves to even, as torchvision's CenterCrop (the bare 'center_crop' floors)."""
  op = augment_spec.eval_resize_op("center_crop(0.9, bicubic)")  # 224 -> shorter side 248
  image = _noise(248, 331)  # left round(107 / 2) = round(53.5) = 54
  np.testing.assert_array_equal(op(image, 224), image[12:236, 54:278])
  image = _noise(329, 248)  # top round(105 / 2) = round(52.5) = 52
  np.testing.assert_array_equal(op(image, 224), image[52:276, 12:236])
  # Resampled: 300 x 400 -> 248 x int(400 * 248 / 300) = 248 x 330 (bicubic), window at
  # (12, 53).
  image = _noise(300, 400)
  want = np.asarray(Image.fromarray(image).resize((330, 248), Image.BICUBIC))[12:236, 53:277]
  np.testing.assert_array_equal(op(image, 224), want)
  want = np.asarray(Image.fromarray(image).resize((330, 248), Image.BILINEAR))[12:236, 53:277]
  np.testing.assert_array_equal(augment_spec.eval_resize_op("center_crop(0.9)")(image, 224),
                                want)


def test_bare_eval_resize_names_are_unchanged():
  for name, op in augment_spec.EVAL_RESIZES.items():
    assert augment_spec.eval_resize_op(name) is op
  # 'center_crop' at 32 px: shorter side round(32 / 0.875) = 37 (here no resampling), window
  # at floor((47 - 32) / 2) = 7.
  image = _noise(37, 47)
  np.testing.assert_array_equal(augment_spec.eval_resize_op("center_crop")(image, 32),
                                image[2:34, 7:39])


@pytest.mark.parametrize("spec,match", [
    ("crop", r"unknown data\.eval_resize='crop'; expected one of \['center_crop', "
     r"'shorter_center_crop', 'squish'\], or center_crop\(F\)"),
    ("squish(0.9)", "unknown data.eval_resize='squish"),
    ("center_crop(0)", r"crop fraction must be in \(0, 1\], got 0"),
    ("center_crop(1.2)", r"crop fraction must be in \(0, 1\], got 1.2"),
    ("center_crop(nan)", r"crop fraction must be in \(0, 1\], got nan"),
    ("center_crop(232/224)", "needs 0 < crop <= resize, got 232/224"),
    ("center_crop(0/5)", "needs 0 < crop <= resize"),
    ("center_crop(x)", "'x' is not a crop fraction"),
    ("center_crop()", r"expected center_crop\(F\) or center_crop\(F, interpolation\)"),
    ("center_crop(0.9, bicubic, 1)", r"expected center_crop\(F\) or"),
    ("center_crop(0.9, lanczos)", r"unknown interpolation 'lanczos'; expected one of "
     r"\['bilinear', 'bicubic'\]"),
    (0.9, "data.eval_resize must be a str, got 0.9"),
])
def test_bad_eval_resize_is_named(spec, match):
  with pytest.raises(ValueError, match=match):
    augment_spec.eval_resize_op(spec)
  with pytest.raises(ValueError, match="^--eval_resize" if isinstance(spec, float) else
                     "--eval_resize="):
    augment_spec.eval_resize_op(spec, "--eval_resize")


def _textured_photo(h, w, seed=0) -> np.ndarray:
  """A blobby photo with per-pixel grain: a one-pixel shift of a crop shows."""
  grain = np.random.default_rng(seed + 1).integers(-40, 41, (h, w, 3))
  return np.clip(_blobby_photo(h, w, seed).astype(int) + grain, 0, 255).astype(np.uint8)


# Sizes whose crop window falls on a half pixel for some of the models below.
_PHOTO_SIZES = ((375, 500), (427, 640), (640, 427), (333, 517), (301, 301))


def _as_uint8_levels(tensor, mean, std) -> np.ndarray:
  """A normalised [3, H, W] torch tensor back in 0..255 levels (floats), [H, W, 3]."""
  return (tensor.numpy().transpose(1, 2, 0) * np.array(std) + np.array(mean)) * 255


@pytest.mark.interop
@pytest.mark.parametrize("name", ["vit_base_patch16_224", "deit3_base_patch16_384", "resnet50",
                                  "tresnet_m"])
def test_center_crop_matches_timms_eval_transform(name):
  """timm.data.create_transform(**resolve_data_config(...)) of the model's pretrained cfg."""
  timm = pytest.importorskip("timm", reason="needs the interop extra")
  cfg = timm.data.resolve_data_config(
      pretrained_cfg=timm.models.get_pretrained_cfg(name).to_dict())
  transform = timm.data.create_transform(**cfg)
  op = augment_spec.eval_resize_op(f"center_crop({cfg['crop_pct']}, {cfg['interpolation']})")
  for h, w in _PHOTO_SIZES:
    image = _textured_photo(h, w, seed=h)
    theirs = _as_uint8_levels(transform(Image.fromarray(image)), cfg["mean"], cfg["std"])
    ours = np.asarray(op(image, cfg["input_size"][-1])).astype(float)
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= 1, (name, h, w, np.abs(ours - theirs).max())


@pytest.mark.interop
@pytest.mark.parametrize("weights", ["ResNet50_Weights.IMAGENET1K_V2",
                                     "ViT_L_16_Weights.IMAGENET1K_V1",
                                     "ViT_B_16_Weights.IMAGENET1K_SWAG_E2E_V1"])
def test_center_crop_ratio_matches_torchvisions_eval_transform(weights):
  """weights.transforms(): Resize(resize) then CenterCrop(crop) = center_crop(crop/resize)."""
  torchvision = pytest.importorskip("torchvision", reason="needs the interop extra")
  transform = torchvision.models.get_weight(weights).transforms()
  crop, resize = transform.crop_size[0], transform.resize_size[0]
  op = augment_spec.eval_resize_op(f"center_crop({crop}/{resize}, "
                                   f"{transform.interpolation.value})")
  for h, w in _PHOTO_SIZES:
    image = _textured_photo(h, w, seed=w)
    theirs = _as_uint8_levels(transform(Image.fromarray(image)), transform.mean, transform.std)
    ours = np.asarray(op(image, crop)).astype(float)
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= 1, (weights, h, w, np.abs(ours - theirs).max())


def test_resize_crop_takes_the_window_the_generator_picks():
  image = _noise(8, 12)  # Shorter side already 8 for image_size 7.
  seen = set()
  for seed in range(8):
    out = augment.resize_crop(image, np.random.default_rng(seed), 7)
    rng = np.random.default_rng(seed)
    top, left = int(rng.integers(0, 2)), int(rng.integers(0, 6))
    np.testing.assert_array_equal(out, image[top:top + 7, left:left + 7])
    seen.add((top, left))
  assert len(seen) > 1


def test_inception_crop_box_respects_scale_and_ratio():
  h, w = 200, 300
  for seed in range(50):
    top, left, ch, cw = augment.inception_crop_box(h, w, np.random.default_rng(seed))
    assert 0 <= top and top + ch <= h and 0 <= left and left + cw <= w
    # Rounding to whole pixels moves the area and ratio only slightly past the bounds.
    assert 0.08 * 0.97 <= ch * cw / (h * w) <= 1.0
    assert 0.75 * 0.97 <= cw / ch <= 4 / 3 * 1.03


def test_inception_crop_box_fallback_is_central_with_clamped_ratio():
  # A 10 x 1000 strip: every sampled crop is taller than 10 px, so all attempts miss and the
  # fallback takes the widest allowed ratio 4/3: width round(10 * 4/3) = 13, centred.
  box = augment.inception_crop_box(10, 1000, np.random.default_rng(0))
  assert box == (0, (1000 - 13) // 2, 10, 13)


def test_inception_crop_output_and_full_box_equals_squish():
  image = _noise(8, 8)
  out = augment.inception_crop(image, np.random.default_rng(3), 5)
  assert out.shape == (5, 5, 3) and out.dtype == np.uint8
  full = augment.inception_crop(image, np.random.default_rng(0), 5, scale=(1, 1), ratio=(1, 1))
  np.testing.assert_array_equal(full, augment.squish(image, 5))


def test_normalize_presets_against_numpy():
  x = np.array([[[[0, 128, 255]]]], np.uint8)
  f = x.astype(np.float64)
  np.testing.assert_allclose(augment.normalize(x, "0_1"), f / 255, rtol=1e-6)
  np.testing.assert_allclose(augment.normalize(x, "minus1_1"), [[[[-1, 128 / 127.5 - 1, 1]]]],
                             rtol=1e-6, atol=1e-6)
  expected = (np.array([0, 128, 255]) / 255 - np.array([0.485, 0.456, 0.406])) / np.array(
      [0.229, 0.224, 0.225])
  np.testing.assert_allclose(augment.normalize(x, "imagenet")[0, 0, 0], expected, rtol=1e-5)
  for preset in augment.NORMALIZE_PRESETS:
    assert augment.normalize(x, preset).dtype == np.float32


def test_device_normalize_matches_the_host_presets():
  x = np.random.default_rng(0).integers(0, 256, (2, 3, 4, 3), dtype=np.uint8)
  for preset in augment.NORMALIZE_PRESETS:
    out = preprocess.normalize(jnp.asarray(x), preset)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, augment.normalize(x, preset), rtol=1e-5, atol=1e-6)
  with pytest.raises(TypeError, match="uint8"):
    preprocess.normalize(jnp.zeros((1, 2, 2, 3), jnp.float32), "0_1")


def test_normalize_batch_per_channel_against_numpy():
  x = np.random.default_rng(5).integers(0, 256, (2, 3, 5, 3), dtype=np.uint8)
  f = x.astype(np.float64)
  mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
  np.testing.assert_allclose(augment.normalize(x, "imagenet"), (f / 255 - mean) / std,
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(augment.normalize(x, "0_1"), f / 255, rtol=1e-6)
  assert augment.normalize(x, "minus1_1").shape == x.shape
  with pytest.raises(ValueError, match="shape"):
    augment.normalize(np.zeros((4, 4), np.uint8), "0_1")


def test_normalize_unknown_preset():
  with pytest.raises(ValueError, match="'zscore'"):
    augment.normalize(np.zeros((1, 1, 3), np.uint8), "zscore")


def test_parse_and_apply_train_ops():
  assert augment_spec.parse_train_ops("inception_crop|flip") == ("inception_crop", "flip")
  assert augment_spec.parse_train_ops(" squish | flip |") == ("squish", "flip")
  assert augment_spec.parse_train_ops("") == ()
  assert augment_spec.parse_train_ops("squish|randaugment(2,9)|cutout( 0.5 , 0.5 )") == (
      "squish", "randaugment(2, 9)", "cutout(0.5, 0.5)")
  assert augment_spec.parse_train_ops("simple_random_crop(4)|three_augment|color_jitter(0.3)") == (
      "simple_random_crop(4)", "three_augment", "color_jitter(0.3)")
  with pytest.raises(ValueError, match="'rotate'"):
    augment_spec.parse_train_ops("squish|rotate")
  image = _noise(6, 9)
  out = augment_spec.apply_train_ops(image, ("squish", "flip"), np.random.default_rng(1), 4)
  rng = np.random.default_rng(1)
  expected = augment.squish(image, 4)
  np.testing.assert_array_equal(out, expected[:, ::-1] if rng.random() < 0.5 else expected)


def test_ops_reject_non_uint8_images():
  with pytest.raises(ValueError, match="uint8"):
    augment.squish(np.zeros((4, 4, 3), np.float32), 2)
  with pytest.raises(ValueError, match="uint8"):
    augment.squish(np.zeros((4, 4), np.uint8), 2)


@pytest.mark.parametrize("spec,match", [
    ("randaugment(2)", "'randaugment'.*expected randaugment or randaugment"),
    ("randaugment(2, 11)", "'randaugment'.*M \\(magnitude\\)"),
    ("randaugment(1.5, 9)", "'randaugment'.*N \\(ops per image\\) must be an int"),
    ("randaugment(two, 9)", "argument 'two' is not a number"),
    ("cutout(1.5)", "'cutout'.*P \\(probability\\)"),
    ("color_jitter(0.1, 0.2)", "'color_jitter'"),
    ("flip(1)", "'flip'"),
    ("squish|flip(", "cannot parse augmentation op 'flip\\('"),
    ("three_augment(-0.1)", "'three_augment'.*jitter"),
])
def test_parse_rejects_bad_ops_naming_them(spec, match):
  with pytest.raises(ValueError, match=match):
    augment_spec.parse_train_ops(spec)


# Each train op after a squish to 16 x 16: shape, dtype, determinism per seed, seed dependence.
_OP_SPECS = ["inception_crop|flip", "resize_crop", "simple_random_crop", "randaugment(2, 9)",
             "randaugment(3, 5, 1.0)", "cutout(1.0)", "color_jitter(0.3)", "three_augment"]


def _photo(h=20, w=28, seed=0):
  """Smooth gradients plus noise: every op (blur, equalize, crops) visibly changes it."""
  y, x = np.mgrid[0:h, 0:w]
  base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 255 / (h + w)], -1)
  noise = np.random.default_rng(seed).normal(0, 25, base.shape)
  return np.clip(base + noise, 0, 255).astype(np.uint8)


@pytest.mark.parametrize("spec", _OP_SPECS)
def test_train_op_shape_dtype_and_seed_behaviour(spec):
  ops = augment_spec.parse_train_ops(spec if "crop" in spec else "squish|" + spec)
  image = _photo()
  run = lambda seed: augment_spec.apply_train_ops(image, ops, np.random.default_rng(seed), 16)
  first = run(0)
  assert first.shape == (16, 16, 3) and first.dtype == np.uint8
  np.testing.assert_array_equal(run(0), first)
  assert any(not np.array_equal(run(seed), first) for seed in range(1, 6))


def test_ops_keep_the_input_kind():
  image = _photo()
  for op in ("randaugment(2, 9, 1.0)", "three_augment", "simple_random_crop", "cutout(1.0)"):
    build = augment_spec._build(op)
    from_array = build(image, np.random.default_rng(4), 16)
    from_pil = build(Image.fromarray(image), np.random.default_rng(4), 16)
    assert isinstance(from_array, np.ndarray) and isinstance(from_pil, Image.Image)
    np.testing.assert_array_equal(from_array, np.asarray(from_pil))


def _cutout_expected(image, seed, prob, factor):
  """Cutout's rule written out with the same draws (the authors' CutoutPIL, square images)."""
  rng = np.random.default_rng(seed)
  if rng.random() >= prob:
    return image, None
  h, w = image.shape[:2]
  c = int(factor * h + 0.5)  # Their h_cutout; the images here are square.
  cy, cx = rng.integers(0, h), rng.integers(0, w)
  colour = rng.integers(0, 256, 3)
  out = image.copy()
  # ImageDraw.rectangle([x1, y1, x2, y2]) fills both corners: c // 2 either side of the centre.
  rows = slice(max(0, cy - c // 2), min(h, cy + c // 2 + 1))
  cols = slice(max(0, cx - c // 2), min(w, cx + c // 2 + 1))
  out[rows, cols] = colour
  return out, (rows, cols)


def test_cutout_rule_size_and_every_image_by_default():
  image = _photo(16, 16)
  full_squares = 0
  for seed in range(200):
    out = augment.cutout(image, np.random.default_rng(seed))
    expected, box = _cutout_expected(image, seed, 1.0, 0.5)
    np.testing.assert_array_equal(out, expected)
    assert box is not None and not np.array_equal(out, image)  # Every image, as theirs.
    rows, cols = box
    size = (rows.stop - rows.start, cols.stop - cols.start)
    assert size[0] <= 9 and size[1] <= 9  # 8 // 2 = 4 pixels either side of the centre.
    full_squares += size == (9, 9)
    patch = out[rows, cols].reshape(-1, 3)
    assert (patch == patch[0]).all()  # One colour.
  assert full_squares > 10
  # The config op's default is every image too; an explicit probability still works.
  op = augment_spec._build("cutout")  # pylint: disable=protected-access
  changed = sum(not np.array_equal(op(image, np.random.default_rng(s), 16), image)
                for s in range(100))
  assert changed == 100
  applied = 0
  for seed in range(200):
    out = augment.cutout(image, np.random.default_rng(seed), prob=0.5)
    expected, box = _cutout_expected(image, seed, 0.5, 0.5)
    np.testing.assert_array_equal(out, expected)
    applied += box is not None
  assert 80 <= applied <= 120  # p = 0.5: 100 +- 4 sigma.
  np.testing.assert_array_equal(augment.cutout(image, np.random.default_rng(0), prob=0.0), image)


def test_cutout_box_on_a_224_image_is_113_pixels():
  # CutoutPIL at 224 with factor 0.5: h_cutout = int(112.5) = 112, rows cy - 56 .. cy + 56.
  image = np.zeros((224, 224, 3), np.uint8)
  sides = set()
  for seed in range(30):
    out = augment.cutout(image, np.random.default_rng(seed))
    rows, cols = np.nonzero(out.any(-1))  # The painted pixels (a black colour is unlikely).
    if rows.min() > 0 and rows.max() < 223 and cols.min() > 0 and cols.max() < 223:
      sides.add((rows.max() - rows.min() + 1, cols.max() - cols.min() + 1))
      assert len(rows) == 113 * 113
  assert sides == {(113, 113)}


def test_color_jitter_factors_and_zero_strength():
  image = np.full((4, 4, 3), 100, np.uint8)
  np.testing.assert_array_equal(
      augment.color_jitter(image, np.random.default_rng(0), 0, 0, 0), image)
  values = set()
  for seed in range(20):
    out = augment.color_jitter(image, np.random.default_rng(seed), 0.3, 0, 0)
    rng = np.random.default_rng(seed)
    rng.permutation(3)
    factor = rng.uniform(0.7, 1.3)  # Brightness scales towards black: v * factor.
    np.testing.assert_allclose(out, 100 * factor, atol=1)
    values.add(int(out[0, 0, 0]))
  assert len(values) > 5


def test_grayscale_solarize_and_blur_against_formulas():
  image = _photo()
  gray = augment.grayscale(image).astype(int)
  luma = image.astype(int) @ np.array([299, 587, 114]) / 1000  # ITU-R 601.
  np.testing.assert_allclose(gray[..., 0], luma, atol=1)
  assert (gray[..., 0] == gray[..., 1]).all() and (gray[..., 1] == gray[..., 2]).all()
  np.testing.assert_array_equal(augment.solarize(image),
                                np.where(image >= 128, 255 - image, image))
  flat = np.full((9, 9, 3), 77, np.uint8)
  np.testing.assert_array_equal(augment.gaussian_blur(flat, 1.5), flat)
  assert augment.gaussian_blur(image, 2.0).astype(float).std() < image.astype(float).std()


def test_three_augment_picks_each_of_the_three():
  image = _photo(16, 16)
  picks = []
  for seed in range(60):
    out = augment.three_augment(image, np.random.default_rng(seed), jitter=0.0)
    rng = np.random.default_rng(seed)
    k = int(rng.integers(0, 3))
    if k == 0:
      expected = augment.grayscale(image)
    elif k == 1:
      expected = augment.solarize(image)
    else:
      sigma = rng.uniform(0.1, 2.0)
      expected = np.asarray(Image.fromarray(image).filter(ImageFilter.GaussianBlur(sigma)))
    np.testing.assert_array_equal(out, expected)
    picks.append(k)
  counts = np.bincount(picks, minlength=3)
  assert counts.min() >= 10, counts  # Uniform: 20 each on average.
  # With jitter the result differs from the plain pick.
  jittered = augment.three_augment(image, np.random.default_rng(0), jitter=0.3)
  assert not np.array_equal(jittered, augment.three_augment(image, np.random.default_rng(0),
                                                            jitter=0.0))


def test_rand_augment_applies_n_ops_drawn_uniformly(monkeypatch):
  calls = []
  for name in augment.RAND_AUGMENT_NAMES:
    monkeypatch.setitem(augment.RAND_AUGMENT_OPS, name,
                        lambda im, f, rng, name=name: calls.append((name, f)) or im)
  image = _photo()
  for n in (0, 1, 2, 5):
    calls.clear()
    augment.rand_augment(image, np.random.default_rng(n), n, 9, prob=1.0)
    want = np.random.default_rng(n).integers(0, 15, n)
    assert calls == [(augment.RAND_AUGMENT_NAMES[i], 0.9) for i in want]
  calls.clear()
  out = augment.rand_augment(image, np.random.default_rng(0), 4, 9, prob=0.0)
  assert calls == []
  np.testing.assert_array_equal(out, image)
  calls.clear()
  for seed in range(200):
    augment.rand_augment(image, np.random.default_rng(seed), 2, 9)  # prob 0.5 per op.
  assert 160 <= len(calls) <= 240  # 200 expected.
  assert len({name for name, _ in calls}) == 15


def _rand_op(name, image, magnitude, seed=0):
  return augment.RAND_AUGMENT_OPS[name](image, magnitude / 10, np.random.default_rng(seed))


def test_rand_augment_magnitudes_m9():
  image = _photo()
  x = image.astype(int)
  np.testing.assert_array_equal(_rand_op("invert", image, 9), 255 - x)
  np.testing.assert_array_equal(_rand_op("solarize", image, 9), np.where(x >= 230, 255 - x, x))
  np.testing.assert_array_equal(_rand_op("posterize", image, 9), x & 0b11100000)  # 3 bits.
  np.testing.assert_array_equal(_rand_op("solarize_add", image, 9),
                                np.where(x < 128, np.minimum(x + 99, 255), x))
  grey = np.full((4, 4, 3), 100, np.uint8)
  np.testing.assert_allclose(_rand_op("brightness", grey, 9), 172, atol=1)  # 0.1 + 1.8 * 0.9.
  np.testing.assert_array_equal(_rand_op("color", grey, 9), grey)  # Grey has no saturation.


def test_rand_augment_translate_moves_by_045_of_the_side():
  image = _photo(10, 20)
  for seed in range(6):
    out = _rand_op("translate_x", image, 10, seed).astype(int)
    positive = np.random.default_rng(seed).random() >= 0.5  # The sign draw.
    shift = 9  # 0.45 * 20 pixels.
    if positive:  # Output column c shows input column c + 9.
      np.testing.assert_array_equal(out[:, :20 - shift], image[:, shift:])
      np.testing.assert_array_equal(out[:, 20 - shift:], np.broadcast_to(augment.FILL,
                                                                          (10, shift, 3)))
    else:
      np.testing.assert_array_equal(out[:, shift:], image[:, :20 - shift])
  np.testing.assert_array_equal(_rand_op("translate_y", image, 0), image)
  np.testing.assert_array_equal(_rand_op("rotate", image, 0), image)


def test_simple_random_crop_is_a_reflect_padded_crop():
  image = _photo(16, 24)  # Shorter side already 16: no resampling.
  padded = np.pad(image, ((4, 4), (4, 4), (0, 0)), mode="reflect")
  tops = set()
  for seed in range(30):
    out = augment.simple_random_crop(image, np.random.default_rng(seed), 16)
    rng = np.random.default_rng(seed)
    top, left = rng.integers(0, 9), rng.integers(0, 17)  # 16+8-16, 24+8-16.
    np.testing.assert_array_equal(out, padded[top:top + 16, left:left + 16])
    tops.add(int(top))
  assert min(tops) < 4 and max(tops) > 4  # Both padding and the image's own rows show.
  big = augment.simple_random_crop(_photo(40, 30), np.random.default_rng(0), 16, pad=0)
  assert big.shape == (16, 16, 3)  # Resized to 21 x 16 first, then cropped.


# ------------------------------------------------------------------------------------------
# Decoding from bytes: JPEGs downscaled in the decoder where the op's output allows.


def _blobby_photo(h, w, seed=0) -> np.ndarray:
  """Smooth colour gradients plus blurred blobs: JPEG-friendly, with some detail."""
  rng = np.random.default_rng(seed)
  y, x = np.mgrid[0:h, 0:w].astype(np.float32)
  image = rng.uniform(60, 190, 3) + (x[..., None] / w) * rng.uniform(-60, 60, 3) + (
      y[..., None] / h) * rng.uniform(-60, 60, 3)
  for _ in range(6):
    cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(0.05, 0.2) * min(h, w)
    image += np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2 * r * r))[..., None] * rng.uniform(
        -50, 50, 3)
  return np.clip(image, 0, 255).astype(np.uint8)


def _encode(array: np.ndarray, fmt: str = "JPEG", mode: str = "RGB") -> bytes:
  buf = io.BytesIO()
  Image.fromarray(array).convert(mode).save(buf, format=fmt, quality=95)
  return buf.getvalue()


@pytest.mark.parametrize("size,min_side,expected", [
    ((1024, 768), 224, (512, 384)),  # 768 // 224 = 3 -> factor 2.
    ((2000, 1800), 224, (250, 225)),  # 1800 // 224 = 8 -> factor 8.
    ((1024, 768), 400, (1024, 768)),  # 768 // 400 = 1: full size.
    ((300, 200), 64, (150, 100)),  # min(300 // 64, 200 // 64) = 3 -> factor 2.
])
def test_decode_scale_keeps_both_sides_above_the_minimum(size, min_side, expected):
  w, h = size
  image = decoding.decode(decoding.open_image(_encode(_blobby_photo(h, w))), min_side, min_side)
  assert image.size == expected and image.mode == "RGB"
  assert min(image.size) >= min_side


def test_reduced_decode_matches_full_decode_and_downscale():
  array = _blobby_photo(768, 1024)
  data = _encode(array)
  reduced = np.asarray(decoding.decode(decoding.open_image(data), 224, 224)).astype(float)
  full = Image.open(io.BytesIO(data)).convert("RGB")
  box_2x = np.asarray(full.reduce(2)).astype(float)  # 2x2 means of the full decode.
  assert reduced.shape == box_2x.shape == (384, 512, 3)
  assert np.abs(reduced - box_2x).mean() < 2.0


@pytest.mark.parametrize("op", ["squish", "center_crop", "resize_crop", "simple_random_crop",
                                "inception_crop", "inception_crop(0.6, 1)"])
def test_ops_on_undecoded_jpegs_match_ops_on_decoded_ones(op):
  """Same generator draws (the next draw agrees) and nearly the same pixels, big or small."""
  for h, w in ((900, 1200), (150, 130)):
    data = _encode(_blobby_photo(h, w, seed=h))
    for seed in range(3):
      rng_a, rng_b = np.random.default_rng(seed), np.random.default_rng(seed)
      lazy = augment_spec.apply_train_ops(decoding.open_image(data), (op,), rng_a, 112) if (
          op not in augment_spec.EVAL_RESIZES) else augment_spec.EVAL_RESIZES[op](
              decoding.open_image(data), 112)
      decoded = Image.open(io.BytesIO(data)).convert("RGB")
      eager = augment_spec.apply_train_ops(decoded, (op,), rng_b, 112) if (
          op not in augment_spec.EVAL_RESIZES) else augment_spec.EVAL_RESIZES[op](decoded, 112)
      lazy, eager = np.asarray(lazy), np.asarray(eager)
      assert lazy.shape == eager.shape == (112, 112, 3) and lazy.dtype == np.uint8
      assert rng_a.random() == rng_b.random()
      assert np.abs(lazy.astype(float) - eager.astype(float)).mean() < 3.0, (op, h, seed)


def test_undecoded_png_grayscale_cmyk_and_corrupt_bytes():
  array = _blobby_photo(40, 50)
  png = decoding.decode(decoding.open_image(_encode(array, "PNG")), 8, 8)
  np.testing.assert_array_equal(np.asarray(png), array)  # Never downscaled: not a JPEG.
  gray = augment.squish(decoding.open_image(_encode(_blobby_photo(600, 600), mode="L")), 64)
  assert gray.mode == "RGB" and gray.size == (64, 64)
  g = np.asarray(gray)
  np.testing.assert_array_equal(g[..., 0], g[..., 2])
  cmyk = decoding.decode(decoding.open_image(_encode(_blobby_photo(600, 800), mode="CMYK")),
                        200, 200)
  assert cmyk.mode == "RGB" and cmyk.size == (400, 300)  # Downscaled by 2 and converted.
  with pytest.raises(decoding.CorruptImageError, match="UnidentifiedImageError"):
    decoding.open_image(b"not an image at all")
  truncated = decoding.open_image(_encode(_blobby_photo(600, 800))[:3000])  # The header survives.
  with pytest.raises(decoding.CorruptImageError, match="truncated"):
    augment.squish(truncated, 64)
  assert issubclass(decoding.CorruptImageError, ValueError)


def test_no_train_ops_still_decode_to_rgb_and_report_corrupt_bytes():
  rng = np.random.default_rng(0)
  grey = decoding.open_image(_encode(_blobby_photo(16, 16), mode="L"))
  out = augment_spec.apply_train_ops(grey, (), rng, 16)
  assert out.shape == (16, 16, 3) and out.dtype == np.uint8
  truncated = decoding.open_image(_encode(_blobby_photo(600, 800))[:3000])
  with pytest.raises(decoding.CorruptImageError, match="truncated"):
    augment_spec.apply_train_ops(truncated, (), rng, 16)


@pytest.mark.parametrize("fmt,mode", [("WEBP", "RGBA"), ("ICO", "L")])
def test_images_pil_decodes_on_open_come_out_rgb(fmt, mode):
  # PIL decodes WebP and ICO while opening them, in their own modes.
  array = _blobby_photo(32, 32)
  source = Image.fromarray(array).convert(mode)
  buffer = io.BytesIO()
  source.save(buffer, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
  image = decoding.open_image(buffer.getvalue())
  out = decoding.decode(image)
  assert out.mode == "RGB" and out.size == (32, 32)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(source.convert("RGB")))
  assert augment.squish(decoding.open_image(buffer.getvalue()), 16).mode == "RGB"


# ------------------------------------------------------------------------------------------
# The OpenCV / lookup-table ops against the PIL operations they replace (the implementation
# the pipeline used before; PIL stays the reference).

_BILINEAR = Image.Resampling.BILINEAR


def _pil_affine(image, matrix):
  return image.transform(image.size, Image.Transform.AFFINE, matrix, resample=_BILINEAR,
                         fillcolor=augment.FILL)


def _pil_enhance(enhancer):
  return lambda image, f, sign: enhancer(image).enhance(0.1 + 1.8 * f)


def _signed(value, sign):
  return -value if sign else value


def _pil_posterize(image, bits):
  """PIL's posterize; 0 bits (timm's increasing form at magnitude 10) keeps none: black, as
  Pillow computed it before 13, which refuses bits < 1."""
  return ImageOps.posterize(image, bits) if bits >= 1 else Image.new(image.mode, image.size)


# name -> op(PIL image, f, negative sign?) as PIL computes it.
_PIL_RAND_OPS = {
    "auto_contrast": lambda image, f, sign: ImageOps.autocontrast(image),
    "equalize": lambda image, f, sign: ImageOps.equalize(image),
    "invert": lambda image, f, sign: ImageOps.invert(image),
    "rotate": lambda image, f, sign: image.rotate(_signed(30 * f, sign), resample=_BILINEAR,
                                                  fillcolor=augment.FILL),
    "posterize": lambda image, f, sign: _pil_posterize(image, int(4 * f)),
    "solarize": lambda image, f, sign: ImageOps.solarize(image, int(256 * f)),
    "solarize_add": lambda image, f, sign: image.point(
        [min(255, v + int(110 * f)) if v < 128 else v for v in range(256)] * 3),
    "color": _pil_enhance(ImageEnhance.Color),
    "contrast": _pil_enhance(ImageEnhance.Contrast),
    "brightness": _pil_enhance(ImageEnhance.Brightness),
    "sharpness": _pil_enhance(ImageEnhance.Sharpness),
    "shear_x": lambda image, f, sign: _pil_affine(image, (1, _signed(0.3 * f, sign), 0, 0, 1, 0)),
    "shear_y": lambda image, f, sign: _pil_affine(image, (1, 0, 0, _signed(0.3 * f, sign), 1, 0)),
    "translate_x": lambda image, f, sign: _pil_affine(
        image, (1, 0, _signed(0.45 * f * image.width, sign), 0, 1, 0)),
    "translate_y": lambda image, f, sign: _pil_affine(
        image, (1, 0, 0, 0, 1, _signed(0.45 * f * image.height, sign))),
}

# Largest difference in grey levels from PIL. Lookup-table ops apply PIL's own integer rule:
# exact. Interpolating and blending ops differ by rounding only: OpenCV rounds fixed-point
# interpolation weights and blends where PIL truncates a double (1 level). Color's grey
# image comes from OpenCV's 14-bit luma weights, 1 level off PIL's 16-bit ones at times,
# which the extrapolating blend (factor up to 1.9) carries into the result (2 levels).
_RAND_OP_TOLERANCE = {"rotate": 1, "shear_x": 1, "shear_y": 1, "translate_x": 1,
                      "translate_y": 1, "sharpness": 1, "color": 2}


def _edgy_photo(h, w, seed):
  """Gradients, noise and hard-edged blocks: interpolation and histogram ops see both."""
  image = _photo(h, w, seed).astype(int)
  rng = np.random.default_rng(seed)
  for _ in range(3):
    top, left = rng.integers(0, h - 4), rng.integers(0, w - 4)
    image[top:top + h // 3, left:left + w // 3] = rng.integers(0, 256, 3)
  return image.astype(np.uint8)


@pytest.mark.parametrize("name", augment.RAND_AUGMENT_NAMES)
def test_rand_augment_ops_match_pil(name):
  tolerance = _RAND_OP_TOLERANCE.get(name, 0)
  for seed, (h, w) in enumerate([(37, 53), (64, 48)]):
    image = _edgy_photo(h, w, seed)
    for magnitude in (3, 9, 10):
      for sign_seed in (0, 1):  # default_rng(0).random() < 0.5 is False, (1) is True.
        got = _rand_op(name, image, magnitude, sign_seed)
        sign = np.random.default_rng(sign_seed).random() < 0.5
        want = np.asarray(_PIL_RAND_OPS[name](Image.fromarray(image), magnitude / 10, sign))
        assert got.shape == want.shape and got.dtype == np.uint8
        diff = np.abs(got.astype(int) - want)
        assert diff.max() <= tolerance, (name, magnitude, sign, diff.max())
        assert diff.mean() <= 0.6, (name, magnitude, sign, diff.mean())


# timm's increasing ('inc1') forms as PIL computes them (timm auto_augment.py:
# _posterize_increasing_level 4 - int(4f), _solarize_increasing_level 256 - int(256f),
# _enhance_increasing_level max(0.1, 1 +- 0.9f)).
def _pil_enhance_increasing(enhancer):
  return lambda image, f, sign: enhancer(image).enhance(max(0.1, 1 + _signed(0.9 * f, sign)))


_PIL_INCREASING_OPS = {
    "posterize": lambda image, f, sign: _pil_posterize(image, 4 - int(4 * f)),
    "solarize": lambda image, f, sign: ImageOps.solarize(image, 256 - int(256 * f)),
    "color": _pil_enhance_increasing(ImageEnhance.Color),
    "contrast": _pil_enhance_increasing(ImageEnhance.Contrast),
    "brightness": _pil_enhance_increasing(ImageEnhance.Brightness),
    "sharpness": _pil_enhance_increasing(ImageEnhance.Sharpness),
}


@pytest.mark.parametrize("name", sorted(_PIL_INCREASING_OPS))
def test_increasing_rand_augment_ops_match_pil(name):
  image = _edgy_photo(37, 53, 0)
  for magnitude in (3, 9, 10):
    for sign_seed in (0, 1):
      got = augment.RAND_AUGMENT_INCREASING_OPS[name](image, magnitude / 10,
                                                       np.random.default_rng(sign_seed))
      sign = np.random.default_rng(sign_seed).random() < 0.5
      want = np.asarray(_PIL_INCREASING_OPS[name](Image.fromarray(image), magnitude / 10, sign))
      diff = np.abs(got.astype(int) - want)
      assert diff.max() <= _RAND_OP_TOLERANCE.get(name, 0), (name, magnitude, sign, diff.max())
  # The other nine ops are the plain ones; the spec's fourth argument selects the variant.
  assert {k for k, op in augment.RAND_AUGMENT_INCREASING_OPS.items()
          if op is not augment.RAND_AUGMENT_OPS[k]} == set(_PIL_INCREASING_OPS)


def test_geometric_ops_fill_exactly_where_pil_fills():
  """Samples outside the image get FILL, inside ones interpolate edge pixels (PIL's rule),
  also on the 1-pixel band where OpenCV's own borders would mix the two."""
  image = np.full((30, 40, 3), (250, 5, 250), np.uint8)  # Far from FILL in every channel.
  for name, magnitude in (("rotate", 9), ("shear_x", 7), ("shear_y", 10), ("translate_x", 3),
                          ("translate_y", 5)):
    for sign_seed in (0, 1):
      got = _rand_op(name, image, magnitude, sign_seed)
      sign = np.random.default_rng(sign_seed).random() < 0.5
      want = np.asarray(_PIL_RAND_OPS[name](Image.fromarray(image), magnitude / 10, sign))
      filled = np.all(want == augment.FILL, -1)
      assert 0 < filled.sum() < filled.size
      np.testing.assert_array_equal(np.all(got == augment.FILL, -1), filled)
      np.testing.assert_array_equal(got[~filled], want[~filled])


# (input image (h, w), output side): every box of the first is downscaled, of the second upscaled.
_CROP_SIZES = {"down": ((200, 260), 24), "up": ((40, 60), 48)}


def _crop_cases(direction: str):
  """(image kind, seed, uint8 input array, inception_crop's box as (top, left, h, w), output
  side) for PIL, array and undecoded (PNG) inputs, the box drawn as inception_crop draws it."""
  (h, w), size = _CROP_SIZES[direction]
  for seed in range(6):
    array = _edgy_photo(h, w, seed)
    box = augment.inception_crop_box(h, w, np.random.default_rng(seed))
    for kind in ("pil", "array", "undecoded"):
      yield kind, seed, array, box, size


def _crop_input(kind: str, array: np.ndarray):
  if kind == "pil":
    return Image.fromarray(array)
  return array if kind == "array" else decoding.open_image(_encode(array, "PNG"))


# Train op name -> its resampling filter.
_CROP_OPS = {"inception_crop": augment.RESAMPLE, "inception_crop_bicubic": augment.BICUBIC}


def _assert_crop_then_resize(name, direction, reference):
  """The train op `name` equals `reference(pil_image, box, size, resample)` (a crop of the
  box, then a resize) within one level on the bilinear upscale (OpenCV's rounding), exactly
  elsewhere, the edge rows and columns included."""
  op, resample = augment_spec.TRAIN_OPS.get(name)(name), _CROP_OPS[name]
  tolerance = 1 if (direction, resample) == ("up", augment.RESAMPLE) else 0
  for kind, seed, array, (top, left, ch, cw), size in _crop_cases(direction):
    got = op(_crop_input(kind, array), np.random.default_rng(seed), size)
    want = np.asarray(reference(Image.fromarray(array), (top, left, ch, cw), size, resample))
    assert (ch <= size and cw <= size) == (direction == "up")
    diff = np.abs(np.asarray(got).astype(int) - want)
    assert diff.max() <= tolerance, (kind, seed, diff.max(), diff[[0, -1]].max())


@pytest.mark.parametrize("direction", ["down", "up"])
@pytest.mark.parametrize("name", _CROP_OPS)
def test_inception_crop_crops_the_box_then_resizes(name, direction):
  """torchvision's and timm's RandomResizedCrop on a PIL image: PIL's crop of the box, then
  PIL's resize of the crop alone; pixels outside the box never reach the edge rows."""
  def reference(image, box, size, resample):
    top, left, ch, cw = box
    return image.crop((left, top, left + cw, top + ch)).resize((size, size), resample)
  _assert_crop_then_resize(name, direction, reference)


@pytest.mark.interop
@pytest.mark.parametrize("direction", ["down", "up"])
@pytest.mark.parametrize("name", _CROP_OPS)
def test_inception_crop_matches_torchvision_resized_crop(name, direction):
  """torchvision's RandomResizedCrop (bilinear) and timm's / DeiT's
  RandomResizedCropAndInterpolation('bicubic') both apply F.resized_crop to the box."""
  functional = pytest.importorskip(
      "torchvision.transforms.v2.functional",
      reason="needs the interop extra (torchvision): pip install -e '.[interop]'")
  modes = pytest.importorskip("torchvision.transforms").InterpolationMode
  mode = {augment.RESAMPLE: modes.BILINEAR, augment.BICUBIC: modes.BICUBIC}[_CROP_OPS[name]]
  reference = lambda image, box, size, _: functional.resized_crop(image, *box, [size, size],
                                                                  mode)
  _assert_crop_then_resize(name, direction, reference)


def test_inception_crop_at_reduced_decode_scale_ignores_pixels_outside_the_box(monkeypatch):
  """A JPEG decoded at 1/2, 1/4 or 1/8 scale gives the box fractional edges: the op resizes
  the fractional box within the decoded image cut to the box rounded outward, so decoded
  pixels wholly outside the box (here painted white) change no output pixel."""
  size = 112  # Every box of a 900 x 1200 image keeps >= 2 x 112 pixels a side: a reduced decode.
  data = _encode(_edgy_photo(900, 1200, 5))
  decode_scaled = decoding.decode_scaled
  for seed in range(8):
    top, left, ch, cw = augment.inception_crop_box(900, 1200, np.random.default_rng(seed))
    decoded, factor = decode_scaled(decoding.open_image(data), min(ch, cw) // size)
    assert factor > 1
    x0, y0 = left // factor, top // factor  # The box rounded outward at the decoded scale.
    x1, y1 = math.ceil((left + cw) / factor), math.ceil((top + ch) / factor)
    painted = np.full_like(np.asarray(decoded), 255)
    painted[y0:y1, x0:x1] = np.asarray(decoded)[y0:y1, x0:x1]
    crop = lambda: np.asarray(augment.inception_crop(decoding.open_image(data),
                                                     np.random.default_rng(seed), size))
    want = crop()
    with monkeypatch.context() as patch:
      patch.setattr(decoding, "decode_scaled",
                    lambda image, max_factor: (Image.fromarray(painted), factor))
      np.testing.assert_array_equal(crop(), want)


def _pil_train_chain(data: bytes, seed: int, size: int):
  """'inception_crop|flip|randaugment(2, 9)' as the PIL implementation computes it, with the
  same draws in the same order; returns (pixels, the generator afterwards)."""
  rng = np.random.default_rng(seed)
  image = Image.open(io.BytesIO(data))
  top, left, ch, cw = augment.inception_crop_box(image.height, image.width, rng)
  box = (left, top, left + cw, top + ch)
  wanted = min(cw, ch) // size
  if wanted >= 2:  # PIL's reduced-scale JPEG decode, as decoding.decode_scaled asks for it.
    factor = next(f for f in (8, 4, 2) if f <= wanted)
    width = image.width
    image.draft("RGB", (width // factor, image.height // factor))
    factor = width / image.size[0]
    box = tuple(min(v / factor, limit) for v, limit in zip(box, image.size * 2))
  # The decoded image cut to the box rounded outward, the box resized within the cut.
  outer = tuple(int(np.floor(v)) for v in box[:2]) + tuple(int(np.ceil(v)) for v in box[2:])
  inner = tuple(v - outer[i % 2] for i, v in enumerate(box))
  out = image.convert("RGB").crop(outer).resize((size, size), _BILINEAR, box=inner)
  if rng.random() < 0.5:
    out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
  for i in rng.integers(0, 15, 2):
    if rng.random() < 0.5:
      name = augment.RAND_AUGMENT_NAMES[i]
      sign = rng.random() < 0.5 if name in ("rotate", "shear_x", "shear_y", "translate_x",
                                             "translate_y") else False
      out = _PIL_RAND_OPS[name](out, 0.9, sign)
  return np.asarray(out), rng


@pytest.mark.parametrize("h,w", [(300, 400), (600, 520)])
def test_train_chain_matches_the_pil_path(h, w):
  """The whole default train chain from JPEG bytes: the same crops and op draws (the
  generators end in the same state), pixels within rounding of the PIL path."""
  ops = augment_spec.parse_train_ops("inception_crop|flip|randaugment(2, 9)")
  data = _encode(_edgy_photo(h, w, 7))
  worst = 0.0
  for seed in range(12):
    rng = np.random.default_rng(seed)
    got = augment_spec.apply_train_ops(decoding.open_image(data), ops, rng, 112)
    want, want_rng = _pil_train_chain(data, seed, 112)
    assert got.shape == want.shape == (112, 112, 3) and got.dtype == np.uint8
    assert rng.random() == want_rng.random(), seed
    diff = np.abs(got.astype(int) - want)
    worst = max(worst, diff.mean())
    # A level that rounding moved can cross a step of a later posterize, solarize or
    # equalize (e.g. rotate then posterize(3 bits): 1 in 32 such pixels jumps 32 levels).
    assert (diff > 2).mean() < 0.03, (seed, (diff > 2).mean())
  assert worst < 0.6, worst
