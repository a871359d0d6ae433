"""Tests for bigpretrain.optim: schedules, masks, LayerDecay and optimizer steps vs numpy."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bigpretrain import optim


def _cfg(**overrides):
  """optim_defaults() with overrides; 'schedule.x' keys go to the schedule section."""
  c = optim.optim_defaults()
  for k, v in overrides.items():
    if k.startswith('schedule.'):
      c.schedule[k.split('.', 1)[1]] = v
    else:
      c[k] = v
  return c


def _sched(total, **overrides):
  _, schedule = optim.make_optimizer(_cfg(**overrides), total_steps=total)
  return lambda s: float(schedule(s))


# ---------------------------------------------------------------- schedules


def test_cosine_with_linear_warmup_matches_formula():
  lr, warm, total, end = 0.1, 10, 110, 0.1
  sched = _sched(total, lr=lr, **{'schedule.name': 'cosine', 'schedule.warmup_steps': warm,
                                  'schedule.end_factor': end})

  def expected(s):
    if s < warm:
      return lr * s / warm
    t = min(s - warm, total - warm) / (total - warm)
    return lr * (end + (1 - end) * 0.5 * (1 + math.cos(math.pi * t)))

  for s in (0, 3, 9, 10, 11, 35, 60, 85, 109, 110, 200):
    assert sched(s) == pytest.approx(expected(s), rel=1e-5, abs=1e-9), s
  assert sched(60) == pytest.approx(lr * (end + (1 - end) * 0.5), rel=1e-5)  # Half-way.
  assert sched(total) == pytest.approx(lr * end, rel=1e-5)


def test_warmup_frac_equals_warmup_steps_and_init_factor():
  by_frac = _sched(200, lr=1.0, **{'schedule.warmup_frac': 0.1})
  by_steps = _sched(200, lr=1.0, **{'schedule.warmup_steps': 20})
  for s in (0, 7, 19, 20, 21, 150):
    assert by_frac(s) == pytest.approx(by_steps(s), rel=1e-6)
  # SWAG-style warmup from lr/10: 0.1 + 0.9 * s / 20.
  from_tenth = _sched(200, lr=1.0, **{'schedule.warmup_steps': 20,
                                      'schedule.warmup_init_factor': 0.1})
  for s in (0, 5, 10, 20):
    assert from_tenth(s) == pytest.approx(0.1 + 0.9 * s / 20, rel=1e-6)


def test_absolute_ends_are_the_factors_of_the_applied_peak_and_never_above_it():
  # timm's --warmup-lr 1e-6 / --min-lr 1e-5 around a peak of 1e-4.
  ends = {'schedule.warmup_steps': 10, 'schedule.warmup_init_lr': 1e-6,
          'schedule.end_lr': 1e-5, 'layer_decay': 0.0}
  sched = _sched(110, lr=1e-4, **ends)
  by_factor = _sched(110, lr=1e-4, **{'schedule.warmup_steps': 10,
                                      'schedule.warmup_init_factor': 1e-2,
                                      'schedule.end_factor': 1e-1})
  for s in (0, 5, 10, 60, 110):
    assert sched(s) == pytest.approx(by_factor(s), rel=1e-5), s
  low = _sched(110, lr=4e-6, **ends)  # The floor is above this peak: held at the peak.
  assert [low(s) for s in (0, 10, 60, 110)] == pytest.approx([1e-6, 4e-6, 4e-6, 4e-6])
  with pytest.raises(ValueError, match=r"schedule.end_factor=0.1: set either end_lr"):
    optim.validate_optim_config(_cfg(**{'schedule.end_lr': 1e-5, 'schedule.end_factor': 0.1}))


def test_constant_schedule():
  sched = _sched(50, lr=0.3, **{'schedule.name': 'constant', 'schedule.warmup_steps': 4})
  assert [sched(s) for s in (0, 2, 4, 30, 49)] == pytest.approx([0, 0.15, 0.3, 0.3, 0.3])


def test_onecycle_formula_and_shape():
  lr, total, pct, div, fdiv = 2.0, 100, 0.2, 25.0, 1e4
  sched = _sched(total, lr=lr, **{'schedule.name': 'onecycle', 'schedule.pct_start': pct,
                                  'schedule.div_factor': div,
                                  'schedule.final_div_factor': fdiv})
  start, peak_step, final = lr / div, 20, lr / (div * fdiv)

  def cos_interp(a, b, frac):
    return a + (b - a) * (1 - math.cos(math.pi * frac)) / 2

  def expected(s):
    if s <= peak_step:
      return cos_interp(start, lr, s / peak_step)
    return cos_interp(lr, final, min(s - peak_step, total - peak_step) / (total - peak_step))

  for s in (0, 5, 10, 20, 21, 40, 60, 99, 100):
    assert sched(s) == pytest.approx(expected(s), rel=1e-4), s
  values = np.array([sched(s) for s in range(total + 1)])
  assert int(np.argmax(values)) == peak_step
  assert np.all(np.diff(values[:peak_step + 1]) > 0)
  assert np.all(np.diff(values[peak_step:]) < 0)
  assert values[0] == pytest.approx(lr / 25) and values[-1] == pytest.approx(lr / 25e4, rel=1e-4)


def test_step_schedule_halves_13_times_evenly():
  lr, total = 0.8, 1400  # 14 equal segments of 100 steps, 13 halvings.
  _, schedule = optim.make_optimizer(_cfg(lr=lr, **{'schedule.name': 'step'}),
                                     total_steps=total)
  values = np.asarray(jax.vmap(schedule)(jnp.arange(total)))
  expected = lr * 0.5 ** np.minimum(np.arange(total) // 100, 13)
  np.testing.assert_allclose(values, expected, rtol=1e-6)
  drops = np.nonzero(np.diff(values) < 0)[0] + 1
  np.testing.assert_array_equal(drops, np.arange(100, 1400, 100))
  assert values[-1] == pytest.approx(lr / 2 ** 13)


def test_step_schedule_after_warmup():
  # Warmup 100 steps, then 1400 steps split into 14 segments: drops at 200, 300, ... 1400.
  sched = _sched(1500, lr=1.0, **{'schedule.name': 'step', 'schedule.warmup_steps': 100})
  assert sched(50) == pytest.approx(0.5)
  assert sched(100) == pytest.approx(1.0) and sched(199) == pytest.approx(1.0)
  assert sched(200) == pytest.approx(0.5) and sched(1399) == pytest.approx(0.5 ** 12)
  assert sched(1400) == pytest.approx(0.5 ** 13) and sched(1499) == pytest.approx(0.5 ** 13)


def test_warmup_longer_than_run_is_an_error():
  with pytest.raises(ValueError, match='optim.schedule.warmup_steps'):
    optim.make_optimizer(_cfg(**{'schedule.warmup_steps': 101}), total_steps=100)


# ---------------------------------------------------------------- masks and LayerDecay


def _vit_params(depth=12, width=4):
  """A ViT-like pure dict (int block keys, as nnx.List gives) of small arrays."""
  ones = lambda *shape: jnp.ones(shape, jnp.float32)
  block = {'norm1': {'scale': ones(width), 'bias': ones(width)},
           'attn': {'qkv': {'kernel': ones(width, 3 * width), 'bias': ones(3 * width)},
                    'proj': {'kernel': ones(width, width), 'bias': ones(width)}},
           'mlp': {'fc1': {'kernel': ones(width, 2 * width), 'bias': ones(2 * width)},
                   'fc2': {'kernel': ones(2 * width, width), 'bias': ones(width)}}}
  return {'patch_embed': {'kernel': ones(2, 2, 3, width), 'bias': ones(width)},
          'cls_token': ones(1, 1, width),
          'pos_embed': ones(1, 5, width),
          'blocks': {i: jax.tree.map(lambda x: x, block) for i in range(depth)},
          'norm': {'scale': ones(width), 'bias': ones(width)},
          'head': {'kernel': ones(width, 10), 'bias': ones(10)}}


def _by_path(tree):
  return {jax.tree_util.keystr(p, simple=True, separator='/'): v
          for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_weight_decay_mask_on_vit_params():
  mask = _by_path(optim.weight_decay_mask(_vit_params(depth=2)))
  decayed = sorted(k for k, v in mask.items() if v)
  assert decayed == ['blocks/0/attn/proj/kernel', 'blocks/0/attn/qkv/kernel',
                     'blocks/0/mlp/fc1/kernel', 'blocks/0/mlp/fc2/kernel',
                     'blocks/1/attn/proj/kernel', 'blocks/1/attn/qkv/kernel',
                     'blocks/1/mlp/fc1/kernel', 'blocks/1/mlp/fc2/kernel',
                     'head/kernel', 'patch_embed/kernel']
  # Custom regexes replace the default list; the ndim <= 1 rule always holds.
  mask = _by_path(optim.weight_decay_mask(_vit_params(depth=1), exclude=('head', r'fc\d')))
  assert mask['pos_embed'] and mask['cls_token'] and not mask['head/kernel']
  assert not mask['blocks/0/mlp/fc1/kernel'] and mask['blocks/0/attn/qkv/kernel']
  assert not mask['blocks/0/attn/qkv/bias']


def _abstract_model(name):
  """The registered model `name` with shapes only (its layer order, no weights)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from bigpretrain import models  # pylint: disable=import-outside-toplevel
  return nnx.eval_shape(lambda: models.get_model(name, num_classes=10, rngs=nnx.Rngs(0)))


