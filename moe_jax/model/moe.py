"""Mixture-of-experts FFN: router → dispatch → routed SwiGLU experts → combine, + shared experts.

Two single-device dispatch paths (model.moe.dispatch):

* dropless: the N·k (token, expert) assignments are sorted by expert, run
  through a grouped matmul, unsorted and summed with the combine weights. With
  N·k ≤ E (decoding a few tokens) and `decode_dispatch` other than "grouped", each
  assignment's expert weights are applied directly instead: no sort and no
  grouped-matmul kernel, but N·k copies of expert weights read (duplicates too).
  "gather" gathers them for one einsum; "fused" reads them inside two Pallas
  kernels (pallas_kernels/moe/pallas_gpu_decode_experts.py); "layer" runs the whole layer,
  router and shared expert included, as three kernels (pallas_gpu_decode_layer.py) where
  they apply (`MoE._decode_layer_kernels`). "auto" (default) is "layer" on GPU where its
  kernels apply and the router is narrow (`decode_layer_wanted`), else fused on GPU from
  AUTO_FUSED_MIN assignments, else gather.
* capacity: each expert takes at most C = ceil(capacity_factor·N·k/E)
  assignments (earlier tokens first); they are laid out [E, C, D] for batched
  dense matmuls. Assignments over capacity are dropped (counted in the stats):
  their token gets nothing from that expert, only the residual and shared path.

With an `expert` mesh axis > 1, `parallel/expert.py` exchanges tokens between
expert shards with all-to-all instead: dropless in rounds of buffers sized by the load
(model.moe.ep_buffer_factor), or one round that drops past capacity.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.fields import param_names
from moe_jax.model import experts, layer_stack, remat, router
from moe_jax.model.dispatch import (capacity, combine, inverse_permutation, permute_rows,
                                     repeat_rows, sort_by_group, take_rows)
from moe_jax.model.layers import SwiGLU, dense, dtype_of, lp, out_scale, rms_norm
from moe_jax.parallel import expert as expert_parallel
from moe_jax.parallel.mesh import axis_size
from pallas_kernels import platform
from pallas_kernels.moe import ops as moe_ops, reference as moe_reference


def dropless(x_NxD, idx_NxK, w_NxK, gate_up_ExDx2xF, down_ExFxD, implementation="",
             grad_in_kernel=False, weights_before_down=False):
  """Every assignment is computed: sort by expert, grouped matmul, unsort, combine.

  weights_before_down (model.moe.weights_before_down): each assignment's weight scales its
  SwiGLU activation before the down projection, (w·a)·down, and the combine is a plain sum
  over the k; w·(a·down) elsewhere. Equal in exact arithmetic, as the projection is linear
  in its row. The weights' gradient is then Σ_F d(w·a) · a in the SwiGLU's backward, so
  the backward needs no expert output rows: none is stored (N·k·D values a layer) or
  copied into a scanned stack."""
  N, K = idx_NxK.shape
  E = gate_up_ExDx2xF.shape[0]
  order_A, sizes_E, _ = sort_by_group(idx_NxK.reshape(-1), E)
  inverse_A = inverse_permutation(order_A)
  x_AxD = permute_rows(repeat_rows(x_NxD, K), order_A, inverse_A)
  w_A = (permute_rows(w_NxK.reshape(-1, 1), order_A, inverse_A)[:, 0]
         if weights_before_down else None)
  with jax.named_scope("moe_experts"):
    y_AxD = experts.swiglu_grouped(x_AxD, sizes_E, gate_up_ExDx2xF, down_ExFxD, implementation,
                                   grad_in_kernel, w_A)
  # token order: the combine's weight gradient reads it (saved with model.remat_expert_rows)
  y_tokens_AxD = remat.tag(permute_rows(y_AxD, inverse_A, order_A), "moe_y_tokens")
  if weights_before_down:
    return y_tokens_AxD.reshape(N, K, -1).astype(jnp.float32).sum(1).astype(x_NxD.dtype)
  return combine(y_tokens_AxD, w_NxK, x_NxD.dtype)


AUTO_FUSED_MIN = 8   # assignments from which "auto" takes the fused kernels (on GPU)


def decode_path(decode_dispatch: str, assignments: int, backend: str | None = None) -> str:
  """model.moe.decode_dispatch with "auto" resolved: "fused" on GPU from AUTO_FUSED_MIN
  assignments, else "gather". On the H200 at 1M context the fused kernels are 25% faster per
  hybrid decode step at batch 8 (32 assignments), even at batch 2, and 12% slower at batch 1,
  where 4 assignments made too small a grid of 64-wide tiles (benchmarks/long_context.md).
  The kernels now narrow their tiles to fill the GPU (pallas_gpu_decode_experts.tiles); that
  is not timed yet, so the threshold stays."""
  if decode_dispatch not in ("auto", "layer"):   # "layer" where its kernels do not apply
    return decode_dispatch
  backend = backend or platform.target()
  return "fused" if backend == "gpu" and assignments >= AUTO_FUSED_MIN else "gather"


AUTO_LAYER_MAX_ROUTE_STEPS = 8   # "auto" takes the layer kernels up to this (see below)


def decode_layer_wanted(decode_dispatch: str, W: int, E: int, backend: str | None = None) -> bool:
  """Whether decode_dispatch asks for the decode layer kernels: "layer", or "auto" on GPU
  with a router the route kernel reads in at most AUTO_LAYER_MAX_ROUTE_STEPS loop steps.
  Timed: long_context_1b's 1024 × 32 router (4 steps), where the layer made the 1M hybrid
  decode step faster at every batch (H100, benchmarks/decode.md); a wider router (Kimi
  Linear's 2304 × 256, 72 steps in one program a token) keeps the fused or gather path
  that its decode was measured with, until the layer is timed there."""
  backend = backend or platform.target()
  return decode_dispatch == "layer" or (
      decode_dispatch == "auto" and backend == "gpu"
      and moe_ops.decode_route_steps(W, E) <= AUTO_LAYER_MAX_ROUTE_STEPS)


def gathered(x_NxD, idx_NxK, w_NxK, gate_up_ExDx2xF, down_ExFxD, fused=False):
  """Dropless for a handful of tokens (decode): each assignment's expert weights are gathered
  and applied directly, no sort and no grouped-matmul launch. Reads N·k experts' weights.
  fused: by the Pallas kernels of decode_experts (same math) where the shapes fit."""
  E, D, _, F = gate_up_ExDx2xF.shape
  experts_fn = fused_experts if fused and moe_ops.decode_experts_fit(D, F) else gathered_experts
  y_NxKxD = experts_fn(x_NxD, idx_NxK, gate_up_ExDx2xF, down_ExFxD)
  return combine(y_NxKxD.reshape(-1, D), w_NxK, x_NxD.dtype)


# The gather path: each assignment's expert weights gathered for one einsum (the spec).
gathered_experts = moe_reference.swiglu_experts


@jax.custom_vjp
def fused_experts(x_NxD, idx_NxK, gate_up_ExDx2xF, down_ExFxD):
  """gathered_experts by the Pallas kernels. The kernels are forward only; the backward is
  gathered_experts' (so a gradient through a tiny GPU batch under "auto" still works)."""
  return moe_ops.decode_experts(x_NxD, idx_NxK, gate_up_ExDx2xF, down_ExFxD).astype(x_NxD.dtype)


def _fused_fwd(x_NxD, idx_NxK, gate_up_ExDx2xF, down_ExFxD):
  y = fused_experts(x_NxD, idx_NxK, gate_up_ExDx2xF, down_ExFxD)
  return y, (x_NxD, idx_NxK, gate_up_ExDx2xF, down_ExFxD)


def _fused_bwd(res, dy_NxKxD):
  x_NxD, idx_NxK, gate_up_ExDx2xF, down_ExFxD = res
  _, vjp = jax.vjp(lambda x, gu, dn: gathered_experts(x, idx_NxK, gu, dn),
                   x_NxD, gate_up_ExDx2xF, down_ExFxD)
  dx, dgate_up, ddown = vjp(dy_NxKxD)
  return dx, None, dgate_up, ddown


fused_experts.defvjp(_fused_fwd, _fused_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def decode_layer(x_NxW, kernel_WxE, bias_E, gate_up_ExWx2xF, down_ExFxW, shared, top_k: int,
                 score: str, route_scale: float, router_dtype: str):
  """(y [N, W] in x's dtype, expert ids [N, top_k]): routing, routed experts, combine and the
  shared expert (gate, up, down kernels, or None) by pallas_gpu_decode_layer's kernels. They
  are forward only; the backward is the XLA path's at the same experts (so a gradient
  through a decode-sized batch under decode_dispatch="layer" still works)."""
  idx_NxKP, w_NxKP = moe_ops.decode_route(x_NxW, kernel_WxE, bias_E, top_k, score, route_scale,
                                          jnp.dtype(router_dtype))
  y_NxW = moe_ops.decode_layer(x_NxW, idx_NxKP, w_NxKP, top_k, gate_up_ExWx2xF, down_ExFxW,
                               shared)
  return y_NxW, idx_NxKP[:, :top_k]


def _decode_layer_xla(x_NxW, kernel_WxE, gate_up_ExWx2xF, down_ExFxW, shared, idx_NxK, score,
                      route_scale, router_dtype):
  """decode_layer's output, in XLA, at the given experts (its backward's function)."""
  dtype = x_NxW.dtype
  w_NxK = router.combine_weights(router.logits(x_NxW, kernel_WxE, router_dtype), idx_NxK,
                                 score, route_scale)
  y_NxW = gathered(x_NxW, idx_NxK, w_NxK, gate_up_ExWx2xF.astype(dtype),
                   down_ExFxW.astype(dtype))
  if shared is not None:
    g_WxF, u_WxF, d_FxW = (w.astype(dtype) for w in shared)
    y_NxW = y_NxW + (jax.nn.silu(x_NxW @ g_WxF) * (x_NxW @ u_WxF)) @ d_FxW
  return y_NxW


def _decode_layer_fwd(x, kernel, bias, gate_up, down, shared, top_k, score, route_scale,
                      router_dtype):
  out = decode_layer(x, kernel, bias, gate_up, down, shared, top_k, score, route_scale,
                     router_dtype)
  return out, (x, kernel, bias, gate_up, down, shared, out[1])


def _decode_layer_bwd(top_k, score, route_scale, router_dtype, res, cotangents):
  x, kernel, bias, gate_up, down, shared, idx_NxK = res
  _, vjp = jax.vjp(lambda *a: _decode_layer_xla(*a, idx_NxK, score, route_scale, router_dtype),
                   x, kernel, gate_up, down, shared)
  dx, dkernel, dgate_up, ddown, dshared = vjp(cotangents[0])
  return dx, dkernel, jnp.zeros_like(bias), dgate_up, ddown, dshared


decode_layer.defvjp(_decode_layer_fwd, _decode_layer_bwd)


def with_capacity(x_NxD, idx_NxK, w_NxK, gate_up_ExDx2xF, down_ExFxD, capacity_C: int):
  """Returns (y [N, D], number of dropped assignments)."""
  N, K = idx_NxK.shape
  E, D = gate_up_ExDx2xF.shape[:2]
  C = capacity_C
  e_A = idx_NxK.reshape(-1)
  order_A, _, rank_sorted_A = sort_by_group(e_A, E)
  rank_A = rank_sorted_A[inverse_permutation(order_A)]
  keep_A = rank_A < C
  slot_A = jnp.where(keep_A, e_A * C + rank_A, E * C)  # E·C: out of range = dropped
  # The assignment in each [E, C] slot (N·K, out of range, for an empty slot).
  assign_S = jnp.full((E * C,), N * K, jnp.int32).at[slot_A].set(jnp.arange(N * K), mode="drop")
  x_ExCxD = take_rows(repeat_rows(x_NxD, K), assign_S).reshape(E, C, D)
  with jax.named_scope("moe_experts"):
    y_ExCxD = experts.swiglu_batched(x_ExCxD, gate_up_ExDx2xF, down_ExFxD)
  y_AxD = take_rows(y_ExCxD.reshape(E * C, D), slot_A)
  return combine(y_AxD, w_NxK, x_NxD.dtype), (~keep_A).sum()


def routed_experts(mc, x_NxD, idx_NxK, w_NxK, gate_up_ExDx2xF, down_ExFxD):
  """(y [N, D], dropped assignments, expert-parallel stats: {} on one expert shard, else
  ep_rounds and ep_buffer_fill, parallel/expert.py) by the path the config and mesh pick."""
  N, K = idx_NxK.shape
  E = gate_up_ExDx2xF.shape[0]
  ep = axis_size("expert")
  if ep > 1:
    y_NxD, stats = expert_parallel.moe_ffn(
        x_NxD, idx_NxK, w_NxK, gate_up_ExDx2xF, down_ExFxD, expert_shards=ep,
        capacity_factor=mc.capacity_factor if mc.dispatch == "capacity" else None,
        buffer_factor=mc.get("ep_buffer_factor", 2.0), implementation=mc.grouped_matmul)
    return y_NxD, stats.pop("dropped"), stats
  if mc.dispatch == "dropless" and N * K <= E and (
      decode := decode_path(mc.decode_dispatch, N * K)) != "grouped":
    return gathered(x_NxD, idx_NxK, w_NxK, gate_up_ExDx2xF, down_ExFxD,
                    fused=decode == "fused"), 0, {}
  if mc.dispatch == "dropless":
    return dropless(x_NxD, idx_NxK, w_NxK, gate_up_ExDx2xF, down_ExFxD, mc.grouped_matmul,
                    mc.get("swiglu_grad_in_kernel", False),
                    mc.get("weights_before_down", False)), 0, {}
  C = capacity(N, K, E, mc.capacity_factor)
  return (*with_capacity(x_NxD, idx_NxK, w_NxK, gate_up_ExDx2xF, down_ExFxD, C), {})


def sown_routes(model_cfg, intermediates: dict, shape_BxT) -> dict:
  """The top-k ids each MoE layer sowed (intermediates["topk"], scanned or per-layer
  layout) → {layer: [B, T, K]}."""
  B, T = shape_BxT
  out = {}
  for layer, v in layer_stack.unstack(model_cfg, dict(intermediates)).items():
    if isinstance(v, dict) and "ffn" in v and "topk" in v["ffn"]:
      ids = v["ffn"]["topk"]
      ids = ids[0] if isinstance(ids, tuple) else ids
      out[layer] = ids.reshape(B, T, -1)
  return out


class MoE(nn.Module):
  """Routed experts (+ shared). Returns (y [B,T,D], routing stats of this batch).

  With model.moe.latent_dim = R > 0 (latent MoE, as NVIDIA's LatentMoE): x → latent_down
  [D, R] → latent_norm → the router and the routed experts (R → F → R) work on the R-wide
  latent, so dispatch and the all-to-all move R-wide rows and each expert holds 3·R·F
  weights → latent_up [R, D]. Shared experts stay on x (d_model).

  The top-k expert ids the router picks are sown as intermediates["topk"] (kept only when
  the caller asks: the routing-fluctuation probe, train/probe.py; GRPO rollouts).

  Routing replay (moe_jax/rl/replay.py): given a variable replay/topk [N, k], the layer runs
  those experts instead of its own choice, with combine weights from its own scores at them
  (so the router still gets a gradient). What it would have picked is still sown.
  """
  cfg: object

  @nn.compact
  def __call__(self, x_BxTxD):
    cfg, mc = self.cfg, self.cfg.moe
    B, T, D = x_BxTxD.shape
    E, K, F, R = mc.num_experts, mc.top_k, mc.expert_hidden, mc.latent_dim
    dtype = dtype_of(cfg)
    x_NxD = x_BxTxD.reshape(B * T, D)
    tracked = {}   # the routing params the init regulariser may name: name → value
    if R:
      latent_down = dense(cfg, R, ("embed", "moe_latent"), "latent_down")
      z_NxW = rms_norm(cfg, "latent_norm", "moe_latent")(latent_down(x_NxD.astype(dtype)))
      tracked["latent_down"] = nn.meta.unbox(latent_down.variables["params"]["kernel"])
    else:
      z_NxW = x_NxD          # W: the width routed and dispatched (R, or D)
    W, width = z_NxW.shape[-1], "moe_latent" if R else "embed"

    kernel_WxE = self.param("router_kernel",
                            lp(nn.initializers.normal(mc.router_init_scale), (width, None)),
                            (W, E), jnp.float32)
    tracked["router_kernel"] = kernel_WxE
    bias_E = self.variable("router", "bias", lambda: router.init_state(mc, E)["bias"]).value
    if mc.balancer == "quantile_ema":
      self.variable("router", "ema_load", lambda: router.init_state(mc, E)["ema_load"])
    with jax.named_scope("router"):
      logits_NxE = router.logits(z_NxW, kernel_WxE, mc.router_dtype or cfg.dtype)
      scores_NxE = router.scores_from_logits(logits_NxE, mc.score)
      idx_NxK, w_NxK = router.select(logits_NxE, bias_E, K, mc.score, mc.route_scale)
    layer_kernels = self._decode_layer_kernels(B * T, W)
    # With the layer kernels the routing above feeds only the stats, which a decode step
    # discards (XLA drops it); the kernels' own routing (the same function) runs and is sown.
    if layer_kernels:
      p = nn.meta.unbox(self.variables["params"])
      shared = (tuple(p["shared"][n]["kernel"] for n in ("gate", "up", "down"))
                if mc.num_shared else None)
      # The stored expert weights: the kernels round them, so no convert kernel runs a step.
      y_NxD, idx_NxK = decode_layer(
          z_NxW.astype(dtype), kernel_WxE, bias_E, p["gate_up"], p["down"], shared, K,
          mc.score, mc.route_scale, mc.router_dtype or cfg.dtype)
    self.sow("intermediates", "topk", idx_NxK)
    if self.has_variable("replay", "topk"):
      idx_NxK = self.get_variable("replay", "topk").reshape(idx_NxK.shape)
      w_NxK = router.combine_weights(logits_NxE, idx_NxK, mc.score, mc.route_scale)

    # Latent experts write into latent_up, which carries the residual-branch scale.
    down_scale = 1.0 if R else out_scale(cfg)
    gate_up_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                    in_axis=1, out_axis=(2, 3), batch_axis=0)
    down_init = nn.initializers.variance_scaling(down_scale, "fan_in", "truncated_normal",
                                                 in_axis=1, out_axis=2, batch_axis=0)
    gate_up = self.param("gate_up", lp(gate_up_init, ("expert", width, None, "mlp")),
                         (E, W, 2, F), jnp.float32).astype(dtype)
    down = self.param("down", lp(down_init, ("expert", "mlp", width)), (E, F, W),
                      jnp.float32).astype(dtype)

    x_NxD = x_NxD.astype(dtype)
    if layer_kernels:
      dropped, ep_stats = 0, {}
    else:
      with jax.named_scope("moe_dispatch"):   # sort, gather, all-to-all, combine
        y_NxW, dropped, ep_stats = routed_experts(mc, z_NxW.astype(dtype), idx_NxK, w_NxK,
                                                  gate_up, down)
      y_NxD = (dense(cfg, D, ("moe_latent", "embed"), "latent_up",
                     scale=out_scale(cfg))(y_NxW) if R else y_NxW)
      if mc.num_shared:
        with jax.named_scope("shared_experts"):
          y_NxD = y_NxD + SwiGLU(cfg, mc.num_shared * F, name="shared")(x_NxD)

    with jax.named_scope("router"):
      stats = router.routing_stats(mc, logits_NxE, scores_NxE, idx_NxK, bias_E,
                                   jnp.asarray(dropped, jnp.float32) / idx_NxK.size)
      stats.update(ep_stats)
    penalty = mc.z_loss * stats["z_loss"]
    if mc.balancer == "aux_loss":
      penalty = penalty + mc.aux_loss_coef * stats["aux_loss"]
    if mc.router_init_reg:
      # Σ ||p − p at init||² over the named routing params. The init copies live in the
      # "router" collection (checkpointed, no gradient); the router kernel's keeps its name.
      drift = jnp.zeros((), jnp.float32)
      for name in param_names(mc.init_reg_params):
        var = "kernel_init" if name == "router_kernel" else f"{name}_init"
        init = self.variable("router", var, lambda v=tracked[name]: v).value
        drift = drift + jnp.sum((tracked[name] - jax.lax.stop_gradient(init)) ** 2)
      stats["router_drift"] = drift
      penalty = penalty + mc.router_init_reg * drift
    stats["penalty"] = penalty
    return y_NxD.reshape(B, T, D), stats

  def _decode_layer_kernels(self, N: int, W: int) -> bool:
    """Whether the layer runs pallas_gpu_decode_layer's three kernels here (decode_dispatch =
    "layer", or "auto" on a GPU): decoding (N·k ≤ E), dropless, not on a TPU, on one expert
    shard, with no latent, at most one shared expert, shapes the kernels tile, and no
    routing replay (the XLA path runs a replayed routing). In apply only: init creates the
    parameters. Which dispatch values ask for them: `decode_layer_wanted`."""
    mc = self.cfg.moe
    E, K, F = mc.num_experts, mc.top_k, mc.expert_hidden
    return (mc.dispatch == "dropless" and N * K <= E
            and platform.target() != "tpu"   # Triton kernels (interpreted off a GPU)
            and not mc.latent_dim and mc.num_shared <= 1 and axis_size("expert") == 1
            and moe_ops.decode_layer_fits(W, F, E) and decode_layer_wanted(mc.decode_dispatch, W, E)
            and not self.has_variable("replay", "topk") and not self.is_initializing())
