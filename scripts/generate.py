"""Complete prompts with a model trained by scripts/train.py (reads <workdir>/config.json and
the latest checkpoint).

  python scripts/generate.py --workdir=workdir/tiny --prompt="def main(" --max_new_tokens=200
  python scripts/generate.py --workdir=workdir/tiny --prompts_file=prompts.txt --temperature=0
  python scripts/generate.py --workdir=workdir/mm --image=digit.png --prompt=" digit: " \
      --max_new_tokens=1 --temperature=0     # a multimodal model (configs/multimodal.py)

With --image (a PNG, or an NPY array in [0, 1]) every prompt is the image followed by the
prompt's text; without a --prompt the image alone.
"""

import jax
from absl import app, flags, logging

from moe_jax.data import images, tokenizers
from moe_jax.infer.generate import complete
from moe_jax.infer.workdir import load
from moe_jax.train import state as state_lib

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir (config.json, checkpoints/).")
_PROMPT = flags.DEFINE_multi_string("prompt", [], "A prompt; repeat the flag for a batch.")
_PROMPTS_FILE = flags.DEFINE_string("prompts_file", None, "One prompt per line.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens to generate per prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = off).")
_TOP_P = flags.DEFINE_float("top_p", 0.95, "Nucleus: keep the smallest set with this mass.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_CHUNK = flags.DEFINE_integer("prefill_chunk", 256, "Prompt tokens per prefill step.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_IMAGE = flags.DEFINE_string("image", None, "A PNG or NPY image that precedes each prompt.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  prompts = list(_PROMPT.value)
  if _PROMPTS_FILE.value:
    with open(_PROMPTS_FILE.value) as f:
      prompts += [line.rstrip("\n") for line in f if line.strip()]
  if not prompts and not _IMAGE.value:
    raise app.UsageError("give --prompt (repeatable), --prompts_file or --image")
  c, variables, step = load(_WORKDIR.value, _STEP.value)
  inputs = prompts
  if _IMAGE.value:
    image = images.load(_IMAGE.value)
    prompts = prompts or [""]
    inputs = [[image, p] for p in prompts]
  outs = complete(state_lib.frozen_model_config(c), variables, inputs,
                  max_new=_MAX_NEW.value, key=jax.random.key(_SEED.value),
                  prefill_chunk=_CHUNK.value, temperature=_TEMPERATURE.value,
                  top_k=_TOP_K.value, top_p=_TOP_P.value, tok=tokenizers.load(c.data.tokenizer))
  print(f"# checkpoint step {step} of {_WORKDIR.value}")
  shown = f"<image {_IMAGE.value}>" if _IMAGE.value else ""
  for prompt, out in zip(prompts, outs):
    print(f"=== {shown}{prompt!r}\n{shown}{prompt}{out}\n")


if __name__ == "__main__":
  flags.mark_flag_as_required("workdir")   # not at import (tests/test_scripts.py)
  app.run(main)
