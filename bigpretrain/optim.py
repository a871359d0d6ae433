"""Optimizers and learning-rate schedules built from `config.optim` with optax.

One `make_optimizer` covers the four recipes: SGD with Nesterov momentum (semi-supervised,
SWAG RegNetY), Adam with coupled L2 weight decay (ImageNet-21K: lr 3e-4, wd 1e-4, OneCycle),
AdamW (SWAG ViT) and LAMB (DeiT-III / cosub, as timm's Lamb). Weight decay skips 0/1-d params
(biases, norm scales, LayerScale gammas; with `wd_1d` they are decayed too) and the paths
matched by `wd_exclude`; LayerDecay (cosub supplement A.1) scales each layer's updates
geometrically, over the layer order the model declares (models.base.Classifier.layer_of).
Params are pure nested dicts, paths are 'a/b/c' strings.
"""
from collections.abc import Mapping, Sequence
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from bigpretrain import registry

# Optimizers by config.optim.name: fn(cfg, decay, adapted) -> the transforms between gradient
# clipping and the learning rate (decay: weight-decay transforms, [] without; adapted: the
# mask of parameters LAMB's trust ratio applies to).
OPTIMIZERS = registry.Registry('optimizer', 'config.optim.name')
# Learning-rate schedules by config.optim.schedule.name: fn(cfg, lr, total_steps) -> schedule.
SCHEDULES = registry.Registry('lr schedule', 'config.optim.schedule.name')
DEFAULT_WD_EXCLUDE = ('pos_embed', 'cls_token')
LR_RULES = ('sqrt', 'linear', 'none')
LAYER_DECAY_CONVENTIONS = ('cosub', 'mae')


def optim_defaults() -> ml_collections.ConfigDict:
  """Defaults for `config.optim`; recipes override name, lr, weight_decay and the schedule."""
  return ml_collections.ConfigDict(dict(
      name='adamw',  # One of OPTIMIZERS.
      lr=1e-3,  # Peak learning rate (after warmup).
      weight_decay=0.05,
      b1=0.9, b2=0.999, eps=1e-8,  # adam / adamw / lamb.
      momentum=0.9, nesterov=True,  # sgd.
      # lamb: the trust ratio on every param, not only the weight-decayed ones (timm's
      # always_adapt; False is timm's and apex FusedLAMB's default, which DeiT-III uses).
      always_adapt=False,
      grad_clip_norm=0.0,  # Clip by global norm first in the chain; 0 = off.
      # Regexes searched in 'a/b/c' param paths; matches get no weight decay. Params with
      # ndim <= 1 (biases, norm scales) never get weight decay.
      wd_exclude=DEFAULT_WD_EXCLUDE,
      # True: 0/1-d params are decayed too unless wd_exclude matches them (ClassyVision's
      # rule, which SWAG trains with: only BatchNorm params are exempt, biases are decayed).
      wd_1d=False,
      layer_decay=0.0,  # LD of LayerDecay; 0 = off.
      layer_decay_lr_scale=2.0,  # C_LD: lr multiplier when LayerDecay is on.
      # 'cosub': block l of L gets LD^(L - l), the last block and the head x 1 (cosub
      # supplement A.1); 'mae': LD^(L + 1 - l), the last block x LD (BEiT / MAE).
      layer_decay_convention='cosub',
      schedule=dict(
          name='cosine',  # One of SCHEDULES.
          warmup_steps=-1,  # -1 = use warmup_frac; set at most one of the two.
          warmup_frac=0.0,  # Fraction of total_steps.
          warmup_init_factor=0.0,  # Linear warmup starts at lr * this.
          end_factor=0.0,  # cosine: final lr as a fraction of lr.
          # The same two as absolute lrs (timm's --warmup-lr, --min-lr; -1 = use the factor),
          # of the lr applied (times C_LD with LayerDecay on); one above the peak is the peak.
          warmup_init_lr=-1.0,
          end_lr=-1.0,
          pct_start=0.2,  # onecycle: fraction of the run spent increasing the lr.
          div_factor=25.0,  # onecycle: starts at lr / div_factor.
          final_div_factor=1e4,  # onecycle: ends at lr / (div_factor * final_div_factor).
          decay_factor=0.5,  # step: lr multiplier at each decay.
          num_decays=13,  # step: decays evenly spaced over the post-warmup run.
          # step: decay at these fractions of the whole run instead (warm-up included), e.g.
          # (30/90, 60/90, 80/90) for Goyal et al.'s ImageNet epochs 30, 60, 80 of 90.
          decay_at=(),
      ),
  ))


