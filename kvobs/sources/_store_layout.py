"""Where the embedded store keeps what (kvobs.sources.store describes the layout), shared
by its writer and its turn reader."""

from __future__ import annotations

import os

import pyarrow as pa

from kvobs import semconv as sc
from kvobs.sources._frame import frame_from_rows

COMPACTED_DIR = sc.STORE_COMPACTED_DIR
TURNS_DIR = sc.STORE_TURNS_DIR


def store_schema() -> pa.Schema:
    """The Arrow schema of compacted segments (the span table's columns and types)."""
    return pa.Schema.from_pandas(frame_from_rows([]), preserve_index=False)


def turns_path(store_dir: str, span_file: str) -> str:
    """The turn file of a compacted span file (it may not exist: older stores)."""
    bucket = os.path.basename(os.path.dirname(span_file))
    return os.path.join(store_dir, TURNS_DIR, bucket, os.path.basename(span_file))


def span_files(store_dir: str) -> list[str]:
    compacted = os.path.join(store_dir, COMPACTED_DIR)
    if not os.path.isdir(compacted):
        return []
    return sorted(os.path.join(compacted, bucket, name)
                  for bucket in os.listdir(compacted) if bucket.startswith("bucket=")
                  for name in os.listdir(os.path.join(compacted, bucket))
                  if name.endswith(".parquet"))
