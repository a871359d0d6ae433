"""The embedded `demo` dataset: synthetic 32x32 images that follow a real WordNet hierarchy.

100 ImageNet-21K-P classes (input_pipeline/demo_wnids.txt, made by `select_wnids`) form a
5-level forest under bigpretrain.semantic.tree.SemanticTree. A class's look is a function
of its ancestor chain, so sibling classes share the coarse look and differ in a finer one:

  level 0 ancestor -> background hue         level 3 ancestor -> texture inside the shape
  level 1 ancestor -> shape                   level 4 (itself) -> orientation of a bar
  level 2 ancestor -> shape colour

A class at depth d has the defaults beyond level d (no shape, white, plain, no bar); every
image adds position/scale/colour jitter and pixel noise.

What an image pictures (the `members` look, the default). ImageNet-21K tags each image with
one WordNet class that need not be the most specific one: a picture of a cow may be tagged
'animal', another 'cow' (Ridnik et al. 2021, section 2.2 and Figure 2), so an inner class's
images picture members of the class and the same look carries labels of different depths.
The demo follows that: an example of a leaf class pictures the leaf's look; an example of an
inner class pictures a LEAF OF ITS SUBTREE, drawn uniformly (the classes are balanced, so an
image tagged c shows each most specific member of c equally often), rendered exactly as that
leaf's own examples are, and keeps the inner class as its label. The leaf is drawn from the
example's seed (seed, split, index) on a stream of its own, so leaf examples are the same
images under both looks. The `plain` look (`demo_plain`, the demo before this rule) draws an
inner class's images with its own look, plain beyond its depth, and is kept so that results
measured on it stay reproducible.

Like ImageNet-21K's inconsistent tagging, a share of TRAIN labels (default 20%) is replaced by
a random ancestor of the example's class, on top of the rule above; validation labels are the
example's class; `unlabeled` keeps it but recipes ignore it. Each example also carries noun
hashtags (lemmas of its class and the class's ancestors, written the way Instagram tags are:
lower case, no separators) plus noise tags, for SWAG-style training.

Features: 'image' (PNG), 'label' (ClassLabel over the wnids), 'hashtags' (list of str),
'true_label' (the example's class before truncation) and 'member' (the class whose look the
image shows: a leaf under `members`, 'true_label' itself under `plain`), for analysis.

Generation happens on first use into `<cache>/tensorflow_datasets` (<cache>: see
bigpretrain/runtime/cache.py) or a given data dir, under a file lock
so that concurrent processes generate it once. Change the truncation share with the config
name: `--config.data.name=demo/trunc35` (35%), `demo/trunc0` (exact labels); plain `demo` is
`demo/trunc20`; `demo_plain[/truncNN]` is the plain look. In code:
`prepare(data_dir, truncation=0.35, look="plain")`.

The looks survive a horizontal flip (symmetric shapes, bars at 0 or 90 degrees), so flip
augmentation never turns one class into another.
"""
import colorsys
import contextlib
import dataclasses
import fcntl
import io
import os
import pathlib
import re

from absl import logging
from etils import epath
import numpy as np
from PIL import Image
from PIL import ImageDraw
import tensorflow_datasets as tfds

from bigpretrain.semantic import tree as tree_lib
from bigpretrain.semantic import wordnet
from input_pipeline import datasets

WNIDS_PATH = pathlib.Path(__file__).with_name("demo_wnids.txt")
IMAGE_SIZE = 32
DEFAULT_TRUNCATION = 0.2
# Examples per class, and the split's id in every example's seed.
SPLIT_SIZES = {"train": 200, "validation": 25, "unlabeled": 50}
SPLIT_IDS = {"train": 0, "validation": 1, "unlabeled": 2}
# select_wnids: classes wanted at each level (sum 100).
LEVEL_COUNTS = (4, 12, 24, 30, 30)
# What an inner class's images picture (module docstring): a leaf of its subtree, or the
# class's own plain look (the demo before the `members` rule).
LOOKS = ("members", "plain")
DEFAULT_LOOK = "members"
_MEMBER_STREAM = 1  # The member draw's own rng stream: [seed, split, index, _MEMBER_STREAM].

