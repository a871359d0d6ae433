"""Hashtag -> WordNet synsets -> canonical hashtag (SWAG, Singh et al. 2022, appendix A).

get_synsets is the paper's Listing 1 on nltk's WordNet 3.0 (bigpretrain.semantic.wordnet):
candidates are the noun base form of the hashtag and the base form (any part of speech) of
every split "abc_def" with both parts at least 3 characters long; all synsets of the
candidates whose lexicographer file is one of ALLOWED_LEXNAMES are kept. Hashtags that map to
the same synset set are one label, the canonical hashtag: the sorted synset names joined with
'+' (#eggplant and #aubergine -> 'eggplant.n.01+eggplant.n.02'); hashtags with no synset are
dropped (#newyork: 'new_york' is a noun.location). Results are sets and sorted strings, so they
do not depend on PYTHONHASHSEED or nltk's iteration order (DESIGN principle 8).
"""
import functools

from bigpretrain.semantic import wordnet

MIN_LEN = 3  # Listing 1: shorter hashtags map to nothing; compound parts are >= 3 long.
# Listing 1's ALLOWED_SENSES. The printed listing lacks a comma after "noun.object", which
# would fuse it with "noun.plant"; the six lexnames are meant (issue 13).
ALLOWED_LEXNAMES = frozenset({
    "noun.animal", "noun.artifact", "noun.food", "noun.object", "noun.plant", "noun.event"})
SEPARATOR = "+"  # No WordNet 3.0 synset name contains '+'.


def normalise(hashtag: str) -> str:
  """'#NewYork' -> 'newyork': one leading '#' stripped, lower-cased."""
  if not isinstance(hashtag, str):
    raise TypeError(f"hashtag must be a str, got {type(hashtag).__name__}: {hashtag!r}")
  return hashtag.removeprefix("#").lower()


def get_synsets(hashtag: str) -> frozenset[str]:
  """Names of the WordNet synsets a hashtag maps to (Listing 1); empty if none."""
  return _synsets(normalise(hashtag))


@functools.lru_cache(maxsize=1 << 16)
def _synsets(h: str) -> frozenset[str]:
  if len(h) < MIN_LEN:
    return frozenset()
  wn = wordnet.load()
  candidates = {wn.morphy(h, wn.NOUN)}
  for i in range(MIN_LEN, len(h) - MIN_LEN + 1):
    candidates.add(wn.morphy(h[:i] + "_" + h[i:]))  # No POS, as the listing does.
  return frozenset(
      synset.name() for word in candidates if word is not None
      for synset in wn.synsets(word) if synset.lexname() in ALLOWED_LEXNAMES)


def canonical_hashtag(hashtag: str) -> str | None:
  """The hashtag's label: its sorted synset names joined with '+', or None if it has none."""
  synsets = get_synsets(hashtag)
  return SEPARATOR.join(sorted(synsets)) if synsets else None


def label_synsets(label: str) -> tuple[str, ...]:
  """Canonical hashtag -> its synset names, in order ('a.n.01+b.n.02' -> ('a.n.01', 'b.n.02'))."""
  if not isinstance(label, str) or not label:
    raise ValueError(f"canonical hashtag must be a non-empty str, got {label!r}")
  return tuple(label.split(SEPARATOR))
