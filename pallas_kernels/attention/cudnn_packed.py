"""Causal attention within packed documents by cuDNN's fused attention, in its packed
layout: each row's documents as separate sequences (q_offsets / kv_offsets and per-document
lengths), so only the causal pairs within a document are computed, forward and backward.

Why: cuDNN's flash attention is faster than the Triton kernels of pallas_gpu_causal.py on
whole rows (benchmarks/attention.md), and `jax.nn.dot_product_attention` takes no segment
ids; the packed layout gives it documents. It is jax's private cuDNN entry point
(`jax._src.cudnn.fused_attention_stablehlo`, which axlearn's GPU attention also calls),
pinned with jax in setup.py.

The contract is reference.causal_attention's (a key is visible to a query at or after it
with the same segment id, padding id 0 included), met where each id is one contiguous run
of its row, as packing lays documents out, and a row has at most `max_segments` runs.
Elsewhere (an id in two runs, more runs than that) the step takes pallas_gpu_causal's
kernels instead, chosen on the device by a `lax.cond` on the ids, so any input is right.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.attention import pallas_gpu_causal

MAX_SEGMENTS = 64   # runs a row may have for cuDNN (the packed layout's M)


def runs(segment_ids_BxT, max_segments: int):
  """cuDNN's packed-layout description of each row's runs of equal ids, as its docstring
  gives it: (offsets [B, M+1] int32, the start of each run in its row, then -1; lengths
  [B, M] int32, -1 past the last run; ok [B] bool: the row has at most M runs and no id in
  two of them)."""
  B, T = segment_ids_BxT.shape
  M = max_segments
  seg = segment_ids_BxT.astype(jnp.int32)
  start_BxT = jnp.concatenate([jnp.ones((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  run_BxT = jnp.cumsum(start_BxT, axis=1, dtype=jnp.int32) - 1
  n_B = run_BxT[:, -1] + 1
  rows_BxT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  slot_BxT = jnp.where(start_BxT, run_BxT, M)          # only run starts write; M is dropped
  pos_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
  starts_BxM = jnp.full((B, M), -1, jnp.int32).at[rows_BxT, slot_BxT].set(pos_BxT, mode="drop")
  ids_BxM = jnp.full((B, M), -1, jnp.int32).at[rows_BxT, slot_BxT].set(seg, mode="drop")
  live_BxM = jnp.arange(M)[None] < n_B[:, None]
  ends_BxM = jnp.where(jnp.arange(M)[None] + 1 < n_B[:, None],
                       jnp.concatenate([starts_BxM[:, 1:], jnp.full((B, 1), -1, jnp.int32)], 1),
                       T)
  lengths_BxM = jnp.where(live_BxM, ends_BxM - starts_BxM, -1)
  offsets_BxM1 = jnp.concatenate([starts_BxM, jnp.full((B, 1), -1, jnp.int32)], axis=1)
  same_BxMxM = ((ids_BxM[:, :, None] == ids_BxM[:, None, :]) & live_BxM[:, :, None]
                & live_BxM[:, None, :] & ~jnp.eye(M, dtype=bool)[None])
  ok_B = (n_B <= M) & ~jnp.any(same_BxMxM, axis=(1, 2))
  return offsets_BxM1, lengths_BxM, ok_B


def fits(q_BxTxHxDqk, v_BxTxHxDv) -> bool:
  """cuDNN's fused attention takes bf16/fp16 and head dims that are multiples of 8 up to 256
  (Hopper). Query/key and value dims may differ (MLA): `_cudnn` pads them to one width."""
  dims_ok = all(d % 8 == 0 and d <= 256 for d in (q_BxTxHxDqk.shape[-1], v_BxTxHxDv.shape[-1]))
  return q_BxTxHxDqk.dtype in (jnp.bfloat16, jnp.float16) and dims_ok


def _cudnn(q, k, v, offsets, lengths):
  """The entry point takes one head dim for q, k and v: with MLA's 192/128 unpadded its
  output was NaN (H100). So the narrower side is padded with zeros, which changes no score
  and no output column, and the output cut back to v's width."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  Dqk, Dv = q.shape[-1], v.shape[-1]
  D = max(Dqk, Dv)
  pad = lambda x: jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, D - x.shape[-1]),))
  o = cudnn.dot_product_attention(
      pad(q), pad(k), pad(v), q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
      kv_offsets=offsets, scale=Dqk ** -0.5, mask_type=cudnn.MaskType.PADDING_CAUSAL,
      qkv_layout="BTNH")
  return o[..., :Dv]


@functools.partial(jax.jit, static_argnames=("max_segments",))
def causal_attention(q_BxTxHxDqk, k_BxTxHxDqk, v_BxTxHxDv, segment_ids_BxT, *,
                     max_segments: int = MAX_SEGMENTS):
  """reference.causal_attention by cuDNN where every row's ids are runs it can take (`runs`),
  else by pallas_gpu_causal's kernels (one of the two runs a step, decided on the device)."""
  offsets, lengths, ok_B = runs(segment_ids_BxT, max_segments)
  args = (q_BxTxHxDqk, k_BxTxHxDqk, v_BxTxHxDv)
  by_cudnn = lambda q, k, v: _cudnn(q, k, v, offsets, lengths).astype(v.dtype)
  by_pallas = lambda q, k, v: pallas_gpu_causal.causal_attention(
      q, k, v, segment_ids_BxT).astype(v.dtype)
  return jax.lax.cond(jnp.all(ok_B), by_cudnn, by_pallas, *args)
