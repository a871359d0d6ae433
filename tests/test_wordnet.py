"""Tests for the offline WordNet 3.0 access in bigpretrain.semantic.wordnet."""
import pytest

from bigpretrain.semantic import wordnet


def test_load_is_wordnet_30():
  reader = wordnet.load()
  assert reader.get_version() == "3.0"
  assert wordnet.load() is reader  # Cached: one reader per process.


@pytest.mark.parametrize("wnid, name", [
    ("n02084071", "dog.n.01"),
    ("n00001740", "entity.n.01"),
    ("n03001627", "chair.n.01"),
    ("n00007846", "person.n.01"),
])
def test_synset_from_wnid_and_back(wnid, name):
  synset = wordnet.synset_from_wnid(wnid)
  assert synset.name() == name
  assert wordnet.wnid(synset) == wnid


def test_wnid_is_zero_padded():
  assert wordnet.wnid(wordnet.load().synset("entity.n.01")) == "n00001740"


@pytest.mark.parametrize("bad", [
    "n2084071",     # 7 digits: nltk would still find dog.n.01 at that offset.
    "n020840710",   # 9 digits.
    "x02084071",    # Unknown POS letter.
    "N02084071",    # POS letters are lower case.
    "n0208407\uff11",  # A non-ASCII digit.
    "",
    "n",
    2084071,
])
def test_malformed_wnid_raises_naming_it(bad):
  with pytest.raises(ValueError, match="Malformed wnid") as info:
    wordnet.synset_from_wnid(bad)
  assert repr(bad) in str(info.value)


@pytest.mark.parametrize("unknown", ["n02084072", "n99999999", "n00000000"])
def test_unknown_wnid_raises_naming_it(unknown):
  with pytest.raises(ValueError, match=unknown):
    wordnet.synset_from_wnid(unknown)
