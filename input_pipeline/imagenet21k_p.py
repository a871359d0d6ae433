"""ImageNet-21K-P (Ridnik et al., 2021, section 2.1) prepared by an Apache Beam job into tfds.

One command turns the official raw release into the tfds dataset `imagenet21k_p` (ArrayRecord
files, splits `train` and `validation`, features 'image' (JPEG bytes), 'label' (ClassLabel over
the kept wnids, sorted) and 'file_name' ('wnid/member name')):

  python -m input_pipeline.prepare imagenet21k_p --manual_dir=RAW --data_dir=OUT \
      [--beam_runner=DataflowRunner|FlinkRunner|SparkRunner ...]

Input (detected): RAW (or RAW/train) holds either one folder of images per wnid (winter21 style
`train/` folders) or one uncompressed `.tar` of images per wnid (fall11 style). Entries whose
name is not a wnid are ignored and listed in the report.

The job follows the paper's three steps:
  1. Classes with `min_images` (500) or fewer listed files are dropped; a class is kept only if
     it has MORE than 500 files (corrupt files included in that count, as they are files of
     the release). Dropped wnids and their counts go to the metadata.
  2. Validation split, `val_per_class` (50) images per kept class. The rule: rank the class's
     files by sha256 of the UTF-8 string 'wnid/name' (hex digest, ties by name) and send the
     first 50 to `validation`, the rest to `train`. It depends on the file names only, so the
     same input gives the same split on any runner, worker count or layout (folder or tar).
     A corrupt file is skipped where the rule put it, not replaced, so such a class has
     fewer than 50 validation images.
  3. Squish-resize to 224x224 (aspect ratio not kept); images whose longer side is already
     below 224 keep their size (never upscaled); everything is re-encoded as RGB JPEG at
     `jpeg_quality` (default 75, PIL's default; the paper's ~250 GB for 12.4M images is
     about 20 KB an image).

Metadata (`builder.info.metadata`, stored in metadata.json next to the shards; `report(builder)`
reads it back): the class list (wnids, index = label), readable names (WordNet lemmas), per-class
counts per split, dropped classes with counts, the semantic tree of the kept classes
(`SemanticTree.from_wnids`, as `semantic_tree(builder)`), and every corrupt or unreadable file
with its error: those are skipped and counted, never fatal, never silent.

Engine: step 1 is a small Beam job (counting each class's files in parallel: listing tars of a
1.3 TB release is real work), steps 2-3 are the Beam pipeline of the tfds builder (tfds's
Beam path writes ArrayRecord without TensorFlow). Both run on the DirectRunner by default, or on
any runner given by `beam_runner`; extra Beam options (`--project=...`, `--direct_num_workers=4`,
`--setup_file=./setup.py` for remote workers) are passed through. Progress: tfds progress bars,
per-class log lines, and Beam counters (namespace 'imagenet21k_p'), logged at the end.
Memory: the DirectRunner keeps PCollections in memory, and tfds's deterministic writer groups
all encoded examples by shard, so a one-machine run holds the output (~20 KB an image) in RAM:
fine for subsets and downstream datasets; the full release (~250 GB out) wants a distributed
runner (Dataflow, Flink, Spark) or a machine with that much memory.

Re-running: tfds writes into an `incomplete.*` folder and renames it when done, so a finished
dataset is reused (the command says so and checks that it was made with the same parameters),
and an interrupted run's folder is never read: the next run starts over and says which
leftovers it ignores.

The same job converts ImageFolder trees (input_pipeline/image_folder.py).
"""
import dataclasses
import hashlib
import io
import json
import re
import tarfile
import uuid
from typing import Any, Iterable, Sequence

from absl import logging
import apache_beam as beam
from apache_beam.options import pipeline_options
from etils import epath
from PIL import Image
import tensorflow_datasets as tfds
from tensorflow_datasets.core import read_only_builder

from bigpretrain.semantic import tree as tree_lib
from bigpretrain.semantic import wordnet

NAME = "imagenet21k_p"
MIN_IMAGES = 500  # A class is kept only with more files than this.
VAL_PER_CLASS = 50
IMAGE_SIZE = 224
JPEG_QUALITY = 75
COUNTER_NAMESPACE = "imagenet21k_p"  # Beam counters of every job in this module.
REPORT_FILE = "preparation_report.json"  # Written by the pipeline, folded into the metadata.
WNID_RE = re.compile(r"n\d{8}")
_CORRUPT = "corrupt"  # Tag of the Beam side output of unreadable files.


