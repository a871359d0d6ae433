"""Readers of crawled image + hashtag inputs (no Beam): WebDataset tar shards and JSONL /
Parquet manifests, as the hashtag dataset job (hashtag_job.py) reads them.

Inputs are found under RAW by suffix (hidden entries ignored):
  *.tar      WebDataset shards as img2dataset writes them: members grouped by key (the
             member name up to the first '.' of its base name, as webdataset does), an image
             KEY.jpg/.jpeg/.png/.webp/.bmp/.gif plus the tags in KEY.json (the first of the
             keys "hashtags", "tags" holding a list of str, or a str parsed as a .txt) or,
             when KEY.json holds neither key (img2dataset's metadata .json), in KEY.txt
             (its caption). Uncompressed tars only (images are later read at their offset).
  *.jsonl    one JSON object a line: "id" (or "key"; default the line number), "image" (a path,
             relative to the manifest's folder or absolute) or "image_base64" (the bytes),
             "hashtags" or "tags" (list of str, or a str), optional "split".
  *.parquet  the same columns; "image" may also be binary (the bytes) or a struct with
             "bytes"/"path" (the Hugging Face datasets image layout).
Text tags (.txt, or a str in JSON): the '#'-words if there are any (a caption), else the
words separated by whitespace or commas (a tag list).

Split of a sample: the input's first folder under RAW when that is a split folder (train,
val -> validation, validation, test), else the manifest row's "split" if it has one, else
'train'. A row in a split folder whose "split" names another split is skipped (split_mismatch,
counted and named): a manifest is split by its rows outside split folders.

Tags are normalised as the vocabulary does (one leading '#' stripped, lower case; repeats in one
sample count once). Bad input never stops a reader: a tar member with an absolute or '..' path
(never extracted: members are read in memory), a member that is not a regular file, an
oversized tag file, an unparsable manifest row, a sample without an image, and tags that are
not valid UTF-8 are each yielded as a Skip (reason, where) for the job to count. A name that is
not UTF-8 (a latin-1 shard, member or manifest id) is read as usual and kept with those bytes
as \\xNN, as the image job does (decoding.text_name: b'caf\\xe9.jpg' -> the text caf\\xe9.jpg).
"""
import base64
import dataclasses
import json
import pathlib
import posixpath
import re
import tarfile
from typing import Any, Iterator

from etils import epath

from bigpretrain.swag import vocabulary
from input_pipeline import decoding

SPLIT_DIRS = {"train": "train", "val": "validation", "validation": "validation",
              "test": "test"}
INPUT_SUFFIXES = (".tar", ".jsonl", ".parquet")
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif")
TAG_EXTENSIONS = ("json", "txt")
TAG_KEYS = ("hashtags", "tags")
ID_KEYS = ("id", "key")
MAX_TAG_BYTES = 1 << 20  # A tag file above 1 MiB is not a post's tags: skipped unread.
PARQUET_BATCH = 256  # Rows read at a time (images may be inline).


@dataclasses.dataclass(frozen=True)
class Sample:
  """One crawled image with its raw tags.

  uid: unique in the job ('relpath#n', n the sample's ordinal in its input file); name: for
  people ('relpath/KEY' or 'relpath:ID'); tags: distinct normalised tags, sorted. The image is
  `data` when inline, else `size` bytes at `offset` of `path` (offset -1: the whole file).
  """
  uid: str
  name: str
  split: str
  tags: tuple[str, ...]
  path: str = ""
  offset: int = -1
  size: int = -1
  data: bytes | None = None


@dataclasses.dataclass(frozen=True)
class Skip:
  """Something a reader could not use: reason (a fixed word), where (file/key), error."""
  reason: str
  where: str
  error: str = ""


@dataclasses.dataclass(frozen=True)
class DroppedTag:
  """A tag left out of a sample that is still read (e.g. not UTF-8): counted apart from the
  Skips, so that those add up to the samples rejected, each under one reason."""
  reason: str
  where: str
  error: str = ""


@dataclasses.dataclass(frozen=True)
class InputFile:
  path: str
  relpath: str  # Relative to RAW, '/'-separated, as text (decoding.text_name).
  split: str  # '' when the file is not in a split folder.


def find_inputs(raw_dir) -> list[InputFile]:
  """Every input file under raw_dir, sorted by relative path."""
  raw = pathlib.Path(raw_dir)
  if not raw.is_dir():
    what = "is a file, not a folder" if raw.exists() else "does not exist"
    raise FileNotFoundError(f"Raw input folder {raw} (--manual_dir) {what}.")
  found = []
  for path in sorted(raw.rglob("*")):
    rel = path.relative_to(raw)
    if any(p.startswith(".") for p in rel.parts) or not path.is_file():
      continue
    if path.suffix.lower() in INPUT_SUFFIXES:
      split = SPLIT_DIRS.get(rel.parts[0].lower(), "") if len(rel.parts) > 1 else ""
      found.append(InputFile(str(path), decoding.text_name(rel.as_posix()), split))
  if not found:
    raise ValueError(f"No input under {raw}: expected WebDataset shards (*.tar) or manifests "
                     "(*.jsonl, *.parquet), optionally in train/, val/, validation/, test/.")
  return found


