"""Tests for bigpretrain.semantic.tree.SemanticTree."""
import hashlib
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bigpretrain.semantic import tree as tree_lib
from bigpretrain.semantic.tree import SemanticTree

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_WNIDS_21K_P = _ROOT / "bigpretrain" / "semantic" / "data" / "imagenet21k_p_wnids.txt"

# Synsets used below, with their WordNet 3.0 hypernym links (read off WordNet by hand):
#   dog -> {canine, domestic_animal}; canine -> carnivore -> placental -> mammal -> vertebrate
#   -> chordate -> animal; domestic_animal -> animal; animal -> organism -> living_thing
#   -> whole -> object -> physical_entity -> entity; bird -> vertebrate;
#   swan -> aquatic_bird -> bird; chair -> seat -> furniture -> furnishing -> ... -> artifact
#   -> whole; person -> {causal_agent, organism}; causal_agent -> physical_entity;
#   scrabble -> {board_game, word_game} (both min_depth 8) -> parlor_game;
#   sun -(instance of)-> star -> celestial_body -> natural_object -> whole.
W = {
    "dog": "n02084071", "canine": "n02083346", "domestic_animal": "n01317541",
    "carnivore": "n02075296", "mammal": "n01861778", "animal": "n00015388",
    "organism": "n00004475", "living_thing": "n00004258", "whole": "n00003553",
    "physical_entity": "n00001930", "bird": "n01503061", "swan": "n01858441",
    "chair": "n03001627", "furniture": "n03405725", "person": "n00007846",
    "scrabble": "n00502161", "board_game": "n00502415", "word_game": "n00501870",
    "parlor_game": "n00501722", "sun": "n09450163", "star": "n09444100",
    "automatic_firearm": "n02760429", "machine_gun": "n03701391", "automatic_rifle": "n02760855",
}


def _tree(names):
  return SemanticTree.from_wnids([W[n] for n in names])


def _parent_names(tree, names):
  return {n: (None if p == -1 else names[p]) for n, p in zip(names, tree.parent)}


def test_real_synsets_parents_and_depths():
  names = ["dog", "canine", "carnivore", "mammal", "animal", "swan", "bird", "chair",
           "furniture", "person", "organism"]
  tree = _tree(names)
  assert _parent_names(tree, names) == {
      "dog": "canine", "canine": "carnivore", "carnivore": "mammal", "mammal": "animal",
      "animal": "organism", "swan": "bird", "bird": "animal", "chair": "furniture",
      "furniture": None, "person": "organism", "organism": None}
  depth = dict(zip(names, tree.class_depth.tolist()))
  assert depth == {"organism": 0, "furniture": 0, "animal": 1, "person": 1, "chair": 1,
                   "mammal": 2, "bird": 2, "carnivore": 3, "swan": 3, "canine": 4, "dog": 5}
  assert tree.num_classes == 11 and tree.num_levels == 6
  assert tree.parent.dtype == np.int32 and tree.class_depth.dtype == np.int32
  assert tree.wnids == [W[n] for n in names]


def test_a_class_hangs_under_its_lowest_in_set_ancestor_not_the_nearest():
  # dog reaches animal in 2 links (via domestic_animal) and mammal in 4 (via canine,
  # carnivore, placental); mammal lies under animal, so dog hangs under mammal and an image
  # of a dog has one ground truth per level (animal, mammal, dog), none skipped.
  names = ["mammal", "dog", "animal"]
  tree = _tree(names)
  assert _parent_names(tree, names) == {"mammal": "animal", "dog": "mammal", "animal": None}
  # person reaches physical_entity in 2 links (causal_agent) and whole in 3 (organism,
  # living_thing); whole itself hangs under physical_entity (object in between).
  names = ["whole", "person", "physical_entity"]
  tree = _tree(names)
  assert _parent_names(tree, names) == {
      "whole": "physical_entity", "person": "whole", "physical_entity": None}
  assert tree.class_depth.tolist() == [1, 2, 0]
  # automatic_rifle's two hypernyms: machine_gun, itself under automatic_firearm.
  names = ["automatic_firearm", "machine_gun", "automatic_rifle"]
  assert _parent_names(_tree(names), names)["automatic_rifle"] == "machine_gun"


