"""Staged context extension (scripts/extend_context.py, moe_jax/train/stages.py).

  :cpu  the tiny model on package-length stdlib documents with 20% passkey and MQAR rows,
        128 → 512 → 1K at 2048 tokens per step, then the control run straight at 1K and
        the evals to 8× (the 2-core CPU, under 10 min in all)
  :h200 a 0.18 B-active hybrid MoE (configs/long_context_1b.py cut to 12 layers, with 32
        shared key dims in MLA so that its RoPE control has the same parameters), pretrained
        at 2K on stdlib documents with 80% passkey and MQAR rows, then 8K and 32K, at 64K
        tokens a step on one GPU; evals at 1×, 2×, 4× and 8× of 32K with passkey at five
        depths. On an H100 the stages take about 10 minutes, the direct control about 11
        (94K tokens/s at 32K) and a run's evals about 7 with 16 rows per task at 32K and 8
        at 64K–256K (benchmarks/context_extension.md). The checkpoints (10 GB) stay on the
        machine's disk, so a run's jobs go back to back on one machine; rerun, it resumes where it
        stopped, the evals too (by length). --nocontrol trains the stages alone,
        --nostaged the direct control alone. The controls:
          --config.run.model.mla_rope_theta=10000.0   RoPE on those dims (run `rope`)
          --config.run.seed=1 --config.run.data.shuffle_seed=1   the second seed
        and `python -m benchmarks.context_gpu` gathers the runs' results into
        benchmarks/context_gpu.{json,md}.
  :1b   configs/long_context_1b.py, 8K → 64K → 256K → 1M (the method's layout; GPUs)

  python scripts/extend_context.py --config=configs/stages.py:cpu --workdir=workdir/stages
  python scripts/extend_context.py --config=configs/stages.py:cpu --workdir=... \
      --config.stages.s512.steps=100 --config.carry_optimizer=False

Each stage: seq_len, steps, tokens_per_step (the batch is tokens_per_step / seq_len, so
it shrinks as the length grows), its own schedule (re-warmup, then cosine decay to
final_lr_fraction) and optional overrides: kda_chunk_size and mesh_sequence (0 = keep),
remat (None = keep), remat_policy ("" = keep).
"""

import ml_collections

from configs import long_context_1b, tiny


def _stage(seq_len, steps, tokens_per_step, learning_rate, warmup_steps, *,
           final_lr_fraction=0.1, kda_chunk_size=0, mesh_sequence=0, remat=None,
           remat_policy=""):
  return ml_collections.ConfigDict({
      "seq_len": seq_len, "steps": steps, "tokens_per_step": tokens_per_step,
      "learning_rate": learning_rate, "warmup_steps": warmup_steps,
      "final_lr_fraction": final_lr_fraction, "kda_chunk_size": kda_chunk_size,
      "mesh_sequence": mesh_sequence, "remat_policy": remat_policy,
      "remat": ml_collections.FieldReference(remat, field_type=bool)})


def _retrieval_mix(run, fraction, every_steps):
  """Package-length stdlib documents with this share of passkey and MQAR rows; evals and
  checkpoints every `every_steps`."""
  run.data.source = "stdlib_packages"
  run.data.synthetic_fraction = fraction
  run.data.synthetic_tasks = "passkey,mqar"
  run.eval.every_steps = every_steps
  run.eval.num_batches = 4
  run.checkpoint.every_steps = every_steps
  return run


