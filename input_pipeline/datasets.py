"""Dataset lookup: `config.data` -> class list, split sizes and random-access record sources.

`config.data.name` is looked up in SOURCES, a registry of names and name prefixes; a new kind
of dataset registers its loader `loader(name, data_dir) -> Dataset` where it is defined
(`@datasets.SOURCES.register("myprefix:")`, in a module listed in config.plugins); Dataset
and Source (dataset_base.py) say what a loader's dataset and its split sources provide. A
loader whose sources read config.data keys of their own declares them (`data_keys`): other
data keys than pipeline.data_defaults()'s are refused by config_lib.validate as typos. The
built-in sources of the sources/ package register themselves the same way; the package is
imported on the registry's first lookup. Built in:
  'demo'                 the embedded demo (input_pipeline/sources/demo.py), generated on first use
                         into data.dir or `<cache>/tensorflow_datasets`; 'demo/trunc35' sets
                         the share of truncated train labels (percent, default 20).
                         'demo_plain[/truncNN]': the demo with inner classes drawn in their
                         own plain look instead of picturing their members (demo.py).
  'demo_coarse'          the demo's images labelled at a coarser WordNet level (12 classes),
                         the demo's downstream task (demo_coarse.py); 'demo_plain_coarse'
                         the same over demo_plain.
  'tfds:NAME[/CONFIG]'   any tfds dataset already prepared as ArrayRecord in data.dir (or the
                         default cache), e.g. by `tfds build NAME --data_dir=DIR
                         --file_format=array_record` or the project's Beam preparation jobs.
                         The builder code is not needed: tfds reads the prepared files.
  'imagenet21k_p'        ImageNet-21K-P prepared in data.dir by `python -m input_pipeline.prepare
                         imagenet21k_p --manual_dir=RAW --data_dir=DIR` (imagenet21k_p.py);
                         class_names are the kept wnids, splits 'train' and 'validation'.
  'hashtags:NAME'        a SWAG hashtag dataset prepared into data.dir by `python -m
                         input_pipeline.prepare hashtags --manual_dir=RAW --data_dir=DIR
                         --name=NAME` (hashtag_job.py): canonical hashtags as classes,
                         'hashtag_ids' per record, head/tail resampled train
                         (hashtag_source.py). 'hashtags:demo': the demo's tags, prepared
                         by the same job on first use.
  'folder:NAME'          an ImageFolder tree converted into data.dir by `python -m
                         input_pipeline.prepare folder --manual_dir=RAW --data_dir=DIR
                         --name=NAME` (image_folder.py); class_names are the folder names.
  'selection:DIR'        the dataset D-hat selected into DIR by `python -m input_pipeline.prepare
                         selection`, read through its index from the source dataset (in the
                         same data.dir); its other splits pass through (selection_source.py).

A source record is a dict with 'image' (the ENCODED PNG/JPEG bytes; grain workers decode
them), 'label' (int; a multi-label tfds dataset without one, e.g. voc, has instead its class
list as 'labels', a Sequence(ClassLabel) shipped as an id list padded to num_classes),
'hashtags' (list of str) when the dataset has them, and the dataset's
other scalar features (e.g. the demo's 'true_label'; 'file_name' as str for the prepared
datasets).
"""
import functools
import pathlib
import re
import time
from typing import Any, Mapping

from array_record.python import array_record_module
import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.core import read_only_builder

from bigpretrain import registry
from bigpretrain.runtime import cache
from bigpretrain.runtime import transient
from input_pipeline import dataset_base
from input_pipeline import decoding
from input_pipeline import subset

# Loaders by config.data.name: exact names, and prefixes (ending in ':' or '/') that serve
# every longer name starting with them.
# The built-ins (input_pipeline/sources/) import this module: imported on first lookup.
SOURCES = registry.Registry("dataset", "config.data.name", prefixes=True,
                            builtins="input_pipeline.sources")
register_source = SOURCES.register


def data_keys(*keys: str):
  """Declares the config.data keys a loader's dataset or sources read beyond
  pipeline.data_defaults()'s (e.g. the hashtag sources' data.resample_alpha, read by their
  configure()), as the loader's `data_keys` attribute; a loader class may set that attribute
  itself. config_lib.validate accepts such a key only in configs whose data.name or data.mix
  entries name a loader that declares it: elsewhere it would be ignored, so it is refused
  as a typo. Place it under the registration:

    @datasets.SOURCES.register("myprefix:")
    @datasets.data_keys("my_option")
    def load(name, data_dir): ...
  """
  for key in keys:
    if not isinstance(key, str) or not key:
      raise ValueError(f"data_keys takes config.data key names (strings), got {key!r}.")

  def declare(loader):
    loader.data_keys = tuple(keys)
    return loader

  return declare


