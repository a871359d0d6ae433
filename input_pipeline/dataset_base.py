"""What every dataset provides, declared once: a loader registered in datasets.SOURCES
returns a `Dataset`, whose `source(split)` is a `Source`. The trainer, the evaluators and the
pipeline use datasets through these members only (datasets.py re-exports them; this module
stands apart so that pipeline.py and subset.py read the contract without importing tfds)."""
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """What the trainer needs to know about a dataset before reading it."""
  name: str
  num_classes: int
  class_names: list[str]  # wnids for WordNet-labelled datasets (demo, ImageNet).
  num_examples: dict[str, int]  # split -> examples.
  image_size: int | None  # Side of the stored square images; None if they vary.
  splits: tuple[str, ...]
  # Record fields the pipeline can ship (besides 'image'): name -> 0 for a numeric scalar,
  # K > 0 for an id list padded to K, None for fields that stay on the host (text, bytes).
  features: dict[str, int | None] = dataclasses.field(default_factory=dict)
  # Counts a source reports about itself (e.g. images it dropped); informational only.
  stats: dict[str, Any] = dataclasses.field(default_factory=dict)


class Source:
  """The records of one split, random access, picklable (grain's workers read it).

  Every source provides len(source), source[i] -> a record (a dict: 'image' as encoded
  bytes, the fields of DatasetInfo.features; see datasets.py) and `split` (the split's name).
  Optional members, with their defaults here:
  - index_sampler(seed, process_index, process_count): this host's own sample order, an
    object whose [j] is the source index of the host's j-th record, a pure function of
    (seed, j) (e.g. hashtag head/tail resampling), or None. Default None (no method): the
    pipeline shuffles the source and slices the stream over hosts.
  - configure(data_cfg): the source read with its own data.* options (e.g.
    data.resample_alpha, which its loader declares with datasets.data_keys so that
    config_lib.validate accepts it); default the source itself.
  A source may also define __getitems__(indices), a batched read.
  """
  split: str | None = None
  index_sampler = None

  def __len__(self) -> int:
    raise NotImplementedError

  def __getitem__(self, index: int) -> dict[str, Any]:
    raise NotImplementedError

  def configure(self, data_cfg) -> "Source":
    del data_cfg
    return self


class Dataset:
  """What every loader in datasets.SOURCES returns: `info` and `source(split)`, a Source
  over one of info.splits (ValueError naming them for another split, check_split)."""
  info: DatasetInfo

  def source(self, split: str) -> Source:
    raise NotImplementedError

  def check_split(self, split: str) -> None:
    if split not in self.info.splits:
      raise ValueError(f"Unknown split {split!r} for dataset {self.info.name!r}; known "
                       f"splits: {list(self.info.splits)}.")
