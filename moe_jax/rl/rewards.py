"""Rewards: plain Python functions of (prompt, completion, environment state) → float, and
their weighted sum, named in the config:

  rl.rewards = "exact_answer:1,tool_calls:-0.05,length:-0.002"

`completion` is the whole episode after the prompt (the model's text and any tool output),
without special tokens. Add a function to REWARDS to make it nameable.
"""

from moe_jax.rl.tools import CALL_END


def final_answer(completion: str) -> str:
  """The answer the completion ends on: the text after the last tool result, without an
  "A " prefix (the tool format), stripped."""
  tail = completion.rsplit("</result>", 1)[-1].strip()
  return tail.removeprefix("A ").strip()


def exact_answer(prompt: str, completion: str, state: dict) -> float:
  del prompt
  return float(final_answer(completion) == state["answer"])


def digit_match(prompt: str, completion: str, state: dict) -> float:
  """Partial credit: the share of answer positions written right, over the longer of the
  answer and the attempt (so extra or missing characters cost): still verifiable, and
  denser than exact_answer while a model is far from solving a task."""
  del prompt
  got, want = final_answer(completion), state["answer"]
  return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want), 1)


def tool_calls(prompt: str, completion: str, state: dict) -> float:
  """The number of tool calls (weight < 0 penalises them, > 0 rewards them)."""
  del prompt, state
  return float(completion.count(CALL_END))


def length(prompt: str, completion: str, state: dict) -> float:
  """UTF-8 bytes the model wrote (tool output not counted)."""
  del prompt, state
  own = completion
  while "<result>" in own:
    head, _, rest = own.partition("<result>")
    own = head + rest.partition("</result>")[2]
  return float(len(own.encode("utf-8")))


REWARDS = {"exact_answer": exact_answer, "digit_match": digit_match, "tool_calls": tool_calls,
           "length": length}


def parse(spec: str) -> list[tuple[str, float]]:
  """"exact_answer:1,length:-0.01" → [("exact_answer", 1.0), ("length", -0.01)]."""
  terms = []
  for part in (p.strip() for p in spec.split(",") if p.strip()):
    name, _, weight = part.partition(":")
    if name not in REWARDS:
      raise ValueError(f"rl.rewards: unknown reward {name!r} in {spec!r}; accepted: "
                       f"{sorted(REWARDS)}, each as name:weight")
    try:
      terms.append((name, float(weight) if weight else 1.0))
    except ValueError:
      raise ValueError(f"rl.rewards: weight of {name!r} must be a number, got {weight!r}") from None
  if not terms:
    raise ValueError(f"rl.rewards must name at least one reward, got {spec!r}")
  return terms


def total(terms, prompt: str, completion: str, state: dict) -> float:
  return sum(w * REWARDS[name](prompt, completion, state) for name, w in terms)
