"""Teacher predictions over an unlabelled pool: per image its top-P classes and scores.

The library of `python -m bigpretrain.tools.infer` (its flags are listed there).

Stage 2 of the semi-supervised recipe (Yalniz et al., 2019, section 3.1): the teacher, in eval
mode and with its checkpoint's preprocessing (meta['data']: image_size, eval_resize,
normalize), scores every record of the split; the top_p (P = 10 in the paper, section 4.1)
classes of each image and their softmax scores (raw logits with --logits: the supplement's
ablation, section 1) are written in the predictions format (input_pipeline/jobs/selection_job.py's
docstring; selection_formats.py), keyed by (--data, --split, record index), for the selection
job. --exclude names an exclusion list (input_pipeline/exclusions.py, e.g. the near-duplicates
of evaluation images found by bigpretrain.tools.dedup): its records of this split are never scored,
and predictions.json counts them (num_excluded).

Shards and resumption: shard s holds the records [s * S, (s + 1) * S) (S = --shard_size) as
`SPLIT-SSSSS-of-NNNNN.parquet`, written whole to a temporary name and renamed, so a shard
file exists only when complete. A killed run, re-run with the same flags, skips the shards
that exist; other flags on a started folder are an error (inference.json records them), and
so is a teacher that has saved a newer checkpoint since (the step the shards were scored by
is recorded with them).
predictions.json is written last, with num_records; its presence means the folder is done.

Hosts: every process runs this command (launch/ scripts); each reads its own slice of each
shard (pipeline.eval_iterator: host p takes rows p, p + H, ...), the forward pass is one jit
over the global mesh (--fsdp shards a large teacher's weights), the top-P rows come back
replicated and process 0 writes the shards (OUT must be visible to it, e.g. gs:// or local).
"""
import json
import sys
import uuid

from etils import epath
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
import tqdm

from bigpretrain import checkpoint
from bigpretrain import config_lib
from bigpretrain import inference
from bigpretrain import sharding
from bigpretrain.models import pretrained
from bigpretrain.runtime import console
from bigpretrain.runtime import out_paths
from bigpretrain.runtime import process_zero
from input_pipeline import datasets
from input_pipeline import exclusions
from input_pipeline import selection_formats
from input_pipeline import subset

PARAMS_FILE = "inference.json"
DEFAULT_TOP_P = 10  # Section 4.1: "P = 10".
DEFAULT_SHARD_SIZE = 50_000


def shard_name(split: str, shard: int, num_shards: int) -> str:
  return f"{split}-{shard:05d}-of-{num_shards:05d}.parquet"


def shard_ranges(num_records: int, shard_size: int) -> list[tuple[int, int]]:
  """[(start, stop)] of each shard: fixed ranges of record indices, the last one shorter."""
  return [(a, min(a + shard_size, num_records)) for a in range(0, num_records, shard_size)]


def check_top_p(top_p: int, num_classes: int, name: str = "--top_p") -> None:
  """ValueError unless 1 <= top_p <= the model's classes (before a step is made); `name`:
  the setting's, for the message."""
  if isinstance(top_p, bool) or not isinstance(top_p, int) or not 1 <= top_p <= num_classes:
    raise ValueError(f"{name}={top_p!r} must be an integer in [1, {num_classes}] (the model's "
                     "classes).")


def check_shard_size(shard_size: int, name: str = "--{}") -> None:
  if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
    raise ValueError(f"{name.format('shard_size')}={shard_size!r} must be a positive integer.")


def make_step(model_def, shardings, mesh, normalize: str, top_p: int, logits: bool):
  """make_forward with the top_p softmax scores (or logits) per row: {'classes', 'scores'}."""

  def top(module, images):
    out = module(images, train=False).astype(jnp.float32)
    scores = out if logits else jax.nn.softmax(out, axis=-1)
    values, classes = jax.lax.top_k(scores, top_p)  # Best first.
    return {"classes": classes.astype(jnp.int32), "scores": values}

  return inference.make_forward(model_def, shardings, mesh, normalize, top)


def _check_params(out: epath.Path, params: dict) -> None:
  """Records the run's parameters in a new folder; a started one must have the same."""
  path = out / PARAMS_FILE
  if path.exists():
    found = json.loads(path.read_text())
    if found != params:
      diff = {k: (found.get(k), v) for k, v in params.items() if found.get(k) != v}
      if "checkpoint_step" in diff:
        advice = ("the teacher has a newer checkpoint than the one its shards were scored "
                  "with: use another --out (or delete this one) to score with it")
      else:
        advice = "re-run with the same flags to resume, or use another --out"
      raise ValueError(f"{out} holds inference with other parameters {diff} (found, given); "
                       f"{advice}.")
  elif jax.process_index() == 0:
    _write_atomic(path, json.dumps(params, indent=1).encode())


