"""Preemption: SIGTERM asks the loop to checkpoint at the next step boundary and stop.

Cloud TPUs and GPUs send SIGTERM some seconds before they reclaim a machine. With one
process a handler sets a flag. With several, each process would see the signal at a
different step, so they agree through orbax's `reached_preemption` (jax's preemption
sync point, which needs `jax.distributed.initialize`) instead.
"""

import signal
import threading

import jax


class Preemption:
  """Context manager around the training loop; `requested(step, manager)` at each boundary."""

  def __init__(self):
    self.signalled = False
    self._previous = None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():  # handlers live there only
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
    return self

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)

  def _on_sigterm(self, signum, frame):
    del signum, frame
    self.signalled = True

  def requested(self, step: int, manager) -> bool:
    if jax.process_count() > 1:
      return manager.reached_preemption(step)
    return self.signalled
