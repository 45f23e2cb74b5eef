"""Image-text documents that need no download (data.image_tasks), packed into rows.

* digits: scikit-learn's `load_digits` (1,797 8×8 scans, 17 grey levels) as captioning,
  "<image>…</image> digit: 7". Every fifth image (index % 5 == 0) is held out.
* charts: bar charts rendered in NumPy (16×24, 3–6 bars of height 1–8 in steps of two
  pixels) with one question each: "which bar is tallest?" (the maximum is unique) or
  "value of bar i?". Train and held-out charts come from different seeds.

A document is BOS, the image, the prompt, a one-character answer and EOS. Training rows
learn every text target (prompt, answer, EOS; never an image's layout tokens); held-out rows
only the answer, so a split's `accuracy` is its answer accuracy (the answer is one token:
teacher-forced argmax is the greedy answer).
"""

import functools
from typing import NamedTuple

import numpy as np

from moe_jax.data import images, tokenizer

TASKS = ("digits", "charts")
CHART_HW = (16, 24)
IMAGE_HW = {"digits": (8, 8), "charts": CHART_HW}   # every image of a task has this size
HELD_OUT_CHARTS = 384


class Doc(NamedTuple):
  image: np.ndarray   # [H, W] in [0, 1]
  prompt: str
  answer: str


@functools.cache
def _digits():
  try:
    from sklearn.datasets import load_digits  # noqa: PLC0415 (the vision extra)
  except ImportError as e:
    raise ImportError("data.image_tasks=digits needs scikit-learn: pip install -e '.[vision]'") from e
  d = load_digits()
  return (d.images / 16.0).astype(np.float32), d.target.astype(np.int32)


def digit_indices(split: str) -> np.ndarray:
  n = len(_digits()[1])
  held = np.arange(n) % 5 == 0
  return np.flatnonzero(held if split == "eval" else ~held)


def digit_doc(index: int) -> Doc:
  pixels, labels = _digits()
  return Doc(pixels[index], " digit: ", str(labels[index]))


def render_chart(values) -> np.ndarray:
  """Bars of 2·v pixels from the bottom, each in an equal slot with a one-pixel gap."""
  H, W = CHART_HW
  image = np.zeros((H, W), np.float32)
  slot = W // len(values)
  for i, v in enumerate(values):
    image[H - 2 * v:, i * slot:(i + 1) * slot - 1] = 1.0
  return image