def _vit(depth):
  """An abstract ViT whose parameter paths are _vit_params(depth)'s."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from bigpretrain.models import vit  # pylint: disable=import-outside-toplevel
  return nnx.eval_shape(lambda: vit.VisionTransformer(
      num_classes=10, rngs=nnx.Rngs(0), patch_size=2, width=4, depth=depth, num_heads=1,
      mlp_dim=8, image_size=4))


@pytest.mark.parametrize('convention', ['cosub', 'mae'])
def test_layer_decay_multipliers_12_block_vit(convention):
  ld = 0.75
  mult = _by_path(optim.layer_decay_multipliers(_vit_params(depth=12), ld, convention,
                                                layers=_vit(12)))
  # cosub (supplement A.1): block l of L gets LD^(L - l), the final block is not affected;
  # mae (BEiT / MAE): LD^(L + 1 - l), one more factor LD on every layer but the head.
  shift = 0 if convention == 'cosub' else 1
  for path in ('patch_embed/kernel', 'patch_embed/bias', 'cls_token', 'pos_embed'):
    assert mult[path] == pytest.approx(ld ** (12 + shift)), path
  for i in range(12):  # blocks/i is l = i + 1.
    for leaf in ('norm1/scale', 'attn/qkv/kernel', 'mlp/fc2/bias'):
      assert mult[f'blocks/{i}/{leaf}'] == pytest.approx(ld ** (11 - i + shift)), (i, leaf)
  for path in ('norm/scale', 'norm/bias', 'head/kernel', 'head/bias'):
    assert mult[path] == 1.0
  last, first = mult['blocks/11/attn/qkv/kernel'], mult['blocks/0/attn/qkv/kernel']
  if convention == 'cosub':
    assert last == 1.0 and first == pytest.approx(0.75 ** 11)
  else:
    assert last == pytest.approx(0.75) and first == pytest.approx(0.75 ** 12)


# Per family at LD = 0.5, cosub's rule (supplement A.1: every layer but the final block): the
# stem is layer 0 and gets LD^L, block i (counted over all stages) LD^(L - 1 - i), what
# follows the last block 1. (model, L, {path: exponent}), the exponents written out by hand.
_FAMILY_LAYERS = [
    ('vit_demo', 4, {'patch_embed/kernel': 4, 'cls_token': 4, 'pos_embed': 4,
                     'blocks/0/attn/qkv/kernel': 3, 'blocks/3/mlp/fc2/bias': 0,
                     'norm/scale': 0, 'head/kernel': 0}),
    ('resnet50', 16, {'stem_conv/kernel': 16, 'stem_bn/scale': 16, 'stem_bn/bias': 16,
                      'blocks/0/conv1/kernel': 15, 'blocks/3/downsample_conv/kernel': 12,
                      'blocks/15/bn3/scale': 0, 'head/kernel': 0}),
    ('regnety_demo', 6, {'stem_conv/kernel': 6, 'stem_bn/bias': 6, 'blocks/0/se/fc1/kernel': 5,
                         'blocks/5/conv_c/kernel': 0, 'head/bias': 0}),
    # Stages of 3, 4, 11 and 3 blocks: layer3/10 is block 3 + 4 + 10 = 17 of 21.
    ('tresnet_m', 21, {'conv1/conv/kernel': 21, 'conv1/bn/scale': 21,
                       'layer1/0/conv1/conv/kernel': 20, 'layer2/0/conv1/conv/kernel': 17,
                       'layer3/10/conv3/conv/kernel': 3, 'layer4/2/conv1/conv/kernel': 0,
                       'head/kernel': 0}),
    # The final 1x1 convs after the last block are on the head's side.
    ('mobilenetv3_large_100', 15, {'conv_stem/kernel': 15, 'bn_stem/scale': 15,
                                   'blocks/0/conv_dw/kernel': 14, 'blocks/14/conv_pw/kernel': 0,
                                   'conv_last/kernel': 0, 'bn_last/bias': 0,
                                   'conv_head/kernel': 0, 'head/kernel': 0}),
    ('mixer_s16', 8, {'patch_embed/kernel': 8, 'blocks/0/token_mixing/fc1/kernel': 7,
                      'blocks/7/norm2/scale': 0, 'norm/scale': 0, 'head/kernel': 0}),
]


@pytest.mark.parametrize('name, num_blocks, expected', _FAMILY_LAYERS,
                         ids=[f[0] for f in _FAMILY_LAYERS])
def test_layer_decay_per_family_from_the_stem_to_the_head(name, num_blocks, expected):
  from flax import nnx  # pylint: disable=import-outside-toplevel
  model = _abstract_model(name)
  assert model.num_layers() == num_blocks + 2
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  mult = _by_path(optim.layer_decay_multipliers(params, 0.5, layers=model))
  for path, exponent in expected.items():
    assert mult[path] == 0.5 ** exponent, path
  # The stem is the lowest layer, below every block: never the head's x1 (a convnet's stem
  # named outside a ViT's layer-0 names once got it while blocks/0 got LD^(L-1)).
  stem = min(mult.values())
  assert stem == 0.5 ** num_blocks and max(mult.values()) == 1.0


def test_a_parameter_outside_the_layer_order_is_refused():
  params = {**_vit_params(depth=2), 'extra_token': jnp.ones((1, 1, 4))}
  with pytest.raises(ValueError, match="'extra_token' is in none of its layers"):
    optim.layer_decay_multipliers(params, 0.7, layers=_vit(2))


def test_layer_decay_convention_is_checked():
  with pytest.raises(ValueError, match=r'optim\.layer_decay_convention'):
    optim.layer_decay_multipliers(_vit_params(depth=2), 0.7, 'beit2', layers=_vit(2))
  with pytest.raises(ValueError, match=r'optim\.layer_decay_convention'):
    optim.make_optimizer(_cfg(layer_decay=0.7, layer_decay_convention='beit2'), total_steps=10)


def test_layer_decay_needs_the_model():
  with pytest.raises(ValueError, match='layers=model'):
    optim.make_optimizer(_cfg(layer_decay=0.7), total_steps=10)


@pytest.mark.parametrize('convention, shift', [('cosub', 0), ('mae', 1)])
def test_layer_decay_applied_with_lr_scale(convention, shift):
  params = _vit_params(depth=3)
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5), params)
  cfg = _cfg(name='sgd', momentum=0.0, nesterov=False, weight_decay=0.0, lr=0.1,
             layer_decay=0.5, layer_decay_convention=convention,
             **{'schedule.name': 'constant'})
  tx, schedule = optim.make_optimizer(cfg, total_steps=10, layers=_vit(3))
  assert float(schedule(0)) == pytest.approx(0.2)  # lr * C_LD (2.0).
  updates, _ = tx.update(grads, tx.init(params), params)
  u = _by_path(updates)
  # Update = -lr * C_LD * LD^(L - layer + shift) * g with L = 3; the head always x 1.
  assert float(u['pos_embed'][0, 0, 0]) == pytest.approx(-0.2 * 0.5 ** (3 + shift) * 0.5)
  assert float(u['blocks/0/mlp/fc1/kernel'][0, 0]) == pytest.approx(
      -0.2 * 0.5 ** (2 + shift) * 0.5)
  assert float(u['blocks/2/norm1/bias'][0]) == pytest.approx(-0.2 * 0.5 ** shift * 0.5)
  assert float(u['head/kernel'][0, 0]) == pytest.approx(-0.2 * 0.5)


# ---------------------------------------------------------------- optimizer steps vs numpy


_RNG = np.random.default_rng(0)
_PARAMS = {'dense': {'kernel': _RNG.normal(size=(3, 2)), 'bias': _RNG.normal(size=(2,))},
           'pos_embed': _RNG.normal(size=(1, 2, 2))}
_GRADS = [jax.tree.map(lambda x: _RNG.normal(size=x.shape), _PARAMS) for _ in range(2)]
_DECAYED = {'dense': {'kernel': True, 'bias': False}, 'pos_embed': False}


def _run(cfg, steps=2):
  """Applies `steps` optax updates (constant lr) and returns the params as numpy."""
  tx, _ = optim.make_optimizer(cfg, total_steps=100)
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _PARAMS)
  state = tx.init(params)
  for g in _GRADS[:steps]:
    updates, state = tx.update(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g), state,
                               params)
    params = optax.apply_updates(params, updates)
  return jax.tree.map(np.asarray, params)


def _numpy_reference(kind, lr, wd, b1=0.9, b2=0.999, eps=1e-8, momentum=0.9, steps=2):
  """Per-leaf reference updates written from the algorithms' definitions."""
  out = {}
  for path, p0 in _by_path(_PARAMS).items():
    decay = wd if _by_path(_DECAYED)[path] else 0.0
    p, m, v, buf = p0.copy(), 0.0, 0.0, 0.0
    for t in range(1, steps + 1):
      g = _by_path(_GRADS[t - 1])[path]
      if kind == 'sgd':  # PyTorch SGD(nesterov=True, weight_decay): coupled.
        g = g + decay * p
        buf = momentum * buf + g
        p = p - lr * (g + momentum * buf)
        continue
      if kind == 'adam':  # Coupled L2: decay enters the moments.
        g = g + decay * p
      m = b1 * m + (1 - b1) * g
      v = b2 * v + (1 - b2) * g * g
      u = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
      if kind in ('adamw', 'lamb'):
        u = u + decay * p
      if kind == 'lamb' and decay > 0:  # timm: trust ratio only where weight_decay != 0.
        pn, un = np.linalg.norm(p), np.linalg.norm(u)
        u = u * (pn / un if pn > 0 and un > 0 else 1.0)
      p = p - lr * u
    out[path] = p
  return out


