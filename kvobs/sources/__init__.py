"""Span sources: one small interface, backends chosen once by ``open_source``.

Every source returns spans as a pandas DataFrame with the columns ``SPAN_COLUMNS`` plus
one column per known attribute key (``semconv.ATTRIBUTES``); unknown attributes are
dropped, absent ones are null; ``span_table()`` gives them as Arrow (what diagnose
reads: span files and the store's live segments through ``_frame.table_from_rows``, its
compacted spans from parquet, neither through pandas). ``turn_row_slices()`` gives the
fleet's turn rows (``kvobs.turns.correlate.aggregate`` over every span, before ``derive``), each
backend the way it does best: the store from its turn files, ClickHouse in SQL. Problems met while
reading (corrupt lines, unreadable files) are collected in ``problems`` as
``file:line: reason`` and never stop the read.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterator, Protocol

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

from kvobs.sources._errors import SourceError
from kvobs.sources._frame import empty_spans
from kvobs.sources._rows import SPAN_COLUMNS

__all__ = ["SpanSource", "SourceError", "open_source", "SOURCE_HELP", "SPAN_COLUMNS", "empty_spans"]


class SpanSource(Protocol):
    problems: list[str]

    def spans(self, conversation_id: str | None = None) -> pd.DataFrame:
        """All spans, or those of one conversation (including their traces' spans)."""

    def span_table(self, conversation_id: str | None = None) -> pa.Table:
        """``spans`` as an Arrow table (its columns; types may differ): what diagnose
        reads, so that one conversation never needs pandas where the source can help it
        (span files and the store build it in Arrow; ``spans`` derives from it)."""

    def turn_row_slices(self) -> Iterator[pa.Table]:
        """The fleet's turn rows, one Arrow row per (tenant, conversation_id, turn) with
        the columns of ``kvobs.turns.schema.FLEET_COLUMNS`` (``correlate.aggregate``), in
        slices: each conversation whole in one slice, rows in any order
        (``correlate.derive`` links each turn to its previous one by key; sorting a
        fleet's rows costs more than reading them). A source slices as its storage
        allows (ClickHouse's turn view by ranges of conversation ids), so that a
        fleet's rows need never all be in memory at once."""

    def conversation_ids(self) -> list[str]:
        """Every conversation id the source knows."""


CLICKHOUSE_SCHEMES = ("clickhouse://", "clickhouses://", "chdb:")
TRACE_API_SCHEMES = ("tempo+http://", "tempo+https://", "jaeger+http://", "jaeger+https://")
SOURCE_HELP = (
    "Span source: a kvobs store directory; span file(s) or a directory of them "
    "(OTLP JSON lines or document, OTLP protobuf, the Collector file exporter's "
    "output, Tempo or Jaeger trace JSON; gzip/zstd; the format read from the "
    "content); clickhouse://[USER:PASSWORD@]HOST:8123/DB[?table=otel_traces]; "
    "chdb:PATH[?table=T]; tempo+http://[USER:PASSWORD@]HOST:3200"
    "[?trace=ID|since=1h&q=TRACEQL][&tenant=T][&timeout=60]; "
    "jaeger+http://[USER:PASSWORD@]HOST:16686[?trace=ID|since=1h&service=S] "
    "(docs/sources.md)."
)


def open_source(location: str) -> SpanSource:
    """Every command's ``--source`` (``SOURCE_HELP``): ClickHouse by URL (HTTP interface)
    or ``chdb:PATH`` (embedded ClickHouse), Tempo or Jaeger by URL (their HTTP query
    APIs), a store directory (has ``spans/`` or ``compacted/``), else span file(s)."""
    from kvobs.sources.otlp_json import OtlpJsonSource
    from kvobs.sources.store import StoreSource, is_store

    if location.startswith(CLICKHOUSE_SCHEMES):
        from kvobs.sources.clickhouse import ClickHouseSource

        try:
            source = ClickHouseSource.from_url(location)
        except ImportError as error:  # chdb not installed
            raise SourceError(f"{location}: {error}") from error
        source.check()
        return source
    if location.startswith(TRACE_API_SCHEMES):
        from kvobs.sources.trace_api import TraceApiSource

        trace_api = TraceApiSource(location)
        trace_api.check()
        return trace_api
    if not os.path.exists(location):
        raise SourceError(f"source not found: {location}")
    if os.path.isdir(location) and is_store(location):
        return StoreSource(location)
    return OtlpJsonSource(location)
