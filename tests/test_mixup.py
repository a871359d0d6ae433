"""Tests for bigpretrain/mixup.py: on-device mixup/cutmix with timm's batch-level semantics."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bigpretrain import mixup


def _const_images(b, h, w, dtype=np.float32):
  """Image i is filled with i + 1 (so pasted or blended pixels are recognisable)."""
  return np.broadcast_to(np.arange(1, b + 1, dtype=dtype)[:, None, None, None],
                         (b, h, w, 3)).copy()


_jit_mix = jax.jit(mixup.mix_batch, static_argnames=(
    "mixup_alpha", "cutmix_alpha", "switch_prob", "label_smoothing"))


def _one_hot(labels, num_classes):
  return jax.nn.one_hot(jnp.asarray(labels), num_classes, dtype=jnp.float32)


def _mix(key, images, labels, num_classes=10, **kw):
  return _jit_mix(jax.random.key(key), jnp.asarray(images), _one_hot(labels, num_classes), **kw)


def _lam(targets, labels):
  """lam = weight of each example's own label (labels distinct, no smoothing)."""
  return float(targets[0, labels[0]])


def test_defaults():
  cfg = mixup.mixup_defaults()
  assert cfg.to_dict() == dict(mixup_alpha=0.0, cutmix_alpha=0.0, switch_prob=0.5,
                               label_smoothing=0.0)


def test_off_returns_images_and_smoothed_one_hot():
  images = np.random.default_rng(0).random((3, 4, 4, 3), np.float32)
  labels = np.array([0, 4, 2])
  out, targets = _mix(0, images, labels, num_classes=5, mixup_alpha=0.0, cutmix_alpha=0.0,
                      label_smoothing=0.1)
  np.testing.assert_array_equal(out, images)
  expected = np.full((3, 5), 0.1 / 5, np.float32)
  expected[np.arange(3), labels] = 0.9 + 0.1 / 5
  np.testing.assert_allclose(targets, expected, rtol=1e-6)
  assert targets.dtype == jnp.float32


def test_mixup_blends_with_the_flipped_batch():
  rng = np.random.default_rng(1)
  images = rng.random((5, 3, 4, 3), np.float32)  # Odd batch: the middle row pairs with itself.
  labels = np.array([3, 1, 4, 0, 2])
  for key in range(4):
    out, targets = _mix(key, images, labels, num_classes=6, mixup_alpha=0.8, cutmix_alpha=0.0)
    lam = _lam(targets, labels)
    assert 0 <= lam <= 1
    np.testing.assert_allclose(out, lam * images + (1 - lam) * images[::-1], atol=1e-6)
    expected = np.zeros((5, 6), np.float32)
    expected[np.arange(5), labels] += lam
    expected[np.arange(5), labels[::-1]] += 1 - lam
    np.testing.assert_allclose(targets, expected, atol=1e-6)
    np.testing.assert_allclose(np.sum(targets, axis=1), 1, atol=1e-6)
    assert targets[2, labels[2]] == pytest.approx(1.0)