def declared_data_keys(name: str) -> tuple[str, ...]:
  """The extra config.data keys (see data_keys) that the loader of dataset `name` declares.
  Raises ValueError (naming the close match) when no loader serves `name`."""
  keys = getattr(SOURCES.get(str(name)), "data_keys", ())
  if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
    raise ValueError(f"The loader of dataset {name!r} declares data_keys={keys!r}: it must "
                     "be a tuple of config.data key names.")
  return tuple(keys)


def sources_declaring(key: str) -> list[str]:
  """The dataset names (as written in messages) of the imported loaders that declare the
  config.data key `key` (data_keys)."""
  return [name for name, loader in SOURCES.loaded().items()
          if key in getattr(loader, "data_keys", ())]


# The contract every loader's dataset and source follow (dataset_base.py).
Dataset = dataset_base.Dataset
DatasetInfo = dataset_base.DatasetInfo
Source = dataset_base.Source

# tfds names of the prepared datasets (imagenet21k_p.NAME, image_folder.BUILDER_NAME; not
# imported from there, so that reading needs no Apache Beam).
IMAGENET21K_P = "imagenet21k_p"
FOLDER_BUILDER = "bigpretrain_folder"
_TEXT_KEYS = ("file_name",)  # tfds Text features: bytes -> str.
# Features read as 'label' in datasets without one: ReaL (tfds imagenet2012_real) keeps the
# ImageNet validation label as 'original_label' beside its 'real_label' lists.
_LABEL_ALIASES = ("original_label",)
# A multi-label dataset without a single 'label': its class list is this top-level
# Sequence(ClassLabel) feature, read as an id-list field (tfds voc: each image's distinct
# object classes, sorted).
LABEL_LIST = "labels"


def _class_label_list(feature):
  """The ClassLabel inside `feature` when it is a Sequence(ClassLabel), else None."""
  inner = getattr(feature, "feature", None)
  if isinstance(feature, tfds.features.Sequence) and isinstance(inner, tfds.features.ClassLabel):
    return inner
  return None


def _field_size(name: str, feature, max_lengths: Mapping[str, int]) -> int | None:
  """DatasetInfo.features entry of one tfds feature (see there)."""
  if isinstance(feature, tfds.features.Text):
    return None
  shape, dtype = getattr(feature, "shape", None), getattr(feature, "np_dtype", None)
  if dtype is None or isinstance(dtype, Mapping):  # Nested features (tfds voc's 'objects').
    return None
  if not (np.issubdtype(np.dtype(dtype), np.integer)
          or np.issubdtype(np.dtype(dtype), np.floating)):
    return None
  if shape == ():
    return 0
  if shape == (None,) and np.issubdtype(np.dtype(dtype), np.integer):
    return max_lengths.get(name)  # Unknown max length: not shippable.
  return None


# Seconds before each new read of a record whose read failed for a storage or network
# reason (runtime.transient): a blip of up to about 40 s is ridden out; after the last, the
# run stops (decoding.StorageUnavailableError) rather than skip records an outage hides.
READ_RETRY_WAITS_S = (0.5, 2.0, 8.0, 30.0)