# ------------------------------------------------------------------------------------------
# Raw layouts.


@dataclasses.dataclass(frozen=True)
class ClassSource:
  """One raw class: a folder of images or an uncompressed tar of images.

  split: the split all its files go to; '' means split by the hash rule (`validation_names`).
  """
  class_name: str
  path: str
  kind: str  # 'dir' or 'tar'.
  split: str = ""


def detect_layout(raw_dir) -> tuple[str, list[ClassSource], list[str]]:
  """RAW -> (layout 'folders' or 'tars', class sources sorted by wnid, ignored entry names).

  Looks in RAW/train when it exists (winter21 layout), else in RAW. Raises ValueError when it
  finds both wnid folders and wnid tars, or neither.
  """
  raw = epath.Path(raw_dir)
  if not raw.is_dir():
    raise FileNotFoundError(f"Raw ImageNet-21K folder {raw} (--manual_dir) does not exist.")
  root = raw / "train" if (raw / "train").is_dir() else raw
  folders, tars, ignored = [], [], []
  for entry in sorted(root.iterdir(), key=lambda p: p.name):
    if entry.name.startswith("."):
      continue
    if WNID_RE.fullmatch(entry.name) and entry.is_dir():
      folders.append(ClassSource(entry.name, str(entry), "dir"))
    elif entry.name.endswith(".tar") and WNID_RE.fullmatch(entry.name[:-4]) and entry.is_file():
      tars.append(ClassSource(entry.name[:-4], str(entry), "tar"))
    else:
      ignored.append(entry.name)
  if folders and tars:
    raise ValueError(
        f"{root} holds both wnid folders ({len(folders)}, e.g. {folders[0].class_name}) and "
        f"wnid .tar files ({len(tars)}, e.g. {tars[0].class_name}.tar); keep one layout.")
  if not folders and not tars:
    raise ValueError(
        f"No class found in {root}: expected one folder of images per wnid (e.g. "
        f"n01440764/) or one .tar per wnid (e.g. n01440764.tar); found "
        f"{ignored[:5] or 'nothing'}.")
  if ignored:
    logging.warning("Ignoring %d entries of %s that are not wnid folders/tars: %s",
                    len(ignored), root, ignored[:10])
  return ("folders", folders, ignored) if folders else ("tars", tars, ignored)