# What each level's attribute value (the ancestor's rank among its siblings) draws.
_SHAPES = ("circle", "square", "triangle", "cross", "diamond", "ring")
# Index 0 is the default for classes above level 2.
_COLOURS = ((245, 245, 245), (25, 25, 25), (225, 35, 35), (35, 70, 225), (245, 215, 30),
            (30, 165, 60), (190, 40, 200))
_TEXTURES = ("plain", "stripes", "checker", "dots", "grid")
# Bar angles in degrees; only ones a horizontal flip (the usual augmentation) keeps.
_ORIENTATIONS = (None, 0.0, 90.0)
_MAX_ROOTS = 8  # Background hues stay distinguishable up to this many.
# Most siblings per parent at levels 1..4, bounded by the number of distinct looks.
MAX_CHILDREN = (len(_SHAPES), len(_COLOURS) - 1, len(_TEXTURES) - 1, len(_ORIENTATIONS) - 1)
NUM_LEVELS = len(LEVEL_COUNTS)

# Generic tags that name no demo class (Instagram's usual noise).
_NOISE_TAGS = ("love", "instagood", "photooftheday", "nofilter", "picoftheday", "happy",
               "weekend", "summer", "tbt", "friends", "beautiful", "fun")


# config.data.name of the demo in each look (input_pipeline/datasets.py); '/truncNN' may follow.
DATASET_NAMES = {"members": "demo", "plain": "demo_plain"}


def is_demo_name(name: str) -> bool:
  """Whether config.data.name names the demo itself (any look, any truncation)."""
  return any(name == n or name.startswith(n + "/") for n in DATASET_NAMES.values())


# ------------------------------------------------------------------------------------------
# Class selection (run once by a developer; the result ships as demo_wnids.txt).


def _subtree_stats(children: list[list[int]], node: int, memo: dict) -> tuple[int, int]:
  """(height, size) of the subtree under `node` in the full tree."""
  if node not in memo:
    stats = [_subtree_stats(children, k, memo) for k in children[node]]
    memo[node] = (1 + max((h for h, _ in stats), default=-1), 1 + sum(s for _, s in stats))
  return memo[node]


def select_wnids(all_wnids: list[str] | None = None, level_counts=LEVEL_COUNTS) -> list[str]:
  """Picks demo classes from the ImageNet-21K-P list; sorted wnids.

  The result is closed under the full list's tree (every chosen class's parent is chosen),
  so SemanticTree.from_wnids(result) has the same parents as the full tree restricted to it.
  Level k gets level_counts[k] classes; roots and children are preferred when their subtree
  reaches the last level, then by subtree size, then by wnid. Children are handed out two per
  parent in that order (so that most classes have siblings that differ only in the finer
  attribute), then one more per parent per round, at most MAX_CHILDREN[k - 1] per parent.
  Deterministic: only sorted numpy/int data is involved.
  """
  if all_wnids is None:
    path = pathlib.Path(wordnet.__file__).parent / "data" / "imagenet21k_p_wnids.txt"
    all_wnids = [w for w in path.read_text().split() if w]
  if len(level_counts) > NUM_LEVELS:
    raise ValueError(f"At most {NUM_LEVELS} levels have a look; got {level_counts}.")
  full = tree_lib.SemanticTree.from_wnids(all_wnids)
  children = [[] for _ in all_wnids]
  for c, p in enumerate(full.parent.tolist()):
    if p >= 0:
      children[p].append(c)
  memo = {}
  last = len(level_counts) - 1

  def preference(c: int, level: int):
    height, size = _subtree_stats(children, c, memo)
    return (-min(height, last - level), -size, all_wnids[c])

  roots = sorted(full.level_classes[0].tolist(), key=lambda c: preference(c, 0))
  if level_counts[0] > _MAX_ROOTS:
    raise ValueError(f"At most {_MAX_ROOTS} roots (background hues); got {level_counts[0]}.")
  chosen = [roots[:level_counts[0]]]
  for level in range(1, len(level_counts)):
    cap = MAX_CHILDREN[level - 1]
    parents = sorted(chosen[-1], key=lambda c: preference(c, level - 1))
    pools = {p: sorted(children[p], key=lambda c, lv=level: preference(c, lv)) for p in parents}
    taken = {p: 0 for p in parents}
    picked = []
    rounds = [2] + [1] * cap  # Two per parent first, then one more per round.
    for per_round in rounds:
      for p in parents:
        for _ in range(per_round):
          if len(picked) == level_counts[level] or taken[p] >= min(cap, len(pools[p])):
            break
          picked.append(pools[p][taken[p]])
          taken[p] += 1
    if len(picked) < level_counts[level]:
      raise ValueError(f"Only {len(picked)} classes available at level {level}; "
                       f"wanted {level_counts[level]}.")
    chosen.append(picked)
  return sorted(all_wnids[c] for level in chosen for c in level)


