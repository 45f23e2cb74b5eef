"""Train a BPE or unigram tokenizer on documents, with SentencePiece or Hugging Face
`tokenizers` (scripts/train_tokenizer.py). Both are set up to round-trip any text exactly:
SentencePiece with identity normalisation, no dummy prefix, whitespace kept and byte
fallback; `tokenizers` over a byte-level alphabet. Ids 0..2 (SentencePiece: 1..3 after
<unk>) are PAD, BOS, EOS.
"""

import io

LIBRARIES = ("sentencepiece", "hf")
MODELS = ("bpe", "unigram")
SPECIALS = ("<pad>", "<bos>", "<eos>")


def train(docs: list[bytes], *, library: str, model: str, vocab_size: int, output: str) -> str:
  """Trains on `docs` and writes the tokenizer to `output`; returns its data.tokenizer spec."""
  if library not in LIBRARIES:
    raise ValueError(f"library must be one of {LIBRARIES}, got {library!r}")
  if model not in MODELS:
    raise ValueError(f"model must be one of {MODELS}, got {model!r}")
  if not 259 <= vocab_size <= 1 << 20:
    raise ValueError(f"vocab_size must be in [259, 2**20], got {vocab_size!r}")
  if not docs:
    raise ValueError("no documents to train on")
  texts = [d.decode("utf-8", errors="replace") for d in docs]
  if library == "sentencepiece":
    _train_sentencepiece(texts, model, vocab_size, output)
  else:
    _train_hf(texts, model, vocab_size, output)
  return f"{library}:{output}"


def _train_sentencepiece(texts, model, vocab_size, output):
  import sentencepiece as spm
  proto = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts), model_writer=proto, vocab_size=vocab_size,
      model_type=model, byte_fallback=True, character_coverage=1.0,
      normalization_rule_name="identity", add_dummy_prefix=False,
      remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
      split_digits=True, user_defined_symbols=["\n", "\t"],
      max_sentence_length=1 << 30, input_sentence_size=0,   # 0: every document
      unk_id=0, pad_id=1, bos_id=2, eos_id=3, minloglevel=2, num_threads=2)
  with open(output, "wb") as f:
    f.write(proto.getvalue())


def _train_hf(texts, model, vocab_size, output):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  common = dict(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  if model == "bpe":
    tok, trainer = Tokenizer(models.BPE()), trainers.BpeTrainer(**common)
  else:
    tok, trainer = Tokenizer(models.Unigram()), trainers.UnigramTrainer(**common)
  tok.pre_tokenizer, tok.decoder = byte_level, decoders.ByteLevel()
  tok.train_from_iterator(texts, trainer)
  tok.save(output)