def _err(key: str, value: Any, why: str) -> ValueError:
  return ValueError(f'config.{key}={value!r}: {why}')


def _check_type(key: str, value: Any, default: Any) -> None:
  """Raises unless `value` has the kind of type its default has (number, bool, str, regexes)."""
  if isinstance(default, bool):
    ok = isinstance(value, bool)
  elif isinstance(default, (int, float)):
    kinds = int if isinstance(default, int) else (int, float)
    ok = isinstance(value, kinds) and not isinstance(value, bool)
  elif isinstance(default, str):
    ok = isinstance(value, str)
  elif key.endswith('decay_at'):  # A sequence of run fractions.
    ok = isinstance(value, (tuple, list)) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
  else:  # wd_exclude: a sequence of regex strings.
    ok = isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value)
  if not ok:
    raise _err(key, value, f'has the wrong type; expected a value like {default!r}')


def validate_optim_config(cfg: Mapping[str, Any], prefix: str = 'optim') -> None:
  """Raises ValueError naming the key for unknown keys or out-of-range values."""
  defaults = optim_defaults()
  if not hasattr(cfg.get('schedule'), 'keys'):
    raise _err(f'{prefix}.schedule', cfg.get('schedule'), 'must be a ConfigDict of schedule keys')
  for section, known, keys in ((prefix, defaults, cfg),
                               (f'{prefix}.schedule', defaults.schedule, cfg['schedule'])):
    for k in sorted(keys):
      if k not in known:
        raise ValueError(f'config.{section}.{k} is not a known key; valid keys: '
                         f'{sorted(known)}')
    for k in sorted(known):
      if k not in keys or keys[k] is None:
        raise ValueError(f'config.{section}.{k} is missing (required).')
      if k != 'schedule':
        _check_type(f'{section}.{k}', keys[k], known[k])
  s = cfg['schedule']
  p, ps = prefix, f'{prefix}.schedule'
  checks = [
      (f'{p}.name', cfg['name'], cfg['name'] in OPTIMIZERS,
       f'must be one of {OPTIMIZERS.names()}'),
      (f'{p}.lr', cfg['lr'], cfg['lr'] > 0, 'must be > 0'),
      (f'{p}.weight_decay', cfg['weight_decay'], cfg['weight_decay'] >= 0, 'must be >= 0'),
      (f'{p}.b1', cfg['b1'], 0 <= cfg['b1'] < 1, 'must be in [0, 1)'),
      (f'{p}.b2', cfg['b2'], 0 <= cfg['b2'] < 1, 'must be in [0, 1)'),
      (f'{p}.eps', cfg['eps'], cfg['eps'] >= 0, 'must be >= 0'),
      (f'{p}.momentum', cfg['momentum'], 0 <= cfg['momentum'] < 1, 'must be in [0, 1)'),
      (f'{p}.grad_clip_norm', cfg['grad_clip_norm'], cfg['grad_clip_norm'] >= 0,
       'must be >= 0 (0 = off)'),
      (f'{p}.layer_decay', cfg['layer_decay'], 0 <= cfg['layer_decay'] <= 1,
       'must be in [0, 1] (0 = off)'),
      (f'{p}.layer_decay_lr_scale', cfg['layer_decay_lr_scale'],
       cfg['layer_decay_lr_scale'] > 0, 'must be > 0'),
      (f'{p}.layer_decay_convention', cfg['layer_decay_convention'],
       cfg['layer_decay_convention'] in LAYER_DECAY_CONVENTIONS,
       f'must be one of {LAYER_DECAY_CONVENTIONS}'),
      (f'{ps}.name', s['name'], s['name'] in SCHEDULES, f'must be one of {SCHEDULES.names()}'),
      (f'{ps}.warmup_steps', s['warmup_steps'], s['warmup_steps'] >= -1,
       'must be >= 0, or -1 to use warmup_frac'),
      (f'{ps}.warmup_frac', s['warmup_frac'], 0 <= s['warmup_frac'] <= 1, 'must be in [0, 1]'),
      (f'{ps}.warmup_init_factor', s['warmup_init_factor'], 0 <= s['warmup_init_factor'] <= 1,
       'must be in [0, 1]'),
      (f'{ps}.end_factor', s['end_factor'], 0 <= s['end_factor'] <= 1, 'must be in [0, 1]'),
      (f'{ps}.warmup_init_lr', s['warmup_init_lr'], s['warmup_init_lr'] == -1 or
       s['warmup_init_lr'] >= 0, 'must be >= 0, or -1 to use warmup_init_factor'),
      (f'{ps}.end_lr', s['end_lr'], s['end_lr'] == -1 or s['end_lr'] >= 0,
       'must be >= 0, or -1 to use end_factor'),
      (f'{ps}.pct_start', s['pct_start'], 0 <= s['pct_start'] < 1, 'must be in [0, 1)'),
      (f'{ps}.div_factor', s['div_factor'], s['div_factor'] > 0, 'must be > 0'),
      (f'{ps}.final_div_factor', s['final_div_factor'], s['final_div_factor'] > 0,
       'must be > 0'),
      (f'{ps}.decay_factor', s['decay_factor'], 0 < s['decay_factor'] <= 1, 'must be in (0, 1]'),
      (f'{ps}.num_decays', s['num_decays'], s['num_decays'] >= 0, 'must be >= 0'),
      (f'{ps}.decay_at', s['decay_at'], list(s['decay_at']) == sorted(set(s['decay_at']))
       and all(0 < f < 1 for f in s['decay_at']), 'must be increasing fractions in (0, 1)'),
  ]
  for key, value, ok, why in checks:
    if not ok:
      raise _err(key, value, why)
  for absolute, factor in (('warmup_init_lr', 'warmup_init_factor'), ('end_lr', 'end_factor')):
    if s[absolute] >= 0 and s[factor] > 0:
      raise _err(f'{ps}.{factor}', s[factor], f'set either {absolute} ({s[absolute]}) or '
                 f'{factor}, not both')
  if s['warmup_steps'] >= 0 and s['warmup_frac'] > 0:
    raise _err(f'{ps}.warmup_frac', s['warmup_frac'],
               f'set either warmup_steps ({s["warmup_steps"]}) or warmup_frac, not both')
  if s['name'] == 'onecycle' and (s['warmup_steps'] >= 0 or s['warmup_frac'] > 0):
    key = 'warmup_steps' if s['warmup_steps'] >= 0 else 'warmup_frac'
    raise _err(f'{ps}.{key}', s[key], 'onecycle warms up over pct_start; leave warmup unset')
  for k in sorted(cfg.get('wd_exclude', ())):
    try:
      re.compile(k)
    except re.error as e:
      raise _err(f'{p}.wd_exclude', k, f'not a valid regex ({e})') from e


