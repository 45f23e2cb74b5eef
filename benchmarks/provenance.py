"""Date, commit and machine for a benchmark record.

A device machine gets a copy of the working tree without .git: there the caller passes
the commit in MOE_JAX_COMMIT (e.g. `MOE_JAX_COMMIT=$(git rev-parse --short HEAD)` typed
where the checkout is)."""

import datetime
import os
import subprocess


def commit() -> str:
  """MOE_JAX_COMMIT, else `git rev-parse --short HEAD` (with `+dirty` for uncommitted
  changes to tracked files), else "unknown"."""
  if os.environ.get("MOE_JAX_COMMIT"):
    return os.environ["MOE_JAX_COMMIT"]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    run = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, check=True,
                                    cwd=root).stdout.strip()
    return run("rev-parse", "--short", "HEAD") + ("+dirty" if run("status", "--porcelain",
                                                                   "-uno") else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def today() -> str:
  return datetime.date.today().isoformat()