def write_wnids_file(path: str | os.PathLike = WNIDS_PATH) -> list[str]:
  """Regenerates demo_wnids.txt with select_wnids() (takes ~10 s: builds the 11k tree)."""
  wnids = select_wnids()
  pathlib.Path(path).write_text("\n".join(wnids) + "\n")
  return wnids


def load_wnids() -> list[str]:
  """The shipped demo class list (sorted wnids)."""
  return [w for w in WNIDS_PATH.read_text().split() if w]


# ------------------------------------------------------------------------------------------
# Per-class look and hashtags.


def class_attributes(parent: np.ndarray) -> np.ndarray:
  """int32 [C, NUM_LEVELS]: column k = rank of the class's level-k ancestor among its
  siblings (children of the same parent, or all roots, in class-id order); -1 below depth."""
  parent = np.asarray(parent)
  num = len(parent)
  rank = np.zeros(num, dtype=np.int32)
  for p in np.unique(parent):
    siblings = np.flatnonzero(parent == p)
    rank[siblings] = np.arange(len(siblings))
  attrs = np.full((num, NUM_LEVELS), -1, dtype=np.int32)
  for c in range(num):
    chain = []
    a = c
    while a != -1:
      chain.append(a)
      a = int(parent[a])
    if len(chain) > NUM_LEVELS:
      raise ValueError(f"Class {c} is at level {len(chain) - 1}; the demo draws at most "
                       f"{NUM_LEVELS} levels.")
    for level, ancestor in enumerate(reversed(chain)):
      attrs[c, level] = rank[ancestor]
  return attrs


def _check_attributes(attrs: np.ndarray, num_roots: int) -> None:
  """ValueError when a level has more siblings than it has distinct looks."""
  if num_roots > _MAX_ROOTS:
    raise ValueError(f"{num_roots} root classes but only {_MAX_ROOTS} background hues.")
  for level, cap in enumerate(MAX_CHILDREN, start=1):
    if attrs[:, level].max() >= cap:
      raise ValueError(f"A level-{level - 1} class has more than {cap} children; the demo "
                       f"has only {cap} distinct looks at level {level}.")


def hashtag(lemma_name: str) -> str | None:
  """WordNet lemma -> Instagram-style tag ('golden_retriever' -> 'goldenretriever').

  None for lemmas of more than two words or with non-letters: a tag is split back into
  lemmas at no more than one place (SWAG's canonicalisation).
  """
  words = re.split(r"[_\-]", lemma_name.lower())
  if len(words) > 2 or not all(w.isalpha() for w in words):
    return None
  tag = "".join(words)
  return tag if len(tag) >= 3 else None


def lemma_tags(wnid: str) -> list[str]:
  """Tags for one class from its synset's lemmas (WordNet order, duplicates dropped)."""
  synset = wordnet.synset_from_wnid(wnid)
  tags = []
  for lemma in synset.lemmas():
    tag = hashtag(lemma.name())
    if tag and tag not in tags:
      tags.append(tag)
  if not tags:  # Only long lemmas: fall back to the first one, squashed.
    tags.append("".join(ch for ch in synset.lemmas()[0].name().lower() if ch.isalpha()))
  return tags


# ------------------------------------------------------------------------------------------
# Rendering.


