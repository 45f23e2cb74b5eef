"""Public KDA entry point: validates inputs and dispatches to an implementation."""

import jax
import jax.numpy as jnp

from pallas_kernels import platform
from pallas_kernels.kda import pallas_gpu, pallas_tpu, pallas_gpu_prologue, reference
from pallas_kernels.kda.gate import check_lower_bound, kda_gate
# A KDA layer's whole decode step (T = 1) as one kernel: Triton on GPU, interpret elsewhere.
from pallas_kernels.kda.pallas_gpu_decode import (  # noqa: F401 — re-exported
    decode_step, fits as decode_step_fits)

IMPLEMENTATIONS = ("xla", "recurrent", "pallas_gpu", "triton", "pallas_tpu")
GPU_KERNELS = ("pallas_gpu", "triton")   # prologue, gate and L2 norm inside the op
CHUNK_SIZES = (16, 32, 64, 128)  # multiples of the 16-row sub-chunk


def _validate(q, k, v, g, beta, initial_state, segment_ids, chunk_size, lower_bound, A_log,
              dt_bias):
  if q.ndim != 4:
    raise ValueError(f"q must be [B,T,H,K], got shape {q.shape}")
  B, T, H, K = q.shape
  if k.shape != q.shape:
    raise ValueError(f"k must match q's shape {q.shape}, got {k.shape}")
  if g.shape != q.shape:
    raise ValueError(f"g must match q's shape {q.shape}, got {g.shape}")
  if v.ndim != 4 or v.shape[:3] != (B, T, H):
    raise ValueError(f"v must be [B,T,H,V] with B,T,H = {(B, T, H)}, got {v.shape}")
  if beta.shape != (B, T, H):
    raise ValueError(f"beta must be [B,T,H] = {(B, T, H)}, got {beta.shape}")
  if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
    raise ValueError(f"initial_state must be [B,H,K,V] = {(B, H, K, v.shape[-1])}, "
                     f"got {initial_state.shape}")
  if segment_ids is not None and (segment_ids.shape != (B, T)
                                  or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
    raise ValueError(f"segment_ids must be an integer [B,T] = {(B, T)} array, got "
                     f"{segment_ids.shape} {segment_ids.dtype}")
  for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be a floating array, got {x.dtype}")
  if chunk_size not in CHUNK_SIZES:
    raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size}")
  check_lower_bound(lower_bound)
  if (A_log is None) != (dt_bias is None):
    raise ValueError("A_log and dt_bias go together (the gate inside the op), got "
                     f"A_log={'None' if A_log is None else 'an array'} and "
                     f"dt_bias={'None' if dt_bias is None else 'an array'}")
  if A_log is not None:       # g is the gate's input: any real value
    if A_log.shape != (H,):
      raise ValueError(f"A_log must have shape [H]=({H},), got {A_log.shape}")
    if dt_bias.shape != (H * K,):
      raise ValueError(f"dt_bias must have shape [H*K]=({H * K},), got {dt_bias.shape}")
    return
  if not isinstance(g, jax.core.Tracer):  # checkable only on concrete arrays
    # Concrete g can still arrive inside a trace (closed over by a jitted function).
    with jax.ensure_compile_time_eval():
      g_max, g_min = float(jnp.max(g)), float(jnp.min(g))
    if g_max > 0:
      raise ValueError(f"g is a log-decay and must be <= 0; max is {g_max}")
    if lower_bound is not None and g_min < lower_bound * (1 + 1e-6):
      raise ValueError(f"g has values below lower_bound={lower_bound} (min {g_min});"
                       " pass lower_bound=None for unbounded (legacy) gates")


def pallas_gpu_fits(K, V) -> bool:
  """The Pallas GPU kernels tile K and V in blocks of powers of two, at least 16 wide
  (Triton's smallest dot)."""
  return all(d >= 16 and d & (d - 1) == 0 for d in (K, V))


