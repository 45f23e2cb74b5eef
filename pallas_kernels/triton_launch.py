"""Launching Triton kernels from JAX: through jax_triton on a GPU (compiled on a worker
thread from the moment the call is traced), or Triton's interpreter on host arrays inside a
`jax.pure_callback` elsewhere (the CPU tests). Also compiles a kernel for a CUDA target
without a GPU (compile_for, shared_for), as jax_triton would build it, to check its
registers and shared memory. Needs the `triton` package; jax_triton only on a GPU
(jax_triton_compat)."""

import functools
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from pallas_kernels import jax_triton_compat, triton_precompile

# Shared memory a block may use (opt-in maximum) by compute capability; the default is the
# smallest of these.
MAX_SHARED = {80: 166912, 87: 166912, 90: 232448, 100: 232448}
TRITON_TYPES = {jnp.dtype(jnp.bfloat16): "*bf16", jnp.dtype(jnp.float16): "*fp16",
                 jnp.dtype(jnp.float32): "*fp32", jnp.dtype(jnp.int32): "*i32"}


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
  fp32; (2) rounds fp32 to bf16 toward zero: here to nearest even, as the GPU's cvt.rn.
  (3) It holds scalars as 1-element arrays, which NumPy 2.x refuses to turn into an int, so
  a loop bound computed from program_id failed; they are read with .item() here."""
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

  patch_tensor = interpreter._patch_lang_tensor

  def patch_with_index(tensor, scope):
    patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

  builder.create_dot = lambda self, a, b, *rest: create_dot(self, to_f32(a), to_f32(b), *rest)
  builder.cast_impl = cast
  interpreter._patch_lang_tensor = patch_with_index
  return interpreter.InterpretedFunction


@functools.cache
def _interpreted(kernel):
  """`kernel` for Triton's interpreter. Its @triton.jit helpers (chunk_rows, _state) are
  swapped for interpreted ones in a copy of the module's globals: a JITFunction refuses to
  run outside a compiled kernel, and the interpreter writes into the globals it runs in."""
  interpreted = _interpreter()
  scope = dict(kernel.fn.__globals__)
  clone = lambda fn: types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__)
  for name, value in kernel.fn.__globals__.items():
    if isinstance(value, triton.runtime.JITFunction):
      scope[name] = interpreted(clone(value.fn))
  return interpreted(clone(kernel.fn))


# Triton's interpreter patches triton.language's functions for the length of a launch and
# restores them after: two launches at once (XLA's CPU runtime runs independent callbacks,
# a grouped matmul's dx and dw, on two threads) would see each other's restore mid-kernel
# ("Did you forget to add @triton.jit?"). Launches take turns.
_INTERPRETER_LOCK = threading.Lock()


def run_interpreted(kernel, grid, args, out_type, meta):
  """Run `kernel` with Triton's interpreter on the host, as jax_triton would on the GPU:
  outputs are allocated and passed after the inputs."""

  def host(*arrays):
    outs = [np.zeros(o.shape, o.dtype) for o in out_type]
    ins = [np.ascontiguousarray(a) for a in arrays]
    with _INTERPRETER_LOCK:
      _interpreted(kernel)[grid](*map(_HostArray, ins + outs), **meta)
    return outs

  return jax.pure_callback(host, out_type, *args)


def _source(kernel, signature, meta):
  """`kernel` as jax_triton hands it to Triton: signature and meta as sorted (name, value)
  tuples, every array 16-byte aligned (jax_triton's assumption; it lets Triton copy rows
  asynchronously, and so sets the pipeline's shared memory)."""
  from triton.compiler import ASTSource
  meta = dict(meta)
  aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(signature))}
  return ASTSource(kernel, {**dict(signature), **{n: "constexpr" for n in meta}}, meta,
                   aligned)


def _target(capability):
  from triton.backends.compiler import GPUTarget
  return GPUTarget("cuda", capability, 32)


