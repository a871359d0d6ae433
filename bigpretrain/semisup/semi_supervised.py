"""The semi-supervised stage runner (Yalniz et al. 2019, section 3.2): teacher -> inference over
the unlabelled pool -> deduplication against the evaluation sets -> top-K selection -> student
pretraining -> fine-tuning.

Each stage writes its own folder under DIR/round<r>/ (teacher_pretrain, teacher,
predictions/<split>, pool, selection, student, finetune; DIR/dedup/<split> once for all
rounds) and, last, its completion marker; DIR/baseline holds the supervised baseline and
DIR/results.json the numbers. Re-running the command skips finished stages and resumes an
interrupted one: the trainer from its checkpoint (SIGTERM saves one and stops the command
with exit 0; one that comes in any other stage, or after a trainer's last step, lets that
stage finish and stops the command before the next), inference shard by shard, the
selection from scratch (it writes its index files, then selection.json). Each stage's
folder records what it was built from (inputs.json: the identity of the teacher,
predictions, pool, selection or student it read); a stage whose inputs have changed since
(a teacher trained again, another top_p) is refused with the folders to delete, never
reused. With `rounds` > 1 the fine-tuned student of round r is round r + 1's teacher
(supplement section 3).

Stages run in this process, one after the other, as ordinary calls of the trainer
(train.train_and_evaluate), of pool_predictions.run and of the Beam selection job
(input_pipeline.jobs.selection_job.prepare): one jax.distributed initialisation serves every stage on a
multi-host run, and JAX starts and compiles from the persistent cache once, not per stage.
Stages share no state but the files: each gets a fresh copy of its config section, read
nowhere else, and the trainer restores its signal handler and mesh context when it returns.

The pool U: the data.pool_splits of data.name, plus (pool_train_rest, with data.subset_frac)
the records of the train split outside the labelled draw D. The teacher scores whole splits;
the `pool` stage then keeps, per split, the prediction rows of U's records (dropping D's), so
that D-hat is keyed by the records' own (dataset, split, index) and reads them through the
plain dataset.

Semi-weakly supervised (section 3.3, section 4.4): with config.teacher_pretrain, the teacher
is that section's hashtag pretraining (DIR/round1/teacher_pretrain, or the existing run
config.teacher_pretrained) fine-tuned on D by config.teacher (its model_init); with
data.pool naming another dataset (e.g. `hashtags:NAME`, in the same data.dir), U is
data.pool_splits of that dataset: only its images are read (inference needs no labels, and
D-hat's records are the pool's image with the teacher's label), and the student is evaluated
on data.name's data.eval_split instead of D-hat's.

Deduplication (supplement section 5: "remove images in the large-scale dataset that are also
present in the labeled test or validation set"): with config.dedup.against set, each pool
split is deduplicated against those sets by bigpretrain.semisup.dedup (the features of
config.dedup.model, '' = the round-1 teacher, a model trained on the labelled set as the
paper's ImageNet ResNet-18 is; the dedup.top_n closest pool images of each split, or all
within dedup.max_distance), and the `pool` stage drops them with D's records, so no round
selects them.
"""
import hashlib
import json
import uuid

from etils import epath
import jax
import ml_collections
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bigpretrain import checkpoint
from bigpretrain import config_lib
from bigpretrain import sharding
from bigpretrain.evaluators import base as evaluators_base
from bigpretrain.runtime import console
from bigpretrain.runtime import preemption
from bigpretrain.runtime import process_zero
from bigpretrain.semisup import dedup
from bigpretrain.semisup import pool_predictions
from bigpretrain.semisup import topk
from bigpretrain import train
from input_pipeline import datasets
from input_pipeline import exclusions
from input_pipeline import selection_formats

