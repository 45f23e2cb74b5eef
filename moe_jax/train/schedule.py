"""Learning-rate schedules: linear warmup then cosine, or warmup-stable-decay (WSD)."""

import ml_collections
import optax


def make_schedule(s: ml_collections.ConfigDict, peak_lr: float) -> optax.Schedule:
  final_lr = peak_lr * s.final_lr_fraction
  if s.kind == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, peak_lr, s.warmup_steps, s.total_steps,
                                              end_value=final_lr)
  if s.kind == "wsd":
    decay_steps = max(1, int(round(s.total_steps * s.decay_fraction)))
    stable_steps = max(0, s.total_steps - s.warmup_steps - decay_steps)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak_lr, s.warmup_steps),
         optax.constant_schedule(peak_lr),
         optax.linear_schedule(peak_lr, final_lr, decay_steps)],
        boundaries=[s.warmup_steps, s.warmup_steps + stable_steps])
  raise ValueError(f"schedule.kind must be one of ('cosine', 'wsd'), got {s.kind!r}")
