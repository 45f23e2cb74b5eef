"""A multi-turn tool environment: the model calls a tool in a fixed text format, the
environment runs it and appends the result, and the model continues.

  model:        <call>lookup("k17")</call>        (the rollout stops on "</call>")
  environment:  <result>42</result>
  model:        A 42                               (then EOS)

Tools: `lookup(key)` reads a table that only the environment holds (the prompt names the
key, never the value), and `calc(expr)` evaluates integer + - * expressions. A call the
environment cannot parse or run gets `<result>error</result>`. Tool output is context for
the model and is never trained on (rl/rollout.py masks it).
"""

import ast
import operator
import re

from moe_jax.rl.tasks import Problem, Task

CALL_END = "</call>"
_CALL = re.compile(r'<call>(\w+)\(([^<>]*)\)</call>$')
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calc(expr: str) -> int:
  """Integer + - * (and unary minus) only; anything else raises ValueError."""
  def ev(node):
    if isinstance(node, ast.Constant) and type(node.value) is int:
      return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      return _OPS[type(node.op)](ev(node.left), ev(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
      return -ev(node.operand)
    raise ValueError(f"calc accepts integers and + - *, got {expr!r}")
  try:
    tree = ast.parse(expr, mode="eval")
  except SyntaxError as e:
    raise ValueError(f"calc could not parse {expr!r}") from e
  return ev(tree.body)


def run_call(completion: str, table: dict) -> str:
  """The result text for the call that ends `completion`."""
  m = _CALL.search(completion)
  if m is None:
    return "error"
  name, arg = m.group(1), m.group(2).strip()
  try:
    if name == "lookup":
      return table.get(arg.strip('"'), "none")
    if name == "calc":
      return str(calc(arg))
  except ValueError:
    return "error"
  return "error"


class ToolTask(Task):
  """Questions that need a tool: `lookup` of a hidden key's value, or `calc` of a product.

  The teacher's mistake (mistake_rate, rl/tasks.py) answers at once, without a call:
  supervised data that mixes two strategies, as traces written with and without tools do.
  Answering directly is right only by chance (the table is hidden; a 3-digit × 2-digit
  product by heart), so what GRPO has to learn is when to call. With every demonstration
  calling, the task is copying, learned within 50 warm-up steps (greedy pass@1 0.97 at
  configs/grpo.py:h200's first check), and GRPO has nothing left to improve."""
  name = "tools"
  stop_sequences = (CALL_END,)

  def __init__(self, table_size: int = 16, max_calls: int = 2, mistake_rate: float = 0.0):
    super().__init__(mistake_rate)
    self.table_size, self.max_calls = table_size, max_calls

  def sample(self, rng):
    if rng.random() < 0.5:
      keys = rng.choice(range(10, 100), size=self.table_size, replace=False)
      table = {f"k{k}": str(v) for k, v in zip(keys, rng.integers(10, 100, self.table_size))}
      key = f"k{keys[int(rng.integers(self.table_size))]}"
      return Problem(f"Q {key}?\n", {"task": self.name, "answer": table[key], "table": table,
                                     "call": f'lookup("{key}")'})
    a, b = int(rng.integers(10, 1000)), int(rng.integers(2, 100))
    return Problem(f"Q {a}*{b}?\n", {"task": self.name, "answer": str(a * b), "table": {},
                                     "call": f"calc({a}*{b})"})

  def solution(self, problem):
    s = problem.state
    return [(f"<call>{s['call']}{CALL_END}", True),
            (f"<result>{run_call(f'<call>{s['call']}{CALL_END}', s['table'])}</result>\n", False),
            (f"A {s['answer']}", True)]

  def mistake(self, problem):
    return [(f"A {problem.state['answer']}", True)]

  def wrote_mistake(self, problem, completion):
    """Whether the completion answered without a call, as the teacher's mistake does."""
    return CALL_END not in completion

  def right_call(self, problem, completion: str) -> bool:
    """Whether the completion made the call the problem needs (tool use, not the answer)."""
    return f"<call>{problem.state['call']}{CALL_END}" in completion

  def respond(self, problem, completion):
    if not completion.endswith(CALL_END) or completion.count(CALL_END) > self.max_calls:
      return None
    return f"<result>{run_call(completion, problem.state['table'])}</result>\n"
