"""Learned tokenizers (SentencePiece, Hugging Face) and Kimi's tiktoken one: round trips, byte counts, appended
specials, vocab_size following the tokenizer, bits per byte over the same bytes, and
generation decoding through the tokenizer."""

import base64
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base as base_config, tiny
from moe_jax import config as config_lib
from moe_jax.data import pipeline, tokenizer_training, tokenizers
from moe_jax.train import step as step_lib

CASES = [("sentencepiece", "bpe"), ("sentencepiece", "unigram"), ("hf", "bpe"), ("hf", "unigram")]


@pytest.fixture(scope="module")
def stdlib_docs():
  return pipeline.text_documents(tiny.get_config())


@pytest.fixture(scope="module")
def trained(stdlib_docs, tmp_path_factory):
  """One small tokenizer per (library, model), trained on 40 stdlib train documents."""
  d = tmp_path_factory.mktemp("tok")
  train = stdlib_docs["train"][::len(stdlib_docs["train"]) // 40][:40]
  return {(lib, model): tokenizer_training.train(
      train, library=lib, model=model, vocab_size=640,
      output=str(d / (f"{lib}_{model}" + (".model" if lib == "sentencepiece" else ".json"))))
          for lib, model in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "_".join(c))
def test_round_trips_the_validation_text_with_exact_byte_counts(trained, stdlib_docs, case):
  tok = tokenizers.load(trained[case])
  assert tok.vocab_size == 640 and len({tok.bos, tok.eos, tok.pad}) == 3
  n_tokens = n_bytes = 0
  extra = ["tab\tcafé ☃ 𝄞 — ÿ\r\n  \n\n", ""]   # beyond the corpus: 2-4-byte chars, CR, blanks
  for doc in stdlib_docs["validation"] + [e.encode() for e in extra]:
    ids_N, bytes_N = tok.encode_with_bytes(doc)
    assert ids_N[0] == tok.bos and ids_N[-1] == tok.eos and bytes_N[0] == bytes_N[-1] == 0
    assert (bytes_N >= 0).all() and bytes_N.sum() == len(doc)
    assert tok.decode(ids_N) == doc.decode("utf-8")
    n_tokens, n_bytes = n_tokens + len(ids_N) - 2, n_bytes + len(doc)
  assert 1.5 < n_bytes / n_tokens < 4.0   # it did learn merges (bytes would be 1.0)


def test_missing_specials_are_appended_and_bad_specs_named(tmp_path, stdlib_docs):
  import sentencepiece as spm
  path = str(tmp_path / "nopad.model")
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(d.decode() for d in stdlib_docs["train"][:20]),
      model_prefix=path[:-len(".model")], vocab_size=600, byte_fallback=True, pad_id=-1,
      bos_id=-1, minloglevel=2)
  tok = tokenizers.load(f"sentencepiece:{path}")
  assert (tok.n, tok.bos, tok.pad, tok.vocab_size) == (600, 600, 601, 602)
  assert tok.eos == tok.sp.eos_id() < 600
  assert tok.decode(tok.encode("x = 1")) == "x = 1"
  with pytest.raises(ValueError, match="data.tokenizer must be one of"):
    tokenizers.load("tiktoken:cl100k")
  with pytest.raises(ValueError, match="no file at '/nonexistent.json'"):
    tokenizers.load("hf:/nonexistent.json")
  c = tiny.get_config()
  c.data.tokenizer = "hf:x.json"
  c.data.synthetic_fraction = 0.1
  with pytest.raises(ValueError, match="data.synthetic_fraction must be 0 with data.tokenizer"):
    config_lib.validate(c)
  c.data.synthetic_fraction, c.data.source = 0.0, "mqar"
  with pytest.raises(ValueError, match="data.tokenizer must be 'bytes' with data.source='mqar'"):
    config_lib.validate(c)


def _uniform_eval(c, rows):
  """Eval sums of a model that predicts every id with probability 1/V, over all rows."""
  V = c.model.vocab_size
  apply_fn = lambda variables, batch: (jnp.zeros(batch["tokens"].shape + (V,)), {})
  eval_step = jax.jit(functools.partial(step_lib.eval_step, apply_fn=apply_fn))
  sums = None
  for i in range(0, len(rows), 16):
    batch = pipeline._stack([rows[j] for j in range(i, min(i + 16, len(rows)))])
    out = eval_step({}, {}, batch)
    sums = out if sums is None else {k: sums[k] + out[k] for k in out}
  return {k: float(v) for k, v in sums.items()}


def test_bits_per_byte_counts_the_same_bytes_for_every_tokenizer(trained, stdlib_docs):
  """Over the whole validation split, the bytes the eval divides by are the split's UTF-8
  bytes less those of the tokens that open a row mid-document (never labels), for the
  byte tokenizer and a SentencePiece one alike; and a uniform predictor's bits per byte
  is tokens · log2(V) / bytes."""
  val = {"validation": stdlib_docs["validation"]}
  total = sum(len(d) for d in val["validation"])
  results = {}
  for spec in ("bytes", trained[("sentencepiece", "bpe")]):
    c = tiny.get_config()
    c.data.tokenizer = spec
    tok = tokenizers.configure(c)
    assert c.model.vocab_size == tok.vocab_size == (259 if spec == "bytes" else 640)
    rows = pipeline.text_rows(c, val)["validation"]
    # Tokens that open a row mid-document are never labels: their bytes are not counted.
    doc_lengths = [len(tok.encode(d)) for d in val["validation"]]
    doc_starts = set(np.cumsum([0] + doc_lengths[:-1]).tolist())
    continues = np.array([r * c.data.seq_len not in doc_starts for r in range(1, len(rows))])
    first_ids = rows.tokens_NxL[1:, 0]
    skipped = int((continues & (first_ids < 256)).sum() if spec == "bytes"
                  else rows.bytes_NxL[1:, 0][continues].sum())
    sums = _uniform_eval(c, rows)
    assert sums["bytes"] + skipped == total
    bpb = step_lib.summarize_eval(sums)["bits_per_byte"]
    np.testing.assert_allclose(bpb, sums["tokens"] * np.log2(c.model.vocab_size) / sums["bytes"],
                               rtol=1e-5)
    results[spec] = (sums["tokens"], sums["bytes"])
  (byte_tokens, byte_bytes), (sp_tokens, sp_bytes) = results.values()
  assert abs(byte_bytes - sp_bytes) / total < 0.01 and sp_tokens < 0.7 * byte_tokens


