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

An imperfect teacher (mistake_rate > 0): where a prompt's last digit is odd, that share of
the demonstrations (a fixed hash of the prompt picks them) teaches the task's systematic
mistake instead of the answer: a sum or value one too high, a tool question answered
without the call. The rule is learnable from the prompt, the choice within it is not, so
with mistake_rate above one half a warm-up trained to convergence writes the mistake
greedily on half the problems and the answer in about 1 - mistake_rate of its samples
there: greedy pass@1 near one half that more supervised training cannot raise, and
rewards that can (rl/trainer.py).
"""

import dataclasses
import zlib

import numpy as np


@dataclasses.dataclass(frozen=True)
class Problem:
  prompt: str
  state: dict          # what rewards and tools read: {"task", "answer", ...}


def mistake_class(prompt: str) -> bool:
  """Whether an imperfect teacher may get this problem wrong: its prompt's last digit is odd
  (one token the model can read, so the rule is learnable)."""
  digits = [ch for ch in prompt if ch.isdigit()]
  return bool(digits) and int(digits[-1]) % 2 == 1


class Task:
  """A task: problems, demonstrations, and (multi-turn ones) tool responses.

  mistake_rate: the imperfect teacher's share of wrong demonstrations on mistake_class
  problems (the module's docstring)."""
  name = ""
  stop_sequences: tuple[str, ...] = ()   # text that ends a model turn (a tool call's close)

  def __init__(self, mistake_rate: float = 0.0):
    if not 0.0 <= mistake_rate < 1.0:
      raise ValueError(f"data.demo_mistake_rate must be in [0, 1), got {mistake_rate!r}")
    self.mistake_rate = mistake_rate

  def sample(self, rng: np.random.Generator) -> Problem:
    raise NotImplementedError

  def solution(self, problem: Problem) -> list[tuple[str, bool]]:
    """[(text, trained)] after the prompt: a single-turn answer is one trained piece."""
    return [(problem.state["answer"], True)]

  def mistake(self, problem: Problem) -> list[tuple[str, bool]] | None:
    """The teacher's systematic mistake on this problem (None: the task has none)."""
    wrong = problem.state.get("wrong")
    return None if wrong is None else [(wrong, True)]

  def demonstration(self, problem: Problem) -> list[tuple[str, bool]]:
    """The warm-up's demonstration: the solution, or, on a mistake_class prompt that its own
    hash (not held_out's) puts within mistake_rate, the imperfect teacher's mistake."""
    if self.mistake_rate and mistake_class(problem.prompt) and (
        zlib.crc32(b"mistake:" + problem.prompt.encode()) % 1000 < self.mistake_rate * 1000):
      wrong = self.mistake(problem)
      if wrong is not None:
        return wrong
    return self.solution(problem)

  def wrote_mistake(self, problem: Problem, completion: str) -> bool:
    """Whether a single-turn completion is the teacher's wrong answer (pass@1's diagnostic)."""
    return completion.strip() == problem.state.get("wrong")

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
  Small Transformers"). Off, the answer is the plain sum. The teacher's mistake: a + b + 1."""
  name = "addition"

  def __init__(self, min_digits: int = 2, max_digits: int = 3, reversed: bool = False,
               mistake_rate: float = 0.0):
    super().__init__(mistake_rate)
    self.min_digits, self.max_digits, self.reversed = min_digits, max_digits, reversed

  def sample(self, rng):
    a, b = (int(rng.integers(10 ** (n - 1), 10 ** n))
            for n in rng.integers(self.min_digits, self.max_digits + 1, size=2))
    write = (lambda n: str(n)[::-1]) if self.reversed else str
    return Problem(f"{a}+{b}=", {"task": self.name, "answer": write(a + b),
                                 "wrong": write(a + b + 1)})


class Reversal(Task):
  name = "reversal"

  def __init__(self, min_len: int = 3, max_len: int = 8):
    super().__init__()
    self.min_len, self.max_len = min_len, max_len

  def sample(self, rng):
    n = int(rng.integers(self.min_len, self.max_len + 1))
    word = "".join(chr(ord("a") + int(i)) for i in rng.integers(0, 26, size=n))
    return Problem(f"rev {word}=", {"task": self.name, "answer": word[::-1]})


class Retrieval(Task):
  """Between min_pairs and max_pairs key:value pairs (uniform), so difficulty is spread: a
  fixed count makes accuracy jump from ~0 to ~1 once the model finds the lookup, which
  leaves GRPO nothing to improve on either side of the jump. The teacher's mistake: the
  value plus one."""
  name = "retrieval"

  def __init__(self, max_pairs: int = 12, min_pairs: int = 4, mistake_rate: float = 0.0):
    super().__init__(mistake_rate)
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
                   {"task": self.name, "answer": str(values[asked]),
                    "wrong": str(values[asked] + 1)})
