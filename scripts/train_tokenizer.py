"""Train a BPE or unigram tokenizer on a config's train documents (any document source, the
embedded stdlib corpus included) and save it for data.tokenizer.

  python scripts/train_tokenizer.py --config=configs/tiny.py --library=sentencepiece \
      --model=bpe --vocab_size=2048 --output=workdir/stdlib_bpe2048.model
  python scripts/train.py --config=configs/tiny.py --workdir=workdir/tiny_bpe \
      --config.data.tokenizer=sentencepiece:workdir/stdlib_bpe2048.model
  python scripts/train_tokenizer.py --config=configs/tiny.py --config.data.source=jsonl \
      --config.data.paths='corpus/*.jsonl' --library=hf --output=workdir/tok.json
"""

import os
import time

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from moe_jax.data import pipeline, tokenizer_training, tokenizers

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Config file[:arg].")
_LIBRARY = flags.DEFINE_enum("library", "sentencepiece", tokenizer_training.LIBRARIES,
                             "sentencepiece (writes a .model) or hf (writes a tokenizer.json).")
_MODEL = flags.DEFINE_enum("model", "bpe", tokenizer_training.MODELS, "Tokenizer model.")
_VOCAB = flags.DEFINE_integer("vocab_size", 2048, "Vocabulary size, specials included.")
_OUTPUT = flags.DEFINE_string("output", None, "Where to write the tokenizer.")
_MAX_DOCS = flags.DEFINE_integer("max_documents", 0, "Train on at most this many documents, "
                                 "an even sample of the train split (0 = all).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  c = _CONFIG.value
  docs = pipeline.text_documents(c)
  train = docs["train"]
  if _MAX_DOCS.value and len(train) > _MAX_DOCS.value:
    train = [train[i] for i in np.linspace(0, len(train) - 1, _MAX_DOCS.value).astype(int)]
  os.makedirs(os.path.dirname(os.path.abspath(_OUTPUT.value)), exist_ok=True)
  start = time.perf_counter()
  spec = tokenizer_training.train(train, library=_LIBRARY.value, model=_MODEL.value,
                                  vocab_size=_VOCAB.value, output=_OUTPUT.value)
  seconds = time.perf_counter() - start
  tok = tokenizers.load(spec)
  val_bytes = sum(len(d) for d in docs["validation"])
  val_tokens = sum(len(tok.encode(d, bos=False, eos=False)) for d in docs["validation"])
  print(f"trained {spec} on {len(train)} documents in {seconds:.1f} s: {tok.vocab_size} ids, "
        f"{val_bytes / max(val_tokens, 1):.2f} validation bytes per token")
  print(f"use it with --config.data.tokenizer={spec}")


if __name__ == "__main__":
  flags.mark_flag_as_required("output")   # not at import (tests/test_scripts.py)
  app.run(main)
