"""Every notebook in notebooks/ runs top to bottom (nbclient, a fresh kernel each, on this
machine's backend), and is stored without outputs. Their own cells assert what they show
(a falling loss, balancers beating `none`, kernels matching the recurrence, ...)."""

import glob
import os
import time

import nbformat
import pytest

from tests.conftest import FAST_CPU_COMPILE, ROOT, xla_flags_without

NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
# Notebooks whose time is in running (many steps of several models), not in compiling: their
# kernel gets XLA's optimised CPU code (conftest.FAST_CPU_COMPILE: 160 s against 59 s for 03,
# 51 against 42 s for 01; 05 is the other way, 55 against 64 s).
RUNTIME_BOUND = ("01_quickstart.ipynb", "03_moe_balancing.ipynb")
# The quick one (02) stays in `make test`; the rest are the second tier (`make test-all`).
QUICK = ("02_bounded_decay.ipynb",)
_PARAMS = [pytest.param(p, marks=() if os.path.basename(p) in QUICK else pytest.mark.slow)
           for p in NOTEBOOKS]


def test_the_five_notebooks_are_there_without_outputs():
  names = [os.path.basename(p) for p in NOTEBOOKS]
  assert names == ["01_quickstart.ipynb", "02_bounded_decay.ipynb", "03_moe_balancing.ipynb",
                   "04_long_context.ipynb", "05_attention_residuals.ipynb"]
  for path in NOTEBOOKS:
    for cell in nbformat.read(path, as_version=4).cells:
      if cell.cell_type == "code":
        assert not cell.outputs and cell.execution_count is None, f"{path}: strip outputs"


@pytest.mark.parametrize("path", _PARAMS, ids=os.path.basename)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
  from nbclient import NotebookClient
  if os.path.basename(path) in RUNTIME_BOUND:
    monkeypatch.setenv("XLA_FLAGS", xla_flags_without(*FAST_CPU_COMPILE))
  book = nbformat.read(path, as_version=4)
  start = time.perf_counter()
  os.environ.pop("MPLBACKEND", None)   # the kernel's inline backend turns plots into outputs
  NotebookClient(book, timeout=300, kernel_name="python3",
                 resources={"metadata": {"path": os.path.dirname(path)}}).execute()
  seconds = time.perf_counter() - start
  if os.environ.get("NOTEBOOK_OUT"):   # keep the executed copy (e.g. a GPU run's outputs)
    os.makedirs(os.environ["NOTEBOOK_OUT"], exist_ok=True)
    nbformat.write(book, os.path.join(os.environ["NOTEBOOK_OUT"], os.path.basename(path)))
  images = sum("image/png" in out.get("data", {}) for cell in book.cells
               for out in cell.get("outputs", []))
  assert images >= 1, "a notebook that plots nothing"
  print(f"{os.path.basename(path)}: {seconds:.0f} s, {images} plots")