class RecordSource(Source):
  """Random-access records of one split, picklable for grain workers.

  Wraps a tfds ArrayRecord data source read with image decoding skipped, and turns tfds's
  byte strings and numpy scalars into str and int.
  """

  def __init__(self, source, split: str):
    self._source = source
    self.split = split

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> dict[str, Any]:
    for wait_s in READ_RETRY_WAITS_S + (None,):
      try:
        record = self._source[index]
        break
      except Exception as e:  # pylint: disable=broad-except
        if not transient.is_transient(e):
          raise self._read_error(index, e) from e
        if wait_s is None:
          raise decoding.StorageUnavailableError(
              f"record {index} of split {self.split!r} could not be read in "
              f"{len(READ_RETRY_WAITS_S) + 1} tries over {sum(READ_RETRY_WAITS_S):g} s "
              f"({type(e).__name__}: {e}). The storage failed, not the record, so the run "
              "stops rather than skip records; re-run the same command once the storage is "
              "back to resume from the last checkpoint.") from e
        time.sleep(wait_s)  # A storage blip: the record is read again, not skipped.
    return _clean(record)

  def __getitems__(self, indices) -> list[dict[str, Any]]:
    try:
      records = self._source.__getitems__(indices)
    except Exception:  # pylint: disable=broad-except
      return [self[i] for i in indices]  # Raises for the first unreadable record.
    return [_clean(r) for r in records]

  def _read_error(self, index: int, error: Exception) -> ValueError:
    """UnreadableShardError when the record's shard cannot be opened at all, else a
    CorruptRecordError naming the record and its shard."""
    shard, opened = _shard_of(self._source, index)
    what = f"{type(error).__name__}: {error}"
    if shard is not None and not opened:
      return decoding.UnreadableShardError(
          f"shard {shard} of split {self.split!r} cannot be read ({what}); restore or "
          "re-prepare it")
    where = f" (shard {shard})" if shard else ""
    return decoding.CorruptRecordError(f"record {index} of split {self.split!r}{where} "
                                       f"cannot be read: {what}")

  def __repr__(self) -> str:
    return f"RecordSource(split={self.split!r}, len={len(self)})"


def _shard_of(source, index: int) -> tuple[str | None, bool]:
  """(the shard file holding record `index`, whether that shard opens: its record index
  reads) of a tfds ArrayRecord data source; (None, True) where the source does not tell."""
  inner = getattr(source, "data_source", None)
  try:
    reader, _ = inner._reader_idx_and_position(index)  # pylint: disable=protected-access
    shard = str(inner._read_instructions[reader].filename)  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-except
    return None, True
  return shard, _shard_opens(shard)


@functools.lru_cache(maxsize=None)
def _shard_opens(path: str) -> bool:
  """False when ArrayRecord cannot read the shard's footer and record index at all (a
  truncated or overwritten tail): no record of it is readable."""
  try:
    reader = array_record_module.ArrayRecordReader(path)
  except Exception as e:  # pylint: disable=broad-except
    if transient.is_transient(e):
      raise  # Not remembered: the next failed read looks again.
    return False
  ok = reader.ok()
  try:
    reader.close()
  except Exception:  # pylint: disable=broad-except
    return False
  return ok


def _clean(record: Mapping[str, Any]) -> dict[str, Any]:
  """tfds record -> plain Python values (image stays encoded bytes)."""
  out = {}
  for key, value in record.items():
    if key == "hashtags":
      out[key] = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in value]
    elif key in _TEXT_KEYS and isinstance(value, (bytes, np.bytes_)):
      out[key] = bytes(value).decode("utf-8")
    elif isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.ndim == 0):
      out["label" if key in _LABEL_ALIASES and "label" not in record else key] = value.item()
    else:
      out[key] = value
  return out


class TfdsDataset(Dataset):
  """A dataset prepared by tfds or by input_pipeline.prepare, read from its ArrayRecord files."""

  def __init__(self, name: str, builder: tfds.core.DatasetBuilder):
    self.builder = builder
    features = builder.info.features
    label_key = next((k for k in ("label",) + _LABEL_ALIASES if k in features), None)
    label_list = (_class_label_list(features[LABEL_LIST])
                  if label_key is None and LABEL_LIST in features else None)
    if "image" not in features or (label_key is None and label_list is None):
      raise ValueError(f"Dataset {name!r} needs an 'image' feature and a 'label' feature "
                       f"(or a '{LABEL_LIST}' Sequence(ClassLabel) of a multi-label dataset); "
                       f"it has {sorted(features.keys())}.")
    label = features[label_key] if label_key is not None else label_list
    names = list(label.names) if hasattr(label, "names") else []
    shape = getattr(features["image"], "shape", (None, None, None))
    size = shape[0] if shape[0] is not None and shape[0] == shape[1] else None
    splits = tuple(sorted(builder.info.splits.keys()))
    max_lengths = dict((builder.info.metadata or {}).get("max_lengths", {}))
    if label_list is not None:
      # Without a stated max length: distinct classes per image (tfds voc's 'labels' and
      # 'labels_no_difficult'), at most C; likewise every top-level Sequence(ClassLabel) of
      # the same classes.
      for key, feature in features.items():
        inner = _class_label_list(feature)
        if inner is not None and list(inner.names) == names:
          max_lengths.setdefault(key, int(label.num_classes))
    self.info = DatasetInfo(
        name=name,
        num_classes=int(label.num_classes),
        class_names=names,
        num_examples={s: int(builder.info.splits[s].num_examples) for s in splits},
        image_size=size,
        splits=splits,
        features={("label" if k == label_key else k): _field_size(k, f, max_lengths)
                  for k, f in sorted(features.items()) if k != "image"},
    )

  def source(self, split: str) -> RecordSource:
    """Random-access source over `split` ('train', 'validation', ...)."""
    self.check_split(split)
    decoders = {"image": tfds.decode.SkipDecoding()}
    try:
      source = self.builder.as_data_source(split, decoders=decoders)
    except NotImplementedError as e:  # Prepared as TFRecord: not random-access.
      raise ValueError(
          f"Dataset {self.info.name!r} in {self.builder.data_dir} is not stored as "
          "ArrayRecord; re-prepare it with --file_format=array_record.") from e
    return RecordSource(source, split)


