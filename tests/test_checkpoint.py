"""Checkpoint helpers: initialising a model from a checkpoint of a different model; what a
run's meta holds."""
import functools
import os

import jax.numpy as jnp
import numpy as np
import pytest

from bigpretrain import checkpoint


def _state(head_classes, body_value):
  return {"step": jnp.zeros((), jnp.int32), "opt_state": {}, "skipped_records": jnp.zeros(()),
          "params": {"head": {"kernel": jnp.full((4, head_classes), 7.0)},
                     "blocks": {0: {"w": jnp.full((3,), body_value)}}},
          "extra": {}}


def test_init_from_keeps_mismatched_and_skipped_arrays_fresh(tmp_path):
  saver = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  saver.save(5, _state(head_classes=10, body_value=1.0))  # E.g. a 21k-class pretraining run.
  saver.close()
  fresh_state = _state(head_classes=3, body_value=0.0)  # A 3-class fine-tuning model.
  target = {"params": fresh_state["params"], "extra": fresh_state["extra"]}

  out, fresh, _, dropped = checkpoint.init_from(str(tmp_path), target)
  assert fresh == ["params/head/kernel"] and dropped == []  # (4, 10) vs (4, 3): at its init.
  np.testing.assert_array_equal(out["params"]["blocks"][0]["w"], np.ones(3))
  np.testing.assert_array_equal(out["params"]["head"]["kernel"], np.full((4, 3), 7.0))

  out, fresh, _, _ = checkpoint.init_from(str(tmp_path), target, skip=r"^params/blocks/")
  assert sorted(fresh) == ["params/blocks/0/w", "params/head/kernel"]
  np.testing.assert_array_equal(out["params"]["blocks"][0]["w"], np.zeros(3))


def test_init_from_names_the_checkpoints_arrays_the_model_has_no_place_for(tmp_path):
  # E.g. SWAG's ViT with its tanh pre-logits layer, fine-tuned without it (Table 5).
  _save(tmp_path, {"blocks": {"0": {"w": jnp.ones(3)}},
                   "pre_logits": {"kernel": jnp.ones((4, 4)), "bias": jnp.ones(4)}})
  target = {"params": {"blocks": {"0": {"w": jnp.zeros(3)}}}, "extra": {}}
  out, fresh, _, dropped = checkpoint.init_from(str(tmp_path), target)
  assert fresh == [] and dropped == ["params/pre_logits/bias", "params/pre_logits/kernel"]
  np.testing.assert_array_equal(out["params"]["blocks"]["0"]["w"], np.ones(3))


def _save(path, params):
  saver = checkpoint.Checkpointer(str(path), async_save=False)
  saver.save(1, {"step": jnp.zeros((), jnp.int32), "opt_state": {},
                 "skipped_records": jnp.zeros(()), "params": params, "extra": {}})
  saver.close()


def test_init_from_refuses_a_checkpoint_of_another_model_that_only_shares_the_head(tmp_path):
  """A RegNetY checkpoint given to a ViT: only the head's paths match. Loading it would start
  the whole backbone fresh under the name of fine-tuning; it is refused, naming both sides."""
  saver = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  saver.save(5, _state(head_classes=3, body_value=1.0))
  saver.close()
  other = {"params": {"head": {"kernel": jnp.zeros((4, 3))},
                      "encoder": {"w": jnp.zeros((3,)), "b": jnp.zeros((3,))}}, "extra": {}}
  with pytest.raises(ValueError, match=r"none of this model's 2 arrays outside the head is in "
                     r"the checkpoint: the checkpoint has e\.g\. params/blocks/0/w, "
                     r"params/head/kernel; this model params/encoder/b, params/encoder/w\."):
    checkpoint.init_from(str(tmp_path), other)
  # Its own arrays skipped on purpose: nothing is expected to load but the head.
  out, fresh, _, _ = checkpoint.init_from(str(tmp_path), other, skip=r"^params/encoder/")
  assert fresh == ["params/encoder/b", "params/encoder/w"]
  assert float(out["params"]["head"]["kernel"][0, 0]) == 7.0


