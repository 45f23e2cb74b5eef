"""A run's own config, read back from its workdir: configs/base.py updated with
<workdir>/config.json (what scripts/train.py and scripts/convert_checkpoint.py write).

  python scripts/convert_checkpoint.py --from_hf=~/Kimi-Linear-48B-A3B --workdir=W
  python scripts/train.py --config=configs/workdir.py:W --workdir=W \
      --config.data.source=jsonl --config.data.paths='~/sft/*.jsonl'

Fields added to base since the run keep their defaults; `--config.a.b=...` overrides win.
"""

import json
import os

from configs import base


def get_config(arg=None):
  if not arg:
    raise ValueError("configs/workdir.py needs the workdir: --config=configs/workdir.py:<workdir>")
  path = os.path.join(os.path.expanduser(arg), "config.json")
  if not os.path.exists(path):
    raise ValueError(f"configs/workdir.py:{arg}: no config.json there (a workdir of "
                     "scripts/train.py or scripts/convert_checkpoint.py)")
  c = base.get_config()
  with open(path) as f:
    c.update(json.load(f))
  return c
