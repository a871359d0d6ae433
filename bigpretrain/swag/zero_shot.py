"""Zero-shot transfer of a hashtag model (SWAG, Singh et al. 2022, section 4.4, appendix D).

- class_map: each class synset -> the canonical hashtag(s) with the largest WordNet path
  similarity to it (many-to-many, ties kept; #crane serves both crane classes).
- aggregate: hashtag scores [N, H] -> class scores [N, C] through that map: 'sum' (RegNetY
  with Platt scaling), 'mean' (RegNetY without), 'max_split' (ViT: 1/n of a hashtag's score to
  each of its n classes, then the max per class).
- platt_fit / platt_apply: the transductive Platt scaler p' = softmax(diag(w) p + b) that
  makes the predicted class distribution on the test set uniform (see platt_fit for how).

`run` evaluates a hashtag model (a soft_target run) on a WordNet-labelled dataset (the
command: bigpretrain/tools/zero_shot.py). It runs the model in eval mode over the split at
the checkpoint's (pre-training) resolution and normalisation, the images' shorter side resized
to that size and the central square kept (EVAL_RESIZE: section 4.4 "the same image resolution
as pre-training", section 4.1's evaluation crop, "a boost of 0.1% to 0.5%" over the usual
87.5% crop), turns the hashtag softmax into class scores through the class map (saved as
DIR/zero_shot/<dataset>-class_map.json), fits Platt scaling on those scores without labels
and prints top-1 with and without it. Without --aggregation the paper's choice (appendix D)
is used: RegNetY 'sum' with Platt and 'mean' without, ViT 'max_split' for both.
"""
from collections.abc import Sequence
import json
import os
import re

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from bigpretrain import checkpoint
from bigpretrain import config_lib
from bigpretrain import inference
from bigpretrain import sharding
from bigpretrain.models import pretrained
from bigpretrain.runtime import console
from bigpretrain.semantic import wordnet
from bigpretrain.swag import vocabulary
from input_pipeline import augment_spec
from input_pipeline import datasets
from input_pipeline import subset

AGGREGATIONS = ("sum", "mean", "max_split")
PLATT_MODES = ("on", "off", "both")
HASHTAG_OBJECTIVES = ("soft_target",)  # Objectives whose classes are canonical hashtags.
REAL_LABEL = "real_label"  # ReaL's label lists (tfds imagenet2012_real), as evaluators read them.
EVAL_RESIZE = "shorter_center_crop"  # Section 4.1: shorter side to the size, centre crop.


def _ancestor_distances(synset) -> dict[str, int]:
  """Synset name -> fewest hypernym (or instance-hypernym) edges up from `synset`, itself
  included at 0: the distances nltk's path_similarity takes its minimum over."""
  dist = {}
  frontier = [synset]
  depth = 0
  while frontier:
    nxt = []
    for s in frontier:
      if s.name() not in dist:
        dist[s.name()] = depth
        nxt.extend(s.hypernyms() + s.instance_hypernyms())
    frontier = nxt
    depth += 1
  return dist


