"""Head dims as Triton holds them: the attention kernels' tiles are powers of two, at least
16 wide (Triton's smallest dot)."""

from jax.experimental import pallas as pl


def tile_dim(d: int) -> int:
  """The tile width that holds a dim of d: d padded up to a power of two ≥ 16."""
  return max(16, pl.next_power_of_2(d))


def head_parts(d: int, split: bool = True) -> list[tuple[int, int]]:
  """[(start, width)] of the parts a head dim of d runs as: [(0, d)] (padded to tile_dim(d)),
  or with `split` and d two tiles (a power of two and the rest, both ≥ 16: Kimi's 192 =
  128 + 64) two parts, each a whole tile, whose products are summed: a quarter fewer score
  FLOPs and loads than one tile of 256."""
  d1 = tile_dim(d) // 2
  if split and tile_dim(d) != d and d1 >= 16 and tile_dim(d - d1) == d - d1:
    return [(0, d1), (d1, d - d1)]
  return [(0, d)]
