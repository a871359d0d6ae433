"""Orbax checkpoints: params, optimizer state and the grain iterator, saved asynchronously.

Items: 'params' ({'params', 'extra'}: the raw weights training resumes from), 'ema' (the
same structure, only when config.ema is on: the EMA weights), 'train' ({'step', 'opt_state',
'skipped_records', 'health': the divergence record}), 'data' (the grain iterator, one file
per process), 'data_position' (JSON: the process count, data.num_workers, the sizes of the
train sources and the stream_position.Position the train stream started from) and 'meta'
(JSON: the model config, class names, dataset and input settings, so that a checkpoint path
alone rebuilds the model, and the class tree of an objective trained on one; see
`run_meta`). Arrays are
restored onto the current mesh's shardings, whatever mesh saved them; the train stream
resumes from grain's own state on the same topology and from the global stream position on
another (see _data_plan). A checkpoint written for another configuration (its 'meta' names
another model, class list or objective, or its arrays do not fit the state) is refused with
the differing keys named, and nothing is moved; one whose data cannot be read is moved aside
to `<dir>_corrupt/` (never over an earlier copy there) and the previous one used. A read that
fails for the storage, network or memory (runtime.transient) stops the run with nothing
moved: a re-run retries it.

Rotation keeps the `keep` newest checkpoints whose state is known good (its loss, measured
by the next step, was good: see bigpretrain/divergence.py) and every newer one; a diverged run
moves the checkpoints of its diverging state to `<dir>_diverged/`, so the newest checkpoint
taken before it is never rotated out, nor a diverged one resumed from.

Consumers of the weights (model_init, teachers, load_pretrained) read the 'ema' item when
there is one: the weights the run evaluated.
"""
import contextlib
import json
import logging as logging_std
import os
import re
import shutil
import sys

from absl import logging
import grain
import jax
from jax.experimental import multihost_utils
import orbax.checkpoint as ocp

from bigpretrain import registry
from bigpretrain.runtime import console
from bigpretrain.runtime import transient
from input_pipeline import stream_position


