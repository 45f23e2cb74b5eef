"""Train a HybridMoE model; resumes from the latest checkpoint in --workdir.

  python scripts/train.py --config=configs/tiny.py --workdir=workdir/tiny \
      [--config.model.d_model=256] [--config.data.source=files --config.data.paths='~/text/*.txt']
"""

from absl import app, flags, logging
from ml_collections import config_flags

from moe_jax.parallel import distributed
from moe_jax.train import compile_cache, xla_flags
from moe_jax.train.loop import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Config file[:arg].")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and logs go here.")
# Multi-process runs (moe_jax/parallel/distributed.py); else JAX_COORDINATOR_ADDRESS etc.
_COORDINATOR = flags.DEFINE_string("coordinator_address", "", "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 0, "Processes in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", -1, "This process's index.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO; pass -v 0 to see it
    logging.set_verbosity(logging.WARNING)
  xla_flags.apply_config(_CONFIG.value.train)   # before jax starts
  distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  compile_cache.enable(_CONFIG.value.train.compile_cache_dir)
  train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  flags.mark_flag_as_required("workdir")   # not at import (tests/test_scripts.py)
  app.run(main)