def test_init_from_takes_the_models_adaptation_of_another_shape(tmp_path):
  """An array of another shape (a position embedding at a larger image size) takes what the
  model's hook makes of it; without the hook, it is refused, named."""
  pos = np.random.RandomState(0).randn(1, 1 + 4 * 4, 3).astype(np.float32)
  _save(tmp_path, {"cls_token": jnp.ones((1, 1, 3)), "pos_embed": jnp.asarray(pos)})
  target = {"params": {"cls_token": jnp.zeros((1, 1, 3)), "pos_embed": jnp.zeros((1, 37, 3))},
            "extra": {}}
  calls = []

  def adapt(path, saved):
    calls.append((path, tuple(saved.shape)))
    return jnp.full((1, 37, 3), saved[0, 0, 0])

  out, fresh, resized, _ = checkpoint.init_from(str(tmp_path), target, adapt=adapt)
  assert calls == [("params/pos_embed", (1, 17, 3))]
  assert fresh == [] and resized == ["params/pos_embed (1, 17, 3) -> (1, 37, 3)"]
  np.testing.assert_array_equal(out["params"]["pos_embed"], np.full((1, 37, 3), pos[0, 0, 0]))
  np.testing.assert_array_equal(out["params"]["cls_token"], np.ones((1, 1, 3)))
  with pytest.raises(ValueError, match=r"params/pos_embed \(1, 17, 3\) -> \(1, 37, 3\)"):
    checkpoint.init_from(str(tmp_path), target)
  with pytest.raises(ValueError, match=r"params/pos_embed \(1, 17, 3\) -> \(1, 37, 3\)"):
    checkpoint.init_from(str(tmp_path), target, adapt=lambda path, saved: None)


def test_init_from_refuses_other_shape_changes_naming_them(tmp_path):
  _save(tmp_path, {"blocks": {"0": {"kernel": jnp.ones((4, 8))}},
                   "head": {"kernel": jnp.ones((8, 10))}})
  target = {"params": {"blocks": {"0": {"kernel": jnp.zeros((4, 6))}},
                       "head": {"kernel": jnp.zeros((8, 3))}}, "extra": {}}
  with pytest.raises(ValueError, match=r"params/blocks/0/kernel \(4, 8\) -> \(4, 6\)"):
    checkpoint.init_from(str(tmp_path), target)
  out, fresh, _, _ = checkpoint.init_from(str(tmp_path), target, skip=r"^params/blocks/")
  assert sorted(fresh) == ["params/blocks/0/kernel", "params/head/kernel"]
  np.testing.assert_array_equal(out["params"]["blocks"]["0"]["kernel"], np.zeros((4, 6)))


def _stream(records, allow=False):
  """A TrainStream over 0, 1, 2, ... (grain), whose sources have `records` records."""
  import grain  # pylint: disable=import-outside-toplevel
  from input_pipeline import stream_position  # pylint: disable=import-outside-toplevel

  def make(position):
    return iter(grain.MapDataset.range(10**6).to_iter_dataset().map(
        lambda i: position.global_index(i)))
  return stream_position.TrainStream(make, num_workers=0, records=records,
                                     allow_other_records=allow)


def test_train_stream_closes_the_iterators_it_drops():
  """A restart elsewhere and close() close the iterator (with workers: their processes and
  the batches they prepared); the restarted stream reads from its new position."""
  from input_pipeline import stream_position  # pylint: disable=import-outside-toplevel
  stream = _stream({})
  first = stream.iterator
  assert [next(stream), next(stream)] == [0, 1]
  stream.restart(stream_position.Position(start=5))
  with pytest.raises(ValueError):
    next(first)
  assert next(stream) == 5
  stream.close()
  with pytest.raises(ValueError):
    next(stream)