def _text(data: bytes) -> str:
  """UTF-8 bytes -> str; invalid bytes become lone surrogates, caught per tag later."""
  return data.decode("utf-8", errors="surrogateescape")


def split_text(text: str) -> list[str]:
  """A caption or tag list -> raw tags (see the module docstring)."""
  hashes = re.findall(r"#([^\s#,]+)", text)
  return hashes if hashes else [t for t in re.split(r"[\s,]+", text) if t]


def parse_tags(value: Any, where: str) -> tuple[tuple[str, ...], list[Skip]]:
  """A tag list or text -> (distinct normalised tags, sorted; DroppedTags of non-UTF-8 tags)."""
  if value is None:
    return (), []
  if isinstance(value, bytes):
    value = _text(value)
  if isinstance(value, str):
    value = split_text(value)
  if not isinstance(value, (list, tuple)):
    raise ValueError(f"tags must be a list of str or a str, got {type(value).__name__}")
  tags, skips = set(), []
  for tag in value:
    if isinstance(tag, bytes):
      tag = _text(tag)
    if not isinstance(tag, str):
      raise ValueError(f"tags must be str, got {type(tag).__name__}: {tag!r}")
    try:
      tag.encode("utf-8")
    except UnicodeEncodeError:
      skips.append(DroppedTag("non_utf8_tag", where,
                              repr(tag.encode("utf-8", "surrogateescape"))))
      continue
    tag = vocabulary.normalise(tag.strip())
    if tag:
      tags.add(tag)
  return tuple(sorted(tags)), skips


def _sample_tags(parts: dict, where: str):
  """(tags, skips) from a sample's KEY.json when it holds a TAG_KEYS key, else from its
  KEY.txt (img2dataset writes a .json of metadata beside the caption's .txt)."""
  if "json" in parts:
    meta = json.loads(_text(parts["json"]))
    if not isinstance(meta, dict):
      raise ValueError("a tag .json must hold an object")
    key = next((k for k in TAG_KEYS if k in meta), None)
    if key is not None or "txt" not in parts:
      return parse_tags(meta[key] if key else None, where)
  return parse_tags(parts["txt"], where) if "txt" in parts else ((), [])


def unsafe_member_name(name: str) -> bool:
  """True for tar member names that would leave an extraction folder."""
  parts = name.replace("\\", "/").split("/")
  return name.startswith(("/", "\\")) or bool(re.match(r"^[A-Za-z]:", name)) or ".." in parts


def _member_key(name: str) -> tuple[str, str]:
  """'dir/000001.jpg' -> ('dir/000001', 'jpg'); webdataset keys end at the base name's first
  '.'."""
  name = name[2:] if name.startswith("./") else name
  folder, base = posixpath.split(name)
  stem, _, ext = base.partition(".")
  return posixpath.join(folder, stem), ext.lower()


def read_tar(f: InputFile) -> Iterator[Sample | Skip]:
  """Samples of one WebDataset shard, streamed (consecutive members with one key)."""
  current, parts = None, {}
  count = 0

  def finish():
    nonlocal count
    if current is None:
      return
    where = f"{f.relpath}/{current}"
    image = next((parts[e] for e in IMAGE_EXTENSIONS if e in parts), None)
    if image is None:
      yield Skip("no_image", where)
      return
    if "_bad_tags" in parts:  # The sample's tag file: rejected under this one reason.
      yield Skip("bad_tags", where, parts["_bad_tags"])
      return
    try:
      tags, skips = _sample_tags(parts, where)
    except ValueError as e:  # json.JSONDecodeError is a ValueError.
      yield Skip("bad_tags", where, f"{type(e).__name__}: {e}")
      return
    yield from skips
    offset, size = image
    yield Sample(uid=f"{f.relpath}#{count}", name=where, split=f.split or "train", tags=tags,
                 path=f.path, offset=offset, size=size)
    count += 1

  with epath.Path(f.path).open("rb") as fileobj, tarfile.open(fileobj=fileobj,
                                                               mode="r|") as tar:
    for member in tar:
      name = decoding.text_name(member.name)  # Names are kept as text, even if not UTF-8.
      where = f"{f.relpath}/{name}"
      if unsafe_member_name(name):
        yield Skip("unsafe_tar_member", where)
        continue
      if not member.isreg():
        if not member.isdir():
          yield Skip("tar_member_not_a_file", where)
        continue
      key, ext = _member_key(name)
      if key != current:
        yield from finish()
        current, parts = key, {}
      if ext in IMAGE_EXTENSIONS:
        parts.setdefault(ext, (member.offset_data, member.size))
      elif ext in TAG_EXTENSIONS:
        if member.size > MAX_TAG_BYTES:
          parts["_bad_tags"] = f"tag file {name} of {member.size} bytes"
          continue
        parts[ext] = tar.extractfile(member).read()
    yield from finish()