def _target(x):
  """Shape/dtype/sharding target of one array; without a sharding it restores onto the first
  device (a checkpoint saved on any mesh loads on a laptop)."""
  x = ocp.utils.to_shape_dtype_struct(x)
  if getattr(x, "sharding", None) is None:
    x = jax.ShapeDtypeStruct(x.shape, x.dtype,
                             sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
  return x


def _abstract(tree):
  return jax.tree.map(_target, tree)


_READ_ERROR = "Encountered error while reading array index"
# The step folders `Checkpointer.restore` reported unreadable, each ending in "/": the storage
# layer's errors name the files they failed on.
_REPORTED: set[str] = set()


def _echo(text: str) -> bool:
  """Whether `text` is the storage layer's error of a checkpoint already reported."""
  return _READ_ERROR in text or any(folder in text for folder in _REPORTED)


class _DropFailedReads(logging_std.Filter):
  """Drops the log records of a failed restore's other reads: Orbax raises one error per
  array (`Encountered error while reading array index`, or a TensorStore error naming the
  file), the restore reports the first, and asyncio logs each of the rest when its task is
  collected ('Task exception was never retrieved'), a traceback each, possibly after the
  log's files are closed at exit."""

  def filter(self, record):
    text = record.getMessage()
    if ("Task exception was never retrieved" in text and "orbax" in text) or _READ_ERROR in text:
      return False
    error = record.exc_info[1] if record.exc_info else None  # restore's own lines have none.
    while error is not None:
      if _echo(str(error)):
        return False
      error = error.__cause__ or error.__context__
    return True


def _quiet_storage_noise() -> None:
  """Silences the echoes of a failed restore; the failure itself is reported once by
  `restore`. After it, the storage layer's reads still in flight complete into the
  restore's closed asyncio loop and each reports 'RuntimeError: Event loop is closed' as an
  unraisable exception; its other failed reads are logged (see _DropFailedReads)."""
  for name in ("asyncio", "absl"):
    logger = logging_std.getLogger(name)
    if not any(isinstance(f, _DropFailedReads) for f in logger.filters):
      logger.addFilter(_DropFailedReads())
  if getattr(sys.unraisablehook, "quiet_closed_loop", False):
    return
  previous = sys.unraisablehook

  def hook(unraisable):
    value = unraisable.exc_value
    if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
      return
    if _echo(str(value)):
      return
    previous(unraisable)

  hook.quiet_closed_loop = True
  sys.unraisablehook = hook


class _IteratorSnapshot:
  """The iterator's state taken now, in the training thread. Orbax may write an item later,
  from its background thread, while the loop already pulls the next batches."""

  def __init__(self, iterator):
    self._state = json.dumps(iterator.get_state(), indent=2).encode()

  def get_state(self) -> bytes:
    return self._state


def _train_item(state, health: bool = True):
  """The 'train' item: the optimizer's state and counters, and the divergence record
  ('health', when the state has one and `health`)."""
  keys = ("step", "opt_state", "skipped_records") + (
      ("health",) if health and "health" in state else ())
  return {k: state[k] for k in keys}


META_VERSION = 1


def _plain(section) -> dict:
  return section.to_dict() if hasattr(section, "to_dict") else dict(section)


def run_meta(config, model_config: dict, class_names, num_classes: int,
             objective_meta: dict | None = None) -> dict:
  """The 'meta' item of a run's checkpoints: what consumers of the weights need.
  `model_config` is ModelDef.config() (config.model with the options resolved);
  `objective_meta` is the objective's own entries (objectives.base.Objective.meta: e.g.
  'class_tree', the tree a semantic softmax's heads are trained for)."""
  return {
      **(objective_meta or {}),
      "version": META_VERSION,
      "model": dict(model_config),
      "compute_dtype": config.compute_dtype,
      "num_classes": int(num_classes),
      "class_names": list(class_names or ()),
      "dataset": config.data.name,
      "data": {k: config.data[k] for k in ("image_size", "normalize", "eval_resize")},
      "objective": _plain(config.objective),
      # The run's own modules (config.plugins): read_meta imports them, so that every
      # command opening the checkpoint finds a model or objective from a user's package.
      "plugins": list(config.get("plugins", ())),
  }


class CheckpointSaveError(RuntimeError):
  """A checkpoint could not be written (e.g. a full disk); the earlier ones are kept."""


def _root_cause(e: BaseException) -> BaseException:
  while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
    e = e.__cause__ or e.__context__
  return e


class CheckpointReadError(RuntimeError):
  """A checkpoint could not be read for a reason outside it (storage, network, memory): the
  run stops and nothing is moved, so that a re-run retries the same checkpoint."""


def _reason(e: BaseException, limit: int = 300) -> str:
  """'Type: message' of the innermost error (the storage layer's, e.g. a short read): its first
  line without TensorStore's spec dumps, its end when longer than `limit` (the most specific
  part of a chained message)."""
  cause = _root_cause(e)
  text = (str(cause).strip().splitlines() or [""])[0]
  text = re.split(r" \[(?:tensorstore_spec|source locations)", text)[0]
  text = text if len(text) <= limit else "..." + text[-limit:]
  return f"{type(cause).__name__}: {text}" if text else type(cause).__name__


class CheckpointUnreadable(ValueError):
  """A checkpoint read for its weights or meta (model_init, a teacher, a command's model) is
  damaged: the command stops with one line naming it (nothing is moved; the trainer's own
  checkpoints fall back instead, see Checkpointer.restore)."""


def _read_failed(directory: str, step: int, e: Exception) -> None:
  """Raises CheckpointReadError when reading checkpoint `step` in `directory` failed for a
  reason outside the checkpoint (runtime.transient); else logs the failure as the
  checkpoint's own (the storage layer's echoes of it are silenced from now on)."""
  if transient.is_transient(e):
    raise CheckpointReadError(
        f"reading checkpoint step {step} in {directory} failed ({_reason(e)}): a storage, "
        "network or memory error, not the checkpoint's; nothing was moved. Re-run the same "
        "command to retry.") from e
  _REPORTED.add(os.path.join(directory, str(step), ""))
  logging.info("Checkpoint %s/%d cannot be read: %s: %s", directory, step,
               type(e).__name__, e)


@contextlib.contextmanager
def _reading(directory: str, step: int):
  """A read of checkpoint `step` in `directory`: a failure is one error naming it,
  CheckpointReadError when the cause is outside the checkpoint, else CheckpointUnreadable."""
  _quiet_storage_noise()
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except
    _read_failed(directory, step, e)
    raise CheckpointUnreadable(f"checkpoint step {step} in {directory} cannot be read "
                               f"({_reason(e)}): damaged or incompletely copied.") from e


class CheckpointMismatch(ValueError):
  """The checkpoint is readable but was written for another configuration, or is past the
  run's total_steps: the run refuses to start rather than train over it or mislabel it (the
  user's error; nothing is moved or deleted)."""


# The meta entries a restored train state must agree on (the objective by name: its other
# settings may change between runs of one state).
_MATCHED_META = ("model", "num_classes", "class_names", "objective.name")


def _flat(tree, prefix: str = "") -> dict:
  if not isinstance(tree, dict):
    return {prefix: tree}
  out = {}
  for k, v in tree.items():
    out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
  return out


def meta_differences(saved: dict, current: dict) -> list[str]:
  """'key: checkpoint X, this run Y' for each _MATCHED_META entry (flattened) that differs."""
  saved, current = _flat(saved), _flat(current)
  out = []
  for key in sorted(set(saved) | set(current)):
    if not any(key == m or key.startswith(m + ".") for m in _MATCHED_META):
      continue
    a, b = saved.get(key, "(unset)"), current.get(key, "(unset)")
    if a != b:
      if key == "class_names":
        a, b = f"{len(a)} names" if isinstance(a, list) else a, (
            f"{len(b)} names" if isinstance(b, list) else b)
        if a == b:
          a, b = "another list", "this dataset's"
      out.append(f"{key}: checkpoint {a!r}, this run {b!r}")
  return out


def _tree_differences(saved_meta, abstract: dict) -> list[str]:
  """Array paths missing on either side or with another shape, between a saved item's
  metadata and the state's tree."""
  saved = {k: tuple(v.shape) for k, v in _paths(saved_meta).items() if hasattr(v, "shape")}
  ours = {k: tuple(v.shape) for k, v in _paths(abstract).items()}
  out = [f"{k}: only in the checkpoint" for k in sorted(set(saved) - set(ours))]
  out += [f"{k}: not in the checkpoint" for k in sorted(set(ours) - set(saved))]
  out += [f"{k}: shape {saved[k]} in the checkpoint, {ours[k]} in this run"
          for k in sorted(set(saved) & set(ours)) if saved[k] != ours[k]]
  return out


class Checkpointer:
  """Saves and restores the train state and the data iterator under `directory`; `meta`
  (see run_meta) is written into every checkpoint. Keeps the `keep` newest checkpoints
  confirmed good (see `confirm`) and every newer one."""

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True,
               meta: dict | None = None, read_only: bool = False):
    """`read_only`: another run's checkpoints (config.resume): restore passes over an
    unreadable one without moving it, and nothing is written or deleted there."""
    self.directory = os.path.abspath(directory)
    self.meta = meta
    # The saved 'meta' of the checkpoint restore() restored (None: none yet, or it has none).
    self.restored_meta = None
    self.read_only = read_only
    self.keep = keep
    self._pending = None  # The step of a save that may still be running.
    # Checkpoints of steps up to this one hold a good state: those a run resumes past were
    # good, the one it resumes from is confirmed by its first step.
    self._good_through = -1
    # Rotation is this class's (see `confirm`), not Orbax's max_to_keep, which would delete
    # the last good checkpoint as soon as a newer one, perhaps diverged, is written.
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=None, create=not read_only,
                                             read_only=read_only,
                                             enable_async_checkpointing=async_save),
    )

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: dict, data_iter=None) -> None:
    """`data_iter`: a grain iterator, or a stream_position.TrainStream (also saves its
    position and topology, so that it can resume on another one)."""
    items = {
        "params": ocp.args.StandardSave({"params": state["params"], "extra": state["extra"]}),
        "train": ocp.args.StandardSave(_train_item(state)),
    }
    if "ema" in state:
      items["ema"] = ocp.args.StandardSave(state["ema"])
    if isinstance(data_iter, stream_position.TrainStream):
      items["data_position"] = ocp.args.JsonSave({
          "process_count": jax.process_count(), "num_workers": data_iter.num_workers,
          "records": data_iter.records, **data_iter.position.to_json()})
      data_iter = data_iter.iterator
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointSave(_IteratorSnapshot(data_iter))
    if self.meta is not None:
      items["meta"] = ocp.args.JsonSave(self.meta)
    self._join_pending()  # Its failure is its own step's, not this one's.
    try:
      self.manager.save(step, args=ocp.args.Composite(**items), force=True)
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_error(step, e) from e
    self._pending = step

  def confirm(self, step: int) -> None:
    """The states up to `step` gave good losses: their checkpoints count towards `keep`, and
    the older ones beyond it are deleted. The last save counts from the next save or `wait`
    on: every process decides alike (how far a save has got differs between processes, and
    each deletion is a barrier of all of them)."""
    self._good_through = max(self._good_through, step)
    self._rotate()

  def _rotate(self) -> None:
    good = [s for s in self.manager.all_steps()
            if s <= self._good_through and s != self._pending]
    for step in sorted(good)[:-self.keep]:
      self.manager.delete(step)

  def set_aside_from(self, step: int, why: str) -> tuple[list[int], str]:
    """Moves the checkpoints of `step` and later to `<dir>_<why>/` once the save in flight
    has finished (it may be one of them). Returns (their steps, that folder)."""
    self.wait(rotate=False)
    moved = sorted(s for s in self.manager.all_steps() if s >= step)
    for s in moved:
      self._move_aside(s, why)
    return moved, f"{self.directory}_{why}/"

  def check(self) -> None:
    """Raises CheckpointSaveError as soon as the last asynchronous save has failed; cheap
    (the trainer calls it every step). Nothing while it runs or once it succeeded; nothing
    that other processes must join (see `confirm`)."""
    if self._pending is not None and not self.manager.is_saving_in_progress():
      self._join_pending()

  def _join_pending(self) -> None:
    """Waits for the save in flight, here only (no barrier); CheckpointSaveError naming its
    step if it failed. It still counts as the last save (see `confirm`)."""
    if self._pending is None:
      return
    try:
      self.manager.wait_until_finished()
      self.manager.check_for_errors()
    except Exception as e:  # pylint: disable=broad-except
      step, self._pending = self._pending, None
      raise self._save_error(step, e) from e

  def _save_error(self, step: int, e: BaseException) -> CheckpointSaveError:
    cause = _root_cause(e)
    kept = [s for s in self.manager.all_steps() if s != step]
    self._remove_partial(step)
    return CheckpointSaveError(
        f"saving checkpoint step {step} in {self.directory} failed ({type(cause).__name__}: "
        f"{cause}); it is not kept, the earlier ones are (latest: "
        f"{max(kept) if kept else 'none'}). Fix the cause (e.g. free disk space) and re-run "
        "the same command to resume.")

  def _remove_partial(self, step: int) -> None:
    """Deletes what a failed save of `step` left (its folder, or Orbax's
    `<step>.orbax-checkpoint-tmp*`): never a committed checkpoint, only on process 0."""
    if jax.process_index() != 0 or step in self.manager.all_steps():
      return
    for name in os.listdir(self.directory):
      if name == str(step) or name.startswith(f"{step}.orbax-checkpoint-tmp"):
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def restore(self, state: dict, data_iter=None, step: int | None = None
              ) -> tuple[dict, int] | None:
    """Restores the newest readable checkpoint (or that of `step`: ValueError listing the
    steps there are when it is absent or unreadable) into `state`'s structure and shardings.

    A state with 'ema' gets it back only from a checkpoint that has one (saved with EMA on);
    otherwise the result has no 'ema' and the caller starts the average anew. `data_iter`:
    a grain iterator (restored in place; same topology only) or a
    stream_position.TrainStream (restarted where the checkpoint's stream stood, on any
    topology).
    """
    _quiet_storage_noise()
    attempted, wanted = False, step
    available = sorted(self.manager.all_steps())
    if wanted is not None and wanted not in available:
      raise ValueError(f"config.resume_step={wanted}: {self.directory} has no checkpoint of "
                       f"that step; it has steps {available}.")
    candidates = sorted(available if wanted is None else [wanted], reverse=True)
    for i, step in enumerate(candidates):
      older = len(candidates) - i - 1  # Checkpoints left to fall back to.
      try:  # A readable checkpoint of another configuration is the user's error: refuse.
        saved_meta = self._check_meta(step)
      except CheckpointMismatch:
        raise
      except Exception as e:  # pylint: disable=broad-except
        self._unreadable(step, e, older)
        continue
      grain_iter = data_iter
      if isinstance(data_iter, stream_position.TrainStream):
        try:
          position, same_topology, records = self._data_plan(step, data_iter)
        except Exception as e:  # pylint: disable=broad-except
          self._unreadable(step, e, older)
          continue
        # Outside the try: a refusal here is the caller's error.
        warning = data_iter.check_records(records, f"checkpoint step {step} in "
                                          f"{self.directory}")
        if warning:
          console.warn(warning)
        data_iter.restart(position)
        grain_iter = data_iter.iterator if same_topology else None
      weights = {"params": state["params"], "extra": state["extra"]}
      saved_health = self._saved_health(step, state)
      train = _train_item(state, health=saved_health is not None)
      abstract_train = _abstract(train)
      if saved_health is not None:  # Read as saved; kept only when it fits (below).
        abstract_train["health"] = saved_health
      items = {
          "params": ocp.args.StandardRestore(_abstract(weights)),
          "train": ocp.args.StandardRestore(abstract_train),
      }
      if "ema" in state and _has_item(self.directory, step, "ema"):
        items["ema"] = ocp.args.StandardRestore(_abstract(state["ema"]))
      if grain_iter is not None:
        items["data"] = grain.checkpoint.CheckpointRestore(grain_iter)
      attempted = True
      try:
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
      except Exception as e:  # pylint: disable=broad-except
        # A tree or shape mismatch is refused, not moved (the divergence record as read).
        self._check_tree(step, {"params": weights, "train": abstract_train})
        self._unreadable(step, e, older)
        continue
      restored = {**out["params"], **out["train"]}
      if saved_health is not None and not _same_shapes(restored["health"], state["health"]):
        del restored["health"]  # Another config.divergence.window: the fresh record stands.
      if "ema" in items:
        restored["ema"] = out["ema"]
      logging.info("Restored checkpoint %s/%d", self.directory, step)
      self.restored_meta = saved_meta
      # Its state is confirmed by the next good loss; with the skip policy, the states of a
      # run of bad steps in progress are not good either.
      bad_run = int(restored.get("health", {}).get("bad_run", 0))
      self._good_through = step - 1 - bad_run
      return restored, step
    if wanted is not None:
      where = "left in place" if self.read_only else f"moved to {self.directory}_corrupt/"
      raise ValueError(f"config.resume_step={wanted}: checkpoint step {wanted} in "
                       f"{self.directory} is unreadable ({where}).")
    if isinstance(data_iter, stream_position.TrainStream):
      # From the beginning, and rebuilt: a failed restore may have set the iterator's state.
      data_iter.restart(stream_position.Position(), rebuild=attempted)
    return None

  def _saved_health(self, step: int, state: dict):
    """The abstract divergence record of checkpoint `step` (its shapes, `state`'s
    shardings), or None when it has none (saved before the record was) or `state` has none.
    """
    if "health" not in state:
      return None
    try:
      saved = _paths(_item_metadata(self.directory, step, "train"))
    except Exception:  # pylint: disable=broad-except
      return None  # Unreadable: the restore itself reports it.
    paths = {f"health/{k}": k for k in state["health"]}
    if not all(hasattr(saved.get(p), "shape") for p in paths):
      return None
    return {k: jax.ShapeDtypeStruct(tuple(saved[p].shape), state["health"][k].dtype,
                                    sharding=_target(state["health"][k]).sharding)
            for p, k in paths.items()}

  def _refuse(self, step: int, differences: list[str]) -> None:
    shown = differences[:8] + ([f"... {len(differences) - 8} more"] if len(differences) > 8
                               else [])
    raise CheckpointMismatch(
        f"checkpoint step {step} in {self.directory} was written for another configuration "
        f"({'; '.join(shown)}). Nothing was changed. Re-run with the checkpoint's settings, "
        "use another --workdir, or start a new run from its weights with "
        "--config.model_init=<this workdir>.")

  def refuse_another_configuration(self, check_records=None, step: int | None = None) -> None:
    """Raises CheckpointMismatch if the newest checkpoint with a readable 'meta' (or that of
    `step`) was written for another configuration, and what `check_records(saved sizes,
    where)` raises (stream_position.check_records: the train data changed) for its stream:
    the checks restore() makes first, early enough that a refusal costs no state to build.
    Unreadable checkpoints are passed over here; restore() sets them aside and says so."""
    steps = self.manager.all_steps()
    for step in sorted(steps if step is None else set(steps) & {step}, reverse=True):
      try:
        self._check_meta(step)
      except CheckpointMismatch:
        raise
      except Exception:  # pylint: disable=broad-except
        continue
      if check_records is not None and _has_item(self.directory, step, "data_position"):
        try:
          saved = self._json_item(step, "data_position").get("records")
        except Exception:  # pylint: disable=broad-except
          return  # Unreadable: restore() falls back from it.
        check_records(saved, f"checkpoint step {step} in {self.directory}")
      return

  def _json_item(self, step: int, name: str) -> dict:
    """The JSON item `name` ('meta', 'data_position') of checkpoint `step`."""
    return self.manager.restore(step, args=ocp.args.Composite(
        **{name: ocp.args.JsonRestore()}))[name]

  def _check_meta(self, step: int) -> dict | None:
    """Raises CheckpointMismatch if the checkpoint's 'meta' names another model, class list
    or objective than this run's; any other error means the checkpoint is unreadable.
    Returns the saved meta (None without one, or when this run has none to check)."""
    if self.meta is None or not _has_item(self.directory, step, "meta"):
      return None
    saved = self._json_item(step, "meta")
    differences = meta_differences(saved, self.meta)
    if differences:
      self._refuse(step, differences)
    return saved

  def _check_tree(self, step: int, items: dict) -> None:
    """Raises CheckpointMismatch if the tree or shapes of a saved item ('params': weights,
    'train': optimizer state) differ from this run's `items` (a checkpoint without 'meta',
    or a change meta does not show, e.g. another optimizer). Unreadable metadata is left to
    the caller (corruption)."""
    differences = []
    for name, tree in items.items():
      try:
        saved = _item_metadata(self.directory, step, name)
      except Exception:  # pylint: disable=broad-except
        continue
      if not any(hasattr(v, "shape") for v in _paths(saved).values()):
        continue  # Orbax returns an empty tree when the metadata itself is unreadable.
      differences += [f"{name}: {d}" for d in _tree_differences(saved, tree)]
    if differences:
      self._refuse(step, differences)

  def _data_plan(self, step: int, stream: stream_position.TrainStream
                 ) -> tuple[stream_position.Position, bool, dict | None]:
    """(the Position to restart `stream` from, whether grain's saved state restores onto
    it, the sizes of the sources it counts records of (None: not saved)). grain's state is
    per process and per worker and cannot be re-split: with another process count or
    data.num_workers the stream continues from the global position."""
    data = os.path.join(self.directory, str(step), "data")
    if not os.path.isdir(data):
      console.warn(f"checkpoint step {step} in {self.directory} holds no data stream state "
                   "(written without the train stream); the stream starts from its beginning.")
      return stream_position.Position(), False, None
    counts = {int(m.group(1)) for m in (re.fullmatch(r"process_\d+-of-(\d+)\.json", f)
                                        for f in os.listdir(data)) if m}
    if len(counts) != 1:
      raise ValueError(f"{data} holds grain states of process counts {sorted(counts)}")
    saved_processes = counts.pop()
    if _has_item(self.directory, step, "data_position"):
      saved = self._json_item(step, "data_position")
      previous = stream_position.Position.from_json(saved)
      saved_workers = int(saved["num_workers"])
      records = saved.get("records")
    else:  # Written before positions were saved: the stream started at the beginning.
      previous, records = stream_position.Position(), None
      saved_workers = stream_position.num_workers_of(
          stream_position.read_states(data, saved_processes)[0])
    now = (jax.process_count(), stream.num_workers)
    if (saved_processes, saved_workers) == now:
      return previous, True, records
    position = stream_position.continue_from(
        stream_position.read_states(data, saved_processes), previous)
    message = (f"Data stream: checkpoint step {step} was written by {saved_processes} "
               f"processes x {saved_workers} grain workers, this run has {now[0]} x {now[1]}; "
               "grain's per-process iterator state cannot be re-split, so the stream continues "
               f"from global record position {position.start} (skipping "
               f"{len(position.consumed)} records already read after it).")
    console.warn(message)
    return position, False, records

  def _unreadable(self, step: int, e: Exception, older: int) -> None:
    """Reports checkpoint `step` unreadable and moves it aside (passes over it when
    read-only), or raises CheckpointReadError when the cause is outside the checkpoint."""
    _read_failed(self.directory, step, e)
    where = "left in place" if self.read_only else f"moved to {self.directory}_corrupt/"
    then = "falling back to the previous checkpoint" if older else "no older one to fall back to"
    console.warn(f"checkpoint step {step} in {self.directory} is unreadable "
                 f"({_reason(e)}); {where}, {then}.")
    if not self.read_only:
      self._move_aside(step, "corrupt")

  def _move_aside(self, step: int, why: str) -> None:
    """Keeps a checkpoint for inspection in `<dir>_<why>/`, out of the manager's way; an
    earlier copy of the same step there is kept too (the new one gets a '.N' suffix)."""
    if jax.process_index() == 0:
      src = os.path.join(self.directory, str(step))
      folder = f"{self.directory}_{why}"
      dst = os.path.join(folder, str(step))
      n = 1
      while os.path.exists(dst):
        dst, n = os.path.join(folder, f"{step}.{n}"), n + 1
      if os.path.exists(src):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.move(src, dst)
    if jax.process_count() > 1:  # The others list the steps once process 0 has moved it.
      multihost_utils.sync_global_devices(f"bigpretrain checkpoint {step} moved aside")
    self.manager.reload()

  def wait(self, rotate: bool = True) -> None:
    """Waits for the last save; raises CheckpointSaveError if it failed. Then rotates, as
    `confirm` would have done had the save been finished."""
    step, self._pending = self._pending, None
    try:
      self.manager.wait_until_finished()
      self.manager.check_for_errors()
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_error(step, e) from e
    if rotate:
      self._rotate()

  def close(self) -> None:
    self.manager.close()


