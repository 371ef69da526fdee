"""Reader for OTLP-JSON lines (OTel Collector file exporter), a file or a directory."""

from __future__ import annotations

import json
import os
from typing import Iterator

import pandas as pd

from kvobs import semconv as sc
from kvobs.sources._frame import drop_duplicate_spans, frame_from_rows, select_conversation

_VALUE_KEYS = ("stringValue", "intValue", "doubleValue", "boolValue")
_ERROR_STATUS = 2  # STATUS_CODE_ERROR


def _value(any_value: dict):
    for key in _VALUE_KEYS:
        if key in any_value:
            return any_value[key]
    return None


def _attributes(items) -> dict:
    return {item["key"]: _value(item.get("value", {})) for item in items or ()}


def spans_from_request(request: dict) -> Iterator[dict]:
    """Flatten one ``{"resourceSpans": ...}`` object into span rows (known keys only)."""
    for resource_spans in request.get("resourceSpans") or ():
        resource = _attributes((resource_spans.get("resource") or {}).get("attributes"))
        service = resource.get("service.name")
        for scope_spans in resource_spans.get("scopeSpans") or ():
            for span in scope_spans.get("spans") or ():
                row = {key: value for key, value in _attributes(span.get("attributes")).items()
                       if key in sc.ATTRIBUTES}
                row.update(
                    trace_id=span.get("traceId"), span_id=span.get("spanId"),
                    parent_span_id=span.get("parentSpanId") or None, name=span.get("name"),
                    service=service, start_ns=span.get("startTimeUnixNano"),
                    end_ns=span.get("endTimeUnixNano"),
                    error=(span.get("status") or {}).get("code") in (_ERROR_STATUS,
                                                                     "STATUS_CODE_ERROR"))
                yield row


def otlp_files(location: str, problems: list[str] | None = None) -> list[str]:
    """Regular files only: a FIFO or socket named *.jsonl would block every read."""
    if os.path.isfile(location):
        return [location]
    found = []
    for root, _dirs, files in os.walk(location):
        for name in files:
            path = os.path.join(root, name)
            if not name.endswith((".json", ".jsonl")):
                continue
            if os.path.isfile(path):
                found.append(path)
            elif problems is not None:
                problems.append(f"{path}: skipped (not a regular file)")
    return sorted(found)


def read_rows(path: str, problems: list[str]) -> Iterator[dict]:
    """Rows of one file; corrupt or truncated lines are reported and skipped."""
    try:
        handle = open(path, encoding="utf-8", errors="replace")
    except OSError as error:
        problems.append(f"{path}: cannot read ({error.strerror})")
        return
    with handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                request = json.loads(line)
                if not isinstance(request, dict) or "resourceSpans" not in request:
                    raise ValueError("not an OTLP-JSON traces object")
                yield from spans_from_request(request)
            except (ValueError, TypeError, AttributeError, KeyError) as error:
                problems.append(f"{path}:{number}: skipped corrupt line ({_short(error)})")


def _short(error: Exception) -> str:
    return str(error).splitlines()[0][:120] if str(error) else type(error).__name__


class OtlpJsonSource:
    """Spans from OTLP-JSON lines files; reads everything (small to medium sets)."""

    def __init__(self, location: str):
        self.location = location
        self.problems: list[str] = []
        self._frame: pd.DataFrame | None = None

    def _all(self) -> pd.DataFrame:
        if self._frame is None:
            rows = [row for path in otlp_files(self.location, self.problems)
                    for row in read_rows(path, self.problems)]
            self._frame = drop_duplicate_spans(frame_from_rows(rows), self.problems)
        return self._frame

    def spans(self, conversation_id: str | None = None) -> pd.DataFrame:
        frame = self._all()
        return frame if conversation_id is None else select_conversation(frame, conversation_id)

    def conversation_ids(self) -> list[str]:
        return sorted(self._all()[sc.CONVERSATION_ID.key].dropna().unique())
