"""Config loading, command-line overrides, and every validation error."""

import pytest
from absl import flags
from ml_collections import config_flags

from configs import base, kimi_linear_48b, long_context_1b, tiny, trillion
from moe_jax import config as config_lib
from moe_jax.train.loop import train_and_evaluate
from tests.conftest import ROOT


def test_configs_load_and_validate():
  for c in (base.get_config(), tiny.get_config(), tiny.get_config("mqar"),
            kimi_linear_48b.get_config(), kimi_linear_48b.get_config("h200_slice"),
            trillion.get_config(),
            long_context_1b.get_config(), long_context_1b.get_config("all_mla"),
            long_context_1b.get_config("scanned")):
    assert config_lib.validate(c) is c
  # the trained default unrolls the layers; "scanned" is the layout single_h200 was timed with
  assert not long_context_1b.get_config().model.scan_layers
  assert long_context_1b.get_config("scanned").model.scan_layers
  with pytest.raises(ValueError, match=r"long_context_1b.py arg must be '', 'all_mla' or "
                     r"'scanned'; got 'scan'"):
    long_context_1b.get_config("scan")
  assert tiny.get_config("mqar").data.source == "mqar"
  with pytest.raises(ValueError, match="configs/tiny.py arg"):
    tiny.get_config("nope")
  with pytest.raises(ValueError, match=r"kimi_linear_48b.py arg must be one of .*'h200_sliced'"):
    kimi_linear_48b.get_config("h200_sliced")


def test_command_line_overrides(monkeypatch):
  argv = ["prog", f"--config={ROOT}/configs/tiny.py", "--config.model.d_model=512",
          "--config.model.layer_pattern=KA", "--config.data.paths=/x/*.txt"]
  monkeypatch.setattr("sys.argv", argv)  # config_flags reads overrides from sys.argv
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv)
  fv(argv)
  c = fv.config
  assert (c.model.d_model, c.model.layer_pattern, c.data.paths) == (512, "KA", "/x/*.txt")
  assert c.model.n_layers == tiny.get_config().model.n_layers  # untouched fields keep defaults