def get_config(arg="cpu"):
  sc = ml_collections.ConfigDict()
  sc.carry_optimizer = True     # Adam moments carried over a stage boundary (stages.py says why)
  sc.stages = ml_collections.ConfigDict()
  ev = sc.eval = ml_collections.ConfigDict()
  ev.multipliers = "0.5,1,2,4,8"  # eval lengths, × the last stage's seq_len
  ev.buckets = 8                # position buckets of the loss-by-position table
  ev.max_windows = 2            # held-out document windows per length
  ev.retrieval_rows = 8         # passkey and MQAR rows per length
  ev.retrieval_rows_at_trained = 0   # rows at 1× the final length instead; 0 = retrieval_rows
  ev.chunk = 1024               # the eval runs the inference path in chunks of this
  ev.entropy_queries = 128      # MLA attention entropy over the last this many positions
  ev.passkey_depths = ""        # comma-separated key depths in [0, 1] with their own passkey
                                # accuracy (besides the random-depth one); "" = none

  if arg == "cpu":
    run = _retrieval_mix(tiny.get_config(), 0.2, 100)
    run.checkpoint.every_steps = 50
    sc.stages.s128 = _stage(128, 160, 2048, 3e-3, 20)
    sc.stages.s512 = _stage(512, 40, 2048, 1.5e-3, 10)
    sc.stages.s1k = _stage(1024, 24, 2048, 1e-3, 5)
    sc.stage_names = "s128,s512,s1k"
    ev.chunk = 512
  elif arg == "h200":
    # 80% of the rows passkey and MQAR (40% each): retrieval appears only past a few
    # thousand passkey rows (benchmarks/context_extension.md, 2026-12-05: the tiny model
    # learned none from 4800, all from 7700), so 2K holds 6400 (3200 at 50%).
    # Scanned, as its seeds ran (context_gpu.json): the controls compare like with like.
    run = _retrieval_mix(long_context_1b.get_config("scanned"), 0.8, 200)
    run.model.n_layers = 12
    run.model.mla_qk_rope_dim = 32
    # One checkpoint per stage: each is 10 GB (fp32 params and Adam moments of 0.85 B), and
    # three stages, the control and orbax's next save fit a 64 GB disk only at one each.
    run.checkpoint.max_to_keep = 1
    # 64K tokens a step at 2K and 32K: XLA plans the step for more than JAX's default 75%.
    run.train.memory_fraction = 0.95
    # Each longer stage sees enough passkey rows at its own length to keep retrieval there
    # (the tiny model in the same proportions: 72 rows at its last length gave 0.56, 216
    # gave 1.00; context_extension.md): 576 at 8K, 192 at 32K. 60 M tokens a run (33 M at
    # 2K, 12 M at 8K, 16 M at 32K) and as many in its direct control.
    # From 8K on, the scanned layers keep only their inputs ("full"): with the default
    # policy the 8K step asked for a 47 GiB buffer and ran out of an H100's 80 GB
    # (benchmarks/context_extension.md); the maths is the same.
    sc.stages.s2k = _stage(2048, 500, 65536, 6e-4, 40)
    sc.stages.s8k = _stage(8192, 180, 65536, 3e-4, 18, remat_policy="full")
    sc.stages.s32k = _stage(32768, 240, 65536, 2e-4, 24, remat_policy="full")
    sc.stage_names = "s2k,s8k,s32k"
    ev.multipliers = "1,2,4,8"
    ev.max_windows = 4
    # 16 rows per task and depth at the trained length, where the goal is judged, 8 beyond,
    # so that a whole run (stages or control, then its evals) takes about 22 minutes on one
    # H100. With 16 everywhere the evals took 546 s there (55, 52, 114 and 328 s at 32K to
    # 256K; 8× is attention-bound); with 16 and 8, 73, 72, 106 and 153 s
    # (benchmarks/context_extension.md, 2026-12-07).
    ev.retrieval_rows = 8
    ev.retrieval_rows_at_trained = 16
    ev.chunk = 8192
    ev.passkey_depths = "0,0.25,0.5,0.75,1"
  elif arg == "1b":
    run = _retrieval_mix(long_context_1b.get_config(), 0.1, 200)
    sc.stages.s8k = _stage(8192, 2000, 262144, 3e-4, 200)
    sc.stages.s64k = _stage(65536, 500, 262144, 1.5e-4, 50, remat=True)
    sc.stages.s256k = _stage(262144, 200, 524288, 1e-4, 20, remat=True)
    sc.stages.s1m = _stage(1048576, 100, 1048576, 5e-5, 10, mesh_sequence=8, remat=True)
    sc.stage_names = "s8k,s64k,s256k,s1m"
    ev.chunk = 8192
  else:
    raise ValueError(f"configs/stages.py arg must be one of 'cpu', 'h200', '1b'; got {arg!r}")
  sc.run = run
  return sc
