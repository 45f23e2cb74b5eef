"""KDA's stage 2 (the chunk recurrence) as native Triton kernels: issue 22's route test.

`implementation="triton"` is pallas_gpu with stage 2's sequential kernels written in
Triton: the same prologue and stage-1 kernels, and pallas_gpu's per-chunk gradient kernel.
It answers one question on the H200 before more of the op is rewritten: does Triton
written by hand, called through jax_triton, beat the same algorithm lowered by Pallas?
(benchmarks/kda.md: yes, 1.0-1.8x forward and 1.1-1.4x backward for these loops, with
bit-identical outputs.)

  _kda_recurrence_triton      grid (V/BV, B·H): the state S [K, BV] stays in registers
                              across all chunks; per chunk U = U0 - W S, O = Qg S + Aqk U,
                              S <- decay * S + Kdᵀ U. Emits O, the final state and, for
                              the backward, each chunk's start state.
  _kda_recurrence_bwd_triton  the same loop in reverse carrying dS: dU0, each chunk's U
                              and the dS at each chunk's end, for pallas_gpu's gradient
                              kernel.

On a GPU the kernels run through `jax_triton.triton_call`; elsewhere Triton's interpreter
runs them on host arrays inside a `jax.pure_callback` (CPU tests). Both need the `triton`
package (3.6, the GPU machine's); jax_triton only on the GPU.
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from pallas_kernels.kda import pallas_gpu
from pallas_kernels.kda.recurrence_vjp import recurrence_with_vjp

F32 = jnp.float32

# Launch knobs (chosen on the H200 by scripts/profile_kda_stages.py --triton; kda.md).
BLOCK_V = 32         # V columns per program (64 was not faster once pipelined)
WARPS = 4
STAGES = 3           # chunks in flight in the recurrence loop, fewer where they do not fit
# Shared memory a block may use (opt-in maximum) by compute capability; the default is the
# smallest of these.
MAX_SHARED = {80: 166912, 87: 166912, 90: 232448, 100: 232448}
_TRITON_TYPES = {jnp.dtype(jnp.bfloat16): "*bf16", jnp.dtype(jnp.float16): "*fp16",
                 jnp.dtype(jnp.float32): "*fp32"}


@triton.jit
def _chunk_rows(ptr, row0, n, col, Tp: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                C: tl.constexpr, BD: tl.constexpr):
  """Block pointer to rows n·C … n·C + C and columns col … col + BD of one (b, h) of a
  [B, Tp, H, D] array whose row 0 is at row0 (= b·Tp·H + h)."""
  return tl.make_block_ptr(ptr + row0 * D, (Tp, D), (H * D, 1), (n * C, col), (C, BD), (1, 0))


@triton.jit
def _state(ptr, i, iv, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
  """Block pointer to columns iv·BV … of the i-th [K, V] fp32 state of an array of them."""
  return tl.make_block_ptr(ptr + i * K * V, (K, V), (V, 1), (0, iv * BV), (K, BV), (1, 0))


@triton.jit
def _kda_recurrence_triton(W, U0, Qg, Kd, Aqk, decay, S0, O, SN, states,
                           Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                           V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                           WITH_STATES: tl.constexpr, PREC: tl.constexpr,
                           NUM_STAGES: tl.constexpr):
  """W, Qg, Kd [B, Tp, H, K]; U0, O [B, Tp, H, V]; Aqk [B, Tp, H, C]; decay [B, N, H, K]
  fp32; S0, SN [B, H, K, V] fp32; states [B, H, N, K, V] fp32 (WITH_STATES). The chunk
  loop is a tl.range: with NUM_STAGES > 1 Triton prefetches the next chunks' rows (cp.async)
  while this one's dots run; a plain range is not pipelined."""
  iv = tl.program_id(0)
  bh = tl.program_id(1).to(tl.int64)
  b, h = bh // H, bh % H
  N: tl.constexpr = Tp // C
  dt = W.dtype.element_ty
  row0 = b * Tp * H + h                   # (b, t=0, h) in a [B, Tp, H, ·] array
  S_KV = tl.load(_state(S0, bh, iv, K, V, BV)).to(tl.float32)
  k_K = tl.arange(0, K)
  for n in tl.range(0, N, num_stages=NUM_STAGES):
    if WITH_STATES:
      tl.store(_state(states, bh * N + n, iv, K, V, BV), S_KV)
    S_d = S_KV.to(dt)
    W_CK = tl.load(_chunk_rows(W, row0, n, 0, Tp, H, K, C, K))
    U0_CV = tl.load(_chunk_rows(U0, row0, n, iv * BV, Tp, H, V, C, BV))
    U_CV = U0_CV.to(tl.float32) - tl.dot(W_CK, S_d, input_precision=PREC)
    U_d = U_CV.to(dt)
    Qg_CK = tl.load(_chunk_rows(Qg, row0, n, 0, Tp, H, K, C, K))
    A_CC = tl.load(_chunk_rows(Aqk, row0, n, 0, Tp, H, C, C, C))
    O_CV = tl.dot(A_CC, U_d, acc=tl.dot(Qg_CK, S_d, input_precision=PREC),
                  input_precision=PREC)
    tl.store(_chunk_rows(O, row0, n, iv * BV, Tp, H, V, C, BV), O_CV.to(O.dtype.element_ty))
    Kd_CK = tl.load(_chunk_rows(Kd, row0, n, 0, Tp, H, K, C, K))
    decay_K = tl.load(decay + ((b * N + n) * H + h) * K + k_K)
    S_KV = tl.dot(tl.trans(Kd_CK), U_d, acc=S_KV * decay_K[:, None], input_precision=PREC)
  tl.store(_state(SN, bh, iv, K, V, BV), S_KV)


