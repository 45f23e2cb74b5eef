"""Images as tokens in the text stream (early fusion, as Fuyu): an image becomes

  <image> p p … p <row> p p … p <row> … </image>

one PATCH position per P×P patch (its pixels ride along in a `patches` field, flattened
row-major, channels last) and a ROW_BREAK after each row of patches, so any height, width and
aspect ratio has a layout; `patch_rows` / `patch_cols` give each patch its 2-D place (the
model is NoPE, so that is the only position an image has). Text positions carry zero pixels.

A document is a list of parts, each a str or an image [H, W, C] (or [H, W]) in [0, 1];
`encode` turns it into per-position arrays, the one format for training rows and prompts.
"""

import numpy as np

from moe_jax.data import tokenizer

# Token ids that belong to an image's layout: never a training target.
IMAGE_TOKENS = (tokenizer.IMAGE_START, tokenizer.IMAGE_END, tokenizer.ROW_BREAK, tokenizer.PATCH)
FIELDS = ("tokens", "patches", "patch_rows", "patch_cols")


def no_pixels(n: int, patch_dim: int) -> dict[str, np.ndarray]:
  """The image fields of n positions that hold no patch (text, padding)."""
  return {"patches": np.zeros((n, patch_dim), np.float32),
          "patch_rows": np.zeros(n, np.int32), "patch_cols": np.zeros(n, np.int32)}


def as_hwc(image) -> np.ndarray:
  """[H, W] or [H, W, C] → float32 [H, W, C]."""
  image = np.asarray(image, np.float32)
  if image.ndim == 2:
    image = image[..., None]
  if image.ndim != 3:
    raise ValueError(f"an image must be [H, W] or [H, W, C], got shape {image.shape}")
  return image


def patchify(image_HxWxC, patch: int) -> np.ndarray:
  """[H, W, C] → [H/P, W/P, P·P·C]; H and W must be multiples of P."""
  H, W, C = image_HxWxC.shape
  if H % patch or W % patch:
    raise ValueError(f"image {H}×{W} is not a whole number of {patch}×{patch} patches "
                     "(model.vision.patch_size)")
  x = image_HxWxC.reshape(H // patch, patch, W // patch, patch, C)
  return x.transpose(0, 2, 1, 3, 4).reshape(H // patch, W // patch, patch * patch * C)


def unpatchify(patches_RxCxP, patch: int, channels: int) -> np.ndarray:
  """patchify's inverse: [rows, cols, P·P·C] → [rows·P, cols·P, C]."""
  R, Cc, _ = patches_RxCxP.shape
  x = patches_RxCxP.reshape(R, Cc, patch, patch, channels)
  return x.transpose(0, 2, 1, 3, 4).reshape(R * patch, Cc * patch, channels)


def image_span(image, patch: int, channels: int) -> dict[str, np.ndarray]:
  """The positions of one image: tokens, patches [N, P·P·C], patch_rows, patch_cols."""
  image = as_hwc(image)
  if image.shape[-1] != channels:
    raise ValueError(f"image has {image.shape[-1]} channels, model.vision.channels={channels}")
  grid = patchify(image, patch)
  R, Cc, Pd = grid.shape
  n = 2 + R * (Cc + 1)
  out = {"tokens": np.full(n, tokenizer.PATCH, np.int32), **no_pixels(n, Pd)}
  out["tokens"][0], out["tokens"][-1] = tokenizer.IMAGE_START, tokenizer.IMAGE_END
  for r in range(R):
    at = 1 + r * (Cc + 1)
    out["patches"][at:at + Cc] = grid[r]
    out["patch_rows"][at:at + Cc] = r
    out["patch_cols"][at:at + Cc] = np.arange(Cc)
    out["tokens"][at + Cc] = tokenizer.ROW_BREAK
  return out


def token_span(ids, patch_dim: int) -> dict[str, np.ndarray]:
  ids = np.asarray(ids, np.int32)
  return {"tokens": ids, **no_pixels(len(ids), patch_dim)}


def encode(parts, patch: int, channels: int, *, bos: bool = True,
           eos: bool = False) -> dict[str, np.ndarray]:
  """A document of text and images (in order) → per-position arrays (FIELDS)."""
  patch_dim = patch * patch * channels
  spans = [token_span([tokenizer.BOS] if bos else [], patch_dim)]
  for part in ([parts] if isinstance(parts, (str, bytes)) else parts):
    spans.append(token_span(tokenizer.encode(part, bos=False, eos=False), patch_dim)
                 if isinstance(part, (str, bytes)) else image_span(part, patch, channels))
  if eos:
    spans.append(token_span([tokenizer.EOS], patch_dim))
  return {k: np.concatenate([s[k] for s in spans]) for k in FIELDS}


def is_image_token(tokens) -> np.ndarray:
  return np.isin(tokens, IMAGE_TOKENS)


def load(path: str) -> np.ndarray:
  """A PNG (8- or 16-bit, grey or RGB; scaled to [0, 1]) or an NPY array (taken as is,
  expected in [0, 1]) → float32 [H, W, C]."""
  if path.endswith(".npy"):
    return as_hwc(np.load(path))
  from PIL import Image  # noqa: PLC0415 (pillow comes with matplotlib; only image prompts use it)
  with Image.open(path) as im:
    if im.mode not in ("L", "I;16", "RGB"):
      im = im.convert("RGB" if im.mode in ("RGBA", "P", "CMYK") else "L")
    scale = 65535.0 if im.mode == "I;16" else 255.0
    return as_hwc(np.asarray(im, np.float32) / scale)


def save_png(image, path: str):
  """An image in [0, 1] as an 8-bit PNG (grey for one channel)."""
  from PIL import Image  # noqa: PLC0415
  image = as_hwc(image)
  pixels = np.clip(np.round(image * 255.0), 0, 255).astype(np.uint8)
  Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels).save(path)
