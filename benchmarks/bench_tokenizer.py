"""Bits per byte with a learned BPE tokenizer against the byte tokenizer, on the embedded
stdlib corpus (benchmarks/tokenizers.md).

  python -m benchmarks.bench_tokenizer --workdir=workdir/bench_tokenizer [--steps=300]

Trains a SentencePiece BPE tokenizer on the train split, then the tiny config twice (bytes,
BPE) for the same steps and rows of the same token length (so BPE sees ≈ 2.6× the bytes),
and with --equal_bytes a third byte run for as many steps as BPE's bytes take. Every run
is evaluated over the whole validation split: total bits / the bytes its labels cover.
"""

import json
import os
import time

from absl import app, flags, logging

from configs import tiny
from moe_jax.data import pipeline, tokenizer_training, tokenizers
from moe_jax.train import state as state_lib
from moe_jax.train.loop import train_and_evaluate

_WORKDIR = flags.DEFINE_string("workdir", "workdir/bench_tokenizer", "Runs and tokenizer.")
_STEPS = flags.DEFINE_integer("steps", 300, "Train steps per run.")
_VOCAB = flags.DEFINE_integer("vocab_size", 2048, "BPE vocabulary size.")
_DOCS = flags.DEFINE_integer("tokenizer_documents", 600, "Train documents for the tokenizer.")
_EVAL_BATCHES = flags.DEFINE_integer("eval_batches", 10_000, "Validation batches (the default "
                                     "covers the whole split).")
_EQUAL_BYTES = flags.DEFINE_bool("equal_bytes", False, "Also train the byte model for as many "
                                 "steps as it takes to see the BPE run's bytes.")


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
  bpe_tok = tokenizers.load(spec)
  bpe_bytes_per_token = val_bytes / sum(len(bpe_tok.encode(d)) for d in docs["validation"])
  arms = [("bytes", "bytes", _STEPS.value), ("bpe", spec, _STEPS.value)]
  if _EQUAL_BYTES.value:
    arms.append(("bytes_equal_bytes", "bytes", round(_STEPS.value * bpe_bytes_per_token)))
  for name, tokenizer, steps in arms:
    rc = tiny.get_config()
    rc.data.tokenizer = tokenizer
    rc.schedule.total_steps = steps
    rc.schedule.warmup_steps = min(rc.schedule.warmup_steps, steps // 2)
    rc.eval.num_batches = _EVAL_BATCHES.value
    rc.eval.every_steps = steps
    tok = tokenizers.load(tokenizer)
    val_tokens = sum(len(tok.encode(d)) for d in docs["validation"])
    start = time.perf_counter()
    out = train_and_evaluate(rc, os.path.join(_WORKDIR.value, name), progress=False)
    results["runs"][name] = {
        "tokenizer": tokenizer, "vocab_size": tok.vocab_size, "steps": steps,
        "val_bits_per_byte": out["val_bits_per_byte"], "val_loss": out["val_loss"],
        "validation_tokens": val_tokens, "bytes_per_token": val_bytes / val_tokens,
        "params": state_lib.param_count(out["state"].params),
        "train_bytes_seen": steps * rc.data.batch_size * rc.data.seq_len
                            * (1.0 if tokenizer == "bytes" else bpe_bytes_per_token),
        "wall_s": time.perf_counter() - start}
    print(name, json.dumps(results["runs"][name]), flush=True)
    with open(os.path.join(_WORKDIR.value, "results.json"), "w") as f:
      json.dump(results, f, indent=2)
  with open(os.path.join(_WORKDIR.value, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
  print("| run | vocab | params | steps | bytes/token | val bits/byte | train bytes seen | wall |")
  print("|---|---|---|---|---|---|---|---|")
  for name, r in results["runs"].items():
    print(f"| {name} | {r['vocab_size']} | {r['params']:,} | {r['steps']} | "
          f"{r['bytes_per_token']:.2f} | "
          f"{r['val_bits_per_byte']:.4f} | {r['train_bytes_seen'] / 1e6:.2f} M | "
          f"{r['wall_s']:.0f} s |")


if __name__ == "__main__":
  app.run(main)