@pytest.mark.parametrize('kind', ['sgd', 'adam', 'adamw', 'lamb'])
def test_two_steps_match_numpy(kind):
  lr, wd = 0.05, 0.3
  cfg = _cfg(name=kind, lr=lr, weight_decay=wd, **{'schedule.name': 'constant'})
  got = _by_path(_run(cfg))
  want = _numpy_reference(kind, lr, wd)
  for path in want:
    np.testing.assert_allclose(got[path], want[path], rtol=2e-5, atol=1e-6, err_msg=path)


def test_adam_coupled_differs_from_adamw_only_where_decayed():
  base = dict(lr=0.05, weight_decay=0.3, **{'schedule.name': 'constant'})
  adam = _by_path(_run(_cfg(name='adam', **base), steps=1))
  adamw = _by_path(_run(_cfg(name='adamw', **base), steps=1))
  assert not np.allclose(adam['dense/kernel'], adamw['dense/kernel'])
  np.testing.assert_allclose(adam['dense/bias'], adamw['dense/bias'], rtol=1e-6)
  np.testing.assert_allclose(adam['pos_embed'], adamw['pos_embed'], rtol=1e-6)


def _lamb_tree():
  """DeiT-III-like leaves: decayed kernels, and bias / LayerScale / pos_embed / cls_token."""
  rng = np.random.default_rng(3)
  params = {'blocks': {0: {'attn': {'qkv': {'kernel': rng.normal(size=(4, 6)),
                                            'bias': rng.normal(size=(6,))}},
                           'ls1': {'gamma': np.full((4,), 1e-4)}}},
            'pos_embed': rng.normal(size=(1, 3, 4)) * 0.02,
            'cls_token': rng.normal(size=(1, 1, 4)) * 0.02,
            'head': {'kernel': rng.normal(size=(4, 5)) * 0.02, 'bias': np.zeros(5)}}
  grads = jax.tree.map(lambda x: rng.normal(size=x.shape), params)
  return params, grads


