"""`demo_coarse`: the demo's images relabelled one level up the WordNet tree, the demo's
second (downstream) task for transfer experiments (configs/transfer.py).

Each image's label is the ancestor at level COARSE_LEVEL of the class it pictures (its
'member', input_pipeline/sources/demo.py; the class itself when it sits at or above that level),
named by its wnid. Every demo image pictures a leaf, and every leaf is below a level-1
class, so `demo_coarse` has the 12 level-1 classes; `demo_plain_coarse`, whose root-class
images picture the root itself, has those and the 4 roots. A pretraining on `demo` learned the fine classes; this task asks for a
different, coarser partition of the same visual world (background hue and shape, input_
pipeline/demo.py), so frozen features, a linear probe and fine-tuning all have to carry the
transfer. Labels come from what the image shows, exactly, as a curated downstream dataset's
do: an image of the demo tagged with a root class pictures a member with a shape, and is
labelled with that member's level-1 ancestor. Splits: 'train' and 'validation' of the demo
(same images, same truncation setting). `demo_plain_coarse` is the same over `demo_plain`.
"""
import functools

import numpy as np

from bigpretrain.semantic import tree as tree_lib
from input_pipeline import datasets

COARSE_LEVEL = 1  # Levels 0..COARSE_LEVEL are kept as classes.
SPLITS = ("train", "validation")


def coarse_map(wnids: list[str], level: int = COARSE_LEVEL,
               leaves_only: bool = False) -> tuple[np.ndarray, list[str]]:
  """(fine class -> coarse class id [C], coarse wnids): a class's ancestor at `level`, or
  itself when its depth is <= level; coarse classes in fine-class order. With leaves_only
  (images picture leaves only: the demo's members look) the coarse classes are those of the
  leaves, and the other fine classes map to -1."""
  tree = tree_lib.SemanticTree.from_wnids(wnids)
  pictured = np.ones(tree.num_classes, bool)
  if leaves_only:
    pictured[tree.parent[tree.parent >= 0]] = False
  target = np.full(tree.num_classes, -1, np.int64)
  for c in np.flatnonzero(pictured).tolist():
    node = c
    while tree.class_depth[node] > level:
      node = int(tree.parent[node])
    target[c] = node
  kept = sorted(set(target[pictured].tolist()))
  index = {c: i for i, c in enumerate(kept)}
  return np.array([index.get(t, -1) for t in target], np.int64), [wnids[c] for c in kept]


class CoarseSource(datasets.Source):
  """A demo split's records with 'label' = the coarse class of 'member' (the pictured
  class; 'true_label' in records written before the demo had 'member')."""

  def __init__(self, source, mapping: np.ndarray):
    self._source, self._map = source, mapping
    self.split = source.split

  def __len__(self) -> int:
    return len(self._source)

  def _relabel(self, record: dict) -> dict:
    return {**record, "label": int(self._map[record.get("member", record["true_label"])])}

  def __getitem__(self, index: int) -> dict:
    return self._relabel(self._source[index])

  def __getitems__(self, indices) -> list[dict]:
    return [self._relabel(r) for r in self._source.__getitems__(indices)]

  def __repr__(self) -> str:
    return f"CoarseSource({self._source!r})"


class CoarseDemo(datasets.Dataset):
  """The coarse-labelled dataset over a demo dataset."""

  def __init__(self, name: str, fine, leaves_only: bool = True):
    self._fine = fine
    self.mapping, names = coarse_map(fine.info.class_names, leaves_only=leaves_only)
    info = fine.info
    self.info = datasets.DatasetInfo(
        name=name, num_classes=len(names), class_names=names,
        num_examples={s: info.num_examples[s] for s in SPLITS}, image_size=info.image_size,
        splits=SPLITS, features={k: v for k, v in info.features.items() if k != "hashtags"})

  def source(self, split: str) -> CoarseSource:
    self.check_split(split)
    return CoarseSource(self._fine.source(split), self.mapping)


# Coarse dataset name -> the demo it relabels.
FINE = {"demo_coarse": "demo", "demo_plain_coarse": "demo_plain"}


def leaves_only(name: str) -> bool:
  """Whether coarse dataset `name`'s images picture leaves only (coarse_map's leaves_only)."""
  return FINE[name] == "demo"


@functools.cache
def _load(name: str, data_dir: str) -> CoarseDemo:
  return CoarseDemo(name, datasets.get_dataset({"name": FINE[name], "dir": data_dir}),
                    leaves_only=leaves_only(name))


@datasets.SOURCES.register("demo_plain_coarse")
@datasets.SOURCES.register("demo_coarse")
def load(name: str, data_dir: str) -> CoarseDemo:
  return _load(name, data_dir)