@pytest.mark.parametrize("h,w", [(8, 8), (6, 10)])
def test_cutmix_lambda_is_the_unpasted_area(h, w):
  b = 4
  images = _const_images(b, h, w)
  labels = np.array([7, 2, 5, 0])
  partial = 0
  for key in range(30):
    out, targets = _mix(key, images, labels, cutmix_alpha=1.0, mixup_alpha=0.0)
    out = np.asarray(out)
    pasted = out != images  # Pixel came from the partner image.
    # One box for the whole batch, the same in every channel.
    for i in range(b):
      np.testing.assert_array_equal(pasted[i], pasted[0])
      np.testing.assert_array_equal(out[i][pasted[i]], b - i)  # Partner i' = b-1-i holds b-i.
      np.testing.assert_array_equal(out[i][~pasted[i]], i + 1)
    box = pasted[0, :, :, 0]
    rows, cols = np.nonzero(box)
    area = int(box.sum())
    if area:  # A solid rectangle.
      assert area == (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
    lam = 1 - area / (h * w)
    expected = np.zeros((b, 10), np.float32)
    expected[np.arange(b), labels] += lam
    expected[np.arange(b), labels[::-1]] += 1 - lam
    np.testing.assert_allclose(targets, expected, atol=1e-6)
    partial += 0 < area < h * w
  assert partial >= 10


def test_cutmix_box_sides_follow_lambda():
  # lam = 0.75: sqrt(1 - lam) = 0.5, so a 4 x 5 box on 8 x 10 before clipping to the image;
  # rows [cy - 2, cy + 2), columns [cx - 2, cx + 2) (timm halves the side with //).
  heights, widths = set(), set()
  for key in range(60):
    top, bottom, left, right = map(int, mixup.cutmix_box(jax.random.key(key), 8, 10,
                                                         jnp.float32(0.75)))
    assert any((max(cy - 2, 0), min(cy + 2, 8)) == (top, bottom) for cy in range(8))
    assert any((max(cx - 2, 0), min(cx + 2, 10)) == (left, right) for cx in range(10))
    heights.add(bottom - top)
    widths.add(right - left)
  assert max(heights) == 4 and max(widths) == 4 and min(heights) == 2


def test_switch_prob_picks_cutmix_or_mixup():
  images = _const_images(4, 5, 5)
  labels = np.arange(4)

  def is_cutmix(out):
    out = np.asarray(out)
    return bool(np.all((out == images) | (out == images[::-1])))

  for key in range(6):
    assert is_cutmix(_mix(key, images, labels, mixup_alpha=1.0, cutmix_alpha=1.0,
                          switch_prob=1.0)[0])
    assert not is_cutmix(_mix(key, images, labels, mixup_alpha=1.0, cutmix_alpha=1.0,
                              switch_prob=0.0)[0])
  mix = jax.jit(jax.vmap(functools.partial(
      mixup.mix_batch, images=jnp.asarray(images), targets=_one_hot(labels, 4),
      mixup_alpha=1.0, cutmix_alpha=1.0, switch_prob=0.3)))
  outs, _ = mix(jax.random.split(jax.random.key(0), 400))
  share = np.mean([is_cutmix(o) for o in outs])
  assert 0.22 < share < 0.38  # 0.3 +- 3.5 sigma for 400 draws.


def test_mixup_lambda_is_beta_distributed():
  alpha = 0.4
  labels = jnp.arange(2)
  mix = jax.jit(jax.vmap(lambda k: mixup.mix_batch(
      k, jnp.zeros((2, 1, 1, 3)), _one_hot(labels, 2), mixup_alpha=alpha,
      cutmix_alpha=0.0)[1][0, 0]))
  lam = np.asarray(mix(jax.random.split(jax.random.key(3), 4000)))
  assert lam.min() >= 0 and lam.max() <= 1
  # Beta(a, a): mean 1/2, variance 1 / (4 (2a + 1)).
  assert abs(lam.mean() - 0.5) < 0.03
  assert abs(lam.var() - 1 / (4 * (2 * alpha + 1))) < 0.015


def test_label_smoothing_applies_to_both_one_hots():
  s, c = 0.2, 8
  images = np.random.default_rng(2).random((4, 4, 4, 3), np.float32)
  labels = np.array([1, 6, 3, 0])
  _, targets = _mix(5, images, labels, num_classes=c, mixup_alpha=1.0, cutmix_alpha=1.0,
                    label_smoothing=s)
  targets = np.asarray(targets, np.float64)
  lam = (targets[0, labels[0]] - s / c) / (1 - s)
  smooth = lambda y: np.eye(c)[y] * (1 - s) + s / c
  np.testing.assert_allclose(targets, lam * smooth(labels) + (1 - lam) * smooth(labels[::-1]),
                             atol=1e-6)
  np.testing.assert_allclose(targets.sum(1), 1, atol=1e-6)
  assert targets.min() >= s / c - 1e-7


def test_jit_on_a_sharded_batch_matches_eager_and_keeps_dtype():
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  n = len(jax.devices())
  images = jnp.asarray(np.random.default_rng(4).random((n, 6, 6, 3)), jnp.bfloat16)
  targets = _one_hot(jnp.arange(n) % 3, 3)
  kw = dict(mixup_alpha=0.5, cutmix_alpha=1.0, label_smoothing=0.1)
  fn = jax.jit(functools.partial(mixup.mix_batch, **kw))
  for key in range(4):
    rng = jax.random.key(key)
    want_images, want_targets = mixup.mix_batch(rng, images, targets, **kw)
    got_images, got_targets = fn(rng, jax.device_put(images, batch),
                                 jax.device_put(targets, batch))
    assert got_images.dtype == jnp.bfloat16 and got_targets.dtype == jnp.float32
    assert got_targets.shape == (n, 3)
    np.testing.assert_array_equal(np.asarray(got_images, np.float32),
                                  np.asarray(want_images, np.float32))
    np.testing.assert_allclose(got_targets, want_targets, atol=1e-6)


@pytest.mark.parametrize("kw,match", [
    (dict(mixup_alpha=-1.0), "mixup_alpha"),
    (dict(cutmix_alpha=float("nan")), "cutmix_alpha"),
    (dict(switch_prob=1.5), "switch_prob"),
    (dict(label_smoothing=1.0), "label_smoothing"),
])
def test_bad_arguments(kw, match):
  args = dict(mixup_alpha=0.2, cutmix_alpha=0.0)
  args.update(kw)
  with pytest.raises(ValueError, match=match):
    mixup.mix_batch(jax.random.key(0), jnp.zeros((2, 2, 2, 3)), jnp.zeros((2, 4)), **args)
  with pytest.raises(ValueError, match="targets"):
    mixup.mix_batch(jax.random.key(0), jnp.zeros((2, 2, 2, 3)), jnp.zeros((3, 4)),
                    mixup_alpha=0.2, cutmix_alpha=0.0)


@pytest.mark.parametrize("kw,match", [
    (dict(mixup_alpha=-0.8), "mixup_alpha"),  # Would turn mixing off unsaid.
    (dict(mixup_alpha=0.8, switch_prob=5.0), "switch_prob"),
    (dict(label_smoothing=0.1), "label_smoothing=0.1 with mixup and cutmix off"),
])
def test_config_values_are_checked_before_the_run(kw, match):
  cfg = mixup.mixup_defaults()
  mixup.check_config(cfg)
  cfg.update(kw)
  with pytest.raises(ValueError, match=match):
    mixup.check_config(cfg)


def test_multi_hot_targets_mix_like_one_hots():
  """Mixed multi-hot targets (multi-label objectives) are lam * y + (1 - lam) * flip(y)."""
  images = np.random.default_rng(7).random((4, 3, 3, 3), np.float32)
  y = np.array([[1, 0, 1, 0], [0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 1]], np.float32)
  for key in range(3):
    out, targets = _jit_mix(jax.random.key(key), jnp.asarray(images), jnp.asarray(y),
                            mixup_alpha=1.0, cutmix_alpha=0.0)
    # Pixel (0, 0, 0) of row 0 is lam * x0 + (1 - lam) * x3: solve for lam.
    x0, x3 = images[0, 0, 0, 0], images[3, 0, 0, 0]
    lam = (float(out[0, 0, 0, 0]) - x3) / (x0 - x3)
    np.testing.assert_allclose(targets, lam * y + (1 - lam) * y[::-1], atol=1e-5)


# ------------------------------------------------------- repeated augmentation: mixing in blocks


def _ra_batch(processes, copies, records):
  """A global batch as pipeline.train_iterator lays it out: process p's rows, then copy c's,
  then record j; record (p, j) has value 1 + p * records + j in every pixel, all copies."""
  ids = np.array([[[p * records + j for j in range(records)] for _ in range(copies)]
                  for p in range(processes)]).reshape(-1)
  return _const_images(processes * records, 4, 6)[ids], ids


@pytest.mark.parametrize("alphas", [dict(mixup_alpha=0.8, cutmix_alpha=0.0),
                                    dict(mixup_alpha=0.0, cutmix_alpha=1.0),
                                    dict(mixup_alpha=0.8, cutmix_alpha=1.0)])
def test_repeated_copies_get_their_own_partner_and_lam(alphas):
  processes, copies, m = 2, 3, 6
  images, ids = _ra_batch(processes, copies, m)
  blocks = processes * copies
  for key in range(3):
    out, targets = jax.jit(functools.partial(mixup.mix_batch, blocks=blocks, copies=copies,
                                             **alphas))(
        jax.random.key(key), jnp.asarray(images), _one_hot(ids, processes * m))
    out, targets = np.asarray(out), np.asarray(targets, np.float64)
    lams, partners = [], np.zeros((processes, copies, m), int)
    for g in range(blocks):
      p, c = divmod(g, copies)
      rows = np.arange(g * m, (g + 1) * m)
      partner = p * m + (m - 1 - np.arange(m) + 2 * c) % m  # Record ids, worked by hand.
      own = ids[rows]
      partners[p, c] = partner
      assert np.all(partner != own)  # m even: nobody mixes with itself.
      lam = targets[rows, own]
      np.testing.assert_allclose(lam, lam[0], atol=1e-6)  # One lam per block.
      np.testing.assert_allclose(targets[rows, partner], 1 - lam, atol=1e-6)
      pixels = out[rows]
      x, x2 = (own + 1)[:, None, None, None], (partner + 1)[:, None, None, None]
      from_own = np.isclose(pixels, x, atol=1e-5)
      from_partner = np.isclose(pixels, x2, atol=1e-5)
      if np.all(from_own | from_partner):  # CutMix: the same box in every row of the block.
        np.testing.assert_array_equal(from_partner, from_partner[:1].repeat(m, 0))
        np.testing.assert_allclose(1 - from_partner[0].mean(), lam[0], atol=1e-6)
      else:  # Mixup.
        np.testing.assert_allclose(pixels, np.broadcast_to(lam[0] * x + (1 - lam[0]) * x2,
                                                           pixels.shape), rtol=1e-5)
      lams.append(lam[0])
    assert len(set(np.round(lams, 6))) > 1  # Not one lam for the batch.
    for p, j in np.ndindex(processes, m):  # Each copy of a record meets another record.
      assert len(set(partners[p, :, j])) == copies


def test_one_block_is_the_flipped_batch():
  images = np.random.default_rng(9).random((6, 3, 3, 3), np.float32)
  labels = np.arange(6)
  kw = dict(mixup_alpha=0.8, cutmix_alpha=1.0)
  one = _mix(4, images, labels, **kw)
  both = jax.jit(functools.partial(mixup.mix_batch, blocks=1, copies=1, **kw))(
      jax.random.key(4), jnp.asarray(images), _one_hot(labels, 10))
  for a, b in zip(one, both):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("blocks,copies", [(4, 1), (3, 2), (2, 3), (0, 1)])
def test_blocks_must_divide_the_batch_and_copies_the_blocks(blocks, copies):
  with pytest.raises(ValueError, match="blocks"):
    mixup.mix_batch(jax.random.key(0), jnp.zeros((6, 2, 2, 3)), jnp.zeros((6, 4)),
                    mixup_alpha=0.2, cutmix_alpha=0.0, blocks=blocks, copies=copies)


def test_mixup_layout_follows_processes_and_copies(caplog):
  import types  # pylint: disable=import-outside-toplevel
  import ml_collections  # pylint: disable=import-outside-toplevel
  from bigpretrain import train  # pylint: disable=import-outside-toplevel

  def mesh(feeders):  # data x fsdp x tensor = len x 1 x 2, the tensor pair on one process.
    devices = [[[types.SimpleNamespace(process_index=p)] * 2] for p in feeders]
    return types.SimpleNamespace(devices=np.array(devices, dtype=object))

  def config(k, cutmix_alpha=1.0):
    return ml_collections.ConfigDict(dict(
        data=dict(repeated_augment=k),
        mixup=dict(mixup_alpha=0.0, cutmix_alpha=cutmix_alpha, switch_prob=0.5,
                   label_smoothing=0.0)))

  assert train.mixup_layout(config(1), mesh([0, 0, 1, 1])) == (1, 1)
  assert train.mixup_layout(config(3, cutmix_alpha=0.0), mesh([0, 1])) == (1, 1)
  caplog.clear()
  assert train.mixup_layout(config(3), mesh([1, 1, 0, 0, 2, 2])) == (9, 3)
  assert "interleaves" not in caplog.text
  assert train.mixup_layout(config(3), mesh([0, 1, 0, 1])) == (6, 3)
  assert "interleaves" in caplog.text