@pytest.mark.parametrize('always_adapt', [False, True])
def test_lamb_one_step_matches_timm_rule_in_numpy(always_adapt):
  params, grads = _lamb_tree()
  lr, wd, b1, b2, eps = 1e-3, 0.02, 0.9, 0.999, 1e-8
  cfg = _cfg(name='lamb', lr=lr, weight_decay=wd, b1=b1, b2=b2, eps=eps, grad_clip_norm=1.0,
             always_adapt=always_adapt, **{'schedule.name': 'constant'})
  tx, _ = optim.make_optimizer(cfg, total_steps=10)
  p32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  g32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), grads)
  updates, _ = tx.update(g32, tx.init(p32), p32)
  got = _by_path(optax.apply_updates(p32, updates))

  # timm Lamb, step 1: grads / max(global_norm / 1.0, 1); m_hat = g, v_hat = g^2;
  # u = m_hat / (sqrt(v_hat) + eps) (+ wd * p where decayed); u *= ||p|| / ||u|| where
  # decayed (everywhere with always_adapt), 1 where either norm is 0; p -= lr * u.
  flat_p, flat_g = _by_path(params), _by_path(grads)
  global_norm = np.sqrt(sum(np.sum(g ** 2) for g in flat_g.values()))
  assert global_norm > 1.0  # The clip is active.
  decayed = {'blocks/0/attn/qkv/kernel', 'head/kernel'}
  for path, p in flat_p.items():
    g = flat_g[path] / max(global_norm, 1.0)
    m = (1 - b1) * g / (1 - b1)
    v = (1 - b2) * g * g / (1 - b2)
    u = m / (np.sqrt(v) + eps)
    if path in decayed:
      u = u + wd * p
    if path in decayed or always_adapt:  # Ratio 1 where a norm is 0 (the zero head bias).
      pn, un = np.linalg.norm(p), np.linalg.norm(u)
      u = u * (pn / un if pn > 0 and un > 0 else 1.0)
    np.testing.assert_allclose(got[path], p - lr * u, rtol=1e-5, atol=1e-9, err_msg=path)
  # The LayerScale gamma (1e-4) moves by lr per element like Adam, not by a factor (1 + lr).
  step = np.abs(got['blocks/0/ls1/gamma'] - 1e-4)
  if always_adapt:
    np.testing.assert_allclose(step, lr * 1e-4, rtol=1e-3)
  else:
    np.testing.assert_allclose(step, lr, rtol=1e-3)


