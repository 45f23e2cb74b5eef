"""Bits per byte with a learned BPE tokenizer against the byte tokenizer, on the embedded
stdlib corpus (benchmarks/tokenizers.md).

  python scripts/bench_tokenizer.py --workdir=workdir/bench_tokenizer [--steps=300]

Trains a SentencePiece BPE tokenizer on the train split, then the tiny config twice (bytes,
BPE) for the same steps and rows of the same token length, and evaluates both over the
whole validation split: total bits / the split's UTF-8 bytes, whatever the tokenizer.
"""

import json
import os
import time

from absl import app, flags, logging

from configs import tiny
from moe_jax.data import pipeline, tokenizer_training, tokenizers
from moe_jax.train.loop import train_and_evaluate

_WORKDIR = flags.DEFINE_string("workdir", "workdir/bench_tokenizer", "Runs and tokenizer.")
_STEPS = flags.DEFINE_integer("steps", 300, "Train steps per run.")
_VOCAB = flags.DEFINE_integer("vocab_size", 2048, "BPE vocabulary size.")
_DOCS = flags.DEFINE_integer("tokenizer_documents", 600, "Train documents for the tokenizer.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  c = tiny.get_config()
  docs = pipeline.text_documents(c)
  train = docs["train"][::max(1, len(docs["train"]) // _DOCS.value)][:_DOCS.value]
  start = time.perf_counter()
  spec = tokenizer_training.train(train, library="sentencepiece", model="bpe",
                                  vocab_size=_VOCAB.value,
                                  output=os.path.join(_WORKDIR.value, "stdlib_bpe.model"))
  tok_seconds = time.perf_counter() - start
  val_bytes = sum(len(d) for d in docs["validation"])
  results = {"tokenizer_train_s": tok_seconds, "validation_bytes": val_bytes, "runs": {}}
  for name, tokenizer in (("bytes", "bytes"), ("bpe", spec)):
    rc = tiny.get_config()
    rc.data.tokenizer = tokenizer
    rc.schedule.total_steps = _STEPS.value
    rc.eval.num_batches = 10_000   # the whole validation split
    rc.eval.every_steps = _STEPS.value
    tok = tokenizers.load(tokenizer)
    val_tokens = sum(len(tok.encode(d)) for d in docs["validation"])
    start = time.perf_counter()
    out = train_and_evaluate(rc, os.path.join(_WORKDIR.value, name), progress=False)
    results["runs"][name] = {
        "tokenizer": tokenizer, "vocab_size": tok.vocab_size, "steps": _STEPS.value,
        "val_bits_per_byte": out["val_bits_per_byte"], "val_loss": out["val_loss"],
        "validation_tokens": val_tokens, "bytes_per_token": val_bytes / val_tokens,
        "train_bytes_seen": _STEPS.value * rc.data.batch_size * rc.data.seq_len
                            * (1.0 if name == "bytes" else val_bytes / val_tokens),
        "wall_s": time.perf_counter() - start}
    print(name, json.dumps(results["runs"][name]), flush=True)
  with open(os.path.join(_WORKDIR.value, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
  print("| tokenizer | vocab | bytes/token | val bits/byte | train bytes seen | wall |")
  print("|---|---|---|---|---|---|")
  for name, r in results["runs"].items():
    print(f"| {name} | {r['vocab_size']} | {r['bytes_per_token']:.2f} | "
          f"{r['val_bits_per_byte']:.4f} | {r['train_bytes_seen'] / 1e6:.2f} M | "
          f"{r['wall_s']:.0f} s |")


if __name__ == "__main__":
  app.run(main)