@triton.jit
def _kda_recurrence_bwd_triton(W, U0, Qg, Kd, Aqk, decay, states, dO, dSN,
                               dU0, U, dstates, dS0,
                               Tp: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                               V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                               PREC: tl.constexpr, NUM_STAGES: tl.constexpr):
  """The sequential part of stage 2's backward, dS carried from the last chunk to the
  first (pallas_gpu._recurrence_bwd_kernel's loop): per chunk dU0 = Aqkᵀ dO + Kd dS, the
  chunk's U = U0 - W S and the dS at its end, for the per-chunk gradient kernel."""
  iv = tl.program_id(0)
  bh = tl.program_id(1).to(tl.int64)
  b, h = bh // H, bh % H
  N: tl.constexpr = Tp // C
  dt = W.dtype.element_ty
  row0 = b * Tp * H + h
  dS_KV = tl.load(_state(dSN, bh, iv, K, V, BV)).to(tl.float32)
  k_K = tl.arange(0, K)
  for i in tl.range(0, N, num_stages=NUM_STAGES):
    n = N - 1 - i
    tl.store(_state(dstates, bh * N + n, iv, K, V, BV), dS_KV)
    S_d = tl.load(_state(states, bh * N + n, iv, K, V, BV)).to(dt)
    dS_d = dS_KV.to(dt)
    W_CK = tl.load(_chunk_rows(W, row0, n, 0, Tp, H, K, C, K))
    dO_d = tl.load(_chunk_rows(dO, row0, n, iv * BV, Tp, H, V, C, BV)).to(dt)
    U0_CV = tl.load(_chunk_rows(U0, row0, n, iv * BV, Tp, H, V, C, BV))
    U_CV = U0_CV.to(tl.float32) - tl.dot(W_CK, S_d, input_precision=PREC)
    tl.store(_chunk_rows(U, row0, n, iv * BV, Tp, H, V, C, BV), U_CV.to(U.dtype.element_ty))
    A_CC = tl.load(_chunk_rows(Aqk, row0, n, 0, Tp, H, C, C, C))
    Kd_CK = tl.load(_chunk_rows(Kd, row0, n, 0, Tp, H, K, C, K))
    dU_CV = tl.dot(tl.trans(A_CC), dO_d, acc=tl.dot(Kd_CK, dS_d, input_precision=PREC),
                   input_precision=PREC)
    tl.store(_chunk_rows(dU0, row0, n, iv * BV, Tp, H, V, C, BV),
             dU_CV.to(dU0.dtype.element_ty))
    Qg_CK = tl.load(_chunk_rows(Qg, row0, n, 0, Tp, H, K, C, K))
    decay_K = tl.load(decay + ((b * N + n) * H + h) * K + k_K)
    dS_KV = tl.dot(tl.trans(Qg_CK), dO_d, acc=dS_KV * decay_K[:, None], input_precision=PREC)
    dS_KV = tl.dot(tl.trans(W_CK), (-dU_CV).to(dt), acc=dS_KV, input_precision=PREC)
  tl.store(_state(dS0, bh, iv, K, V, BV), dS_KV)


