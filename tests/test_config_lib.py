"""Tests for bigpretrain.config_lib: base keys, recipe-arg parsing, validation, durations."""
import ml_collections
import pytest

from bigpretrain import config_lib
from input_pipeline import datasets


def _valid(**overrides):
  c = config_lib.base_config()
  c.total_steps = 100
  for k, v in overrides.items():
    c[k] = v
  return c


def test_base_config_defaults():
  c = config_lib.base_config()
  assert (c.seed, c.total_steps, c.num_epochs, c.num_examples) == (0, -1, -1.0, -1)
  assert (c.batch_size, c.log_every_steps, c.eval_every_steps, c.ckpt_every_steps,
          c.keep_ckpts) == (256, 50, 1000, 1000, 3)
  assert c.compute_dtype == 'float32' and c.resume == '' and c.model_init == ''
  assert c.mesh.to_dict() == {'data': -1, 'fsdp': 1, 'tensor': 1}
  assert c.sharding_rules[0] == ('embed', 'fsdp') and isinstance(c.sharding_rules, tuple)
  assert (c.model.name, c.data.name, c.data.dir, c.objective.name) == ('vit_demo', 'demo', '',
                                                                      'softmax')
  assert c.evals.eval.type == 'classification' and tuple(c.evals.eval.topk) == (1, 5)
  assert c.optim.schedule.name == 'cosine'


def test_validate_locks_and_returns_config():
  c = config_lib.validate(_valid())
  c.batch_size = 128  # Values stay overridable.
  with pytest.raises(AttributeError):
    c.batchsize = 128  # New keys do not.


# ---------------------------------------------------------------- parse_arg


def test_parse_arg_types():
  defaults = dict(model='vit_b16', runlocal=False, epochs=90, lr=1e-3, data_dir=None)
  got = config_lib.parse_arg('model=vit_l16,runlocal=true,epochs=300,lr=2e-4,data_dir=/d/x=y',
                             **defaults)
  assert got.to_dict() == dict(model='vit_l16', runlocal=True, epochs=300, lr=2e-4,
                               data_dir='/d/x=y')
  assert isinstance(got.epochs, int) and isinstance(got.lr, float)
  assert config_lib.parse_arg('lr=1', **defaults).lr == 1.0
  assert config_lib.parse_arg(None, **defaults).to_dict() == defaults
  assert config_lib.parse_arg('', **defaults).model == 'vit_b16'
  for text, value in (('True', True), ('1', True), ('false', False), ('0', False)):
    assert config_lib.parse_arg(f'runlocal={text}', **defaults).runlocal is value
  assert config_lib.parse_arg('runlocal', **defaults).runlocal is True


@pytest.mark.parametrize('arg, match', [
    ('modle=vit', r"'modle' is unknown \(did you mean 'model'\?\); valid keys: \['epochs', "
                  r"'lr', 'model', 'runlocal'\]"),
    ('xyz=1', r"'xyz' is unknown; valid keys"),
    ('epochs=ninety', r"epochs='ninety'.*int"),
    ('epochs=1.5', r"epochs='1.5'.*int"),
    ('lr=fast', r"lr='fast'.*float"),
    ('runlocal=yes please', r"runlocal='yes please'.*bool"),
    ('epochs', r"'epochs' needs a value"),
    ('lr=1,lr=2', r"'lr' is given twice"),
])
def test_parse_arg_errors(arg, match):
  with pytest.raises(ValueError, match=match):
    config_lib.parse_arg(arg, model='vit', runlocal=False, epochs=90, lr=1e-3)


# ---------------------------------------------------------------- validate errors


def _raises(config, key):
  with pytest.raises(ValueError, match=key.replace('.', r'\.')):
    config_lib.validate(config)


def test_unknown_top_level_key_from_recipe():
  c = _valid()
  c.batchsize = 512  # Typo added by a recipe.
  with pytest.raises(ValueError, match=r"config\.batchsize.*did you mean 'batch_size'"):
    config_lib.validate(c)
  config_lib.validate(c, extra_keys=('batchsize',))  # Allowed when a caller says so.


def test_unknown_keys_in_closed_sections():
  c = _valid()
  c.mesh.dat = 2
  _raises(c, 'mesh.dat')
  c = _valid()
  c.optim.weight_decy = 0.1
  _raises(c, 'optim.weight_decy')
  c = _valid()
  c.optim.schedule.warmup_step = 3
  _raises(c, 'optim.schedule.warmup_step')


