"""The one trainer: every recipe is a config plus extension points (objective, evaluators,
data source, sampler), never a fork of this loop.

State is a plain pytree {'step', 'params', 'extra', 'opt_state', 'skipped_records', 'health'}
('extra' holds non-parameter model state such as BatchNorm statistics; 'health' the step's
divergence record, see bigpretrain/divergence.py), plus 'ema' ({'params', 'extra'}, sharded
alike) when config.ema.momentum > 0, created already sharded on a
('data', 'fsdp', 'tensor') mesh and advanced by one `jax.jit` step with donated buffers.
"""
import contextlib
import dataclasses
import os
import time

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from bigpretrain import checkpoint as ckpt_lib
from bigpretrain import config_lib
from bigpretrain.runtime import console
from bigpretrain.runtime import distributed
from bigpretrain import divergence
from bigpretrain import evaluators as evaluators_lib
from bigpretrain.plan import flops
from bigpretrain.runtime import goodput as goodput_lib
from bigpretrain import initial_state
from bigpretrain.runtime import metric_writers
from bigpretrain import models
from bigpretrain import objectives
from bigpretrain import optim
from bigpretrain.runtime import preemption as preemption_lib
from bigpretrain import preprocess
from bigpretrain import sharding
from bigpretrain.runtime import workdir_lock
from input_pipeline import datasets
from input_pipeline import pipeline
from input_pipeline import stream_position


def rules_of(config) -> tuple:
  return tuple(tuple(r) for r in config.sharding_rules)


def variable_shardings(model_def: models.ModelDef, config, mesh) -> dict:
  """NamedShardings of {'params', 'extra'}: params by the logical rules, extra replicated."""
  return {"params": sharding.state_shardings(model_def.abstract_params, rules_of(config), mesh),
          "extra": sharding.state_shardings(model_def.abstract_extra, (), mesh)}


def state_shardings(model_def: models.ModelDef, tx, config, mesh):
  """NamedShardings of the train state: params by logical rules, optimizer state alike."""
  variables = variable_shardings(model_def, config, mesh)
  abstract_params = model_def.abstract_pure_params()
  abstract_opt = jax.eval_shape(tx.init, abstract_params)
  repl = sharding.replicated(mesh)
  opt = optax.tree_utils.tree_map_params(
      tx, lambda _, s: s, abstract_opt, variables["params"],
      transform_non_params=lambda _: repl)
  out = {"step": repl, **variables, "opt_state": opt, "skipped_records": repl,
         "health": {"losses": repl, "skipped_steps": repl, "bad_run": repl}}
  if config.ema.momentum > 0:
    out["ema"] = dict(variables)
  return out


def ema_update(ema, weights, momentum: float):
  """momentum * ema + (1 - momentum) * weights on floating-point leaves (as ClassyVision's
  EMA hook averages parameters and BatchNorm buffers); other leaves (e.g.
  integer counters, RNG keys) take the current value."""

  def update(e, w):
    if not jnp.issubdtype(w.dtype, jnp.inexact):
      return w
    return (momentum * e + (1.0 - momentum) * w).astype(w.dtype)

  return jax.tree.map(update, ema, weights)


def eval_weights(state: dict) -> dict:
  """The state the evaluators see: with EMA on, its 'params' and 'extra' are the EMA ones."""
  return {**state, **state["ema"]} if "ema" in state else state


def mixup_layout(config, mesh) -> tuple[int, int]:
  """(blocks, copies) for mixup.mix_batch: with repeated augmentation k > 1 the global batch
  is, process by process, k blocks of copies (pipeline.train_iterator), each mixed on its own;
  else one block, timm's pairing over the whole batch."""
  k = config.data.repeated_augment
  if k == 1 or not objectives.mixup_enabled(config.mixup):
    return 1, 1
  feeders = sharding.batch_processes(mesh)
  runs = [p for i, p in enumerate(feeders) if i == 0 or feeders[i - 1] != p]
  if len(runs) != len(set(runs)):
    logging.warning(
        "the mesh interleaves the processes' devices along the batch, so the mixup blocks "
        "do not follow the %d copies of repeated augmentation: copies of a record may be "
        "mixed with the same partner and lam", k)
  return len(set(feeders)) * k, k


