"""Bounded-decay Kimi delta attention (KDA): public op, gate and references."""

from pallas_kernels.kda.gate import kda_gate
from pallas_kernels.kda.ops import decode_step, kda

__all__ = ["decode_step", "kda", "kda_gate"]
