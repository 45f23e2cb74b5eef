"""Text corpora: the embedded Python-stdlib corpus (one document per file, or one per
package) and user globs, split by path hash."""

import glob
import hashlib
import os
import sysconfig


def stdlib_paths() -> list[str]:
  """Every .py file of this interpreter's standard library (present on any machine)."""
  root = sysconfig.get_paths()["stdlib"]
  paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
    paths += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
  return paths


def glob_paths(pattern: str) -> list[str]:
  paths = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True)
                 if os.path.isfile(p))
  if not paths:
    raise ValueError(f"data.paths={pattern!r} matched no files; give a glob of text files")
  return paths


def is_validation(path: str, root: str, val_percent: float) -> bool:
  """Deterministic split: a file is held out iff its relative path hashes below val_percent."""
  return bucket(os.path.relpath(path, root).replace(os.sep, "/")) < val_percent * 100


def split_paths(paths: list[str], val_percent: float) -> dict[str, list[str]]:
  root = os.path.commonpath(paths) if len(paths) > 1 else os.path.dirname(paths[0])
  val = [p for p in paths if is_validation(p, root, val_percent)]
  train = [p for p in paths if not is_validation(p, root, val_percent)]
  if not train or not val:
    raise ValueError(f"data.val_percent={val_percent} leaves an empty split over {len(paths)} "
                     "files; use more files or another val_percent")
  return {"train": train, "validation": val}


def read_documents(paths: list[str]) -> list[bytes]:
  docs = []
  for p in paths:
    with open(p, "rb") as f:
      data = f.read()
    if data:
      docs.append(data)
  return docs


def stdlib_package_documents() -> dict[str, list[str]]:
  """The stdlib as long documents: one per directory (package), its .py files in a stable
  order, `__init__.py` first and then by name, so later files use names the earlier ones
  define. Files directly in the stdlib root stay one document each. Keys are the
  directory's (or root file's) path relative to the stdlib root."""
  root = sysconfig.get_paths()["stdlib"]
  docs: dict[str, list[str]] = {}
  for path in stdlib_paths():
    rel_dir = os.path.relpath(os.path.dirname(path), root)
    key = os.path.relpath(path, root) if rel_dir == "." else rel_dir
    docs.setdefault(key.replace(os.sep, "/"), []).append(path)
  order = lambda p: (os.path.basename(p) != "__init__.py", os.path.basename(p))
  return {k: sorted(v, key=order) for k, v in sorted(docs.items())}


def split_packages(packages: dict[str, list[str]], val_percent: float) -> dict[str, list]:
  """Splits whole packages by the hash of their relative path: no package is in both."""
  val = [ps for k, ps in packages.items() if bucket(k) < val_percent * 100]
  train = [ps for k, ps in packages.items() if bucket(k) >= val_percent * 100]
  if not train or not val:
    raise ValueError(f"data.val_percent={val_percent} leaves an empty split over "
                     f"{len(packages)} packages; use another val_percent")
  return {"train": train, "validation": val}


def bucket(rel: str) -> int:
  """A stable hash of a key into [0, 10000): the splits hold out keys below val_percent·100."""
  return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "little") % 10_000