def make_train_step(model_def: models.ModelDef, objective, tx, schedule, seed: int,
                    mixup_cfg, normalize: str, ema_momentum: float = 0.0,
                    divergence_cfg=None, mixup_blocks: tuple[int, int] = (1, 1)):
  """(state, batch, frozen) -> (state, metrics): loss, gradients, update and norms, on device;
  with ema_momentum > 0 also the EMA of the new weights (see ema_update).

  Each step is judged by divergence.assess (divergence_cfg: config.divergence; the metrics
  carry the verdict as '_healthy'); with the 'skip' policy a bad step leaves the weights,
  model state, optimizer state and EMA as they were.

  The batch's uint8 images are normalised by the `normalize` preset (config.data.normalize).
  With mixup/cutmix on, the batch gains 'targets' [B, C]: the objective's dense_targets,
  mixed in `mixup_blocks` = (blocks, copies) (mixup_layout); `frozen` is the objective's
  fixed input (e.g. a frozen model to distil from) or None.
  """
  use_mixup = objectives.mixup_enabled(mixup_cfg)
  divergence_cfg = divergence_cfg or config_lib.base_config().divergence

  def train_step(state, batch, frozen):
    # The key is made inside the step: an eager one would need a device to run on, which
    # the compile-only devices of an ahead-of-time plan (bigpretrain.plan.accelerators) are not.
    rng = jax.random.fold_in(jax.random.key(seed), state["step"])
    batch = {**batch, "image": preprocess.normalize(batch["image"], normalize)}
    if use_mixup:
      from bigpretrain import mixup  # pylint: disable=import-outside-toplevel
      rng, mix_rng = jax.random.split(rng)
      images, targets = mixup.mix_batch(
          mix_rng, batch["image"], objective.dense_targets(batch),
          mixup_alpha=mixup_cfg.mixup_alpha, cutmix_alpha=mixup_cfg.cutmix_alpha,
          switch_prob=mixup_cfg.switch_prob, label_smoothing=mixup_cfg.label_smoothing,
          blocks=mixup_blocks[0], copies=mixup_blocks[1])
      batch = {**batch, "image": images, "targets": targets}

    def loss_fn(params):
      model = model_def.merge(params, state["extra"])
      loss, aux = objective.loss(model, batch, rng, frozen)
      extra = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
      return loss, (aux, extra)

    (loss, (aux, extra)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    skip = divergence_cfg.policy == "skip"
    # One reduction per parameter for every norm, so the update stays in place on GPUs.
    norms = optim.global_norms(grads, updates, params, *([state["params"]] if skip else []))
    metrics = {
        "train/loss": loss,
        # optax.scale_by_learning_rate applies schedule(count) and then advances count; its
        # count starts at 0 with state['step'] and advances with it (skipped steps included:
        # divergence.keep_if), so this is the lr of this step's update.
        "train/lr": schedule(state["step"]),
        "train/grad_norm": norms[0],
        "train/update_norm": norms[1],
        **aux,
    }
    skipped = state["skipped_records"] + jnp.sum(batch.get("_skipped", 0))
    metrics["data/skipped_records"] = skipped
    healthy, median, health = divergence.assess(state["health"], loss, metrics["train/grad_norm"],
                                                divergence_cfg.loss_factor,
                                                divergence_cfg.min_rise)
    learned = {"params": params, "extra": extra, "opt_state": opt_state}
    if ema_momentum > 0:
      learned["ema"] = ema_update(state["ema"], {"params": params, "extra": extra},
                                  ema_momentum)
    if skip:
      learned = divergence.keep_if(healthy, learned, {k: state[k] for k in learned})
      health = {**health, "skipped_steps": health["skipped_steps"] + (~healthy).astype(jnp.int32)}
      metrics["train/skipped_steps"] = health["skipped_steps"]
    metrics["train/param_norm"] = (jnp.where(healthy, norms[2], norms[3]) if skip
                                   else norms[2])  # As kept.
    metrics.update({"_healthy": healthy, "_loss_median": median,
                    "_bad_run": health["bad_run"]})
    new_state = {"step": state["step"] + 1, **learned, "skipped_records": skipped,
                 "health": health}
    return new_state, metrics

  return train_step


def setup_compilation_cache(config) -> None:
  """Persistent XLA cache: a second run of the same config compiles in a fraction of the time."""
  path = config_lib.compilation_cache_dir(config)
  if path is None:
    return
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def _reports_last(key: str) -> bool:
  """Whether a metrics row reports `key` at its last step rather than as the interval mean:
  running counters, and the lr (a mean trails the lr the row's step applied)."""
  return key.startswith("data/") or key in ("train/skipped_steps", "train/lr")


class _Pending:
  """Per-step device metrics awaiting the next log step (no host sync in between)."""

  def __init__(self, monitor: divergence.Monitor):
    self.rows, self.images = [], 0
    self.monitor = monitor

  def add(self, step, metrics, images):
    self.rows.append((step, metrics))
    self.images += images

  def check(self):
    """Fetches the steps' metrics (the callers wait for them anyway: a log or a checkpoint)
    and has the monitor read their verdicts: raises divergence.Diverged as the policy says,
    and confirms the checkpoints whose state gave a good loss."""
    self.rows = jax.device_get(self.rows)
    self.monitor.observe(self.rows)

  def flush(self, timer: goodput_lib.IntervalTimer):
    """(the interval's host values: means, and last values of counters and the lr; the
    divergence.Diverged to raise once they are written, or None). Waits for the interval's
    steps (counted as `timer.blocked`: processes wait for each other here)."""
    with timer.blocked():
      try:
        self.check()
        error = None
      except divergence.Diverged as e:  # Raised by the caller, after the row that shows it.
        error = e
    rows = [m for _, m in self.rows]
    averaged = self._averaged(rows)
    # Running counters and the lr report the last step's value (the row's step is that
    # step); the rest, the mean ('_...': the divergence verdicts, read by the monitor only).
    out = {k: float(rows[-1][k] if _reports_last(k) else np.mean([m[k] for m in averaged]))
           for k in rows[-1] if not k.startswith("_")}
    # Over the interval's own time (timer: compile, evals and checkpoints excluded).
    out["train/images_per_sec"] = self.images / max(timer.wall_s, 1e-9)
    self.rows, self.images = [], 0
    return out, error

  def _averaged(self, rows: list) -> list:
    """The interval's rows its means are taken over. Under the skip policy a bad step applied
    no update, and its loss (NaN, or a spike) would hide the healthy steps': the healthy
    rows, or all of them when every step was bad (the row then shows the bad values)."""
    if self.monitor.policy != "skip":
      return rows
    return [m for m in rows if m["_healthy"]] or rows


class DataWorkerDied(RuntimeError):
  """A grain worker process died (most often killed by the out-of-memory killer)."""


class DeviceOutOfMemory(RuntimeError):
  """The devices ran out of memory (XLA's RESOURCE_EXHAUSTED) building, compiling or running
  a step."""


def out_of_device_memory(config, e: BaseException) -> DeviceOutOfMemory | None:
  """`e` as a DeviceOutOfMemory saying what to change, when it is XLA's RESOURCE_EXHAUSTED
  for memory ("Out of memory while trying to allocate", TPU's "Ran out of memory in memory
  space hbm"; not, e.g., a message past gRPC's size limit); else None."""
  text = str(e)
  if (not isinstance(e, jax.errors.JaxRuntimeError) or "RESOURCE_EXHAUSTED" not in text
      or "memory" not in text.lower()):
    return None
  first = text.strip().splitlines()[0][:300]
  return DeviceOutOfMemory(
      f"the devices ran out of memory ({first}). Lower config.batch_size={config.batch_size} "
      f"(over {jax.device_count()} devices), set config.model.remat (e.g. "
      "'nothing_saveable'), or shard the weights over more devices (config.mesh's fsdp); "
      "`python -m bigpretrain.tools.plan --config=... --topology=... --max_batch` finds the "
      "largest batch that fits, without a device.")


def _next_batch(train_iter, checkpointer: ckpt_lib.Checkpointer):
  """next(train_iter); a data worker's death raises DataWorkerDied (_raise_if_worker_died)."""
  try:
    return next(train_iter)
  except RuntimeError as e:
    _raise_if_worker_died(e, checkpointer)
    raise


def _raise_if_worker_died(e: RuntimeError, checkpointer: ckpt_lib.Checkpointer) -> None:
  """When `e` is a data worker's death (train or evaluation batches): DataWorkerDied, in one
  line, raised once the save in flight (if any) has completed."""
  death = pipeline.worker_death(e)
  if death is None:
    return
  checkpointer.wait()
  step = checkpointer.latest_step()
  resume = (f"resume from the last checkpoint (step {step})" if step is not None
            else "start over (no checkpoint was saved yet)")
  raise DataWorkerDied(
      f"{death}. Lower data.num_workers or data.prefetch, or give the job more memory, then "
      f"re-run the same command to {resume}.") from e


def _settle_saves(checkpointer: ckpt_lib.Checkpointer, error) -> None:
  """When an error stops the run (e.g. metrics.jsonl on a full disk): the save in flight
  completes, or what it left is removed; its own failure goes to the log, the error that
  stopped the run is the one reported."""
  if error is None or issubclass(error, ckpt_lib.CheckpointSaveError):
    return
  try:
    checkpointer.wait()
  except ckpt_lib.CheckpointSaveError as e:
    logging.warning("%s", e)


def _every(step: int, every: int, last: int) -> bool:
  return step == last or (every > 0 and step % every == 0)


@dataclasses.dataclass
class ModelSetup:
  """Mesh, dataset and model of a config: enough for inference and evaluation."""
  config: object
  mesh: jax.sharding.Mesh
  dataset: datasets.Dataset
  model_def: models.ModelDef
  shardings: dict  # At least {'params', 'extra'}.


@dataclasses.dataclass
class Experiment(ModelSetup):
  """Everything a run needs before its first step; shared by the trainer and the benchmarks.
  `shardings` covers the whole train state."""
  objective: objectives.base.Objective = None
  tx: optax.GradientTransformation = None
  schedule: object = None
  total_steps: int = 0
  frozen: object = None  # The objective's fixed inputs (e.g. a frozen model), already sharded.
  frozen_shardings: object = None

  @property
  def fields(self) -> dict:
    """The batch fields the objective reads, with their sizes (see pipeline.record_fields)."""
    return objectives.batch_fields(self.objective, self.dataset.info)

  def _init(self, rng) -> dict:
    params, extra = self.model_def.create(rng)
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "extra": extra,
             "opt_state": self.tx.init(params), "skipped_records": jnp.zeros((), jnp.int32),
             "health": divergence.init_health(self.config.divergence.window)}
    if "ema" in self.shardings:
      state["ema"] = jax.tree.map(jnp.copy, {"params": params, "extra": extra})
    return state

  def model_flops_per_device(self, state, batch, traced=None) -> float:
    """FLOPs per device of one train step on `batch` as the model defines them, MFU's: the
    step traced with XLA's kernels and no rematerialisation (ModelDef.for_model_flops;
    `traced`, this step's own trace, is counted where it is that already)."""
    reference = self.model_def.for_model_flops()
    if traced is None or reference is not self.model_def:
      with jax.set_mesh(self.mesh):
        traced = dataclasses.replace(self, model_def=reference).train_step().trace(
            state, batch, self.frozen)
    return flops.traced_flops_per_device(traced, self.mesh.size)

  def init_state(self) -> dict:
    """The train state, created directly with its shardings (no host copy of the params)."""
    return jax.jit(self._init, out_shardings=self.shardings)(jax.random.key(self.config.seed))

  def abstract_state(self) -> dict:
    """The train state as jax.ShapeDtypeStructs with their shardings: nothing is allocated
    (ahead-of-time compilation, bigpretrain.plan.aot_plan)."""
    shapes = jax.eval_shape(lambda: self._init(jax.random.key(self.config.seed)))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        shapes, self.shardings)

  def restart_ema(self, state: dict) -> dict:
    """The state with its EMA set to (a copy of) its current weights, e.g. after model_init."""
    if "ema" not in self.shardings:
      return state
    copy = jax.jit(lambda w: jax.tree.map(jnp.copy, w), out_shardings=self.shardings["ema"])
    return {**state, "ema": copy({"params": state["params"], "extra": state["extra"]})}

  def train_step(self):
    """The jitted step `(state, batch, frozen) -> (state, metrics)`; pass `self.frozen`."""
    fn = make_train_step(self.model_def, self.objective, self.tx, self.schedule,
                         self.config.seed, self.config.mixup, self.config.data.normalize,
                         self.config.ema.momentum, self.config.divergence,
                         mixup_layout(self.config, self.mesh))
    fn = sharding.with_rules(fn, rules_of(self.config))
    return jax.jit(fn, in_shardings=(self.shardings, sharding.batch_sharding(self.mesh),
                                     self.frozen_shardings),
                   out_shardings=(self.shardings, sharding.replicated(self.mesh)),
                   donate_argnums=(0,))


