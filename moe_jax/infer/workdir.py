"""A trained model from its training workdir: config.json and the newest (or a given)
checkpoint, as inference variables."""

import os

import jax
import numpy as np

from configs import workdir as workdir_config
from moe_jax import config as config_lib
from moe_jax.model import layer_stack
from moe_jax.model.transformer import HybridMoE
from moe_jax.train import checkpoint, optim, state as state_lib


def load(workdir: str, step=None):
  """(config, variables {"params", "router"}, step) of a training workdir."""
  c = config_lib.validate(workdir_config.get_config(workdir))
  model = HybridMoE(state_lib.frozen_model_config(c))
  T = c.model.kda_chunk_size
  example = {"tokens": np.zeros((1, T), np.int32), "segment_ids": np.ones((1, T), np.int32)}
  abstract = state_lib.abstract_train_state(
      model, optim.make_optimizer(c), example,
      jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  state, step = checkpoint.restore_state(
      os.path.abspath(os.path.join(workdir, "checkpoints")), abstract, step, c.model)
  # Inference reads layers unscanned (model/layer_stack.py).
  return c, {"params": layer_stack.unstack(c.model, state.params),
             "router": layer_stack.unstack(c.model, state.router)}, step