def _excluded_records(listed: exclusions.Exclusions, data: str, split: str,
                      num_records: int) -> np.ndarray:
  """The record indices of data:split on an exclusion list (sorted); ValueError when one is
  past the split's end."""
  path = listed.path
  excluded = listed.indices(data, split)
  if excluded.size and excluded[-1] >= num_records:
    raise ValueError(f"Exclusion list {path} names record {int(excluded[-1])} of {data}:{split},"
                     f" which has {num_records} records: a list made for another dataset?")
  if len(listed) and not excluded.size and jax.process_index() == 0:
    console.warn(f"Exclusion list {path} has {len(listed)} records, none of {data}:{split} "
                 f"(it lists {sorted(listed.records)}).")
  return excluded


def _write_atomic(path: epath.Path, data: bytes) -> None:
  tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex}"
  tmp.write_bytes(data)
  tmp.rename(path)


def _agree(flags_: np.ndarray) -> np.ndarray:
  """Process 0's view of which shards are pending, on every process."""
  if jax.process_count() == 1:
    return flags_
  return np.asarray(multihost_utils.broadcast_one_to_all(flags_))


def _write_shard(out: epath.Path, name: str, dataset: str, split: str, rows: dict) -> None:
  """One shard in selection.py's format: tmp file + rename (selection reads only *.parquet)."""
  tmp = out / f".{name}.tmp-{uuid.uuid4().hex}"
  selection_formats.write_predictions(tmp, dataset, split, rows["index"], rows["classes"],
                              rows["scores"])
  tmp.rename(out / name)