def resolve_warmup_steps(schedule_cfg: Mapping[str, Any], total_steps: int,
                         prefix: str = 'optim.schedule') -> int:
  """Warmup length in steps; raises if it is longer than the run."""
  if total_steps <= 0:
    raise ValueError(f'total_steps={total_steps} must be > 0.')
  if schedule_cfg['name'] == 'onecycle':
    return int(schedule_cfg['pct_start'] * total_steps)
  if schedule_cfg['warmup_steps'] >= 0:
    key, warmup = 'warmup_steps', int(schedule_cfg['warmup_steps'])
  else:
    key, warmup = 'warmup_frac', int(round(schedule_cfg['warmup_frac'] * total_steps))
  if warmup > total_steps:
    raise _err(f'{prefix}.{key}', schedule_cfg[key],
               f'warmup of {warmup} steps is longer than the run ({total_steps} steps)')
  return warmup


def _fraction(s, absolute: str, factor: str, lr: float) -> float:
  """A schedule end as a fraction of the peak `lr`: s[absolute] / lr (at most 1) when set."""
  return min(1.0, s[absolute] / lr) if s[absolute] >= 0 else s[factor]


def make_schedule(schedule_cfg: Mapping[str, Any], *, lr: float,
                  total_steps: int) -> optax.Schedule:
  """The learning-rate schedule peaking at `lr` named by schedule_cfg['name']."""
  return SCHEDULES.get(schedule_cfg['name'])(schedule_cfg, lr, total_steps)


