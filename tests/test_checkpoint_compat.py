"""A checkpoint written before the package's restructuring (tests/data/pre_move_run: a
2-step run of a micro config with every layer kind, dense and MoE FFNs and scanned periods,
saved at commit de5335f) restores with today's code: the same parameter paths and shapes,
and the same values."""

import json
import os
import shutil

import jax
import numpy as np

from moe_jax.infer import workdir as workdir_lib
from moe_jax.model import layer_stack
from tests.conftest import ROOT

RUN = os.path.join(ROOT, "tests", "data", "pre_move_run")


def test_a_checkpoint_from_before_the_restructuring_restores(tmp_path):
  run = shutil.copytree(RUN, tmp_path / "run")   # orbax may write beside what it reads
  c, variables, step = workdir_lib.load(str(run))
  assert step == 2
  params = layer_stack.stack(c.model, variables["params"])   # the layout the run saved
  with open(os.path.join(RUN, "param_sums.json")) as f:
    want = json.load(f)
  got = {jax.tree_util.keystr(p): (list(np.shape(v)), float(np.asarray(v, np.float64).sum()))
         for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
  assert sorted(got) == sorted(want)
  for path, (shape, total) in want.items():
    assert got[path][0] == shape, path
    np.testing.assert_allclose(got[path][1], total, rtol=1e-6, atol=1e-6, err_msg=path)