def test_lamb_without_weight_decay_is_adam():
  # timm adapts a param group only where weight_decay != 0 (or always_adapt).
  params, grads = _lamb_tree()
  base = dict(lr=1e-3, weight_decay=0.0, **{'schedule.name': 'constant'})
  out = {}
  for name in ('lamb', 'adamw'):
    tx, _ = optim.make_optimizer(_cfg(name=name, **base), total_steps=10)
    p32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    updates, _ = tx.update(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), grads),
                           tx.init(p32), p32)
    out[name] = _by_path(updates)
  for path, u in out['adamw'].items():
    np.testing.assert_allclose(out['lamb'][path], u, rtol=1e-6, err_msg=path)


def test_clip_by_global_norm_comes_first():
  params = {'w': jnp.full((2, 2), 2.0)}
  grads = {'w': jnp.full((2, 2), 5.0)}  # Global norm 10.
  cfg = _cfg(name='sgd', momentum=0.0, nesterov=False, lr=0.1, weight_decay=0.5,
             grad_clip_norm=1.0, **{'schedule.name': 'constant'})
  tx, _ = optim.make_optimizer(cfg, total_steps=10)
  updates, _ = tx.update(grads, tx.init(params), params)
  # Clipped gradient 5 * 1/10 = 0.5, then coupled decay 0.5 * 2 = 1 (not clipped).
  np.testing.assert_allclose(updates['w'], -0.1 * (0.5 + 1.0), rtol=1e-6)
  cfg.grad_clip_norm = 20.0  # Above the norm: no change.
  tx, _ = optim.make_optimizer(cfg, total_steps=10)
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates['w'], -0.1 * (5.0 + 1.0), rtol=1e-6)


