"""`hashtags:demo`: the demo's tags prepared by the hashtag Beam job (hashtag_job.py), once.

The demo's train and validation images and tags are exported once into the cache as WebDataset
shards (`<data dir>/hashtags_demo_raw/VERSION/SPLIT/*.tar`, KEY.png + KEY.json {"hashtags",
"label"}) and prepared by hashtag_job as `bigpretrain_hashtags/demo_VERSION` with min_count =
min_raw_count = 1 (the vocabulary is every canonical label of the train tags) and
DEMO_TAIL_THRESHOLD, under a file lock, like the demo itself. VERSION is the demo's tfds
version (dots as underscores), so a new demo version is exported and prepared anew rather than
read from an older cache. Building it the first time needs Apache Beam; this module is
imported only when the name is used.
"""
import io
import json
import pathlib
import tarfile

from input_pipeline import datasets
from input_pipeline.sources import demo
from input_pipeline.sources import hashtag_source

DEMO_NAME = hashtag_source.DEMO_NAME
DEMO_SPLITS = ("train", "validation")
DEMO_RAW = "hashtags_demo_raw"
DEMO_SHARD_SIZE = 5000
# Head = labels in at least this many train images (the paper's 5,000 is for billions of
# images). The demo's 109 labels are in 45-686 of its ~17k labelled train images; at 200
# both the head and the tail hold a good part of the labels and of the images.
DEMO_TAIL_THRESHOLD = 200


def export_demo(base_builder, raw_dir: pathlib.Path) -> pathlib.Path:
  """Writes the demo's train and validation splits as WebDataset shards under raw_dir
  (once: a finished export is reused); returns raw_dir."""
  done = raw_dir / ".complete"
  if done.exists():
    return raw_dir
  base = datasets.TfdsDataset("demo", base_builder)
  wnids = base.info.class_names
  for split in DEMO_SPLITS:
    folder = raw_dir / split
    folder.mkdir(parents=True, exist_ok=True)
    source = base.source(split)
    for start in range(0, len(source), DEMO_SHARD_SIZE):
      shard = folder / f"demo-{start // DEMO_SHARD_SIZE:05d}.tar"
      with tarfile.open(shard, "w") as tar:
        for i in range(start, min(start + DEMO_SHARD_SIZE, len(source))):
          record = source[i]
          meta = json.dumps({"hashtags": record["hashtags"],
                             "label": wnids[record["label"]]}).encode("utf-8")
          for name, data in ((f"{i:06d}.png", record["image"]), (f"{i:06d}.json", meta)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
  done.write_text("")
  return raw_dir


def _version(base_builder) -> str:
  return str(base_builder.info.version).replace(".", "_")


def prepared_name(base_builder) -> str:
  """The NAME of 'hashtags:NAME' the demo is prepared under: one per demo version."""
  return f"{DEMO_NAME}_{_version(base_builder)}"


def demo_builder(data_dir: str):
  """The hashtags:demo builder, exported and prepared by the Beam job on first use."""
  base = demo.prepare(data_dir or None)
  root = pathlib.Path(data_dir) if data_dir else datasets.default_data_dir()
  name = prepared_name(base)
  found = hashtag_source.find(f"{hashtag_source.BUILDER_NAME}/{name}", root)
  if found is not None and (pathlib.Path(found.data_dir) /
                            hashtag_source.LABEL_INDEX.format(split="train")).exists():
    return found
  with demo.file_lock(root / f".{hashtag_source.BUILDER_NAME}-{name}.lock"):
    raw = export_demo(base, root / DEMO_RAW / _version(base))
    # Apache Beam is imported only when the demo's tags are first prepared.
    from input_pipeline.jobs import hashtag_job  # pylint: disable=import-outside-toplevel
    return hashtag_job.prepare(raw, root, name, min_count=1, min_raw_count=1,
                               tail_threshold=DEMO_TAIL_THRESHOLD)


@datasets.SOURCES.register("hashtags:demo")
@datasets.data_keys(hashtag_source.ALPHA_KEY)
def load(name: str, data_dir: str) -> hashtag_source.HashtagDataset:
  return hashtag_source.HashtagDataset(name, demo_builder(data_dir), image_size=demo.IMAGE_SIZE)