def list_files(source: ClassSource) -> list[tuple[str, int, int]]:
  """Files of a class as (name, offset, size), sorted by name.

  Folder: regular non-hidden files directly inside, offset = size = -1 (read whole).
  Tar: regular members, name without a leading './', offset/size of the member's data.
  """
  path = epath.Path(source.path)
  if source.kind == "dir":
    return [(p.name, -1, -1) for p in sorted(path.iterdir(), key=lambda p: p.name)
            if not p.name.startswith(".") and p.is_file()]
  if source.kind == "tar":
    files = []
    with path.open("rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
      for member in tar:
        if member.isreg():
          name = member.name[2:] if member.name.startswith("./") else member.name
          files.append((name, member.offset_data, member.size))
    return sorted(files)
  raise ValueError(f"Unknown class source kind {source.kind!r} for {source.path}.")


def read_file(path: str, offset: int, size: int) -> bytes:
  """Bytes of a listed file: the whole file (offset -1) or `size` bytes at `offset`."""
  with epath.Path(path).open("rb") as f:
    if offset < 0:
      return f.read()
    f.seek(offset)
    data = f.read(size)
  if len(data) != size:
    raise OSError(f"tar member truncated: {len(data)} of {size} bytes at offset {offset}")
  return data


def validation_names(class_name: str, names: Iterable[str], val_per_class: int) -> set[str]:
  """The hash rule: the `val_per_class` names with the smallest sha256('class/name') hex
  digest (ties by name) go to validation."""
  def rank(name):
    return hashlib.sha256(f"{class_name}/{name}".encode("utf-8")).hexdigest(), name
  return set(sorted(names, key=rank)[:max(val_per_class, 0)])


# ------------------------------------------------------------------------------------------
# Image processing.


def squish_jpeg(data: bytes, size: int = IMAGE_SIZE, quality: int = JPEG_QUALITY) -> bytes:
  """Encoded image -> RGB JPEG squished to size x size, or kept at its size when its longer
  side is below `size`. Raises (PIL's error types) on undecodable data."""
  with Image.open(io.BytesIO(data)) as image:
    if max(image.size) >= size:
      image.draft("RGB", (size, size))  # JPEG DCT scaling: decodes big images fast.
    image.load()
    rgb = image.convert("RGB")
  if max(rgb.size) >= size:
    rgb = rgb.resize((size, size), Image.Resampling.BICUBIC)
  out = io.BytesIO()
  rgb.save(out, format="JPEG", quality=quality)
  return out.getvalue()


def verified_image(data: bytes, quality: int = JPEG_QUALITY) -> bytes:
  """Encoded image -> the same bytes if it is a decodable JPEG/PNG, other decodable formats
  re-encoded as RGB JPEG. Raises on undecodable data."""
  with Image.open(io.BytesIO(data)) as image:
    image.load()
    if image.format in ("JPEG", "PNG"):
      return data
    rgb = image.convert("RGB")
  out = io.BytesIO()
  rgb.save(out, format="JPEG", quality=quality)
  return out.getvalue()


@dataclasses.dataclass(frozen=True)
class ImageOptions:
  """image_size: squish side (None keeps images as they are); jpeg_quality of re-encodes."""
  image_size: int | None = IMAGE_SIZE
  jpeg_quality: int = JPEG_QUALITY

  def encode(self, data: bytes) -> bytes:
    if self.image_size is None:
      return verified_image(data, self.jpeg_quality)
    return squish_jpeg(data, self.image_size, self.jpeg_quality)


# ------------------------------------------------------------------------------------------
# Step 1: counting files per class (a Beam job) and choosing classes.


def _error_text(e: Exception) -> str:
  """'Type: message' without memory addresses, so that reports are reproducible."""
  return re.sub(r" at 0x[0-9a-fA-F]+", "", f"{type(e).__name__}: {e}")


def _counter(name: str):
  return beam.metrics.Metrics.counter(COUNTER_NAMESPACE, name)


class _CountClass(beam.DoFn):
  """(index, ClassSource) -> JSON line {'index', 'count', 'error'}; unreadable sources count
  0 files and carry the error (reported, never fatal)."""

  def __init__(self):
    self._listed = _counter("classes_listed")
    self._unreadable = _counter("classes_unreadable")

  def process(self, element):
    index, source = element
    try:
      count, error = len(list_files(source)), ""
    except Exception as e:  # pylint: disable=broad-except
      count, error = 0, _error_text(e)
      self._unreadable.inc()
      logging.warning("Cannot list %s: %s", source.path, error)
    self._listed.inc()
    yield json.dumps({"index": index, "count": count, "error": error})


def pipeline_options_from(beam_options: Sequence[str] | None):
  """A list of Beam command-line flags -> PipelineOptions."""
  return pipeline_options.PipelineOptions(list(beam_options or []))


def count_files(sources: Sequence[ClassSource], work_dir, *, beam_runner=None,
                beam_options: Sequence[str] | None = None) -> list[tuple[int, str]]:
  """(file count, error or '') for every source, by a Beam job writing under work_dir."""
  scratch = epath.Path(work_dir) / f"bigpretrain_scan.{uuid.uuid4().hex}"
  scratch.mkdir(parents=True, exist_ok=True)
  logging.info("Step 1: counting the files of %d classes (Beam job, scratch %s)",
               len(sources), scratch)
  try:
    with beam.Pipeline(runner=beam_runner, options=pipeline_options_from(beam_options)) as p:
      _ = (p
           | "Classes" >> beam.Create(list(enumerate(sources)))
           | "Reshuffle" >> beam.Reshuffle()
           | "Count" >> beam.ParDo(_CountClass())
           | "Write" >> beam.io.WriteToText(str(scratch / "counts"), file_name_suffix=".jsonl"))
    results = {}
    for shard in sorted(scratch.glob("counts*.jsonl")):
      for line in shard.read_text().splitlines():
        if line.strip():
          row = json.loads(line)
          results[row["index"]] = (int(row["count"]), row["error"])
  finally:
    scratch.rmtree(missing_ok=True)
  missing = [sources[i].path for i in range(len(sources)) if i not in results]
  if missing:
    raise RuntimeError(f"The counting job returned nothing for {len(missing)} classes, e.g. "
                       f"{missing[:3]}.")
  return [results[i] for i in range(len(sources))]


@dataclasses.dataclass
class Plan:
  """What the main Beam job needs, decided before it starts.

  classes: class names (label = index), sorted; sources: raw sources of the kept classes;
  splits: the splits to write; val_per_class: for sources with split ''; image: processing;
  metadata: JSON-able dict stored with the dataset.
  """
  classes: list[str]
  sources: list[ClassSource]
  splits: tuple[str, ...]
  val_per_class: int
  image: ImageOptions
  metadata: dict[str, Any]


def choose_classes(sources: Sequence[ClassSource], counts: Sequence[tuple[int, str]],
                   min_images: int) -> tuple[list[str], dict[str, int], dict[str, str]]:
  """-> (kept class names sorted, dropped {name: files}, unreadable {name: error}).

  A class (all its sources together) is kept iff it has more than `min_images` files.
  """
  total, errors = {}, {}
  for source, (count, error) in zip(sources, counts):
    total[source.class_name] = total.get(source.class_name, 0) + count
    if error:
      errors[source.class_name] = error
  kept = sorted(c for c, n in total.items() if n > min_images)
  dropped = {c: total[c] for c in sorted(total) if total[c] <= min_images}
  return kept, dropped, dict(sorted(errors.items()))


# ------------------------------------------------------------------------------------------
# Steps 2-3: the main Beam job.


class _ListClass(beam.DoFn):
  """ClassSource -> one work item per file: (split, label, key, path, offset, size); path is
  the file's, or the tar's for a member."""

  def __init__(self, labels: dict[str, int], val_per_class: int):
    self._labels = labels
    self._val_per_class = val_per_class
    self._files = _counter("files_listed")
    self._unreadable = _counter("classes_unreadable_at_listing")

  def process(self, source: ClassSource):
    try:
      files = list_files(source)
    except Exception as e:  # pylint: disable=broad-except
      self._unreadable.inc()
      yield beam.pvalue.TaggedOutput(_CORRUPT, {
          "file": source.path, "split": source.split or "*",
          "error": f"cannot list: {_error_text(e)}"})
      return
    validation = set()
    if not source.split:
      validation = validation_names(source.class_name, [f[0] for f in files],
                                    self._val_per_class)
    label = self._labels[source.class_name]
    for name, offset, size in files:
      split = source.split or ("validation" if name in validation else "train")
      path = source.path if source.kind == "tar" else str(epath.Path(source.path) / name)
      yield split, label, f"{source.class_name}/{name}", path, offset, size
    self._files.inc(len(files))
    logging.info("Listed %s: %d files (%d to validation)", source.class_name, len(files),
                 len(validation))


class _ProcessImage(beam.DoFn):
  """Work item -> (key, example); unreadable/corrupt files go to the 'corrupt' output."""

  def __init__(self, image: ImageOptions):
    self._image = image
    self._written = _counter("images_written")
    self._corrupt = _counter("corrupt_files")
    self._done = 0

  def process(self, item):
    split, label, key, path, offset, size = item
    try:
      data = self._image.encode(read_file(path, offset, size))
    except Exception as e:  # pylint: disable=broad-except
      # PIL and file systems report bad data through many error types; all mean "skip".
      self._corrupt.inc()
      error = _error_text(e)
      logging.warning("Skipping corrupt file %s: %s", key, error)
      yield beam.pvalue.TaggedOutput(_CORRUPT, {"file": key, "split": split, "error": error})
      return
    self._written.inc()
    self._done += 1
    if self._done % 10000 == 0:
      logging.info("This worker processed %d images (last: %s)", self._done, key)
    yield key, {"image": data, "label": label, "file_name": key}


def _in_split(item, split: str) -> bool:
  return item[0] == split


def _label(key_example) -> int:
  return key_example[1]["label"]


def _tag_split(label_count, split: str):
  label, count = label_count
  return split, int(label), int(count)


def _write_report(_, path: str, counts, corrupt):
  """Writes {'counts': [[split, label, n]...], 'corrupt': [...]} (sorted) to `path`."""
  report = {"counts": sorted([list(c) for c in counts]),
            "corrupt": sorted(corrupt, key=lambda r: (r["file"], r["split"]))}
  with epath.Path(path).open("w") as f:
    json.dump(report, f)


def build_splits(pipeline, plan: Plan, report_path: str) -> dict[str, Any]:
  """Adds the main job to `pipeline`: split name -> PCollection of (key, example). Per-class
  counts and corrupt files go to the JSON at report_path when the pipeline runs."""
  labels = {c: i for i, c in enumerate(plan.classes)}
  listed = (pipeline
            | "Sources" >> beam.Create(plan.sources)
            | "ReshuffleSources" >> beam.Reshuffle()
            | "List" >> beam.ParDo(_ListClass(labels, plan.val_per_class)).with_outputs(
                _CORRUPT, main="items"))
  splits, counts, corrupt = {}, [], [listed[_CORRUPT]]
  for split in plan.splits:
    processed = (listed["items"]
                 | f"{split}/Select" >> beam.Filter(_in_split, split)
                 | f"{split}/Reshuffle" >> beam.Reshuffle()
                 | f"{split}/Process" >> beam.ParDo(_ProcessImage(plan.image)).with_outputs(
                     _CORRUPT, main="examples"))
    splits[split] = processed["examples"]
    corrupt.append(processed[_CORRUPT])
    counts.append(processed["examples"]
                  | f"{split}/Labels" >> beam.Map(_label)
                  | f"{split}/CountLabels" >> beam.combiners.Count.PerElement()
                  | f"{split}/TagSplit" >> beam.Map(_tag_split, split))
  all_counts = counts | "AllCounts" >> beam.Flatten()
  all_corrupt = corrupt | "AllCorrupt" >> beam.Flatten()
  _ = (pipeline
       | "ReportSeed" >> beam.Create([None])
       | "WriteReport" >> beam.Map(_write_report, report_path,
                                   counts=beam.pvalue.AsList(all_counts),
                                   corrupt=beam.pvalue.AsList(all_corrupt)))
  return splits


def _pipeline_counters(pipeline_result) -> dict[str, int]:
  """This module's Beam counters from a finished pipeline ({} if the runner has none)."""
  try:
    query = pipeline_result.metrics().query(
        beam.metrics.MetricsFilter().with_namespace(COUNTER_NAMESPACE))
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("Runner gave no Beam counters: %s", e)
    return {}
  out = {}
  for counter in query["counters"]:
    value = counter.committed if counter.committed is not None else counter.attempted
    out[counter.key.metric.name] = out.get(counter.key.metric.name, 0) + int(value or 0)
  return dict(sorted(out.items()))


class BeamImageBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """tfds builder whose splits come from `build_splits` on a Plan (shared by imagenet21k_p
  and ImageFolder conversions). Built without a plan it can only read prepared files."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First version."}
  IMAGE_ENCODING = "jpeg"

  def __init__(self, *, plan: Plan | None = None, **kwargs):
    self._plan = plan
    super().__init__(**kwargs)

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    # As in demo.py: tfds 4.9.10 cannot find a packaged builder's file on Python >= 3.9.
    return epath.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    plan = self._plan
    label = tfds.features.ClassLabel(names=plan.classes) if plan else tfds.features.ClassLabel()
    return tfds.core.DatasetInfo(
        builder=self,
        description=(self.__doc__ or "").strip(),
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(None, None, 3),
                                         encoding_format=self.IMAGE_ENCODING),
            "label": label,
            "file_name": tfds.features.Text(),
        }),
        supervised_keys=("image", "label"),
        metadata=tfds.core.MetadataDict(plan.metadata if plan else {}),
    )

  def _split_generators(self, dl_manager, pipeline):
    del dl_manager  # Raw paths are in the plan.
    if self._plan is None:
      raise ValueError(f"{self.name}: generating needs a plan; use the module's prepare().")
    return build_splits(pipeline, self._plan, str(epath.Path(self.data_dir) / REPORT_FILE))

  def _generate_examples(self):
    raise NotImplementedError("Splits come from build_splits (a Beam pipeline).")

  def _process_pipeline_result(self, pipeline_result):
    """Folds the pipeline's report and counters into the metadata, and logs a summary."""
    report_path = epath.Path(self.data_dir) / REPORT_FILE
    report = json.loads(report_path.read_text())
    report_path.unlink()
    num_classes = len(self._plan.classes)
    per_split = {s: [0] * num_classes for s in self._plan.splits}
    for split, label, count in report["counts"]:
      per_split[split][label] = count
    meta = self.info.metadata
    meta["class_counts"] = per_split
    meta["corrupt_files"] = report["corrupt"]
    meta["num_corrupt_files"] = len(report["corrupt"])
    meta["counters"] = _pipeline_counters(pipeline_result)
    empty = [c for i, c in enumerate(self._plan.classes)
             if not any(per_split[s][i] for s in per_split)]
    if empty:
      logging.warning("%d kept classes have no readable image: %s", len(empty), empty[:10])
    logging.info("Beam counters: %s", meta["counters"])
    if report["corrupt"]:
      logging.warning("Skipped %d corrupt/unreadable files (listed in the metadata), e.g. %s",
                      len(report["corrupt"]), report["corrupt"][:3])


class Imagenet21kP(BeamImageBuilder):
  """ImageNet-21K-P: ImageNet-21K without classes of 500 or fewer images, a 50-per-class
  validation split, images squished to 224x224 (Ridnik et al., 2021, section 2.1)."""

  name = NAME
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      "Give the raw ImageNet-21K release (winter21 `train/` folders of JPEGs per wnid, or "
      "fall11 one .tar per wnid) as --manual_dir; see input_pipeline/imagenet21k_p.py.")


