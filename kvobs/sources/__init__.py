"""Span sources: one small interface, backends chosen once by ``open_source``.

Every source returns spans as a pandas DataFrame with the columns ``SPAN_COLUMNS`` plus
one column per known attribute key (``semconv.ATTRIBUTES``); unknown attributes are
dropped, absent ones are null. Problems met while reading (corrupt lines, unreadable
files) are collected in ``problems`` as ``file:line: reason`` and never stop the read.
"""

from __future__ import annotations

import os
from typing import Protocol

import pandas as pd

from kvobs.sources._frame import SPAN_COLUMNS, empty_spans

__all__ = ["SpanSource", "SourceError", "open_source", "SPAN_COLUMNS", "empty_spans"]


class SourceError(Exception):
    """The source cannot be read at all (missing path, unknown format)."""


class SpanSource(Protocol):
    problems: list[str]

    def spans(self, conversation_id: str | None = None) -> pd.DataFrame:
        """All spans, or those of one conversation (including their traces' spans)."""

    def conversation_ids(self) -> list[str]:
        """Every conversation id the source knows."""


def open_source(location: str) -> SpanSource:
    """A store directory (has ``spans/`` or ``compacted/``), else OTLP-JSON file(s)."""
    from kvobs.sources.otlp_json import OtlpJsonSource
    from kvobs.sources.store import StoreSource, is_store

    if not os.path.exists(location):
        raise SourceError(f"source not found: {location}")
    if os.path.isdir(location) and is_store(location):
        return StoreSource(location)
    return OtlpJsonSource(location)
