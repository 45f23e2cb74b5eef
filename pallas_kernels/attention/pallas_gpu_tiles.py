"""Head dims as Triton holds them: the attention kernels' tiles are powers of two, at least
16 wide (Triton's smallest dot)."""

from jax.experimental import pallas as pl


def tile_dim(d: int) -> int:
  """The tile width that holds a dim of d: d padded up to a power of two ≥ 16."""
  return max(16, pl.next_power_of_2(d))
