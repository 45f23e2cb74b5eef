"""Multi-process (multi-host) runs: jax.distributed, from flags or the environment.

  # two processes on one machine (or one per host, same command with its own --process_id)
  python scripts/train.py ... --coordinator_address=localhost:12355 --num_processes=2 \
      --process_id=0
  python scripts/train.py ... --coordinator_address=localhost:12355 --num_processes=2 \
      --process_id=1

Without the flags, JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID are read;
with neither, a cluster jax detects itself (SLURM, Open MPI, Cloud TPU) is used when
MOE_JAX_DISTRIBUTED=auto, else the run is one process. Every process sees the global mesh
(jax.devices()), loads only its rows of each batch (data/pipeline.py) and joins the orbax
save of each checkpoint in the shared workdir; process 0 alone writes metrics and logs.
"""

import os

import jax


def initialize(coordinator_address: str = "", num_processes: int = 0,
               process_id: int = -1) -> bool:
  """Joins the run's processes; returns whether this is a multi-process run."""
  coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
  num_processes = num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0"))
  if process_id < 0:
    process_id = int(os.environ.get("JAX_PROCESS_ID", "-1"))
  if coordinator_address:
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ValueError(f"a multi-process run needs num_processes >= 1 and 0 <= process_id < "
                       f"num_processes; got num_processes={num_processes}, "
                       f"process_id={process_id}")
    _cpu_collectives()
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
  elif os.environ.get("MOE_JAX_DISTRIBUTED") == "auto":
    _cpu_collectives()
    jax.distributed.initialize()
  return jax.process_count() > 1


def _cpu_collectives():
  """CPU processes exchange data through gloo (the default has no cross-process path); GPU
  and TPU clients ignore the setting."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")


def is_primary() -> bool:
  return jax.process_index() == 0
