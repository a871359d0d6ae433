"""The base config every recipe starts from, recipe-argument parsing, and validation.

`base_config()` holds every key the trainer reads. Recipes (configs/*.py) override values and
add model/objective kwargs and the data settings (input_pipeline.pipeline.data_defaults());
`validate()` then catches typos and bad values before any compilation, naming the offending
key, and locks the config.
"""
from collections.abc import Iterable, Mapping
import difflib
import json
import math
import os
import re
from typing import Any

import ml_collections

from bigpretrain import divergence
from bigpretrain.runtime import cache
from bigpretrain.runtime import goodput
from bigpretrain import mixup
from bigpretrain import model_init
from bigpretrain import optim
from bigpretrain import registry
from bigpretrain.models import base as model_base
from bigpretrain.sharding import MESH_AXES
from input_pipeline import datasets
from input_pipeline import pipeline

COMPUTE_DTYPES = ('float32', 'bfloat16')
# Sections whose keys are fixed: a key not in base_config() is a typo.
_CLOSED_SECTIONS = ('mesh', 'optim', 'mixup', 'ema', 'divergence')
# config.data: base_config()'s keys are required; any other key must be one of the pipeline's
# (data_defaults()) or one the named data sources declare (_check_data_keys), else a typo.
_DATA_SECTION = 'data'
# Sections recipes extend with their own kwargs; only their base keys are required.
# (config.evals entries are checked by the evaluators they name.)
_OPEN_SECTIONS = ('model', 'objective', 'evals')
# Base keys of open sections that may be left out (their default applies).
_OPTIONAL_KEYS = ('model.remat', 'model.attention_impl', 'model.head_dtype',
                  'model.grouped_conv_impl', 'model.pointwise_conv_impl')
_STEP_KEYS = ('log_every_steps', 'eval_every_steps', 'ckpt_every_steps')


