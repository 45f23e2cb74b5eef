"""KDA across sequence shards: each shard scans its slice once, states pass as a prefix.

The KDA state update is linear in (state, v) and acts on each column of the state
[K, V] independently. So one local run, with v extended by K zero columns and the state
started at [0 | I], gives everything a shard needs:

  final state  [B_loc | A]   B_loc: the state reached from zero; A [K, K]: the transition
                             of the state through the slice (S_end = A·S_in + B_loc)
  output       [o_loc | r]   o_loc: the output from a zero state; r_t = scale·A_tᵀq_t, so
                             the output's dependence on the true incoming state S_in is
                             o_t = o_loc_t + S_inᵀ r_t

The summaries (A, B_loc) are all-gathered over `sequence` and combined in order
(S_in of shard i+1 = A_i·S_in_i + B_loc_i, from the global initial state); each shard
then corrects its output with one [T, K]·[K, V] product. A segment that starts exactly
at a shard's first token resets the incoming state (the local op cannot see that boundary).
Cost: the scan runs on V + K columns instead of V; the exchange is n·[K, K+V] per head.
Everything is plain JAX, so gradients flow through the same ops (all_gather transposes
to a reduce-scatter).
"""

import jax
import jax.numpy as jnp
from moe_jax.parallel.mesh import activation_spec, state_spec
from pallas_kernels.kda import kda

AXIS = "sequence"


def kda_shard(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxK, beta_BxTxH, segment_ids_BxT,
              initial_state_BxHxKxV=None, *, axis=AXIS, **kda_kw):
  """Per-shard body (inside shard_map over `axis`): this shard's output [B, T, H, V] and the
  global final state [B, H, K, V] fp32 (the last shard's, on every shard)."""
  B, T, H, K = q_BxTxHxK.shape
  V = v_BxTxHxV.shape[-1]
  n, idx = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
  zeros_v = jnp.zeros((B, T, H, K), v_BxTxHxV.dtype)
  eye_BxHxKxK = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (B, H, K, K))
  S0_ext = jnp.concatenate([jnp.zeros((B, H, K, V), jnp.float32), eye_BxHxKxK], -1)
  o_ext, S_ext = kda(q_BxTxHxK, k_BxTxHxK, jnp.concatenate([v_BxTxHxV, zeros_v], -1),
                     g_BxTxHxK, beta_BxTxH, segment_ids=segment_ids_BxT, initial_state=S0_ext,
                     output_final_state=True, **kda_kw)
  # The extended output is in v's dtype; the r part is kept in fp32 below where it matters.
  o_loc_BxTxHxV, r_BxTxHxK = o_ext[..., :V], o_ext[..., V:]
  B_loc_BxHxKxV, A_BxHxKxK = S_ext[..., :V], S_ext[..., V:]

  # Does a new segment start at this shard's first token? (then S_in is not carried over)
  last_seg_B = segment_ids_BxT[:, -1]
  prev_last_B = jax.lax.ppermute(last_seg_B, axis, [(i, i + 1) for i in range(n - 1)])
  first_seg_B = segment_ids_BxT[:, 0]
  reset_B = (idx > 0) & (first_seg_B != 0) & (first_seg_B != prev_last_B)
  resets_nxB = jax.lax.all_gather(reset_B, axis)
  As = jax.lax.all_gather(A_BxHxKxK, axis)         # [n, B, H, K, K]
  Bs = jax.lax.all_gather(B_loc_BxHxKxV, axis)     # [n, B, H, K, V]

  S_BxHxKxV = (jnp.zeros((B, H, K, V), jnp.float32) if initial_state_BxHxKxV is None
               else initial_state_BxHxKxV.astype(jnp.float32))
  S_in = []
  for i in range(n):  # n is static: the prefix over shards, in order
    S_BxHxKxV = jnp.where(resets_nxB[i][:, None, None, None], 0.0, S_BxHxKxV)
    S_in.append(S_BxHxKxV)
    S_BxHxKxV = jnp.einsum("bhkj,bhjv->bhkv", As[i], S_BxHxKxV) + Bs[i]
  S_final_BxHxKxV = S_BxHxKxV
  S_in_BxHxKxV = jnp.stack(S_in)[idx]
  o_BxTxHxV = (o_loc_BxTxHxV.astype(jnp.float32)
               + jnp.einsum("bthk,bhkv->bthv", r_BxTxHxK.astype(jnp.float32), S_in_BxHxKxV))
  return o_BxTxHxV.astype(v_BxTxHxV.dtype), S_final_BxHxKxV


def kda_sequence_parallel(q, k, v, g, beta, segment_ids, initial_state=None, *, mesh=None,
                          axis=AXIS, **kda_kw):
  """kda() on [B, T, H, ·] arrays sharded over `axis` along T (shard_map over the mesh set
  with jax.set_mesh, or `mesh`). Returns (o [B, T, H, V], final state [B, H, K, V] fp32)."""
  mesh = mesh or jax.sharding.get_abstract_mesh()
  x4, x3, x2 = (activation_spec(mesh, n, axis) for n in (4, 3, 2))
  state = state_spec(mesh, 4)
  if segment_ids is None:
    segment_ids = jnp.ones(q.shape[:2], jnp.int32)
  if initial_state is None:
    initial_state = jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), jnp.float32)
  body = lambda q, k, v, g, beta, seg, s0: kda_shard(q, k, v, g, beta, seg, s0, axis=axis,
                                                     **kda_kw)
  return jax.shard_map(body, mesh=mesh, in_specs=(x4, x4, x4, x4, x3, x2, state),
                       out_specs=(x4, state), check_vma=False)(
                           q, k, v, g, beta, segment_ids, initial_state)
