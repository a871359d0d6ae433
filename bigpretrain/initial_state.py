"""Where a run's first train state comes from, decided in one place.

The order: (1) resume from the newest readable checkpoint in the workdir (a re-run of the
same command), or from its step `config.resume_step` (going back: the later checkpoints are
moved to `checkpoints_superseded/`, so that they are not resumed from again); else (2)
resume from `config.resume` (another run's checkpoints, its step `config.resume_step` if
set: the whole train state and data position); else (3) initialise the weights from
`config.model_init` (fine-tuning: weights only, the optimizer and step start fresh;
`config.model_init_head` may then initialise the head); else (4) the scratch initialisation.
A checkpoint written for another configuration, or past the run's total_steps, stops the run
(checkpoint.CheckpointMismatch) at (1) or (2).

The EMA of the weights (config.ema) restarts from the starting weights unless the restored
checkpoint carried its own EMA. A resumed run trains on the class tree its checkpoint stores
(objectives.base.Objective.restore_meta), and stores it again; so does a run initialised from
a checkpoint of the same classes whose head it keeps.
"""
import functools
import os
import re

from absl import logging

from bigpretrain import checkpoint as ckpt_lib
from bigpretrain import config_lib
from bigpretrain.runtime import console
from bigpretrain import model_init
from input_pipeline import stream_position


def _refuse_past_end(step: int, total_steps: int, directory: str, source: str) -> None:
  """Raises CheckpointMismatch when the checkpoint to resume from, of `step`, is past the
  run's last step: the run would evaluate and log that state as step total_steps's."""
  if step > total_steps:
    raise ckpt_lib.CheckpointMismatch(
        f"checkpoint step {step} in {directory} is past total_steps={total_steps}: that "
        "state has trained beyond the end of this run. Raise total_steps to "
        f"{step} or more (with --config.allow_schedule_change=True), go back to a checkpoint "
        f"at or before step {total_steps} with --config.resume_step=N, or use another "
        f"{source}.")


def _refuse_another_schedule(config, total_steps: int, checkpointer: ckpt_lib.Checkpointer,
                             workdir: str) -> int | None:
  """Refuses resuming the workdir's checkpoints with another schedule, or past the run's
  end; returns the newest checkpoint step (None: none)."""
  latest = checkpointer.latest_step()
  if latest is not None:  # Resuming: the schedule must be the same.
    if config.resume_step < 0:  # Said first: allowing the schedule change would not resume it.
      _refuse_past_end(latest, total_steps, checkpointer.directory, "--workdir")
    config_lib.check_schedule_unchanged(config, os.path.join(workdir, "config.json"))
  return latest


def refuse_early(config, total_steps: int, checkpointer: ckpt_lib.Checkpointer, workdir: str,
                 records: dict) -> None:
  """The refusals restore_or_init makes for the checkpoints it would resume from, the
  workdir's or else config.resume's (a missing folder; another configuration, schedule or
  train data sizes `records`; the workdir's past the run's end), made before the state is
  built and compiled, so that a refused resume costs neither."""
  check = functools.partial(stream_position.check_records, records,
                            allow_other_records=config.allow_schedule_change)
  step = None if config.resume_step < 0 else config.resume_step
  checkpointer.refuse_another_configuration(check, step)
  if _refuse_another_schedule(config, total_steps, checkpointer, workdir) is None and (
      config.resume):
    other = ckpt_lib.Checkpointer(ckpt_lib.checkpoint_dir(config.resume), async_save=False,
                                  meta=checkpointer.meta, read_only=True)
    try:
      other.refuse_another_configuration(check, step)
    finally:
      other.close()


