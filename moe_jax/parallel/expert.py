"""Expert parallelism: experts sharded over the `expert` mesh axis, tokens moved by all-to-all.

Inside `jax.shard_map` every shard holds a slice of the tokens (batch over
data·fsdp·expert, time over sequence) and E/P experts (P = expert axis size):

  1. each local assignment (token, expert e) goes to shard e // (E/P): pack a
     send buffer [P, S, D] (S slots per destination) and the local expert ids;
  2. all_to_all over `expert`: shard p now holds what every shard sent it;
  3. sort the received rows by local expert, grouped matmul, unsort;
  4. all_to_all back, unpack, combine with the routing weights.

Dropless (capacity_factor=None) sizes S for the worst case, all N_local·k
assignments to one shard: exact, at P× the buffer memory of the balanced
case. With a capacity factor S = ceil(factor·N_local·k/P) and assignments past
it are dropped (counted), which bounds memory for large P.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_jax.model import experts
from moe_jax.model.dispatch import (capacity, combine, inverse_permutation, permute_rows,
                                     repeat_rows, sort_by_group, take_rows)

TOKEN_AXES = ("data", "fsdp", "expert", "sequence")


def _exchange(x_MxD, idx_MxK, w_MxK, gate_up_LxDx2xF, down_LxFxD, *, shards, capacity_factor,
              implementation):
  """Per-shard body: dispatch over `expert`, local experts, return, combine."""
  M, K = idx_MxK.shape
  L, D = gate_up_LxDx2xF.shape[:2]
  A = M * K
  S = A if capacity_factor is None else capacity(M, K, shards, capacity_factor)
  e_A = idx_MxK.reshape(-1)
  order_A, _, rank_sorted_A = sort_by_group(e_A // L, shards)  # by destination shard
  rank_A = rank_sorted_A[inverse_permutation(order_A)]
  keep_A = rank_A < S
  slot_A = jnp.where(keep_A, (e_A // L) * S + rank_A, shards * S)  # out of range = dropped

  assign_slot = jnp.full((shards * S,), A, jnp.int32).at[slot_A].set(jnp.arange(A), mode="drop")
  expert_slot = jnp.full((shards * S,), L, jnp.int32).at[slot_A].set(e_A % L, mode="drop")
  send_x_PxSxD = take_rows(repeat_rows(x_MxD, K), assign_slot).reshape(shards, S, D)
  send_e_PxS = expert_slot.reshape(shards, S)

  recv_x_PxSxD = jax.lax.all_to_all(send_x_PxSxD, "expert", 0, 0)
  recv_e_R = jax.lax.all_to_all(send_e_PxS, "expert", 0, 0).reshape(-1)
  local_order_R, sizes_L, _ = sort_by_group(recv_e_R, L)  # empty slots (id L) sort last
  local_inverse_R = inverse_permutation(local_order_R)
  # The local sort and unsort are permutations: gathers both ways (dispatch.permute_rows).
  y_R = experts.swiglu_grouped(
      permute_rows(recv_x_PxSxD.reshape(-1, D), local_order_R, local_inverse_R), sizes_L,
      gate_up_LxDx2xF, down_LxFxD, implementation)
  y_R = jnp.where((recv_e_R[local_order_R] < L)[:, None], y_R, 0)  # rows past the groups
  y_PxSxD = permute_rows(y_R, local_inverse_R, local_order_R).reshape(shards, S, D)

  back_PxSxD = jax.lax.all_to_all(y_PxSxD, "expert", 0, 0)
  y_AxD = take_rows(back_PxSxD.reshape(-1, D), slot_A)
  dropped = jax.lax.psum((~keep_A).sum(), TOKEN_AXES)
  return combine(y_AxD, w_MxK, x_MxD.dtype), dropped


def moe_ffn(x_NxD, idx_NxK, w_NxK, gate_up_ExDx2xF, down_ExFxD, *, expert_shards: int,
            capacity_factor=None, implementation=""):
  """Routed-expert output [N, D] and dropped assignments, under the mesh set by jax.set_mesh."""
  E = gate_up_ExDx2xF.shape[0]
  if E % expert_shards:
    raise ValueError(f"model.moe.num_experts={E} must be a multiple of mesh.expert={expert_shards}")
  tokens = P(TOKEN_AXES)

  def body(*args):
    return _exchange(*args, shards=expert_shards, capacity_factor=capacity_factor,
                     implementation=implementation)

  return jax.shard_map(body, in_specs=(tokens, tokens, tokens, P("expert"), P("expert")),
                       out_specs=(tokens, P()))(x_NxD, idx_NxK, w_NxK, gate_up_ExDx2xF,
                                                down_ExFxD)
