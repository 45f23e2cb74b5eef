"""Shared building blocks: partitioned dense/norm factories, SwiGLU, segment-aware short conv."""


import flax.linen as nn
import jax
import jax.numpy as jnp

from pallas_kernels.matmul import ops as matmul_ops

lp = nn.with_logical_partitioning


def dtype_of(cfg):
  return jnp.dtype(cfg.dtype)


def dense(cfg, features, axes, name, *, axis=-1, scale=1.0, use_bias=False):
  """DenseGeneral contracting `axis`; `axes` are the kernel's logical names (*in, *out)."""
  n_in = len(axis) if isinstance(axis, tuple) else 1
  # DenseGeneral hands the initializer the kernel flattened to 2-D (in, out): fans are right.
  init = nn.initializers.variance_scaling(scale, "fan_in", "truncated_normal")
  # decode_matmul=pallas: a few rows (decoding) on GPU go to one Pallas kernel per projection.
  dot_general = matmul_ops.dot_general(cfg.decode_matmul)
  return nn.DenseGeneral(features, axis=axis, use_bias=use_bias, dtype=dtype_of(cfg),
                         param_dtype=jnp.float32, kernel_init=lp(init, axes), name=name,
                         bias_init=lp(nn.initializers.zeros, axes[n_in:]),
                         dot_general=dot_general)


def rms_norm(cfg, name, axis_name="norm", eps=None):
  return nn.RMSNorm(epsilon=cfg.norm_eps if eps is None else eps, dtype=dtype_of(cfg), param_dtype=jnp.float32,
                    scale_init=lp(nn.initializers.ones, (axis_name,)), name=name)


ONE_HOT_VOCAB = 4096   # up to this vocabulary the embedding lookup is a one-hot matmul


def embed_lookup(embed: nn.Embed, tokens_BxT):
  """embed(tokens), as a one-hot matmul for small vocabularies. Its gradient is then a matmul
  too: the gather's gradient is a scatter-add of every token's row into V table rows, which
  on the H200 took 28.6 ms per step for 32 768 tokens into the 259 byte rows (atomics on few
  addresses), against well under a millisecond for the matmul. The lookup stays exact: each
  output sums one table entry times 1.

  Larger vocabularies gather the rows from the fp32 table and cast only those: nn.Embed casts
  the whole table to the compute dtype first, and its gradient is then a bf16 scatter-add
  into a [V, D] bf16 buffer converted to fp32 after (10.2 ms of the Kimi-48B slice's step
  at V = 163,840 on the H200, benchmarks/train.md). Here the scatter-add is fp32 into the
  fp32 gradient, and a token's repeats sum in fp32. Same rows, bit for bit."""
  V = embed.num_embeddings
  if V > ONE_HOT_VOCAB:
    return jnp.take(embed.embedding, tokens_BxT, axis=0).astype(embed.dtype)
  table_VxD = embed.embedding.astype(embed.dtype)
  one_hot_BxTxV = jax.nn.one_hot(tokens_BxT, V, dtype=embed.dtype)
  return jnp.einsum("btv,vd->btd", one_hot_BxTxV, table_VxD,
                    precision=jax.lax.Precision.HIGHEST)


def out_scale(cfg):
  """Residual-branch output projections shrink with depth (GPT-2 style)."""
  return 1.0 / (2 * cfg.n_layers)


class SwiGLU(nn.Module):
  """Dense gated FFN: down(silu(gate(x)) * up(x))."""
  cfg: object
  hidden: int

  @nn.compact
  def __call__(self, x_BxTxD):
    D = x_BxTxD.shape[-1]
    gate_BxTxF = dense(self.cfg, self.hidden, ("embed", "mlp"), "gate")(x_BxTxD)
    up_BxTxF = dense(self.cfg, self.hidden, ("embed", "mlp"), "up")(x_BxTxD)
    h_BxTxF = nn.silu(gate_BxTxF) * up_BxTxF
    return dense(self.cfg, D, ("mlp", "embed"), "down", scale=out_scale(self.cfg))(h_BxTxF)


def segment_shift(x_BxTxC, segment_ids_BxT, shift):
  """x[t - shift] where it lies in the same segment as t, else 0 (causal, no cross-document leak)."""
  if shift == 0:
    return x_BxTxC
  x_prev = jnp.pad(x_BxTxC, ((0, 0), (shift, 0), (0, 0)))[:, :-shift]
  seg_prev = jnp.pad(segment_ids_BxT, ((0, 0), (shift, 0)), constant_values=-1)[:, :-shift]
  return jnp.where((seg_prev == segment_ids_BxT)[..., None], x_prev, 0)


class ShortConv(nn.Module):
  """Depthwise causal convolution over time followed by SiLU (KDA's q/k/v pre-mixing).

  With `cache` ({"x": [B, W-1, C], "seg": [B, W-1]}: the last W-1 live inputs of each row
  and their segment ids) the window reaches back into earlier calls; returns (y, new cache).
  Live tokens must come first in each row (right padding), as in prefill and decode.
  """
  cfg: object
  width: int

  @nn.compact
  def __call__(self, x_BxTxC, segment_ids_BxT, cache=None):
    C = x_BxTxC.shape[-1]
    init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=0,
                                            out_axis=1)
    w_WxC = self.param("kernel", lp(init, ("conv", "kda_channels")), (self.width, C), jnp.float32)
    w_WxC = w_WxC.astype(x_BxTxC.dtype)
    conv = lambda x, seg: nn.silu(sum(segment_shift(x, seg, j) * w_WxC[j]
                                      for j in range(self.width)))
    if cache is None:
      if self.cfg.get("kda_conv_implementation", "") == "triton":
        # Native Triton kernels, forward and backward (interpreted off a GPU); the triton
        # package is optional, so imported on use.
        from pallas_kernels.kda import triton_gpu_short_conv
        return triton_gpu_short_conv.short_conv(x_BxTxC, w_WxC, segment_ids_BxT)
      return conv(x_BxTxC, segment_ids_BxT)
    W1 = self.width - 1
    # The barrier keeps XLA GPU from fusing the input projection into the concatenate as a
    # naive reduction: at decode (T = 1) that one kernel took 0.3 ms, 90% of a KDA layer.
    x_BxTxC = jax.lax.optimization_barrier(x_BxTxC)
    x_ext = jnp.concatenate([cache["x"].astype(x_BxTxC.dtype), x_BxTxC], axis=1)
    seg_ext = jnp.concatenate([cache["seg"], segment_ids_BxT.astype(cache["seg"].dtype)], 1)
    y_BxTxC = conv(x_ext, seg_ext)[:, W1:]
    # The new tail: the W-1 positions before each row's first padding token.
    start_B = (segment_ids_BxT != 0).sum(-1)
    idx_BxW1 = start_B[:, None] + jnp.arange(W1)
    new = {"x": jnp.take_along_axis(x_ext, idx_BxW1[..., None], 1).astype(cache["x"].dtype),
           "seg": jnp.take_along_axis(seg_ext, idx_BxW1, 1)}
    return y_BxTxC, new