def base_config() -> ml_collections.ConfigDict:
  """Every key the trainer reads, with its default."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  # Modules imported before anything is built: a user's own objectives, evaluators, models,
  # data sources or hooks register themselves there (bigpretrain/registry.py).
  c.plugins = ()
  # Duration: total_steps > 0 wins, else num_epochs > 0, else num_examples > 0. total_steps
  # = 0 trains nothing: the evaluators run once on the initial (model_init) weights.
  c.total_steps = -1
  c.num_epochs = -1.0
  c.num_examples = -1
  c.batch_size = 256  # Global, over all hosts.
  c.log_every_steps = 50
  c.eval_every_steps = 1000  # 0 = only at the end.
  c.ckpt_every_steps = 1000  # 0 = only at the end (and on SIGTERM).
  c.keep_ckpts = 3
  c.compute_dtype = 'float32'  # One of COMPUTE_DTYPES.
  # '' = '<cache>/jax' (see compilation_cache_dir()); 'none' disables the persistent cache.
  c.compilation_cache_dir = ''
  c.resume = ''  # A run's workdir (or checkpoint dir) to resume from when the workdir has none.
  # The checkpoint step to resume from (-1 = the newest): an earlier one of the workdir (its
  # later checkpoints are moved to checkpoints_superseded/), else of config.resume. Remove
  # it from the command for later re-runs, or each would go back to step N again.
  c.resume_step = -1
  # Resuming with another run length, batch size, lr, lr schedule or seed than the
  # checkpoint's run (SCHEDULE_KEYS) is refused unless this is True.
  c.allow_schedule_change = False
  c.model_init = ''  # Checkpoint to load params from (a teacher, an ImageNet-1K init).
  # Regex of param paths (e.g. '^params/head/') that model_init leaves freshly initialised;
  # arrays whose shape differs (a 21k head in a 1k model) always stay fresh.
  c.model_init_skip = ''
  # How a model adapts a checkpoint's size-dependent arrays to its own (a ViT's position
  # embedding at a new image size): models.vit.RESIZE_METHODS, or 'auto': the resize of the
  # library a converted checkpoint came from, 'bicubic' otherwise (models.ModelDef).
  c.model_init_resize = 'auto'
  # A hook run after model_init (bigpretrain/model_init.py), e.g. 'zero_shot': the head from
  # a hashtag model's head through the WordNet class map (bigpretrain/swag/head_init.py).
  c.model_init_head = ''
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))  # -1 = the rest.
  # (logical axis name, mesh axis) rules, in order of priority as flax.linen reads them (a
  # name's later rules apply where its earlier ones' axes are taken; None = replicated;
  # bigpretrain/sharding.py). A tuple so overrides keep the type.
  # FSDP shards transformer weights on 'embed' and convolution kernels on their input
  # channels ('conv_in'), or on their output channels where the input's do not divide it
  # (RegNetY's squeeze-excitation widths, a quarter of the block's); tensor parallelism the
  # other axis of each.
  c.sharding_rules = (('embed', 'fsdp'), ('mlp', 'tensor'), ('heads', 'tensor'),
                      ('classes', 'tensor'), ('conv_in', 'fsdp'), ('conv_out', 'fsdp'),
                      ('conv_out', 'tensor'))
  # model.remat: '' or 'none' (off), or the jax.checkpoint_policies policy every residual
  # block is rematerialised with (bigpretrain.models.base.REMAT_POLICIES): 'nothing_saveable'
  # recomputes each block in the backward pass, keeping only its input; 'dots_saveable' keeps
  # the matmul / conv outputs. Less activation memory for more compute, the same parameters
  # (checkpoints load either way): for a config that does not fit the chip's HBM (plan it with
  # bigpretrain.tools.plan --topology: XLA:CPU plans show the recompute, not the saving; see
  # docs/scaling.md). Recipes replacing the section keep it (model_section); a section
  # without it is off.
  # model.attention_impl: the attention kernel ('xla'; 'cudnn' for cuDNN's fused flash
  # attention on NVIDIA GPUs; 'auto': cudnn where it runs, on GPUs in bf16, else xla: the same
  # losses up to bf16 rounding, and a faster ViT step); model.head_dtype: what the classifier's
  # matmul reads ('float32', or 'bfloat16' with float32 accumulation);
  # model.grouped_conv_impl: how grouped convolutions run ('xla'; 'gemm': one batched
  # matrix product over the groups; 'split': one convolution per group; 'pallas': implicit-
  # GEMM kernels); model.pointwise_conv_impl: how ungrouped 1x1 convolutions run ('xla';
  # 'gemm': a matrix product over the channels). All pick kernels, not weights
  # (bigpretrain.models.base.ATTENTION_CHOICES / HEAD_DTYPES / GROUPED_CONV_IMPLS /
  # POINTWISE_CONV_IMPLS; their A/B figures: benchmarks/accelerator.py, docs/benchmarks.md).
  c.model = ml_collections.ConfigDict(dict(name='vit_demo', remat='', attention_impl='auto',
                                           head_dtype='float32', grouped_conv_impl='xla',
                                           pointwise_conv_impl='xla'))
  c.data = ml_collections.ConfigDict(dict(name='demo', dir=''))
  c.objective = ml_collections.ConfigDict(dict(name='softmax'))
  c.optim = optim.optim_defaults()
  # Evaluators by name (bigpretrain/evaluators): 'eval' is the objective's metrics on
  # data.eval_split every eval_every_steps (its every_steps: -1); logged as 'eval/...'.
  c.evals = ml_collections.ConfigDict(
      {'eval': ml_collections.ConfigDict(dict(type='classification', topk=(1, 5),
                                              every_steps=-1))})
  # On-device mixup/cutmix inside the train step (timm semantics); both 0 = off.
  c.mixup = mixup.mixup_defaults()
  # EMA of the weights (params and float model state such as BatchNorm statistics), updated
  # after every step as ema = momentum * ema + (1 - momentum) * weights; 0 = off. When on,
  # every evaluator (the 'eval/...' rows) evaluates the EMA weights, checkpoints hold them
  # beside the raw ones, and model_init / load_pretrained read the EMA weights.
  c.ema = ml_collections.ConfigDict(dict(momentum=0.0))
  # What a bad step is and what the run does about one (bigpretrain/divergence.py): a step
  # is bad when its loss or gradient norm is non-finite, or its loss is above loss_factor x
  # the running median of the last `window` good losses and min_rise above it (loss_factor 0
  # = only non-finite).
  # policy 'stop' ends the run at the first bad step, naming it and the last good checkpoint
  # (later ones, from the diverging state, are moved to checkpoints_diverged/); 'skip' applies
  # no update on a bad step (counted in 'train/skipped_steps' over the whole run, resumes
  # included) and stops at a bad step that follows max_consecutive_skips in a row. A factor of 10
  # leaves the noise of small batches alone and catches a blow-up; min_rise (in loss units)
  # keeps a loss near 0 (a fine-tune's 0.05 -> 0.6) from counting as a spike.
  c.divergence = ml_collections.ConfigDict(dict(
      policy='stop', loss_factor=10.0, min_rise=1.0, window=100, max_consecutive_skips=20))
  # 'START,COUNT': a JAX profiler trace of steps START..START+COUNT-1 into
  # workdir/profile/process_<i> (TensorBoard's profile tab); '' = off.
  c.profile_steps = ''
  return c


def model_section(**options: Any) -> ml_collections.ConfigDict:
  """A `config.model` of `options` ('name' and the model's keyword options) over the base
  section's defaults, for recipes that replace the section: its keys (model.remat) stay
  settable from the command line (--config.model.remat=...)."""
  return ml_collections.ConfigDict({**base_config().model, **options})


# A checkpoint's model options that belong to the run that trained it, not to its weights: the
# image size (a fine-tune builds the model at its own data.image_size; model_init adapts the
# size-dependent arrays, e.g. a ViT's position embedding) and the BatchNorm statistics' group
# (each fine-tuning recipe sets its own).
RUN_MODEL_OPTIONS = ('image_size', 'bn_group_size')


def finetune_model_section(checkpoint_model: dict, **options: Any) -> ml_collections.ConfigDict:
  """A fine-tune's `config.model` from a checkpoint meta's model: its architecture without
  RUN_MODEL_OPTIONS, plus the fine-tuning recipe's `options`."""
  kept = {k: v for k, v in checkpoint_model.items() if k not in RUN_MODEL_OPTIONS}
  return model_section(**{**kept, **options})


def _parse_bool(key: str, value: str) -> bool:
  v = value.strip().lower()
  if v in ('true', '1'):
    return True
  if v in ('false', '0'):
    return False
  raise ValueError(f'config arg {key}={value!r}: expected a bool (true/false/1/0).')


def parse_arg(arg: str | None, **defaults: Any) -> ml_collections.ConfigDict:
  """Parses a recipe argument 'k=v,k2=v2' with types taken from `defaults`.

  bool accepts true/false/1/0 (a bare 'k' means k=true), int, float and str values follow
  their defaults; a None default takes the string. Unknown keys and bad values raise.
  """
  out = dict(defaults)
  seen = set()
  for token in (arg or '').split(','):
    token = token.strip()
    if not token:
      continue
    key, sep, value = token.partition('=')
    key = key.strip()
    if key not in defaults:
      close = difflib.get_close_matches(key, sorted(defaults), n=1)
      hint = f' (did you mean {close[0]!r}?)' if close else ''
      raise ValueError(f'config arg {key!r} is unknown{hint}; valid keys: {sorted(defaults)}')
    if key in seen:
      raise ValueError(f'config arg {key!r} is given twice in {arg!r}')
    seen.add(key)
    default = defaults[key]
    if not sep:
      if not isinstance(default, bool):
        raise ValueError(f'config arg {key!r} needs a value ({key}=...) in {arg!r}')
      out[key] = True
      continue
    if isinstance(default, bool):
      out[key] = _parse_bool(key, value)
    elif isinstance(default, (int, float)):
      kind = type(default)
      try:
        out[key] = kind(value)
      except ValueError:
        raise ValueError(f'config arg {key}={value!r}: expected {kind.__name__}.') from None
    elif default is None or isinstance(default, str):
      out[key] = value
    else:
      raise TypeError(f'config arg {key!r}: default {default!r} has unsupported type '
                      f'{type(default).__name__} (use bool, int, float, str or None).')
  return ml_collections.ConfigDict(out)


def _suggest(key: str, known: Iterable[str]) -> str:
  close = difflib.get_close_matches(key, sorted(known), n=1)
  return f" (did you mean '{close[0]}'?)" if close else ''


def check_known_keys(section: Mapping[str, Any], known: Iterable[str], where: str) -> None:
  """Raises ValueError naming the first key of `section` (config `where`, e.g. 'config.dedup')
  that is not in `known`, with its close match: a misspelt key would be ignored."""
  known = set(known)
  for key in sorted(section):
    if key not in known:
      raise ValueError(f'{where}.{key} is not a known key{_suggest(key, known)}; valid: '
                       f'{sorted(known)}')


def _is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_keys(config: Mapping[str, Any], base: Mapping[str, Any],
                extra_keys: Iterable[str]) -> None:
  """Missing required keys and unknown top-level / closed-section / data keys."""
  extra = set(extra_keys)
  for key in sorted(config):
    if key not in base and key not in extra:
      raise ValueError(f'config.{key} is not a known key{_suggest(key, base)}; valid top-level '
                       f'keys: {sorted(base)}')
  for key in sorted(base):
    if key not in config or config[key] is None:
      raise ValueError(f'config.{key} is missing (required).')
  for section in _CLOSED_SECTIONS + (_DATA_SECTION,) + _OPEN_SECTIONS:
    if not hasattr(config[section], 'keys'):
      raise ValueError(f'config.{section}={config[section]!r} must be a ConfigDict section.')
    if section in ('optim', 'evals'):
      continue  # Checked by optim.validate_optim_config / by the evaluators at build time.
    for key in sorted(base[section]):
      if f'{section}.{key}' in _OPTIONAL_KEYS and key not in config[section]:
        continue
      if key not in config[section] or config[section][key] is None:
        raise ValueError(f'config.{section}.{key} is missing (required).')
    if section in _CLOSED_SECTIONS:
      check_known_keys(config[section], base[section], f'config.{section}')
  _check_data_keys(config[_DATA_SECTION])


def _check_data_keys(data: Mapping[str, Any]) -> None:
  """Refuses a config.data key that nothing reads: neither a key of base_config().data or
  pipeline.data_defaults() (what the pipeline, trainer and evaluators read) nor one declared
  (datasets.data_keys) by the loader of data.name or of a data.mix entry, e.g. the hashtag
  sources' resample_alpha. Such a key would be ignored silently (a misspelt num_workers
  would train with 0 workers), so it is named with its close match instead."""
  known = set(base_config().data) | set(pipeline.data_defaults())
  unknown = sorted(k for k in data if k not in known)
  if not unknown:
    return
  name = str(data.get('name', ''))
  mix = [n for n, _ in datasets.parse_mix(data.get('mix', ''))]
  for source in [name] + mix:
    if source not in datasets.SOURCES:  # The name's error first: its source may declare the key.
      if source == name:
        raise ValueError(datasets.SOURCES.unknown_message(name))
      raise ValueError(f'config.data.mix entry {source!r} is not a known dataset'
                       f'{_suggest(source, datasets.SOURCES.keys())}; known: '
                       f'{", ".join(datasets.SOURCES.names())}.')
    known.update(datasets.declared_data_keys(source))
  for key in unknown:
    if key not in known:
      named = f'data.name={name!r}' + (f' and data.mix {mix}' if mix else '')
      elsewhere = datasets.sources_declaring(key)
      note = (f'Declared by the data sources {", ".join(map(repr, elsewhere))}: valid only '
              'where data.name or data.mix names one of them.' if elsewhere else
              'A key that a data source declares, datasets.data_keys, is valid only where '
              'data.name or data.mix names that source.')
      raise ValueError(f'config.data.{key} is not a known key{_suggest(key, known)}; valid '
                       f'with {named}: {sorted(known)}. ({note})')


def _check_values(config: Mapping[str, Any]) -> None:
  """Types and ranges of the trainer's own keys."""
  for key in ('seed', 'total_steps', 'num_examples', 'batch_size', 'keep_ckpts',
              'resume_step') + _STEP_KEYS:
    if not _is_int(config[key]):
      raise ValueError(f'config.{key}={config[key]!r} must be an int.')
  if not _is_number(config.num_epochs):
    raise ValueError(f'config.num_epochs={config.num_epochs!r} must be a number.')
  if config.batch_size <= 0:
    raise ValueError(f'config.batch_size={config.batch_size} must be > 0.')
  for key in _STEP_KEYS:
    if config[key] < 0:
      raise ValueError(f'config.{key}={config[key]} must be >= 0.')
  if config.log_every_steps < 1:  # Each row's steps are held until it is written.
    raise ValueError(f'config.log_every_steps={config.log_every_steps} must be >= 1.')
  if config.keep_ckpts < 1:
    raise ValueError(f'config.keep_ckpts={config.keep_ckpts} must be >= 1.')
  if config.resume_step < -1:
    raise ValueError(f'config.resume_step={config.resume_step} must be a checkpoint step >= 0, '
                     'or -1 (the newest).')
  _check_divergence(config.divergence)
  if not (config.total_steps >= 0 or config.num_epochs > 0 or config.num_examples > 0):
    raise ValueError('config.total_steps, config.num_epochs and config.num_examples are all '
                     '<= 0: set one of them to give the run a duration.')
  if config.compute_dtype not in COMPUTE_DTYPES:
    raise ValueError(f'config.compute_dtype={config.compute_dtype!r} must be one of '
                     f'{COMPUTE_DTYPES}.')
  if not isinstance(config.allow_schedule_change, bool):
    raise ValueError(f'config.allow_schedule_change={config.allow_schedule_change!r} must be a '
                     'bool.')
  for key in ('compilation_cache_dir', 'resume', 'model_init', 'model_init_skip',
              'model_init_head', 'model_init_resize'):
    if not isinstance(config[key], str):
      raise ValueError(f'config.{key}={config[key]!r} must be a str.')
  try:
    re.compile(config.model_init_skip)
  except re.error as e:
    raise ValueError(f'config.model_init_skip={config.model_init_skip!r} is not a regular '
                     f'expression: {e}.') from None
  for section in ('model', 'data', 'objective'):
    name = config[section].name
    if not isinstance(name, str) or not name:
      raise ValueError(f'config.{section}.name={name!r} must be a non-empty str.')
  group = config.model.get('bn_group_size', 0)
  if not _is_int(group) or group < 0:
    raise ValueError(f'config.model.bn_group_size={group!r} must be an int >= 0 (0 = BatchNorm '
                     'statistics over the whole batch).')
  if group and config.batch_size % group:
    raise ValueError(f'config.model.bn_group_size={group} must divide config.batch_size='
                     f'{config.batch_size}: BatchNorm statistics are taken per group of '
                     f'{group} rows.')
  if config.model_init_head and config.model_init_head not in model_init.HOOKS:
    raise ValueError(model_init.HOOKS.unknown_message(config.model_init_head))
  if config.model_init_head and not config.model_init:
    raise ValueError(f'config.model_init_head={config.model_init_head!r} needs '
                     'config.model_init (the checkpoint whose head it starts from).')
  momentum = config.ema.momentum
  if not _is_number(momentum) or not 0 <= momentum < 1:
    raise ValueError(f'config.ema.momentum={momentum!r} must be a number in [0, 1) (0 = off; '
                     'a "decay" of 1e-4 is momentum 0.9999).')
  goodput.parse_profile_steps(config.profile_steps)
  remat = config.model.get('remat', '')
  if not isinstance(remat, str) or remat not in model_base.REMAT_OFF + model_base.REMAT_POLICIES:
    raise ValueError(f'config.model.remat={remat!r} must be one of {model_base.REMAT_POLICIES} '
                     "(the jax.checkpoint_policies policy each residual block is "
                     "rematerialised with), or '' / 'none' for off.")
  for key, allowed in (('attention_impl', model_base.ATTENTION_CHOICES),
                       ('head_dtype', model_base.HEAD_DTYPES),
                       ('grouped_conv_impl', model_base.GROUPED_CONV_IMPLS),
                       ('pointwise_conv_impl', model_base.POINTWISE_CONV_IMPLS)):
    value = config.model.get(key, allowed[0])
    if value not in allowed:
      raise ValueError(f'config.model.{key}={value!r} must be one of {allowed}.')
  if not isinstance(config.data.dir, str):
    raise ValueError(f'config.data.dir={config.data.dir!r} must be a str.')
  # The data settings, with the other keys: before any dataset is opened or model compiled.
  pipeline.check_data_config(config.data)
  datasets.parse_mix(config.data.get('mix', ''))
  sizes = [config.mesh[a] for a in MESH_AXES]
  for axis, size in zip(MESH_AXES, sizes):
    if not _is_int(size) or (size < 1 and size != -1):
      raise ValueError(f'config.mesh.{axis}={size!r} must be an int >= 1, or -1 (= the rest).')
  if sizes.count(-1) > 1:
    axes = [a for a, s in zip(MESH_AXES, sizes) if s == -1]
    raise ValueError(f'config.mesh.{axes[1]}=-1: at most one mesh axis may be -1 '
                     f'(mesh.{axes[0]} already is).')
  rules = config.sharding_rules
  if not isinstance(rules, (tuple, list)):
    raise ValueError(f'config.sharding_rules={rules!r} must be a tuple of (logical, mesh) pairs.')
  for rule in rules:
    if (not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str)
        or rule[1] not in MESH_AXES + (None,)):
      raise ValueError(f'config.sharding_rules: bad rule {rule!r}; each must be a pair '
                       f'(logical name, one of {MESH_AXES} or None).')