def _has_item(directory: str, step: int, item: str) -> bool:
  return os.path.isdir(os.path.join(directory, str(step), item))


def _weights_item(directory: str, step: int) -> str:
  """'ema' when the checkpoint holds EMA weights (what the run evaluated), else 'params'."""
  return "ema" if _has_item(directory, step, "ema") else "params"


def _item_metadata(directory: str, step: int, item: str):
  """The saved tree of one item (shapes and dtypes), read without registering a handler."""
  with ocp.PyTreeCheckpointer() as reader:
    meta = reader.metadata(os.path.join(directory, str(step), item))
  return getattr(meta, "item_metadata", meta)


def no_checkpoint(directory: str) -> FileNotFoundError:
  """The error for a folder without checkpoints; one step's folder gets its parent named."""
  step = os.path.basename(os.path.normpath(directory))
  hint = (f" It is one checkpoint step's folder: pass the folder that holds the steps, "
          f"{os.path.dirname(os.path.normpath(directory))}." if step.isdigit() else "")
  return FileNotFoundError(f"No checkpoint found in {directory}.{hint}")


def checkpoint_dir(path: str) -> str:
  """Accepts a run's workdir or its checkpoints/ folder; checks it exists."""
  if not os.path.isdir(path):
    what = "is a file, not a folder" if os.path.exists(path) else "does not exist"
    raise FileNotFoundError(f"Checkpoint directory {path} {what}.")
  inner = os.path.join(path, "checkpoints")
  return inner if os.path.isdir(inner) else path


