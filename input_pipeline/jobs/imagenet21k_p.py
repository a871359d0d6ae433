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
  1. Classes with fewer than `min_images` (500) listed files are dropped ("removing
     infrequent classes, with less than 500 labels"); a class with 500 or more is kept
     (corrupt files included in that count, as they are files of the release). Dropped wnids
     and their counts go to the metadata. This follows the paper's text; the authors' script
     (github.com/Alibaba-MIIL/ImageNet21K, dataset_preprocessing/processing_script.sh) keeps
     `count -gt 500`, more than 500, and notes 11,221 classes: --min_images=501 reproduces it.
  2. Validation split, `val_per_class` (50) images per kept class. The rule: rank the class's
     files by sha256 of the UTF-8 string 'wnid/name' (hex digest, ties by name) and send the
     first 50 to `validation`, the rest to `train`. It depends on the file names only, so the
     same input gives the same split on any runner, worker count or layout (folder or tar).
     A corrupt file is skipped where the rule put it, not replaced, so such a class has
     fewer than 50 validation images. A name that is not UTF-8 is hashed as its own bytes
     and stored with them as \\xNN (latin-1 b'caf\\xe9.JPEG' -> the text caf\\xe9.JPEG).
  3. Squish-resize to 224x224 (aspect ratio not kept); images whose longer side is already
     below 224 keep their size (never upscaled); everything is re-encoded as RGB JPEG at
     `jpeg_quality` (default 75, PIL's default; the paper's ~250 GB for 12.4M images is
     about 20 KB an image).

Metadata (`builder.info.metadata`, stored in metadata.json next to the shards; `report(builder)`
reads it back): the class list (wnids, index = label), readable names (WordNet lemmas), per-class
counts per split, dropped classes with counts, the semantic tree of the kept classes
(`SemanticTree.from_wnids`, as `semantic_tree(builder)`), and every corrupt or unreadable file
with its error: those are skipped and counted, never fatal, never silent.

Engine (input_pipeline/jobs/beam_images.py, shared with ImageFolder conversions): step 1 is a small Beam job (counting each class's files in parallel: listing tars of a
1.3 TB release is real work), steps 2-3 are the Beam pipeline of the tfds builder (tfds's
Beam path writes ArrayRecord without TensorFlow). Both run on Beam's local FnApiRunner by
default, or on any runner given by `beam_runner`; extra Beam options (`--project=...`,
`--direct_num_workers=4`, `--setup_file=./setup.py` for remote workers) are passed through.
Progress: tfds progress bars, per-class log lines, and Beam counters, logged at the end.
Memory: the local runner keeps PCollections in memory, and tfds's deterministic writer groups
all encoded examples by shard, so a one-machine run holds the output (~20 KB an image) in RAM:
fine for subsets and downstream datasets; the full release (~250 GB out) wants a distributed
runner (Dataflow, Flink, Spark) or a machine with that much memory.

Re-running: tfds writes into an `incomplete.*` folder and renames it when done, so a finished
dataset is reused (the command says so and checks that it was made with the same parameters),
and an interrupted run's folder is never read: the next run starts over and says which
leftovers it ignores.
"""
import json
from typing import Any, Sequence

from absl import logging
from etils import epath
import tensorflow_datasets as tfds

from bigpretrain.semantic import tree as tree_lib
from bigpretrain.semantic import wordnet
from input_pipeline import decoding
from input_pipeline.jobs import beam_images as job

NAME = "imagenet21k_p"
MIN_IMAGES = 500  # A class is kept only with at least this many files.
VAL_PER_CLASS = 50
IMAGE_SIZE = 224  # Squish-resized to 224x224 (section 2.1).


def detect_layout(raw_dir) -> tuple[str, list[job.ClassSource], list[str]]:
  """RAW -> (layout 'folders' or 'tars', class sources sorted by wnid, ignored entry names).

  Looks in RAW/train when it exists (winter21 layout), else in RAW. Raises ValueError when it
  finds both wnid folders and wnid tars, or neither.
  """
  raw = epath.Path(raw_dir)
  if not raw.is_dir():
    what = "is a file, not a folder" if raw.exists() else "does not exist"
    raise FileNotFoundError(f"Raw ImageNet-21K folder {raw} (--manual_dir) {what}.")
  root = raw / "train" if (raw / "train").is_dir() else raw
  folders, tars, ignored = [], [], []
  for entry in sorted(root.iterdir(), key=lambda p: p.name):
    if entry.name.startswith("."):
      continue
    if wordnet.is_wnid(entry.name) and entry.is_dir():
      folders.append(job.ClassSource(entry.name, str(entry), "dir"))
    elif entry.name.endswith(".tar") and wordnet.is_wnid(entry.name[:-4]) and entry.is_file():
      tars.append(job.ClassSource(entry.name[:-4], str(entry), "tar"))
    else:
      ignored.append(decoding.text_name(entry.name))
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


class Imagenet21kP(job.BeamImageBuilder):
  """ImageNet-21K-P: ImageNet-21K without classes of fewer than 500 images, a 50-per-class
  validation split, images squished to 224x224 (Ridnik et al., 2021, section 2.1)."""

  name = NAME
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      "Give the raw ImageNet-21K release (winter21 `train/` folders of JPEGs per wnid, or "
      "fall11 one .tar per wnid) as --manual_dir; see input_pipeline/jobs/imagenet21k_p.py.")


def readable_name(wnid: str) -> str:
  """'n01440764' -> 'tench, Tinca tinca' (the synset's lemmas)."""
  return ", ".join(n.replace("_", " ") for n in wordnet.synset_from_wnid(wnid).lemma_names())


def prepare(manual_dir, data_dir, *, beam_runner=None, beam_options: Sequence[str] | None = None,
            min_images: int = MIN_IMAGES, val_per_class: int = VAL_PER_CLASS,
            image_size: int = IMAGE_SIZE, jpeg_quality: int = job.JPEG_QUALITY
            ) -> tfds.core.DatasetBuilder:
  """Prepares `imagenet21k_p` in data_dir from the raw release in manual_dir, or reuses it.

  beam_runner: a Beam runner name or object (None: the local FnApiRunner); beam_options:
  extra Beam flags. min_images/val_per_class/image_size/jpeg_quality: steps 1-3 (module docstring).
  Returns a builder to read the dataset with.
  """
  job.check_params(min_images, val_per_class, image_size, jpeg_quality)
  if image_size is None:
    raise ValueError("imagenet21k_p always squishes images; image_size must be an int.")
  if val_per_class >= min_images:
    raise ValueError(f"val_per_class={val_per_class} >= min_images={min_images} would leave "
                     "kept classes without train images.")
  params = {"raw_dir": str(manual_dir), "min_images": min_images,
            "class_rule": job.CLASS_RULE, "val_per_class": val_per_class,
            "image_size": image_size, "jpeg_quality": jpeg_quality}
  prepared = job.find_prepared(NAME, data_dir)
  if prepared is not None:
    job.reuse(prepared, params)
    return prepared
  job.note_incomplete(epath.Path(data_dir) / NAME)
  layout, sources, ignored = detect_layout(manual_dir)
  logging.info("Raw layout: %s, %d classes in %s", layout, len(sources), manual_dir)
  counts = job.count_files(sources, data_dir, beam_runner=beam_runner, beam_options=beam_options)
  kept, dropped, unreadable = job.choose_classes(sources, counts, min_images)
  if not kept:
    largest = max(n for n, _ in counts)
    raise ValueError(f"No class in {manual_dir} has min_images={min_images} files or more "
                     f"(largest: {largest}).")
  logging.info("Step 1: keeping %d classes, dropping %d with < %d files", len(kept),
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
  plan = job.Plan(classes=kept, sources=[s for s in sources if s.class_name in kept_set],
              splits=splits, val_per_class=val_per_class,
              image=job.ImageOptions(image_size, jpeg_quality), metadata=metadata)
  builder = Imagenet21kP(data_dir=str(data_dir), plan=plan, file_format="array_record")
  return job.generate(builder, manual_dir, beam_runner=beam_runner, beam_options=beam_options)


def report(builder: tfds.core.DatasetBuilder) -> dict[str, Any]:
  """The preparation metadata of a prepared dataset (see the module docstring)."""
  return dict(builder.info.metadata or {})


def semantic_tree(builder: tfds.core.DatasetBuilder) -> tree_lib.SemanticTree:
  """The semantic tree stored with a prepared imagenet21k_p."""
  data = report(builder).get("semantic_tree")
  if data is None:
    raise ValueError(f"No semantic tree in the metadata of {builder.data_dir}.")
  return tree_lib.SemanticTree.from_json(json.dumps(data))
