"""SWAG hashtag datasets (Singh et al. 2022, section 3.1, appendix A) built by an Apache Beam job.

  python -m input_pipeline.prepare hashtags --manual_dir=RAW --data_dir=OUT [--name=NAME] \
      [--min_count=1] [--min_raw_count=2] [--tail_threshold=5000] [--image_size=keep] \
      [--max_pixels=67108864] [--beam_runner=...]

Inputs: WebDataset shards and JSONL/Parquet manifests under RAW (crawl_inputs.py documents
the layouts, the accepted tag keys and how splits are found). The job:
  1. reads every input (tar members in memory, never extracted) into samples of raw tags;
  2. counts each raw tag's train images (every train sample read, before its image is
     checked) and keeps the tags in at least `min_raw_count` of them (the paper keeps
     hashtags "used more than once": 2);
  3. canonicalises each DISTINCT kept tag once (bigpretrain.swag.vocabulary, Listing 1),
     and hands the tag -> label map to the samples as a side input (only tags with a label,
     a small share of a crawl's tags);
  4. drops train images left with no label, then reads, checks and (optionally) resizes the
     images: over MAX_IMAGE_BYTES, a header declaring more than `max_pixels` pixels (checked
     before decoding), missing, truncated or undecodable files are skipped;
  5. counts each canonical label's train images and keeps labels in at least `min_count`
     (the vocabulary, sorted: id = index); train images left with no kept label are dropped.
     Other splits keep every image, labelled or not, so an evaluation split stays whole
     (the soft_target metrics count only labelled images); their labels map through the
     train vocabulary.
Every rejected sample is counted under one reason, with the first SKIP_EXAMPLES places
(sorted) as examples, in the metadata's "skipped" (and as Beam counters): the counts add up to
the samples rejected, and no error in the data is fatal or silent. Tags left out of a sample
that is kept (not UTF-8) are counted apart, in "dropped_tags". An
empty vocabulary is an error that names min_count.

Output: the tfds dataset `bigpretrain_hashtags/NAME` (ArrayRecord) with features 'image'
(the original JPEG/PNG bytes, or squished JPEG with --image_size), 'hashtag_ids' (the sorted
vocabulary ids: a padded id list on the host, never a dense multi-hot), 'hashtags' (the raw
tags) and 'file_name'; metadata: 'vocabulary' ([{label, synsets, raw_hashtags {tag: train
images}, images}] in id order), head/tail statistics at 'tail_threshold' (paper: 5,000), raw
tag counts, 'max_lengths' and the parameters. Read it with `config.data.name=hashtags:NAME`,
`config.data.dir=OUT` (hashtag_source.py). After the Beam job, `prepare` stores each split's id
lists in `hashtag_ids-SPLIT.npz` beside the shards, so that the resampler's importance is
computed without reading every record on every host.

Runner options, ArrayRecord writing, reuse of a finished dataset and leftovers of interrupted
runs are the shared image job's (beam_images.py).
"""
import dataclasses
import json
from typing import Any, Sequence

from absl import logging
import apache_beam as beam
from etils import epath
import numpy as np
from PIL import Image
import tensorflow_datasets as tfds

from bigpretrain.swag import vocabulary
from input_pipeline.jobs import beam_images as job
from input_pipeline.jobs import crawl_inputs
from input_pipeline.sources import hashtag_source

