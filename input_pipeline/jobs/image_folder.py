"""ImageFolder-style trees -> tfds datasets, converted once by the shared Beam image job
(beam_images.py).

  python -m input_pipeline.prepare folder --manual_dir=RAW --data_dir=OUT --name=NAME \
      [--val_per_class=K] [--min_images=N] [--image_size=S] [--jpeg_quality=Q] [--beam_runner=...]

Layouts (detected):
  RAW/<split>/<class>/<image>  split folders among train, val or validation, test ('val' is
                               written as the split 'validation'); other entries are ignored.
  RAW/<class>/<image>          one split, `train`.
With --val_per_class=K and no validation folder, K images per class move from train to
`validation` by the imagenet21k_p hash rule (smallest sha256('class/name')).

Classes: the class folder names of all splits, sorted (label = index; a name that is not
UTF-8 is stored with those bytes as \\xNN, as file names are: beam_images.py). A class with
fewer than `min_images` files over all splits is dropped and reported (default 1: empty
folders).
Images are kept as they are (decodable JPEG/PNG bytes unchanged, other formats re-encoded as
JPEG) unless --image_size squishes them as for imagenet21k_p. Corrupt files are skipped and
listed in the metadata, as for imagenet21k_p.

The result is the tfds dataset `bigpretrain_folder/NAME` (ArrayRecord, features 'image',
'label', 'file_name') in OUT, read through `config.data.name='folder:NAME'`,
`config.data.dir=OUT`. Re-running reuses a finished dataset.
"""
import re
from typing import Sequence

from absl import logging
from etils import epath
import tensorflow_datasets as tfds

from input_pipeline import decoding
from input_pipeline.jobs import beam_images as job

BUILDER_NAME = "bigpretrain_folder"
SPLIT_DIRS = {"train": "train", "val": "validation", "validation": "validation",
              "test": "test"}
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]*")


class BigpretrainFolder(job.BeamImageBuilder):
  """An ImageFolder tree converted by input_pipeline/jobs/image_folder.py; config name = NAME."""

  name = BUILDER_NAME
  IMAGE_ENCODING = None  # Original JPEG or PNG bytes.
  MANUAL_DOWNLOAD_INSTRUCTIONS = "Give the ImageFolder tree as --manual_dir."


def check_name(name: str) -> str:
  """Validates a dataset NAME (it becomes a tfds config and folder name)."""
  if not isinstance(name, str) or not NAME_RE.fullmatch(name):
    raise ValueError(f"Dataset name {name!r} must be letters, digits, '_' or '-', starting "
                     "with a letter or digit.")
  return name


def _class_dirs(folder: epath.Path) -> tuple[list[epath.Path], list[str]]:
  """(non-hidden sub-folders sorted by name, names of other non-hidden entries as text)."""
  dirs, other = [], []
  for entry in sorted(folder.iterdir(), key=lambda p: p.name):
    if entry.name.startswith("."):
      continue
    if entry.is_dir():
      dirs.append(entry)
    else:
      other.append(decoding.text_name(entry.name))
  return dirs, other


def detect_layout(raw_dir, val_per_class: int = 0
                  ) -> tuple[str, list[job.ClassSource], list[str]]:
  """RAW -> (layout 'splits' or 'classes', class sources, ignored entry names).

  Train sources get split '' (hash-rule carving) when val_per_class > 0; that needs a tree
  without a validation folder.
  """
  raw = epath.Path(raw_dir)
  if not raw.is_dir():
    what = "is a file, not a folder" if raw.exists() else "does not exist"
    raise FileNotFoundError(f"ImageFolder root {raw} (--manual_dir) {what}.")
  dirs, ignored = _class_dirs(raw)
  split_dirs = [d for d in dirs if d.name in SPLIT_DIRS]
  if split_dirs:
    layout = "splits"
    names = [d.name for d in split_dirs]
    if "val" in names and "validation" in names:
      raise ValueError(f"{raw} has both val/ and validation/; keep one.")
    if "train" not in names and val_per_class:
      raise ValueError(f"--val_per_class needs a train/ folder in {raw}.")
    if val_per_class and any(SPLIT_DIRS[n] == "validation" for n in names):
      raise ValueError(f"{raw} already has a validation folder; drop --val_per_class "
                       f"(got {val_per_class}).")
    ignored += [decoding.text_name(d.name) for d in dirs if d.name not in SPLIT_DIRS]
    sources = []
    for split_dir in split_dirs:
      split = SPLIT_DIRS[split_dir.name]
      class_dirs, other = _class_dirs(split_dir)
      ignored += [f"{split_dir.name}/{o}" for o in other]
      carve = split == "train" and val_per_class > 0
      sources += [job.ClassSource(decoding.text_name(d.name), str(d), "dir",
                                  "" if carve else split)
                  for d in class_dirs]
  else:
    layout = "classes"
    sources = [job.ClassSource(decoding.text_name(d.name), str(d), "dir",
                               "" if val_per_class else "train")
               for d in dirs]
  if not sources:
    raise ValueError(f"No class folder found in {raw}: expected RAW/<class>/<image> or "
                     "RAW/<train|val|validation|test>/<class>/<image>.")
  if ignored:
    logging.warning("Ignoring %d entries of %s: %s", len(ignored), raw, ignored[:10])
  return layout, sorted(sources, key=lambda s: (s.class_name, s.split, s.path)), ignored