def run(workdir: str, data: str, split: str, out: str, *, data_dir: str = "",
        top_p: int = DEFAULT_TOP_P, batch_size: int = 256, logits: bool = False,
        shard_size: int = DEFAULT_SHARD_SIZE, fsdp: int = 1, num_workers: int = 0,
        progress: bool = True, exclude: str | None = None,
        pool_classes: str = "teacher", name: str = "--{}") -> dict:
  """Writes (or completes) the predictions of `workdir`'s model on `data`:`split` in `out`;
  returns predictions.json's content. `exclude`: an exclusion list (input_pipeline/
  exclusions.py) whose records of `data`:`split` are not scored. `pool_classes`: 'teacher'
  (the pool is labelled in the teacher's class list, checked) or 'any' (a pool of another
  class list, e.g. a hashtag dataset: its labels are never read, selection_source.py).
  `name` formats a setting's name in messages ('--{}', 'config.infer.{}')."""
  if pool_classes not in ("teacher", "any"):
    raise ValueError(f"pool_classes={pool_classes!r} must be 'teacher' or 'any'.")
  check_shard_size(shard_size, name)
  checkpoint_step = checkpoint.latest_step(workdir)  # Recorded: a resume scores with it.
  meta = checkpoint.read_meta(workdir, checkpoint_step)
  dataset = datasets.get_dataset({"name": data, "dir": data_dir})
  info = dataset.info
  if split not in info.splits:
    raise ValueError(f"Dataset {data!r} has no split {split!r}; its splits: "
                     f"{list(info.splits)}" + (" (a slice such as 'unlabeled[:50]' is the "
                     "trainer's and evaluators' form: inference scores whole splits)."
                     if "[" in split else "."))
  num_classes = int(meta["num_classes"])
  class_names = list(meta["class_names"]) or [str(c) for c in range(num_classes)]
  same = pool_classes == "teacher"
  if same and num_classes != info.num_classes:
    raise ValueError(f"The teacher in {workdir} predicts {num_classes} classes (trained on "
                     f"{meta['dataset']!r}); dataset {data!r} has {info.num_classes}: the "
                     "pool must be labelled in the teacher's class list.")
  if same and meta["class_names"] and info.class_names:
    selection_formats.check_class_names(info.class_names, meta["class_names"], f"dataset {data!r}")
  check_top_p(top_p, num_classes, name.format("top_p"))

  mesh = sharding.inference_mesh(fsdp, batch_size, name)
  listed = exclusions.read(exclude) if exclude else None
  # Made only once the settings are checked: a refused run leaves no folder behind.
  root = epath.Path(out)
  is_main = jax.process_index() == 0
  process_zero.run("the --out check", out_paths.folder, out)
  loaded = pretrained.load(workdir, mesh=mesh, rules=config_lib.base_config().sharding_rules,
                           step=checkpoint_step)
  step = make_step(loaded.model_def, loaded.shardings, mesh, meta["data"]["normalize"],
                   top_p, logits)
  data_cfg = {**meta["data"], "num_workers": num_workers}
  inference.warn_of_shared_memory(data_cfg, batch_size)

  source = dataset.source(split)
  ranges = shard_ranges(len(source), shard_size)
  names = [shard_name(split, s, len(ranges)) for s in range(len(ranges))]
  params = {"workdir": str(workdir), "checkpoint_step": checkpoint_step, "dataset": data,
            "split": split, "top_p": top_p, "scores": "logits" if logits else "softmax",
            "shard_size": shard_size, "split_records": len(source)}
  excluded = np.zeros(0, np.int64)
  if listed is not None:
    excluded = _excluded_records(listed, data, split, len(source))
    params["exclude"] = {**listed.describe(), "num_excluded": len(excluded)}
  _check_params(root, params)
  strays = sorted(set(p.name for p in root.glob("*.parquet")) - set(names))
  if strays:
    raise ValueError(f"{out} holds shards {strays[:3]} that this run would not write; "
                     "use an empty --out.")
  pending = _agree(np.array([not (root / n).exists() for n in names], bool))

  todo = sum(b - a - int(((excluded >= a) & (excluded < b)).sum())
             for (a, b), p in zip(ranges, pending) if p)
  if is_main:
    console.say(f"Inference of {workdir} on {data}:{split}: {len(ranges)} shards, "
                f"{int(pending.sum())} pending ({todo} records, {len(excluded)} excluded in all).")
  skipped = 0
  # Closed (its line ended) by the time an error reaches the command's error line.
  with tqdm.tqdm(total=todo, unit="img", unit_scale=True, smoothing=0.1, file=sys.stdout,
                 disable=not (progress and is_main), desc=f"{data}:{split}") as bar:
    for (start, stop), name, todo_shard in zip(ranges, names, pending):
      if not todo_shard:
        continue
      records = np.setdiff1d(np.arange(start, stop), excluded, assume_unique=True)
      parts = [{"index": np.zeros(0, np.int64), "classes": np.zeros((0, top_p), np.int32),
                "scores": np.zeros((0, top_p), np.float32)}]  # An all-excluded shard is empty.
      for rows, skipped_rows in inference.forward_rows(step, loaded.variables,
                                             subset.SubsetSource(source, records), data_cfg,
                                             batch_size=batch_size, mesh=mesh):
        skipped += skipped_rows
        parts.append(rows)
        bar.update(len(rows["index"]))
      process_zero.run(f"Writing shard {name}", _finish_shard, root, name, data, split, parts,
                       records)
  if skipped and is_main:
    console.warn(f"{skipped} corrupt records skipped (not in the predictions).")

  info_path = root / selection_formats.INFO_FILE
  process_zero.run("Writing predictions.json", _write_info, root, names, class_names, top_p,
                   data, split, params["scores"], len(excluded) if exclude else None)
  return json.loads(info_path.read_text())


def _finish_shard(root: epath.Path, name: str, dataset: str, split: str, parts: list[dict],
                  records: np.ndarray) -> None:
  """One shard's rows, in record order, as `name` (process 0)."""
  rows = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
  order = np.argsort(rows["index"], kind="stable")
  rows = {k: v[order] for k, v in rows.items()}
  rows["index"] = records[rows["index"]]  # Subset position -> record index.
  if len(np.unique(rows["index"])) != len(rows["index"]):
    raise RuntimeError(f"Shard {name}: a record came back twice from the eval pipeline.")
  _write_shard(root, name, dataset, split, rows)


def _write_info(root: epath.Path, names: list[str], class_names: list[str], top_p: int,
                dataset: str, split: str, scores: str, num_excluded: int | None) -> None:
  """predictions.json, the done marker, once every shard is there (process 0)."""
  info_path = root / selection_formats.INFO_FILE
  if not info_path.exists():
    missing = [n for n in names if not (root / n).exists()]
    if missing:
      raise RuntimeError(f"Shards {missing[:3]} are missing in {root} after the run.")
    num_records = 0
    for n in names:
      with (root / n).open("rb") as f:
        num_records += pq.ParquetFile(f).metadata.num_rows
    tmp = root / f".info-tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    selection_formats.write_info(tmp, class_names=class_names, top_p=top_p, dataset=dataset,
                                 splits=[split], num_records=num_records, scores=scores,
                                 num_excluded=num_excluded)
    (tmp / selection_formats.INFO_FILE).rename(info_path)
    tmp.rmdir()