def _check_divergence(d: Mapping[str, Any]) -> None:
  if d.policy not in divergence.POLICIES:
    raise ValueError(f'config.divergence.policy={d.policy!r} must be one of '
                     f'{divergence.POLICIES}.')
  if not _is_number(d.loss_factor) or not (d.loss_factor == 0 or d.loss_factor > 1):
    raise ValueError(f'config.divergence.loss_factor={d.loss_factor!r} must be a number > 1 '
                     '(0 = only non-finite losses are bad).')
  if not _is_number(d.min_rise) or d.min_rise < 0:
    raise ValueError(f'config.divergence.min_rise={d.min_rise!r} must be a number >= 0.')
  for key in ('window', 'max_consecutive_skips'):
    if not _is_int(d[key]) or d[key] < 1:
      raise ValueError(f'config.divergence.{key}={d[key]!r} must be an int >= 1.')


def validate(config: ml_collections.ConfigDict, *,
             extra_keys: Iterable[str] = ()) -> ml_collections.ConfigDict:
  """Checks keys and values, raising ValueError naming the bad key; then locks the config.

  Call before any compilation. `extra_keys` are top-level keys a caller allows beyond
  base_config()'s. The warmup-vs-run check needs the dataset size: see resolve_total_steps.
  """
  registry.import_plugins(config.get('plugins', ()))
  _check_keys(config, base_config(), extra_keys)
  _check_values(config)
  optim.validate_optim_config(config.optim)
  config.lock()
  return config


