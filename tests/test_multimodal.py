"""Images in the token stream: patch layout, the image documents, loss masks, packing
isolation, decoding after an image prompt, the patch loss and the per-modality expert load."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import config as config_lib
from moe_jax.data import image_tasks, images, pipeline, tokenizer
from moe_jax.infer.cache import init_cache
from moe_jax.infer.generate import complete, encode_prompts, inference_model, make_step, prefill
from moe_jax.model import vision
from moe_jax.model.transformer import HybridMoE
from moe_jax.train import step as step_lib
from moe_jax.train.state import frozen_model_config
from tests.conftest import make_small_config, rel_err

P = 4


def _config(**vision_fields):
  c = make_small_config()
  c.model.vocab_size = tokenizer.MULTIMODAL_VOCAB_SIZE
  c.model.dtype = "float32"
  c.model.vision.update({"patch_size": P, "max_rows": 8, "max_cols": 8, **vision_fields})
  return c


def test_patchify_then_unpatchify_gives_the_image_back():
  image = np.random.default_rng(0).random((12, 8, 3)).astype(np.float32)
  grid = images.patchify(image, P)
  assert grid.shape == (3, 2, P * P * 3)
  np.testing.assert_array_equal(grid[1, 0], image[4:8, 0:4].reshape(-1))  # row-major, C last
  np.testing.assert_array_equal(images.unpatchify(grid, P, 3), image)
  with pytest.raises(ValueError, match="patch"):
    images.patchify(image[:10], P)


def test_marker_layout_of_a_non_square_image():
  """8×12 at P = 4: two rows of three patches, a row break after each row."""
  image = np.random.default_rng(1).random((8, 12)).astype(np.float32)
  span = images.image_span(image, P, 1)
  S, E, R, X = (tokenizer.IMAGE_START, tokenizer.IMAGE_END, tokenizer.ROW_BREAK,
                tokenizer.PATCH)
  assert span["tokens"].tolist() == [S, X, X, X, R, X, X, X, R, E]
  patch = span["tokens"] == X
  assert span["patch_rows"][patch].tolist() == [0, 0, 0, 1, 1, 1]
  assert span["patch_cols"][patch].tolist() == [0, 1, 2, 0, 1, 2]
  np.testing.assert_array_equal(span["patches"][patch],
                                images.patchify(image[..., None], P).reshape(6, -1))
  assert not span["patches"][~patch].any()
  # A tall image: three rows of two.
  tall = images.image_span(image.T, P, 1)
  assert tall["tokens"].tolist() == [S, X, X, R, X, X, R, X, X, R, E]


def test_image_loss_mask():
  """Training documents learn every text target and no image-layout token; held-out ones
  only the one-character answer."""
  doc = image_tasks.chart_doc(np.random.default_rng(3))
  arrays, trained = image_tasks.encode_doc(doc, P, 1, answer_only=False)
  row = image_tasks.pack([(arrays, trained)], 128, P * P)
  n = len(arrays["tokens"])
  targets, mask = row["targets"][:n - 1], row["loss_mask"][:n - 1]
  is_layout = np.isin(targets, images.IMAGE_TOKENS)
  assert not mask[is_layout].any() and mask[~is_layout].all()
  assert targets[-1] == tokenizer.EOS and mask[n - 2] == 1
  assert not row["loss_mask"][n - 1:].any()
  _, answer_only = image_tasks.encode_doc(doc, P, 1, answer_only=True)
  row = image_tasks.pack([(arrays, answer_only)], 128, P * P)
  (at,) = np.flatnonzero(row["loss_mask"])
  assert tokenizer.decode(row["targets"][at:at + 1]) == doc.answer


def test_chart_answers_read_off_the_rendered_bars():
  """Count the bars (runs of lit pixels along the bottom row), read each one's height in
  its slot, and check the answer against them."""
  rng = np.random.default_rng(4)
  W = image_tasks.CHART_HW[1]
  for _ in range(50):
    doc = image_tasks.chart_doc(rng)
    bottom = (doc.image[-1] > 0).astype(int)
    n = int((np.diff(np.concatenate([[0], bottom])) == 1).sum())
    bars = [int((doc.image[:, i * (W // n)] > 0).sum()) // 2 for i in range(n)]
    assert 3 <= n <= 6 and min(bars) >= 1
    if "tallest" in doc.prompt:
      assert bars.count(max(bars)) == 1 and int(doc.answer) == bars.index(max(bars)) + 1
    else:
      i = int(doc.prompt.split("bar ")[1].split("?")[0])
      assert int(doc.answer) == bars[i - 1]


def test_digit_split_is_deterministic_and_disjoint():
  train, held = image_tasks.digit_indices("train"), image_tasks.digit_indices("eval")
  assert len(train) + len(held) == 1797 and not set(train) & set(held)
  a = image_tasks.TrainRows(["digits", "charts"], P, 1, 128, seed=0)
  b = image_tasks.TrainRows(["digits", "charts"], P, 1, 128, seed=0)
  for k in a[5]:
    np.testing.assert_array_equal(a[5][k], b[5][k])
  rows = image_tasks.HeldOutRows("digits", P, 1, 128, multiple=4)
  assert len(rows) % 4 == 0
  assert sum(r["loss_mask"].sum() for r in rows) == len(held)   # every held-out digit once


def test_sources_give_every_row_the_image_fields():
  c = _config()
  c.data.image_fraction = 0.5
  c.data.seq_len = 128
  config_lib.validate(c)
  src = pipeline.sources(c)
  assert {"validation_digits", "validation_charts"} <= set(src)
  text, image = src["train"][0], src["train"][src["train"].n_text]
  assert set(text) == set(image) and text["patches"].shape == (128, P * P)
  assert not text["patches"].any() and (image["tokens"] == tokenizer.PATCH).any()
  batch = next(iter(pipeline.train_dataset(src["train"], c)))
  assert batch["patches"].shape == (c.data.batch_size, 128, P * P)


@pytest.mark.parametrize("field,value,match", [
    ("data.image_fraction", 0.3, "patch_size is 0"),
    ("model.vocab_size", 259, "image markers"),
    ("model.vision.patch_size", 3, "divisor"),
    ("model.vision.max_cols", 5, "max_rows/max_cols"),
])
def test_bad_multimodal_fields_are_named(field, value, match):
  c = _config()
  c.data.image_fraction = 0.5
  if field == "data.image_fraction":
    c.model.vision.patch_size = 0
  section, *rest = field.split(".")
  target = c[section]
  for part in rest[:-1]:
    target = target[part]
  target[rest[-1]] = value
  with pytest.raises(ValueError, match=match):
    config_lib.validate(c)


@pytest.fixture(scope="module")
def mm_model():
  """fp32 KDA + MLA model with MoE in layer 1 and patch inputs."""
  c = _config(patch_loss_weight=0.5)
  model = HybridMoE(frozen_model_config(c))
  digit = image_tasks.digit_doc(0)
  enc = images.encode([digit.image, digit.prompt + digit.answer], P, 1, eos=True)
  batch = {k: jnp.asarray(v[None]) for k, v in enc.items()}
  batch["segment_ids"] = jnp.ones_like(batch["tokens"])
  variables = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), batch))
  return c, model, variables


def _alone(enc, T):
  n = len(enc["tokens"])
  b = {k: np.pad(v, ((0, T - n),) + ((0, 0),) * (v.ndim - 1)) for k, v in enc.items()}
  b["tokens"][n:] = tokenizer.PAD
  b["segment_ids"] = (np.arange(T) < n).astype(np.int32)
  return {k: jnp.asarray(v[None]) for k, v in b.items()}


def test_packed_image_and_text_documents_match_each_alone(mm_model):
  c, model, variables = mm_model
  chart = image_tasks.chart_doc(np.random.default_rng(5))
  img = images.encode([chart.image, chart.prompt + chart.answer], P, 1, eos=True)
  txt = images.encode(["def f(x):\n  return x + 1\n"], P, 1, eos=True)
  row = image_tasks.pack([(img, np.ones(len(img["tokens"]), bool)),
                          (txt, np.ones(len(txt["tokens"]), bool))], 112, P * P)
  packed = {k: jnp.asarray(row[k][None]) for k in ("tokens", "segment_ids", *images.FIELDS[1:])}
  apply = jax.jit(model.apply)
  logits, _ = apply(variables, packed)
  n_img, n_txt = len(img["tokens"]), len(txt["tokens"])
  alone_img, _ = apply(variables, _alone(img, 112))
  alone_txt, _ = apply(variables, _alone(txt, 112))
  assert rel_err(logits[0, :n_img], alone_img[0, :n_img]) < 1e-5
  assert rel_err(logits[0, n_img:n_img + n_txt], alone_txt[0, :n_txt]) < 1e-5
  # The pixels matter: another image changes the logits after it.
  other = _alone(images.encode([1.0 - chart.image, chart.prompt + chart.answer], P, 1,
                               eos=True), 112)
  assert rel_err(apply(variables, other)[0][0, :n_img], alone_img[0, :n_img]) > 1e-3


def test_decoding_after_an_image_prompt_equals_the_full_forward(mm_model):
  """Prefill BOS + a digit + text in chunks of 8 (the image straddles a chunk edge), then
  feed the rest of the caption one token at a time."""
  c, model, variables = mm_model
  digit = image_tasks.digit_doc(7)
  full_enc = images.encode([digit.image, digit.prompt + digit.answer], P, 1, eos=True)
  T = len(full_enc["tokens"])
  full = _alone(full_enc, T)
  logits_full, _ = jax.jit(model.apply)(variables, full)
  inf = inference_model(model.cfg)
  step = make_step(inf)
  tokens, lengths, fields = encode_prompts(model.cfg, [[digit.image, digit.prompt[:3]]])
  n_prompt = int(lengths[0])
  assert n_prompt > 9 and (tokens[0] == full_enc["tokens"][:n_prompt]).all()
  cache = init_cache(inf.cfg, 1, T)
  last, cache = prefill(step, variables, cache, tokens, lengths, chunk=8, images=fields)
  assert rel_err(last[0], logits_full[0, n_prompt - 1]) < 1e-5
  jstep = jax.jit(step)
  for t in range(n_prompt, T):
    logits, cache = jstep(variables, full_enc["tokens"][None, t:t + 1], np.ones((1, 1), bool),
                          cache)
    assert rel_err(logits[0, 0], logits_full[0, t]) < 1e-5


def test_complete_with_an_image_and_bad_prompts(mm_model):
  c, model, variables = mm_model
  """Greedy completion of an image prompt starts with the full forward's argmax; an image
  too large for the position tables, or one given to a text-only model, is refused."""
  digit = image_tasks.digit_doc(1)
  enc = images.encode([digit.image, " digit: "], P, 1)
  logits, _ = jax.jit(model.apply)(variables, _alone(enc, len(enc["tokens"])))
  first = int(jnp.argmax(logits[0, -1]))
  out = complete(model.cfg, variables, [[digit.image, " digit: "], "x"], max_new=1,
                 key=jax.random.key(0), temperature=0.0, stop_tokens=())
  assert out[0] == tokenizer.decode([first]) and len(out) == 2
  with pytest.raises(ValueError, match="max_rows"):
    complete(model.cfg, variables, [[np.zeros((40, 8)), "x"]], max_new=1, key=jax.random.key(0))
  with pytest.raises(ValueError, match="text-only"):
    encode_prompts(frozen_model_config(make_small_config()), [[np.zeros((8, 8)), "x"]])


def test_patch_loss_and_per_modality_load(mm_model):
  c, model, variables = mm_model
  rows = image_tasks.TrainRows(["digits", "charts"], P, 1, 112, seed=0)
  batch = {k: jnp.asarray(np.stack([rows[i][k] for i in range(2)])) for k in rows[0]}
  # The patch loss: the head's prediction at t against the pixels at t + 1.
  loss_and_grad = jax.jit(jax.value_and_grad(
      lambda p, b: step_lib.loss_fn(p, variables["router"], model.apply, b, 0.5), has_aux=True))
  (total, (nll, aux)), grads = loss_and_grad(variables["params"], batch)
  _, aux_full = jax.jit(model.apply)(variables, batch)
  pred = np.asarray(aux_full["patch_pred"], np.float64)
  nxt = (np.asarray(batch["targets"]) == tokenizer.PATCH)
  target = np.roll(np.asarray(batch["patches"], np.float64), -1, axis=1)
  want = ((pred - target) ** 2).mean(-1)[nxt].mean()
  assert abs(float(aux["patch_loss"]) - want) < 1e-6 * max(want, 1.0)
  penalty = sum(float(s["penalty"]) for s in aux["routing"].values())
  assert abs(float(total) - (float(nll) + penalty + 0.5 * want)) < 1e-5
  assert float(jnp.abs(grads["patch_head"]["kernel"]).sum()) > 0
  assert float(jnp.abs(grads["patch_embed"]["patch_proj"]["kernel"]).sum()) > 0
  # Per-modality load: every image patch and every other live token, k times per MoE layer.
  sums = jax.jit(lambda p, r, b: step_lib.eval_step(p, r, b, apply_fn=model.apply,
                                                    model_cfg=model.cfg))(
      variables["params"], variables["router"], batch)
  k = c.model.moe.top_k
  n_image = int((batch["tokens"] == tokenizer.PATCH).sum())
  n_text = int((batch["segment_ids"] > 0).sum()) - n_image
  assert float(sums["moe/layer_1/image_count"].sum()) == k * n_image
  assert float(sums["moe/layer_1/text_count"].sum()) == k * n_text
  out = step_lib.summarize_eval(jax.device_get(sums))
  assert abs(out["moe/layer_1/load_image"].sum() - 1) < 1e-9
  assert 0.0 <= out["moe/layer_1/modality_tv"] <= 1.0
  assert vision.patch_dim(c.model.vision) == P * P