def test_a_train_split_of_another_size_is_refused_on_resume(tmp_path, capsys):
  """The saved position indexes the shuffle order of the old split size: resuming over a
  re-prepared split of another size is refused, nothing moved; allowed, it warns and goes on."""
  from input_pipeline import stream_position  # pylint: disable=import-outside-toplevel
  state = _state(head_classes=3, body_value=1.0)
  stream = _stream({"demo": 100, "tfds:extra": 40})
  assert [next(stream) for _ in range(3)] == [0, 1, 2]
  saver = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  saver.save(4, state, stream)
  saver.close()
  files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))

  with pytest.raises(stream_position.StreamChanged,
                     match=r"\(demo: 100 records in the checkpoint's stream, 120 now\)"):
    checkpoint.Checkpointer(str(tmp_path), async_save=False).restore(
        state, _stream({"demo": 120, "tfds:extra": 40}))
  assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == files
  # The same check before a state exists (the trainer's, before it builds one).
  reader = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  check = functools.partial(stream_position.check_records, {"demo": 120, "tfds:extra": 40})
  with pytest.raises(stream_position.StreamChanged, match="since checkpoint step 4 in"):
    reader.refuse_another_configuration(functools.partial(check, allow_other_records=False))
  reader.refuse_another_configuration(functools.partial(check, allow_other_records=True))
  reader.refuse_another_configuration(functools.partial(
      stream_position.check_records, {"demo": 100}, allow_other_records=False))
  reader.refuse_another_configuration(functools.partial(check, allow_other_records=False),
                                      step=3)  # No such checkpoint: restore() says so.
  reader.close()

  for records in ({"demo": 100, "tfds:extra": 40}, {"demo": 100}):  # The same; or fewer known.
    again = _stream(records)
    _, step = checkpoint.Checkpointer(str(tmp_path), async_save=False).restore(state, again)
    assert step == 4 and next(again) == 3

  bare = tmp_path / "bare"  # Saved without the stream: it restores, the stream from its start.
  saver = checkpoint.Checkpointer(str(bare), async_save=False)
  saver.save(2, state)
  saver.close()
  fresh = _stream({"demo": 120})
  _, step = checkpoint.Checkpointer(str(bare), async_save=False).restore(state, fresh)
  assert step == 2 and next(fresh) == 0 and os.listdir(bare) == ["2"]

  allowed = _stream({"demo": 120, "tfds:extra": 40}, allow=True)
  _, step = checkpoint.Checkpointer(str(tmp_path), async_save=False).restore(state, allowed)
  assert step == 4 and next(allowed) == 3
  assert "WARNING: the train data changed since checkpoint step 4" in capsys.readouterr().out


def test_a_semantic_runs_meta_holds_its_class_tree_a_softmax_runs_does_not(demo_run):
  # The tree is rebuilt from the class list by a rule that may change: the checkpoint keeps
  # the one the level heads were trained for.
  from bigpretrain import objectives
  from bigpretrain.semantic import tree as tree_lib
  from input_pipeline import datasets
  from tests import helpers
  meta = checkpoint.read_meta(demo_run)  # A semantic_softmax run.
  built = tree_lib.SemanticTree.from_wnids(meta["class_names"])
  assert meta["class_tree"] == {"parent": built.parent.tolist()}
  assert built.num_levels > 1
  config = helpers.tiny_config("single_label")  # Softmax: the tree only adds eval metrics.
  info = datasets.get_dataset(config.data).info
  softmax = objectives.get_objective(config.objective, info)
  assert softmax.tree is not None and softmax.meta() == {}
  assert "class_tree" not in checkpoint.run_meta(config, {}, info.class_names,
                                                 info.num_classes, softmax.meta())


def test_one_steps_folder_given_for_a_checkpoint_folder_names_the_parent(tmp_path):
  _save(tmp_path, {"blocks": {"0": {"w": jnp.ones(3)}}})
  with pytest.raises(FileNotFoundError, match=rf"No checkpoint found in {tmp_path / '1'}\. It "
                     rf"is one checkpoint step's folder: pass the folder that holds the steps, "
                     rf"{tmp_path}\."):
    checkpoint.read_meta(str(tmp_path / "1"))
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match=r"No checkpoint found in \S+empty\.$"):
    checkpoint.read_meta(str(empty))
  (tmp_path / "a_file").write_text("")
  for path, what in (("a_file", "is a file, not a folder"), ("missing", "does not exist")):
    with pytest.raises(FileNotFoundError, match=rf"Checkpoint directory \S+{path} {what}\.$"):
      checkpoint.read_meta(str(tmp_path / path))