DONE_FILE = "stage_done.json"
INPUTS_FILE = "inputs.json"  # What a stage's folder was built from.
POOL_EXCLUDED_FILE = "excluded.json"  # The pool stage's record of what it left out.
RESULTS_FILE = "results.json"
METRIC = "eval/top1"
_DATA_KEYS = ("name", "dir", "subset_frac", "subset_seed")
# The keys of the runner's own sections (configs/semi_supervised.py); the stage sections
# (teacher_pretrain, teacher, student, finetune, baseline) are trainer configs, validated as
# such when their stage runs.
_KEYS = {
    "config": ("seed", "rounds", "run_baseline", "teacher_workdir", "teacher_pretrained",
               "data", "infer", "dedup", "selection", "teacher_pretrain", "teacher", "student",
               "finetune", "baseline"),
    "config.data": _DATA_KEYS + ("pool", "pool_splits", "pool_train_rest"),
    "config.infer": ("top_p", "batch_size", "shard_size", "logits", "num_workers", "fsdp"),
    "config.dedup": ("against", "model", "top_n", "max_distance", "batch_size",
                     "ivf_threshold", "nlist", "nprobe", "seed", "fsdp", "num_workers"),
    "config.selection": ("k", "variant", "class_sizes", "zipf_total", "zipf_exponent", "seed",
                         "beam_runner", "beam_options"),
}


class Interrupted(Exception):
  """A SIGTERM or Ctrl-C stopped the run (a training stage before its last step, or the run
  before its next stage): re-run to resume."""


def is_main() -> bool:
  return jax.process_index() == 0


def _read_done(folder: epath.Path) -> dict | None:
  path = folder / DONE_FILE
  return json.loads(path.read_text()) if path.exists() else None


def _write_json(path: epath.Path, payload) -> None:
  """Writes `path` whole or not at all (temporary name, then rename), on process 0."""
  if not is_main():
    return
  tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex}"
  tmp.write_text(json.dumps(payload, indent=1, default=float))
  tmp.replace(path)  # Overwrites (results.json after another round).


def _say(text: str) -> None:
  if is_main():
    console.say(text)


def identity(marker: epath.Path) -> str:
  """A finished stage's identity: the hash of its completion marker, which holds its config,
  parameters and results, so a stage built again differently gets another."""
  return hashlib.sha256(marker.read_bytes()).hexdigest()[:16]


def model_identity(workdir: str) -> str:
  """A model folder's identity: its stage marker's when this runner trained it, else (a model
  trained elsewhere, e.g. config.teacher_workdir) its latest checkpoint step."""
  marker = epath.Path(workdir) / DONE_FILE
  if marker.exists():
    return identity(marker)
  ckpt = checkpoint.Checkpointer(checkpoint.checkpoint_dir(workdir), async_save=False,
                                 read_only=True)
  try:
    return f"{workdir} step {ckpt.latest_step()}"
  finally:
    ckpt.close()


def check_inputs(stage: str, folder: epath.Path, inputs: dict) -> None:
  """Refuses to reuse or resume `folder` when it was built from other inputs; records them
  in a folder that has no record yet."""
  path = folder / INPUTS_FILE
  if path.exists():
    before = json.loads(path.read_text())
    if before != inputs:
      changed = sorted(k for k in set(before) | set(inputs) if before.get(k) != inputs.get(k))
      raise ValueError(f"[{stage}] {folder} was built from another {' and '.join(changed)} than "
                       f"now ({before} then, {inputs} now): delete it and the folders of the "
                       "stages after it to build them again, or use another --workdir.")
    return
  if is_main():
    folder.mkdir(parents=True, exist_ok=True)
  _write_json(path, inputs)


def stage_config(section, seed: int, data: dict) -> ml_collections.ConfigDict:
  """A fresh, unlocked trainer config from a config section, with the run's seed and the
  stage's data (name, dir, subset keys) set."""
  c = ml_collections.ConfigDict(section.to_dict())
  c.seed = seed
  for key, value in data.items():
    c.data[key] = value
  return c


def pool_name(config) -> str:
  """The dataset whose data.pool_splits form U: data.pool, or ('' / absent) data.name."""
  return config.data.get("pool") or config.data.name


def labelled_data(config) -> dict:
  """The data keys of D: data.name in data.dir, cut to the labelled draw if subset_frac < 1."""
  return {k: config.data[k] for k in _DATA_KEYS if k in config.data}