class _HostArray:
  """A numpy array dressed as the torch tensor Triton's interpreter reads and writes in
  place (data_ptr, dtype, storage): host and "device" are the same memory here."""

  class _Storage:
    def __init__(self, arr):
      self.arr = arr

    def data_ptr(self):
      return self.arr.ctypes.data

    def cpu(self):
      return self

    def copy_(self, other):
      return self

  class _Dtype:
    def __init__(self, name):
      self.name = name

    def __str__(self):
      return "torch." + self.name

    @staticmethod
    @functools.cache
    def of(name):
      """One object per dtype: Triton caches a type by the dtype object's identity, and a
      fresh object can reuse a freed one's address (an fp32 array read as bf16)."""
      return _HostArray._Dtype(name)

  def __init__(self, arr):
    self.arr = arr

  dtype = property(lambda self: self._Dtype.of(str(self.arr.dtype)))
  data_ptr = lambda self: self.arr.ctypes.data
  untyped_storage = lambda self: self._Storage(self.arr)
  new_empty = lambda self, *a, **k: self
  set_ = lambda self, *a: self
  copy_ = lambda self, other: self
  storage_offset = lambda self: 0
  size = lambda self: self.arr.shape
  stride = lambda self: tuple(s // self.arr.itemsize for s in self.arr.strides)


@functools.cache
def _interpreter():
  """Triton's InterpretedFunction, with its bf16 arithmetic made the GPU's. Triton 3.6's
  interpreter holds bf16 as uint16 bits and (1) multiplies those integers in tl.dot: here
  they are widened to fp32 first, the exact products a bf16 tensor-core dot accumulates in
  fp32; (2) rounds fp32 to bf16 toward zero: here to nearest even, as the GPU's cvt.rn."""
  import ml_dtypes
  from triton.runtime import interpreter

  def to_f32(x):
    if x.dtype.scalar != tl.bfloat16:
      return x
    bits = x.data.astype(np.uint32) << 16
    return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

  builder = interpreter.InterpreterBuilder
  create_dot, cast_impl = builder.create_dot, builder.cast_impl

  def cast(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
      bits = src.data.astype(ml_dtypes.bfloat16).view(np.uint16)
      return interpreter.TensorHandle(bits, tl.bfloat16)
    return cast_impl(self, src, dst_type)

  builder.create_dot = lambda self, a, b, *rest: create_dot(self, to_f32(a), to_f32(b), *rest)
  builder.cast_impl = cast
  return interpreter.InterpretedFunction


@functools.cache
def _interpreted(kernel):
  """`kernel` for Triton's interpreter. Its @triton.jit helpers (_chunk_rows, _state) are
  swapped for interpreted ones in a copy of the module's globals: a JITFunction refuses to
  run outside a compiled kernel, and the interpreter writes into the globals it runs in."""
  interpreted = _interpreter()
  scope = dict(kernel.fn.__globals__)
  clone = lambda fn: types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__)
  for name, value in kernel.fn.__globals__.items():
    if isinstance(value, triton.runtime.JITFunction):
      scope[name] = interpreted(clone(value.fn))
  return interpreted(clone(kernel.fn))


def _interpret(kernel, grid, args, out_type, meta):
  """Run `kernel` with Triton's interpreter on the host, as jax_triton would on the GPU:
  outputs are allocated and passed after the inputs."""

  def host(*arrays):
    outs = [np.zeros(o.shape, o.dtype) for o in out_type]
    ins = [np.ascontiguousarray(a) for a in arrays]
    _interpreted(kernel)[grid](*map(_HostArray, ins + outs), **meta)
    return outs

  return jax.pure_callback(host, out_type, *args)


@functools.cache
def compile_for(kernel, signature, meta, num_warps, num_stages, capability=90):
  """`kernel` compiled by the triton package for a CUDA GPU of this compute capability, as
  jax_triton builds it: signature and meta as sorted (name, value) tuples, every array
  16-byte aligned (jax_triton's assumption; it lets Triton copy rows asynchronously, and
  so sets the pipeline's shared memory). Runs without a GPU (the package's LLVM, ptxas)."""
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource
  meta = dict(meta)
  aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(signature))}
  src = ASTSource(kernel, {**dict(signature), **{n: "constexpr" for n in meta}}, meta,
                  aligned)
  return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                        options={"num_warps": num_warps, "num_stages": num_stages})


def _capability():
  cc = getattr(jax.devices()[0], "compute_capability", "9.0")
  major, minor = str(cc).split(".")
  return int(major) * 10 + int(minor)


def build(kernel, arrays, meta, stages, capability=90):
  """compile_for with these arrays (inputs, then outputs: anything with a dtype) as the
  kernel's pointer arguments, at this pipeline depth and the shipped WARPS."""
  pointers = [n for n, p in zip(kernel.arg_names, kernel.params) if not p.is_constexpr]
  signature = tuple((n, _TRITON_TYPES[jnp.dtype(a.dtype)]) for n, a in zip(pointers, arrays))
  items = tuple(sorted({**meta, "NUM_STAGES": stages}.items()))
  return compile_for(kernel, signature, items, WARPS, stages, capability)


def _fitting_stages(kernel, arrays, meta):
  """The most chunks in flight (≤ STAGES) whose buffers fit in shared memory: each stage
  holds a chunk's rows of every loaded array, so wide heads and fp32 take fewer (H200,
  K = V = 128: the bf16 backward and the fp32 forward exceed 227 KB at 3 stages)."""
  cc = _capability()
  limit = MAX_SHARED.get(cc, min(MAX_SHARED.values()))
  for stages in range(STAGES, 1, -1):
    if build(kernel, arrays, meta, stages, cc).metadata.shared <= limit:
      return stages
  return 1


