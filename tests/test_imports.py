"""No import cycles in the project's packages, counting imports inside functions too (a
function-local import must not be a way around one): config.py, the leaf fields.py, the
MoE dispatch helpers and the Triton launch machinery keep the graph a DAG."""

import ast
import os
import subprocess
import sys

from tests.conftest import ROOT, subprocess_env

PACKAGES = ("moe_jax", "pallas_kernels", "configs", "benchmarks")


def _modules() -> dict[str, str]:
  """{dotted module name: path} of every .py file under PACKAGES and of scripts/."""
  mods = {}
  for top in (*PACKAGES, "scripts"):
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
      dirnames[:] = [d for d in dirnames if d != "__pycache__"]
      for f in filenames:
        if f.endswith(".py"):
          rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
          mods[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
  return mods


def import_graph() -> dict[str, set[str]]:
  """{module: the project modules it imports anywhere in its body}. `from a import b` is an
  edge to a.b where that is a module, else to a."""
  mods = _modules()
  graph = {m: set() for m in mods}
  for m, path in mods.items():
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
      targets = []
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods
                   else node.module for a in node.names]
      graph[m] |= {t for t in targets if t in mods and t != m}
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_cycle_finder_finds_a_cycle():
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_project_has_no_import_cycle():
  graph = import_graph()
  assert {"moe_jax.config", "moe_jax.fields", "moe_jax.model.dispatch",
          "pallas_kernels.triton_launch"} <= set(graph)
  assert "moe_jax.parallel.ring_attention" in graph["moe_jax.config"]   # edges are read
  assert cycles(graph) == []
  # The leaf: every module may import it, so it imports nothing of the project.
  assert graph["moe_jax.fields"] == set()


_WITHOUT_TRITON = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name.split(".")[0] in ("triton", "jax_triton"):
      raise ImportError("no " + name)
sys.meta_path.insert(0, Block())
import moe_jax.model.transformer, moe_jax.train.step, moe_jax.infer.generate
import pallas_kernels.kda.ops, pallas_kernels.moe.ops, pallas_kernels.attention.ops
print("ok")
"""


def test_the_model_imports_without_the_triton_package():
  """triton and jax_triton are optional (the `gpu` and `test` extras): the model, the train
  step, inference and the kernels' entry points import without them; the Triton kernel
  modules are imported where a Triton path is chosen."""
  run = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON], cwd=ROOT, capture_output=True,
                       text=True, env=subprocess_env(), timeout=300)
  assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
