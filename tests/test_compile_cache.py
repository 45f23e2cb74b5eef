"""compile_cache's store of exported programs: a restart loads the init and the train step
untraced, and computes exactly what the traced programs compute."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from moe_jax.train import compile_cache
from moe_jax.train.loop import train_and_evaluate


@pytest.fixture
def store(tmp_path, monkeypatch):
  """The store alone (jax's own cache stays the suite's), in a fresh folder."""
  monkeypatch.setitem(compile_cache._STORE, "dir", str(tmp_path / "exported"))
  return tmp_path / "exported"


@struct.dataclass
class State:
  w: jax.Array
  fn: object = struct.field(pytree_node=False)   # static, like TrainState.apply_fn


def _program(traces):
  mesh = jax.make_mesh((1,), ("data",))
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def step(state, batch):
    traces.append(1)
    w = state.w - 0.1 * batch["x"].mean(0) * state.fn(state.w)
    return state.replace(w=w), {"loss": jnp.sum(w ** 2), "parts": (w[0], [w[1]])}

  jitted = jax.jit(step, donate_argnums=0)
  state = State(w=jnp.arange(4.0), fn=jnp.tanh)
  batch = {"x": jnp.ones((3, 4))}
  args = (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state),
          jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), batch))
  return jitted, args, state, batch, mesh


def _compiled(jitted, args, mesh, config, timings):
  return compile_cache.compiled(jitted, args, name="step", config=config,
                                devices=mesh.devices.flat, known={"state": args[0]},
                                donate=(0,), timings=timings)


def test_a_stored_program_loads_untraced_and_computes_the_same(store, small_config):
  traces = []
  jitted, args, state, batch, mesh = _program(traces)
  want = jitted(jax.tree.map(jnp.copy, state), batch)
  runs = []
  for _ in range(2):
    timings = {}
    program = _compiled(jitted, args, mesh, small_config, timings)
    s = jax.tree.map(jnp.copy, state)
    runs.append((timings["executable"], len(traces), program(s, batch)))
    assert s.w.is_deleted()            # the state is still donated
  (first, n1, out1), (second, n2, out2) = runs
  assert (first, second) == ("traced", "loaded") and n2 == n1   # no trace on the load
  for got in (out1, out2):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert sorted(p.suffix for p in store.iterdir()) == [".bin", ".json"]
  with pytest.raises(TypeError, match="do not match"):
    program(batch, state)


def test_a_changed_config_or_shape_is_traced_and_a_bad_entry_is_replaced(store, small_config):
  traces = []
  jitted, args, state, batch, mesh = _program(traces)
  timings = {}
  _compiled(jitted, args, mesh, small_config, timings)
  small_config.optim.learning_rate *= 2
  _compiled(jitted, args, mesh, small_config, timings)
  assert timings["executable"] == "traced" and len(os.listdir(store)) == 4
  x_sh = args[1]["x"].sharding
  wider = (args[0], {"x": jax.ShapeDtypeStruct((5, 4), jnp.float32, sharding=x_sh)})
  _compiled(jitted, wider, mesh, small_config, timings)
  assert timings["executable"] == "traced"
  for name in os.listdir(store):         # corrupt every program: each traces and is rewritten
    if name.endswith(".bin"):
      (store / name).write_bytes(b"not a program")
  _compiled(jitted, args, mesh, small_config, timings)
  assert timings["executable"] == "traced"
  _compiled(jitted, args, mesh, small_config, timings)
  assert timings["executable"] == "loaded"


@pytest.mark.slow
def test_a_restarted_run_loads_init_and_step_and_trains_identically(store, small_config, tmp_path):
  """Two fresh runs of 3 steps: the second loads both programs and matches bit for bit."""
  c = small_config
  c.schedule.total_steps = 3
  runs = [train_and_evaluate(c, str(tmp_path / f"run{i}"), progress=False) for i in range(2)]
  assert [r["start"]["executable"] for r in runs] == ["traced", "loaded"]
  assert len([n for n in os.listdir(store) if n.startswith("init-")]) == 2   # .bin + .json
  assert runs[0]["history"] == runs[1]["history"]
  for a, b in zip(jax.tree.leaves(runs[0]["state"]), jax.tree.leaves(runs[1]["state"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