@functools.cache
def _jax_triton():
  """jax_triton (the GPU's custom call; imported only there). Its 0.4.1 imports TMA_TF32
  from Triton's NVIDIA driver, which Triton 3.6 (the GPU machine's, torch's) lacks; the
  failed import silently stubs out jax_triton's whole NVIDIA backend. The constant is read
  only for TMA tensor descriptors of fp32 rounded to TF32, which these kernels do not use."""
  import triton.backends.nvidia.driver as driver
  if not hasattr(driver, "TMA_TF32"):
    driver.TMA_TF32 = 0
  import jax_triton
  return jax_triton


def _launch(kernel, grid, args, out_type, meta, *, name, interpret):
  if interpret:
    return _interpret(kernel, grid, args, out_type, {**meta, "NUM_STAGES": STAGES})
  stages = _fitting_stages(kernel, [*args, *out_type], meta)
  return _jax_triton().triton_call(*args, kernel=kernel, out_type=out_type, grid=grid, name=name,
                                num_warps=WARPS, num_stages=stages, NUM_STAGES=stages,
                                **meta)


def _fp32_dots():
  """Triton's input_precision for fp32 dots, as Pallas's lowering picks it: IEEE under
  jax_default_matmul_precision "highest" / "float32", else TF32."""
  return ("ieee" if str(jax.config.jax_default_matmul_precision).lower() in
          ("highest", "float32") else "tf32")


def _recurrence_call(st, S0, *, chunk_size, with_states, interpret):
  B, Tp, H, K = st["W"].shape
  V = st["U0"].shape[-1]
  C, N, BV = chunk_size, Tp // chunk_size, min(V, BLOCK_V)
  out_type = [jax.ShapeDtypeStruct((B, Tp, H, V), st["U0"].dtype),
              jax.ShapeDtypeStruct((B, H, K, V), F32),
              # unwritten without states: the kernel's pointer needs an argument
              jax.ShapeDtypeStruct((B, H, N, K, V) if with_states else (1,), F32)]
  prec = _fp32_dots() if st["W"].dtype == F32 else "tf32"   # (ignored for bf16)
  meta = dict(Tp=Tp, H=H, K=K, V=V, C=C, BV=BV, WITH_STATES=with_states, PREC=prec)
  args = (st["W"], st["U0"], st["Qg"], st["Kd"], st["Aqk"], st["decay"], S0)
  O, SN, states = _launch(_kda_recurrence_triton, (V // BV, B * H), args, out_type, meta,
                          name="kda_recurrence_triton", interpret=interpret)
  return (O, SN, states) if with_states else (O, SN)


def _recurrence_bwd_call(st, states, dO, dSN, *, chunk_size, interpret):
  """The sequential backward in Triton, then pallas_gpu's per-chunk gradient kernel."""
  B, Tp, H, K = st["W"].shape
  V = st["U0"].shape[-1]
  C, N, BV, dt = chunk_size, Tp // chunk_size, min(V, BLOCK_V), st["W"].dtype
  out_type = [jax.ShapeDtypeStruct((B, Tp, H, V), dt),        # dU0
              jax.ShapeDtypeStruct((B, Tp, H, V), dt),        # U, for the grads kernel
              jax.ShapeDtypeStruct((B, H, N, K, V), F32),     # dS at each chunk's end
              jax.ShapeDtypeStruct((B, H, K, V), F32)]        # dS0
  meta = dict(Tp=Tp, H=H, K=K, V=V, C=C, BV=BV, PREC=_fp32_dots() if dt == F32 else "tf32")
  args = (st["W"], st["U0"], st["Qg"], st["Kd"], st["Aqk"], st["decay"], states, dO, dSN)
  dU0, U, dstates, dS0 = _launch(_kda_recurrence_bwd_triton, (V // BV, B * H), args, out_type,
                                 meta, name="kda_recurrence_bwd_triton", interpret=interpret)
  return pallas_gpu._recurrence_grads_call(states, dstates, dO, U, dU0, dS0, chunk_size=C,
                                           interpret=interpret)


# Stage 2: Triton's sequential kernels forward and backward, pallas_gpu's per-chunk
# gradient kernel.
recurrence = recurrence_with_vjp(_recurrence_call, _recurrence_bwd_call)


def kda_triton(q, k, v, g, beta, **kw):
  """kda_pallas_gpu's contract and arguments, stage 2's forward in native Triton."""
  return pallas_gpu.kda_pallas_gpu(q, k, v, g, beta, stage2=recurrence, **kw)
