"""Train a HybridMoE model; resumes from the latest checkpoint in --workdir.

  python scripts/train.py --config=configs/tiny.py --workdir=workdir/tiny \
      [--config.model.d_model=256] [--config.data.source=files --config.data.paths='~/text/*.txt']
"""

from absl import app, flags, logging
from ml_collections import config_flags

from moe_jax.train.loop import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Config file[:arg].")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and logs go here.",
                               required=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO; pass -v 0 to see it
    logging.set_verbosity(logging.WARNING)
  train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
