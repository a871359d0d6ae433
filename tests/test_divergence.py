"""A diverging run never costs its last good checkpoint: it stops with one line naming the
step and that checkpoint, `resume_step` goes back to an earlier one, and the skip policy skips
bad steps and counts them. Real demo runs: one diverging `bigpretrain.main` shared by the
tests, the rest in-process."""
import os
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from bigpretrain import config_lib
from bigpretrain import divergence
from bigpretrain.runtime import goodput
from bigpretrain.runtime import metric_writers
from bigpretrain import train
from tests import helpers

# Step 1 has lr 0 (the warmup starts there), step 2 lr 2e5: its update explodes the weights,
# which shows in step 3's loss. The loss of step 3 judges the state after step 2.
_DIVERGING = {"optim.lr": 1e6, "optim.schedule.name": "cosine", "optim.schedule.warmup_steps": 5,
              "total_steps": 8, "ckpt_every_steps": 1, "keep_ckpts": 1}


def _steps(folder) -> list[int]:
  return sorted(int(p) for p in os.listdir(folder) if p.isdigit()) if os.path.isdir(folder) else []


def _max_abs_weight(step_dir) -> float:
  with ocp.PyTreeCheckpointer() as reader:
    weights = reader.restore(os.path.join(step_dir, "params"))
  return max(float(np.max(np.abs(np.asarray(w)))) for w in jax.tree.leaves(weights))


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("diverged")
  # Rows every 2 steps: the bad step 3 is met at its checkpoint, between two rows.
  result = helpers.run_main(helpers.main_args(workdir, **_DIVERGING, log_every_steps=2))
  return workdir, result


@pytest.mark.slow
def test_divergence_stops_with_one_line_and_keeps_the_last_good_checkpoint(diverged):
  workdir, r = diverged
  assert r.returncode == 1, r.stderr[-3000:]
  assert "Traceback" not in r.stderr
  errors = [line for line in r.stderr.splitlines() if line.startswith("ERROR")]
  assert len(errors) == 1, errors
  # The exploded weights give a huge loss and, by how far float32 reaches, maybe an inf
  # gradient norm: either names step 3.
  assert re.match(r"ERROR: the run diverged at step 3 \((loss |non-finite gradient norm)",
                  errors[0]), errors[0]
  assert f"Last good checkpoint: step 1 in {workdir}/checkpoints;" in errors[0]
  # keep_ckpts=1: writing step 2 did not rotate step 1 out, and step 2 (the exploded
  # weights) is no longer the latest.
  assert _steps(workdir / "checkpoints") == [1]
  assert _steps(workdir / "checkpoints_diverged") == [2]
  assert _max_abs_weight(workdir / "checkpoints" / "1") < 10
  assert _max_abs_weight(workdir / "checkpoints_diverged" / "2") > 1e3
  rows = metric_writers.read_metrics(str(workdir))  # The blow-up is logged, at step 3.
  assert [r["step"] for r in rows] == [2, 3] and rows[1]["train/loss"] > 1e3 * rows[0][
      "train/loss"]


@pytest.mark.slow
def test_a_rerun_resumes_from_the_last_good_and_resume_step_goes_back(diverged, capsys):
  workdir, _ = diverged
  sane = {**_DIVERGING, "optim.lr": 1e-3, "optim.schedule.warmup_steps": 0,
          "allow_schedule_change": True, "total_steps": 4,
          "evals": ml_collections.ConfigDict()}  # Training only: what is tested here.
  train.train_and_evaluate(helpers.tiny_config(**sane), str(workdir))
  assert "Resuming from step 1 in" in capsys.readouterr().out
  # Step 4 waits for a later step's loss to confirm it: kept beside keep_ckpts=1 good ones.
  assert _steps(workdir / "checkpoints") == [3, 4]

  with pytest.raises(ValueError, match=r"resume_step=7: .* has no checkpoint of that step; it "
                                       r"has steps \[3, 4\]\."):
    train.train_and_evaluate(helpers.tiny_config(resume_step=7, **sane), str(workdir))

  train.train_and_evaluate(helpers.tiny_config(resume_step=3, **sane), str(workdir))
  out = capsys.readouterr().out
  assert "Resuming from step 3 in" in out
  assert f"checkpoints [4] moved to {workdir}/checkpoints_superseded/" in out
  assert _steps(workdir / "checkpoints_superseded") == [4]
  assert _steps(workdir / "checkpoints") == [3, 4]  # Step 4 trained again.