def restore_or_init(exp, state: dict, stream, checkpointer: ckpt_lib.Checkpointer,
                    workdir: str) -> tuple[dict, int]:
  """(the state to train from, its step). `exp`: the train.Experiment; `state`: its fresh
  initialisation; `stream`: the stream_position.TrainStream, restarted where the restored
  checkpoint's data stream stood (at the beginning otherwise)."""
  config = exp.config
  step = config.resume_step if config.resume_step >= 0 else None
  latest = _refuse_another_schedule(config, exp.total_steps, checkpointer, workdir)
  if latest is None and step is not None and not config.resume:
    raise ValueError(f"config.resume_step={step}: {checkpointer.directory} holds no "
                     "checkpoint (and config.resume is unset).")
  source, restored = "workdir", None
  if latest is not None or not config.resume:
    restored = checkpointer.restore(state, stream, step)
  if restored is not None:  # Before anything is set aside.
    _refuse_past_end(restored[1], exp.total_steps, checkpointer.directory, "--workdir")
  if restored is not None and step is not None and step < latest:
    moved, aside = checkpointer.set_aside_from(restored[1] + 1, "superseded")
    console.say(f"config.resume_step={step}: checkpoints {moved} moved to {aside}")
  if restored is None and config.resume:
    source = "resume"
    with_resume = ckpt_lib.Checkpointer(ckpt_lib.checkpoint_dir(config.resume),
                                        async_save=False, meta=checkpointer.meta,
                                        read_only=True)
    restored = with_resume.restore(state, stream, step)
    with_resume.close()
    if restored is None:
      raise FileNotFoundError(f"config.resume={config.resume!r} holds no checkpoint.")
    _refuse_past_end(restored[1], exp.total_steps, with_resume.directory, "--config.resume")
  start = 0
  if restored is not None:  # A checkpoint without a divergence record keeps the fresh one.
    restored_state, start = restored
    state = {"health": state["health"], **restored_state}
    console.say(f"Resuming from step {start} in "
                f"{with_resume.directory if source == 'resume' else workdir}")
    saved = (with_resume if source == "resume" else checkpointer).restored_meta
    if saved is not None and "class_tree" in exp.objective.meta() and "class_tree" not in saved:
      logging.info("Checkpoint step %d stores no class tree (written before trees were "
                   "stored): training on the tree built now.", start)
    _restore_objective(exp, saved, f"checkpoint step {start}")
  elif config.model_init:
    source = "model_init"
    loaded, fresh, resized, dropped = ckpt_lib.init_from(
        config.model_init, {"params": state["params"], "extra": state["extra"]},
        skip=config.model_init_skip,
        adapt=exp.model_def.param_adapter(config.model_init_resize,
                                          lambda: ckpt_lib.origin(config.model_init)))
    state = {**state, **loaded}
    console.say(f"Initialised from {config.model_init}; kept fresh: {fresh or 'nothing'}; "
                f"resized: {resized or 'nothing'}; not in this model, not loaded: "
                f"{dropped or 'nothing'}")
    _warn_other_normalize(config)
    if config.model_init_head:  # A registered hook, e.g. SWAG's zero-shot head.
      hook = model_init.HOOKS.get(config.model_init_head)
      state = {**state, "params": hook(config.model_init, state["params"],
                                       exp.dataset.info.class_names)}
    elif not any(re.search(ckpt_lib.HEAD_PATTERN, path) for path in fresh):
      # The head goes on from the checkpoint's (same classes): so does the tree it learnt.
      meta = ckpt_lib.read_meta(config.model_init, required=False)
      if meta and meta.get("class_names") == list(exp.dataset.info.class_names):
        _restore_objective(exp, meta, config.model_init)
  else:
    source = "scratch"  # init_state already set the EMA to the initial weights.
  if checkpointer.meta is not None:  # Its checkpoints store the tree it trains on.
    checkpointer.meta.update(exp.objective.meta())

  if "ema" in exp.shardings and (source == "model_init" or "ema" not in state):
    if restored is not None:
      console.warn("the checkpoint has no EMA weights (saved with config.ema off); the EMA "
                   f"starts from the weights of step {start}.")
    state = exp.restart_ema(state)
  return state, start


def _restore_objective(exp, saved: dict | None, where: str) -> None:
  """The objective takes back what the meta `saved` of the checkpoint its weights come from
  (`where`) stores (its class tree), and says when the tree built now differs from it."""
  change = exp.objective.restore_meta(saved or {})
  if change:
    console.warn(f"{where} was trained on another class tree than the one built now from its "
                 f"class list (checkpoint's -> now: {change}); training on with the "
                 "checkpoint's tree, which its level heads were trained for.")


def _warn_other_normalize(config) -> None:
  """Weights fed inputs normalised otherwise than in their training start from a shifted
  input; a recipe copies the checkpoint's preset, a hand-set model_init may not."""
  meta = ckpt_lib.read_meta(config.model_init, required=False)
  trained = (meta or {}).get("data", {}).get("normalize")
  if trained and trained != config.data.normalize:
    console.warn(f"{config.model_init} was trained on inputs normalised as {trained!r}; this "
                 f"run feeds it config.data.normalize={config.data.normalize!r} (set "
                 f"--config.data.normalize={trained} unless that is meant).")
