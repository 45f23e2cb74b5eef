"""Sequence parallelism on fake CPU devices: ring attention and KDA state passing equal the
single-device ops in output and gradients, with segments crossing shard boundaries."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, cpu_devices_env

_SCRIPT = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
from moe_jax.parallel.kda_sequence import kda_sequence_parallel
from moe_jax.parallel import ring_attention as ra
from moe_jax.parallel.ring_attention import ring_attention
ra.SUB = 16  # shards of 64/32/16 positions run as 4/2/1 sub-blocks (causal skips inside)
from pallas_kernels.kda import kda

rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
ks = jax.random.split(jax.random.key(0), 10)
B, T, H = 2, 128, 2
# Segments: boundaries at 32 and 64 (shard edges for n = 4), 16 (n = 8), 70 (inside a
# shard), a length-1 document at 90, and trailing padding (id 0) in row 1.
seg = np.ones((B, T), np.int32)
seg[0, 32:], seg[0, 64:], seg[0, 70:], seg[0, 90:], seg[0, 91:] = 2, 3, 4, 5, 6
seg[1, 16:], seg[1, 100:] = 2, 0
seg = jnp.array(seg)
out = {}

# Ring attention: Dqk 16, Dv 8.
q, k = (jax.random.normal(ks[i], (B, T, H, 16)) for i in (0, 1))
v = jax.random.normal(ks[2], (B, T, H, 8))
w = jax.random.normal(ks[3], (B, T, H, 8))
def dense_attention(q, k, v, seg=seg):
  T = q.shape[1]
  visible = (seg[:, :, None] == seg[:, None, :]) & jnp.tril(jnp.ones((T, T), bool))
  s = jnp.where(visible[:, None], jnp.einsum("bthd,bshd->bhts", q, k) / 4.0, -jnp.inf)
  return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v)
# The references jitted: op by op they took 10 of the subprocess's 48 s.
ref = jax.jit(dense_attention)(q, k, v)
ref_g = jax.jit(jax.grad(lambda *a: (dense_attention(*a) * w).sum(), argnums=(0, 1, 2)))(q, k, v)

# KDA: K 16, V 8, bounded gates, a random initial state.
kq, kk = (jax.random.normal(ks[i], (B, T, H, 16)) for i in (4, 5))
kk = kk / jnp.linalg.norm(kk, axis=-1, keepdims=True)
kv = jax.random.normal(ks[6], (B, T, H, 8))
g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[7], (B, T, H, 16)))
beta = jax.nn.sigmoid(jax.random.normal(ks[8], (B, T, H)))
S0 = jax.random.normal(ks[9], (B, H, 16, 8))
kw = dict(chunk_size=16, lower_bound=-5.0)
def kda_loss(o, S):
  return (o * jnp.sin(o)).sum() + (S * S0).sum()
kref_o, kref_S = jax.jit(lambda *a: kda(*a, segment_ids=seg, initial_state=S0,
                                        output_final_state=True, **kw))(kq, kk, kv, g, beta)
kref_g = jax.jit(jax.grad(lambda q, k, v, g, beta, s0: kda_loss(*kda(
    q, k, v, g, beta, segment_ids=seg, initial_state=s0, output_final_state=True, **kw)),
                  argnums=range(6)))(kq, kk, kv, g, beta, S0)

for n in (4, 8):   # (2 shards: every edge of 2 is one of 4's)
  mesh = Mesh(np.array(jax.devices()[:n]), ("sequence",))
  with jax.set_mesh(mesh):
    o = jax.jit(lambda *a: ring_attention(*a, seg))(q, k, v)
    gr = jax.jit(jax.grad(lambda *a: (ring_attention(*a, seg) * w).sum(), argnums=(0, 1, 2)))(q, k, v)
    ko, kS = jax.jit(lambda *a: kda_sequence_parallel(*a, seg, S0, **kw))(kq, kk, kv, g, beta)
    kg = jax.jit(jax.grad(lambda q, k, v, g, beta, s0: kda_loss(*kda_sequence_parallel(
        q, k, v, g, beta, seg, s0, **kw)), argnums=range(6)))(kq, kk, kv, g, beta, S0)
  with jax.set_mesh(mesh):  # each ring step as the flash kernels (interpret mode on CPU)
    ring_p = lambda *a: ring_attention(*a, seg, implementation="pallas")
    op = jax.jit(ring_p)(q, k, v)
    grp = jax.jit(jax.grad(lambda *a: (ring_p(*a) * w).sum(), argnums=(0, 1, 2)))(q, k, v)
  out[n] = {"ring_out": rel(o, ref), "ring_grads": [rel(a, b) for a, b in zip(gr, ref_g)],
            "ring_pallas_out": rel(op, ref),
            "ring_pallas_grads": [rel(a, b) for a, b in zip(grp, ref_g)],
            "kda_out": rel(ko, kref_o), "kda_state": rel(kS, kref_S),
            "kda_grads": [rel(a, b) for a, b in zip(kg, kref_g)],
            "finite": bool(jnp.isfinite(o).all() and jnp.isfinite(ko).all())}
  if n == 4:  # bf16 inputs: the backward's matmuls run in bf16 with fp32 accumulation
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    with jax.set_mesh(mesh):
      o = jax.jit(lambda *a: ring_attention(*a, seg))(*bf)
      gr = jax.jit(jax.grad(lambda *a: (ring_attention(*a, seg).astype(jnp.float32) * w).sum(),
                            argnums=(0, 1, 2)))(*bf)
    out[n]["ring_bf16_out"] = rel(o.astype(jnp.float32), ref)
    out[n]["ring_bf16_grads"] = [rel(a.astype(jnp.float32), b) for a, b in zip(gr, ref_g)]
# Ring steps as jax's TPU flash kernels: shards of whole 128-position tiles. Documents end
# inside shards and at an edge, so shard 2 of 4 (ids 3, 4) sees nothing of block 0 (ids 1,
# 2): the case the kernel's finite mask value would fill with a uniform average. Run by
# the generic interpreter (True): the TPU interpreter steps the devices in lockstep and
# hangs when shards take different step kinds (lax.switch branches).
from jax.experimental.pallas import tpu as pltpu
Tt = 512
segt = np.ones((1, Tt), np.int32)
segt[0, 100:], segt[0, 256:], segt[0, 300:], segt[0, 420:] = 2, 3, 4, 0
segt = jnp.array(segt)
qt, kt = (jax.random.normal(ks[i], (1, Tt, 1, 16)) for i in (0, 1))
vt, wt = (jax.random.normal(ks[i], (1, Tt, 1, 8)) for i in (2, 3))
reft = jax.jit(lambda *a: dense_attention(*a, segt))(qt, kt, vt)
reft_g = jax.jit(jax.grad(lambda *a: (dense_attention(*a, segt) * wt).sum(),
                          argnums=(0, 1, 2)))(qt, kt, vt)
for n in (4,):
  mesh = Mesh(np.array(jax.devices()[:n]), ("sequence",))
  ring_t = lambda *a: ring_attention(*a, segt, implementation="tpu")
  with jax.set_mesh(mesh), pltpu.force_tpu_interpret_mode(True):
    ot = jax.jit(ring_t)(qt, kt, vt)
    grt = jax.jit(jax.grad(lambda *a: (ring_t(*a) * wt).sum(), argnums=(0, 1, 2)))(qt, kt, vt)
  out[n].update(ring_tpu_out=rel(ot, reft),
                ring_tpu_grads=[rel(a, b) for a, b in zip(grt, reft_g)])
try:
  with jax.set_mesh(Mesh(np.array(jax.devices()[:8]), ("sequence",))):
    ring_attention(qt, kt, vt, segt, implementation="tpu")   # shards of 64
except ValueError as e:
  out["tpu_short_shards"] = str(e)
print("RESULT", json.dumps(out))
"""