def latest_step(path: str) -> int:
  """The latest checkpoint step under `path` (a run's workdir or its checkpoints/ folder)."""
  directory = checkpoint_dir(path)
  with ocp.CheckpointManager(os.path.abspath(directory)) as manager:
    step = manager.latest_step()
  if step is None:
    raise no_checkpoint(directory)
  return step


def read_meta(path: str, step: int | None = None, *, required: bool = True) -> dict | None:
  """The 'meta' item (see run_meta) of the latest (or given) checkpoint under `path`; None
  for a checkpoint without one when not `required`."""
  directory = checkpoint_dir(path)
  with ocp.CheckpointManager(os.path.abspath(directory)) as manager:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise no_checkpoint(directory)
    if not os.path.isdir(os.path.join(directory, str(step), "meta")):
      if not required:
        return None
      raise ValueError(f"Checkpoint {directory}/{step} has no 'meta' item (model config and "
                       "class names), so it cannot describe its model; it was written by an "
                       "older bigpretrain. Re-save it with a current run or convert it.")
    with _reading(directory, step):
      meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  if meta.get("version") != META_VERSION:
    raise ValueError(f"Checkpoint {directory}/{step} has meta version {meta.get('version')!r}; "
                     f"this bigpretrain reads version {META_VERSION}.")
  registry.import_plugins(meta.get("plugins", ()),
                          where=f"checkpoint {directory}/{step} (its run's config.plugins)")
  return meta