def warn_replicated_params(exp: ModelSetup) -> None:
  """Warns (once, before the state is created) of parameters the sharding rules leave whole
  on a mesh axis, a dimension they name not dividing it (sharding.param_report): the rules
  pass such dimensions over so that odd widths run, but on a large mesh the arrays can hold
  most of each device's parameter memory."""
  report = sharding.param_report(exp.model_def.abstract_params, rules_of(exp.config), exp.mesh)
  if report.replicated:
    console.warn(f"{report.describe()}. {report.advice()}")


def build_model(config, devices=None, dataset=None) -> ModelSetup:
  """Validates the config, then builds the mesh, the dataset and the model definition.
  `dataset` replaces config.data's (e.g. bigpretrain.plan.aot_plan's stand-in, with only its info)."""
  config_lib.validate(config)
  setup_compilation_cache(config)
  mesh = sharding.make_mesh(config.mesh, devices)
  sharding.check_batch_size(config.batch_size, mesh)
  dataset = datasets.get_dataset(config.data) if dataset is None else dataset
  model_def = models.ModelDef.from_config(config.model, dataset.info.num_classes,
                                          config.compute_dtype, config.data.image_size,
                                          platform=mesh.devices.flat[0].platform)
  return ModelSetup(config=config, mesh=mesh, dataset=dataset, model_def=model_def,
                    shardings=variable_shardings(model_def, config, mesh))