@SCHEDULES.register('onecycle')
def _onecycle(s, lr: float, total_steps: int) -> optax.Schedule:
  # Cosine rise from lr/div over pct_start, then cosine fall to lr/(div*final_div).
  return optax.cosine_onecycle_schedule(total_steps, lr, pct_start=s['pct_start'],
                                        div_factor=s['div_factor'],
                                        final_div_factor=s['final_div_factor'])


def _warmup_then(decay):
  """A schedule of linear warmup (warmup_steps / warmup_frac) then `decay(s, lr, steps)`."""

  def schedule(s, lr: float, total_steps: int) -> optax.Schedule:
    warmup = resolve_warmup_steps(s, total_steps)
    main = decay(s, lr, max(total_steps - warmup, 1))
    if warmup == 0:
      return main
    ramp = optax.linear_schedule(
        lr * _fraction(s, 'warmup_init_lr', 'warmup_init_factor', lr), lr, warmup)
    return optax.join_schedules([ramp, main], [warmup])

  return schedule


@SCHEDULES.register('cosine')
@_warmup_then
def _cosine(s, lr: float, steps: int) -> optax.Schedule:
  return optax.cosine_decay_schedule(lr, decay_steps=steps,
                                     alpha=_fraction(s, 'end_lr', 'end_factor', lr))


@SCHEDULES.register('constant')
@_warmup_then
def _constant(s, lr: float, steps: int) -> optax.Schedule:
  del s, steps
  return optax.constant_schedule(lr)


@SCHEDULES.register('step')
def _step_schedule(s, lr: float, total_steps: int) -> optax.Schedule:
  if not s['decay_at']:
    return _step(s, lr, total_steps)
  # decay_at: boundaries at fractions of the whole run, counted from step 0.
  warmup = resolve_warmup_steps(s, total_steps)
  scales = {}
  for f in s['decay_at']:
    b = int(round(f * total_steps))
    if b < warmup:
      raise _err('optim.schedule.decay_at', tuple(s['decay_at']),
                 f'a decay at step {b} falls inside the {warmup}-step warm-up')
    scales[b] = scales.get(b, 1.0) * s['decay_factor']
  main = optax.piecewise_constant_schedule(lr, scales)
  if warmup == 0:
    return main
  ramp = optax.linear_schedule(
      lr * _fraction(s, 'warmup_init_lr', 'warmup_init_factor', lr), lr, warmup)
  return lambda step: jnp.where(step < warmup, ramp(step), main(step))


@_warmup_then
def _step(s, lr: float, steps: int) -> optax.Schedule:
  # num_decays decays evenly spaced: steps is split into num_decays + 1 equal segments.
  scales = {}
  for k in range(1, s['num_decays'] + 1):
    b = int(round(k * steps / (s['num_decays'] + 1)))
    scales[b] = scales.get(b, 1.0) * s['decay_factor']
  return optax.piecewise_constant_schedule(lr, scales)