def test_skip_policy_keeps_the_weights_of_bad_steps_and_counts_them(tmp_path):
  # lr 1e10: step 1's update explodes the weights; every later loss is bad.
  config = helpers.tiny_config(**{"optim.lr": 1e10, "optim.schedule.name": "constant",
                                  "divergence.policy": "skip",
                                  "divergence.max_consecutive_skips": 2})
  with pytest.raises(divergence.Diverged,
                     match=r"diverged at step 4 \(3 bad steps in a row since step 2, more than "
                           r"divergence.max_consecutive_skips=2; the last: "):
    train.train_and_evaluate(config, str(tmp_path))
  rows = metric_writers.read_metrics(str(tmp_path))
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert [r["train/skipped_steps"] for r in rows] == [0, 1, 2, 3]
  first, *bad = [r["train/loss"] for r in rows]
  assert all(not np.isfinite(loss) or loss > 10 * first for loss in bad), (first, bad)
  # The skipped steps applied no update: the weights stay step 1's (exploded, finite).
  norms = [r["train/param_norm"] for r in rows]
  assert 1e9 < norms[0] < np.inf and norms[1:] == [norms[0]] * 3


class _Confirms:
  def confirm(self, step):
    del step


def _interval_row(losses, healthy):
  """The metrics row _Pending writes for steps 1.. with these losses (also their gradient
  norms) and verdicts, under the skip policy."""
  config = config_lib.base_config()
  config.divergence.policy = "skip"
  pending = train._Pending(divergence.Monitor(config, _Confirms()))
  skipped = np.cumsum(~np.array(healthy))
  bad_run = 0
  for step, (loss, ok) in enumerate(zip(losses, healthy), 1):
    bad_run = 0 if ok else bad_run + 1
    pending.add(step, {"train/loss": jnp.float32(loss), "train/grad_norm": jnp.float32(loss),
                       "train/skipped_steps": jnp.int32(skipped[step - 1]),
                       "_healthy": jnp.bool_(ok), "_loss_median": jnp.float32(2.0),
                       "_bad_run": jnp.int32(bad_run)}, 16)
  row, error = pending.flush(goodput.IntervalTimer())
  assert error is None
  return row


def test_a_skipped_steps_values_stay_out_of_the_rows_means():
  row = _interval_row([2.0, np.nan, 2.2, 1e4], [True, False, True, False])
  assert row["train/loss"] == pytest.approx(2.1) and row["train/grad_norm"] == pytest.approx(2.1)
  assert row["train/skipped_steps"] == 2  # Still counted.
  row = _interval_row([np.nan, 1e4], [False, False])  # Every step bad: the row shows them.
  assert np.isnan(row["train/loss"]) and row["train/skipped_steps"] == 2


def test_a_skipped_step_keeps_the_moments_but_the_schedule_follows_the_step():
  schedule = optax.linear_schedule(0.0, 1.0, 10)
  tx = optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(schedule))
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  grads = {"w": jnp.full(3, 2.0)}
  for step, healthy in enumerate((True, False, False, True)):
    updates, new = tx.update(grads, state, params)
    np.testing.assert_allclose(updates["w"], -schedule(step) * np.ones(3), rtol=1e-4)
    state = divergence.keep_if(jnp.bool_(healthy), new, state)
  adam_state, schedule_state = state
  # Two updates applied: adam's bias-correction count and moments saw two steps (mu of a
  # constant gradient g after n steps: g * (1 - 0.9^n)); the schedule saw all four.
  assert int(adam_state.count) == 2 and int(schedule_state.count) == 4
  np.testing.assert_allclose(adam_state.mu["w"], 2.0 * (1 - 0.9**2) * np.ones(3), rtol=1e-6)


