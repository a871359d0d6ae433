"""The semantic tree over a class list: parents, hierarchy levels and per-level targets.

Semantic softmax (Ridnik et al., 2021, section 3.3) trains one softmax per hierarchy level.
This module turns a list of WordNet ids into a forest over those classes only: each class
hangs under its nearest ancestor that is also a class and lies above no other such ancestor.
From that forest it derives the level of every class, the classes of every level, the
per-level targets of a label, and the level balancing weights W_k.

Everything here is plain numpy and deterministic (independent of PYTHONHASHSEED and of nltk's
hypernym order), because every host builds the same tree on its own. A tree is immutable and
hashable, so it can be a static argument or a closure constant of a jitted function.
"""
import functools
import hashlib
import json
import os
import pathlib
import tempfile
from typing import Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from bigpretrain.runtime import cache
from bigpretrain.semantic import wordnet


def _validate_wnids(wnids: Sequence[str]) -> list[str]:
  """Checks the wnids are unique; returns them as a list of str."""
  wnids = list(wnids)
  seen = {}
  for i, w in enumerate(wnids):
    if w in seen:
      raise ValueError(f"Duplicate wnid {w!r} at classes {seen[w]} and {i}.")
    seen[w] = i
  return wnids


def _up(synset) -> list:
  """Hypernyms and instance hypernyms of a synset (in nltk's, hash-dependent, order)."""
  return synset.hypernyms() + synset.instance_hypernyms()


def _sort_key(synset) -> tuple[int, str, int]:
  """Tie-break among equally near candidate parents: most general first, then offset."""
  return (synset.min_depth(), synset.pos(), synset.offset())


@functools.lru_cache(maxsize=None)
def _ancestors(synset) -> frozenset:
  """Every hypernym and instance hypernym above `synset`, transitively."""
  out = set()
  for h in _up(synset):
    out.add(h)
    out |= _ancestors(h)
  return frozenset(out)


def _parent_in_set(synset, index: dict) -> int:
  """Class id of the parent of `synset` among the classes, or -1.

  The candidates are its in-set ancestors that lie above no other in-set ancestor of it, so
  that its chain to the root passes through every in-set ancestor it can (automatic_rifle
  hangs under machine_gun, itself under automatic_firearm, though both are its hypernyms). Of
  those, the nearest (fewest hypernym steps, breadth-first) wins, then _sort_key.
  """
  in_set = [a for a in _ancestors(synset) if a in index]
  lowest = {a for a in in_set if not any(a in _ancestors(b) for b in in_set)}
  seen = {synset}
  frontier = [synset]
  while frontier and lowest:
    layer = set()
    for s in frontier:
      for h in _up(s):
        if h not in seen:
          seen.add(h)
          layer.add(h)
    found = layer & lowest
    if found:
      return index[min(found, key=_sort_key)]
    # Whole layers are expanded before looking, so visiting order cannot change the result.
    frontier = list(layer)
  return -1


def _stored_tree(wnids: tuple[str, ...]) -> pathlib.Path:
  """Where the parents of this class list are kept: keyed by the list and by this module's and
  wordnet.py's code, so that a change to either rebuilds the tree."""
  key = hashlib.sha256("\n".join(wnids).encode())
  for module in (__file__, wordnet.__file__):
    key.update(pathlib.Path(module).read_bytes())
  return cache.root() / "semantic_trees" / f"{key.hexdigest()[:32]}.json"


@functools.lru_cache(maxsize=8)
def _parents_from_wnids(wnids: tuple[str, ...]) -> tuple[int, ...]:
  """Parent class id of every wnid (an error naming a wnid that is not in WordNet 3.0).

  Kept in the bigpretrain cache once built: loading WordNet alone takes seconds, and every
  process of every run over the same classes builds the same tree."""
  path = _stored_tree(wnids)
  if path.exists():
    try:
      parents = json.loads(path.read_text())
      if len(parents) == len(wnids) and all(isinstance(p, int) for p in parents):
        return tuple(parents)
    except (OSError, ValueError) as e:
      logging.warning("Rebuilding the semantic tree kept in %s: %s", path, e)
  synsets = [wordnet.synset_from_wnid(w) for w in wnids]  # ValueError naming a bad wnid.
  index = {s: i for i, s in enumerate(synsets)}
  parents = tuple(_parent_in_set(s, index) for s in synsets)
  try:  # Atomic: processes that build the same tree at once never read a torn file.
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as tmp:
      json.dump(parents, tmp)
    os.replace(tmp.name, path)
  except OSError as e:  # A read-only cache: the tree is built again next time.
    logging.warning("Could not keep the semantic tree in %s: %s", path, e)
  return parents