def default_implementation(K=128, V=128) -> str:
  """The target platform's kernels where the head dims fit them: on GPU triton (faster than
  pallas_gpu on every shape of benchmarks/kda.md), or pallas_gpu where jax_triton is not
  installed; pallas_tpu on TPU, including a TPU program compiled on a CPU host; the XLA
  chunked form elsewhere."""
  target = platform.target()
  if target == "gpu" and pallas_gpu_fits(K, V):
    return "triton" if platform.triton_available() else "pallas_gpu"
  if target == "tpu" and pallas_tpu.fits(K, V):
    return "pallas_tpu"
  return "xla"


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        segment_ids=None, chunk_size=64, lower_bound=None, A_log=None, dt_bias=None,
        qk_l2norm=False, implementation=None):
  """Kimi delta attention. q,k,g [B,T,H,K]; v [B,T,H,V]; beta [B,T,H]; g ≤ 0 (log-decay).

  Returns (o [B,T,H,V] in v's dtype, final state [B,H,K,V] float32 or None).
  segment_ids [B,T] (0 = padding) resets the state at each new segment.
  lower_bound: the gate's bound (every g ≥ lower_bound, as `kda_gate` guarantees) — the
  static flag that allows all-matmul 16-row tiles; None (unbounded / legacy gates) takes
  the safe path for the diagonal tiles.
  A_log [H] and dt_bias [H*K]: the gate inside the op (fla's use_gate_in_kernel): g is
  then kda_gate's input x and the op computes kda_gate(x, A_log, dt_bias, lower_bound).
  qk_l2norm: q and k are L2-normalised inside the op (fla's use_qk_l2norm_in_kernel).
  pallas_gpu and triton do both in their prologue kernel; the others in JAX first.
  """
  _validate(q, k, v, g, beta, initial_state, segment_ids, chunk_size, lower_bound, A_log,
            dt_bias)
  K, V = q.shape[-1], v.shape[-1]
  impl = default_implementation(K, V) if implementation is None else implementation
  if impl in GPU_KERNELS and not pallas_gpu_fits(K, V):
    raise ValueError(f"implementation='{impl}' needs K and V to be powers of two >= 16, "
                     f"got K={K}, V={V}; use implementation='xla'")
  if impl == "pallas_tpu" and not pallas_tpu.fits(K, V):
    raise ValueError(f"implementation='pallas_tpu' needs K and V to be multiples of 8 up to "
                     f"{pallas_tpu.MAX_HEAD_DIM}, got K={K}, V={V}; use implementation='xla'")
  kw = dict(scale=scale, initial_state=initial_state, segment_ids=segment_ids)
  bounded = lower_bound is not None
  if impl not in GPU_KERNELS:
    if A_log is not None:
      g = kda_gate(g, A_log, dt_bias, lower_bound=lower_bound)
    if qk_l2norm:
      q, k = reference.l2_normalize(q), reference.l2_normalize(k)
  if impl == "xla":
    o, S = reference.kda_chunked(q, k, v, g, beta, chunk_size=chunk_size, bounded=bounded, **kw)
  elif impl == "recurrent":
    o, S = reference.kda_recurrent(q, k, v, g, beta, **kw)
  elif impl == "pallas_gpu":
    o, S = pallas_gpu.kda_pallas_gpu(q, k, v, g, beta, chunk_size=chunk_size,
                                     lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias,
                                     qk_l2norm=qk_l2norm, **kw)
  elif impl == "triton":     # pallas_gpu's algorithm, main kernels in Triton
    # (these need the triton package)
    from pallas_kernels.kda import (triton_gpu, triton_gpu_fwd16, triton_gpu_prologue,
                                    triton_gpu_stage1)
    prologue = triton_gpu_prologue.prologue if triton_gpu.PROLOGUE else pallas_gpu_prologue.prologue
    core = triton_gpu_fwd16.core if triton_gpu_fwd16.FWD16 else None
    o, S = pallas_gpu.kda_pallas_gpu(q, k, v, g, beta, stage1=triton_gpu_stage1.intra,
                                     stage1_unbounded=triton_gpu_stage1.intra_unbounded,
                                     stage2=triton_gpu.recurrence, prologue=prologue, core=core,
                                     chunk_size=chunk_size, lower_bound=lower_bound,
                                     A_log=A_log, dt_bias=dt_bias, qk_l2norm=qk_l2norm, **kw)
  elif impl == "pallas_tpu":
    o, S = pallas_tpu.kda_pallas_tpu(q, k, v, g, beta, chunk_size=chunk_size, bounded=bounded,
                                     **kw)
  else:
    raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, got {impl!r}")
  return o.astype(v.dtype), (S if output_final_state else None)
