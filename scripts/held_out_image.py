"""Write one held-out image of an image task as a PNG (or NPY) and print its prompt and answer:
the input for `scripts/generate.py --image=`.

  python scripts/held_out_image.py --task=digits --index=3 --out=/tmp/digit.png
"""

import numpy as np
from absl import app, flags

from moe_jax.data import image_tasks, images

_TASK = flags.DEFINE_enum("task", "digits", image_tasks.TASKS, "Image task.")
_INDEX = flags.DEFINE_integer("index", 0, "Document index within the held-out split.")
_OUT = flags.DEFINE_string("out", None, "Path ending in .png or .npy.")


def main(argv):
  del argv
  doc = image_tasks.draw(_TASK.value, "eval", 0, _INDEX.value)
  if _OUT.value.endswith(".npy"):
    np.save(_OUT.value, doc.image)
  else:
    images.save_png(doc.image, _OUT.value)
  print(f"wrote {_OUT.value} ({doc.image.shape[0]}×{doc.image.shape[1]}); prompt "
        f"{doc.prompt!r}, answer {doc.answer!r}")


if __name__ == "__main__":
  flags.mark_flag_as_required("out")   # not at import (tests/test_scripts.py)
  app.run(main)