def test_global_norms_are_each_trees_l2_norm():
  rng = np.random.default_rng(0)
  shapes = {'kernel': (3, 3, 4, 5), 'bias': (5,), 'scale': ()}
  trees = [{k: rng.normal(size=s).astype(np.float32) * (i + 1) for k, s in shapes.items()}
           for i in range(3)]
  trees[2]['kernel'] = trees[2]['kernel'].astype(jnp.bfloat16)  # Summed in float32.
  got = jax.jit(optim.global_norms)(*trees)
  assert len(got) == 3 and all(g.dtype == jnp.float32 for g in got)
  for tree, norm in zip(trees, got):
    want = math.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in tree.values()))
    assert float(norm) == pytest.approx(want, rel=1e-6)
  assert optim.global_norms() == ()
  with pytest.raises(ValueError):  # Trees of other lengths.
    optim.global_norms(trees[0], {'bias': trees[1]['bias']})


# ---------------------------------------------------------------- lr rules and config errors


def test_scale_lr_rules():
  assert optim.scale_lr(1e-3, 512) == pytest.approx(1e-3 * 0.5)  # sqrt(512 / 2048).
  assert optim.scale_lr(1e-3, 8192) == pytest.approx(2e-3)
  assert optim.scale_lr(1e-4, 1024, base_batch=256) == pytest.approx(2e-4)
  assert optim.scale_lr(0.1, 1536, rule='linear') == pytest.approx(0.6)  # 0.1 / 256 * 1536.
  assert optim.scale_lr(0.1, 1536, rule='none') == 0.1
  with pytest.raises(ValueError, match='rule'):
    optim.scale_lr(0.1, 256, rule='cubic')


