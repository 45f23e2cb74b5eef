"""Tokenizers behind one interface: the byte default, SentencePiece and Hugging Face.

`data.tokenizer` names one: "bytes", "sentencepiece:<model file>", "hf:<tokenizer.json>" or
"kimi:<tiktoken.model or its directory>" (Kimi Linear's tokenizer).
Every tokenizer reports, for each token it emits, how many UTF-8 bytes of the text it
covers (`encode_with_bytes`), from the library's own offsets; the eval divides total bits by
the sum of those counts, so bits per byte mean the same whatever the tokenizer. A model
that lacks a BOS, EOS or PAD id gets one appended after its vocabulary.
"""

import os

import ml_collections
import numpy as np

from moe_jax import fields
from moe_jax.data import tokenizer as byte_tokenizer

MAX_VOCAB = 1 << 20


class ByteTokenizer:
  """A token per UTF-8 byte (ids 0..255), then BOS, EOS, PAD (data/tokenizer.py)."""

  vocab_size = byte_tokenizer.VOCAB_SIZE
  bos, eos, pad = byte_tokenizer.BOS, byte_tokenizer.EOS, byte_tokenizer.PAD

  def encode(self, text, *, bos=True, eos=True) -> np.ndarray:
    return byte_tokenizer.encode(text, bos=bos, eos=eos)

  def encode_with_bytes(self, text, *, bos=True, eos=True):
    ids_N = self.encode(text, bos=bos, eos=eos)
    return ids_N, (ids_N < 256).astype(np.int32)

  def decode(self, ids) -> str:
    return byte_tokenizer.decode(ids)


class _Subword:
  """Framing, appended specials and byte counts shared by the library tokenizers. A
  subclass sets self.n (the library's vocabulary size) and implements _ids_and_ends
  (ids and each token's end as a byte offset into the text) and _decode."""

  def _set_specials(self, bos: int, eos: int, pad: int):
    extra = iter(range(self.n, self.n + 3))
    self.bos, self.eos, self.pad = (i if i is not None and i >= 0 else next(extra)
                                    for i in (bos, eos, pad))
    self.vocab_size = max(self.n, self.bos + 1, self.eos + 1, self.pad + 1)
    self.specials = {self.bos, self.eos, self.pad}

  def encode(self, text, *, bos=True, eos=True) -> np.ndarray:
    return self.encode_with_bytes(text, bos=bos, eos=eos)[0]

  def encode_with_bytes(self, text, *, bos=True, eos=True):
    """(ids [N] int32, bytes [N] int32): a token's count is the bytes from the previous
    token's end to its own (so the counts of a text sum to its UTF-8 length exactly; the
    bytes a normaliser drops go to the token after them)."""
    text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
    ids, ends = self._ids_and_ends(text)
    ends_N = np.maximum.accumulate(np.asarray(ends, np.int64)) if ids else np.zeros(0, np.int64)
    if ids:
      ends_N[-1] = len(text.encode("utf-8"))
    nbytes_N = np.diff(ends_N, prepend=0)
    ids_N = np.asarray(ids, np.int32)
    head, tail = [self.bos] * bos, [self.eos] * eos
    return (np.concatenate([np.asarray(head, np.int32), ids_N, np.asarray(tail, np.int32)]),
            np.concatenate([np.zeros(int(bos), np.int64), nbytes_N, np.zeros(int(eos), np.int64)]
                           ).astype(np.int32))

  def decode(self, ids) -> str:
    ids = [int(i) for i in np.asarray(ids).reshape(-1)
           if int(i) not in self.specials and 0 <= int(i) < self.n]
    return self._decode(ids)


class SentencePieceTokenizer(_Subword):
  def __init__(self, path: str):
    import sentencepiece as spm
    self.sp = spm.SentencePieceProcessor(model_file=path)
    self.n = self.sp.vocab_size()
    self._set_specials(self.sp.bos_id(), self.sp.eos_id(), self.sp.pad_id())

  def _ids_and_ends(self, text):
    pieces = self.sp.encode(text, return_type="proto").pieces   # begin / end: byte offsets
    return [p.id for p in pieces], [p.end for p in pieces]

  def _decode(self, ids):
    return self.sp.decode(ids)


class HFTokenizer(_Subword):
  """A `tokenizers` tokenizer.json; BOS / EOS / PAD found by their usual names."""

  NAMES = {"bos": ("<bos>", "<s>", "[BOS]", "<|begin_of_text|>", "<|endoftext|>"),
           "eos": ("<eos>", "</s>", "[EOS]", "<|end_of_text|>", "<|endoftext|>"),
           "pad": ("<pad>", "[PAD]", "<|pad|>")}

  def __init__(self, path: str):
    from tokenizers import Tokenizer
    self.tok = Tokenizer.from_file(path)
    self.n = self.tok.get_vocab_size(with_added_tokens=True)
    found = {k: next((self.tok.token_to_id(t) for t in names
                      if self.tok.token_to_id(t) is not None), None)
             for k, names in self.NAMES.items()}
    self._set_specials(found["bos"], found["eos"], found["pad"])

  def _ids_and_ends(self, text):
    enc = self.tok.encode(text, add_special_tokens=False)
    # Offsets count characters of `text`; the bytes before character c: char_bytes[c].
    code_points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    width = 1 + (code_points >= 0x80) + (code_points >= 0x800) + (code_points >= 0x10000)
    char_bytes = np.concatenate([[0], np.cumsum(width)])
    ends = np.asarray([e for _, e in enc.offsets], np.int64)
    return enc.ids, char_bytes[ends] if len(ends) else []

  def _decode(self, ids):
    return self.tok.decode(ids, skip_special_tokens=False)