def test_ties_at_equal_distance_smallest_min_depth_then_offset():
  # canine (min_depth 12) and domestic_animal (7) are both 1 link above dog, and neither
  # lies above the other.
  names = ["canine", "domestic_animal", "dog"]
  assert _parent_names(_tree(names), names)["dog"] == "domestic_animal"
  # board_game and word_game both have min_depth 8: the smaller offset (word_game) wins.
  names = ["board_game", "scrabble", "word_game", "parlor_game"]
  assert _parent_names(_tree(names), names) == {
      "board_game": "parlor_game", "scrabble": "word_game", "word_game": "parlor_game",
      "parlor_game": None}


def test_instance_hypernyms_are_followed():
  names = ["sun", "whole", "star"]
  assert _parent_names(_tree(names), names) == {"sun": "star", "whole": None, "star": "whole"}


def test_parents_do_not_depend_on_input_order():
  names = ["dog", "canine", "carnivore", "mammal", "animal", "swan", "bird", "person",
           "organism", "domestic_animal", "scrabble", "word_game", "board_game"]
  reference = _parent_names(_tree(names), names)
  for seed in range(3):
    shuffled = [names[i] for i in np.random.default_rng(seed).permutation(len(names))]
    assert _parent_names(_tree(shuffled), shuffled) == reference


@pytest.mark.parametrize("bad, message", [
    ("n123", "Malformed wnid 'n123'"),
    ("dog.n.01", "Malformed wnid 'dog.n.01'"),
    ("n02084072", "'n02084072' is not a WordNet"),
])
def test_from_wnids_bad_wnid_raises_naming_it(bad, message):
  with pytest.raises(ValueError, match=message):
    SemanticTree.from_wnids([W["dog"], bad])


def test_from_wnids_duplicate_and_empty_raise():
  with pytest.raises(ValueError, match="Duplicate wnid 'n02084071'"):
    SemanticTree.from_wnids([W["dog"], W["animal"], W["dog"]])
  with pytest.raises(ValueError, match="empty"):
    SemanticTree.from_wnids([])


def test_a_built_tree_is_kept_and_read_back_without_wordnet(tmp_path, monkeypatch):
  """The parents of a class list are kept in the cache: another process over the same classes
  reads them without loading WordNet; a damaged file is rebuilt."""
  from bigpretrain.semantic import tree as tree_lib  # pylint: disable=import-outside-toplevel
  from bigpretrain.semantic import wordnet  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("BIGPRETRAIN_CACHE", str(tmp_path))
  names = ["dog", "canine", "animal", "swan"]
  wnids = [W[n] for n in names]
  tree_lib._parents_from_wnids.cache_clear()  # What a new process starts with.
  built = SemanticTree.from_wnids(wnids)
  assert _parent_names(built, names) == {"dog": "canine", "canine": "animal", "animal": None,
                                         "swan": "animal"}
  [kept] = (tmp_path / "semantic_trees").iterdir()

  def no_wordnet(*args):
    raise AssertionError("WordNet read for a kept tree")

  tree_lib._parents_from_wnids.cache_clear()
  monkeypatch.setattr(wordnet, "synset_from_wnid", no_wordnet)
  assert SemanticTree.from_wnids(wnids) == built
  with pytest.raises(AssertionError):  # Another class order is another tree.
    SemanticTree.from_wnids(wnids[::-1])
  monkeypatch.undo()
  monkeypatch.setenv("BIGPRETRAIN_CACHE", str(tmp_path))
  kept.write_text("[1, 2")  # Torn.
  tree_lib._parents_from_wnids.cache_clear()
  assert SemanticTree.from_wnids(wnids) == built
  assert kept.read_text() == "[1, 2, -1, 2]"  # dog, canine, animal, swan.


# Tiny explicit tree used below (class: parent):
#   0 (root) -> 1, 2;  1 -> 3, 4;  3 -> 5;  2 -> 7;  6 is a root with no children.
_PARENT = [-1, 0, 0, 1, 1, 3, -1, 2]


