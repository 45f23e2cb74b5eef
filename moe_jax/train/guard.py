"""Divergence guard (config `train.guard`): when to roll back to the last good checkpoint.

Non-finite gradients are already skipped inside the train step. This watches what that
misses: a loss spike that stays finite (loss > spike_factor × the EMA of the healthy
losses), and a run of `max_skipped` skipped updates in a row. The loop then restores the
newest checkpoint before the trigger and skips the batches from there through the one
that triggered, plus `skip_batches` more (PaLM and OLMo restart before a spike and skip
the data around it). More than `max_rollbacks` rollbacks stop the run.
"""

import dataclasses

import ml_collections


@dataclasses.dataclass
class Trigger:
  step: int      # the step whose update triggered (1-based: state.step after it)
  loss: float    # that step's loss
  reason: str


class DivergenceGuard:
  """Host-side state: the healthy-loss EMA, skipped updates in a row, rollbacks so far."""

  def __init__(self, g: ml_collections.ConfigDict):
    self.g = g
    self.ema = None
    self.healthy_steps = 0
    self.skipped_in_a_row = 0
    self.last_skipped_total = None   # the count restored with the state: the baseline
    self.rollbacks = 0

  def observe(self, step: int, loss: float, skipped_total: float) -> Trigger | None:
    """Feeds one step's loss and cumulative skipped-update count; a Trigger to roll back."""
    g = self.g
    skipped = self.last_skipped_total is not None and skipped_total > self.last_skipped_total
    self.last_skipped_total = skipped_total
    self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
    if self.skipped_in_a_row >= g.max_skipped:
      return Trigger(step, loss, f"{self.skipped_in_a_row} skipped (non-finite) updates in a row")
    if skipped:
      return None
    if self.ema is not None and self.healthy_steps >= g.warmup_steps and (
        loss > g.spike_factor * self.ema):
      return Trigger(step, loss, f"loss {loss:.4g} > {g.spike_factor} x its EMA {self.ema:.4g}")
    decay = 1.0 - 1.0 / g.ema_steps
    self.ema = loss if self.ema is None else decay * self.ema + (1.0 - decay) * loss
    self.healthy_steps += 1
    return None

  def rolled_back(self, trigger: Trigger):
    """Counts a rollback (RuntimeError past max_rollbacks); skipped updates count afresh."""
    self.rollbacks += 1
    if self.rollbacks > self.g.max_rollbacks:
      raise RuntimeError(
          f"divergence guard: {trigger.reason} at step {trigger.step}, after "
          f"{self.g.max_rollbacks} rollbacks already (train.guard.max_rollbacks); stopping. "
          f"Lower the learning rate or inspect the data near step {trigger.step}.")
    self.skipped_in_a_row = 0
    self.last_skipped_total = None   # the restored state carries an older count
