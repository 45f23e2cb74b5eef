"""Tokenize and pack a corpus once into ArrayRecord shards (moe_jax/data/prepare.py writes them, prepared.py reads them), so a
large corpus is not re-tokenized at the start of every run.

  python scripts/prepare_data.py --config=configs/tiny.py --output=workdir/stdlib_prepared \
      [--config.data.tokenizer=sentencepiece:tok.model] [--config.data.source=jsonl ...]
  python scripts/train.py --config=configs/tiny.py --workdir=workdir/run \
      --config.data.source=prepared --config.data.paths=workdir/stdlib_prepared \
      [--config.data.tokenizer=<the same tokenizer>]

The shards hold rows of --config.data.seq_len tokens; a run must use the same seq_len and
tokenizer (the config check says so otherwise).
"""

import time

from absl import app, flags
from ml_collections import config_flags

from moe_jax.data.prepare import prepare

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Config file[:arg].")
_OUTPUT = flags.DEFINE_string("output", None, "Directory for the shards and meta.json.")
_ROWS_PER_SHARD = flags.DEFINE_integer("rows_per_shard", 4096, "Packed rows per shard.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  start = time.perf_counter()
  meta = prepare(_CONFIG.value, _OUTPUT.value, _ROWS_PER_SHARD.value)
  print(f"prepared {_OUTPUT.value} in {time.perf_counter() - start:.1f} s: "
        + ", ".join(f"{k} {n} rows of {meta['seq_len']}" for k, n in meta["rows"].items())
        + f"; tokenizer {meta['tokenizer']}")
  print(f"train with --config.data.source=prepared --config.data.paths={_OUTPUT.value}")


if __name__ == "__main__":
  flags.mark_flag_as_required("output")   # not at import (tests/test_scripts.py)
  app.run(main)