def test_from_parents_tables_by_hand():
  tree = SemanticTree.from_parents(_PARENT)
  assert tree.wnids is None
  assert tree.num_classes == 8 and tree.num_levels == 4
  assert tree.class_depth.tolist() == [0, 1, 1, 2, 2, 3, 0, 2]
  assert [c.tolist() for c in tree.level_classes] == [[0, 6], [1, 2], [3, 4, 7], [5]]
  assert all(c.dtype == np.int32 for c in tree.level_classes)
  assert tree.level_sizes.tolist() == [2, 2, 3, 1]
  assert tree.index_in_level.tolist() == [0, 0, 1, 0, 1, 0, 1, 2]
  np.testing.assert_array_equal(tree.target_table, [
      [0, -1, -1, -1],
      [0, 1, -1, -1],
      [0, 2, -1, -1],
      [0, 1, 3, -1],
      [0, 1, 4, -1],
      [0, 1, 3, 5],
      [6, -1, -1, -1],
      [0, 2, 7, -1],
  ])
  assert tree.target_table.dtype == np.int32


def test_level_weights_by_hand():
  tree = SemanticTree.from_parents(_PARENT)
  # O_k = classes at level >= k: [8, 6, 4, 1]; W_k = min(8 / O_k, max_weight).
  np.testing.assert_allclose(tree.level_weights(), [1.0, 8 / 6, 2.0, 8.0], rtol=1e-6)
  np.testing.assert_allclose(tree.level_weights(max_weight=5.0), [1.0, 8 / 6, 2.0, 5.0],
                             rtol=1e-6)
  assert tree.level_weights().dtype == np.float32


def test_semantic_targets_numpy_and_jax():
  tree = SemanticTree.from_parents(_PARENT)
  labels = np.array([5, 6, 7, 0])
  expected = [[0, 1, 3, 5], [6, -1, -1, -1], [0, 2, 7, -1], [0, -1, -1, -1]]
  targets = tree.semantic_targets(labels)
  assert isinstance(targets, np.ndarray) and targets.dtype == np.int32
  np.testing.assert_array_equal(targets, expected)
  jitted = jax.jit(tree.semantic_targets)(jnp.asarray(labels))
  np.testing.assert_array_equal(np.asarray(jitted), expected)
  with pytest.raises(ValueError, match="label 8 is outside"):
    tree.semantic_targets(np.array([1, 8]))
  with pytest.raises(ValueError, match="label -1 is outside"):
    tree.semantic_targets([-1])


@pytest.mark.parametrize("parent, message", [
    ([1, 2, 0], r"Cycle .* class 0"),
    ([-1, 1], r"Cycle .* class 1"),
    ([-1, 0, 3, 2], r"Cycle .* class 2"),
    ([-1, 8], r"parent\[1\] = 8"),
    ([-2, 0], r"parent\[0\] = -2"),
    ([-1.0, 0.0], "integers"),
    ([], "non-empty"),
])
def test_from_parents_rejects_bad_arrays(parent, message):
  with pytest.raises(ValueError, match=message):
    SemanticTree.from_parents(parent)


def test_from_parents_cycle_error_names_the_wnid():
  with pytest.raises(ValueError, match="'n00000002'"):
    SemanticTree.from_parents([-1, 2, 1], wnids=["n00000001", "n00000002", "n00000003"])
  with pytest.raises(ValueError, match="2 wnids"):
    SemanticTree.from_parents([-1, 0, 0], wnids=["n00000001", "n00000002"])
  with pytest.raises(ValueError, match="Duplicate wnid 'n00000001'"):
    SemanticTree.from_parents([-1, 0], wnids=["n00000001", "n00000001"])


