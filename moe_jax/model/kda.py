"""KDA mixer: projections, short conv, L2-normed q/k, bounded gate, delta-rule scan, gated norm."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.model import remat
from moe_jax.model.layers import ShortConv, dense, dtype_of, lp, out_scale, rms_norm
from moe_jax.parallel.kda_sequence import kda_sequence_parallel
from moe_jax.parallel.mesh import axis_size, per_device, single_device
from pallas_kernels import platform
from pallas_kernels.kda import decode_step, kda, kda_gate, ops as kda_ops
from pallas_kernels.kda.reference import l2_normalize


def _A_log_init(key, shape, dtype=jnp.float32):
  """Per-head decay rate A ~ U(1, 16), stored as log A (as in fla's KDA)."""
  return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))


def _dt_bias_init(key, shape, dtype=jnp.float32):
  """Inverse softplus of dt ~ logU(1e-3, 1e-1): slow decay (long memory) at init."""
  u = jax.random.uniform(key, shape, dtype)
  dt = jnp.maximum(jnp.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)), 1e-4)
  return dt + jnp.log(-jnp.expm1(-dt))


FUSED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "f_a", "b_proj", "g_a")   # in_proj's order


def _widths(H: int, K: int) -> dict:
  return dict(zip(FUSED_PROJECTIONS, (H * K, H * K, H * K, K, H, K)))


def _input_projections(cfg, x_BxTxD, H: int, K: int, fused: bool) -> tuple[tuple, dict]:
  """(arrays, where): the six projections of x, q, k, v [.., H·K], f_a [.., K], b_proj
  [.., H] and g_a [.., K], with where[name] = (index into arrays, first column). Six
  matmuls, or fused, one (`in_proj`, kernel [D, 3·H·K + 2·K + H]): at decode each matmul is
  its own kernels."""
  widths = _widths(H, K)
  if not fused:
    axes = dict(q_proj=("embed", "kda_channels"), k_proj=("embed", "kda_channels"),
                v_proj=("embed", "kda_channels"), f_a=("embed", "kda_rank"),
                b_proj=("embed", "heads"), g_a=("embed", "kda_rank"))
    arrays = tuple(dense(cfg, w, axes[name], name)(x_BxTxD) for name, w in widths.items())
    return arrays, {name: (i, 0) for i, name in enumerate(widths)}
  y = dense(cfg, sum(widths.values()), ("embed", "kda_fused"), "in_proj")(x_BxTxD)
  firsts = np.cumsum([0, *widths.values()])
  return (y,), {name: (0, int(first)) for name, first in zip(widths, firsts)}


def _by_name(arrays, where, H: int, K: int) -> dict:
  widths = _widths(H, K)
  return {name: arrays[i][..., first:first + widths[name]] for name, (i, first) in where.items()}


def fuse_projection_params(mixer_params: dict) -> dict:
  """A KDA mixer's parameters with its six input projections as one `in_proj` (their
  kernels side by side, in FUSED_PROJECTIONS order): model.fused_projections' layout."""
  out = {k: v for k, v in mixer_params.items() if k not in FUSED_PROJECTIONS}
  kernels = [mixer_params[name]["kernel"] for name in FUSED_PROJECTIONS]
  out["in_proj"] = {"kernel": jnp.concatenate(kernels, axis=-1)}
  return out


def split_projection_params(mixer_params: dict, H: int, K: int) -> dict:
  """fuse_projection_params' inverse: a fused `in_proj` back into the six kernels (as
  stored, no copy of the other parameters); parameters without one as they are."""
  if "in_proj" not in mixer_params:
    return mixer_params
  out = {k: v for k, v in mixer_params.items() if k != "in_proj"}
  kernel, first = mixer_params["in_proj"]["kernel"], 0
  for name, width in _widths(H, K).items():
    out[name] = {"kernel": kernel[..., first:first + width]}
    first += width
  return out


def fuse_projections(params):
  """A params tree (scanned layers stacked or not) with every KDA mixer's six input
  projections fused (fuse_projection_params); other leaves as they were."""
  if not isinstance(params, dict):
    return params
  if all(name in params for name in FUSED_PROJECTIONS):
    return fuse_projection_params(params)
  return {k: fuse_projections(v) for k, v in params.items()}


