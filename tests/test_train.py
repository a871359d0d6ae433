"""The trainer in-process: sharding equivalence, eval counting, and clear errors."""
import itertools
import math
import re
import shutil

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import ml_collections
import numpy as np
import pytest

from bigpretrain import config_lib
from bigpretrain import evaluators
from bigpretrain import optim
from bigpretrain.runtime import metric_writers
from bigpretrain import sharding
from bigpretrain import train
from input_pipeline import datasets
from input_pipeline import pipeline
from input_pipeline import stream_position
from input_pipeline import subset
from tests import helpers


def _losses(config, devices, steps=3):
  """Losses of the first steps on `devices`, fed by the real pipeline."""
  exp = train.build(config, devices=devices)
  state = exp.init_state()
  step_fn = exp.train_step()
  it = pipeline.train_iterator(exp.dataset.source("train"), config.data,
                               global_batch_size=config.batch_size, seed=config.seed,
                               process_index=0, process_count=1)
  out = []
  with jax.set_mesh(exp.mesh):  # As train_and_evaluate runs its steps.
    for _ in range(steps):
      batch = next(it)
      batch.pop("_skipped")
      state, m = step_fn(state, sharding.global_batch(batch, exp.mesh), exp.frozen)
      out.append(float(m["train/loss"]))
  return np.array(out)


