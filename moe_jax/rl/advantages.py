"""Group-relative advantages (GRPO): each completion's reward against the other completions
of its prompt.

  A_i = r_i − mean(group)                       scale "none" (Dr. GRPO)
  A_i = (r_i − mean(group)) / (std(group) + ε)  scale "group" (GRPO, DeepSeekMath)
  A_i = (r_i − mean(group)) / (std(batch) + ε)  scale "batch"

std is the population std (ddof 0). A group whose rewards are all equal gets A = 0: it
carries no signal.
"""

import numpy as np

SCALES = ("group", "batch", "none")


def group_advantages(rewards_R, group_size: int, scale: str = "group", eps: float = 1e-4):
  """rewards [R] with the G completions of each prompt adjacent → advantages [R] (float32)."""
  if scale not in SCALES:
    raise ValueError(f"rl.advantage_scale must be one of {SCALES}, got {scale!r}")
  r_PxG = np.asarray(rewards_R, np.float64).reshape(-1, group_size)
  a_PxG = r_PxG - r_PxG.mean(1, keepdims=True)
  if scale == "group":
    a_PxG = a_PxG / (r_PxG.std(1, keepdims=True) + eps)
  elif scale == "batch":
    a_PxG = a_PxG / (r_PxG.std() + eps)
  return a_PxG.reshape(-1).astype(np.float32)