def test_open_sections_accept_recipe_kwargs():
  c = _valid()
  c.model.drop_path_rate = 0.1
  c.objective.label_smoothing = 0.2
  config_lib.validate(c)


def test_misspelt_data_key_is_refused_with_its_close_match():
  c = _valid()
  c.data.image_size, c.data.num_workers = 64, 2  # The pipeline's keys (data_defaults()).
  config_lib.validate(c)
  c = _valid()
  c.data.num_worker = 8  # Would run with data.num_workers' default, 0, unsaid.
  with pytest.raises(ValueError, match=r"config\.data\.num_worker is not a known key "
                     r"\(did you mean 'num_workers'\?\)"):
    config_lib.validate(c)
  c = _valid()
  c.data.shufle_buffer = 1000  # No data key is close: still refused, naming the key.
  _raises(c, 'data.shufle_buffer is not a known key')


# A data source taking its own config.data key (datasets.data_keys), as a plugin's would: by
# the decorator on a loader function, or as a loader class's attribute.
@datasets.SOURCES.register('cfgtest_fn:')
@datasets.data_keys('crop_jitter')
def _cfgtest_loader(name, data_dir):
  raise NotImplementedError(name, data_dir)  # validate() opens no dataset.


class _CfgTestDataset(datasets.Dataset):
  data_keys = ('crop_jitter',)


datasets.SOURCES.register('cfgtest_cls:', _CfgTestDataset)


def _with_crop_jitter(name, mix):
  c = _valid()
  c.data.name, c.data.mix, c.data.crop_jitter = name, mix, 0.1
  return c


@pytest.mark.parametrize('name, mix, other_name, other_mix', [
    ('cfgtest_fn:x', '', 'tfds:x', ''),
    ('cfgtest_cls:x', '', 'demo', ''),
    ('demo', 'cfgtest_fn:x=0.2', 'demo', 'folder:y=0.2'),
])
def test_a_source_declared_data_key_is_valid_only_where_that_source_is_named(
    name, mix, other_name, other_mix):
  config_lib.validate(_with_crop_jitter(name, mix))
  with pytest.raises(ValueError, match=rf'config\.data\.crop_jitter is not a known key; '
                     rf'valid with data\.name={other_name!r}'):
    config_lib.validate(_with_crop_jitter(other_name, other_mix))


def test_declared_data_keys_of_the_builtin_hashtag_sources_and_their_misspellings():
  c = _valid()
  c.data.name, c.data.crop_jiter = 'cfgtest_fn:x', 0.1  # The declared key, misspelt.
  with pytest.raises(ValueError, match=r"config\.data\.crop_jiter .*did you mean 'crop_jitter'"):
    config_lib.validate(c)
  # The built-in hashtag sources declare data.resample_alpha (SWAG's head share).
  c = _valid()
  c.data.name, c.data.resample_alpha = 'hashtags:demo', 0.5
  config_lib.validate(c)
  c.data.name = 'demo'  # The refusal names the sources that read the key.
  with pytest.raises(ValueError, match=r"data\.resample_alpha is not a known key.*\(Declared "
                     r"by the data sources 'hashtags:NAME', 'hashtags:demo': valid only where "
                     r"data\.name or data\.mix names one of them\.\)"):
    config_lib.validate(c)


def test_an_unknown_source_is_named_before_the_keys_it_might_declare():
  c = _valid()
  c.data.name, c.data.crop_jitter = 'cfgtest_fm:x', 0.1
  with pytest.raises(ValueError, match=r"config\.data\.name='cfgtest_fm:x' is not a known "
                     r"dataset\. Did you mean 'cfgtest_fn:'"):
    config_lib.validate(c)
  c.data.name, c.data.mix = 'demo', 'cfgtest_fm:x=0.2'
  with pytest.raises(ValueError, match=r"config\.data\.mix entry 'cfgtest_fm:x' is not a "
                     r"known dataset \(did you mean 'cfgtest_fn:'\?\)"):
    config_lib.validate(c)


def test_missing_required_keys():
  c = _valid()
  del c['keep_ckpts']
  _raises(c, 'keep_ckpts')
  c = _valid()
  del c.model['name']
  _raises(c, 'model.name')
  c = _valid()
  del c.optim['lr']
  _raises(c, 'optim.lr')


