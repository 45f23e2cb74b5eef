"""GRPO post-training with verifiable rewards (moe_jax/rl/); resumes from --workdir.

  python scripts/grpo.py --config=configs/grpo.py:cpu --workdir=workdir/grpo
  python scripts/grpo.py --config=configs/grpo.py:tools --workdir=workdir/grpo_tools

Without --config.rl.init_workdir it first runs the supervised warm-up on the task format
(<workdir>/warmup). Metrics: <workdir>/metrics_grpo.jsonl, metrics_grpo_eval.jsonl and
tb/ (TensorBoard); pass@1 before and after in summary.json.
"""

from absl import app, flags, logging
from ml_collections import config_flags

from moe_jax.rl.trainer import train_grpo
from moe_jax.train import compile_cache, xla_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/grpo.py:cpu", "Config file[:arg].")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and logs go here.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  xla_flags.apply_config(_CONFIG.value.train)   # before jax starts
  compile_cache.enable(_CONFIG.value.train.compile_cache_dir)
  s = train_grpo(_CONFIG.value, _WORKDIR.value)
  if "preempted" in s:   # SIGTERM: checkpointed
    print(f"moe_jax grpo: stopped by SIGTERM in the {s['preempted']}; run again to resume")
    return
  print(f"pass@1 at the start: {s['start']}\npass@1 at the end:   {s.get('final', s.get('latest'))}")


if __name__ == "__main__":
  flags.mark_flag_as_required("workdir")   # not at import (tests/test_scripts.py)
  app.run(main)
