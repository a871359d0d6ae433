"""The Beam image job every preparation shares: raw class sources (folders or tars) -> a tfds
ArrayRecord dataset, used by ImageNet-21K-P (imagenet21k_p.py) and ImageFolder conversions
(image_folder.py).

Step 1 counts each class's files in a small Beam job (listing the tars of a 1.3 TB release is
real work) so the caller can choose classes. Steps 2-3 are the Beam pipeline of a
`BeamImageBuilder`: files split by a name-hash rule (`validation_names`), images squished or
re-encoded (`ImageOptions`), corrupt files skipped and reported in the metadata with their
error, never fatal. Beam counters (namespace COUNTER_NAMESPACE) are logged at the end and
kept in the metadata. `generate` runs it on any Beam runner; `find_prepared`, `reuse` and
`note_incomplete` make re-running a finished or interrupted preparation safe.

Names: a file name that is not UTF-8 (latin-1 b'caf\\xe9.jpg') is read as any other and stored
with those bytes as \\xNN (decoding.text_name: the text caf\\xe9.jpg). A member name a tar holds
twice is read from its last copy, as extraction leaves it; each earlier copy is skipped and
reported with the corrupt files.
"""
import dataclasses
import hashlib
import io
import json
import os
import re
import tarfile
import uuid
from typing import Any, Iterable, Iterator, Sequence

from absl import logging
import apache_beam as beam
from apache_beam.options import pipeline_options
from etils import epath
from PIL import Image
import tensorflow_datasets as tfds
from tensorflow_datasets.core import read_only_builder

from input_pipeline import decoding
from input_pipeline.jobs import local_runner

IMAGE_SIZE = 224
JPEG_QUALITY = 75
# How min_images is read (stored with a prepared dataset's parameters, so that one prepared
# under the earlier "more than min_images" rule is not reused as if it were the same).
CLASS_RULE = "files >= min_images"
COUNTER_NAMESPACE = "bigpretrain_images"  # Beam counters of every job in this module.
REPORT_FILE = "preparation_report.json"  # Written by the pipeline, folded into the metadata.
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


def list_files(source: ClassSource) -> list[tuple[str, int, int]]:
  """Image files of a class as (name, offset, size), sorted by name, each name once.

  Folder: regular non-hidden files inside, at any depth (torchvision's ImageFolder walks
  sub-folders too; a name is its path under the class folder), offset = size = -1 (read
  whole).
  Tar: regular members, name without a leading './', offset/size of the member's data; a name
  held more than once is its last copy (what extraction leaves, and tarfile.getmember's
  choice). Files with a non-image extension (decoding.is_non_image) are left out and logged.
  """
  return _list_files(source)[0]


