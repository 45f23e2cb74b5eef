"""Registers and spills of every Pallas Triton kernel of the KDA op or the flash kernels
(and, through triton_report, of native Triton kernels such as triton_gpu.py's),
without a GPU: the kernels are lowered for an H200 (as tests/test_kda_triton_lowering.py
does), their Triton IR is compiled to PTX by the `triton` package and ptxas -v reports
registers, stack and spills for sm_90a.

  (the triton package, 3.6 as on the GPU machine, comes with `pip install -e '.[dev]'`)
  python -m benchmarks.kernel_registers --op=kda --dim=64 --warps=kda_intra_tiles_bwd=8

Launch widths are the ones the code ships (read from the lowering) unless --warps sets
one. Spills or 255 registers at a kernel's width mean fewer resident warps and local-memory
traffic; that is where a launch-width or block change can pay, and where fusing more work
into a kernel will not (benchmarks/kda.md). The triton package's pipeline is close to but
not the same as XLA's own Triton (jaxlib's), so the counts are a guide, not the H200's.
"""

import os
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp
from absl import app, flags
from jax._src.pallas.triton import gpu_info, lowering, pallas_call_registration

_OP = flags.DEFINE_enum("op", "kda", ["kda", "kda_unbounded", "flash"], "Which kernels: "
                        "KDA's (pallas_gpu, forward and backward; kda_unbounded: Kimi's gate "
                        "on the Pallas stage 1) or the training flash kernels "
                        "(pallas_gpu_causal.py).")
_DIM = flags.DEFINE_integer("dim", 64, "Head dim (K = V for KDA; D = Dv for flash).")
_WARPS = flags.DEFINE_list("warps", [], "KERNEL=N overrides of the shipped num_warps.")
_KEEP = flags.DEFINE_string("keep", None, "Folder to keep the .ttir and .ptx files in.")


def dump_ttir(fn, args, out_dir, stages=False):
  """{kernel name: num_warps} ({name: (num_warps, num_stages)} with stages), each kernel's
  Triton IR written to out_dir/<name>.ttir."""
  h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  get_info = pallas_call_registration.gpu_info_lib.get_gpu_info
  lower = lowering.lower_jaxpr_to_triton_module
  kernels = {}

  def capture(jaxpr, grid_mapping, *a, **k):
    result = lower(jaxpr, grid_mapping, *a, **k)
    name = jaxpr.debug_info.func_name
    with open(os.path.join(out_dir, f"{name}.ttir"), "w") as f:
      f.write(result.module.operation.get_asm())
    kernels[name] = None
    return result

  pallas_call_registration.gpu_info_lib.get_gpu_info = lambda: h200
  lowering.lower_jaxpr_to_triton_module = capture
  jax.clear_caches()   # an inner jit lowered before would be reused without its kernels
  try:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  finally:
    pallas_call_registration.gpu_info_lib.get_gpu_info = get_info
    lowering.lower_jaxpr_to_triton_module = lower
  for name in kernels:   # the launch width (and pipeline depth) each custom call carries
    m = re.search(rf'name = "{name}".*?num_warps = (\d+)', text, re.S)
    kernels[name] = int(m.group(1)) if m else 4
    if stages:
      m = re.search(rf'name = "{name}".*?num_stages = (\d+)', text, re.S)
      kernels[name] = (kernels[name], int(m.group(1)) if m else 3)
  return kernels


def ptxas_report(ttir_path, num_warps):
  """(registers, spill-store bytes) a thread of one Pallas kernel, compiled for sm_90a."""
  import triton   # only this step needs the package
  from triton.backends.compiler import GPUTarget
  compiled = triton.compile(ttir_path, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": 1})
  return _ptxas(compiled.asm["ptx"], ttir_path[:-len(".ttir")] + ".ptx")


def shared_bytes(ttir_path, num_warps, num_stages):
  """Bytes of shared memory one program of a Pallas kernel asks for at launch, compiled for
  sm_90a by the triton package at the kernel's own pipeline depth (the H100/H200 give a
  block at most 232,448)."""
  import triton
  from triton.backends.compiler import GPUTarget
  compiled = triton.compile(ttir_path, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
  return compiled.metadata.shared


def triton_report(compiled, out_dir):
  """(registers, spill-store bytes) a thread of a native Triton kernel compiled by the
  triton package (triton_launch.build / compile_for: as jax_triton builds it)."""
  return _ptxas(compiled.asm["ptx"], os.path.join(out_dir, f"{compiled.name}.ptx"))


def _ptxas(ptx, ptx_path):
  import triton
  with open(ptx_path, "w") as f:
    f.write(ptx)
  ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
  log = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx_path, "-o", os.devnull],
                       capture_output=True, text=True, check=True).stderr
  regs = re.search(r"Used (\d+) registers", log)
  spill = re.search(r"(\d+) bytes spill stores", log)
  return int(regs.group(1)), int(spill.group(1)) if spill else 0


def kda_kernels(D, unbounded=False):
  """The KDA op's kernels, forward and backward; unbounded: Kimi's gate, with stage 1 on
  the Pallas tiles kernels (pallas_gpu.intra_unbounded)."""
  from pallas_kernels.kda import pallas_gpu
  bf = lambda *s: jnp.zeros(s, jnp.bfloat16)
  B, T, H = 1, 256, 2
  gate = dict(lower_bound=None, unbounded_stage1="pallas") if unbounded else {}

  def fwd_bwd(q, k, v, x, beta, A_log, dt_bias):
    fwd = lambda *a: pallas_gpu.kda_pallas_gpu(*a[:5], A_log=a[5], dt_bias=a[6],
                                               qk_l2norm=True, interpret=False, **gate)[0]
    o, vjp = jax.vjp(fwd, q, k, v, x, beta, A_log, dt_bias)
    return vjp(o)

  return fwd_bwd, (bf(B, T, H, D), bf(B, T, H, D), bf(B, T, H, D), bf(B, T, H, D),
                   bf(B, T, H), jnp.zeros(H), jnp.zeros(H * D))


def flash_kernels(D):
  from pallas_kernels.attention.pallas_gpu_causal import causal_attention
  bf = lambda *s: jnp.zeros(s, jnp.bfloat16)
  B, T, H = 1, 512, 2
  seg = jnp.ones((B, T), jnp.int32)

  def fwd_bwd(q, k, v):
    o, vjp = jax.vjp(lambda *a: causal_attention(*a, seg, interpret=False), q, k, v)
    return vjp(o)

  return fwd_bwd, (bf(B, T, H, D), bf(B, T, H, D), bf(B, T, H, D))


def main(argv):
  del argv
  fn, args = (flash_kernels(_DIM.value) if _OP.value == "flash"
              else kda_kernels(_DIM.value, unbounded=_OP.value == "kda_unbounded"))
  overrides = {k: int(v) for k, v in (w.split("=") for w in _WARPS.value)}
  out_dir = _KEEP.value or tempfile.mkdtemp()
  os.makedirs(out_dir, exist_ok=True)
  kernels = dump_ttir(fn, args, out_dir)
  print(f"{_OP.value} kernels, head dim {_DIM.value}, sm_90a:")
  print("| kernel | num_warps | registers / thread | spill stores, bytes / thread |")
  print("|---|---|---|---|")
  for name, warps in sorted(kernels.items()):
    warps = overrides.get(name, warps)
    regs, spill = ptxas_report(os.path.join(out_dir, f"{name}.ttir"), warps)
    print(f"| {name} | {warps} | {regs} | {spill} |", flush=True)


if __name__ == "__main__":
  app.run(main)