class KimiTokenizer(_Subword):
  """Kimi Linear's tokenizer (Moonshot's tokenization_kimi.py): tiktoken BPE ranks from
  `tiktoken.model` split by Kimi's pattern, then 256 special ids. Their names come from a
  tokenizer_config.json beside the file (added_tokens_decoder; bos/eos/pad_token), else
  "<|reserved_token_i|>" with BOS, EOS and PAD at the released ids (ranks + 0, + 1, + 255).
  Text never encodes to a special id. (tokenization_kimi.py registers 258 specials; the
  model's embedding has ranks + 256 rows, so the last two can never be fed.)"""

  PATTERN = "|".join([
      r"""[\p{Han}]+""",
      r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
      r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
      r"""\p{N}{1,3}""",
      r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
      r"""\s*[\r\n]+""",
      r"""\s+(?!\S)""",
      r"""\s+""",
  ])
  SPECIALS = 256

  def __init__(self, path: str):
    import json

    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    model_file = kimi_model_file(path)
    ranks = load_tiktoken_bpe(model_file)
    base = len(ranks)
    config_file = os.path.join(os.path.dirname(model_file), "tokenizer_config.json")
    config = {}
    if os.path.exists(config_file):
      with open(config_file) as f:
        config = json.load(f)
    names = {int(i): v["content"] for i, v in config.get("added_tokens_decoder", {}).items()}
    specials = {names.get(i, f"<|reserved_token_{i}|>"): i
                for i in range(base, base + self.SPECIALS)}
    self.enc = tiktoken.Encoding(name=os.path.basename(model_file), pat_str=self.PATTERN,
                                 mergeable_ranks=ranks, special_tokens=specials)
    self.n = base + self.SPECIALS
    named = lambda key, default: specials.get(_token_content(config.get(key)), default)
    self._set_specials(named("bos_token", base), named("eos_token", base + 1),
                       named("pad_token", base + 255))

  def _ids_and_ends(self, text):
    ids = self.enc.encode(text, disallowed_special=())
    return ids, np.cumsum([len(self.enc.decode_single_token_bytes(i)) for i in ids])

  def _decode(self, ids):
    return self.enc.decode(ids)


def kimi_model_file(path: str) -> str:
  """data.tokenizer=kimi:<path>: the tiktoken.model file, or the one in that directory."""
  return os.path.join(path, "tiktoken.model") if os.path.isdir(path) else path


def _token_content(token):
  """A tokenizer_config.json token field: "[BOS]" or {"content": "[BOS]", ...}."""
  return token.get("content") if isinstance(token, dict) else token


def load(spec: str):
  """"bytes" | "sentencepiece:<model file>" | "hf:<tokenizer.json>" | "kimi:<tiktoken.model
  or its directory>" → a tokenizer."""
  kind, path = fields.parse_tokenizer(spec)
  if kind == "bytes":
    return ByteTokenizer()
  if kind == "kimi":
    model_file = kimi_model_file(path)
    if not os.path.isfile(model_file):
      raise ValueError(f"data.tokenizer={spec!r}: no tiktoken.model at {model_file!r} (it "
                       "comes with a Kimi-Linear checkpoint)")
    return KimiTokenizer(path)
  if not os.path.isfile(path):
    raise ValueError(f"data.tokenizer={spec!r}: no file at {path!r} (train one with "
                     "scripts/train_tokenizer.py)")
  tok = SentencePieceTokenizer(path) if kind == "sentencepiece" else HFTokenizer(path)
  if not byte_tokenizer.VOCAB_SIZE <= tok.vocab_size <= MAX_VOCAB:
    raise ValueError(f"data.tokenizer={spec!r} has {tok.vocab_size} ids; accepted: "
                     f"{byte_tokenizer.VOCAB_SIZE} to {MAX_VOCAB}")
  return tok


def configure(c: ml_collections.ConfigDict):
  """Loads data.tokenizer and makes model.vocab_size follow it (a learned tokenizer sets
  the size, and its path is made absolute; the byte tokenizer leaves the config's vocab
  size). Returns the tokenizer."""
  tok = load(c.data.tokenizer)
  if c.data.tokenizer != "bytes":
    c.data.tokenizer = fields.tokenizer_spec(c.data.tokenizer)
    c.model.vocab_size = tok.vocab_size
  return tok
