"""Deduplication of an unlabelled pool against evaluation sets: an exclusion list and a report.

Yalniz et al. 2019, supplement section 5: the 512-d pool5 features of an ImageNet-trained
ResNet-18, L2-normalised; the Euclidean distance between every ImageNet validation image and
every YFCC-100M image, searched with Faiss over an index of the 100M pool; all pairs sorted
globally by distance (ascending) and the top ones reviewed by hand; the top 5000 YFCC images
removed (218 more for CUB2011). Here MODEL is any checkpoint whose model has `features()` (the
paper's is resnet18 trained on ImageNet-1K), read with its eval preprocessing, and every pool
image is ranked by its distance to its closest evaluation image (the first of its pairs in the
global order): --top_n=N removes the N closest pool images (the paper's N = 5000),
--max_distance=D every pool image within D. Distances are Euclidean between unit vectors,
d = sqrt(2 - 2 cos), in [0, 2]; ties go to the smaller pool record index.

Search: the pool is the index, the evaluation images the queries, faiss inner product on the
unit vectors. A pool of at most --ivf_threshold images gets the exact IndexFlatIP; a larger one
an IndexIVFFlat with --nlist lists (0: 4 sqrt(N), the low end of faiss's 4..16 sqrt(N)
guideline), trained by k-means on a --seed sample of 64 images per list, and searched in
--nprobe lists per query: approximate, a duplicate in a list not probed is missed. --top_n
asks each query for its N + 1 nearest pool images, which finds the exact N closest pool images
(each is among the N closest to its own closest query) and the first one kept; --max_distance
runs a range search. The pool's features live in the index (N x dim float32: 200 GB for the
paper's 100M 512-d pool; at that scale run on parts of the pool and merge, since the global N
closest are among each part's N closest).

Output in DIR: exclusions.tsv (input_pipeline/exclusions.py), the removed pool records, for
`bigpretrain.tools.infer --exclude` and `input_pipeline.prepare selection --exclude`; dedup.json
(written last; a finished DIR with the same flags is reused, with others it is an error): the
parameters, the sets and their sizes, the index, and the removed pairs sorted by distance
(pool record, its closest evaluation record, distance), plus `first_kept` (--top_n: the
closest pool image not removed, the margin to review).

Hosts: as bigpretrain.tools.infer, every process runs the command and computes its slice of each
batch; process 0 builds the index and writes DIR.
"""
import json
import math
import sys
import uuid

from etils import epath
import jax
import jax.numpy as jnp
import numpy as np
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
from input_pipeline import subset

REPORT_FILE = "dedup.json"
EXCLUSIONS_FILE = "exclusions.tsv"
DEFAULT_IVF_THRESHOLD = 1_000_000
DEFAULT_NPROBE = 64
TRAIN_POINTS_PER_LIST = 64  # faiss k-means warns below 39 training points per centroid.
QUERY_BATCH = 4096
_RANGE_SLACK = 1e-6  # float32 slack on the range-search radius; exact distances cut after.


def parse_sets(text: str, flag: str) -> list[tuple[str, str]]:
  """'NAME:SPLIT[,NAME:SPLIT...]' -> [(name, split)]; the split follows the LAST ':' (dataset
  names such as folder:NAME hold one)."""
  out = []
  for entry in (e.strip() for e in str(text or "").split(",")):
    if "[" in entry:
      raise ValueError(f"--{flag}={text!r}: {entry!r} is a slice of a split; deduplication "
                       "compares whole splits (NAME:SPLIT).")
    name, sep, split = entry.rpartition(":")
    if not sep or not name or not split:
      raise ValueError(f"--{flag}={text!r}: expected NAME:SPLIT entries (e.g. demo:validation, "
                       "folder:pets:train), separated by ','.")
    out.append((name, split))
  return out


def distance(inner_product):
  """Euclidean distance of unit vectors from their inner product: sqrt(2 - 2 ip)."""
  return np.sqrt(np.maximum(0.0, 2.0 - 2.0 * np.asarray(inner_product, np.float64)))


