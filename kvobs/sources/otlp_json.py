"""Span files: what the OpenTelemetry Collector's file exporter writes (JSON lines or
length-prefixed protobuf, zstd-compressed or not, rotated), one OTLP JSON or protobuf
document, gzip'd copies, Tempo's and Jaeger's trace JSON; a file or a directory of them.
The format is found from each file's content (``_decode``), never from its name.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterator

import pyarrow as pa

from kvobs import semconv as sc
from kvobs.turns.correlate import turn_rows
from kvobs.sources._decode import bounded_problems, documents, is_regular
from kvobs.sources._frame import (
    drop_duplicate_span_rows,
    frame_from_table,
    select_conversation,
    table_from_rows,
)
from kvobs.sources._rows import rows, spans_from_request

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["DocumentSource", "OtlpJsonSource", "otlp_files", "read_rows", "spans_from_request"]


def otlp_files(location: str, problems: list[str] | None = None) -> list[str]:
    """Every regular file of a directory (or the file itself), whatever its name: the
    file exporter's rotated files have none of ours. A FIFO or socket would block every
    read: skipped, reported (``is_regular``), given alone too. Hidden files (editors'
    swap files) are left alone."""
    if not os.path.isdir(location):
        return [location] if is_regular(location, problems) else []
    found = []
    for root, dirs, files in os.walk(location):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            path = os.path.join(root, name)
            if not name.startswith(".") and is_regular(path, problems):
                found.append(path)
    return sorted(found)


def read_rows(path: str, problems: list[str]) -> Iterator[dict]:
    """Rows of one file; what cannot be read is reported and skipped, in at most
    ``MAX_PROBLEMS_PER_FILE`` warnings (``bounded_problems``)."""
    with bounded_problems(problems, path) as found:
        for where, document in documents(path, found):
            yield from rows(where, document, found)


class DocumentSource:
    """A ``SpanSource`` over trace documents read whole into memory (small to medium
    sets): subclasses say where the documents come from (``_rows``)."""

    location: str

    def __init__(self) -> None:
        self.problems: list[str] = []
        self._table: pa.Table | None = None

    def _rows(self) -> Iterator[dict]:
        raise NotImplementedError

    def _all(self) -> pa.Table:
        if self._table is None:
            self._table = drop_duplicate_span_rows(table_from_rows(self._rows()), self.problems)
        return self._table

    def spans(self, conversation_id: str | None = None) -> pd.DataFrame:
        return frame_from_table(self.span_table(conversation_id))

    def span_table(self, conversation_id: str | None = None) -> pa.Table:
        table = self._all()
        return table if conversation_id is None else select_conversation(table, conversation_id)

    def turn_row_slices(self) -> Iterator[pa.Table]:
        yield turn_rows(self._all())  # spans already in memory: one slice

    def conversation_ids(self) -> list[str]:
        return sorted(self._all().column(sc.CONVERSATION_ID.key).unique().drop_null().to_pylist())


class OtlpJsonSource(DocumentSource):
    """Spans from span files (``otlp_files``): a file or a directory."""

    def __init__(self, location: str):
        super().__init__()
        self.location = location

    def _rows(self) -> Iterator[dict]:
        for path in otlp_files(self.location, self.problems):
            yield from read_rows(path, self.problems)