BUILDER_NAME = hashtag_source.BUILDER_NAME
FIELD = hashtag_source.FIELD
MIN_COUNT = 1  # Canonical labels: the paper filters raw hashtags only (section 3.1).
MIN_RAW_COUNT = 2  # Section 3.1: hashtags "used more than once".
TAIL_THRESHOLD = 5000  # Appendix A: the head is hashtags in at least 5,000 images.
MAX_PIXELS = 1 << 26  # 8192 x 8192; decoding that much RGB takes 192 MiB.
MAX_IMAGE_BYTES = 1 << 26  # 64 MiB; larger files are skipped unread.
SKIP_EXAMPLES = 20
LABEL_INDEX = hashtag_source.LABEL_INDEX
_SKIP = "skip"  # Tag of the skip side outputs.
_DROPPED = "dropped_tag"  # Tag of the dropped-tag side output.
SPLIT_ORDER = ("train", "validation", "test")


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the Beam job needs, fixed before it starts."""
  inputs: tuple[crawl_inputs.InputFile, ...]
  splits: tuple[str, ...]
  min_count: int
  min_raw_count: int
  tail_threshold: int
  image: job.ImageOptions
  max_pixels: int
  metadata: dict[str, Any]


# ------------------------------------------------------------------------------------------
# Beam steps.


def _skip(reason: str, where: str, error: str = ""):
  job._counter(f"skipped_{reason}").inc()  # pylint: disable=protected-access
  if error:
    logging.warning("Skipping %s (%s): %s", where, reason, error)
  return beam.pvalue.TaggedOutput(_SKIP, (reason, where))


class _Read(beam.DoFn):
  """InputFile -> Samples; Skips (and unreadable inputs) to the skip output, DroppedTags
  (reasons) to the dropped-tag output."""

  def process(self, f: crawl_inputs.InputFile):
    try:
      for item in crawl_inputs.read_input(f):
        if isinstance(item, crawl_inputs.DroppedTag):
          job._counter(f"dropped_tags_{item.reason}").inc()  # pylint: disable=protected-access
          yield beam.pvalue.TaggedOutput(_DROPPED, item.reason)
        elif isinstance(item, crawl_inputs.Skip):
          yield _skip(item.reason, item.where, item.error)
        else:
          job._counter("samples_read").inc()  # pylint: disable=protected-access
          yield item
    except Exception as e:  # pylint: disable=broad-except
      # A truncated or foreign file: what was read before the error is kept.
      yield _skip("unreadable_input", f.relpath, job._error_text(e))  # pylint: disable=protected-access


def _train_tags(sample: crawl_inputs.Sample):
  return sample.tags if sample.split == "train" else ()


def _canonical(tag_count, min_raw_count: int):
  """(raw tag, train images) -> (tag, canonical label, images) for kept tags with a label:
  runs once per distinct tag."""
  tag, count = tag_count
  if count >= min_raw_count:
    label = vocabulary.canonical_hashtag(tag)
    if label is not None:
      yield tag, label, int(count)


def _as_pair(entry):
  return entry[0], entry[1]


class _Label(beam.DoFn):
  """Sample -> (sample, sorted distinct canonical labels); unlabelled train samples skipped."""

  def process(self, sample: crawl_inputs.Sample, canonical: dict[str, str]):
    labels = tuple(sorted({canonical[t] for t in sample.tags if t in canonical}))
    if not labels and sample.split == "train":
      yield _skip("no_label", sample.name)
      return
    yield sample, labels


def _read_image(sample: crawl_inputs.Sample) -> bytes:
  if sample.data is not None:
    data = sample.data
  else:
    size = sample.size if sample.offset >= 0 else epath.Path(sample.path).stat().length
    if size > MAX_IMAGE_BYTES:
      raise _TooLarge(f"{size} bytes, more than {MAX_IMAGE_BYTES}")
    data = job.read_file(sample.path, sample.offset, sample.size)
  if len(data) > MAX_IMAGE_BYTES:
    raise _TooLarge(f"{len(data)} bytes, more than {MAX_IMAGE_BYTES}")
  return data


class _TooLarge(ValueError):
  pass


class _Image(beam.DoFn):
  """(sample, labels) -> (sample without inline bytes, labels, checked image bytes)."""

  def __init__(self, image: job.ImageOptions, max_pixels: int):
    self._image = image
    self._max_pixels = max_pixels

  def process(self, element):
    sample, labels = element
    try:
      data = _read_image(sample)
      job.check_declared_size(data, self._max_pixels)
      data = self._image.encode(data)
    except Exception as e:  # pylint: disable=broad-except
      # PIL and file systems report bad data through many error types; all mean "skip".
      if isinstance(e, FileNotFoundError):
        reason = "missing_image"
      elif isinstance(e, _TooLarge):
        reason = "image_too_large"
      elif isinstance(e, Image.DecompressionBombError):
        reason = "decompression_bomb"
      else:
        reason = "corrupt_image"
      yield _skip(reason, sample.name, job._error_text(e))  # pylint: disable=protected-access
      return
    yield dataclasses.replace(sample, data=None), labels, data


def _train_labels(element):
  sample, labels, _ = element
  return labels if sample.split == "train" else ()


def _index(counts):
  """[(label, train images)] -> [(label, (id, images))], ids in sorted label order."""
  return [(label, (i, n)) for i, (label, n) in enumerate(sorted(counts))]


class _ToExample(beam.DoFn):
  """(sample, labels, image) -> (split, (uid, tfds example)); stats (name, n) to the 'stats' output."""

  def __init__(self, tail_threshold: int):
    self._tail_threshold = tail_threshold

  def process(self, element, index: dict[str, tuple[int, int]]):
    sample, labels, image = element
    kept = [index[l] for l in labels if l in index]
    if not kept and sample.split == "train":
      yield _skip("no_label", sample.name)
      return
    ids = sorted(i for i, _ in kept)
    if sample.split == "train":
      tail = min(n for _, n in kept) < self._tail_threshold
      yield beam.pvalue.TaggedOutput("stats", ("tail_images" if tail else "head_images", 1))
    yield beam.pvalue.TaggedOutput("stats", (f"max_labels/{sample.split}", len(ids)))
    job._counter("images_written").inc()  # pylint: disable=protected-access
    yield sample.split, (sample.uid, {"image": image, FIELD: np.asarray(ids, np.int32),
                                      "hashtags": list(sample.tags), "file_name": sample.name})


def _in_split(element, split: str, vocabulary_checked) -> bool:
  del vocabulary_checked  # A side input, so that an empty vocabulary fails before writing.
  return element[0] == split


def _drop_split(element):
  return element[1]


def _check_vocabulary(_, counts, min_count: int, skip_counts):
  if not counts:
    skipped = dict(sorted(skip_counts))
    raise ValueError(
        f"The hashtag vocabulary is empty: no canonical hashtag is in at least "
        f"min_count={min_count} train images. "
        + (f"Skipped on the way (by reason): {skipped}, each named in a WARNING line above; "
           "if they are most of the inputs, that is the cause. " if skipped else "")
        + "Lower --min_count (or --min_raw_count), or check that the inputs carry tags "
        "(crawl_inputs.py lists the accepted layouts).")


def _report(_, path: str, counts, canonical, raw_stats, skip_counts, skip_examples, stats,
            params: dict[str, Any], dropped_tags=()):
  """Writes the report the builder folds into the metadata (vocabulary, stats, skips)."""
  raw = {}
  for tag, label, n in canonical:
    raw.setdefault(label, {})[tag] = n
  vocab = [{"label": label, "synsets": list(vocabulary.label_synsets(label)),
            "raw_hashtags": dict(sorted(raw.get(label, {}).items())), "images": int(n)}
           for label, n in sorted(counts)]
  totals = {}
  for name, value in stats:
    if name.startswith("max_labels/"):
      totals[name] = max(totals.get(name, 0), int(value))
    else:
      totals[name] = totals.get(name, 0) + int(value)
  threshold = params["tail_threshold"]
  head = sum(1 for v in vocab if v["images"] >= threshold)
  report = {
      "vocabulary": vocab,
      "raw_tags": dict(sorted(raw_stats)),
      "head_tail": {"tail_threshold": threshold, "head_labels": head,
                    "tail_labels": len(vocab) - head,
                    "head_images": totals.get("head_images", 0),
                    "tail_images": totals.get("tail_images", 0)},
      "max_labels": {k.split("/", 1)[1]: v for k, v in sorted(totals.items())
                     if k.startswith("max_labels/")},
      "skipped": dict(sorted(skip_counts)),
      "skipped_examples": {r: sorted(w) for r, w in sorted(skip_examples)},
      "dropped_tags": dict(sorted(dropped_tags)),
  }
  with epath.Path(path).open("w") as f:
    json.dump(report, f)


def _count_stat(name: str):
  def make(pcoll):
    return pcoll | f"Count{name}" >> beam.combiners.Count.Globally() | f"Tag{name}" >> beam.Map(
        lambda n: (name, int(n)))
  return make


def build_splits(pipeline, plan: Plan, report_path: str) -> dict[str, Any]:
  """Adds the job to `pipeline`: split name -> PCollection of (uid, example); the report goes
  to report_path when the pipeline runs."""
  read = (pipeline
          | "Inputs" >> beam.Create(list(plan.inputs))
          | "ReshuffleInputs" >> beam.Reshuffle()
          | "Read" >> beam.ParDo(_Read()).with_outputs(_SKIP, _DROPPED, main="samples"))
  samples = read["samples"]
  tag_counts = (samples
                | "TrainTags" >> beam.FlatMap(_train_tags)
                | "CountTags" >> beam.combiners.Count.PerElement())
  canonical = tag_counts | "Canonicalise" >> beam.FlatMap(_canonical, plan.min_raw_count)
  labelled = samples | "Label" >> beam.ParDo(
      _Label(), canonical=beam.pvalue.AsDict(canonical | "TagToLabel" >> beam.Map(_as_pair))
  ).with_outputs(_SKIP, main="labelled")
  images = (labelled["labelled"]
            | "ReshuffleImages" >> beam.Reshuffle()
            | "Images" >> beam.ParDo(_Image(plan.image, plan.max_pixels)).with_outputs(
                _SKIP, main="images"))
  counts = (images["images"]
            | "TrainLabels" >> beam.FlatMap(_train_labels)
            | "CountLabels" >> beam.combiners.Count.PerElement()
            | "MinCount" >> beam.Filter(lambda c, m: c[1] >= m, plan.min_count))
  index = (pipeline
           | "IndexSeed" >> beam.Create([None])
           | "Index" >> beam.FlatMap(lambda _, c: _index(c), beam.pvalue.AsList(counts)))
  examples = images["images"] | "ToExamples" >> beam.ParDo(
      _ToExample(plan.tail_threshold), index=beam.pvalue.AsDict(index)).with_outputs(
          _SKIP, "stats", main="examples")
  skips = ([read[_SKIP], labelled[_SKIP], images[_SKIP], examples[_SKIP]]
           | "AllSkips" >> beam.Flatten())
  skip_counts = skips | "SkipReasons" >> beam.Map(lambda s: (s[0], 1)) | (
      "CountSkips" >> beam.CombinePerKey(sum))
  checked = (pipeline
             | "CheckSeed" >> beam.Create([None])
             | "CheckVocabulary" >> beam.Map(_check_vocabulary, beam.pvalue.AsList(counts),
                                             plan.min_count, beam.pvalue.AsList(skip_counts)))
  splits = {}
  for split in plan.splits:
    splits[split] = (examples["examples"]
                     | f"{split}/Select" >> beam.Filter(_in_split, split,
                                                        beam.pvalue.AsSingleton(checked))
                     | f"{split}/Unkey" >> beam.Map(_drop_split))
  skip_examples = skips | "SkipExamples" >> beam.combiners.Top.SmallestPerKey(SKIP_EXAMPLES)
  dropped_tags = read[_DROPPED] | "DroppedReasons" >> beam.Map(lambda r: (r, 1)) | (
      "CountDropped" >> beam.CombinePerKey(sum))
  raw_stats = [
      _count_stat("distinct_train_tags")(tag_counts),
      _count_stat("kept_train_tags")(
          tag_counts | "KeptTags" >> beam.Filter(lambda c, m: c[1] >= m, plan.min_raw_count)),
      _count_stat("labelled_train_tags")(canonical),
      _count_stat("canonical_labels")(
          canonical | "Labels" >> beam.Map(lambda e: e[1]) | "DistinctLabels" >> beam.Distinct()),
  ] | "RawStats" >> beam.Flatten()
  params = {"min_count": plan.min_count, "tail_threshold": plan.tail_threshold}
  _ = (pipeline
       | "ReportSeed" >> beam.Create([None])
       | "WriteReport" >> beam.Map(
           _report, report_path, counts=beam.pvalue.AsList(counts),
           canonical=beam.pvalue.AsList(canonical), raw_stats=beam.pvalue.AsList(raw_stats),
           skip_counts=beam.pvalue.AsList(skip_counts),
           skip_examples=beam.pvalue.AsList(skip_examples),
           dropped_tags=beam.pvalue.AsList(dropped_tags),
           stats=beam.pvalue.AsList(examples["stats"]), params=params))
  return splits


# ------------------------------------------------------------------------------------------
# The tfds builder and the entry point.


class BigpretrainHashtags(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """A hashtag dataset made by input_pipeline/jobs/hashtag_job.py; config name = NAME."""

  name = BUILDER_NAME
  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First version."}
  MANUAL_DOWNLOAD_INSTRUCTIONS = "Give the crawled shards and manifests as --manual_dir."

  def __init__(self, *, plan: Plan | None = None, **kwargs):
    self._plan = plan
    super().__init__(**kwargs)

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    # As in demo.py: tfds 4.9.10 cannot find a packaged builder's file on Python >= 3.9.
    return epath.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=(self.__doc__ or "").strip(),
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(None, None, 3), encoding_format=None),
            FIELD: tfds.features.Tensor(shape=(None,), dtype=np.int32),
            "hashtags": tfds.features.Sequence(tfds.features.Text()),
            "file_name": tfds.features.Text(),
        }),
        metadata=tfds.core.MetadataDict(self._plan.metadata if self._plan else {}),
    )

  def _split_generators(self, dl_manager, pipeline):
    del dl_manager  # Raw paths are in the plan.
    if self._plan is None:
      raise ValueError(f"{self.name}: generating needs a plan; use hashtag_job.prepare().")
    return build_splits(pipeline, self._plan, str(epath.Path(self.data_dir) / job.REPORT_FILE))

  def _generate_examples(self):
    raise NotImplementedError("Splits come from build_splits (a Beam pipeline).")

  def _process_pipeline_result(self, pipeline_result):
    """Folds the pipeline's report and counters into the metadata, and logs a summary."""
    report_path = epath.Path(self.data_dir) / job.REPORT_FILE
    report = json.loads(report_path.read_text())
    report_path.unlink()
    meta = self.info.metadata
    meta.update(report)
    meta["max_lengths"] = {FIELD: max(report["max_labels"].values(), default=0)}
    meta["counters"] = job._pipeline_counters(pipeline_result)  # pylint: disable=protected-access
    logging.info("Vocabulary: %d labels (%d head, %d tail at %d train images)",
                 len(report["vocabulary"]), report["head_tail"]["head_labels"],
                 report["head_tail"]["tail_labels"], report["head_tail"]["tail_threshold"])
    if report["skipped"]:
      logging.warning("Skipped (by reason): %s; examples in the metadata.", report["skipped"])