@functools.cache
def compile_for(kernel, signature, meta, num_warps, num_stages, capability=90):
  """`kernel` compiled by the triton package for a CUDA GPU of this compute capability
  (to a cubin, with ptxas: registers and spills), as jax_triton builds it. Runs without a
  GPU."""
  return triton.compile(_source(kernel, signature, meta), target=_target(capability),
                        options={"num_warps": num_warps, "num_stages": num_stages})


@functools.cache
def shared_for(kernel, signature, meta, num_warps, num_stages, capability=90):
  """compile_for's shared memory in bytes, from Triton's passes up to LLVM IR only, where
  jax_triton reads it too: no PTX, no ptxas (the half of a build that fitting_stages
  spent on every start)."""
  from triton._C.libtriton import ir
  from triton.compiler.compiler import make_backend
  src, target = _source(kernel, signature, meta), _target(capability)
  backend = make_backend(target)
  options = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages})
  context = ir.context()
  ir.load_dialects(context)
  backend.load_dialects(context)
  module = src.make_ir(target, options, backend.get_codegen_implementation(options),
                       backend.get_module_map(), context)
  passes, metadata = {}, {}
  backend.add_stages(passes, options, src.language)
  for stage in ("ttir", "ttgir", "llir"):
    module = passes[stage](module, metadata)
  return metadata["shared"]


def capability():
  cc = getattr(jax.devices()[0], "compute_capability", "9.0")
  major, minor = str(cc).split(".")
  return int(major) * 10 + int(minor)


def signature(kernel, arrays, meta, stages):
  pointers = [n for n, p in zip(kernel.arg_names, kernel.params) if not p.is_constexpr]
  signature = tuple((n, TRITON_TYPES[jnp.dtype(a.dtype)]) for n, a in zip(pointers, arrays))
  return signature, tuple(sorted({**meta, "NUM_STAGES": stages}.items()))


def build(kernel, arrays, meta, stages, warps, capability=90):
  """compile_for with these arrays (inputs, then outputs: anything with a dtype) as the
  kernel's pointer arguments, at this pipeline depth and launch width."""
  return compile_for(kernel, *signature(kernel, arrays, meta, stages), warps, stages,
                     capability)


def fitting_stages(kernel, arrays, meta, warps, max_stages):
  """The most pipeline stages (≤ max_stages) whose buffers fit in shared memory: a stage
  holds a block of every loaded array, so wide blocks and fp32 take fewer."""
  cc = capability()
  limit = MAX_SHARED.get(cc, min(MAX_SHARED.values()))
  for stages in range(max_stages, 1, -1):
    if shared_for(kernel, *signature(kernel, arrays, meta, stages), warps, stages, cc) <= limit:
      return stages
  return 1


def launch(kernel, grid, args, out_type, meta, *, name, interpret, warps, max_stages,
           stages=None):
  """jax_triton's call of `kernel` at `warps` and `stages` pipeline stages (NUM_STAGES, a
  constexpr the kernel's loops read), or without `stages` the deepest pipeline up to
  max_stages that fits (fitting_stages: one more compile). jax_triton's compile starts now
  on a worker thread (triton_precompile). interpret: Triton's interpreter on the host."""
  if interpret:
    return run_interpreted(kernel, grid, args, out_type, {**meta, "NUM_STAGES": max_stages})
  if stages is None:
    stages = fitting_stages(kernel, [*args, *out_type], meta, warps, max_stages)
  call = dict(kernel=kernel, out_type=out_type, grid=grid, name=name, num_warps=warps,
              num_stages=stages, NUM_STAGES=stages, **meta)
  jax_triton = jax_triton_compat.load()
  triton_precompile.submit(jax_triton, args, **call)   # compiles while the trace goes on
  return jax_triton.triton_call(*args, **call)


def fp32_dots():
  """Triton's input_precision for fp32 dots, as Pallas's lowering picks it: IEEE under
  jax_default_matmul_precision "highest" / "float32", else TF32."""
  return ("ieee" if str(jax.config.jax_default_matmul_precision).lower() in
          ("highest", "float32") else "tf32")
