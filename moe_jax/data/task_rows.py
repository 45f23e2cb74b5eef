"""Rows of task demonstrations (data.source = "tasks"): the supervised warm-up that teaches a
model the task format before GRPO (moe_jax/rl/).

Each demonstration is BOS, the prompt, then the task's pieces (a tool task's reply between
the model's turns) and EOS, as one segment. Demonstrations are packed whole into rows of
seq_len; the loss is on the pieces the model would write and on EOS, never on the prompt
or tool output. Row i depends only on (seed, i).
"""

import numpy as np

from moe_jax.data import tokenizer
from moe_jax.rl import environments


def demonstration(task, problem) -> tuple[np.ndarray, np.ndarray]:
  """(token ids, trained flag per token) of one demonstration."""
  ids, trained = [tokenizer.encode(problem.prompt, eos=False)], []
  trained.append(np.zeros(len(ids[0]), bool))
  for text, is_trained in task.demonstration(problem):
    piece = tokenizer.encode(text, bos=False, eos=False)
    ids.append(piece)
    trained.append(np.full(len(piece), is_trained))
  ids.append(np.array([tokenizer.EOS], np.int32))
  trained.append(np.ones(1, bool))
  return np.concatenate(ids).astype(np.int32), np.concatenate(trained)


class TaskRows:
  """Random-access packed rows of demonstrations from one split (a grain data source)."""

  _PER_ROW = 1000   # demonstration indices reserved per row

  def __init__(self, data_cfg, seq_len: int, seed: int, split: str = "train",
               length: int = 2**31 - 1):
    self.tasks = environments.make_tasks(data_cfg)
    self.seq_len, self.seed, self.split, self.length = seq_len, seed, split, length
    by_name = {t.name: t for t in self.tasks}
    for j in range(len(self.tasks)):   # one of each task must fit a row
      p = environments.draw(self.tasks, seed, j, split)
      n = len(demonstration(by_name[p.state["task"]], p)[0])
      if n > seq_len:
        raise ValueError(f"data.seq_len={seq_len} is shorter than a {p.state['task']} "
                         f"demonstration ({n} tokens)")
    self._by_name = by_name

  def __len__(self):
    return self.length

  def __getitem__(self, i):
    L = self.seq_len
    tokens_L = np.full(L, tokenizer.PAD, np.int32)
    targets_L = np.full(L, tokenizer.PAD, np.int32)
    segment_ids_L = np.zeros(L, np.int32)
    positions_L = np.zeros(L, np.int32)
    loss_mask_L = np.zeros(L, np.float32)
    at, seg = 0, 0
    for j in range(self._PER_ROW):
      p = environments.draw(self.tasks, self.seed, int(i) * self._PER_ROW + j, self.split)
      ids, trained = demonstration(self._by_name[p.state["task"]], p)
      n = len(ids)
      if at + n > L:
        break
      seg += 1
      tokens_L[at:at + n], segment_ids_L[at:at + n] = ids, seg
      positions_L[at:at + n] = np.arange(n)
      targets_L[at:at + n - 1] = ids[1:]
      loss_mask_L[at:at + n - 1] = trained[1:]
      at += n
    return {"tokens": tokens_L, "targets": targets_L, "segment_ids": segment_ids_L,
            "positions": positions_L, "loss_mask": loss_mask_L}
