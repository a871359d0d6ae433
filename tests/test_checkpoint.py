"""Checkpoint helpers: initialising a model from a checkpoint of a different model."""
import jax.numpy as jnp
import numpy as np

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

  out, fresh = checkpoint.init_from(str(tmp_path), target)
  assert fresh == ["params/head/kernel"]  # Shape (4, 10) vs (4, 3): left at its init.
  np.testing.assert_array_equal(out["params"]["blocks"][0]["w"], np.ones(3))
  np.testing.assert_array_equal(out["params"]["head"]["kernel"], np.full((4, 3), 7.0))

  out, fresh = checkpoint.init_from(str(tmp_path), target, skip=r"^params/blocks/")
  assert sorted(fresh) == ["params/blocks/0/w", "params/head/kernel"]
  np.testing.assert_array_equal(out["params"]["blocks"][0]["w"], np.zeros(3))
