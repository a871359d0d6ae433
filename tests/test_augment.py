"""Tests for input_pipeline/augment.py: crops, flips, resizes and normalisation."""
import numpy as np
import pytest

from input_pipeline import augment


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


def test_normalize_unknown_preset():
  with pytest.raises(ValueError, match="'zscore'"):
    augment.normalize(np.zeros((1, 1, 3), np.uint8), "zscore")


def test_parse_and_apply_train_ops():
  assert augment.parse_train_ops("inception_crop|flip") == ("inception_crop", "flip")
  assert augment.parse_train_ops(" squish | flip |") == ("squish", "flip")
  assert augment.parse_train_ops("") == ()
  with pytest.raises(ValueError, match="'rotate'"):
    augment.parse_train_ops("squish|rotate")
  image = _noise(6, 9)
  out = augment.apply_train_ops(image, ("squish", "flip"), np.random.default_rng(1), 4)
  rng = np.random.default_rng(1)
  expected = augment.squish(image, 4)
  np.testing.assert_array_equal(out, expected[:, ::-1] if rng.random() < 0.5 else expected)


def test_ops_reject_non_uint8_images():
  with pytest.raises(ValueError, match="uint8"):
    augment.squish(np.zeros((4, 4, 3), np.float32), 2)
  with pytest.raises(ValueError, match="uint8"):
    augment.squish(np.zeros((4, 4), np.uint8), 2)