def _splits_of(sources: Sequence[job.ClassSource]) -> tuple[str, ...]:
  """Splits the sources feed, in the order train, validation, test."""
  splits = set()
  for s in sources:  # split '' (carving) feeds train and validation.
    splits.update((s.split,) if s.split else ("train", "validation"))
  order = ("train", "validation", "test")
  return tuple(sorted(splits, key=order.index))


def prepare(manual_dir, data_dir, name: str, *, beam_runner=None,
            beam_options: Sequence[str] | None = None, val_per_class: int = 0,
            min_images: int = 1, image_size: int | None = None,
            jpeg_quality: int = job.JPEG_QUALITY) -> tfds.core.DatasetBuilder:
  """Converts the ImageFolder tree manual_dir into `bigpretrain_folder/NAME` in data_dir (or
  reuses a finished one); returns a builder to read it with."""
  check_name(name)
  job.check_params(min_images, val_per_class, image_size, jpeg_quality)
  params = {"raw_dir": str(manual_dir), "min_images": min_images,
            "class_rule": job.CLASS_RULE, "val_per_class": val_per_class,
            "image_size": image_size, "jpeg_quality": jpeg_quality}
  full_name = f"{BUILDER_NAME}/{name}"
  prepared = job.find_prepared(full_name, data_dir)
  if prepared is not None:
    job.reuse(prepared, params)
    return prepared
  job.note_incomplete(epath.Path(data_dir) / BUILDER_NAME / name)
  layout, sources, ignored = detect_layout(manual_dir, val_per_class)
  counts = job.count_files(sources, data_dir, beam_runner=beam_runner,
                           beam_options=beam_options)
  kept, dropped, unreadable = job.choose_classes(sources, counts, min_images)
  if not kept:
    raise ValueError(f"No class folder in {manual_dir} has {min_images} files or more.")
  kept_set = set(kept)
  carved = {}  # The train files of each kept class that val_per_class draws from.
  for s, (n, _) in zip(sources, counts):
    if s.split == "" and s.class_name in kept_set:
      carved[s.class_name] = carved.get(s.class_name, 0) + n
  if carved and max(carved.values()) <= val_per_class:
    raise ValueError(f"--val_per_class={val_per_class} moves every train image to validation "
                     f"(the largest class has {max(carved.values())} files): give a smaller "
                     "value, or a validation folder.")
  kept_sources = [s for s in sources if s.class_name in kept_set]
  totals = {}
  for s, (n, _) in zip(sources, counts):
    totals[s.class_name] = totals.get(s.class_name, 0) + n
  metadata = {
      "params": params,
      "layout": layout,
      "classes": kept,
      "names": kept,
      "listed_counts": [totals[c] for c in kept],
      "dropped_classes": dropped,
      "unreadable_classes": unreadable,
      "ignored_entries": ignored,
      "split_rule": ("folders; validation carved from train: the val_per_class files with "
                     "the smallest sha256('class/name') hex digest (ties by name)"
                     if val_per_class else "folders"),
  }
  plan = job.Plan(classes=kept, sources=kept_sources,
                  splits=_splits_of(kept_sources),
                  val_per_class=val_per_class,
                  image=job.ImageOptions(image_size, jpeg_quality), metadata=metadata)
  config = tfds.core.BuilderConfig(name=name, description=f"ImageFolder tree {manual_dir}.")
  builder = BigpretrainFolder(data_dir=str(data_dir), config=config, plan=plan,
                              file_format="array_record")
  return job.generate(builder, manual_dir, beam_runner=beam_runner, beam_options=beam_options)