def chart_doc(rng: np.random.Generator) -> Doc:
  n = int(rng.integers(3, 7))
  while True:
    values = rng.integers(1, CHART_HW[0] // 2 + 1, size=n)
    if (values == values.max()).sum() == 1:
      break
  if rng.random() < 0.5:
    return Doc(render_chart(values), " Q: which bar is tallest? A: ", str(int(values.argmax()) + 1))
  i = int(rng.integers(n))
  return Doc(render_chart(values), f" Q: value of bar {i + 1}? A: ", str(int(values[i])))


def draw(task: str, split: str, seed: int, n: int) -> Doc:
  """Document n of a task's split: a function of (task, split, seed, n) only."""
  if task == "digits":
    idx = digit_indices(split)
    if split == "eval":
      return digit_doc(int(idx[n % len(idx)]))
    return digit_doc(int(idx[np.random.default_rng((seed, n)).integers(len(idx))]))
  return chart_doc(np.random.default_rng((seed, 1 + (split == "eval"), n)))


def held_out_size(task: str) -> int:
  return len(digit_indices("eval")) if task == "digits" else HELD_OUT_CHARTS


def encode_doc(doc: Doc, patch: int, channels: int, answer_only: bool):
  """(per-position arrays, trained flag per position) of one document."""
  arrays = images.encode([doc.image, doc.prompt + doc.answer], patch, channels, eos=True)
  n = len(arrays["tokens"])
  if answer_only:
    trained = np.zeros(n, bool)
    trained[n - 1 - len(doc.answer.encode()):n - 1] = True
  else:
    trained = ~images.is_image_token(arrays["tokens"])
    trained[0] = False   # BOS
  return arrays, trained


def empty_row(seq_len: int, patch_dim: int) -> dict[str, np.ndarray]:
  return {"tokens": np.full(seq_len, tokenizer.PAD, np.int32),
          "targets": np.full(seq_len, tokenizer.PAD, np.int32),
          "segment_ids": np.zeros(seq_len, np.int32),
          "positions": np.zeros(seq_len, np.int32),
          "loss_mask": np.zeros(seq_len, np.float32),
          **images.no_pixels(seq_len, patch_dim)}


def pack(encoded: list, seq_len: int, patch_dim: int) -> dict[str, np.ndarray]:
  """Whole documents, one segment each, into one row (they must fit)."""
  row = empty_row(seq_len, patch_dim)
  at = 0
  for seg, (arrays, trained) in enumerate(encoded, 1):
    n = len(arrays["tokens"])
    if at + n > seq_len:
      raise ValueError(f"documents of {at + n} tokens do not fit data.seq_len={seq_len}")
    for k in images.FIELDS:
      row[k][at:at + n] = arrays[k]
    row["segment_ids"][at:at + n] = seg
    row["positions"][at:at + n] = np.arange(n)
    row["targets"][at:at + n - 1] = arrays["tokens"][1:]
    row["loss_mask"][at:at + n - 1] = trained[1:]
    at += n
  return row


class TrainRows:
  """Random-access rows of training documents, the tasks taken in turn, packed whole; row i
  depends only on (seed, i) (a grain data source)."""

  _PER_ROW = 1000   # document indices reserved per row

  def __init__(self, tasks: list[str], patch: int, channels: int, seq_len: int, seed: int,
               length: int = 2**31 - 1):
    self.tasks, self.patch, self.channels = tasks, patch, channels
    self.seq_len, self.seed, self.length = seq_len, seed, length
    for t in tasks:
      n = len(self._encode(t, 0)[0]["tokens"])
      if n > seq_len:
        raise ValueError(f"data.seq_len={seq_len} is shorter than a {t} document ({n} tokens)")

  def _encode(self, task, n):
    return encode_doc(draw(task, "train", self.seed, n), self.patch, self.channels, False)

  def __len__(self):
    return self.length

  def __getitem__(self, i):
    encoded, at = [], 0
    for j in range(self._PER_ROW):
      n = int(i) * self._PER_ROW + j
      doc = self._encode(self.tasks[n % len(self.tasks)], n)
      at += len(doc[0]["tokens"])
      if at > self.seq_len:
        break
      encoded.append(doc)
    return pack(encoded, self.seq_len, self.patch * self.patch * self.channels)


class HeldOutRows:
  """Every held-out document of one task once, packed in order, answer-only loss; padded with
  empty rows to a multiple of `multiple` (eval batches keep one shape)."""

  def __init__(self, task: str, patch: int, channels: int, seq_len: int, multiple: int):
    patch_dim = patch * patch * channels
    self.rows, row = [], []
    used = 0
    for n in range(held_out_size(task)):
      doc = encode_doc(draw(task, "eval", 0, n), patch, channels, True)
      size = len(doc[0]["tokens"])
      if used + size > seq_len:
        self.rows.append(pack(row, seq_len, patch_dim))
        row, used = [], 0
      row.append(doc)
      used += size
    self.rows.append(pack(row, seq_len, patch_dim))
    while len(self.rows) % multiple:
      self.rows.append(empty_row(seq_len, patch_dim))

  def __len__(self):
    return len(self.rows)

  def __getitem__(self, i):
    return self.rows[i]


class WithPatches:
  """Rows of a text (or synthetic) source with the image fields added, zero: every row of a
  multimodal model's batch has the same fields."""

  def __init__(self, rows, patch_dim: int):
    self.rows, self.patch_dim = rows, patch_dim

  def __len__(self):
    return len(self.rows)

  def __getattr__(self, name):   # the wrapped source's own attributes (tokens_NxL, ...)
    if name == "rows":   # not set yet (unpickling): no recursion
      raise AttributeError(name)
    return getattr(self.rows, name)

  def __getitem__(self, i):
    row = self.rows[i]
    if "patches" in row:
      return row
    return {**row, **images.no_pixels(len(row["tokens"]), self.patch_dim)}