def class_map(class_wnids: Sequence[str],
              vocabulary_labels: Sequence[str]) -> list[tuple[int, ...]]:
  """For each class, the indices (ascending) of the canonical hashtags of maximum path
  similarity to its synset (appendix D).

  The similarity of a hashtag to a class is the largest nltk path_similarity,
  1 / (1 + shortest hypernym path), between any of its synsets and the class synset; every
  hashtag reaching the maximum is kept. Computed with one ancestor table per synset instead
  of C x (vocabulary synsets) nltk calls.

  Args:
    class_wnids: C distinct noun wnids ('n02012849'), the target dataset's classes.
    vocabulary_labels: H distinct canonical hashtags ('crane.n.04+crane.n.05+grus.n.01').
  """
  # nltk takes about a second to import: not in every trainer process that imports this module.
  from nltk.corpus.reader.wordnet import WordNetError  # pylint: disable=import-outside-toplevel
  wn = wordnet.load()
  if len(set(class_wnids)) != len(class_wnids) or not class_wnids:
    raise ValueError("class_wnids must be a non-empty list of distinct wnids")
  if len(set(vocabulary_labels)) != len(vocabulary_labels) or not vocabulary_labels:
    raise ValueError("vocabulary_labels must be a non-empty list of distinct canonical hashtags")
  classes = []
  for wnid in class_wnids:
    synset = wordnet.synset_from_wnid(wnid)  # ValueError naming a malformed/unknown wnid.
    if synset.pos() != "n":
      raise ValueError(f"class {wnid} ({synset.name()}) is not a noun synset; hashtags are "
                       "nouns, so the class map needs noun classes")
    classes.append(synset)
  # Vocabulary synsets, numbered in sorted order; each label is a run of their ids.
  label_names = [vocabulary.label_synsets(label) for label in vocabulary_labels]
  names = sorted({name for names in label_names for name in names})
  synset_id = {name: i for i, name in enumerate(names)}
  flat = np.array([synset_id[n] for names_ in label_names for n in names_], np.int64)
  starts = np.cumsum([0] + [len(n) for n in label_names[:-1]])
  # Ancestor -> (vocabulary synset ids below it, their distances to it).
  below: dict[str, tuple[list[int], list[int]]] = {}
  for name in names:
    try:
      synset = wn.synset(name)
    except (WordNetError, ValueError) as e:  # nltk's errors for unknown or malformed names.
      labels = [l for l, n in zip(vocabulary_labels, label_names) if name in n]
      raise ValueError(f"hashtag label {labels[0]!r}: {name!r} is not a WordNet 3.0 synset "
                       f"({e})") from None
    for ancestor, d in _ancestor_distances(synset).items():
      ids, ds = below.setdefault(ancestor, ([], []))
      ids.append(synset_id[name])
      ds.append(d)
  below_arrays = {a: (np.array(i), np.array(d)) for a, (i, d) in below.items()}
  out = []
  for synset in classes:
    dist = np.full(len(names), np.inf)  # Shortest path from this class to each synset.
    for ancestor, d in _ancestor_distances(synset).items():
      if ancestor in below_arrays:
        ids, ds = below_arrays[ancestor]
        dist[ids] = np.minimum(dist[ids], d + ds)
    label_dist = np.minimum.reduceat(dist[flat], starts)
    out.append(tuple(np.flatnonzero(label_dist == label_dist.min()).tolist()))
  return out


def aggregate(hashtag_scores, mapping: Sequence[Sequence[int]], method: str):
  """Class scores [N, C] from hashtag scores [N, H] and a class map (class -> hashtag ids).

  'sum': the sum of the class's hashtag scores; 'mean': their mean; 'max_split': the max over
  the class's hashtags of score / (number of classes that hashtag maps to).
  """
  if method not in AGGREGATIONS:
    raise ValueError(f"unknown aggregation {method!r}; expected one of {AGGREGATIONS}")
  scores = jnp.asarray(hashtag_scores)
  if scores.ndim != 2:
    raise ValueError(f"hashtag_scores must be [N, H], got shape {scores.shape}")
  num_hashtags = scores.shape[1]
  lists = [np.asarray(m, np.int64).reshape(-1) for m in mapping]
  if not lists or any(not m.size for m in lists):
    raise ValueError("every class needs at least one hashtag in the class map")
  allids = np.concatenate(lists)
  if allids.min() < 0 or allids.max() >= num_hashtags:
    raise ValueError(f"class map hashtag ids must be in [0, {num_hashtags}), got "
                     f"{allids.min()}..{allids.max()}")
  width = max(m.size for m in lists)
  idx = np.zeros((len(lists), width), np.int64)  # [C, K], padded with hashtag 0 ...
  valid = np.zeros((len(lists), width), bool)  # ... masked out here.
  for c, m in enumerate(lists):
    idx[c, :m.size], valid[c, :m.size] = m, True
  gathered = scores[:, idx]  # [N, C, K]
  if method == "max_split":
    num_classes = np.bincount(allids, minlength=num_hashtags)  # Classes per hashtag.
    split = gathered / num_classes[idx]
    return jnp.where(valid, split, -jnp.inf).max(axis=-1)
  total = jnp.where(valid, gathered, 0).sum(axis=-1)
  return total if method == "sum" else total / valid.sum(axis=-1)