@pytest.mark.parametrize("mesh", [(8, 1, 1), (2, 4, 1), (2, 2, 2)])
def test_sharded_losses_match_one_device(mesh):
  one = helpers.tiny_config(**{"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1})
  ref = _losses(one, jax.devices()[:1])
  config = helpers.tiny_config(**{"mesh.data": mesh[0], "mesh.fsdp": mesh[1],
                                  "mesh.tensor": mesh[2]})
  got = _losses(config, jax.devices())
  assert np.all(np.isfinite(ref)) and len(set(ref.tolist())) == len(ref)
  np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


def test_params_are_sharded_by_logical_rules():
  config = helpers.tiny_config(**{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
  exp = train.build(config)
  specs = exp.shardings["params"]
  # ViT MLP: fc1 kernel is ('embed', 'mlp') -> ('fsdp', 'tensor'); LayerNorm scales replicated.
  fc1 = specs["blocks"][0]["mlp"]["fc1"]["kernel"].spec
  assert tuple(fc1) == ("fsdp", "tensor"), fc1
  state = exp.init_state()
  kernel = state["params"]["blocks"][0]["mlp"]["fc1"]["kernel"]
  assert kernel.sharding.spec == fc1
  # Adam moments follow the parameter they belong to.
  mu = [x for x in jax.tree.leaves(state["opt_state"]) if x.shape == kernel.shape]
  assert mu and all(x.sharding.spec == fc1 for x in mu)


_RULES = (("embed", "fsdp"), ("mlp", "tensor"), ("mlp", "fsdp"), ("embed", "tensor"),
          ("heads", None), ("heads", "tensor"))
_NAMES = (("embed", "mlp"), ("mlp", "embed"), ("embed", "mlp", "heads"),
          ("heads", None, "embed"), ("mlp", "heads"))


def _flax_spec(names, rules):
  return tuple(nn.logical_to_mesh_axes(names, rules))


def test_sharding_rules_are_read_as_flax_reads_them():
  # Every ordering of 4 of the rules (a name's several rules, and a None rule, among them).
  orderings = list(itertools.permutations(_RULES, 4))
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  for rules in orderings:
    for names in _NAMES:
      got = sharding.logical_to_mesh(names, (8,) * len(names), rules, mesh)
      assert tuple(got) == _flax_spec(names, rules), (rules, names)
  # A size-1 axis takes its dimension as in flax, sharding nothing.
  mesh = sharding.make_mesh({"data": 2, "fsdp": 4, "tensor": 1})
  for rules in orderings:
    for names in _NAMES:
      want = tuple(None if a == "tensor" else a for a in _flax_spec(names, rules))
      assert tuple(sharding.logical_to_mesh(names, (8,) * len(names), rules, mesh)) == want
  # An axis that does not divide its dimension ('embed': 6 over fsdp=4) is passed over: flax
  # on the rules without it.
  mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  for rules in orderings:
    for names in _NAMES:
      shape = tuple(6 if n == "embed" else 8 for n in names)
      fits = tuple(r for r in rules if r[0] not in names or r[1] is None or
                   shape[names.index(r[0])] % mesh.shape[r[1]] == 0)
      got = sharding.logical_to_mesh(names, shape, rules, mesh)
      assert tuple(got) == _flax_spec(names, fits), (rules, names)


def test_default_rules_shard_a_kernel_on_fsdp_by_whichever_channels_divide():
  """RegNetY-128GF's squeeze-excitation kernel: 726 input channels do not divide fsdp=8, its
  2904 outputs do (it was replicated on every device); a ViT's MLP kernel is unchanged."""
  rules = config_lib.base_config().sharding_rules
  mesh = sharding.make_mesh({"data": 1, "fsdp": 8, "tensor": 1})
  names = (None, None, "conv_in", "conv_out")
  assert sharding.logical_to_mesh(names, (1, 1, 726, 2904), rules, mesh) == (
      P(None, None, None, "fsdp"))
  assert sharding.logical_to_mesh(names, (3, 3, 2904, 2904), rules, mesh) == (
      P(None, None, "fsdp", None))
  mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  assert sharding.logical_to_mesh(names, (3, 3, 264, 528), rules, mesh) == (
      P(None, None, "fsdp", "tensor"))
  assert sharding.logical_to_mesh(("embed", "mlp"), (768, 3072), rules, mesh) == (
      P("fsdp", "tensor"))


class _Kernels(nnx.Module):
  """Parameters with logical names and nothing else: what param_report reads."""

  def __init__(self, shapes: dict):
    for name, (shape, names, dtype) in shapes.items():
      setattr(self, name, nnx.Param(jnp.zeros(shape, dtype), out_sharding=names))


def _abstract(shapes: dict):
  return nnx.state(nnx.eval_shape(lambda: _Kernels(shapes)), nnx.Param)


_CONV = (None, None, "conv_in", "conv_out")


def test_param_report_names_the_kernels_no_dimension_of_which_divides_fsdp():
  rules = config_lib.base_config().sharding_rules
  mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  abstract = _abstract({
      # 6 and 10 channels: neither divides fsdp=4; the outputs go on tensor=2 instead.
      "odd": ((3, 3, 6, 10), _CONV, jnp.float32),
      # 6 inputs do not divide fsdp, 8 outputs do: the fallback shards them on fsdp, and so
      # they are not on tensor, which they would have been.
      "fallback": ((3, 3, 6, 8), _CONV, jnp.float32),
      "conv": ((3, 3, 8, 16), _CONV, jnp.bfloat16),  # fsdp x tensor.
      "head": ((16, 7), ("embed", "classes"), jnp.float32),  # 7 classes: not on tensor.
      "bias": ((7,), (None,), jnp.float32),  # No rule wants it sharded.
  })
  report = sharding.param_report(abstract, rules, mesh)
  assert [(r.name, r.shape, r.axes, r.dims) for r in report.replicated] == [
      ("odd", (3, 3, 6, 10), {"fsdp": 4}, {"fsdp": (6, 10)}),
      ("fallback", (3, 3, 6, 8), {"tensor": 2}, {"fsdp": (6,)}),
      ("head", (16, 7), {"tensor": 2}, {"tensor": (7,)})]
  odd, fallback, head = report.replicated
  assert (odd.bytes, odd.device_bytes) == (3 * 3 * 6 * 10 * 4, 3 * 3 * 6 * 5 * 4)
  assert (fallback.bytes, fallback.device_bytes) == (3 * 3 * 6 * 8 * 4, 3 * 3 * 6 * 2 * 4)
  assert (head.bytes, head.device_bytes) == (16 * 7 * 4, 4 * 7 * 4)  # embed on fsdp.
  assert report.replicated_device_bytes == 1080 + 432 + 112
  held = 1080 + 3 * 3 * 6 * 2 * 4 + 3 * 3 * 2 * 8 * 2 + 112 + 7 * 4
  total = 2160 + 3 * 3 * 6 * 8 * 4 + 3 * 3 * 8 * 16 * 2 + 448 + 28
  assert (report.device_bytes, report.total_bytes, report.ideal_bytes) == (
      held, total, total // 8)
  # The same decision as the shardings the trainer places the params with.
  shardings = sharding.state_shardings(abstract, rules, mesh)
  assert report.device_bytes == sum(
      math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
      for s, a in zip(jax.tree.leaves(shardings), jax.tree.leaves(nnx.to_pure_dict(abstract))))
  assert shardings["odd"].spec == P(None, None, None, "tensor")
  assert shardings["fallback"].spec == P(None, None, None, "fsdp")
  # fsdp=2 divides 6 and 10 (and would put the fallback's inputs on fsdp, its outputs on
  # tensor); 7 classes on tensor only by padding.
  assert report.fitting_sizes() == {"fsdp": 2, "tensor": 1}
  assert sharding.logical_to_mesh(_CONV, (3, 3, 6, 8), rules, sharding.make_mesh(
      {"data": 2, "fsdp": 2, "tensor": 2})) == P(None, None, "fsdp", "tensor")
  advice = report.advice()
  assert "fsdp=2 divides them all" in advice and "multiple of 2" in advice
  assert "3 parameter arrays" in report.describe()
  assert "odd (3, 3, 6, 10) 1.08 kB on fsdp=4" in report.describe()


def test_param_report_is_empty_where_every_dimension_divides():
  rules = config_lib.base_config().sharding_rules
  mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  report = sharding.param_report(_abstract({
      "conv": ((3, 3, 8, 16), _CONV, jnp.float32),
      "head": ((16, 8), ("embed", "classes"), jnp.float32)}), rules, mesh)
  assert report.replicated == ()
  assert report.device_bytes == report.ideal_bytes == (3 * 3 * 8 * 16 + 16 * 8) * 4 // 8
  assert "replicated" not in report.describe()


class _StopBeforeState(Exception):
  pass


def test_the_trainer_warns_once_of_replicated_params(tmp_path, caplog, monkeypatch):
  """The demo's 100 classes do not divide tensor=8: the head stays whole on every device.
  Said before the state is created (which is where too little memory would fail); fsdp=8
  divides every array, and nothing is said."""
  def stop(exp):
    del exp
    raise _StopBeforeState()

  monkeypatch.setattr(train.Experiment, "init_state", stop)
  for mesh, warned in (((1, 1, 8), 1), ((1, 8, 1), 0)):
    caplog.clear()
    config = helpers.tiny_config(**{"mesh.data": mesh[0], "mesh.fsdp": mesh[1],
                                    "mesh.tensor": mesh[2]})
    with caplog.at_level("WARNING"), pytest.raises(_StopBeforeState):
      train.train_and_evaluate(config, str(tmp_path / str(mesh[2])))
    said = [r.getMessage() for r in caplog.records if "stay replicated" in r.getMessage()]
    assert len(said) == warned, (mesh, said)
    if warned:
      assert "head/kernel (128, 100)" in said[0] and "tensor=8" in said[0], said
      assert "tensor=4 divides them all" in said[0], said  # 100 = 4 x 25.


def test_a_resume_over_changed_train_data_is_refused_before_the_state_is_built(
    demo_run, tmp_path, monkeypatch):
  """The trained demo run's checkpoints count records of its 'demo' split: the same run over
  a split of another size stops before init_state (which compiles and fills the devices at
  scale), with the sizes named; allowed, it gets as far as building the state."""
  def stop(exp):
    del exp
    raise _StopBeforeState()

  workdir = tmp_path / "run"
  shutil.copytree(demo_run, workdir, ignore=shutil.ignore_patterns("*.lock", "log.*"))
  sizes = datasets.train_split_sizes
  monkeypatch.setattr(datasets, "train_split_sizes",
                      lambda *a: {k: v + 1 for k, v in sizes(*a).items()})
  monkeypatch.setattr(train.Experiment, "init_state", stop)
  config = helpers.tiny_config(total_steps=2)  # What demo_run trained.
  with pytest.raises(stream_position.StreamChanged, match=r"\(demo: \d+ records in the "):
    train.train_and_evaluate(config, str(workdir))
  config.allow_schedule_change = True
  with pytest.raises(_StopBeforeState):
    train.train_and_evaluate(config, str(workdir))
  # The same from another run's checkpoints (config.resume), and a folder that is not there.
  config = helpers.tiny_config(total_steps=2, resume=str(workdir))
  with pytest.raises(stream_position.StreamChanged, match=r"\(demo: \d+ records in the "):
    train.train_and_evaluate(config, str(tmp_path / "fine_tune"))
  config.resume = str(tmp_path / "nowhere")
  with pytest.raises(FileNotFoundError, match="nowhere does not exist"):
    train.train_and_evaluate(config, str(tmp_path / "fine_tune"))


def test_eval_counts_every_example_once_with_uneven_last_batch(tmp_path, capsys):
  config = helpers.tiny_config(batch_size=48)  # The validation split is not a multiple of 48.
  config.data.eval_split = "validation"
  exp = train.build(config)
  n = exp.dataset.info.num_examples["validation"]
  assert n % 48 != 0
  state = exp.init_state()
  [evaluator] = [e for e in evaluators.build(config, exp) if e.name == "eval"]
  results = evaluator.run(state)
  assert results["eval/num_examples"] == n
  assert 0.0 <= results["eval/top1"] <= results["eval/top5"] <= 1.0
  # A slice of the split, as tfds writes it: exactly those records.
  full = exp.dataset.source("validation")
  part = subset.split_source(exp.dataset, "validation[-40:]")
  assert [part[i]["label"] for i in range(40)] == [full[n - 40 + i]["label"] for i in range(40)]
  config.data.eval_split = "validation[-40:]"
  # A top-k past the classes is said, and reported as top-C (every class: all correct).
  config.evals.eval.topk = (1, 500)
  classes = exp.dataset.info.num_classes
  [evaluator] = [e for e in evaluators.build(config, exp) if e.name == "eval"]
  assert (f"WARNING: config.evals.eval.topk [500] exceed the {classes} classes of 'demo': "
          f"k={classes} (every class) is reported in their place.") in capsys.readouterr().out
  results = evaluator.run(state)
  assert results["eval/num_examples"] == 40 and results[f"eval/top{classes}"] == 1.0
  assert len(subset.split_source(exp.dataset, "validation[10:-20]")) == n - 30
  for bad, error in (("validation[5:5]", "holds no records"), ("validation[a:]", "NAME[START"),
                     ("nosuch[:3]", "Unknown split")):
    with pytest.raises(ValueError, match=re.escape(error)):
      subset.split_source(exp.dataset, bad)
  # An evaluator of the run's dataset in another folder reads that folder, not the run's.
  with config.unlocked():
    config.evals = ml_collections.ConfigDict({"eval": dict(
        type="classification", data_dir="/proc/no_such_dir")})
  with pytest.raises(FileNotFoundError, match="no_such_dir"):
    evaluators.build(config, exp)
  # The few-shot probe names its datasets and splits in `datasets`: the common keys are refused.
  with config.unlocked():
    config.evals = ml_collections.ConfigDict({"fewshot": dict(type="fewshot", split="train[:5]")})
  with pytest.raises(ValueError, match=r"evals.fewshot has unknown keys \['split'\]"):
    evaluators.build(config, exp)


def test_train_and_evaluate_writes_metrics(tmp_path, capsys):
  # num_epochs beside total_steps: total_steps sets the length, and the run says so.
  config = helpers.tiny_config(total_steps=4, eval_every_steps=2, num_epochs=90.0)
  results = train.train_and_evaluate(config, str(tmp_path))
  assert ("WARNING: config.num_epochs=90.0 is not used: config.total_steps=4 sets the run "
          "length") in capsys.readouterr().out
  rows = metric_writers.read_metrics(str(tmp_path))
  train_rows = [r for r in rows if "train/loss" in r]
  eval_rows = [r for r in rows if "eval/top1" in r]
  assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
  assert [r["step"] for r in eval_rows] == [2, 4]
  for key in ("train/grad_norm", "train/param_norm", "train/update_norm", "train/lr",
              "train/images_per_sec", "data/skipped_records"):
    assert key in train_rows[-1], key
  assert results["eval/semantic_top1"] == eval_rows[-1]["eval/semantic_top1"]
  assert list(tmp_path.glob("events.out.tfevents*")), "no TensorBoard event file"


def test_the_logged_lr_is_the_one_the_rows_step_applied(tmp_path):
  # Plain SGD (no momentum, weight decay or clipping): an optax update is -lr x gradient.
  config = helpers.tiny_config("single_label", **{
      "total_steps": 6, "log_every_steps": 3, "evals": ml_collections.ConfigDict(),
      "optim.name": "sgd", "optim.momentum": 0.0, "optim.weight_decay": 0.0,
      "optim.schedule.name": "cosine", "optim.schedule.warmup_steps": 6})
  train.train_and_evaluate(config, str(tmp_path))
  # The lr optax applies at each of the 6 updates, read off its updates of a unit gradient.
  tx, _ = optim.make_optimizer(config.optim, total_steps=6)
  params = {"w": jnp.ones(())}
  opt_state, applied = tx.init(params), []
  for _ in range(6):
    updates, opt_state = tx.update({"w": jnp.ones(())}, opt_state, params)
    applied.append(-float(updates["w"]))
  # Linear warmup from 0 over 6 steps: the k-th update applies (k - 1) / 6 of the peak.
  np.testing.assert_allclose(applied[:6], config.optim.lr * np.arange(6) / 6, rtol=1e-6)
  rows = [r for r in metric_writers.read_metrics(str(tmp_path)) if "train/loss" in r]
  assert [r["step"] for r in rows] == [3, 6]
  np.testing.assert_allclose([r["train/lr"] for r in rows], [applied[2], applied[5]],
                             rtol=1e-6)


def test_non_finite_loss_stops_naming_the_step(tmp_path):
  config = helpers.tiny_config(**{"optim.lr": 1e30, "optim.schedule.name": "constant"})
  with pytest.raises(FloatingPointError, match=r"diverged at step 2 \(non-finite loss nan\)"):
    train.train_and_evaluate(config, str(tmp_path))
  assert not (tmp_path / "checkpoints" / "6").exists()


def test_batch_size_must_divide_data_parallel_devices(tmp_path):
  config = helpers.tiny_config(batch_size=12)
  with pytest.raises(ValueError, match="batch_size=12 is not divisible by the 8 data-parallel"):
    train.build(config)


def test_mesh_must_match_device_count():
  config = helpers.tiny_config(**{"mesh.data": 3})
  with pytest.raises(ValueError, match="needs 3 devices, but 8 are available"):
    train.build(config)


def test_missing_dataset_dir_is_a_clear_error(tmp_path):
  config = helpers.tiny_config(**{"data.name": "tfds:cifar100", "data.dir": str(tmp_path / "no")})
  with pytest.raises(FileNotFoundError, match="no"):
    train.build(config)