def scale_lr(base_lr: float, batch_size: int, *, rule: str = 'sqrt',
             base_batch: int | None = None) -> float:
  """Scales a reference lr to `batch_size`.

  'sqrt': base_lr * sqrt(bs / base_batch), base_batch 2048 (cosub A.1, for AdamW);
  'linear': base_lr * bs / base_batch, base_batch 256 (Goyal et al., for SGD); 'none'.
  """
  if rule not in LR_RULES:
    raise ValueError(f'scale_lr rule={rule!r} must be one of {LR_RULES}')
  if batch_size <= 0:
    raise ValueError(f'scale_lr batch_size={batch_size} must be > 0')
  if rule == 'none':
    return float(base_lr)
  if base_batch is None:
    base_batch = 2048 if rule == 'sqrt' else 256
  ratio = batch_size / base_batch
  return float(base_lr * (math.sqrt(ratio) if rule == 'sqrt' else ratio))


def global_norms(*trees) -> tuple[jax.Array, ...]:
  """The L2 norm of each of `trees` (alike in structure and shapes: gradients, updates,
  parameters), as optax.global_norm gives it, summed in float32 by one variadic reduction per
  leaf.

  Why not optax.global_norm per tree: XLA:GPU fuses the norms' reductions into the kernel that
  applies the update, and a kernel holding more than one reduction cannot write the new
  parameters and optimizer state over the old ones (its buffer-sharing rule allows one
  reduction), so every step writes them elsewhere and copies them back. One reduction over
  all the trees' squares keeps the update in place.
  """
  sums = [jnp.zeros((), jnp.float32)] * len(trees)
  for leaves in zip(*(jax.tree.leaves(t) for t in trees), strict=True):
    squares = tuple(jnp.square(x.astype(jnp.float32)) for x in leaves)
    leaf_sums = jax.lax.reduce(squares, (jnp.float32(0),) * len(squares),
                               lambda a, b: tuple(x + y for x, y in zip(a, b)),
                               tuple(range(squares[0].ndim)))
    sums = [s + t for s, t in zip(sums, leaf_sums)]
  return tuple(jnp.sqrt(s) for s in sums)


def _path_str(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator='/')


def weight_decay_mask(params: Any, exclude: Sequence[str] = DEFAULT_WD_EXCLUDE, *,
                      decay_1d: bool = False) -> Any:
  """True where weight decay applies: no `exclude` regex found in the path and ndim >= 2
  (any ndim with `decay_1d`)."""
  patterns = [re.compile(p) for p in exclude]

  def decays(path, x):
    p = _path_str(path)
    return bool((decay_1d or np.ndim(x) > 1) and not any(r.search(p) for r in patterns))

  return jax.tree_util.tree_map_with_path(decays, params)


def layer_decay_multipliers(params: Any, layer_decay: float, convention: str = 'cosub', *,
                            layers) -> Any:
  """LayerDecay lr multipliers of `params` over the layer order of `layers`, the model (a
  models.base.Classifier, abstract or not): layer_of(path) puts the stem at 0, the L
  residual blocks at 1..L and what follows them (final norm, head) at L + 1 =
  num_layers() - 1.
  'cosub' (supplement A.1: "the LR of all layers is affected, except those in the final
  block"): layer l gets LD^(L - l), so the last block and the head get 1, the stem LD^L.
  'mae' (BEiT's and MAE's param groups): layer l gets LD^(L + 1 - l), the last block LD.
  """
  if convention not in LAYER_DECAY_CONVENTIONS:
    raise _err('optim.layer_decay_convention', convention,
               f'must be one of {LAYER_DECAY_CONVENTIONS}')
  num_blocks = layers.num_layers() - 2
  if num_blocks < 1:
    raise ValueError(f'optim.layer_decay needs a model with residual blocks; '
                     f'{type(layers).__name__} has none.')
  top = num_blocks if convention == 'cosub' else num_blocks + 1  # The layer that gets 1.

  def multiplier(path, _):
    return float(layer_decay ** max(top - layers.layer_of(_path_str(path)), 0))

  return jax.tree_util.tree_map_with_path(multiplier, params)


