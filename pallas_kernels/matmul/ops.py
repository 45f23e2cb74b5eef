"""The matmul kernels' entry point: the dot_general a model projection uses for a
model.decode_matmul choice ("pallas": pallas_gpu_few_rows.py's kernel for a few rows (decoding) on
GPU, lax.dot_general otherwise; "xla": lax.dot_general). reference.py holds the spec."""

from pallas_kernels.matmul import pallas_gpu_few_rows

IMPLEMENTATIONS = ("xla", "pallas")


def dot_general(implementation: str):
  """The dot_general for flax's Dense layers: None (flax's default, lax.dot_general) for
  "xla"; pallas_gpu_few_rows.dot_general for "pallas"."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"decode matmul implementation must be one of {IMPLEMENTATIONS}, got "
                     f"{implementation!r}")
  return pallas_gpu_few_rows.dot_general if implementation == "pallas" else None