def train_stage(name: str, cfg, folder: epath.Path, inputs: dict | None = None) -> dict:
  """Trains `cfg` in `folder` unless its marker says it is done; returns the marker.
  `inputs`: the identities of the stages it reads (check_inputs)."""
  done = _read_done(folder)
  plain = json.loads(json.dumps(cfg.to_dict(), default=str))
  if done is not None and done.get("config") != plain:
    diff = sorted(k for k in set(plain) | set(done.get("config") or {})
                  if plain.get(k) != (done.get("config") or {}).get(k))
    raise ValueError(f"[{name}] {folder} was trained with another config (keys {diff}); "
                     "use another --workdir, or delete that folder to train it again.")
  check_inputs(name, folder, inputs or {})
  if done is not None:
    _say(f"[{name}] done already in {folder}: skipped ({METRIC}={_metric(done)})")
    return done
  _say(f"[{name}] training in {folder}")
  folder.mkdir(parents=True, exist_ok=True)
  num_train = len(datasets.train_sources(cfg.data, datasets.get_dataset(cfg.data))[0][0])
  total = config_lib.resolve_total_steps(cfg, num_train)
  results = train.train_and_evaluate(cfg, str(folder))
  ckpt = checkpoint.Checkpointer(str(folder / "checkpoints"), async_save=False, read_only=True)
  reached = ckpt.latest_step()
  ckpt.close()
  if reached is None or reached < total:
    raise Interrupted(f"[{name}] stopped at step {reached} of {total} in {folder}; re-run the "
                      "same command to resume it.")
  done = {"stage": name, "total_steps": total, "results": results, "config": plain}
  _write_json(folder / DONE_FILE, done)
  return done


def _metric(done: dict) -> str:
  value = (done.get("results") or {}).get(METRIC)
  return "n/a" if value is None else f"{value:.4f}"


def check_pool(config, info: datasets.DatasetInfo) -> list[str]:
  """The pool splits, checked against the pool's dataset (`info`) before anything runs."""
  splits = list(config.data.pool_splits)
  missing = [s for s in splits if s not in info.splits]
  if missing:
    raise ValueError(f"config.data.pool_splits names {missing}, which dataset "
                     f"{pool_name(config)!r} lacks; its splits: {list(info.splits)}.")
  rest = bool(config.data.pool_train_rest)
  train_split = "train"
  if rest and pool_name(config) != config.data.name:
    raise ValueError(f"config.data.pool_train_rest is set and the pool is another dataset "
                     f"({pool_name(config)!r}, not {config.data.name!r}): unset one of them.")
  if rest and config.data.subset_frac >= 1:
    raise ValueError("config.data.pool_train_rest needs config.data.subset_frac < 1: without "
                     "a labelled draw, all of train is the labelled set D.")
  if rest and train_split in splits:
    raise ValueError(f"config.data.pool_splits has {train_split!r} and pool_train_rest is set: "
                     "the labelled records would be in the pool too.")
  if not splits and not rest:
    raise ValueError("The pool is empty: set config.data.pool_splits and/or pool_train_rest.")
  return splits + ([train_split] if rest else [])


def infer_stage(teacher: str, config, split: str, folder: epath.Path) -> None:
  """The teacher's top-P predictions over one split (bigpretrain.tools.infer; resumes by shard)."""
  c = config.infer
  name = pool_name(config)
  check_inputs(f"infer {split}", folder, {
      "teacher": model_identity(teacher), "pool": name,
      "infer": {"top_p": c.top_p, "logits": c.logits, "shard_size": c.shard_size}})
  if (folder / selection_formats.INFO_FILE).exists():
    _say(f"[infer {split}] done already in {folder}: skipped")
    return
  _say(f"[infer {split}] teacher {teacher} -> {folder}")
  pool_predictions.run(teacher, name, split, str(folder), data_dir=config.data.dir,
            top_p=c.top_p, batch_size=c.batch_size, logits=c.logits, shard_size=c.shard_size,
            fsdp=c.fsdp, num_workers=c.num_workers, progress=is_main(),
            pool_classes="teacher" if name == config.data.name else "any",
            name="config.infer.{}")