@pytest.mark.parametrize('key, value', [
    ('batch_size', 0), ('batch_size', -8), ('log_every_steps', -1), ('log_every_steps', 0),
    ('eval_every_steps', -5), ('ckpt_every_steps', -1), ('keep_ckpts', 0),
    ('compute_dtype', 'float16'), ('compilation_cache_dir', 3),
    ('model_init_skip', '^params/(head'),
])
def test_bad_top_level_values(key, value):
  c = config_lib.base_config().to_dict()  # A plain dict: any type can be planted.
  c['total_steps'] = 100
  c[key] = value
  with pytest.raises(ValueError, match=rf'config\.{key}'):
    config_lib.validate(ml_collections.ConfigDict(c))


def test_zero_eval_and_ckpt_steps_are_fine():
  config_lib.validate(_valid(eval_every_steps=0, ckpt_every_steps=0))


@pytest.mark.parametrize('mesh, key', [
    (dict(data=0, fsdp=1, tensor=1), 'mesh.data'),
    (dict(data=-2, fsdp=1, tensor=1), 'mesh.data'),
    (dict(data=2, fsdp=1.5, tensor=1), 'mesh.fsdp'),
    (dict(data=-1, fsdp=-1, tensor=1), 'mesh.fsdp'),
    (dict(data=4, fsdp=2, tensor=True), 'mesh.tensor'),
])
def test_bad_mesh(mesh, key):
  c = config_lib.base_config().to_dict()
  c['total_steps'] = 100
  c['mesh'] = mesh
  _raises(ml_collections.ConfigDict(c), key)


def test_good_mesh():
  c = _valid()
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, -1, 2
  config_lib.validate(c)


def test_no_duration():
  c = config_lib.base_config()
  with pytest.raises(ValueError, match=r'config\.total_steps.*num_epochs.*num_examples'):
    config_lib.validate(c)


def test_bad_optim_values_name_the_key():
  c = _valid()
  c.optim.name = 'adagrad'
  _raises(c, 'optim.name')
  c = _valid()
  c.optim.schedule.name = 'linear'
  _raises(c, 'optim.schedule.name')
  c = _valid()
  c.optim.lr = 0.0
  _raises(c, 'optim.lr')


def test_bad_sharding_rules():
  c = _valid()
  c.sharding_rules = (('embed', 'fsdp'), ('mlp', 'model'))
  _raises(c, 'sharding_rules')


# ---------------------------------------------------------------- durations


def test_total_steps_wins():
  c = _valid(total_steps=10, num_epochs=90.0, num_examples=10 ** 9)
  assert config_lib.resolve_total_steps(c, 1000) == 10
  assert config_lib.resolve_total_steps(c) == 10  # No dataset size needed.


def test_epochs_then_examples_with_ceil():
  c = _valid(total_steps=-1, num_epochs=2.5, num_examples=999, batch_size=256)
  assert config_lib.resolve_total_steps(c, 1000) == 10  # ceil(2500 / 256) = 10.
  c.num_epochs = 3.0
  assert config_lib.resolve_total_steps(c, 1024) == 12  # 3072 / 256 exactly.
  c.num_epochs = -1.0
  assert config_lib.resolve_total_steps(c, 1000) == 4  # ceil(999 / 256) = 4.
  c.num_examples = -1
  with pytest.raises(ValueError, match=r'config\.total_steps'):
    config_lib.resolve_total_steps(c, 1000)


def test_epochs_need_dataset_size():
  c = _valid(total_steps=-1, num_epochs=1.0)
  with pytest.raises(ValueError, match=r'config\.num_epochs'):
    config_lib.resolve_total_steps(c, None)


def test_warmup_longer_than_run_checked_in_resolve():
  c = _valid(total_steps=-1, num_epochs=1.0, batch_size=10)
  c.optim.schedule.warmup_steps = 20
  config_lib.validate(c)  # Fine until the run length is known.
  with pytest.raises(ValueError, match=r'optim\.schedule\.warmup_steps'):
    config_lib.resolve_total_steps(c, 150)  # 15 steps.
  assert config_lib.resolve_total_steps(c, 200) == 20


def test_describe_duration():
  c = _valid(total_steps=-1, num_epochs=2.0, batch_size=100)
  text = config_lib.describe_duration(c, 1000)
  assert text.startswith('20 steps') and 'num_epochs=2.0' in text and '2 epochs' in text


def test_compilation_cache_dir(monkeypatch):
  monkeypatch.setenv('BIGPRETRAIN_CACHE', '/tmp/bp')
  c = _valid()
  assert config_lib.compilation_cache_dir(c) == '/tmp/bp/jax'
  c.compilation_cache_dir = 'None'
  assert config_lib.compilation_cache_dir(c) is None
  c.compilation_cache_dir = '/x/cc'
  assert config_lib.compilation_cache_dir(c) == '/x/cc'