def check_params(min_count: int, min_raw_count: int, tail_threshold: int,
                 max_pixels: int) -> None:
  """ValueError naming the first bad parameter."""
  for key, value, low in (("min_count", min_count, 1), ("min_raw_count", min_raw_count, 1),
                          ("tail_threshold", tail_threshold, 0), ("max_pixels", max_pixels, 1)):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      raise ValueError(f"{key}={value!r}; expected an int >= {low}.")


def label_index_path(builder, split: str) -> epath.Path:
  return epath.Path(builder.data_dir) / LABEL_INDEX.format(split=split)


def write_label_index(builder, split: str, batch: int = 1024) -> epath.Path:
  """Stores the split's id lists in record order ('ids' int32 flat, 'offsets' int64 [N + 1])
  beside the shards: the resampler needs every train image's labels, and reading them from
  the records would read every image on every host."""
  source = builder.as_data_source(split, decoders={"image": tfds.decode.SkipDecoding()})
  lengths, ids = [], []
  for start in range(0, len(source), batch):
    for record in source.__getitems__(range(start, min(start + batch, len(source)))):
      lengths.append(len(record[FIELD]))
      ids.append(np.asarray(record[FIELD], np.int32))
  offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
  flat = np.concatenate(ids) if ids else np.zeros((0,), np.int32)
  path = label_index_path(builder, split)
  tmp = path.with_name(f"{path.name}.tmp.npz")
  with tmp.open("wb") as f:
    np.savez(f, ids=flat.astype(np.int32), offsets=offsets)
  tmp.replace(path)  # Readers never see half a file.
  return path