def _check_probs(probs) -> np.ndarray:
  p = np.asarray(probs, np.float64)
  if p.ndim != 2 or p.shape[0] < 1 or p.shape[1] < 2:
    raise ValueError(f"probs must be [N, C] with N >= 1 and C >= 2, got shape {p.shape}")
  if not (np.isfinite(p).all() and (p >= 0).all()):
    raise ValueError("probs must be finite and >= 0")
  if not (p.sum(axis=1) > 0).all():
    raise ValueError(f"probs rows must have positive mass; row {np.argmin(p.sum(axis=1))} "
                     "is all zeros")
  return p


def _uniform_prior_targets(p: np.ndarray, tol: float, max_iter: int) -> np.ndarray:
  """q_nc proportional to p_nc v_c with mean_n q_n uniform: Sinkhorn scaling in log space."""
  mass = p.sum(axis=0)
  if not (mass > 0).all():
    raise ValueError(f"class {np.argmin(mass)} has zero probability on every example; no "
                     "prior correction can make the predictions uniform")
  num_classes = p.shape[1]
  logp = np.log(np.maximum(p / p.sum(axis=1, keepdims=True), np.finfo(np.float64).tiny))
  log_v = np.zeros(num_classes)
  for _ in range(max_iter):
    z = logp + log_v
    logq = z - np.logaddexp.reduce(z, axis=1, keepdims=True)
    marginal = np.exp(logq).mean(axis=0) * num_classes  # 1 everywhere when uniform.
    if np.abs(marginal - 1).max() < tol:
      break
    log_v -= np.log(marginal)
  else:
    logging.warning("Platt targets: prior correction not converged after %d iterations "
                    "(max |C * mean q - 1| = %.2g)", max_iter, np.abs(marginal - 1).max())
  return np.exp(logq)


def platt_fit(probs, *, tol: float = 1e-5, max_iter: int = 1000) -> tuple[np.ndarray,
                                                                          np.ndarray]:
  """Fits the transductive Platt scaler p' = softmax(diag(w) p + b) on test predictions
  [N, C], without labels, so that the mean p' is uniform (section 4.4). Returns (w, b) [C].

  The paper minimises the cross-entropy between the mean p' and the uniform distribution,
  which is degenerate: w = 0 makes every p' uniform and wins while discarding the image.
  Well-posed version, two convex problems:
  1. targets q_n: the predictions with their class prior replaced so that mean_n q_n is
     uniform, q_nc proportional to p_nc v_c (the label-free prior correction of Saerens et
     al. 2002 with the new prior known; Sinkhorn scaling finds v, unique up to scale);
  2. (w, b) = argmin mean_n CE(q_n, softmax(diag(w) p_n + b)), Platt's own fit with q as the
     targets (L-BFGS from w = 1, b = 0). Its gradient in b is mean_n (p'_n - q_n), so at the
     minimum the mean p' is exactly uniform, the paper's objective at its optimum, while each
     p'_n stays as close to q_n as the scaler allows (w = 0 scores log C per image instead).
  b is returned with zero mean (softmax ignores a constant shift).

  Step 2 is solved in standardised coordinates, z_c = u_c (p_c - mean_c) / std_c + beta_c (the
  same scalers): in raw (w, b) the Hessian's condition number reaches ~1e8 when a class's
  scores vary little around their mean (as an untrained model's do), and L-BFGS then stops on
  a stalled loss far from the minimum, at a point that float32 rounding of the scores moves.
  It stops on the gradient only (tol / C), so the result is the minimum, not the path to it.

  Args:
    probs: [N, C] non-negative class scores of the test set (rows need not sum to 1, e.g.
      'sum'-aggregated hashtag probabilities).
    tol: stop when every class's mean target is within a factor 1 +- tol of 1 / C (step 1);
      L-BFGS's gradient tolerance is tol / C (step 2).
    max_iter: iteration cap of each step.
  """
  if max_iter < 1 or not tol > 0:
    raise ValueError(f"platt_fit needs max_iter >= 1 and tol > 0, got {max_iter}, {tol}")
  p = _check_probs(probs)
  q = _uniform_prior_targets(p, tol, max_iter)
  n, c = p.shape

  mean = p.mean(axis=0)
  std = p.std(axis=0)
  std = np.where(std > 0, std, 1.0)  # A constant class's scale is absorbed by its bias.
  s = (p - mean) / std

  def loss_and_grad(x):
    u, beta = x[:c], x[c:]
    z = s * u + beta
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    total = e.sum(axis=1, keepdims=True)
    loss = np.mean(np.log(total[:, 0]) - (q * z).sum(axis=1))
    d = (e / total - q) / n  # d loss / d z.
    return loss, np.concatenate([(d * s).sum(axis=0), d.sum(axis=0)])

  x0 = np.concatenate([std, mean])  # w = 1, b = 0.
  # Imported here: scipy is a large share of every trainer process's start-up (they import
  # this module through the hashtag zero-shot evaluator), and most never fit Platt.
  import scipy.optimize  # pylint: disable=import-outside-toplevel
  result = scipy.optimize.minimize(loss_and_grad, x0, jac=True, method="L-BFGS-B",
                                   options={"maxiter": max_iter, "gtol": tol / c, "ftol": 0.0})
  if not result.success:
    logging.warning("platt_fit: L-BFGS stopped early (%s)", result.message)
  u, beta = result.x[:c], result.x[c:]
  w, b = u / std, beta - u * mean / std
  if not (np.isfinite(w).all() and np.isfinite(b).all()):
    raise FloatingPointError(f"platt_fit diverged: {result.message}")
  return w, b - b.mean()