def build(config, devices=None, dataset=None, load_frozen: bool = True) -> Experiment:
  """build_model, then the objective (checked against the data and config) and optimizer.
  load_frozen=False leaves the objective's fixed inputs unread (a plan sets abstract ones)."""
  setup = build_model(config, devices, dataset)
  info = setup.dataset.info
  objective = objectives.get_objective(config.objective, info)
  objectives.check(objective, info, config)
  num_train = datasets.num_train_examples(config.data, setup.dataset)
  total_steps = config_lib.resolve_total_steps(config, num_train)
  logging.info("Run length: %s", config_lib.describe_duration(config, num_train))
  # total_steps = 0 evaluates only; the optimizer is built for one step and never used.
  tx, schedule = optim.make_optimizer(config.optim, total_steps=max(total_steps, 1),
                                      layers=setup.model_def.abstract_module())
  shardings = state_shardings(setup.model_def, tx, config, setup.mesh)
  sharding.log_shardings(shardings["params"], setup.model_def.abstract_pure_params())
  # E.g. a distillation teacher, sharded like the student.
  frozen, frozen_shardings = (objective.load_frozen(setup.mesh, rules_of(config),
                                                    config.compute_dtype, config.data)
                              if load_frozen else (None, None))
  return Experiment(config=config, mesh=setup.mesh, dataset=setup.dataset,
                    model_def=setup.model_def, shardings=shardings, objective=objective, tx=tx,
                    schedule=schedule, total_steps=total_steps, frozen=frozen,
                    frozen_shardings=frozen_shardings)