def _row_sample(row: dict, f: InputFile, n: int) -> Iterator[Sample | Skip]:
  """One manifest row -> a Sample (and Skips of its bad tags), or a Skip."""
  ident = next((row[k] for k in ID_KEYS if row.get(k) is not None), n)
  where = decoding.text_name(f"{f.relpath}:{ident}")
  split = row.get("split") or f.split or "train"
  if not isinstance(split, str) or split.lower() not in SPLIT_DIRS:
    yield Skip("bad_manifest_row", where, f"split {split!r} is not one of {list(SPLIT_DIRS)}")
    return
  if f.split and SPLIT_DIRS[split.lower()] != f.split:  # The job writes the folder's split only.
    yield Skip("split_mismatch", where, f"the row's split {split!r} is not its folder's "
               f"{f.split!r}; a manifest is split by its rows outside split folders")
    return
  try:
    tags, skips = parse_tags(next((row[k] for k in TAG_KEYS if k in row), None), where)
  except ValueError as e:
    yield Skip("bad_tags", where, str(e))
    return
  image = row.get("image")
  if isinstance(image, dict):  # Hugging Face datasets: {'bytes': ..., 'path': ...}.
    image = image.get("bytes") or image.get("path")
  data, path = None, ""
  if isinstance(image, (bytes, bytearray)):
    data = bytes(image)
  elif isinstance(image, str) and image:
    path = str(pathlib.Path(f.path).parent / image)  # An absolute image stays absolute.
  elif isinstance(row.get("image_base64"), str):
    try:
      data = base64.b64decode(row["image_base64"], validate=True)
    except ValueError as e:
      yield Skip("bad_manifest_row", where, f"image_base64: {e}")
      return
  else:
    yield Skip("no_image", where, "no 'image' path or bytes, nor 'image_base64'")
    return
  yield from skips
  yield Sample(uid=f"{f.relpath}#{n}", name=where, split=SPLIT_DIRS[split.lower()], tags=tags,
               path=path, data=data)


def read_jsonl(f: InputFile) -> Iterator[Sample | Skip]:
  with epath.Path(f.path).open("rb") as lines:
    for n, line in enumerate(lines):
      if not line.strip():
        continue
      try:
        row = json.loads(_text(line))
        if not isinstance(row, dict):
          raise ValueError("a manifest line must hold a JSON object")
      except ValueError as e:
        yield Skip("bad_manifest_row", f"{f.relpath}:line {n + 1}", f"{type(e).__name__}: {e}")
        continue
      yield from _row_sample(row, f, n)


def read_parquet(f: InputFile) -> Iterator[Sample | Skip]:
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  n = 0
  with epath.Path(f.path).open("rb") as fileobj:
    for batch in pq.ParquetFile(fileobj).iter_batches(batch_size=PARQUET_BATCH):
      for row in batch.to_pylist():
        yield from _row_sample(row, f, n)
        n += 1


def read_input(f: InputFile) -> Iterator[Sample | Skip]:
  """Samples and Skips of one input file (by suffix)."""
  suffix = pathlib.PurePosixPath(f.relpath).suffix.lower()
  reader = {".tar": read_tar, ".jsonl": read_jsonl, ".parquet": read_parquet}[suffix]
  return reader(f)


def splits_of(f: InputFile) -> set[str]:
  """The splits an input feeds: its folder's, else (manifests) the rows' "split" values.
  A manifest outside split folders is read once here for that column (Parquet reads only
  that column); put manifests in split folders to skip the scan."""
  if f.split:
    return {f.split}
  suffix = pathlib.PurePosixPath(f.relpath).suffix.lower()
  values = set()
  if suffix == ".jsonl":
    with epath.Path(f.path).open("rb") as lines:
      for line in lines:
        try:
          row = json.loads(_text(line)) if line.strip() else None
        except ValueError:
          continue  # Counted when the job reads it.
        if isinstance(row, dict):
          values.add(row.get("split"))
  elif suffix == ".parquet":
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    with epath.Path(f.path).open("rb") as fileobj:
      parquet = pq.ParquetFile(fileobj)
      if "split" in parquet.schema_arrow.names:
        values.update(parquet.read(columns=["split"]).column("split").to_pylist())
  splits = {SPLIT_DIRS[v.lower()] for v in values
            if isinstance(v, str) and v.lower() in SPLIT_DIRS}
  if not values or None in values or "" in values:
    splits.add("train")
  return splits
