"""Attention-residual ablation on the embedded corpus: `tiny` with the plain residual vs
Block AttnRes (blocks of 2 sub-layers = one layer, so 4 blocks + the embedding).

  python scripts/train.py --config=configs/experiments/ablation_attn_res.py:none  --workdir=workdir/ar_none
  python scripts/train.py --config=configs/experiments/ablation_attn_res.py:block --workdir=workdir/ar_block

Compare final val bits/byte (printed at the end, and in each workdir's metrics).
"""

from configs import tiny

MODES = ("none", "block", "full", "mix")


def get_config(arg="block"):
  c = tiny.get_config()
  if arg not in MODES:
    raise ValueError(f"configs/experiments/ablation_attn_res.py arg must be one of {MODES}; got {arg!r}")
  c.model.attn_res = arg
  c.model.attn_res_block_size = 2
  return c