def make_train_iterator(exp: Experiment, position: stream_position.Position | None = None):
  """This host's train batches: data.train_split of the dataset, mixed with data.mix if set;
  only the fields the objective reads; from `position` of the global stream (default: its
  beginning)."""
  config = exp.config
  sources, weights = datasets.train_sources(config.data, exp.dataset)
  if len(sources) > 1:
    logging.info("Mixing train sources %s with weights %s", sources, weights)
  return pipeline.mixed_train_iterator(
      sources, weights, config.data, global_batch_size=config.batch_size, seed=config.seed,
      process_index=jax.process_index(), process_count=jax.process_count(), fields=exp.fields,
      position=position)


def train_and_evaluate(config, workdir: str, on_locked=None) -> dict:
  """Trains `config` in `workdir` (resuming if it holds a checkpoint); returns final metrics.
  Refuses (workdir_lock.WorkdirLocked) while another run uses `workdir`; `on_locked()` runs
  once this run holds it. A SIGTERM or Ctrl-C while the run is set up raises
  preemption.Interrupted (nothing new to save); in its loop, the run saves and returns {}."""
  # The handler first: a signal at any point after the lock is taken releases it, and one
  # before the set-up starts stops it there.
  with (preemption_lib.Preemption(in_set_up=True) as preemption,
        contextlib.ExitStack() as cleanup):
    lock = cleanup.enter_context(workdir_lock.WorkdirLock(workdir))
    preemption.on_abort = lock.release
    if on_locked is not None:
      on_locked()
    try:
      return _train_and_evaluate(config, workdir, cleanup, preemption)
    except jax.errors.JaxRuntimeError as e:
      oom = out_of_device_memory(config, e)
      if oom is None:
        raise
      raise oom from e


