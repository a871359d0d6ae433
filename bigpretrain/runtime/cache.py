"""The cache folder of everything bigpretrain generates once and reuses (WordNet files for
nltk, the semantic trees built from them, the demo dataset, the JAX compilation cache):
$BIGPRETRAIN_CACHE, else ~/.cache/bigpretrain."""
import os
import pathlib


def root() -> pathlib.Path:
  return pathlib.Path(os.environ.get("BIGPRETRAIN_CACHE")
                      or os.path.join(os.path.expanduser("~"), ".cache", "bigpretrain"))