@pytest.mark.slow
def test_a_run_with_a_learned_tokenizer_sizes_the_model_and_generates_through_it(
    trained, tmp_path):
  """A JSONL corpus, a SentencePiece tokenizer: model.vocab_size follows the tokenizer, the
  workdir records its absolute path, and greedy complete() is the tokenizer's decoding of
  the full forward's argmax continuation."""
  import jax

  from moe_jax.data import records
  from moe_jax.infer import generate, workdir
  from moe_jax.train.loop import train_and_evaluate
  from moe_jax.train.state import frozen_model_config
  from tests.conftest import make_small_config
  docs = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" * (1 + i % 3) for i in range(60)]
  records.write("jsonl", str(tmp_path / "corpus.jsonl"), docs)
  c = make_small_config()
  c.data.source, c.data.paths, c.data.val_percent = "jsonl", str(tmp_path / "*.jsonl"), 20
  c.data.tokenizer = trained[("sentencepiece", "bpe")]
  c.schedule.total_steps, c.schedule.warmup_steps = 2, 1
  run = tmp_path / "run"
  out = train_and_evaluate(c, str(run), progress=False)
  assert np.isfinite(out["val_bits_per_byte"]) and out["val_bits_per_byte"] > 0
  c2, variables, _ = workdir.load(str(run))
  tok = tokenizers.load(c2.data.tokenizer)
  assert c2.model.vocab_size == tok.vocab_size == 640
  assert c2.data.tokenizer == config_lib.tokenizer_spec(trained[("sentencepiece", "bpe")])
  prompt, n_new = "def f7(x):\n", 6
  got = generate.complete(frozen_model_config(c2), variables, [prompt], max_new=n_new,
                          key=jax.random.key(0), temperature=0.0, tok=tok,
                          stop_tokens=())[0]
  model = generate.inference_model(frozen_model_config(c2))
  ids = list(tok.encode(prompt, eos=False))
  T = len(ids) + n_new
  apply = jax.jit(model.apply)
  for _ in range(n_new):
    tokens = np.zeros((1, T), np.int32)
    tokens[0, :len(ids)] = ids
    seg = (np.arange(T) < len(ids)).astype(np.int32)[None]
    logits, _ = apply(generate.inference_variables(c2.model, variables),
                      {"tokens": tokens, "segment_ids": seg})
    ids.append(int(np.argmax(logits[0, len(ids) - 1])))
  assert got == tok.decode(ids[T - n_new:])


def _kimi_files(tmp_path, config=None):
  """A tiny tiktoken.model (every byte, then a few merges) in Kimi's layout."""
  pieces = [bytes([b]) for b in range(256)] + [b"th", b"he", b"the", b" the", b"in", b"ing",
                                               "中文".encode()]
  with open(tmp_path / "tiktoken.model", "w") as f:
    f.writelines(f"{base64.b64encode(p).decode()} {r}\n" for r, p in enumerate(pieces))
  if config is not None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  return len(pieces)


def test_kimi_tokenizer_round_trip_and_byte_counts(tmp_path):
  base = _kimi_files(tmp_path)
  tok = tokenizers.load(f"kimi:{tmp_path}")
  assert (tok.vocab_size, tok.bos, tok.eos, tok.pad) == (base + 256, base, base + 1, base + 255)
  text = "the thing 中文 and Ünïcode's 12345\n\n<|im_end|>"
  ids, nbytes = tok.encode_with_bytes(text)
  assert ids[0] == tok.bos and ids[-1] == tok.eos
  assert nbytes.sum() == len(text.encode("utf-8")) and (nbytes[1:-1] > 0).all()
  assert tok.decode(ids) == text                        # specials in text stay text
  assert tok.encode("the", bos=False, eos=False).tolist() == [258]   # the merged piece
  assert max(ids[1:-1]) < base
  c = base_config.get_config()
  c.data.tokenizer = f"kimi:{tmp_path / 'tiktoken.model'}"
  tokenizers.configure(c)
  assert c.model.vocab_size == base + 256


def test_kimi_tokenizer_names_from_its_config(tmp_path):
  base = _kimi_files(tmp_path, {
      "added_tokens_decoder": {str(base_id): {"content": name} for base_id, name in
                               ((263, "[BOS]"), (264, "[EOS]"), (265, "<|im_end|>"),
                                (518, "[PAD]"))},
      "bos_token": "[BOS]", "eos_token": {"content": "<|im_end|>"}, "pad_token": "[PAD]"})
  tok = tokenizers.load(f"kimi:{tmp_path}")
  assert (tok.bos, tok.eos, tok.pad) == (base, base + 2, base + 255)
  assert tok.decode([tok.bos, 258, tok.pad]) == "the"     # BOS, PAD dropped...
  assert tok.decode([tok.eos]) == "" and tok.enc.decode([base + 2]) == "<|im_end|>"  # named


def test_kimi_tokenizer_missing_file_is_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match="no tiktoken.model"):
    tokenizers.load(f"kimi:{tmp_path}")