def origin(path: str) -> str:
  """The source a converted checkpoint was imported from (its meta's source, e.g.
  'timm:vit_base_patch16_224'); '' for a bigpretrain run's."""
  return read_meta(path).get("source", {}).get("from", "")


def load_params(directory: str, abstract_params: dict, step: int | None = None) -> dict:
  """Loads {'params', 'extra'} from a bigpretrain checkpoint dir (model_init, teachers):
  the EMA weights when the run kept them."""
  directory = os.path.abspath(checkpoint_dir(directory))
  with ocp.CheckpointManager(directory) as manager:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise no_checkpoint(directory)
    item = _weights_item(directory, step)
    with _reading(directory, step):
      out = manager.restore(step, args=ocp.args.Composite(
          **{item: ocp.args.StandardRestore(_abstract(abstract_params))}))
  logging.info("Loaded %s from %s step %d", item, directory, step)
  return out[item]


def load_arrays(directory: str, names: list[str]) -> dict:
  """Only the named arrays ('params/head/kernel', ...) of the latest checkpoint's weights
  (EMA if kept), on the first local device: e.g. a 27k-class head without its backbone."""
  directory = os.path.abspath(checkpoint_dir(directory))
  with ocp.CheckpointManager(directory) as manager:
    step = manager.latest_step()
    if step is None:
      raise no_checkpoint(directory)
    item = _weights_item(directory, step)
    saved = _paths(_item_metadata(directory, step, item))
  missing = [n for n in names if n not in saved]
  if missing:
    raise KeyError(f"Checkpoint {directory}/{step} has no arrays {missing}; it has "
                   f"{sorted(saved)[:8]}...")
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  abstract, args = {}, {}
  for name in names:  # A nested tree of just these paths.
    *parents, leaf = name.split("/")
    node, arg_node = abstract, args
    for p in parents:
      node, arg_node = node.setdefault(p, {}), arg_node.setdefault(p, {})
    node[leaf] = jax.ShapeDtypeStruct(saved[name].shape, saved[name].dtype, sharding=device)
    arg_node[leaf] = ocp.ArrayRestoreArgs(sharding=device)
  with ocp.PyTreeCheckpointer() as reader, _reading(directory, step):
    out = reader.restore(os.path.join(directory, str(step), item), args=ocp.args.PyTreeRestore(
        item=abstract, restore_args=args, partial_restore=True))
  return {name: out_leaf for name, out_leaf in _paths(out).items() if name in names}