def resolve_total_steps(config: Mapping[str, Any], num_train_examples: int | None = None) -> int:
  """Total train steps: total_steps > 0, else ceil(epochs * N / bs), else ceil(examples / bs).

  Also checks that the optimizer's warmup fits in the run.
  """
  bs = config['batch_size']
  if config['total_steps'] == 0:
    return 0  # Evaluation only.
  if config['total_steps'] > 0:
    steps = int(config['total_steps'])
  elif config['num_epochs'] > 0:
    if not num_train_examples or num_train_examples <= 0:
      raise ValueError(f'config.num_epochs={config["num_epochs"]} needs the number of training '
                       f'examples, got {num_train_examples!r}.')
    steps = math.ceil(config['num_epochs'] * num_train_examples / bs)
  elif config['num_examples'] > 0:
    steps = math.ceil(config['num_examples'] / bs)
  else:
    raise ValueError('config.total_steps, config.num_epochs and config.num_examples are all '
                     '<= 0: set one of them to give the run a duration.')
  optim.resolve_warmup_steps(config['optim']['schedule'], steps)
  return steps


def describe_duration(config: Mapping[str, Any], num_train_examples: int | None = None) -> str:
  """One line for the log: the resolved steps, where they came from, and epochs seen."""
  steps = resolve_total_steps(config, num_train_examples)
  if config['total_steps'] >= 0:
    source = 'config.total_steps'
  elif config['num_epochs'] > 0:
    source = f'config.num_epochs={config["num_epochs"]}'
  else:
    source = f'config.num_examples={config["num_examples"]}'
  text = f'{steps} steps at batch size {config["batch_size"]} (from {source})'
  if num_train_examples and num_train_examples > 0:
    epochs = steps * config['batch_size'] / num_train_examples
    text += f' = {epochs:.3g} epochs of {num_train_examples} examples'
  return text


