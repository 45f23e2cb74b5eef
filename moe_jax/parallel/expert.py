"""Expert parallelism: experts sharded over the `expert` mesh axis, tokens moved by all-to-all.

Inside `jax.shard_map` every shard holds a slice of the tokens (batch over
data·fsdp·expert, time over sequence) and L = E/P experts (P = expert axis size). Each
local assignment (token, expert e) goes to shard e // L:

  1. pack a send buffer [P, S, D] (S slots per destination) and the local expert ids;
  2. all_to_all over `expert`: shard p now holds what every shard sent it;
  3. sort the received rows by local expert, grouped matmul, unsort;
  4. all_to_all back, unpack, combine with the routing weights.

Dropless (the default): S = ceil(ep_buffer_factor · A / P) slots per destination for the
A = N_local·k local assignments, i.e. the balanced load times the factor. Assignments past
a destination's S go in further rounds of the same four steps (round r carries ranks
r·S … (r+1)·S − 1), so nothing is dropped: a balanced batch takes one round, every token
on one shard ceil(P / factor). The round count is data (a `while_loop` bound, the same on
every shard: a pmax), so it never recompiles; the backward runs the rounds again
(`_rounds`' custom VJP), re-sending each round's rows and output gradients. Buffers take
factor/P of the worst case's memory (MaxText's and Megatron's drop-free dispatchers size
by the load the same way).

Capacity (capacity_factor set): one round of S = ceil(factor·A/P) slots; assignments past
it are dropped and counted.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_jax.model import experts
from moe_jax.model.dispatch import (capacity, combine, inverse_permutation, permute_rows,
                                     repeat_rows, sort_by_group, take_rows)

TOKEN_AXES = ("data", "fsdp", "expert", "sequence")


def slots(assignments: int, shards: int, factor: float) -> int:
  """S, the slots per destination shard in one round: the balanced load times the factor
  (at most every assignment: more would only be empty)."""
  return max(1, min(assignments, math.ceil(factor * assignments / shards)))


def _plan(e_A, L: int, shards: int, S: int):
  """(round of each assignment, its slot in that round's [P·S] buffer, rounds on every
  shard, peak load over S on any shard)."""
  dest_A = e_A // L
  order_A, counts_P, rank_sorted_A = sort_by_group(dest_A, shards)
  rank_A = rank_sorted_A[inverse_permutation(order_A)]
  peak = jax.lax.pmax(counts_P.max(), TOKEN_AXES)
  rounds = jnp.maximum(1, -(-peak // S))
  return rank_A // S, dest_A * S + rank_A % S, rounds, peak.astype(jnp.float32) / S


def _local_experts(x_RxD, e_R, gate_up_LxDx2xF, down_LxFxD, implementation):
  """Each received row through its local expert (id L: an empty slot, zero out)."""
  L = gate_up_LxDx2xF.shape[0]
  order_R, sizes_L, _ = sort_by_group(e_R, L)   # empty slots (id L) sort last
  inverse_R = inverse_permutation(order_R)
  # The local sort and unsort are permutations: gathers both ways (dispatch.permute_rows).
  y_R = experts.swiglu_grouped(permute_rows(x_RxD, order_R, inverse_R), sizes_L,
                               gate_up_LxDx2xF, down_LxFxD, implementation)
  y_R = jnp.where((e_R[order_R] < L)[:, None], y_R, 0)   # rows past the groups
  return permute_rows(y_R, inverse_R, order_R)


def _round_slots(round_A, slot_A, r, shards: int, S: int):
  """(slot of each assignment in round r, out of range if not in it; the assignment in
  each slot, A for an empty one)."""
  A = round_A.shape[0]
  slot_r_A = jnp.where(round_A == r, slot_A, shards * S)
  assign_T = jnp.full((shards * S,), A, jnp.int32).at[slot_r_A].set(
      jnp.arange(A, dtype=jnp.int32), mode="drop")
  return slot_r_A, assign_T


def _send(rows_AxD, assign_T, shards: int, S: int):
  """Round rows [P, S, D] → all_to_all → what this shard received, [P·S, D]."""
  D = rows_AxD.shape[-1]
  send = take_rows(rows_AxD, assign_T).reshape(shards, S, D)
  return jax.lax.all_to_all(send, "expert", 0, 0).reshape(shards * S, D)


def _send_back(rows_TxD, slot_r_A, shards: int, S: int):
  """Received rows' results → all_to_all back → [A, D], zero for assignments of other rounds."""
  D = rows_TxD.shape[-1]
  back = jax.lax.all_to_all(rows_TxD.reshape(shards, S, D), "expert", 0, 0)
  return take_rows(back.reshape(shards * S, D), slot_r_A)


