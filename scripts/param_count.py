"""Total and active parameters of a config, by component (abstract init: nothing is allocated).

  python scripts/param_count.py --config=configs/kimi_linear_48b.py
  python scripts/param_count.py --config=configs/trillion.py --config.model.moe.top_k=6
"""

from absl import app
from ml_collections import config_flags

from moe_jax import config as config_lib, params

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Config file[:arg].")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  c = config_lib.validate(_CONFIG.value)
  counts = params.count(c)
  m = c.model
  print(f"{m.n_layers} layers ({m.layer_pattern}), d_model {m.d_model}, "
        f"{m.moe.num_experts} experts top-{m.moe.top_k} + {m.moe.num_shared} shared")
  print(params.table(counts))


if __name__ == "__main__":
  app.run(main)