def decode_by_kernel(cfg) -> bool:
  """Whether a one-token step runs pallas_gpu_decode's kernel (model.kda_decode): "kernel"
  anywhere but a TPU (interpreted off a GPU, as in the tests), "auto" on GPU where its
  shapes fit (K = V a power of two ≥ 16, a conv of width ≥ 2), else the XLA step. On the
  H100 at 1M context the kernel took the hybrid's batch-1 step 2.204 → 2.134 ms
  (benchmarks/decode.md)."""
  choice = cfg.get("kda_decode", "auto")
  if choice == "kernel":
    return platform.target() != "tpu"
  K = cfg.kda_head_dim
  return (choice == "auto" and platform.target() == "gpu"
          and kda_ops.decode_step_fits(K, K, cfg.kda_conv_size))


def kda_heads(cfg) -> int:
  """KDA's head count: model.kda_n_heads, or with 0 the model's n_heads (MLA's)."""
  return cfg.get("kda_n_heads", 0) or cfg.n_heads


class KDAMixer(nn.Module):
  """With `cache` (infer/cache.py: fp32 state [B,H,K,V] + short-conv tails) it continues
  from the cached state and returns (o, new cache); one token uses the recurrent update."""
  cfg: object

  @nn.compact
  def __call__(self, x_BxTxD, segment_ids_BxT, cache=None):
    cfg = self.cfg
    B, T, D = x_BxTxD.shape
    H, K = kda_heads(cfg), cfg.kda_head_dim
    new_cache = {}

    # The layout is model.fused_projections' when initialising, else the one the params
    # hold: inference_variables fuses the six (the inference model's layout), and training
    # variables, six or fused, apply to either model as they are.
    fused = (cfg.get("fused_projections", False) if self.is_initializing()
             else self.has_variable("params", "in_proj"))
    arrays, where = _input_projections(cfg, x_BxTxD, H, K, fused)
    # The kernel is Triton's (interpreted off a GPU, as in the tests); a TPU takes XLA's step.
    if (cache is not None and T == 1 and decode_by_kernel(cfg) and single_device()
        and not self.is_initializing()):
      return self._decode_kernel(arrays, where, segment_ids_BxT[:, 0], cache)
    proj = _by_name(arrays, where, H, K)

    def conv_proj(name):
      y_BxTxHK = proj[f"{name}_proj"]
      conv = ShortConv(cfg, cfg.kda_conv_size, name=f"{name}_conv")
      if cache is None:
        # The barrier keeps XLA GPU from fusing the conv (4 shifted reads, SiLU) into the
        # l2-norm and gate reductions and the kernels' layout glue, forward and backward:
        # one KDA mixer's fwd+bwd at 8K × 4 on the H200 went 11.9 → 9.9 ms
        # (benchmarks/train.md).
        y_BxTxHK = jax.lax.optimization_barrier(conv(y_BxTxHK, segment_ids_BxT))
      else:
        y_BxTxHK, new_cache[f"{name}_conv"] = conv(y_BxTxHK, segment_ids_BxT, cache[f"{name}_conv"])
      return y_BxTxHK.reshape(B, T, H, K)

    q_BxTxHxK, k_BxTxHxK, v_BxTxHxV = conv_proj("q"), conv_proj("k"), conv_proj("v")

    # Low-rank gate input, then the bounded per-channel log-decay g ∈ [lower_bound, 0).
    f_BxTxHxK = dense(cfg, (H, K), ("kda_rank", "heads", "kv"), "f_b")(proj["f_a"])
    A_log_H = self.param("A_log", lp(_A_log_init, ("heads",)), (H,))
    dt_bias_HK = self.param("dt_bias", lp(_dt_bias_init, ("kda_channels",)), (H * K,))
    beta_BxTxH = nn.sigmoid(proj["b_proj"].astype(jnp.float32))

    impl = cfg.kda_implementation or None
    if cache is not None and T == 1:
      impl = "recurrent"  # decode: one state update per token
    sequence_sharded = cache is None and axis_size("sequence") > 1
    if cache is None and not sequence_sharded and cfg.kda_gate_in_kernel:
      # Training / full forward, each device its own rows, with the q/k L2 norm, the gate
      # and its chunk cumsum inside the op (pallas_gpu: one prologue kernel; the XLA form
      # of this glue fused badly in the scanned step, benchmarks/train.md).
      def run(q, k, v, f, beta, seg, A_log_h, dt_bias_hxK):   # h: this device's heads
        return kda(q, k, v, f, beta, A_log=A_log_h, dt_bias=dt_bias_hxK.reshape(-1),
                   qk_l2norm=True, segment_ids=seg, chunk_size=cfg.kda_chunk_size,
                   lower_bound=cfg.kda_lower_bound, implementation=impl)[0]

      o_BxTxHxV = per_device(run, q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, f_BxTxHxK, beta_BxTxH,
                             segment_ids_BxT, per_head=(A_log_H, dt_bias_HK.reshape(H, K)))
      return self._output(remat.tag(o_BxTxHxV, "kda_out"), proj["g_a"])

    q_BxTxHxK, k_BxTxHxK = l2_normalize(q_BxTxHxK), l2_normalize(k_BxTxHxK)
    g_BxTxHxK = kda_gate(f_BxTxHxK, A_log_H, dt_bias_HK, lower_bound=cfg.kda_lower_bound)
    if sequence_sharded:  # time sharded: pass states between shards
      o_BxTxHxV, _ = kda_sequence_parallel(
          q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxK, beta_BxTxH, segment_ids_BxT,
          chunk_size=cfg.kda_chunk_size, lower_bound=cfg.kda_lower_bound, implementation=impl)
      state = None
    elif cache is None:  # training / full forward: each device scans its own rows
      run = lambda q, k, v, g, beta, seg: kda(
          q, k, v, g, beta, segment_ids=seg, chunk_size=cfg.kda_chunk_size,
          lower_bound=cfg.kda_lower_bound, implementation=impl)[0]
      o_BxTxHxV = per_device(run, q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxK, beta_BxTxH,
                             segment_ids_BxT)
      state = None
    else:
      o_BxTxHxV, state = kda(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxK, beta_BxTxH,
                             segment_ids=segment_ids_BxT, chunk_size=cfg.kda_chunk_size,
                             lower_bound=cfg.kda_lower_bound, implementation=impl,
                             initial_state=cache["state"], output_final_state=True)
    out_BxTxD = self._output(remat.tag(o_BxTxHxV, "kda_out"), proj["g_a"])
    if cache is None:
      return out_BxTxD
    return out_BxTxD, {**new_cache, "state": state}

  def _decode_kernel(self, arrays, where, segment_ids_B, cache):
    """One token through pallas_gpu_decode's kernel (model.kda_decode = "kernel"): the conv
    tails, gate, state update and gated norm in one launch; then o_proj."""
    cfg = self.cfg
    B, H, K, V = cache["state"].shape
    p = nn.meta.unbox(self.variables["params"])
    conv = {n: (cache[f"{n}_conv"]["x"], p[f"{n}_conv"]["kernel"]) for n in "qkv"}
    conv["seg"] = cache["q_conv"]["seg"]
    params = {"f_b": p["f_b"]["kernel"], "A_log": p["A_log"], "dt_bias": p["dt_bias"],
              "g_b": p["g_b"]["kernel"], "g_b_bias": p["g_b"].get("bias"),
              "o_norm": p["o_norm"]["scale"]}
    o_BxHxV, state, tails, seg = decode_step(
        tuple(a.reshape(B, -1) for a in arrays), where, segment_ids_B, conv, params,
        cache["state"], lower_bound=cfg.kda_lower_bound, eps=cfg.norm_eps,
        dtype=dtype_of(cfg))
    out_BxTxD = self._o_proj(o_BxHxV[:, None])
    new_cache = {f"{n}_conv": {"x": t, "seg": seg} for n, t in zip("qkv", tails)}
    return out_BxTxD, {**new_cache, "state": state}

  def _output(self, o_BxTxHxV, gate_BxTxK):
    """Gated RMSNorm per head, norm(o) * sigmoid(g_b(gate)), then the out projection;
    gate_BxTxK is the low-rank gate's first projection of the input, g_a(x)."""
    cfg = self.cfg
    H, K = o_BxTxHxV.shape[-2:]
    gate_BxTxHxV = dense(cfg, (H, K), ("kda_rank", "heads", "kv"), "g_b",
                         use_bias=cfg.get("kda_output_gate_bias", True))(gate_BxTxK)
    o_BxTxHxV = rms_norm(cfg, "o_norm", "kv")(o_BxTxHxV) * nn.sigmoid(gate_BxTxHxV)
    return self._o_proj(o_BxTxHxV)

  def _o_proj(self, o_BxTxHxV):
    return dense(self.cfg, self.cfg.d_model, ("heads", "kv", "embed"), "o_proj", axis=(-2, -1),
                 scale=out_scale(self.cfg))(o_BxTxHxV)
