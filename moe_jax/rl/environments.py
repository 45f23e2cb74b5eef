"""Which tasks exist, how a config names them, and the held-out split.

  data.tasks = "addition,retrieval,tools"      (data.retrieval_pairs sizes the retrieval;
                                               data.addition_reversed writes sums reversed;
                                               data.demo_mistake_rate: the warm-up's
                                               imperfect teacher, rl/tasks.py)

Problems are drawn deterministically from (seed, index), the tasks taken in turn by index.
A prompt whose CRC32 is 0 mod 20 is held out: training (the warm-up rows and GRPO's
prompts) never sees it, and pass@1 is measured only on such prompts.
"""

import zlib

import numpy as np

from moe_jax.rl.tasks import Addition, Problem, Retrieval, Reversal, Task
from moe_jax.rl.tools import ToolTask

TASKS = ("addition", "reversal", "retrieval", "tools")
SPLITS = ("train", "eval")


def make_tasks(data_cfg) -> list[Task]:
  names = [n.strip() for n in data_cfg.tasks.split(",") if n.strip()]
  if not names or any(n not in TASKS for n in names):
    raise ValueError(f"data.tasks must be a comma-separated list of {TASKS}, got "
                     f"{data_cfg.tasks!r}")
  rate = data_cfg.get("demo_mistake_rate", 0.0)
  make = {"addition": lambda: Addition(reversed=data_cfg.addition_reversed, mistake_rate=rate),
          "reversal": Reversal,
          "tools": lambda: ToolTask(mistake_rate=rate),
          "retrieval": lambda: Retrieval(data_cfg.retrieval_pairs, mistake_rate=rate)}
  return [make[n]() for n in names]


def held_out(prompt: str) -> bool:
  return zlib.crc32(prompt.encode()) % 20 == 0


def draw(tasks: list[Task], seed: int, index: int, split: str) -> Problem:
  """Problem `index` of a split: the same for the same (seed, index), on any machine."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  rng = np.random.default_rng((seed, index))
  task = tasks[index % len(tasks)]
  while True:
    p = task.sample(rng)
    if held_out(p.prompt) == (split == "eval"):
      return p