# ------------------------------------------------------------------------------------------
# Running a preparation (shared with image_folder.py).


def find_prepared(full_name: str, data_dir) -> tfds.core.DatasetBuilder | None:
  """Read-only builder of a finished `full_name` ('name' or 'name/config') in data_dir."""
  try:
    return read_only_builder.builder_from_files(full_name, data_dir=str(data_dir))
  except tfds.core.registered.DatasetNotFoundError:
    return None


def reuse(builder: tfds.core.DatasetBuilder, params: dict[str, Any]) -> None:
  """Checks a finished dataset was made with `params` and says that it is reused."""
  made_with = dict(builder.info.metadata.get("params", {}))
  differ = {k: (made_with.get(k), v) for k, v in params.items()
            if k != "raw_dir" and made_with.get(k) != v}
  if differ:
    raise ValueError(
        f"{builder.data_dir} already holds a dataset prepared with other parameters "
        f"(key: (prepared, requested)): {differ}. Use another --data_dir, or delete that "
        "folder to rebuild it.")
  if made_with.get("raw_dir") != params.get("raw_dir"):
    logging.warning("Reused dataset was prepared from %s, not %s.", made_with.get("raw_dir"),
                    params.get("raw_dir"))
  splits = {s: builder.info.splits[s].num_examples for s in sorted(builder.info.splits.keys())}
  logging.info("Reusing the finished dataset in %s (%s, %d classes); nothing is regenerated. "
               "Delete that folder to rebuild it.", builder.data_dir, splits,
               builder.info.features["label"].num_classes)


