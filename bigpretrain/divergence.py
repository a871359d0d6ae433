"""Divergence: which steps are bad, what the step does about them, and what the run does.

A step is bad when its loss or gradient norm is non-finite, or its loss exceeds
`config.divergence.loss_factor` times the running median of the last
`config.divergence.window` good steps' losses and is `config.divergence.min_rise` above it
(a spike rule as LLM Foundry's KillLossSpike callback applies to a window of recent losses).
The rule runs on device inside the train step (`assess`), so the host never waits on a step
to judge it: it reads the verdicts with the metrics it fetches anyway at log and checkpoint
steps (`Monitor`).

The loss of step t is the loss of the weights step t - 1 produced: a bad step t means the state
after step t - 1 has already diverged (an exploding update shows only in the next loss), and
so has every later one. Checkpoints of those states are moved aside, never kept as the latest.

Policies (config.divergence.policy): 'stop' ends the run at the first bad step with one line
naming it and the last good checkpoint; 'skip' applies no update on a bad step, counts it
in 'train/skipped_steps' (over the whole run, resumes included) and stops only after
`max_consecutive_skips` bad steps in a row (the weights themselves have diverged: no batch
gives a good loss any more). PaLM (Chowdhery et al. 2022, section 5.1) met loss spikes by
restarting about 100 steps before one and skipping the 200-500 batches around it; 'skip' is
the in-step form, skipping the bad batches alone, and `resume_step` the restart.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax

POLICIES = ("stop", "skip")


class Diverged(FloatingPointError):
  """The run stopped on a bad step; the message names it and the last good checkpoint."""


def init_health(window: int) -> dict:
  """The step's running record: the last `window` good losses (NaN = empty), the count of
  skipped steps and the bad steps in a row up to the last one (0 after a good step). Saved in
  the checkpoints, so that a resumed run judges its steps, counts a run of bad steps and
  moves checkpoints aside as the uninterrupted run would; one restored from a checkpoint
  without it (written before it was saved, or with another window) starts anew."""
  return {"losses": jnp.full((window,), jnp.nan, jnp.float32),
          "skipped_steps": jnp.zeros((), jnp.int32), "bad_run": jnp.zeros((), jnp.int32)}


def assess(health: dict, loss, grad_norm, loss_factor: float, min_rise: float = 0.0):
  """(healthy, median, new health) for one step, on device. A spike is a loss above
  `loss_factor` x the median of the good losses in the window that is also `min_rise` above
  it (so that the noise of a small loss, e.g. a fine-tune's 0.05 -> 0.6, is no spike). The
  median is NaN while the window is empty, and then no spike is called; only a good loss
  enters the window, so a spike never raises the bar for the next one."""
  losses = health["losses"]
  median = jnp.nanmedian(losses)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  spike = ((loss > loss_factor * median) & (loss > median + min_rise) if loss_factor > 0
           else jnp.zeros((), bool))
  healthy = finite & ~spike
  pushed = jnp.roll(losses, 1).at[0].set(loss.astype(jnp.float32))
  losses = jnp.where(healthy, pushed, losses)
  bad_run = jnp.where(healthy, 0, health["bad_run"] + 1).astype(jnp.int32)
  return healthy, median, {**health, "losses": losses, "bad_run": bad_run}


def keep_if(healthy, new, old):
  """`new` where the step was healthy, else `old` (leaf by leaf): the skip policy's update.

  The learning-rate schedule's own counter (optax.ScaleByScheduleState) always advances: the
  schedule follows the run's step, so a run with skipped steps still ends its schedule at
  total_steps and the logged train/lr is the one applied. The optimizer's moments and their
  bias-correction count stay as they were, as no update was applied."""
  def pick(n, o):
    if isinstance(n, optax.ScaleByScheduleState):
      return n
    return jnp.where(healthy, n, o)
  return jax.tree.map(pick, new, old,
                      is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))


def _reason(row: dict, loss_factor: float, window: int) -> str:
  loss, grad_norm, median = (float(row[k]) for k in
                             ("train/loss", "train/grad_norm", "_loss_median"))
  if not np.isfinite(loss):
    return f"non-finite loss {loss}"
  if not np.isfinite(grad_norm):
    return f"non-finite gradient norm {grad_norm}"
  return (f"loss {loss:.4g} > {loss_factor:g} x {median:.4g}, the median of up to {window} "
          "recent good losses")


class Monitor:
  """Host side: reads the verdicts of fetched step rows in order, confirms the checkpoints
  whose state gave a good loss, and raises Diverged when the policy says stop.

  `checkpointer`: a checkpoint.Checkpointer (confirm, set_aside_from, latest_step)."""

  def __init__(self, config, checkpointer):
    self.policy = config.divergence.policy
    self.loss_factor = config.divergence.loss_factor
    self.window = config.divergence.window
    self.max_skips = config.divergence.max_consecutive_skips
    self.checkpointer = checkpointer
    self.seen = -1  # The last step read.
    self.bad_since = None  # The first step of the current run of bad steps.

  def observe(self, rows) -> None:
    """`rows`: [(step, host metrics)] in step order; steps already read are passed over."""
    good_through = None
    for step, row in rows:
      if step <= self.seen:
        continue
      self.seen = step
      if bool(row["_healthy"]):
        self.bad_since, good_through = None, step - 1
        continue
      # From the step's own count: a run of bad steps goes on across a resume.
      self.bad_since = step - int(row["_bad_run"]) + 1
      if self.policy == "stop" or step - self.bad_since + 1 > self.max_skips:
        self._stop(step, row)
    if good_through is not None:
      self.checkpointer.confirm(good_through)

  def _stop(self, step: int, row: dict) -> None:
    reason = _reason(row, self.loss_factor, self.window)
    if self.policy == "skip":
      reason = (f"{step - self.bad_since + 1} bad steps in a row since step {self.bad_since}, "
                f"more than divergence.max_consecutive_skips={self.max_skips}; the last: "
                f"{reason}")
    # The state before the first bad step produced it: it and every later one diverged.
    moved, aside = self.checkpointer.set_aside_from(self.bad_since - 1, "diverged")
    last = self.checkpointer.latest_step()
    where = self.checkpointer.directory
    text = f"the run diverged at step {step} ({reason}). "
    text += (f"Last good checkpoint: step {last} in {where}" if last is not None else
             f"No checkpoint was taken before it in {where}")
    if moved:
      text += f"; checkpoints {moved} (of the diverging state) moved to {aside}"
    if last is not None:
      text += (". Re-run to resume from it with a lower optim.lr "
               "(--config.allow_schedule_change=True), optim.grad_clip_norm or "
               "--config.divergence.policy=skip; --config.resume_step=N goes back further.")
    else:
      text += ". Re-run with a lower optim.lr or optim.grad_clip_norm."
    raise Diverged(text)