def scale_by_layer_decay(layer_decay: float, convention: str = 'cosub', *,
                         layers) -> optax.GradientTransformation:
  """Multiplies each update by its LayerDecay multiplier (paths read from the update tree,
  layers from the model `layers`)."""

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    mults = layer_decay_multipliers(updates, layer_decay, convention, layers=layers)
    updates = jax.tree.map(lambda u, m: u * jnp.asarray(m, u.dtype), updates, mults)
    return updates, state

  return optax.GradientTransformation(init_fn, update_fn)


def make_optimizer(optim_cfg: Mapping[str, Any], *, total_steps: int,
                   layers=None) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Builds (optax transformation, lr schedule) from `config.optim`; `layers`: the model
  (its layer order), which LayerDecay needs.

  Chain: clip by global norm -> [coupled L2 for sgd/adam] -> sgd/adam moments -> [decoupled
  weight decay for adamw/lamb] -> [trust ratio for lamb] -> LayerDecay -> -lr(step).
  LAMB is timm's Lamb / apex FusedLAMB as DeiT-III runs it: u = adam + wd * p, then
  u * ||p|| / ||u|| (1 where either norm is 0) only on the weight-decayed params, unless
  always_adapt; their clipping at global norm 1.0 is grad_clip_norm=1.0 here.
  The returned schedule is the lr actually applied (times C_LD when LayerDecay is on).
  """
  validate_optim_config(optim_cfg)
  c = optim_cfg
  lr = c['lr'] * (c['layer_decay_lr_scale'] if c['layer_decay'] > 0 else 1.0)
  schedule = make_schedule(c['schedule'], lr=lr, total_steps=total_steps)
  exclude = tuple(c['wd_exclude'])
  wd = c['weight_decay']

  def decayed(params):
    return weight_decay_mask(params, exclude, decay_1d=c['wd_1d'])

  def decay():
    if wd == 0:
      return []
    return [optax.add_decayed_weights(wd, mask=decayed)]

  def adapted(params):  # timm: `if weight_decay != 0 or always_adapt`, per param group.
    if c['always_adapt']:
      return jax.tree.map(lambda _: True, params)
    if wd == 0:
      return jax.tree.map(lambda _: False, params)
    return decayed(params)

  chain = []
  if c['grad_clip_norm'] > 0:
    chain.append(optax.clip_by_global_norm(c['grad_clip_norm']))
  chain += OPTIMIZERS.get(c['name'])(c, decay(), adapted)
  if c['layer_decay'] > 0:
    if layers is None:
      raise ValueError('optim.layer_decay needs the model\'s layer order: '
                       'make_optimizer(..., layers=model).')
    chain.append(scale_by_layer_decay(c['layer_decay'], c['layer_decay_convention'],
                                      layers=layers))
  chain.append(optax.scale_by_learning_rate(schedule))
  return optax.chain(*chain), schedule


def _adam(c) -> optax.GradientTransformation:
  return optax.scale_by_adam(b1=c['b1'], b2=c['b2'], eps=c['eps'])


@OPTIMIZERS.register('sgd')
def _sgd(c, decay: list, adapted) -> list:
  del adapted
  return decay + [optax.trace(decay=c['momentum'], nesterov=c['nesterov'])]


@OPTIMIZERS.register('adam')
def _adam_l2(c, decay: list, adapted) -> list:
  del adapted
  return decay + [_adam(c)]  # Coupled L2: the decay goes through Adam's normalisation.


@OPTIMIZERS.register('adamw')
def _adamw(c, decay: list, adapted) -> list:
  del adapted
  return [_adam(c)] + decay


@OPTIMIZERS.register('lamb')
def _lamb(c, decay: list, adapted) -> list:
  return [_adam(c)] + decay + [optax.masked(optax.scale_by_trust_ratio(), adapted)]