@dataclasses.dataclass
class _StepOutputs:
  """What a run does after each step: metric rows, evaluations and checkpoints, as due."""
  config: object
  total_steps: int
  evaluators: list
  writer: metric_writers.MetricWriter
  checkpointer: ckpt_lib.Checkpointer
  train_iter: stream_position.TrainStream
  perf: goodput_lib.Goodput
  profiler: goodput_lib.Profiler
  bar: object  # metric_writers.progress_bar
  pending: _Pending
  compile_s: float | None = None  # Logged once, in the first row.
  results: dict = dataclasses.field(default_factory=dict)  # The latest evaluations.

  def run_evals(self, step: int, state: dict, force: bool = False) -> dict:
    """Runs the evaluators due at `step` (all with `force`); writes one row; returns it."""
    results = {}
    for ev in self.evaluators:
      if force or _every(step, ev.every_steps, self.total_steps):
        try:
          results.update(ev.run(eval_weights(state)))
        except RuntimeError as e:
          _raise_if_worker_died(e, self.checkpointer)
          raise
    if results:
      self.writer.write(step, results)
    return results

  def log_evaluate_save(self, step: int, state: dict, step_metrics: dict,
                        preemption: preemption_lib.Preemption) -> bool:
    """After step `step`: its metrics row, evaluations and checkpoint, each when due.
    Returns True when the processes agreed to stop (preemption), the checkpoint saved."""
    config, total_steps, timer = self.config, self.total_steps, self.perf.timer
    log = _every(step, config.log_every_steps, total_steps)
    with timer.blocked():
      stop = preemption.agreed(log)
    self.checkpointer.check()  # A failed asynchronous save stops the run now, not at the next.
    self.profiler.after_step(step, step_metrics, timer)
    if log or stop:
      row = self._write_interval(step)
      self.bar.set_postfix(loss=f"{row['train/loss']:.4f}",
                           img_s=f"{row['train/images_per_sec']:.0f}")
    if stop:
      self.profiler.close()
      self.checkpointer.save(step, state, self.train_iter)
      self.checkpointer.wait()
      console.say(f"Preempted: saved checkpoint at step {step}; exiting.")
      self.writer.close()
      return True
    save = _every(step, config.ckpt_every_steps, total_steps)
    if save or any(_every(step, ev.every_steps, total_steps) for ev in self.evaluators):
      with timer.blocked():  # The steps so far belong to the interval, not to the evals.
        jax.block_until_ready(step_metrics)
        try:
          self.pending.check()  # No evaluation or checkpoint of a diverged state.
          diverged = None
        except divergence.Diverged as e:
          diverged = e
      if diverged:
        self._write_interval(step)  # Its rows, the bad step's among them, then the error.
        raise diverged
      with timer.excluded():
        if save:  # First: a preemption during a long evaluation finds it taken.
          self.checkpointer.save(step, state, self.train_iter)
        self.results.update(self.run_evals(step, state))
    return False

  def _write_interval(self, step: int) -> dict:
    """Writes the metrics row of the steps since the last one (at `step`) and returns it;
    raises divergence.Diverged after writing it when one of them diverged."""
    row, diverged = self.pending.flush(self.perf.timer)
    row.update(self.perf.metrics())
    if self.compile_s is not None:
      row["perf/compile_s"], self.compile_s = self.compile_s, None
    self.writer.write(step, row)
    if diverged:
      raise diverged
    return row


