"""Tokenize and pack a config's document source once into ArrayRecord shards, so a large
corpus is not re-tokenized at the start of every run (scripts/prepare_data.py; the
`prepared` source reads them back: prepared.py)."""

from moe_jax import fields
from moe_jax.data import pipeline, prepared, tokenizers


def prepare(c, output: str, rows_per_shard: int = 4096) -> dict:
  """Writes `output` from config c's document source; returns meta.json's contents."""
  if c.data.source not in fields.DOCUMENT_SOURCES:
    raise ValueError(f"data.source must be one of {fields.DOCUMENT_SOURCES} to prepare, "
                     f"got {c.data.source!r}")
  tok = tokenizers.load(c.data.tokenizer)
  docs = pipeline.text_documents(c)
  rows = pipeline.text_rows(c, docs, with_bytes=True)   # shards always hold byte counts
  meta = {"tokenizer": fields.tokenizer_spec(c.data.tokenizer), "seq_len": c.data.seq_len, "pad": tok.pad,
          "vocab_size": tok.vocab_size, "source": c.data.source, "paths": c.data.paths,
          "byte_hist": {k: r.byte_hist.tolist() for k, r in rows.items()},
          "documents": {k: len(v) for k, v in docs.items()}}
  prepared.write(output, rows, meta, rows_per_shard)
  return prepared.read_meta(output)