def _received_ids(e_A, assign_T, L: int, shards: int, S: int):
  e_T = jnp.concatenate([e_A % L, jnp.full((1,), L, e_A.dtype)])[assign_T]  # A → id L
  return jax.lax.all_to_all(e_T.reshape(shards, S), "expert", 0, 0).reshape(-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _rounds(x_AxD, e_A, round_A, slot_A, rounds, gate_up_LxDx2xF, down_LxFxD,
            shards, S, implementation):
  """y [A, D]: each assignment's row through its expert, over `rounds` rounds."""
  return _rounds_fwd(x_AxD, e_A, round_A, slot_A, rounds, gate_up_LxDx2xF, down_LxFxD,
                     shards, S, implementation)[0]


def _rounds_fwd(x_AxD, e_A, round_A, slot_A, rounds, gate_up_LxDx2xF, down_LxFxD,
                shards, S, implementation):
  L = gate_up_LxDx2xF.shape[0]

  def body(r, y_AxD):
    slot_r_A, assign_T = _round_slots(round_A, slot_A, r, shards, S)
    e_T = _received_ids(e_A, assign_T, L, shards, S)
    y_T = _local_experts(_send(x_AxD, assign_T, shards, S), e_T, gate_up_LxDx2xF,
                         down_LxFxD, implementation)
    return y_AxD + _send_back(y_T, slot_r_A, shards, S)

  y_AxD = jax.lax.fori_loop(0, rounds, body, jnp.zeros_like(x_AxD))
  return y_AxD, (x_AxD, e_A, round_A, slot_A, rounds, gate_up_LxDx2xF, down_LxFxD)


def _rounds_bwd(shards, S, implementation, res, dy_AxD):
  x_AxD, e_A, round_A, slot_A, rounds, gate_up, down = res
  L = gate_up.shape[0]

  def body(r, carry):
    dx_AxD, dgate_up, ddown = carry
    slot_r_A, assign_T = _round_slots(round_A, slot_A, r, shards, S)
    e_T = _received_ids(e_A, assign_T, L, shards, S)
    x_T, dy_T = _send(x_AxD, assign_T, shards, S), _send(dy_AxD, assign_T, shards, S)
    _, vjp = jax.vjp(lambda x, gu, dn: _local_experts(x, e_T, gu, dn, implementation),
                     x_T, gate_up, down)
    dx_T, dgu, ddn = vjp(dy_T.astype(x_T.dtype))
    return (dx_AxD + _send_back(dx_T, slot_r_A, shards, S), dgate_up + dgu, ddown + ddn)

  # The expert-weight gradients sum over rounds in the weights' dtype, as one round's
  # grouped matmul returns them: an fp32 accumulator of the local experts cost 1.4 GB more
  # per layer at trillion's shapes (benchmarks/tpu.md); a balanced batch is one round.
  # (zeros_like keeps the varying mesh axes the loop carry must have.)
  dx_AxD, dgate_up, ddown = jax.lax.fori_loop(
      0, rounds, body, (jnp.zeros_like(x_AxD), jnp.zeros_like(gate_up), jnp.zeros_like(down)))
  return dx_AxD, None, None, None, None, dgate_up, ddown


_rounds.defvjp(_rounds_fwd, _rounds_bwd)


def _dropless(x_MxD, idx_MxK, w_MxK, gate_up_LxDx2xF, down_LxFxD, *, shards, buffer_factor,
              implementation):
  """Per-shard body of the dropless path: rounds of load-sized buffers."""
  M, K = idx_MxK.shape
  L = gate_up_LxDx2xF.shape[0]
  S = slots(M * K, shards, buffer_factor)
  e_A = idx_MxK.reshape(-1)
  round_A, slot_A, rounds, fill = _plan(e_A, L, shards, S)
  y_AxD = _rounds(repeat_rows(x_MxD, K), e_A, round_A, slot_A, rounds, gate_up_LxDx2xF,
                  down_LxFxD, shards, S, implementation)
  stats = {"dropped": jnp.zeros((), jnp.int32), "ep_rounds": rounds.astype(jnp.float32),
           "ep_buffer_fill": fill}
  return combine(y_AxD, w_MxK, x_MxD.dtype), stats


def _with_capacity(x_MxD, idx_MxK, w_MxK, gate_up_LxDx2xF, down_LxFxD, *, shards,
                   capacity_factor, implementation):
  """Per-shard body of the capacity path: one round; assignments past S are dropped."""
  M, K = idx_MxK.shape
  L = gate_up_LxDx2xF.shape[0]
  S = capacity(M, K, shards, capacity_factor)
  e_A = idx_MxK.reshape(-1)
  round_A, slot_A, _, fill = _plan(e_A, L, shards, S)
  slot_r_A, assign_T = _round_slots(round_A, slot_A, 0, shards, S)
  y_T = _local_experts(_send(repeat_rows(x_MxD, K), assign_T, shards, S),
                       _received_ids(e_A, assign_T, L, shards, S), gate_up_LxDx2xF,
                       down_LxFxD, implementation)
  y_AxD = _send_back(y_T, slot_r_A, shards, S)
  stats = {"dropped": jax.lax.psum((round_A > 0).sum(), TOKEN_AXES),
           "ep_rounds": jnp.ones((), jnp.float32), "ep_buffer_fill": fill}
  return combine(y_AxD, w_MxK, x_MxD.dtype), stats


def moe_ffn(x_NxD, idx_NxK, w_NxK, gate_up_ExDx2xF, down_ExFxD, *, expert_shards: int,
            capacity_factor=None, buffer_factor: float = 2.0, implementation=""):
  """(routed-expert output [N, D], {"dropped": assignments, "ep_rounds", "ep_buffer_fill":
  peak assignments a shard sent one destination over the slots S}) under the mesh set by
  jax.set_mesh. capacity_factor None = dropless."""
  E = gate_up_ExDx2xF.shape[0]
  if E % expert_shards:
    raise ValueError(f"model.moe.num_experts={E} must be a multiple of mesh.expert={expert_shards}")
  if not buffer_factor > 0:
    raise ValueError(f"model.moe.ep_buffer_factor must be > 0, got {buffer_factor!r}")
  tokens = P(TOKEN_AXES)
  if capacity_factor is None:
    body = functools.partial(_dropless, shards=expert_shards, buffer_factor=buffer_factor,
                             implementation=implementation)
  else:
    body = functools.partial(_with_capacity, shards=expert_shards,
                             capacity_factor=capacity_factor, implementation=implementation)
  return jax.shard_map(body, in_specs=(tokens, tokens, tokens, P("expert"), P("expert")),
                       out_specs=(tokens, P()))(x_NxD, idx_NxK, w_NxK, gate_up_ExDx2xF,
                                                down_ExFxD)