def _list_files(source: ClassSource) -> tuple[list[tuple[str, int, int]], list[str]]:
  """(list_files(source), the names of the earlier copies of repeated tar members it left
  out, one entry per copy)."""
  path = epath.Path(source.path)
  replaced = []
  if source.kind == "dir":
    files = sorted((name, -1, -1) for name in _folder_files(path))
  elif source.kind == "tar":
    members = {}
    with path.open("rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
      for member in tar:
        if member.isreg():
          name = member.name[2:] if member.name.startswith("./") else member.name
          if name in members:
            replaced.append(name)
          members[name] = (member.offset_data, member.size)
    files = sorted((name, *place) for name, place in members.items())
  else:
    raise ValueError(f"Unknown class source kind {source.kind!r} for {source.path}.")
  ignored = [f[0] for f in files if decoding.is_non_image(f[0])]
  if ignored:
    logging.info("Ignoring %d non-image files of %s: %s", len(ignored), source.path,
                 ignored[:5])
  replaced = sorted(n for n in replaced if not decoding.is_non_image(n))
  if replaced:
    logging.warning("%s: %d members repeat an earlier member's name (e.g. %s); each name is "
                    "read from its last copy, as extraction leaves it", source.path,
                    len(replaced), replaced[:5])
  return [f for f in files if not decoding.is_non_image(f[0])], replaced


def _folder_files(folder: epath.Path, prefix: str = "") -> Iterator[str]:
  """Names (paths under the first `folder`) of the regular non-hidden files at any depth;
  hidden folders are not entered."""
  for p in folder.iterdir():
    if p.name.startswith("."):
      continue
    if p.is_dir():
      yield from _folder_files(p, f"{prefix}{p.name}/")
    elif p.is_file():
      yield prefix + p.name


def read_file(path: str | bytes, offset: int, size: int) -> bytes:
  """Bytes of a listed file: the whole file (offset -1) or `size` bytes at `offset`. A path
  may be bytes (os.fsencode), as for names that are not UTF-8."""
  with epath.Path(os.fsdecode(path)).open("rb") as f:
    if offset < 0:
      return f.read()
    f.seek(offset)
    data = f.read(size)
  if len(data) != size:
    raise OSError(f"tar member truncated: {len(data)} of {size} bytes at offset {offset}")
  return data


def validation_names(class_name: str, names: Iterable[str], val_per_class: int) -> set[str]:
  """The hash rule: the `val_per_class` names with the smallest sha256('class/name') hex
  digest (ties by name) go to validation. The string is hashed as UTF-8, or as the name's own
  bytes where it is not UTF-8."""
  def rank(name):
    data = f"{class_name}/{name}".encode("utf-8", "surrogateescape")
    return hashlib.sha256(data).hexdigest(), name
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
    rgb = decoding.to_rgb(image)
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
    if image.format in ("JPEG", "PNG"):  # 16-bit PNGs too: decoding.to_rgb scales them.
      return data
    rgb = decoding.to_rgb(image)
  out = io.BytesIO()
  rgb.save(out, format="JPEG", quality=quality)
  return out.getvalue()


def check_declared_size(data: bytes, max_pixels: int) -> None:
  """Raises Image.DecompressionBombError if the header declares more than max_pixels pixels:
  read before any pixel is decoded, since a tiny file can declare a huge image."""
  with Image.open(io.BytesIO(data)) as image:  # PIL itself refuses > 2 MAX_IMAGE_PIXELS.
    width, height = image.size
  if width * height > max_pixels:
    raise Image.DecompressionBombError(
        f"image declares {width} x {height} = {width * height} pixels, more than the limit "
        f"{max_pixels}")


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
    with beam.Pipeline(runner=local_runner.runner_or_local(beam_runner),
                       options=pipeline_options_from(beam_options)) as p:
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

  A class (all its sources together) is kept iff it has at least `min_images` files.
  """
  total, errors = {}, {}
  for source, (count, error) in zip(sources, counts):
    total[source.class_name] = total.get(source.class_name, 0) + count
    if error:
      errors[source.class_name] = error
  kept = sorted(c for c, n in total.items() if n >= min_images)
  dropped = {c: total[c] for c in sorted(total) if total[c] < min_images}
  return kept, dropped, dict(sorted(errors.items()))


# ------------------------------------------------------------------------------------------
# Steps 2-3: the main Beam job.


class _ListClass(beam.DoFn):
  """ClassSource -> one work item per file: (split, label, key, path, offset, size); path is
  the file's (bytes, since a name need not be UTF-8), or the tar's for a member; key is
  'class/name' as text (decoding.text_name)."""

  def __init__(self, labels: dict[str, int], val_per_class: int):
    self._labels = labels
    self._val_per_class = val_per_class
    self._files = _counter("files_listed")
    self._unreadable = _counter("classes_unreadable_at_listing")
    self._duplicates = _counter("duplicate_tar_members")

  def process(self, source: ClassSource):
    try:
      files, replaced = _list_files(source)
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
    for name in replaced:  # Skipped and reported, as a corrupt file is.
      self._duplicates.inc()
      yield beam.pvalue.TaggedOutput(_CORRUPT, {
          "file": f"{source.class_name}/{decoding.text_name(name)}",
          "split": source.split or ("validation" if name in validation else "train"),
          "error": f"duplicate tar member: an earlier copy in {source.path}, skipped for "
                   "the last one (as extraction leaves it)"})
    for name, offset, size in files:
      split = source.split or ("validation" if name in validation else "train")
      path = (source.path if source.kind == "tar"
              else os.fsencode(str(epath.Path(source.path) / name)))
      yield split, label, f"{source.class_name}/{decoding.text_name(name)}", path, offset, size
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
  logging.info("Reusing the finished dataset in %s (%s examples); nothing is regenerated. "
               "Delete that folder to rebuild it.", builder.data_dir, splits)


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
  config = tfds.download.DownloadConfig(
      manual_dir=str(manual_dir), beam_runner=local_runner.runner_or_local(beam_runner),
      beam_options=pipeline_options_from(beam_options))
  try:
    builder.download_and_prepare(download_config=config, file_format="array_record")
  except (RuntimeError, ValueError) as e:  # tfds' own check, raised through Beam.
    empty = _EMPTY_SPLIT.search(str(e))
    if empty is None:
      raise
    raise ValueError(f"No image of split {empty.group(1)!r} under {manual_dir} could be read: "
                     "every one was skipped as corrupt or unreadable (the warnings above name "
                     "them).") from e
  return builder


_EMPTY_SPLIT = re.compile(r"total number of generated examples is 0 for split (\S+)\.")


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