def _write_label_indexes(builder) -> None:
  for split in sorted(builder.info.splits.keys()):
    if not label_index_path(builder, split).exists():
      write_label_index(builder, split)


def prepare(manual_dir, data_dir, name: str, *, min_count: int = MIN_COUNT,
            min_raw_count: int = MIN_RAW_COUNT, tail_threshold: int = TAIL_THRESHOLD,
            image_size: int | None = None, jpeg_quality: int = job.JPEG_QUALITY,
            max_pixels: int = MAX_PIXELS, beam_runner=None,
            beam_options: Sequence[str] | None = None) -> tfds.core.DatasetBuilder:
  """Builds `bigpretrain_hashtags/NAME` in data_dir from manual_dir (or reuses a finished
  one); returns a builder to read it with."""
  check_params(min_count, min_raw_count, tail_threshold, max_pixels)
  job.check_params(0, 0, image_size, jpeg_quality)
  params = {"raw_dir": str(manual_dir), "min_count": min_count,
            "min_raw_count": min_raw_count, "tail_threshold": tail_threshold,
            "image_size": image_size, "jpeg_quality": jpeg_quality, "max_pixels": max_pixels}
  full_name = f"{BUILDER_NAME}/{name}"
  prepared = job.find_prepared(full_name, data_dir)
  if prepared is not None:
    job.reuse(prepared, params)
    _write_label_indexes(prepared)
    return prepared
  job.note_incomplete(epath.Path(data_dir) / BUILDER_NAME / name)
  inputs = crawl_inputs.find_inputs(manual_dir)
  splits = set()
  for f in inputs:
    splits |= crawl_inputs.splits_of(f)
  plan = Plan(inputs=tuple(inputs), splits=tuple(s for s in SPLIT_ORDER if s in splits),
              min_count=min_count, min_raw_count=min_raw_count, tail_threshold=tail_threshold,
              image=job.ImageOptions(image_size, jpeg_quality), max_pixels=max_pixels,
              metadata={"params": params, "inputs": [f.relpath for f in inputs]})
  if "train" not in plan.splits:
    raise ValueError(f"No train input under {manual_dir}: the vocabulary comes from the "
                     "train split (inputs outside split folders are train).")
  config = tfds.core.BuilderConfig(name=name, description=f"Hashtag dataset from {manual_dir}.")
  builder = BigpretrainHashtags(data_dir=str(data_dir), config=config, plan=plan,
                                file_format="array_record")
  job.generate(builder, manual_dir, beam_runner=beam_runner, beam_options=beam_options)
  _write_label_indexes(builder)
  return builder


def summary(builder) -> str:
  """Human-readable summary of a prepared hashtag dataset."""
  meta = dict(builder.info.metadata)
  splits = {s: builder.info.splits[s].num_examples for s in sorted(builder.info.splits.keys())}
  vocab, head_tail = meta["vocabulary"], meta["head_tail"]
  top = sorted(vocab, key=lambda v: (-v["images"], v["label"]))[:5]
  return "\n".join([
      f"Dataset {builder.info.full_name} in {builder.data_dir}",
      f"  examples: {splits}",
      f"  vocabulary: {len(vocab)} canonical hashtags from {meta['raw_tags']} raw train tags;"
      f" most frequent: {[(v['label'], v['images']) for v in top]}",
      f"  head/tail at {head_tail['tail_threshold']} images: {head_tail}",
      f"  skipped (by reason): {meta['skipped']}",
      f"  tags dropped (by reason): {meta.get('dropped_tags', {})}",
      f"  full report: {builder.data_dir}/metadata.json",
  ])