def note_incomplete(dataset_dir) -> list[str]:
  """Logs (and returns) `incomplete.*` folders of interrupted runs, which tfds never reads."""
  dataset_dir = epath.Path(dataset_dir)
  if not dataset_dir.is_dir():
    return []
  found = sorted(str(p) for p in dataset_dir.glob("incomplete.*") if p.is_dir())
  if found:
    logging.warning(
        "Ignoring %d folders left by interrupted runs (tfds never reads them; generation "
        "starts over in a fresh one, which is renamed only when complete): %s. They can be "
        "deleted once no other run is writing.", len(found), found)
  return found


def generate(builder: BeamImageBuilder, manual_dir, *, beam_runner=None,
             beam_options: Sequence[str] | None = None) -> BeamImageBuilder:
  """Runs the builder's Beam pipeline (steps 2-3) and returns it."""
  config = tfds.download.DownloadConfig(manual_dir=str(manual_dir), beam_runner=beam_runner,
                                        beam_options=pipeline_options_from(beam_options))
  builder.download_and_prepare(download_config=config, file_format="array_record")
  return builder


def check_params(min_images: int, val_per_class: int, image_size: int | None,
                 jpeg_quality: int) -> None:
  """ValueError naming the first bad preparation parameter."""
  for key, value, low in (("min_images", min_images, 0), ("val_per_class", val_per_class, 0),
                          ("jpeg_quality", jpeg_quality, 1)):
    if int(value) != value or value < low:
      raise ValueError(f"{key}={value!r}; expected an int >= {low}.")
  if jpeg_quality > 100:
    raise ValueError(f"jpeg_quality={jpeg_quality!r}; expected 1..100.")
  if image_size is not None and (int(image_size) != image_size or image_size < 1):
    raise ValueError(f"image_size={image_size!r}; expected a positive int.")