def test_a_bad_step_is_a_non_finite_one_or_a_spike_over_the_running_median():
  window = jnp.array([3.0, 1.0, 2.0, jnp.nan], jnp.float32)  # Median of the good ones: 2.
  health = {"losses": window, "skipped_steps": jnp.zeros((), jnp.int32),
            "bad_run": jnp.int32(2)}
  for loss, grad_norm, healthy in ((19.9, 1.0, True), (20.1, 1.0, False),
                                   (np.nan, 1.0, False), (1.0, np.inf, False)):
    ok, median, new = divergence.assess(health, jnp.float32(loss), jnp.float32(grad_norm), 10.0)
    assert bool(ok) == healthy and float(median) == 2.0
    assert int(new["bad_run"]) == (0 if healthy else 3)  # The bad steps in a row.
    expected = [loss, 3.0, 1.0, 2.0] if healthy else [3.0, 1.0, 2.0, np.nan]
    np.testing.assert_array_equal(np.asarray(new["losses"]), np.float32(expected))
  # An empty window (a fresh run) calls no spike; factor 0 calls none at all.
  empty = divergence.init_health(4)
  assert bool(divergence.assess(empty, jnp.float32(1e9), jnp.float32(1.0), 10.0)[0])
  assert bool(divergence.assess(health, jnp.float32(1e9), jnp.float32(1.0), 0.0)[0])
  # A small loss's noise: 12x its median but only 0.55 above it is no spike at min_rise 1.
  small = {"losses": jnp.array([0.05, 0.04, 0.06, jnp.nan], jnp.float32),
           "skipped_steps": jnp.zeros((), jnp.int32), "bad_run": jnp.zeros((), jnp.int32)}
  assert bool(divergence.assess(small, jnp.float32(0.6), jnp.float32(1.0), 10.0, 1.0)[0])
  assert not bool(divergence.assess(small, jnp.float32(0.6), jnp.float32(1.0), 10.0, 0.0)[0])
  assert not bool(divergence.assess(small, jnp.float32(1.2), jnp.float32(1.0), 10.0, 1.0)[0])


@pytest.mark.parametrize("key, value, message", [
    ("divergence.policy", "rewind", "divergence.policy='rewind' must be one of"),
    ("divergence.loss_factor", 0.5, "divergence.loss_factor=0.5 must be a number > 1"),
    ("divergence.window", 0, "divergence.window=0 must be an int >= 1"),
    ("divergence.min_rise", -1.0, "divergence.min_rise=-1.0 must be a number >= 0"),
    ("resume_step", -2, "resume_step=-2 must be a checkpoint step >= 0"),
])
def test_divergence_keys_are_validated(key, value, message):
  config = helpers.set_overrides(config_lib.base_config(), {key: value})
  with pytest.raises(ValueError, match=message):
    config_lib.validate(config)


class _Aside:
  """A checkpointer stand-in for Monitor: records what it is asked to move aside."""

  def __init__(self):
    self.moved_from = None

  def confirm(self, step):
    del step

  def set_aside_from(self, step, why):
    self.moved_from = step
    return [s for s in (2, 4) if s >= step], f"checkpoints_{why}"

  def latest_step(self):
    return None

  directory = "ckpts"


def test_a_run_of_bad_steps_goes_on_across_a_resume():
  """A resumed run's monitor starts fresh; the step's own count (health 'bad_run', restored
  from the checkpoint) still dates the run of bad steps from before the resume."""
  config = config_lib.base_config()
  config.divergence.policy = "skip"
  config.divergence.max_consecutive_skips = 3
  aside = _Aside()
  monitor = divergence.Monitor(config, aside)  # Resumed at step 4, steps 2-4 bad before it.
  row = {"train/loss": jnp.float32(np.nan), "train/grad_norm": jnp.float32(1.0),
         "_healthy": jnp.bool_(False), "_loss_median": jnp.float32(2.0),
         "_bad_run": jnp.int32(4)}
  with pytest.raises(divergence.Diverged, match=r"diverged at step 5 \(4 bad steps in a row "
                     r"since step 2, .*checkpoints \[2, 4\]"):
    monitor.observe([(5, row)])
  assert aside.moved_from == 1  # Step 1's state gave step 2's bad loss.