_SHAPE, _BAR = 1, 2  # Values in the drawing canvas.


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float):
  """Draws a shape with centre (cx, cy) and half-width r, value _SHAPE, on an 'L' canvas."""
  box = (cx - r, cy - r, cx + r, cy + r)
  if shape == "circle":
    draw.ellipse(box, fill=_SHAPE)
  elif shape == "square":
    s = 0.85 * r
    draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=_SHAPE)
  elif shape == "triangle":
    draw.polygon([(cx, cy - r), (cx + r, cy + 0.8 * r), (cx - r, cy + 0.8 * r)], fill=_SHAPE)
  elif shape == "cross":
    w = 0.38 * r
    draw.rectangle((cx - r, cy - w, cx + r, cy + w), fill=_SHAPE)
    draw.rectangle((cx - w, cy - r, cx + w, cy + r), fill=_SHAPE)
  elif shape == "diamond":
    draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=_SHAPE)
  elif shape == "ring":
    draw.ellipse(box, fill=_SHAPE)
    h = 0.5 * r
    draw.ellipse((cx - h, cy - h, cx + h, cy + h), fill=0)
  else:
    raise ValueError(f"Unknown shape {shape!r}; known: {_SHAPES}.")


def _texture(texture: str, size: int, rng: np.random.Generator) -> np.ndarray:
  """bool [size, size]: where the texture paints its contrasting colour (random phase)."""
  period = size // 8  # 4 output pixels.
  x = np.arange(size)[None, :] + rng.integers(period * 2)
  y = np.arange(size)[:, None] + rng.integers(period * 2)
  if texture == "plain":
    return np.zeros((size, size), dtype=bool)
  if texture == "stripes":
    return np.broadcast_to((y % period) < period // 2, (size, size))
  if texture == "checker":
    return ((x // period) + (y // period)) % 2 == 1
  p = period + period // 4
  if texture == "dots":
    return ((x % p) < p // 2) & ((y % p) < p // 2)
  if texture == "grid":
    return ((x % p) < p // 4) | ((y % p) < p // 4)
  raise ValueError(f"Unknown texture {texture!r}; known: {_TEXTURES}.")


def _half(mask: np.ndarray) -> np.ndarray:
  """float32 [n/2, n/2]: share of each 2x2 block of a bool [n, n] mask that is set."""
  m = mask.view(np.uint8)
  return (m[0::2, 0::2] + m[1::2, 0::2] + m[0::2, 1::2] + m[1::2, 1::2]) * np.float32(0.25)


def render(attrs, num_roots: int, rng: np.random.Generator,
           image_size: int = IMAGE_SIZE) -> np.ndarray:
  """uint8 [image_size, image_size, 3] picture of a class with attribute row `attrs`."""
  hue = (attrs[0] / num_roots + rng.normal(0.0, 0.012)) % 1.0
  sat = float(np.clip(0.45 + rng.uniform(-0.1, 0.1), 0.0, 1.0))
  val = float(np.clip(0.78 + rng.uniform(-0.1, 0.1), 0.0, 1.0))
  bg = np.array(colorsys.hsv_to_rgb(hue, sat, val), dtype=np.float32) * 255.0
  # A faint linear gradient in a random direction.
  angle = rng.uniform(0, 2 * np.pi)
  ramp = np.arange(image_size, dtype=np.float32) / image_size - 0.5
  shade = 1.0 + 0.12 * (np.cos(angle) * ramp[None, :] + np.sin(angle) * ramp[:, None])
  img = shade[..., None] * bg
  if attrs[1] >= 0:
    # Shapes are drawn at 2x; each output pixel mixes colours by its 2x2 block's coverage.
    size = 2 * image_size
    r = size * rng.uniform(0.26, 0.36)
    cx, cy = size / 2 + rng.uniform(-0.1, 0.1, size=2) * size
    canvas = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(canvas)
    _draw_shape(draw, _SHAPES[attrs[1]], cx, cy, r)
    orientation = _ORIENTATIONS[attrs[4] + 1]
    if orientation is not None:
      theta = np.deg2rad(orientation + rng.normal(0.0, 4.0))
      dx, dy = 1.4 * r * np.cos(theta), -1.4 * r * np.sin(theta)
      draw.line((cx - dx, cy - dy, cx + dx, cy + dy), fill=_BAR, width=max(2, size // 16))
    canvas = np.asarray(canvas)
    colour = np.array(_COLOURS[attrs[2] + 1], dtype=np.float32)
    colour = np.clip(colour * rng.uniform(0.88, 1.08) + rng.normal(0, 8, size=3), 0, 255)
    luminance = colour @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
    contrast = np.float32(30.0 if luminance > 110 else 235.0)
    shape = canvas == _SHAPE
    pattern = shape & _texture(_TEXTURES[attrs[3] + 1], size, rng)
    body = _half(shape & ~pattern)[..., None]
    marks = _half(pattern | (canvas == _BAR))[..., None]
    img = img * (1.0 - body - marks) + body * colour.astype(np.float32) + marks * contrast
  img += rng.normal(0.0, 6.0, img.shape)
  return np.clip(np.round(img), 0, 255).astype(np.uint8)


def png_bytes(image: np.ndarray) -> bytes:
  """PNG-encodes an image (fast zlib level: the noisy images barely compress anyway)."""
  buf = io.BytesIO()
  Image.fromarray(image).save(buf, format="PNG", compress_level=1)
  return buf.getvalue()


# ------------------------------------------------------------------------------------------
# Examples.


class DemoClasses:
  """Everything per class that generation needs: tree, looks, tag pools."""

  def __init__(self, wnids: list[str] | None = None):
    self.wnids = list(wnids) if wnids is not None else load_wnids()
    self.tree = tree_lib.SemanticTree.from_wnids(self.wnids)
    self.attrs = class_attributes(self.tree.parent)
    self.num_roots = len(self.tree.level_classes[0])
    _check_attributes(self.attrs, self.num_roots)
    self.tags = [lemma_tags(w) for w in self.wnids]
    self.ancestors = []  # Nearest first.
    for c in range(len(self.wnids)):
      chain, a = [], int(self.tree.parent[c])
      while a != -1:
        chain.append(a)
        a = int(self.tree.parent[a])
      self.ancestors.append(chain)
    # The leaves of each class's subtree (a leaf's is itself), in class-id order.
    has_child = np.zeros(len(self.wnids), dtype=bool)
    has_child[self.tree.parent[self.tree.parent >= 0]] = True
    self.leaves = [[] for _ in self.wnids]
    for leaf in np.flatnonzero(~has_child).tolist():
      for c in [leaf] + self.ancestors[leaf]:
        self.leaves[c].append(leaf)

  @property
  def num_classes(self) -> int:
    return len(self.wnids)

  def hashtags(self, c: int, rng: np.random.Generator) -> list[str]:
    """1-5 tags: a lemma of the class (80%) or of an ancestor, maybe more, maybe noise."""
    own = self.tags[c]
    up = [t for a in self.ancestors[c] for t in self.tags[a] if t not in own]
    tags = []
    if up and rng.random() < 0.2:
      tags.append(up[rng.integers(len(up))])
    else:
      tags.append(own[rng.integers(len(own))])
    if up and rng.random() < 0.5:
      tags.append(up[rng.integers(len(up))])
    if rng.random() < 0.3:
      tags.append(own[rng.integers(len(own))])
    if rng.random() < 0.5:
      tags.append(_NOISE_TAGS[rng.integers(len(_NOISE_TAGS))])
    if rng.random() < 0.1:  # A wrong class's tag.
      other = self.tags[rng.integers(self.num_classes)]
      tags.append(other[rng.integers(len(other))])
    tags = list(dict.fromkeys(tags))  # Drop repeats, keep order.
    return [tags[i] for i in rng.permutation(len(tags))]

  def member(self, c: int, split: str, index: int, *, seed: int = 0,
             look: str = DEFAULT_LOOK) -> int:
    """The class whose look example `index` of `split` (of class c) pictures: under
    `members` a leaf of c's subtree drawn uniformly from the example's own seed, under
    `plain` c itself."""
    if look not in LOOKS:
      raise ValueError(f"Unknown demo look {look!r}; known: {LOOKS}.")
    leaves = self.leaves[c]
    if look == "plain" or leaves == [c]:
      return c
    rng = np.random.default_rng([seed, SPLIT_IDS[split], index, _MEMBER_STREAM])
    return leaves[int(rng.integers(len(leaves)))]

  def example(self, split: str, index: int, *, seed: int = 0,
              truncation: float = DEFAULT_TRUNCATION, per_class: int | None = None,
              look: str = DEFAULT_LOOK) -> dict:
    """Example `index` of `split`: class index // per_class, seeded by (seed, split, index)
    only, so that any example can be regenerated on its own."""
    per_class = per_class or SPLIT_SIZES[split]
    if not 0 <= index < per_class * self.num_classes:
      raise IndexError(f"Example {index} outside split {split!r} of "
                       f"{per_class * self.num_classes}.")
    c = index // per_class
    member = self.member(c, split, index, seed=seed, look=look)
    rng = np.random.default_rng([seed, SPLIT_IDS[split], index])
    image = render(self.attrs[member], self.num_roots, rng)
    label = c
    # Always draw, so truncation changes labels only, never images or tags.
    truncate = rng.random() < truncation
    pick = rng.integers(1 << 30)
    if split == "train" and truncate and self.ancestors[c]:
      label = self.ancestors[c][pick % len(self.ancestors[c])]
    return {"image": png_bytes(image), "label": label, "true_label": c, "member": member,
            "hashtags": self.hashtags(c, rng)}


# ------------------------------------------------------------------------------------------
# The tfds builder.


def _split_sizes(split_sizes) -> dict[str, int]:
  """Validated examples per class for every split (defaults: SPLIT_SIZES)."""
  sizes = dict(SPLIT_SIZES if split_sizes is None else split_sizes)
  if sorted(sizes) != sorted(SPLIT_SIZES):
    raise ValueError(f"split_sizes needs exactly the splits {sorted(SPLIT_SIZES)}; got "
                     f"{sorted(sizes)}.")
  for split, n in sizes.items():
    if int(n) != n or n < 1:
      raise ValueError(f"split_sizes[{split!r}] = {n!r}; expected a positive int.")
  return {split: int(sizes[split]) for split in SPLIT_SIZES}


def config_name(truncation: float, split_sizes=None, look: str = DEFAULT_LOOK) -> str:
  """Builder config name: 0.2 -> 'trunc20', 0.125 -> 'trunc12.5', the plain look prefixed
  ('plain_trunc20'); non-default split sizes are appended
  ('trunc20_train10_validation4_unlabeled4')."""
  if not 0.0 <= truncation <= 1.0:
    raise ValueError(f"truncation must be in [0, 1]; got {truncation}.")
  if look not in LOOKS:
    raise ValueError(f"Unknown demo look {look!r}; known: {LOOKS}.")
  name = ("" if look == DEFAULT_LOOK else f"{look}_") + f"trunc{round(truncation * 100, 6):g}"
  sizes = _split_sizes(split_sizes)
  if sizes != SPLIT_SIZES:
    name += "".join(f"_{split}{n}" for split, n in sizes.items())
  return name


@dataclasses.dataclass(eq=False)
class DemoConfig(tfds.core.BuilderConfig):
  """truncation: share of train labels replaced by a random ancestor; seed: data seed;
  split_sizes: examples per class of each split; look: what inner classes picture (LOOKS)."""
  truncation: float = DEFAULT_TRUNCATION
  seed: int = 0
  split_sizes: dict[str, int] = dataclasses.field(default_factory=lambda: dict(SPLIT_SIZES))
  look: str = DEFAULT_LOOK


def demo_config(truncation: float = DEFAULT_TRUNCATION, split_sizes=None,
                look: str = DEFAULT_LOOK) -> DemoConfig:
  """The config (and its directory name) for a truncation share, split sizes and look."""
  pictured = "a leaf of their subtree" if look == "members" else "their own plain look"
  return DemoConfig(name=config_name(truncation, split_sizes, look),
                    truncation=float(truncation), split_sizes=_split_sizes(split_sizes),
                    look=look, description=f"{truncation:.0%} of train labels truncated to an "
                                           f"ancestor; inner classes picture {pictured}.")


class BigpretrainDemo(tfds.core.GeneratorBasedBuilder):
  """tfds builder `bigpretrain_demo` for the demo dataset (see the module docstring)."""

  VERSION = tfds.core.Version("2.0.0")
  RELEASE_NOTES = {
      "1.0.0": "First version.",
      "2.0.0": "Inner classes picture a leaf of their subtree (the `members` look); the "
               "1.0.0 images are the `plain` look (configs plain_*); 'member' feature.",
  }
  BUILDER_CONFIGS = [demo_config(DEFAULT_TRUNCATION), demo_config(0.0), demo_config(0.5),
                     demo_config(DEFAULT_TRUNCATION, look="plain")]

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    # tfds 4.9.10 works this out through the `importlib_resources` backport, which it only
    # requires for Python < 3.9; for a builder inside a package that import then fails.
    return epath.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(IMAGE_SIZE, IMAGE_SIZE, 3),
                                         encoding_format="png"),
            "label": tfds.features.ClassLabel(names=load_wnids()),
            "hashtags": tfds.features.Sequence(tfds.features.Text()),
            "true_label": np.int64,
            "member": np.int64,
        }),
        supervised_keys=("image", "label"),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download.
    classes = DemoClasses(self.info.features["label"].names)
    return {split: self._generate_examples(classes, split) for split in SPLIT_SIZES}

  def _generate_examples(self, classes: DemoClasses, split: str):
    cfg = self.builder_config
    per_class = cfg.split_sizes[split]
    for index in range(per_class * classes.num_classes):
      yield index, classes.example(split, index, seed=cfg.seed, truncation=cfg.truncation,
                                   per_class=per_class, look=cfg.look)


@contextlib.contextmanager
def file_lock(path: pathlib.Path):
  """Holds an exclusive flock on `path` (created if missing) while the block runs."""
  with open(path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def prepare(data_dir: str | os.PathLike | None = None, *,
            truncation: float = DEFAULT_TRUNCATION, split_sizes=None,
            look: str = DEFAULT_LOOK) -> BigpretrainDemo:
  """The demo builder, with its ArrayRecord files generated on first use.

  data_dir defaults to datasets.default_data_dir(); split_sizes (examples per class, e.g. smaller for
  tests) defaults to SPLIT_SIZES; look is one of LOOKS. Each (truncation, split_sizes, look)
  has its own config folder.

  Processes starting together (hosts of a local multi-process run) serialise on a file lock
  in data_dir: the first generates, the others wait, then read the finished files.
  """
  data_dir = pathlib.Path(data_dir) if data_dir else datasets.default_data_dir()
  config = demo_config(truncation, split_sizes, look)
  # tfds takes predefined configs by name only; other shares as a config object.
  predefined = {c.name for c in BigpretrainDemo.BUILDER_CONFIGS}
  config_arg = config.name if config.name in predefined else config

  def make():
    return BigpretrainDemo(data_dir=str(data_dir), config=config_arg, file_format="array_record")

  builder = make()
  if builder.is_prepared():
    return builder
  data_dir.mkdir(parents=True, exist_ok=True)
  with file_lock(data_dir / f".{BigpretrainDemo.name}-{config.name}.lock"):
    builder = make()  # Re-reads what another process may have written meanwhile.
    if not builder.is_prepared():
      logging.info("Generating the demo dataset into %s", builder.data_dir)
      builder.download_and_prepare()
  return builder


@datasets.SOURCES.register("demo_plain/", usage="demo_plain/truncPERCENT")
@datasets.SOURCES.register("demo_plain")
@datasets.SOURCES.register("demo/", usage="demo/truncPERCENT")
@datasets.SOURCES.register("demo")
def _demo(name: str, data_dir: str) -> datasets.Dataset:
  """'demo[/truncNN]' or 'demo_plain[/truncNN]' -> the generated demo dataset, its inner
  classes picturing their members or (demo_plain) their own plain look."""
  match = re.fullmatch(r"(demo|demo_plain)(?:/trunc(\d+(?:\.\d+)?))?", name)
  if not match or (match.group(2) and float(match.group(2)) > 100):
    base = name.split("/")[0]
    raise ValueError(f"Unknown demo variant {name!r}; use '{base}' or '{base}/truncNN' with "
                     "NN the percent (0-100) of train labels truncated to an ancestor.")
  look = {v: k for k, v in DATASET_NAMES.items()}[match.group(1)]
  truncation = (float(match.group(2)) / 100.0 if match.group(2)
                else DEFAULT_TRUNCATION)
  return datasets.TfdsDataset(name, prepare(data_dir or None, truncation=truncation, look=look))