@pytest.mark.parametrize("field,value,match", [
    ("model.n_heads", 3, r"model\.n_heads must be a divisor of model\.d_model=128, got 3"),
    ("model.layer_pattern", "KKXA", r"model\.layer_pattern must be a non-empty string of letters "
                                    r"K \(KDA.*got 'KKXA'"),
    ("model.layer_pattern", "", r"model\.layer_pattern .* got ''"),
    ("model.kda_lower_bound", -8.0, r"model\.kda_lower_bound must be in \[-5, 0\).*got -8\.0"),
    ("model.kda_lower_bound", 0.0, r"model\.kda_lower_bound must be in \[-5, 0\).*got 0\.0"),
    ("data.seq_len", 100, r"data\.seq_len must be a multiple of model\.kda_chunk_size \* "
                          r"mesh\.sequence = 16.*got 100"),
    ("model.kda_chunk_size", 24, r"model\.kda_chunk_size must be one of \(16, 32, 64, 128\), got 24"),
    ("model.decode_matmul", "cublas", r"model\.decode_matmul must be one of "),
    ("model.fused_projections", None, r"model\.fused_projections must be True or False, "
                                      r"got None"),
    ("model.mla_implementation", "flash", r"model\.mla_implementation must be one of "
                                          r"\('', 'xla', 'gpu', 'cudnn', 'tpu'\), got 'flash'"),
    ("model.dtype", "float16", r"model\.dtype must be one of .*got 'float16'"),
    ("model.mla_rope_theta", -1.0, r"model\.mla_rope_theta must be 0 \(NoPE\) or a positive "
                                   r"RoPE base .*got -1\.0"),
    ("model.mla_rope_theta", 10000.0, r"model\.mla_qk_rope_dim must be a positive even number "
                                      r"of dims for RoPE .*got 0"),
    ("data.source", "web", r"data\.source must be one of .*got 'web'"),
    ("schedule.warmup_steps", 10_000, r"schedule\.warmup_steps must be in \[0, "),
    ("mesh.data", 0, r"mesh\.data must be a positive integer or -1 \(all remaining devices\), got 0"),
    ("model.moe.top_k", 9, r"model\.moe\.top_k must be at most model\.moe\.num_experts=8, got 9"),
    ("model.moe.num_experts", -1, r"model\.moe\.num_experts must be 0 \(dense FFN\) or a "
                                  r"positive integer, got -1"),
    ("model.moe.balancer", "switch", r"model\.moe\.balancer must be one of \('none', "
                                     r"'aux_loss', 'loss_free', 'quantile_ema', "
                                     r"'quantile_exact'\), got 'switch'"),
    ("model.moe.dispatch", "ragged", r"model\.moe\.dispatch must be one of .*got 'ragged'"),
    ("model.moe.capacity_factor", 0.0, r"model\.moe\.capacity_factor must be > 0, got 0\.0"),
    ("model.moe.exact_damping", 1.5, r"model\.moe\.exact_damping must be in \(0, 1\], got 1\.5"),
    ("model.moe.grouped_matmul", "cutlass", r"model\.moe\.grouped_matmul must be one of "),
    ("model.remat_expert_rows", None, r"model\.remat_expert_rows must be True or False, "
                                       r"got None"),
    ("model.moe.swiglu_grad_in_kernel", None, r"model\.moe\.swiglu_grad_in_kernel must be "
                                              r"True or False, got None"),
    ("model.moe.weights_before_down", None, r"model\.moe\.weights_before_down must be True or "
                                            r"False, got None"),
    ("model.moe.decode_dispatch", "dense", r"model\.moe\.decode_dispatch must be one of "),
    ("mesh.expert", 3, r"mesh\.expert must be a divisor of model\.moe\.num_experts=8, got 3"),
    ("optim.router_grad_clip_norm", -1.0, r"optim\.router_grad_clip_norm must be >= 0"),
    ("model.moe.latent_dim", -4, r"model\.moe\.latent_dim must be 0 \(off\) or a positive "),
    ("optim.router_clip_params", "router", r"optim\.router_clip_params must be comma-separated "
                                           r"names from .*got 'router'"),
    ("model.moe.init_reg_params", "router_kernel,latent_down",
     r"model\.moe\.init_reg_params must be free of .* while model\.moe\.latent_dim is 0"),
    ("train.guard.spike_factor", 0.5, r"train\.guard\.spike_factor must be > 1, got 0\.5"),
    ("train.guard.ema_steps", 0, r"train\.guard\.ema_steps must be a positive integer, got 0"),
    ("model.moe.router_dtype", "float16", r"model\.moe\.router_dtype must be one of "
                                          r"\('', 'float32', 'bfloat16'\), got 'float16'"),
    ("train.guard.max_rollbacks", -1, r"train\.guard\.max_rollbacks must be a non-negative "),
    ("data.read_threads", -1, r"data\.read_threads must be a non-negative integer, got -1"),
    ("train.memory_fraction", 1.5, r"train\.memory_fraction must be a number in \[0, 1\] .*"
                                   r"got 1\.5"),
    ("data.prefetch_batches", -2, r"data\.prefetch_batches must be a non-negative integer, "
                                  r"got -2"),
])
def test_invalid_fields_raise_naming_field_value_and_accepted(field, value, match):
  c = tiny.get_config()
  *sections, name = field.split(".")
  node = c
  for section in sections:
    node = node[section]
  node[name] = value
  with pytest.raises(ValueError, match=match):
    config_lib.validate(c)


def test_weights_before_down_only_where_it_applies():
  c = tiny.get_config()
  c.model.moe.weights_before_down = c.model.moe.swiglu_grad_in_kernel = True
  config_lib.validate(c)     # the fused gradient kernel takes the weights too
  c.model.moe.dispatch = "capacity"
  with pytest.raises(ValueError, match=r"model\.moe\.weights_before_down must be False unless "
                                       r"model\.moe\.dispatch is 'dropless' on one expert "
                                       r"shard \(mesh\.expert 1\); got dispatch 'capacity', "
                                       r"mesh\.expert 1"):
    config_lib.validate(c)


def test_sequence_shards_must_fit_ring_sub_blocks():
  c = tiny.get_config()
  c.mesh.sequence, c.mesh.data = 2, 1
  c.data.seq_len = 2 * 2080  # 2080 per shard: over 2048 and not a multiple of 512
  with pytest.raises(ValueError, match=r"data\.seq_len must be such that seq_len / "
                                       r"mesh\.sequence \(2080\) is at most 2048 or a multiple "
                                       r"of 512"):
    config_lib.validate(c)
  for ok in (1568, 2560):   # a whole sub-block, and five of 512
    c.data.seq_len = 2 * ok
    config_lib.validate(c)


def test_files_source_needs_paths():
  c = tiny.get_config()
  c.data.source = "files"
  with pytest.raises(ValueError, match=r"data\.paths must be a glob"):
    config_lib.validate(c)


def test_legacy_gate_is_accepted():
  c = tiny.get_config()
  c.model.kda_lower_bound = None
  config_lib.validate(c)


def test_invalid_config_fails_before_any_work(tmp_path):
  """Validation runs first: no data is read, nothing compiles, the workdir is not created."""
  c = tiny.get_config()
  c.model.n_heads = 5
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match="model.n_heads"):
    train_and_evaluate(c, str(workdir), progress=False)
  assert not workdir.exists()
