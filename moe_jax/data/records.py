"""Corpora stored as records: JSONL, Parquet and ArrayRecord files, by glob.

A record is one document: the `data.text_field` of a JSON line or a Parquet row, or the
UTF-8 bytes of an ArrayRecord record (grain's random-access ArrayRecordDataSource). Records
are split by the hash of "<file relative to the glob's root>#<record index>", so the split
is stable under reordering the files and no record is in both splits.
"""

import json
import os

import grain

from moe_jax.data import corpus

FORMATS = ("jsonl", "parquet", "array_record")


def read_file(fmt: str, path: str, text_field: str) -> list[bytes]:
  """The documents of one file, in file order."""
  if fmt == "jsonl":
    docs = []
    with open(path, "rb") as f:
      for line_no, line in enumerate(f, 1):
        if not line.strip():
          continue
        record = json.loads(line)
        docs.append(_text(record, text_field, f"{path}:{line_no}"))
    return docs
  if fmt == "parquet":
    import pyarrow.parquet as pq
    table = pq.ParquetFile(path).read()
    if text_field not in table.column_names:
      raise ValueError(f"data.text_field={text_field!r} is not a column of {path} (columns: "
                       f"{table.column_names})")
    return [_text({text_field: v}, text_field, f"{path} row {i}")
            for i, v in enumerate(table.column(text_field).to_pylist())]
  if fmt == "array_record":
    source = grain.sources.ArrayRecordDataSource([path])
    return [bytes(source[i]) for i in range(len(source))]
  raise ValueError(f"data.source must be one of {FORMATS} here, got {fmt!r}")


def _text(record: dict, field: str, where: str) -> bytes:
  value = record.get(field) if isinstance(record, dict) else None
  if not isinstance(value, str):
    raise ValueError(f"data.text_field={field!r}: {where} has no string field {field!r} "
                     f"(got {type(value).__name__})")
  return value.encode("utf-8")


def split_records(fmt: str, paths: list[str], text_field: str,
                  val_percent: float) -> dict[str, list[bytes]]:
  """{"train", "validation"}: the documents of every file, split by record key."""
  root = os.path.commonpath(paths) if len(paths) > 1 else os.path.dirname(paths[0])
  out = {"train": [], "validation": []}
  for path in paths:
    rel = os.path.relpath(path, root).replace(os.sep, "/")
    for i, doc in enumerate(read_file(fmt, path, text_field)):
      if doc:
        held_out = corpus.bucket(f"{rel}#{i}") < val_percent * 100
        out["validation" if held_out else "train"].append(doc)
  if not out["train"] or not out["validation"]:
    raise ValueError(f"data.val_percent={val_percent} leaves an empty split over "
                     f"{sum(map(len, out.values()))} records; use more or another val_percent")
  return out


def write(fmt: str, path: str, docs: list[str], text_field: str = "text"):
  """Writes documents in `fmt` (the tests' and notebooks' corpora)."""
  if fmt == "jsonl":
    with open(path, "w") as f:
      f.writelines(json.dumps({text_field: d}) + "\n" for d in docs)
  elif fmt == "parquet":
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({text_field: docs}), path)
  elif fmt == "array_record":
    write_array_record(path, [d.encode("utf-8") for d in docs])
  else:
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


def write_array_record(path: str, records: list[bytes]):
  from array_record.python import array_record_module
  writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
  for r in records:
    writer.write(r)
  writer.close()