@pytest.fixture(scope="module")
def results():
  env = cpu_devices_env(8)
  proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                        text=True, cwd=ROOT, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][0]
  return json.loads(line.split(" ", 1)[1])


def test_ring_attention_and_kda_state_passing_equal_single_device(results):
  """One test, so the 8-device subprocess runs once (a fixture per xdist worker would run
  it on each)."""
  for n in ("4", "8"):
    r = results[n]
    assert r["finite"], n
    assert r["ring_out"] < 1e-5, (n, r)
    assert max(r["ring_grads"]) < 1e-5, (n, r)   # dq, dk, dv
    assert r["ring_pallas_out"] < 1e-5 and max(r["ring_pallas_grads"]) < 1e-5, (n, r)
    assert r["kda_out"] < 1e-4 and r["kda_state"] < 1e-4, (n, r)
    assert len(r["kda_grads"]) == 6 and max(r["kda_grads"]) < 1e-4, (n, r)  # q k v g beta S0
  r = results["4"]   # the TPU flash ring steps
  assert r["ring_tpu_out"] < 1e-5 and max(r["ring_tpu_grads"]) < 1e-5, r
  assert "shards of a multiple of 128 positions; got 64" in results["tpu_short_shards"]
  r = results["4"]   # bf16 inputs against the fp32 reference
  assert r["ring_bf16_out"] < 1e-2 and max(r["ring_bf16_grads"]) < 2e-2, r