def _link_or_filter(src: str, dst: epath.Path, exclude: np.ndarray | None) -> int:
  """Copies a prediction shard to dst without the rows whose index is in `exclude`; returns
  the rows kept."""
  with epath.Path(src).open("rb") as f:
    table = pq.read_table(f)
  if exclude is not None and len(exclude):
    table = table.filter(pc.invert(pc.is_in(table.column("index"), pa.array(exclude))))
  tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex}"
  with tmp.open("wb") as f:
    pq.write_table(table, f)
  tmp.rename(dst)
  return table.num_rows


def pool_stage(pred_dirs: dict[str, epath.Path], exclude: dict[str, np.ndarray],
               class_names: list[str], folder: epath.Path) -> None:
  """One predictions folder over U: every split's shards, without the `exclude`d records."""
  excluded = {split: {"num_records": int(len(v)), "sha256": hashlib.sha256(
      np.unique(np.asarray(v, np.int64)).astype("<i8").tobytes()).hexdigest()}
              for split, v in sorted(exclude.items()) if len(v)}
  check_inputs("pool", folder, {"predictions": {
      s: identity(d / selection_formats.INFO_FILE) for s, d in sorted(pred_dirs.items())}})
  if (folder / selection_formats.INFO_FILE).exists():
    marker = folder / POOL_EXCLUDED_FILE
    before = json.loads(marker.read_text()) if marker.exists() else excluded  # Older pools.
    if before != excluded:
      raise ValueError(f"[pool] {folder} was built with other exclusions ({before}) than now "
                       f"({excluded}), e.g. deduplication switched on or off: use another "
                       "--workdir, or delete that round's pool, selection, student and "
                       "finetune folders.")
    _say(f"[pool] done already in {folder}: skipped")
    return
  process_zero.run("[pool]", _build_pool, pred_dirs, exclude, excluded, class_names, folder)


def _build_pool(pred_dirs: dict[str, epath.Path], exclude: dict[str, np.ndarray],
                excluded: dict, class_names: list[str], folder: epath.Path) -> None:
  folder.mkdir(parents=True, exist_ok=True)
  infos = {s: json.loads((d / selection_formats.INFO_FILE).read_text())
           for s, d in pred_dirs.items()}
  first = infos[sorted(infos)[0]]
  for split, info in infos.items():
    for key in ("class_names", "top_p", "dataset", "scores"):
      if info.get(key) != first.get(key):
        raise ValueError(f"The predictions of split {split!r} in {pred_dirs[split]} have "
                         f"another {key} than those of {sorted(infos)[0]!r}: re-run inference.")
  selection_formats.check_class_names(first["class_names"], class_names,
                                      str(pred_dirs[sorted(infos)[0]]))
  records = 0
  for split in sorted(pred_dirs):
    for shard in sorted(pred_dirs[split].glob("*.parquet")):
      records += _link_or_filter(str(shard), folder / shard.name, exclude.get(split))
  _write_json(folder / POOL_EXCLUDED_FILE, excluded)  # Before INFO_FILE, the done marker.
  selection_formats.write_info(folder, class_names=first["class_names"], top_p=first["top_p"],
                               dataset=first["dataset"], splits=sorted(pred_dirs),
                               num_records=records, scores=first["scores"])
  _say(f"[pool] {records} images of U from {sorted(pred_dirs)} in {folder}")