def readable_name(wnid: str) -> str:
  """'n01440764' -> 'tench, Tinca tinca' (the synset's lemmas)."""
  return ", ".join(n.replace("_", " ") for n in wordnet.synset_from_wnid(wnid).lemma_names())


def prepare(manual_dir, data_dir, *, beam_runner=None, beam_options: Sequence[str] | None = None,
            min_images: int = MIN_IMAGES, val_per_class: int = VAL_PER_CLASS,
            image_size: int = IMAGE_SIZE, jpeg_quality: int = JPEG_QUALITY
            ) -> tfds.core.DatasetBuilder:
  """Prepares `imagenet21k_p` in data_dir from the raw release in manual_dir, or reuses it.

  beam_runner: a Beam runner name or object (None: DirectRunner); beam_options: extra Beam
  flags. min_images/val_per_class/image_size/jpeg_quality: steps 1-3 (module docstring).
  Returns a builder to read the dataset with.
  """
  check_params(min_images, val_per_class, image_size, jpeg_quality)
  if image_size is None:
    raise ValueError("imagenet21k_p always squishes images; image_size must be an int.")
  if val_per_class > min_images:
    raise ValueError(f"val_per_class={val_per_class} > min_images={min_images} would leave "
                     "kept classes without train images.")
  params = {"raw_dir": str(manual_dir), "min_images": min_images,
            "val_per_class": val_per_class, "image_size": image_size,
            "jpeg_quality": jpeg_quality}
  prepared = find_prepared(NAME, data_dir)
  if prepared is not None:
    reuse(prepared, params)
    return prepared
  note_incomplete(epath.Path(data_dir) / NAME)
  layout, sources, ignored = detect_layout(manual_dir)
  logging.info("Raw layout: %s, %d classes in %s", layout, len(sources), manual_dir)
  counts = count_files(sources, data_dir, beam_runner=beam_runner, beam_options=beam_options)
  kept, dropped, unreadable = choose_classes(sources, counts, min_images)
  if not kept:
    largest = max(n for n, _ in counts)
    raise ValueError(f"No class in {manual_dir} has more than min_images={min_images} files "
                     f"(largest: {largest}).")
  logging.info("Step 1: keeping %d classes, dropping %d with <= %d files", len(kept),
               len(dropped), min_images)
  count_of = {s.class_name: n for s, (n, _) in zip(sources, counts)}
  tree = tree_lib.SemanticTree.from_wnids(kept)  # Fails now, not after hours, on a bad wnid.
  metadata = {
      "params": params,
      "layout": layout,
      "classes": kept,
      "names": [readable_name(w) for w in kept],
      "listed_counts": [count_of[w] for w in kept],
      "dropped_classes": dropped,
      "unreadable_classes": unreadable,
      "ignored_entries": ignored,
      "split_rule": "validation = the val_per_class files with the smallest "
                    "sha256('wnid/name') hex digest (ties by name); the rest train",
      "semantic_tree": json.loads(tree.to_json()),
  }
  splits = ("train", "validation") if val_per_class else ("train",)
  kept_set = set(kept)
  plan = Plan(classes=kept, sources=[s for s in sources if s.class_name in kept_set],
              splits=splits, val_per_class=val_per_class,
              image=ImageOptions(image_size, jpeg_quality), metadata=metadata)
  builder = Imagenet21kP(data_dir=str(data_dir), plan=plan, file_format="array_record")
  return generate(builder, manual_dir, beam_runner=beam_runner, beam_options=beam_options)


def report(builder: tfds.core.DatasetBuilder) -> dict[str, Any]:
  """The preparation metadata of a prepared dataset (see the module docstring)."""
  return dict(builder.info.metadata or {})


def semantic_tree(builder: tfds.core.DatasetBuilder) -> tree_lib.SemanticTree:
  """The semantic tree stored with a prepared imagenet21k_p."""
  data = report(builder).get("semantic_tree")
  if data is None:
    raise ValueError(f"No semantic tree in the metadata of {builder.data_dir}.")
  return tree_lib.SemanticTree.from_json(json.dumps(data))
