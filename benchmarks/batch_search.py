"""The largest batch that fits: doubling, then bisection on out-of-memory errors."""


def is_oom(e: Exception) -> bool:
  text = str(e).lower()
  return "resource_exhausted" in text or "out of memory" in text


def search_batches(measure, max_batch: int, resolution: int = 1, start: int = 1) -> list[dict]:
  """measure(batch) → row, or raises an out-of-memory error. Doubles from `start` until one
  does not fit (or max_batch), then bisects between the largest that fit and the smallest that
  did not until they are `resolution` apart. Rows in the order tried, a batch that did not
  fit as {"batch": b, "oom": True}."""
  rows, fit, fail = [], 0, None

  def attempt(b):
    nonlocal fit, fail
    try:
      rows.append({**measure(b), "batch": b, "oom": False})
      fit = max(fit, b)
    except Exception as e:  # noqa: BLE001 — anything else is a real error
      if not is_oom(e):
        raise
      rows.append({"batch": b, "oom": True})
      fail = b if fail is None else min(fail, b)

  b = start
  while fail is None and b <= max_batch:
    attempt(b)
    b *= 2
  while fail is not None and fail - fit > max(resolution, 1):
    attempt((fit + fail) // 2)
  return rows