def dedup_stage(config, model: str, split: str, folder: epath.Path) -> np.ndarray:
  """The records of pool split `split` that are near-duplicates of config.dedup.against's
  images (bigpretrain.semisup.dedup; a finished run in `folder` with the same parameters is reused);
  returns their sorted indices."""
  c = config.dedup
  top_n = c.top_n if c.top_n > 0 else None
  max_distance = c.max_distance if c.max_distance >= 0 else None
  _say(f"[dedup {split}] against {c.against} with {model} -> {folder}")
  check_inputs(f"dedup {split}", folder, {"model": model_identity(model)})
  _sync(f"dedup_{split}_start")
  dedup.run(model, f"{pool_name(config)}:{split}", c.against, str(folder),
                     top_n=top_n, max_distance=max_distance, data_dir=config.data.dir,
                     batch_size=c.batch_size, ivf_threshold=c.ivf_threshold, nlist=c.nlist,
                     nprobe=c.nprobe, seed=c.seed, fsdp=c.fsdp, num_workers=c.num_workers,
                     progress=is_main(), name="config.dedup.{}")
  _sync(f"dedup_{split}_done")
  removed = exclusions.read(folder / dedup.EXCLUSIONS_FILE).indices(pool_name(config), split)
  _say(f"[dedup {split}] {len(removed)} pool images removed (report: "
       f"{folder / dedup.REPORT_FILE})")
  return removed


def _selection_sizes(c) -> tuple[int | None, int | None]:
  """(K per class, the Zipf total) as config.selection `c` gives them to the selection job:
  no K for unbalanced_ranked, no total unless > 0."""
  return (None if c.variant == "unbalanced_ranked" else c.k,
          c.zipf_total if c.zipf_total > 0 else None)


def selection_stage(config, pool: epath.Path, class_names: list[str],
                    folder: epath.Path) -> dict:
  """D-hat's index (the Beam job); reuses a finished one with the same parameters."""
  # Imported here: Apache Beam is only needed by this stage.
  from input_pipeline.jobs import selection_job as selection  # pylint: disable=import-outside-toplevel
  c = config.selection
  class_sizes = (selection.read_class_sizes(c.class_sizes, "config.selection.class_sizes")
                 if c.class_sizes else None)
  k, zipf_total = _selection_sizes(c)
  params = {key: v for key, v in c.to_dict().items()
            if key not in ("beam_runner", "beam_options")}  # How, not what, it selects.
  excluded = pool / POOL_EXCLUDED_FILE  # Same-sized pools of other exclusions differ here.
  check_inputs("selection", folder, {
      "pool": identity(pool / selection_formats.INFO_FILE),
      "pool_excluded": json.loads(excluded.read_text()) if excluded.exists() else {},
      "selection": params})
  if (folder / selection_formats.SELECTION_FILE).exists():
    _say(f"[selection] done already in {folder}: skipped")
  else:
    _say(f"[selection] {c.variant} from {pool} -> {folder}")
  info = selection.prepare(
      str(pool), str(folder), k=k, variant=c.variant, class_sizes=class_sizes,
      zipf_total=zipf_total, zipf_exponent=c.zipf_exponent,
      seed=c.seed, expected_class_names=class_names, beam_runner=c.beam_runner or None,
      beam_options=c.beam_options.split())
  _say(selection.summary(info, str(folder)))
  if not info["report"]["num_selected"]:
    raise ValueError(f"The selection in {folder} is empty: no pool image kept any class in "
                     "its top-P; nothing to pretrain the student on.")
  return info


def check_settings(config, num_classes: int) -> None:
  """The inference and selection settings, checked before the teacher trains: a bad one
  would otherwise stop the run after it. `num_classes`: the teacher's (D's)."""
  pool_predictions.check_top_p(config.infer.top_p, num_classes, "config.infer.top_p")
  pool_predictions.check_shard_size(config.infer.shard_size, "config.infer.{}")
  sharding.inference_mesh(config.infer.fsdp, config.infer.batch_size, "config.infer.{}")
  if config.dedup.against:
    sharding.inference_mesh(config.dedup.fsdp, config.dedup.batch_size, "config.dedup.{}")
  c = config.selection
  k, zipf_total = _selection_sizes(c)
  try:
    topk.check_choice(c.variant, k, bool(c.class_sizes), zipf_total)
  except ValueError as e:
    raise ValueError(f"config.selection: {e}") from None