def _logged_evals(workdir: str, step: int) -> dict:
  """The evaluations an earlier run of `workdir` logged at `step` ({} if none)."""
  try:
    rows = metric_writers.read_metrics(workdir)
  except FileNotFoundError:
    return {}
  found = {}
  for row in rows:
    if row.get("step") == step and "train/loss" not in row:
      found.update({k: v for k, v in row.items() if k != "step"})
  return found


def _process_0_says(flag: bool) -> bool:
  """Process 0's `flag`, on every process (they must take the same branch)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


def _train_and_evaluate(config, workdir: str, cleanup: contextlib.ExitStack,
                        preemption: preemption_lib.Preemption) -> dict:
  preemption.setting_up(True)  # Until the loop: a signal stops the run, nothing to save.
  exp = build(config)
  mesh, dataset, total_steps = exp.mesh, exp.dataset, exp.total_steps
  is_main = jax.process_index() == 0
  if config.total_steps >= 0 and config.num_epochs > 0:  # A recipe sets one of the two.
    console.warn(f"config.num_epochs={config.num_epochs} is not used: config.total_steps="
                 f"{config.total_steps} sets the run length (total_steps=-1 trains by epochs).")
  evaluators = evaluators_lib.build(config, exp)
  meta = ckpt_lib.run_meta(config, exp.model_def.config(), dataset.info.class_names,
                           dataset.info.num_classes, exp.objective.meta())
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       keep=config.keep_ckpts, meta=meta)
  cleanup.push(lambda error, *_: _settle_saves(checkpointer, error))
  records = datasets.train_split_sizes(config.data, dataset)
  initial_state.refuse_early(config, total_steps, checkpointer, workdir, records)
  warn_replicated_params(exp)
  state = exp.init_state()
  # Rebuilt by the restore at the checkpoint's stream position (on any topology).
  num_workers = config.data.get("num_workers", pipeline.data_defaults().num_workers)
  on_host, first_on_host = distributed.processes_on_this_host()
  shortfall = pipeline.shared_memory_shortfall(  # The train stream's workers wait in evals.
      config.data, config.batch_size // jax.process_count(), 2 if evaluators else 1, on_host)
  if shortfall and first_on_host:
    console.warn(shortfall)
  train_iter = stream_position.TrainStream(
      lambda pos: make_train_iterator(exp, pos), num_workers, records=records,
      allow_other_records=config.allow_schedule_change)
  cleanup.callback(lambda: train_iter.close())  # The iterator a restore rebuilt, too.
  state, start = initial_state.restore_or_init(exp, state, train_iter, checkpointer, workdir)
  if "ema" in state:
    console.say(f"EMA of the weights on (momentum {config.ema.momentum}): the evaluators "
                "evaluate the EMA weights.")

  if is_main:  # What `bigpretrain.tools.predict` and later readers rebuild the model from.
    path = os.path.join(workdir, "config.json")  # Whole or not at all: resumes read it.
    with open(path + ".tmp", "w") as f:
      f.write(config.to_json_best_effort(indent=2))
    os.replace(path + ".tmp", path)
  writer = metric_writers.MetricWriter(workdir, enabled=is_main)
  cleanup.callback(writer.close)  # Also when the run stops on an error: nothing left to flush.
  step_fn = exp.train_step()

  perf = goodput_lib.Goodput(config.compute_dtype)
  timer = perf.timer
  profiler = goodput_lib.Profiler(
      config.profile_steps, os.path.join(workdir, "profile", f"process_{jax.process_index()}"),
      total_steps)
  cleanup.callback(profiler.close)  # A run that stops inside the window still writes it.
  input_delay = goodput_lib.input_delay()
  preemption.setting_up(False)
  # Drawn once the set-up is over: a signal during the set-up leaves its one line alone.
  bar = metric_writers.progress_bar(total_steps, start, enabled=is_main)
  cleanup.callback(bar.close)  # Before an error line, not redrawn after it at exit.
  out = _StepOutputs(config=config, total_steps=total_steps, evaluators=evaluators,
                     writer=writer, checkpointer=checkpointer, train_iter=train_iter,
                     perf=perf, profiler=profiler, bar=bar,
                     pending=_Pending(divergence.Monitor(config, checkpointer)))
  # The mesh context lets model code see the data-parallel layout (efficient stochastic depth);
  # the rules, its logical constraints: every step traced from here on (train and evaluators,
  # the evaluation owed at a resume and the final one included) is traced with both.
  with jax.set_mesh(mesh), sharding.use_rules(rules_of(config)):
    if 0 < start < total_steps and any(_every(start, ev.every_steps, total_steps)
                                       for ev in evaluators):
      # Preempted at an evaluation step (the save comes first): that evaluation is still owed.
      if not _process_0_says(bool(_logged_evals(workdir, start)) if is_main else False):
        with timer.excluded():  # Not the first train row's step time.
          out.run_evals(start, state)
    for step in range(start + 1, total_steps + 1):
      with timer.excluded():
        profiler.before_step(step)
      with timer.data_wait():
        batch = _next_batch(train_iter, checkpointer)
        if input_delay:
          time.sleep(input_delay)
      batch = sharding.global_batch(batch, mesh)
      if step == start + 1:  # FLOPs from the trace; compiled ahead (reused below) and timed.
        with timer.excluded():
          t0 = time.perf_counter()
          traced = step_fn.trace(state, batch, exp.frozen)
          perf.set_flops(exp.model_flops_per_device(state, batch, traced))
          traced.lower().compile()
          out.compile_s = time.perf_counter() - t0
      state, step_metrics = step_fn(state, batch, exp.frozen)
      out.pending.add(step, step_metrics, config.batch_size)
      timer.steps += 1
      bar.update(1)
      if out.log_evaluate_save(step, state, step_metrics, preemption):
        return {}
    bar.close()
    checkpointer.wait()
    checkpointer.close()
    batch = None  # Freed with the stream's batches (TrainStream.close).
    train_iter.close()  # Its workers' cores and memory go to the final evaluation.
    results = out.results
    if not results and start >= total_steps:  # A finished run, run again.
      results = _logged_evals(workdir, total_steps) if is_main else {}
      if _process_0_says(bool(results)):
        console.say(f"The run had finished; its final eval is in {workdir}/metrics.jsonl.")
      else:  # Stopped between its last save and its final eval.
        results = out.run_evals(total_steps, state, force=True)
  writer.close()
  summary = " ".join(f"{k}={v:.4f}" for k, v in sorted(results.items())
                     if not k.endswith("num_examples"))
  if is_main:
    console.say(f"Final eval at step {total_steps}: {summary}")
  return results