def default_nlist(num_pool: int) -> int:
  """4 sqrt(N) lists, at most one per TRAIN_POINTS_PER_LIST pool images."""
  return max(1, min(round(4 * math.sqrt(num_pool)), num_pool // TRAIN_POINTS_PER_LIST))


def make_features_step(model_def, shardings, mesh, normalize: str):
  """inference.make_forward with the model's L2-normalised pooled features: {'features'}."""

  def outputs(module, images):
    f = module.features(images, train=False).astype(jnp.float32)
    return {"features": f / jnp.maximum(jnp.linalg.norm(f, axis=-1, keepdims=True), 1e-12)}

  return inference.make_forward(model_def, shardings, mesh, normalize, outputs)


def _faiss():
  try:
    import faiss  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("bigpretrain.semisup.dedup needs faiss: pip install 'bigpretrain[dedup]' (or "
                      "faiss-cpu).") from e
  return faiss


def closest_pool_images(index, queries: np.ndarray, *, top_n: int | None = None,
                        max_distance: float | None = None) -> dict[str, np.ndarray]:
  """Per pool image found, its closest query: {'pool', 'query' (positions in the index and in
  `queries`), 'ip'} sorted by (ip descending, pool position); with top_n the first
  top_n + 1 of them (exact for an exact index), with max_distance all within it."""
  keep_best = top_n + 1 if top_n is not None else None
  best = {"pool": np.zeros(0, np.int64), "query": np.zeros(0, np.int64),
          "ip": np.zeros(0, np.float32)}
  for start in range(0, len(queries), QUERY_BATCH):
    q = np.ascontiguousarray(queries[start:start + QUERY_BATCH], np.float32)
    if top_n is not None:
      ip, pool = index.search(q, min(keep_best, index.ntotal))
      query = np.broadcast_to(np.arange(len(q))[:, None], pool.shape)
      found = pool >= 0
      pool, ip, query = pool[found], ip[found], query[found]
    else:
      radius = 1.0 - max_distance ** 2 / 2.0 - _RANGE_SLACK
      lims, ip, pool = index.range_search(q, radius)
      query = np.repeat(np.arange(len(q)), np.diff(lims).astype(np.int64))
      within = distance(ip) <= max_distance
      pool, ip, query = pool[within], ip[within], query[within]
    merged = {"pool": np.concatenate([best["pool"], pool.astype(np.int64)]),
              "query": np.concatenate([best["query"], query.astype(np.int64) + start]),
              "ip": np.concatenate([best["ip"], ip.astype(np.float32)])}
    # Each pool image's best pair (highest ip, then the first query), then the global order.
    order = np.lexsort((merged["query"], -merged["ip"], merged["pool"]))
    first = np.ones(len(order), bool)
    first[1:] = merged["pool"][order][1:] != merged["pool"][order][:-1]
    best = {k: v[order][first] for k, v in merged.items()}
    order = np.lexsort((best["pool"], -best["ip"]))[:keep_best]
    best = {k: v[order] for k, v in best.items()}
  return best


def check_args(top_n, max_distance, batch_size, nprobe, nlist, ivf_threshold) -> None:
  if (top_n is None) == (max_distance is None):
    raise ValueError("Give exactly one of --top_n (remove the N closest pool images) and "
                     f"--max_distance (remove those within D); got top_n={top_n}, "
                     f"max_distance={max_distance}.")
  if top_n is not None and top_n < 1:
    raise ValueError(f"--top_n={top_n} must be >= 1.")
  if max_distance is not None and not 0 <= max_distance <= 2:
    raise ValueError(f"--max_distance={max_distance} must be in [0, 2] (Euclidean distance "
                     "of unit vectors).")
  if batch_size < 1 or nprobe < 1 or nlist < 0 or ivf_threshold < 0:
    raise ValueError(f"Need --batch_size >= 1, --nprobe >= 1, --nlist >= 0, --ivf_threshold "
                     f">= 0; got {batch_size}, {nprobe}, {nlist}, {ivf_threshold}.")


def _source(name: str, split: str, data_dir: str):
  dataset = datasets.get_dataset({"name": name, "dir": data_dir})
  if split not in dataset.info.splits:
    raise ValueError(f"Dataset {name!r} has no split {split!r}; its splits: "
                     f"{list(dataset.info.splits)}.")
  return dataset.source(split)


def _key(dataset: str, split: str, index) -> dict:
  return {"dataset": dataset, "split": split, "index": int(index)}


def run(workdir: str, pool: str, against: str, out: str, *, top_n: int | None = None,
        max_distance: float | None = None, data_dir: str = "", batch_size: int = 256,
        ivf_threshold: int = DEFAULT_IVF_THRESHOLD, nlist: int = 0,
        nprobe: int = DEFAULT_NPROBE, seed: int = 0, fsdp: int = 1, num_workers: int = 0,
        progress: bool = True, name: str = "--{}") -> dict:
  """Deduplicates `pool` ('NAME:SPLIT') against `against` ('NAME:SPLIT[,...]') with the
  model in `workdir`; writes exclusions.tsv and dedup.json into `out`, returns the report.
  `name` formats the batch and mesh settings' names in messages ('--{}', 'config.dedup.{}')."""
  check_args(top_n, max_distance, batch_size, nprobe, nlist, ivf_threshold)
  pools = parse_sets(pool, "pool")
  if len(pools) != 1:
    raise ValueError(f"--pool={pool!r}: one NAME:SPLIT.")
  (pool_name, pool_split), = pools
  evals = parse_sets(against, "against")
  if (pool_name, pool_split) in evals or len(set(evals)) != len(evals):
    raise ValueError(f"--against={against!r} repeats a set or holds the pool {pool!r}.")
  params = {"workdir": str(workdir), "pool": f"{pool_name}:{pool_split}",
            "against": [f"{n}:{s}" for n, s in evals], "top_n": top_n,
            "max_distance": max_distance, "ivf_threshold": ivf_threshold, "nlist": nlist,
            "nprobe": nprobe, "seed": seed}
  root = epath.Path(out)
  done = root / REPORT_FILE
  if done.exists():
    report = json.loads(done.read_text())
    if report.get("params") != params:
      raise ValueError(f"{out} holds a deduplication with other parameters: "
                       f"{report.get('params')} vs {params} now; use another --out.")
    if jax.process_index() == 0:
      console.say(f"Reusing the finished deduplication in {out}.")
    return report
  process_zero.run("the --out check", out_paths.folder, out)
  faiss = _faiss()
  pool_source = _source(pool_name, pool_split, data_dir)
  eval_sources = [_source(n, s, data_dir) for n, s in evals]
  if not len(pool_source):
    raise ValueError(f"--pool={pool!r} has no records.")

  meta = checkpoint.read_meta(workdir)
  mesh = sharding.inference_mesh(fsdp, batch_size, name)
  loaded = pretrained.load(workdir, mesh=mesh, rules=config_lib.base_config().sharding_rules)
  if not callable(getattr(loaded.module(), "features", None)):
    raise ValueError(f"The model in {workdir} ({meta['model']['name']}) has no features() "
                     "method (pooled features), which deduplication compares.")
  step = make_features_step(loaded.model_def, loaded.shardings, mesh,
                            meta["data"]["normalize"])
  data_cfg = {**meta["data"], "num_workers": num_workers}
  inference.warn_of_shared_memory(data_cfg, batch_size)
  is_main = jax.process_index() == 0

  def features(source, desc):
    """(features [n, dim] float32, positions in source [n]) of source's readable records."""
    parts, positions = [], []
    with tqdm.tqdm(total=len(source), unit="img", unit_scale=True, file=sys.stdout,
                   disable=not (progress and is_main), desc=desc) as bar:
      for rows, skipped_rows in inference.forward_rows(step, loaded.variables, source, data_cfg,
                                                   batch_size=batch_size, mesh=mesh):
        parts.append(rows["features"])
        positions.append(rows["index"])
        bar.update(len(rows["index"]) + skipped_rows)
    if not parts:
      return np.zeros((0, 0), np.float32), np.zeros(0, np.int64)
    return np.concatenate(parts), np.concatenate(positions)

  # The evaluation sets: the queries.
  queries, query_keys = [], []
  for (name, split), source in zip(evals, eval_sources):
    f, idx = features(source, f"{name}:{split}")
    queries.append(f)
    query_keys += [(name, split, i) for i in idx.tolist()]
  queries = np.concatenate([q for q in queries if q.size] or [np.zeros((0, 1), np.float32)])

  # The pool: the index, filled batch by batch (its features are not kept twice).
  num_pool = len(pool_source)
  use_ivf = num_pool > ivf_threshold
  lists = (nlist or default_nlist(num_pool)) if use_ivf else None
  index, pool_ids = None, []
  desc = f"{pool_name}:{pool_split}"
  if use_ivf:
    sample = np.sort(np.random.default_rng(seed).choice(
        num_pool, min(num_pool, TRAIN_POINTS_PER_LIST * lists), replace=False))
    train, _ = features(subset.SubsetSource(pool_source, sample), desc + " (k-means sample)")
    if is_main:
      quantizer = faiss.IndexFlatIP(train.shape[1])
      index = faiss.IndexIVFFlat(quantizer, train.shape[1], lists, faiss.METRIC_INNER_PRODUCT)
      index.train(train)
      index.nprobe = nprobe
  with tqdm.tqdm(total=num_pool, unit="img", unit_scale=True, file=sys.stdout,
                 disable=not (progress and is_main), desc=desc) as bar:
    for rows, skipped_rows in inference.forward_rows(step, loaded.variables, pool_source,
                                                 data_cfg, batch_size=batch_size, mesh=mesh):
      bar.update(len(rows["index"]) + skipped_rows)
      if is_main and len(rows["index"]):
        if index is None:
          index = faiss.IndexFlatIP(rows["features"].shape[1])
        index.add(np.ascontiguousarray(rows["features"], np.float32))
        pool_ids.append(rows["index"])

  def write_report() -> dict:
    if index is None or not len(query_keys):
      raise ValueError(f"No readable images in the pool {pool!r} or in --against={against!r}.")
    if queries.shape[1] != index.d:
      raise ValueError(f"Feature sizes differ: {queries.shape[1]} (queries), {index.d} (pool).")
    ids = np.concatenate(pool_ids)
    best = closest_pool_images(index, queries, top_n=top_n, max_distance=max_distance)
    pairs = [{"pool": _key(pool_name, pool_split, ids[p]),
              "nearest": _key(*query_keys[q]), "distance": float(d)}
             for p, q, d in zip(best["pool"].tolist(), best["query"].tolist(),
                                distance(best["ip"]).tolist())]
    removed = pairs[:top_n] if top_n is not None else pairs
    report = {
        "params": params,
        "model": {"name": meta["model"]["name"], "feature_dim": int(index.d),
                  "data": meta["data"]},
        "pool": {"dataset": pool_name, "split": pool_split, "num_records": num_pool,
                 "num_indexed": int(index.ntotal)},
        "against": [{"dataset": n, "split": s, "num_records": len(src)}
                    for (n, s), src in zip(evals, eval_sources)],
        "num_queries": len(query_keys),
        "skipped_corrupt": (num_pool - int(index.ntotal)
                            + sum(len(src) for src in eval_sources) - len(query_keys)),
        "index": ({"type": "IndexIVFFlat", "nlist": lists, "nprobe": nprobe,
                   "train_points": len(train)} if use_ivf else {"type": "IndexFlatIP"}),
        "num_removed": len(removed),
        "removed": removed,
        "first_kept": pairs[top_n] if top_n is not None and len(pairs) > top_n else None,
    }
    exclusions.write(root / EXCLUSIONS_FILE, [(r["pool"]["dataset"], r["pool"]["split"],
                                               r["pool"]["index"]) for r in removed])
    tmp = root / f".{REPORT_FILE}.tmp-{uuid.uuid4().hex}"
    tmp.write_text(json.dumps(report, indent=1))
    tmp.rename(done)
    return report

  report = process_zero.run("deduplication", write_report)
  return report if report is not None else json.loads(done.read_text())


def summary(report: dict, out: str) -> str:
  """Human-readable summary of a report."""
  r = report
  lines = [f"Removed {r['num_removed']} of {r['pool']['num_indexed']} images of "
           f"{r['params']['pool']} (closest to {r['num_queries']} images of "
           f"{', '.join(r['params']['against'])}; index {r['index']['type']})."]
  for pair in r["removed"][:5]:
    p, q = pair["pool"], pair["nearest"]
    lines.append(f"  {p['dataset']}:{p['split']}[{p['index']}] ~ {q['dataset']}:{q['split']}"
                 f"[{q['index']}]  distance {pair['distance']:.4f}")
  if r["removed"]:
    lines.append(f"  ... largest distance removed: {r['removed'][-1]['distance']:.4f}")
  if r["first_kept"]:
    lines.append(f"  closest kept: distance {r['first_kept']['distance']:.4f}")
  lines.append(f"  exclusion list: {epath.Path(out) / EXCLUSIONS_FILE}; pairs: "
               f"{epath.Path(out) / REPORT_FILE}")
  return "\n".join(lines)