def check_keys(config) -> None:
  """Refuses a key of the runner's own sections that it does not read (a typo in a config
  file, which the command line would have refused), naming its close match; a config of
  another command (a trainer's recipe) is named as such."""
  stages = ("teacher", "student", "finetune", "infer", "selection")
  if not all(isinstance(config.get(k), ml_collections.ConfigDict) for k in stages):
    raise ValueError(f"The config is not the semi-supervised runner's: it has no "
                     f"{'/'.join(stages)} sections (configs/semi_supervised.py has them; a "
                     "recipe of the trainer runs with `python -m bigpretrain.main`).")
  for where, known in _KEYS.items():
    section = config if where == "config" else config.get(where.split(".")[1])
    if section is not None:
      config_lib.check_known_keys(section, known, where)


def run(config, workdir: str) -> dict:
  """Runs (or completes) every stage of `config` in `workdir`; returns results.json's content.
  Raises Interrupted when a SIGTERM or Ctrl-C stopped a training stage, or came in a stage
  that ran to its end (then before the next stage starts)."""
  with preemption.Preemption(on_signal="finishing this stage, then stopping") as signals:
    return _run(config, workdir, lambda stage: _stop_if_signalled(signals, stage))


def _stop_if_signalled(signals: preemption.Preemption, stage: str) -> None:
  """Raises Interrupted on every process, before `stage`, once any got a signal."""
  if signals.agreed(log_step=True):
    raise Interrupted(f"Stopped before [{stage}] (SIGTERM or Ctrl-C); re-run the same "
                      "command to resume: finished stages are kept.")