def _depths(parent: np.ndarray, wnids: list[str] | None) -> np.ndarray:
  """Number of ancestors of each class; ValueError naming a class on a cycle."""
  num = len(parent)
  depth = np.full(num, -1, dtype=np.int64)
  for start in range(num):
    path = []
    on_path = set()
    c = start
    while c != -1 and depth[c] < 0:
      if c in on_path:
        name = f"class {c}" + (f" ({wnids[c]!r})" if wnids else "")
        cycle = path[path.index(c):]
        raise ValueError(f"Cycle in parent array through {name}: classes {cycle}.")
      on_path.add(c)
      path.append(c)
      c = int(parent[c])
    d = -1 if c == -1 else int(depth[c])
    for node in reversed(path):
      d += 1
      depth[node] = d
  return depth


def _frozen(a: np.ndarray) -> np.ndarray:
  a.setflags(write=False)
  return a


# The level-weight cap of the authors' code (semantic softmax / KD); 0 = the paper's uncapped
# equation 2.
MAX_LEVEL_WEIGHT = 20.0


class SemanticTree:
  """An immutable forest over classes 0..C-1 with per-level tables.

  Attributes:
    wnids: class id -> wnid (list of str), or None for trees built from a bare parent array.
    num_classes: C.
    num_levels: L = max class depth + 1.
    parent: np.int32 [C], parent class id, -1 at roots.
    class_depth: np.int32 [C], number of ancestors (the class's level).
    level_classes: list of L sorted np.int32 arrays, the class ids at each level.
    level_sizes: np.int32 [L], number of classes at each level.
    index_in_level: np.int32 [C], position of a class inside its level's array.
    target_table: np.int32 [C, L]; row c holds c at level depth(c), each ancestor of c at
      that ancestor's level, and -1 at the other levels.
  """

  def __init__(self, parent: np.ndarray, wnids: list[str] | None):
    """Use from_wnids or from_parents; this trusts its already-validated arguments."""
    self.wnids = wnids
    self.parent = _frozen(np.asarray(parent, dtype=np.int32).copy())
    self.num_classes = int(self.parent.shape[0])
    depth = _depths(self.parent, wnids)
    self.class_depth = _frozen(depth.astype(np.int32))
    self.num_levels = int(depth.max()) + 1
    self.level_classes = [
        _frozen(np.flatnonzero(depth == k).astype(np.int32)) for k in range(self.num_levels)]
    self.level_sizes = _frozen(
        np.array([len(c) for c in self.level_classes], dtype=np.int32))
    index_in_level = np.zeros(self.num_classes, dtype=np.int32)
    for classes in self.level_classes:
      index_in_level[classes] = np.arange(len(classes), dtype=np.int32)
    self.index_in_level = _frozen(index_in_level)
    table = np.full((self.num_classes, self.num_levels), -1, dtype=np.int32)
    for c in range(self.num_classes):
      a = c
      while a != -1:
        table[c, depth[a]] = a
        a = int(self.parent[a])
    self.target_table = _frozen(table)
    self._key = (self.parent.tobytes(), None if wnids is None else tuple(wnids))

  @classmethod
  def from_wnids(cls, wnids: Sequence[str]) -> "SemanticTree":
    """Tree over WordNet classes; class i is wnids[i].

    Each class's parent is its nearest in-set ancestor that lies above no other in-set
    ancestor of it (so no in-set ancestor is skipped where one chain holds them all):
    hypernym and instance-hypernym links are walked breadth-first, and among such synsets
    reached at the smallest number of links the one with the smallest WordNet min_depth()
    wins, then the smallest offset. Classes with no in-set ancestor are roots.

    Raises:
      ValueError naming the wnid: malformed, not in WordNet 3.0, or duplicated.
    """
    wnids = list(wnids)
    if not wnids:
      raise ValueError("SemanticTree needs at least one class; got an empty wnid list.")
    for w in wnids:
      if not wordnet.is_wnid(w):
        wordnet.synset_from_wnid(w)  # Raises the ValueError naming the malformed wnid.
    _validate_wnids(wnids)
    return cls(np.array(_parents_from_wnids(tuple(wnids)), dtype=np.int32), wnids)

  @classmethod
  def from_parents(cls, parent, wnids: Sequence[str] | None = None) -> "SemanticTree":
    """Tree from an explicit parent array (ints in [-1, C), -1 = root, no cycles)."""
    arr = np.asarray(parent)
    if arr.ndim != 1 or arr.shape[0] == 0:
      raise ValueError(f"parent must be a non-empty 1-D array; got shape {arr.shape}.")
    if not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"parent must hold integers; got dtype {arr.dtype}.")
    arr = arr.astype(np.int64)
    num = arr.shape[0]
    if wnids is not None:
      wnids = _validate_wnids(wnids)
      if len(wnids) != num:
        raise ValueError(f"Got {len(wnids)} wnids for a parent array of {num} classes.")
    bad = np.flatnonzero((arr < -1) | (arr >= num))
    if bad.size:
      c = int(bad[0])
      name = f"class {c}" + (f" ({wnids[c]!r})" if wnids else "")
      raise ValueError(f"parent[{c}] = {int(arr[c])} for {name} is outside [-1, {num}).")
    return cls(arr.astype(np.int32), wnids)

  def semantic_targets(self, labels):
    """Per-level targets of class labels: int32 [..., num_levels], global class ids, -1 = none.

    numpy labels give a numpy array (range-checked); jax arrays (also inside jit) give a jax
    array gathered from the same table.
    """
    if isinstance(labels, jax.Array):
      return jnp.asarray(self.target_table)[labels]
    labels = np.asarray(labels)
    if not np.issubdtype(labels.dtype, np.integer):
      raise ValueError(f"labels must be integers; got dtype {labels.dtype}.")
    bad = labels[(labels < 0) | (labels >= self.num_classes)]
    if bad.size:
      raise ValueError(f"label {int(bad[0])} is outside [0, {self.num_classes}).")
    return self.target_table[labels]

  def level_weights(self, max_weight: float = MAX_LEVEL_WEIGHT) -> np.ndarray:
    """W_k = min(O_0 / O_k, max_weight), O_k = classes at level k or deeper; float32 [L].

    max_weight 0 = no cap: the paper's equation 2, W_k = 1 / O_k, times the constant O_0 (so
    W_0 = 1); the cap of 20 is the authors' released code's."""
    if not max_weight >= 0:
      raise ValueError(f"max_weight={max_weight!r} must be >= 0 (0 = uncapped, equation 2).")
    occurrences = np.cumsum(self.level_sizes[::-1])[::-1].astype(np.float64)
    weights = occurrences[0] / occurrences
    return (weights if max_weight == 0 else np.minimum(weights, max_weight)).astype(np.float32)

  def to_json(self) -> str:
    """Serialises the tree (parents and wnids), e.g. to store next to a prepared dataset."""
    return json.dumps({"parent": self.parent.tolist(), "wnids": self.wnids})

  @classmethod
  def from_json(cls, text: str) -> "SemanticTree":
    """Inverse of to_json."""
    data = json.loads(text)
    missing = {"parent", "wnids"} - set(data)
    if missing:
      raise ValueError(f"Semantic tree JSON lacks keys {sorted(missing)}.")
    return cls.from_parents(data["parent"], data["wnids"])

  def __eq__(self, other):
    return isinstance(other, SemanticTree) and self._key == other._key

  def __hash__(self):
    return hash(self._key)

  def __repr__(self):
    return (f"SemanticTree(num_classes={self.num_classes}, num_levels={self.num_levels}, "
            f"level_sizes={self.level_sizes.tolist()})")


def describe_change(before: SemanticTree, after: SemanticTree, shown: int = 3) -> str:
  """How two trees over the same classes differ, in one line: the level sizes (when they
  differ) and the first `shown` classes whose parent changed; '' when they are the same tree.
  For the messages that say a stored tree and the one built now differ."""
  moved = np.flatnonzero(before.parent != after.parent)
  if not moved.size:
    return ""

  def name(c):
    return before.wnids[c] if before.wnids else f"class {c}"

  def parent(tree, c):
    return "(root)" if tree.parent[c] < 0 else name(int(tree.parent[c]))
  parts = []
  if before.level_sizes.tolist() != after.level_sizes.tolist():
    parts.append(f"level sizes {before.level_sizes.tolist()} -> {after.level_sizes.tolist()}")
  examples = ", ".join(f"{name(c)} under {parent(before, c)} -> {parent(after, c)}"
                       for c in moved[:shown])
  parts.append(f"{moved.size} classes with another parent, e.g. {examples}")
  return "; ".join(parts)