# Keys that define the step count and the lr at each step ('optim.schedule' is every key of
# that section: its name, warmup, decay shape; LayerDecay scales the lr per layer), and what a
# checkpoint's data position counts records of: the seed's shuffle order of these datasets,
# mix and subset.
SCHEDULE_KEYS = ('total_steps', 'num_epochs', 'num_examples', 'batch_size', 'optim.lr',
                 'optim.schedule', 'optim.layer_decay', 'optim.layer_decay_lr_scale', 'seed',
                 'data.name', 'data.mix', 'data.train_split', 'data.subset_frac',
                 'data.subset_seed')


def _flat(tree: Mapping[str, Any], prefix: str) -> dict[str, Any]:
  if not hasattr(tree, 'keys'):
    return {prefix: tree}
  out = {}
  for k in tree.keys():
    out.update(_flat(tree[k], f'{prefix}.{k}'))
  return out


def _lookup(tree: Mapping[str, Any], dotted: str):
  for part in dotted.split('.'):
    if not hasattr(tree, 'keys') or part not in tree:
      return None
    tree = tree[part]
  return tree


def schedule_changes(saved: Mapping[str, Any], config: Mapping[str, Any]) -> list[str]:
  """'key: old -> new' for each SCHEDULE_KEYS value that differs between a run's saved
  config (its workdir's config.json, as a dict) and `config`; keys the saved one lacks are
  not compared."""
  changes = []
  for key in SCHEDULE_KEYS:
    old, new = _lookup(saved, key), _lookup(config, key)
    if old is None:
      continue
    old_flat, new_flat = _flat(old, key), _flat(new, key)
    for name in sorted(old_flat):
      # As saved (JSON): a tuple reads back as a list.
      if name in new_flat and old_flat[name] != json.loads(json.dumps(new_flat[name],
                                                                       default=str)):
        changes.append(f'{name}: {old_flat[name]!r} -> {new_flat[name]!r}')
  return changes


def check_schedule_unchanged(config: Mapping[str, Any], saved_config_path: str) -> None:
  """Raises ValueError naming the keys when resuming `config` would change the schedule of
  the run whose config was saved at `saved_config_path`, unless
  config.allow_schedule_change. A missing file is not checked."""
  if config['allow_schedule_change']:
    return
  try:
    with open(saved_config_path) as f:
      saved = json.load(f)
  except FileNotFoundError:
    return
  changes = schedule_changes(saved, config)
  if changes:
    raise ValueError(
        f'Resuming the run in {os.path.dirname(saved_config_path)} with another schedule: '
        f'{"; ".join(changes)}. The checkpoint\'s step, optimizer state and data position '
        'belong to the saved schedule (the data position to the saved record order: seed, '
        'datasets, mix and subset); '
        'set --config.allow_schedule_change=True to resume with the new values anyway, or use '
        'a new --workdir.')


def compilation_cache_dir(config: Mapping[str, Any]) -> str | None:
  """The persistent JAX compilation cache folder, or None when config says 'none'."""
  value = config['compilation_cache_dir']
  if value.lower() == 'none':
    return None
  if value:
    return value
  return str(cache.root() / 'jax')