def _same_shapes(a, b) -> bool:
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
      tuple(x.shape) == tuple(y.shape) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _paths(tree) -> dict:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(p, simple=True, separator="/"): v for p, v in flat}


# The classifier head: with another class count it starts fresh (fine-tuning on new classes).
HEAD_PATTERN = r"^params/head/"


def init_from(directory: str, state: dict, skip: str = "",
              adapt=None) -> tuple[dict, list[str], list[str], list[str]]:
  """Initialises {'params', 'extra'} from a checkpoint whose model may differ (fine-tuning).

  Arrays whose path matches the `skip` regex, or absent from the checkpoint, keep their fresh
  initialisation, as does a classifier head (HEAD_PATTERN) whose class count differs. An
  array of another shape that the model adapts, `adapt(path, saved) -> array or None` (the
  model's hook, models.ModelDef.param_adapter: e.g. a ViT's position embedding resized to a
  new image size), takes the adapted value. Any other shape difference is refused, naming
  the arrays: a changed backbone is never silently re-initialised. Loaded arrays get
  `state`'s shardings (the EMA weights when the checkpoint has them). Returns the new tree,
  the paths kept fresh, the paths adapted and the checkpoint's paths this model has no place
  for (not loaded: e.g. SWAG's tanh pre-logits layer, which its fine-tuned ViTs drop; the
  caller names them, as it names the other two).
  """
  directory = os.path.abspath(checkpoint_dir(directory))
  with ocp.CheckpointManager(directory) as manager:
    step = manager.latest_step()
    if step is None:
      raise no_checkpoint(directory)
    item = _weights_item(directory, step)
    saved = _item_metadata(directory, step, item)
    ours = _paths(state)
    pattern = re.compile(skip) if skip else None

    def target(path, meta):
      name = jax.tree_util.keystr(path, simple=True, separator="/")
      mine = ours.get(name)
      if mine is not None and tuple(mine.shape) == tuple(meta.shape):
        return _target(mine)
      return _target(jax.ShapeDtypeStruct(meta.shape, meta.dtype))

    abstract = jax.tree_util.tree_map_with_path(target, saved)
    with _reading(directory, step):
      loaded = _paths(manager.restore(step, args=ocp.args.Composite(
          **{item: ocp.args.StandardRestore(abstract)}))[item])
  fresh, resized, refused = [], [], []

  def pick(path, mine):
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    value = loaded.get(name)
    if value is None or (pattern and pattern.search(name)):
      fresh.append(name)
      return mine
    if value.shape == mine.shape:
      return value
    if re.search(HEAD_PATTERN, name):
      fresh.append(name)
      return mine
    grown = adapt(name, value) if adapt is not None else None
    if grown is not None and tuple(grown.shape) == tuple(mine.shape):
      resized.append(f"{name} {tuple(value.shape)} -> {tuple(mine.shape)}")
      sharding = getattr(mine, "sharding", None)
      grown = grown.astype(mine.dtype)
      return jax.device_put(grown, sharding) if sharding is not None else grown
    refused.append(f"{name} {tuple(value.shape)} -> {tuple(mine.shape)}")
    return mine

  out = jax.tree_util.tree_map_with_path(pick, state)
  if refused:
    raise ValueError(
        f"model_init={directory}: the checkpoint's arrays {refused} have other shapes than "
        "this model's. Match the model to the checkpoint, or start these arrays fresh with "
        "config.model_init_skip (a regex over these paths).")
  dropped = sorted(set(loaded) - set(ours))
  body = [n for n in ours if not re.search(HEAD_PATTERN, n)
          and not (pattern and pattern.search(n))]
  if body and not set(body) & set(loaded):  # Nothing but the head would load.
    model = (read_meta(directory, step, required=False) or {}).get("model", {}).get("name")
    raise ValueError(
        f"model_init={directory}: none of this model's {len(body)} arrays outside the head "
        f"is in the checkpoint" + (f" (written for model {model!r})" if model else "")
        + f": the checkpoint has e.g. {', '.join(sorted(loaded)[:3])}; this model "
        f"{', '.join(sorted(body)[:3])}. Set config.model to the checkpoint's model.")
  logging.info("Initialised from %s step %d; kept fresh: %s; resized: %s; not loaded: %s",
               directory, step, fresh, resized, dropped)
  return out, fresh, resized, dropped