@pytest.mark.parametrize('overrides, key', [
    (dict(name='rmsprop'), 'optim.name'),
    (dict(lr=0.0), 'optim.lr'),
    (dict(lr=-1e-3), 'optim.lr'),
    (dict(weight_decay=-0.1), 'optim.weight_decay'),
    (dict(layer_decay=1.5), 'optim.layer_decay'),
    (dict(grad_clip_norm=-1.0), 'optim.grad_clip_norm'),
    (dict(wd_exclude=('(',)), 'optim.wd_exclude'),
    ({'schedule.name': 'poly'}, 'optim.schedule.name'),
    ({'schedule.warmup_steps': 5, 'schedule.warmup_frac': 0.1}, 'optim.schedule.warmup_frac'),
    ({'schedule.name': 'onecycle', 'schedule.warmup_frac': 0.1}, 'optim.schedule.warmup_frac'),
    ({'schedule.pct_start': 1.0}, 'optim.schedule.pct_start'),
    ({'schedule.decay_factor': 0.0}, 'optim.schedule.decay_factor'),
])
def test_bad_optim_config_names_key(overrides, key):
  with pytest.raises(ValueError, match=key.replace('.', r'\.')):
    optim.make_optimizer(_cfg(**overrides), total_steps=100)


def test_unknown_optim_key_names_key():
  cfg = optim.optim_defaults()
  cfg.momentumm = 0.9
  with pytest.raises(ValueError, match=r'optim\.momentumm'):
    optim.validate_optim_config(cfg)
  cfg = optim.optim_defaults()
  cfg.schedule.warmup = 5
  with pytest.raises(ValueError, match=r'optim\.schedule\.warmup'):
    optim.validate_optim_config(cfg)


def test_wrong_type_or_missing_optim_key_names_key():
  cfg = optim.optim_defaults().to_dict()  # A plain dict skips ConfigDict's own type checks.
  cfg['lr'] = '0.1'
  with pytest.raises(ValueError, match=r'optim\.lr'):
    optim.validate_optim_config(cfg)
  cfg = optim.optim_defaults().to_dict()
  del cfg['schedule']['num_decays']
  with pytest.raises(ValueError, match=r'optim\.schedule\.num_decays.*missing'):
    optim.validate_optim_config(cfg)