def test_json_round_trip_equality_and_hash():
  names = ["dog", "canine", "animal", "person", "organism"]
  tree = _tree(names)
  again = SemanticTree.from_json(tree.to_json())
  assert again == tree and hash(again) == hash(tree)
  np.testing.assert_array_equal(again.target_table, tree.target_table)
  assert again.wnids == tree.wnids
  other = SemanticTree.from_parents(tree.parent)  # Same shape, no wnids: a different tree.
  assert other != tree
  assert SemanticTree.from_parents(_PARENT) == SemanticTree.from_parents(np.array(_PARENT))
  with pytest.raises(ValueError):
    tree.parent[0] = 3  # Tables are read-only, so the hash cannot go stale.


def test_tree_is_a_valid_static_jit_argument():
  calls = []

  def depth_sum(x, tree):
    calls.append(1)
    return x + jnp.sum(jnp.asarray(tree.class_depth))

  f = jax.jit(depth_sum, static_argnums=1)
  assert int(f(1, SemanticTree.from_parents(_PARENT))) == 1 + 11
  assert int(f(2, SemanticTree.from_parents(list(_PARENT)))) == 2 + 11
  assert len(calls) == 1  # An equal tree hits the compilation cache.


_HASH_SCRIPT = """
import hashlib, pathlib, sys, tempfile
from bigpretrain.semantic import tree as tree_lib
folder = tempfile.mkdtemp()  # Built from WordNet in this process, not read from the cache.
tree_lib._stored_tree = lambda wnids: pathlib.Path(folder) / "tree.json"
wnids = open(sys.argv[1]).read().split()
tree = tree_lib.SemanticTree.from_wnids(wnids)
print(hashlib.sha256(tree.parent.tobytes()).hexdigest())
"""


def test_imagenet21k_p_tree_is_hash_seed_independent_with_11_levels(tmp_path, monkeypatch):
  # Built from WordNet here and in a process whose hash seed differs from this one's.
  seed = "123" if os.environ.get("PYTHONHASHSEED") == "0" else "0"
  env = dict(os.environ, PYTHONHASHSEED=seed,
             PYTHONPATH=os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.Popen([sys.executable, "-c", _HASH_SCRIPT, str(_WNIDS_21K_P)], env=env,
                          cwd=_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  wnids = _WNIDS_21K_P.read_text().split()
  monkeypatch.setattr(tree_lib, "_stored_tree", lambda wnids: tmp_path / "tree.json")
  tree_lib._parents_from_wnids.cache_clear()  # pylint: disable=protected-access
  tree = SemanticTree.from_wnids(wnids)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err
  assert out.strip() == hashlib.sha256(tree.parent.tobytes()).hexdigest()

  assert tree.num_classes == 11221
  assert int(np.sum(tree.level_sizes >= 2)) == 11  # The paper's 11 hierarchies.
  assert int(tree.level_sizes.sum()) == 11221
  # Hand-checked: dog's links are canine (min_depth 12) and domestic_animal (7), both
  # ImageNet-21K-P classes, so domestic_animal wins the tie.
  assert wnids[tree.parent[wnids.index(W["dog"])]] == W["domestic_animal"]
  # Every parent is a WordNet ancestor (hypernym or instance-hypernym closure).
  from bigpretrain.semantic import wordnet  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  for c in rng.choice(np.flatnonzero(tree.parent >= 0), size=50, replace=False):
    synset = wordnet.synset_from_wnid(wnids[c])
    ancestors = set(synset.closure(lambda s: s.hypernyms() + s.instance_hypernyms()))
    assert wordnet.synset_from_wnid(wnids[tree.parent[c]]) in ancestors


def test_level_weights_cap_and_the_papers_uncapped_equation_2():
  # 24 top-level classes and one child: O = [25, 1]. Equation 2: W = 1 / O, times O_0 = 25.
  tree = SemanticTree.from_parents([-1] * 24 + [0])
  np.testing.assert_allclose(tree.level_weights(max_weight=0), [1.0, 25.0], rtol=1e-6)
  np.testing.assert_allclose(tree.level_weights(), [1.0, 20.0], rtol=1e-6)  # The code's cap.
  with pytest.raises(ValueError, match="max_weight"):
    tree.level_weights(max_weight=-1.0)
  from configs import semantic_softmax  # pylint: disable=import-outside-toplevel
  assert semantic_softmax.get_config().objective.max_weight == 20.0
