"""OTLP-JSON lines: the OpenTelemetry Collector file exporter's format.

One ``{"resourceSpans": [...]}`` object per line; ids are lower-case hex as OTLP/JSON
requires (protobuf's own JSON mapping would write base64).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Sequence

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")
_LOG = logging.getLogger("kvobs.emit")


def spans_to_otlp_json(spans: Sequence[ReadableSpan]) -> str:
    """Encode finished SDK spans as one OTLP-JSON line (no trailing newline)."""
    return request_to_otlp_json(encode_spans(spans))


def request_to_otlp_json(message) -> str:
    """An ``ExportTraceServiceRequest`` (protobuf) as one OTLP-JSON line."""
    request = MessageToDict(message)
    for resource_spans in request.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                for field in _ID_FIELDS:
                    if field in span:
                        span[field] = _b64_to_hex(span[field])
                for link in span.get("links", ()):
                    for field in ("traceId", "spanId"):
                        if field in link:
                            link[field] = _b64_to_hex(link[field])
    return json.dumps(request, separators=(",", ":"))


def _b64_to_hex(value: str) -> str:
    import base64

    return base64.b64decode(value).hex()


class OtlpJsonFileExporter(SpanExporter):
    """Appends each export batch as one OTLP-JSON line to ``path``.

    A failed write (full disk, vanished directory) is reported as FAILURE to the span
    processor, which drops the batch and counts it: telemetry never raises into the host.
    A directory that cannot be created does not stop the host either: it is logged once
    (here, at start) and tried again at each export, so the store recovers when fixed.
    """

    def __init__(self, path: str):
        self._path = path
        self._dir = os.path.dirname(os.path.abspath(path))
        self._lock = threading.Lock()
        self._failing = not self._makedirs()
        if self._failing:
            _LOG.warning("span store %s not writable: serving without it (lost spans are "
                         "counted)", self._dir)

    def _makedirs(self) -> bool:
        try:
            os.makedirs(self._dir, exist_ok=True)
            return True
        except OSError:
            return False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        try:
            line = spans_to_otlp_json(spans) + "\n"
            with self._lock:
                if self._failing:
                    self._makedirs()
                with open(self._path, "a", encoding="utf-8") as handle:
                    handle.write(line)
        except Exception:  # noqa: BLE001 - the host must never see a telemetry error
            if not self._failing:
                self._failing = True
                _LOG.warning("span store %s not writable: spans are dropped (counted)",
                             self._dir)
            return SpanExportResult.FAILURE
        if self._failing:
            self._failing = False
            _LOG.warning("span store %s writable again", self._dir)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
