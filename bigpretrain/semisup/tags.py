"""Balanced-with-tags selection (Yalniz et al., 2019, section 4.4 and supplement section 2):
"randomly selects K images per class using relevant hashtags after mapping them to ImageNet
classes and does not use any ranked lists".

Tag -> class (plain lemma matching through WordNet, until the SWAG vocabulary code replaces
it): a tag maps to class c when, lower-cased and without a leading '#' and '_', it equals one
of the lemma names of c's synset lower-cased with '_' removed ('#GoldenRetriever' ->
'goldenretriever' -> n02099601). A tag that is a lemma of several classes maps to all of them.

"Random" is a seeded hash, not a stream of draws: image `id` gets priority
splitmix64-hash(seed, class, id) for each class its tags map to, and each class keeps its K
highest priorities (ties: smaller id). The draw is thus uniform without replacement, exact, and
independent of the order, grouping and worker count of whatever enumerates the images, so the
Beam job (input_pipeline/jobs/selection_job.py) selects the same images as `select_with_tags`.
"""
from typing import Mapping, Sequence

import numpy as np

from bigpretrain.semisup import topk
from bigpretrain.semantic import wordnet

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
PRIORITY_BITS = 53  # Priorities are ints in [0, 2**53): exact as float64 too.


def normalize(text: str) -> str:
  """'#Golden_Retriever' -> 'goldenretriever': lower case, no leading '#', no '_'."""
  return text.strip().lower().lstrip("#").replace("_", "")


def class_lemmas(class_wnids: Sequence[str]) -> dict[str, tuple[int, ...]]:
  """Normalised lemma name -> the (sorted) classes whose synset has it; classes are indices
  into class_wnids. ValueError naming a class that is not a WordNet 3.0 wnid."""
  lemmas: dict[str, set[int]] = {}
  for c, wnid in enumerate(class_wnids):
    for name in wordnet.synset_from_wnid(wnid).lemma_names():
      lemmas.setdefault(normalize(name), set()).add(c)
  return {name: tuple(sorted(classes)) for name, classes in sorted(lemmas.items())}


def tag_pairs(ids, tags: Sequence[Sequence[str]], lemmas: Mapping[str, Sequence[int]]
              ) -> tuple[np.ndarray, np.ndarray]:
  """(classes int64 [M], ids int64 [M]): one pair per image and class some tag of it maps to
  (each class once per image)."""
  ids = np.asarray(ids, np.int64)
  if len(tags) != ids.shape[0]:
    raise ValueError(f"{ids.shape[0]} ids but {len(tags)} tag lists.")
  out_classes, out_ids = [], []
  for image_id, image_tags in zip(ids.tolist(), tags):
    if isinstance(image_tags, str):
      raise ValueError(f"Tags of image {image_id} must be a list of strings, not the string "
                       f"{image_tags!r}.")
    found = sorted({c for t in image_tags for c in lemmas.get(normalize(t), ())})
    out_classes.extend(found)
    out_ids.extend([image_id] * len(found))
  return np.asarray(out_classes, np.int64), np.asarray(out_ids, np.int64)


def _mix(x: np.ndarray) -> np.ndarray:
  """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
  x = x + _GOLDEN
  x = (x ^ (x >> np.uint64(30))) * _MUL1
  x = (x ^ (x >> np.uint64(27))) * _MUL2
  return x ^ (x >> np.uint64(31))


def random_priority(seed: int, classes, ids) -> np.ndarray:
  """int64 [M] in [0, 2**53): the hash of (seed, class, id), uniform and order-independent."""
  if isinstance(seed, bool) or int(seed) != seed or seed < 0:
    raise ValueError(f"seed={seed!r}; expected an integer >= 0.")
  classes = np.asarray(classes, np.int64).astype(np.uint64)
  ids = np.asarray(ids, np.int64).astype(np.uint64)  # Two's complement for negative ids.
  h = _mix(_mix(_mix(np.full(classes.shape, seed, np.uint64)) ^ classes) ^ ids)
  return (h >> np.uint64(64 - PRIORITY_BITS)).astype(np.int64)


def select_with_tags(ids, tags: Sequence[Sequence[str]], class_wnids: Sequence[str], *, k,
                     seed: int = 0) -> dict[int, list[int]]:
  """For each class (index into class_wnids), K ids drawn at random among the images whose
  tags map to it, in priority order; fewer when fewer images have such a tag.

  ids: int [N] distinct; tags: N lists of strings; k: an int, a {class: K} mapping or [C].
  Keys: every class 0..C-1.
  """
  ids = np.asarray(ids)
  if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
    raise ValueError(f"ids must be integers [N]; got {ids.dtype} {ids.shape}.")
  if np.unique(ids).size != ids.size:
    raise ValueError("ids must be distinct.")
  num_classes = len(class_wnids)
  k = topk.per_class_k(k, num_classes)
  classes, pair_ids = tag_pairs(ids, tags, class_lemmas(class_wnids))
  picked_classes, picked_ids, _ = topk.top_k_pairs(
      classes, pair_ids, random_priority(seed, classes, pair_ids), k)
  out = {c: [] for c in range(num_classes)}
  bounds = topk.group_starts(picked_classes)
  for a, b in zip(bounds[:-1], bounds[1:]):
    out[int(picked_classes[a])] = picked_ids[a:b].tolist()
  return out
