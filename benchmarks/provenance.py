"""Date, commit and machine for a benchmark record.

A device machine gets a copy of the working tree whose .git, where it has one, need not be
the checkout's (one reported an earlier HEAD, +dirty, for a later tree): there the caller
passes the commit in MOE_JAX_COMMIT (e.g. `MOE_JAX_COMMIT=$(git rev-parse --short HEAD)`
typed where the checkout is)."""

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


def stamp(machine: str = "") -> dict:
  """{"date", "commit", "machine"}; machine defaults to JAX's first device's kind."""
  if not machine:
    import jax
    machine = jax.devices()[0].device_kind
  return {"date": today(), "commit": commit(), "machine": machine}


def merge_rows(json_path: str, new: list[dict], key) -> list[dict]:
  """Writes json_path's rows with those whose key(row) a new row has replaced by the new
  ones (a record keeps what this run did not measure again); returns all rows."""
  import json
  old = json.load(open(json_path)) if os.path.exists(json_path) else []
  done = {key(r) for r in new}
  rows = [r for r in old if key(r) not in done] + new
  os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
  with open(json_path, "w") as f:
    json.dump(rows, f, indent=1)
  return rows