def _run(config, workdir: str, before) -> dict:
  """run's stages; `before(stage)` ahead of each (_stop_if_signalled)."""
  check_keys(config)
  root = epath.Path(workdir)
  if is_main():
    root.mkdir(parents=True, exist_ok=True)
  if not isinstance(config.rounds, int) or config.rounds < 1:
    raise ValueError(f"config.rounds={config.rounds!r} must be an int >= 1.")
  full = datasets.get_dataset({"name": config.data.name, "dir": config.data.dir})
  foreign_pool = pool_name(config) != config.data.name
  pool_info = (datasets.get_dataset({"name": pool_name(config), "dir": config.data.dir}).info
               if foreign_pool else full.info)
  pool_splits = check_pool(config, pool_info)
  check_settings(config, full.info.num_classes)
  if config.selection.variant == "balanced_with_tags":
    raise ValueError("config.selection.variant=balanced_with_tags draws by the images' tags, "
                     "which the teacher's predictions over U do not carry: run `python -m "
                     "input_pipeline.prepare selection --variant=balanced_with_tags` on "
                     "predictions with a 'tags' column instead.")
  labelled = labelled_data(config)
  d_source = datasets.train_sources(labelled, full)[0][0]  # subset.SubsetSource when drawn.
  class_names = list(full.info.class_names) or [str(c) for c in range(full.info.num_classes)]
  exclude = {}
  if config.data.pool_train_rest:  # The train records of D stay out of U.
    exclude["train"] = d_source.indices
  _say(f"D: {len(d_source)} labelled images of {config.data.name!r}; U: "
       f"splits {pool_splits} of {pool_name(config)!r}" +
       (" (train without D)" if exclude else ""))
  results = {"rounds": []}
  teacher = config.teacher_workdir
  if not teacher:
    teacher_cfg = stage_config(config.teacher, config.seed, labelled)
    inputs = {}
    if config.get("teacher_pretrain"):  # Semi-weakly supervised: hashtags, then D.
      teacher_cfg.model_init = config.get("teacher_pretrained") or ""
      if not teacher_cfg.model_init:
        folder = root / "round1" / "teacher_pretrain"
        before("teacher pretraining")
        done = train_stage("teacher pretraining", stage_config(
            config.teacher_pretrain, config.seed, {"dir": config.data.dir}), folder)
        teacher_cfg.model_init = str(folder)
        results["teacher_pretrain"] = done["results"]
      inputs["model_init"] = model_identity(teacher_cfg.model_init)
    before("teacher")
    done = train_stage("teacher", teacher_cfg, root / "round1" / "teacher", inputs)
    teacher = str(root / "round1" / "teacher")
    results["teacher"] = done["results"]
  if config.get("dedup") and config.dedup.against:
    model = config.dedup.model or teacher
    for split in pool_splits:
      before(f"dedup {split}")
      removed = dedup_stage(config, model, split, root / "dedup" / split)
      exclude[split] = np.union1d(exclude.get(split, np.zeros(0, np.int64)), removed)
  steps = 0
  for r in range(1, config.rounds + 1):
    rdir = root / f"round{r}"
    preds = {s: rdir / "predictions" / s for s in pool_splits}
    for split, folder in preds.items():
      before(f"infer {split}")
      infer_stage(teacher, config, split, folder)
    _sync("pool")
    before("pool")
    pool_stage(preds, exclude, class_names, rdir / "pool")
    # One Beam job; --config.selection.beam_runner spreads it.
    before("selection")
    sel = process_zero.run("[selection]", selection_stage, config, rdir / "pool", class_names,
                           rdir / "selection")
    if not is_main():
      sel = json.loads((rdir / "selection" / selection_formats.SELECTION_FILE).read_text())
    student_data = {"name": f"selection:{rdir / 'selection'}", "dir": config.data.dir,
                    "subset_frac": 1.0}
    student_cfg = stage_config(config.student, config.seed, student_data)
    if foreign_pool:  # D-hat has no eval split of its own (selection_source.py).
      for evaluator in student_cfg.evals.values():
        if "dataset" not in evaluators_base.EVALUATORS.get(evaluator.type).NOT_READ:
          evaluator.dataset = evaluator.get("dataset") or config.data.name
    before(f"round {r} student")
    student = train_stage(f"round {r} student", student_cfg, rdir / "student", {
        "selection": identity(rdir / "selection" / selection_formats.SELECTION_FILE)})
    ft_cfg = stage_config(config.finetune, config.seed, labelled)
    ft_cfg.model_init = str(rdir / "student")
    before(f"round {r} fine-tuning")
    finetune = train_stage(f"round {r} fine-tuning", ft_cfg, rdir / "finetune",
                           {"model_init": identity(rdir / "student" / DONE_FILE)})
    steps = student["total_steps"] + finetune["total_steps"]
    results["rounds"].append({"teacher": teacher, "selected": sel["report"]["num_selected"],
                              "student": student["results"], "finetune": finetune["results"],
                              "steps": steps})
    teacher = str(rdir / "finetune")
  if config.run_baseline:
    base_cfg = stage_config(config.baseline, config.seed, labelled)
    if base_cfg.total_steps <= 0 and base_cfg.num_epochs <= 0 and base_cfg.num_examples <= 0:
      base_cfg.total_steps = steps  # The last round's pretraining + fine-tuning steps.
    before("supervised baseline")
    results["baseline"] = train_stage("supervised baseline", base_cfg,
                                      root / "baseline")["results"]
  before("results")
  _write_json(root / RESULTS_FILE, results)
  _say(summary(results))
  return results


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices(f"semi_supervised_{name}")


def summary(results: dict) -> str:
  """The numbers, one line each (demo validation top-1)."""
  def top1(res):
    return "n/a" if not res or METRIC not in res else f"{100 * res[METRIC]:.2f}"
  lines = []
  if "teacher_pretrain" in results:  # Hashtags: precision@1 on its own validation split.
    p1 = results["teacher_pretrain"].get("eval/precision_at_1")
    lines.append("teacher pretraining (hashtags):  precision@1 " +
                 ("n/a" if p1 is None else f"{100 * p1:.2f}"))
  if "teacher" in results:
    lines.append(f"teacher (on D):                  top-1 {top1(results['teacher'])}")
  for r, rd in enumerate(results["rounds"], 1):
    lines.append(f"round {r} student, pretrained:    top-1 {top1(rd['student'])} "
                 f"(|D-hat| = {rd['selected']})")
    lines.append(f"round {r} student, fine-tuned:    top-1 {top1(rd['finetune'])} "
                 f"({rd['steps']} steps)")
  if "baseline" in results:
    lines.append(f"supervised baseline (D alone):   top-1 {top1(results['baseline'])}")
  return "\n".join(lines)