def platt_apply(probs, w, b) -> np.ndarray:
  """p' = softmax(diag(w) p + b) for probs [N, C]; w, b [C] from platt_fit."""
  p = np.asarray(probs)
  if p.ndim != 2:
    raise ValueError(f"probs must be [N, C], got shape {p.shape}")
  w, b = np.asarray(w), np.asarray(b)
  if w.shape != (p.shape[1],) or b.shape != (p.shape[1],):
    raise ValueError(f"w and b must be [{p.shape[1]}], got {w.shape} and {b.shape}")
  z = p * w + b
  z = z - z.max(axis=1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(axis=1, keepdims=True)


def top1(scores, labels) -> float:
  """Top-1 accuracy of class scores [N, C] against int labels [N]."""
  scores, labels = np.asarray(scores), np.asarray(labels)
  if scores.ndim != 2 or labels.shape != scores.shape[:1]:
    raise ValueError(f"scores [N, C] and labels [N] needed, got {scores.shape} and "
                     f"{labels.shape}")
  bad = (labels < 0) | (labels >= scores.shape[1])
  if bad.any():
    raise ValueError(f"{int(bad.sum())} of {len(labels)} images have no label of the "
                     f"{scores.shape[1]} classes (e.g. {int(labels[bad][0])}: a test split "
                     "whose labels are withheld?); zero-shot top-1 needs a labelled split.")
  return float(np.mean(scores.argmax(axis=1) == labels))


def real_top1(scores, real_labels) -> tuple[float, int]:
  """ReaL top-1 (Beyer et al. 2020) of class scores [N, C] against each image's real labels
  [N, K] (-1 padded): (the share whose top class is one of them, over the images that have
  any; that count)."""
  real = np.asarray(real_labels)
  pred = np.asarray(scores).argmax(axis=1)
  valid = (real >= 0).any(axis=1)
  hit = (real == pred[:, None]).any(axis=1) & valid
  return float(hit.sum() / max(valid.sum(), 1)), int(valid.sum())


# ---------------------------------------------------------------- the command


def paper_aggregation(model_name: str, platt: bool) -> str:
  """Appendix D's aggregation: ViT 'max_split'; RegNetY (any other model) 'sum' with Platt
  scaling and 'mean' without."""
  if model_name.startswith("vit"):
    return "max_split"
  return "sum" if platt else "mean"


def check_hashtag_model(meta: dict, workdir: str) -> list[str]:
  """The canonical hashtags of a checkpoint's classes; ValueError if it is no hashtag model."""
  objective = (meta.get("objective") or {}).get("name")
  names = list(meta.get("class_names") or ())
  if objective not in HASHTAG_OBJECTIVES or not names:
    raise ValueError(f"{workdir} is not a hashtag model: trained with objective {objective!r} "
                     f"on {meta.get('dataset')!r}; zero-shot transfer needs a soft_target run "
                     "on a hashtag dataset (hashtags:NAME), whose classes are canonical "
                     "hashtags.")
  bad = [n for n in names if not all(re.fullmatch(r".+\.n\.\d\d", x)
                                     for x in vocabulary.label_synsets(n))]
  if bad:
    raise ValueError(f"{workdir} is not a hashtag model: class {bad[0]!r} is not a canonical "
                     "hashtag ('+'-joined noun synset names such as 'dog.n.01').")
  return names


def check_wordnet_classes(class_names: Sequence[str], dataset: str) -> list[str]:
  """The dataset's classes as wnids; ValueError if they are not WordNet noun synsets."""
  bad = [c for c in class_names if not wordnet.is_wnid(c)]
  if not class_names or bad:
    raise ValueError(f"dataset {dataset!r} has classes that are not WordNet synsets (e.g. "
                     f"{(bad or [None])[0]!r}); zero-shot transfer maps hashtags to classes "
                     "through WordNet, so the classes must be wnids such as 'n02084071'.")
  for wnid in class_names:
    wordnet.synset_from_wnid(wnid)  # ValueError naming a wnid missing from WordNet 3.0.
  return list(class_names)


def save_class_map(path: str, class_wnids: Sequence[str], hashtags: Sequence[str],
                   mapping: Sequence[Sequence[int]]) -> str | None:
  """{wnid: [canonical hashtags]} as JSON (written whole, then renamed); returns `path`, or
  None with a warning where it cannot be written (a read-only run folder): the scores do not
  depend on it."""
  out = {w: [hashtags[i] for i in ids] for w, ids in zip(class_wnids, mapping)}
  tmp = f"{path}.tmp{os.getpid()}"
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(tmp, "w") as f:
      json.dump(out, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
  except OSError as e:
    console.warn(f"The class map cannot be written to {path} ({e}); zero-shot goes on "
                 "without it.")
    return None
  return path


def scores_step(model_def, shardings, mesh, normalize: str, mapping, methods):
  """Jitted (params, extra, batch) -> replicated {method: class scores [B, C], 'label',
  'mask'} (and the batch's REAL_LABEL lists when it has them): the hashtag softmax, aggregated
  on device (the [N, H] hashtag scores, H ~27k in the paper, never leave it)."""

  def scores(module, batch):
    logits = module(batch["image"], train=False).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    out = {m: aggregate(probs, mapping, m) for m in methods}
    out.update({k: batch[k] for k in ("label", "mask", REAL_LABEL) if k in batch})
    return out

  return inference.make_step(model_def, shardings, mesh, normalize, scores)


def aggregations(model_name: str, aggregation: str, platt: str) -> dict[bool, str]:
  """{with Platt scaling: aggregation} for the --platt mode ('' = the paper's per model)."""
  if platt not in PLATT_MODES:
    raise ValueError(f"platt={platt!r} must be one of {PLATT_MODES}")
  if aggregation and aggregation not in AGGREGATIONS:
    raise ValueError(f"aggregation={aggregation!r} must be one of {AGGREGATIONS}")
  modes = {"on": (True,), "off": (False,), "both": (True, False)}[platt]
  return {p: aggregation or paper_aggregation(model_name, p) for p in modes}


def top1_from_rows(rows: dict, chosen: dict[bool, str]) -> dict:
  """{'top1_platt', 'top1_no_platt'} (None when not asked for) from the scores of every
  image of the split (Platt scaling is fitted on them, without labels)."""
  if not len(rows["label"]):
    raise ValueError("the split yielded no readable images")
  result = {"top1_platt": None, "top1_no_platt": None}
  real = rows.get(REAL_LABEL)

  def score(key: str, scores) -> None:
    result[key] = top1(scores, rows["label"])
    if real is not None:  # ReaL-IN, Table 3's other ImageNet column.
      result[f"real_{key}"], result["num_real_examples"] = real_top1(scores, real)

  if False in chosen:
    score("top1_no_platt", rows[chosen[False]])
  if True in chosen:
    scores = rows[chosen[True]]
    if len(scores) < scores.shape[1]:
      logging.warning("Platt scaling fitted on %d images for %d classes: it pulls each image's "
                      "prediction towards uniform, so top-1 with it says little; use a larger "
                      "split.", len(scores), scores.shape[1])
    w, b = platt_fit(scores)  # Transductive: the test scores, no labels.
    score("top1_platt", platt_apply(scores, w, b))
  return result


def collect_scores(step, variables: dict, source, data_cfg, *, batch_size: int, mesh,
                   num_real: int = 0) -> dict:
  """scores_step's rows over a whole split, concatenated (the same on every process); with
  `num_real` > 0 (the class count) also each image's REAL_LABEL list."""
  fields = {"label": 0, **({REAL_LABEL: num_real} if num_real else {})}
  parts = [rows for rows, _ in inference.forward_rows(
      step, variables, source, data_cfg, batch_size=batch_size, mesh=mesh, fields=fields)]
  return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def eval_data_config(meta_data: dict, num_workers: int = 0,
                     eval_resize: str = EVAL_RESIZE) -> dict:
  """The data config zero-shot reads images with: the checkpoint's `meta_data` (image size,
  normalisation) with the paper's evaluation crop, whatever crop the pre-training evaluated
  with."""
  return {**meta_data, "eval_resize": eval_resize, "num_workers": num_workers}


def run(workdir: str, dataset: str, *, data_dir: str = "", split: str = "validation",
        aggregation: str = "", platt: str = "both", batch_size: int = 256,
        num_workers: int = 0, eval_resize: str = EVAL_RESIZE) -> dict:
  """Zero-shot top-1 of `workdir`'s hashtag model on `dataset`:`split`; see the module doc.

  Returns {'top1_platt', 'top1_no_platt' (None when not computed; with ReaL labels also
  'real_top1_platt' / 'real_top1_no_platt' and 'num_real_examples'), 'aggregation_platt',
  'aggregation_no_platt', 'num_examples', 'num_classes', 'num_hashtags', 'class_map'}.
  """
  augment_spec.eval_resize_op(eval_resize, "--eval_resize")  # Before any work.
  meta = checkpoint.read_meta(workdir)
  chosen = aggregations(meta["model"]["name"], aggregation, platt)
  hashtags = check_hashtag_model(meta, workdir)
  data = datasets.get_dataset({"name": dataset, "dir": data_dir})
  info = data.info
  if subset.split_name(split) not in info.splits:  # 'validation[:1000]': a range of it.
    raise ValueError(f"dataset {dataset!r} has no split {split!r}; its splits: "
                     f"{list(info.splits)}")
  wnids = check_wordnet_classes(info.class_names, dataset)
  mapping = class_map(wnids, hashtags)
  safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", dataset)
  map_path = os.path.join(workdir, "zero_shot", f"{safe}-class_map.json")
  if jax.process_index() == 0:
    map_path = save_class_map(map_path, wnids, hashtags, mapping)

  mesh = sharding.inference_mesh(1, batch_size)
  loaded = pretrained.load(workdir, mesh=mesh, rules=config_lib.base_config().sharding_rules)
  step = scores_step(loaded.model_def, loaded.shardings, mesh, meta["data"]["normalize"],
                     mapping, sorted(set(chosen.values())))
  rows = collect_scores(step, loaded.variables, subset.split_source(data, split),
                        eval_data_config(meta["data"], num_workers, eval_resize),
                        batch_size=batch_size, mesh=mesh,
                        num_real=info.num_classes if REAL_LABEL in info.features else 0)
  return {**top1_from_rows(rows, chosen),
          "aggregation_platt": chosen.get(True), "aggregation_no_platt": chosen.get(False),
          "num_examples": int(len(rows["label"])), "num_classes": len(wnids),
          "num_hashtags": len(hashtags), "class_map": map_path}
