"""Hugging Face Kimi Linear checkpoint ⇄ moe_jax workdir.

  python scripts/convert_checkpoint.py --from_hf=~/Kimi-Linear-48B-A3B-Instruct --workdir=W
      W/config.json and a step-0 train state in W/checkpoints (fresh optimizer, no data
      position), which these resume from:
        python scripts/train.py --config=configs/workdir.py:W --workdir=W   # fine-tune
        python scripts/generate.py --workdir=W --prompt="..."
        python scripts/grpo.py --config.rl.init_workdir=W --workdir=G
  python scripts/convert_checkpoint.py --to_hf=OUT --workdir=W [--step=N]
      config.json + safetensors that transformers' from_pretrained loads: by default in the
      source's tensor naming and dtypes (W/hf_source.json), so HF → W → HF is bit-identical.

The train state holds fp32 master weights and two Adam moments: 12 bytes a parameter
(the 48B: 590 GB, a multi-GPU host's memory; for inference alone, moe_jax.interop.kimi_hf.load
reads the checkpoint straight onto one device in bf16). --dtype sets the compute dtype.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from moe_jax import config as config_lib
from moe_jax.infer import workdir as workdir_lib
from moe_jax.interop import kimi_hf
from moe_jax.model.transformer import HybridMoE
from moe_jax.parallel.mesh import make_mesh
from moe_jax.train import checkpoint, optim, state as state_lib

_FROM_HF = flags.DEFINE_string("from_hf", None, "A Kimi-Linear checkpoint directory to read.")
_TO_HF = flags.DEFINE_string("to_hf", None, "A directory to write a Kimi-Linear checkpoint to.")
_WORKDIR = flags.DEFINE_string("workdir", None, "The moe_jax workdir (written or read).")
_STEP = flags.DEFINE_integer("step", None, "--to_hf: the checkpoint step (default: latest).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"],
                           "--from_hf: model.dtype, the compute dtype of the converted run.")
_NAMING = flags.DEFINE_enum("hf_naming", "", ["", "released", "native"],
                            "--to_hf: tensor names ('' = the source's, else released).")
_HF_DTYPE = flags.DEFINE_enum("hf_dtype", "", ["", "bfloat16", "float32"],
                              "--to_hf: tensor dtype ('' = the source's, else float32).")
SOURCE = "hf_source.json"   # in the workdir: what --to_hf needs to write the source back


def naming_of(names) -> str:
  """"native" if the checkpoint holds transformers' in-memory names, else "released"."""
  native = any(n.endswith((".experts.gate_up_proj", ".self_attn.conv1d.weight")) for n in names)
  return "native" if native else "released"


def from_hf(hf_dir: str, workdir: str, dtype: str):
  config, variables = kimi_hf.load(hf_dir, dtype=jnp.float32)   # fp32 master weights
  config.model.dtype = dtype
  config_lib.validate(config)
  model = HybridMoE(state_lib.frozen_model_config(config))
  T = config.model.kda_chunk_size
  example = {"tokens": np.zeros((1, T), np.int32), "segment_ids": np.ones((1, T), np.int32)}
  mesh = make_mesh(config.mesh)
  tx = optim.make_optimizer(config)
  with jax.set_mesh(mesh):
    abstract, shardings, _ = state_lib.train_state_plan(model, tx, example, mesh, config)
    params = jax.device_put(variables["params"], shardings.params)
    router = jax.device_put(variables["router"], shardings.router)
    opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)
    state = abstract.replace(step=jnp.zeros((), abstract.step.dtype), params=params,
                             router=router, opt_state=opt_state)
  os.makedirs(workdir, exist_ok=True)
  checkpoint.save_weights(os.path.abspath(os.path.join(workdir, "checkpoints")), state)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  dtypes = kimi_hf.tensor_dtypes(hf_dir)
  with open(os.path.join(workdir, SOURCE), "w") as f:
    json.dump({"hf_dir": os.path.abspath(hf_dir), "naming": naming_of(dtypes),
               "dtypes": {k: str(v) for k, v in dtypes.items()},
               "config": kimi_hf.read_config(hf_dir)}, f, indent=2, sort_keys=True)
  print(f"moe_jax: {hf_dir} ({naming_of(dtypes)} naming) → {workdir}: "
        f"{state_lib.param_count(params):,} params, step 0", flush=True)


def to_hf(workdir: str, hf_dir: str, step, naming: str, hf_dtype: str):
  config, variables, step = workdir_lib.load(workdir, step)
  source = {}
  if os.path.exists(os.path.join(workdir, SOURCE)):
    with open(os.path.join(workdir, SOURCE)) as f:
      source = json.load(f)
  naming = naming or source.get("naming", "released")
  as_dtype = lambda name: np.dtype(kimi_hf.SAFETENSORS_DTYPES["BF16"] if name == "bfloat16"
                                   else name)
  stored = source.get("dtypes", {})
  # Each tensor as the source stored it (same naming), else one dtype for all: --hf_dtype,
  # or the source's most common one, or float32.
  dtypes = ({k: as_dtype(v) for k, v in stored.items()}
            if stored and not hf_dtype and naming == source.get("naming") else None)
  common = max(set(stored.values()), key=list(stored.values()).count) if stored else "float32"
  dtype = as_dtype(hf_dtype or common)
  kimi_hf.save(config, variables, hf_dir, naming=naming, dtype=dtype, dtypes=dtypes,
               template=source.get("config"))
  print(f"moe_jax: {workdir} step {step} → {hf_dir} ({naming} naming)", flush=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if bool(_FROM_HF.value) == bool(_TO_HF.value):
    raise app.UsageError("give exactly one of --from_hf and --to_hf")
  if _FROM_HF.value:
    from_hf(os.path.expanduser(_FROM_HF.value), _WORKDIR.value, _DTYPE.value)
  else:
    to_hf(_WORKDIR.value, os.path.expanduser(_TO_HF.value), _STEP.value, _NAMING.value,
          _HF_DTYPE.value)


if __name__ == "__main__":
  flags.mark_flag_as_required("workdir")
  app.run(main)
