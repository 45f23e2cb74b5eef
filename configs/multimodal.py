"""Early-fusion multimodal training (model/vision.py, data/image_tasks.py): image patches
and text in one stream, through the same mixers and experts.

  python scripts/train.py --config=configs/multimodal.py:cpu --workdir=workdir/mm
  python scripts/train.py --config=configs/multimodal.py:text_control --workdir=workdir/mm_text
  python scripts/generate.py --workdir=workdir/mm --image=digit.png --prompt=" digit: " \
      --max_new_tokens=1 --temperature=0

  cpu           the tiny model on stdlib text mixed with digit captions and chart QA
                (data.image_fraction of the rows), 2-core CPU, < 10 min
  text_control  the same model and text rows, no images: the text-only run with the same
                text tokens (steps × (1 − image_fraction)), for the text bits/byte check
"""

from configs import tiny

ARGS = ("cpu", "text_control")
IMAGE_FRACTION = 0.5
STEPS = 400   # held-out digits: 0.917 at 300 steps, 0.961 at 500 (benchmarks/multimodal.md)


def get_config(arg=None):
  if arg not in ARGS:
    raise ValueError(f"configs/multimodal.py arg must be one of {ARGS}; got {arg!r}")
  c = tiny.get_config()
  m = c.model
  m.vocab_size = 263            # bytes, BOS/EOS/PAD, then <image> </image> <row> <patch>
  m.vision.patch_size = 4       # digits 8×8 → 2×2 patches; charts 16×24 → 4×6
  m.vision.max_rows = 8
  m.vision.max_cols = 8
  c.data.image_fraction = IMAGE_FRACTION
  c.data.image_tasks = "digits,charts"
  c.schedule.total_steps = STEPS
  c.eval.every_steps = 100       # the held-out accuracy curve (≈ 10 s per evaluation)
  c.checkpoint.every_steps = 100
  if arg == "text_control":
    c.data.image_fraction = 0.0
    c.schedule.total_steps = round(STEPS * (1 - IMAGE_FRACTION))
    c.eval.every_steps = c.checkpoint.every_steps = 50
  return c
