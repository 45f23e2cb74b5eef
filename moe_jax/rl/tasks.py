"""Single-turn verifiable tasks a byte-level model can learn on CPU.

A task draws a `Problem` (the prompt text and the environment state the rewards read,
the true answer among it) and writes its demonstration for the supervised warm-up: text
pieces, each trained on or not. The model answers right after the prompt and ends with EOS.

  addition    "123+45="                      → "168" (2–3 digit operands; "861" with
                                                  data.addition_reversed)
  reversal    "rev kqzpa="                   → "apzqk"
  retrieval   "k17:42 k03:11 … k55:09 ?k17=" → "42", 4 to data.retrieval_pairs pairs, the
              asked key in the first quarter of them, so the answer sits far back in the
              context (context use)
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Problem:
  prompt: str
  state: dict          # what rewards and tools read: {"task", "answer", ...}


class Task:
  """A task: problems, demonstrations, and (multi-turn ones) tool responses."""
  name = ""
  stop_sequences: tuple[str, ...] = ()   # text that ends a model turn (a tool call's close)

  def sample(self, rng: np.random.Generator) -> Problem:
    raise NotImplementedError

  def demonstration(self, problem: Problem) -> list[tuple[str, bool]]:
    """[(text, trained)] after the prompt: a single-turn answer is one trained piece."""
    return [(problem.state["answer"], True)]

  def respond(self, problem: Problem, completion: str) -> str | None:
    """The environment's reply to the model's text so far; None ends the episode."""
    del problem, completion
    return None


class Addition(Task):
  """Each operand has min_digits to max_digits digits, the count drawn uniformly (so 2 + 2,
  2 + 3 and 3 + 3 digits are all common, not 90% 3 + 3 as uniform numbers would give).

  reversed: the sum is written least-significant digit first ("123+45=" → "861"), so each
  digit depends only on digits already seen and the carry: the format in which small
  transformers learn addition from few examples (Lee et al. 2023, "Teaching Arithmetic to
  Small Transformers"). Off, the answer is the plain sum."""
  name = "addition"

  def __init__(self, min_digits: int = 2, max_digits: int = 3, reversed: bool = False):
    self.min_digits, self.max_digits, self.reversed = min_digits, max_digits, reversed

  def sample(self, rng):
    a, b = (int(rng.integers(10 ** (n - 1), 10 ** n))
            for n in rng.integers(self.min_digits, self.max_digits + 1, size=2))
    answer = str(a + b)[::-1] if self.reversed else str(a + b)
    return Problem(f"{a}+{b}=", {"task": self.name, "answer": answer})


class Reversal(Task):
  name = "reversal"

  def __init__(self, min_len: int = 3, max_len: int = 8):
    self.min_len, self.max_len = min_len, max_len

  def sample(self, rng):
    n = int(rng.integers(self.min_len, self.max_len + 1))
    word = "".join(chr(ord("a") + int(i)) for i in rng.integers(0, 26, size=n))
    return Problem(f"rev {word}=", {"task": self.name, "answer": word[::-1]})


class Retrieval(Task):
  """Between min_pairs and max_pairs key:value pairs (uniform), so difficulty is spread: a
  fixed count makes accuracy jump from ~0 to ~1 once the model finds the lookup, which
  leaves GRPO nothing to improve on either side of the jump."""
  name = "retrieval"

  def __init__(self, max_pairs: int = 12, min_pairs: int = 4):
    if not 4 <= min_pairs <= max_pairs <= 90:
      raise ValueError(f"retrieval pairs must satisfy 4 <= min_pairs <= max_pairs <= 90, got "
                       f"min_pairs={min_pairs}, max_pairs={max_pairs}")
    self.min_pairs, self.max_pairs = min_pairs, max_pairs

  def sample(self, rng):
    n = int(rng.integers(self.min_pairs, self.max_pairs + 1))
    keys = rng.choice(np.arange(10, 100), size=n, replace=False)
    values = rng.integers(10, 100, size=n)
    asked = int(rng.integers(0, max(1, n // 4)))
    context = " ".join(f"k{k}:{v}" for k, v in zip(keys, values))
    return Problem(f"{context} ?k{keys[asked]}=",
                   {"task": self.name, "answer": str(values[asked])})
