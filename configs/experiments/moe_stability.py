"""The routing-stability experiment (benchmarks/moe_stability.py, benchmarks/moe_stability.md):
configs/tiny.py at a learning rate high enough to shake the router, in four arms.

  standard       the MoE on d_model, no routing kit (no router clip, no init regulariser,
                 no z-loss); the global clip (1.0) still applies
  standard_kit   + router clip (norm 1.0) + init regulariser + z-loss
  latent         latent MoE, R = 64 = d_model / 2, expert hidden 256 (so each expert holds
                 as many weights as a standard one: 3·64·256 = 3·128·128), no kit
  latent_kit     + the kit, with the clip and the regulariser also on latent_down

One kit component alone, to tell which one does what: <layout>_clip, <layout>_reg,
<layout>_zloss (layout standard or latent).

  python scripts/train.py --config=configs/experiments/moe_stability.py:latent_kit --workdir=workdir/x
"""

from configs import tiny

ARMS = ("standard", "standard_kit", "latent", "latent_kit")
COMPONENT_ARMS = tuple(f"{layout}_{part}" for layout in ("standard", "latent")
                       for part in ("clip", "reg", "zloss"))


def get_config(arg=None):
  if arg not in ARMS + COMPONENT_ARMS:
    raise ValueError(f"configs/experiments/moe_stability.py arg must be one of {ARMS + COMPONENT_ARMS}; "
                     f"got {arg!r}")
  c = tiny.get_config()
  c.data.batch_size = 8
  c.data.seq_len = 128
  c.optim.learning_rate = 1e-2      # 3.3× tiny's 3e-3
  c.schedule.total_steps = 300
  c.schedule.warmup_steps = 10
  c.log.every_steps = 1
  c.log.route_fluctuation = True
  c.eval.every_steps = 300
  c.checkpoint.every_steps = 300
  layout, _, kit = arg.partition("_")
  e = c.model.moe
  if layout == "latent":
    e.latent_dim = 64
    e.expert_hidden = 256
  parts = {"kit": ("clip", "reg", "zloss"), "": ()}.get(kit, (kit,))
  c.optim.router_grad_clip_norm = 1.0 if "clip" in parts else 0.0
  e.router_init_reg = 1e-3 if "reg" in parts else 0.0
  e.z_loss = 1e-3 if "zloss" in parts else 0.0
  if layout == "latent":
    c.optim.router_clip_params = "router_kernel,latent_down,latent_norm"
    e.init_reg_params = "router_kernel,latent_down"
  return c