def default_data_dir() -> pathlib.Path:
  """Where datasets are read and the demo is generated without data.dir:
  `<cache>/tensorflow_datasets` (bigpretrain/runtime/cache.py)."""
  return cache.root() / "tensorflow_datasets"


def _data_dir(data_cfg) -> str:
  return str(data_cfg.get("dir", "") or "")


@SOURCES.register("tfds:", usage="tfds:NAME[/CONFIG]")
def _tfds(name: str, data_dir: str) -> Dataset:
  """'tfds:NAME[/CONFIG]' -> a dataset already prepared in data_dir."""
  tfds_name = name[len("tfds:"):]
  root = pathlib.Path(data_dir) if data_dir else default_data_dir()
  how = (f"Prepare it first, e.g. `tfds build {tfds_name.split('/')[0]} --data_dir={root} "
         "--file_format=array_record`, or point the data dir at the folder holding it "
         "(config.data.dir in a run; --data_dir in the commands).")
  if not root.is_dir():
    raise FileNotFoundError(f"Data dir {root} for dataset {name!r} does not exist. {how}")
  try:
    builder = tfds.builder(tfds_name, data_dir=str(root))
  except Exception as e:  # tfds raises several types for unknown, unprepared names.
    first_line = str(e).strip().split("\n")[0]
    raise FileNotFoundError(f"No prepared dataset {tfds_name!r} in {root} "
                            f"({type(e).__name__}: {first_line}). {how}") from e
  if not builder.is_prepared():
    raise FileNotFoundError(f"Dataset {tfds_name!r} is not prepared in {root}. {how}")
  return TfdsDataset(name, builder)


def _prepared(name: str, tfds_name: str, data_dir: str, command: str) -> Dataset:
  """A dataset made by input_pipeline.prepare, read from its files (no builder code)."""
  root = pathlib.Path(data_dir) if data_dir else default_data_dir()
  how = f"Prepare it with `python -m input_pipeline.prepare {command}` (--data_dir={root})."
  if not root.is_dir():
    raise FileNotFoundError(f"Data dir {root} for dataset {name!r} does not exist. {how}")
  try:
    builder = read_only_builder.builder_from_files(tfds_name, data_dir=str(root))
  except tfds.core.registered.DatasetNotFoundError as e:
    raise FileNotFoundError(f"No prepared dataset {name!r} ({tfds_name}) in {root}. "
                            f"{how}") from e
  return TfdsDataset(name, builder)


@SOURCES.register(IMAGENET21K_P)
def _imagenet21k_p(name: str, data_dir: str) -> Dataset:
  return _prepared(name, IMAGENET21K_P, data_dir, "imagenet21k_p --manual_dir=RAW --data_dir=DIR")


@SOURCES.register("folder:", usage="folder:NAME")
def _folder(name: str, data_dir: str) -> Dataset:
  folder = name[len("folder:"):]
  if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_\-]*", folder):
    raise ValueError(f"Bad dataset name {name!r}: use 'folder:NAME' with NAME the --name "
                     "given to `python -m input_pipeline.prepare folder`.")
  return _prepared(name, f"{FOLDER_BUILDER}/{folder}", data_dir,
                   f"folder --manual_dir=RAW --data_dir=DIR --name={folder}")




def name_prefixes() -> list[str]:
  """The registered name prefixes ('tfds:', 'folder:', 'demo/', ...)."""
  return [k for k in SOURCES.keys() if k.endswith((":", "/"))]


def get_dataset(data_cfg) -> Dataset:
  """`config.data` (uses keys 'name' and 'dir') -> Dataset; see the module docstring."""
  name = str(data_cfg.get("name", ""))
  return SOURCES.get(name)(name, _data_dir(data_cfg))


def parse_mix(spec: str) -> list[tuple[str, float]]:
  """'tfds:extra=0.25;folder:web=0.1' -> [('tfds:extra', 0.25), ('folder:web', 0.1)]."""
  out = []
  for entry in (e.strip() for e in str(spec).split(";")):
    if not entry:
      continue
    name, sep, weight = entry.rpartition("=")
    try:
      w = float(weight)
    except ValueError:
      w = float("nan")
    if not sep or not name.strip() or not 0 < w < 1:
      raise ValueError(f"Bad data.mix entry {entry!r} in {spec!r}: use 'NAME=WEIGHT' with "
                       "0 < WEIGHT < 1, entries separated by ';'.")
    out.append((name.strip(), w))
  total = sum(w for _, w in out)
  if total >= 1:
    raise ValueError(f"data.mix weights sum to {total:g}; they must leave data.name a share "
                     "(sum < 1).")
  return out


def num_train_examples(data_cfg, dataset: Dataset) -> int:
  """The records one epoch of data.train_split counts: the split's size, or the size of its
  per-class draw with data.subset_frac < 1 (few-shot training). data.mix entries do not count:
  at data.name's share w of the stream, an epoch shows each of its records w times."""
  if data_cfg.get("subset_frac", 1.0) != 1.0:
    return len(train_sources(data_cfg, dataset)[0][0])
  return dataset.info.num_examples[data_cfg.get("train_split", "train")]


def train_split_sizes(data_cfg, dataset: Dataset) -> dict[str, int]:
  """Records of data.train_split in data.name and in each data.mix dataset, as their infos
  state them (a dataset that does not state it is left out): what the train stream's order
  depends on besides the seed and the config, saved with its position (stream_position)."""
  split = data_cfg.get("train_split", "train")
  named = [(dataset.info.name, dataset)] + [
      (name, get_dataset({"name": name, "dir": _data_dir(data_cfg)}))
      for name, _ in parse_mix(data_cfg.get("mix", ""))]
  return {name: int(d.info.num_examples[split]) for name, d in named
          if isinstance(d.info.num_examples.get(split), (int, np.integer))}


def train_sources(data_cfg, dataset: Dataset) -> tuple[list[Source], list[float]]:
  """The train split of `dataset` (its per-class draw when data.subset_frac < 1; see
  subset.py) and of every data.mix entry, with their weights.

  Mixed datasets are looked up like data.name (same data.dir) and must have the same classes
  in the same order, so that one label means one class everywhere. Each source is replaced
  by its `configure(data_cfg)` (its own data.* options, e.g. the hashtag sources'
  data.resample_alpha).
  """
  split = data_cfg.get("train_split", "train")
  mix = parse_mix(data_cfg.get("mix", ""))
  sources = [_configured(subset.apply(dataset.source(split), data_cfg, dataset.info.name),
                         data_cfg)]
  weights = [1.0 - sum(w for _, w in mix)]
  for name, weight in mix:
    other = get_dataset({"name": name, "dir": _data_dir(data_cfg)})
    info = dataset.info
    if (other.info.num_classes, other.info.class_names) != (info.num_classes,
                                                           info.class_names):
      raise ValueError(
          f"data.mix dataset {name!r} has {other.info.num_classes} classes "
          f"({other.info.class_names[:3]}...), {info.name!r} has {info.num_classes} "
          f"({info.class_names[:3]}...): mixed datasets need the same class list.")
    sources.append(_configured(other.source(split), data_cfg))
    weights.append(weight)
  return sources, weights


def _configured(source: Source, data_cfg) -> Source:
  if not isinstance(source, Source):
    raise TypeError(f"A train source is a {type(source).__name__}, not a datasets.Source: "
                    "a dataset's source(split) returns one (subclass it; "
                    "input_pipeline/dataset_base.py).")
  return source.configure(data_cfg)
