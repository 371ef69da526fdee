"""OTLP-JSON lines: the OpenTelemetry Collector file exporter's format.

One ``{"resourceSpans": [...]}`` object per line; ids are lower-case hex as OTLP/JSON
requires (protobuf's own JSON mapping would write base64).
"""

from __future__ import annotations

import base64
import json
import logging
from typing import Any, Callable, Mapping, Sequence

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, StatusCode

from kvobs.emit.segments import LiveSegmentWriter

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")
_LOG = logging.getLogger("kvobs.emit")


_orjson_dumps: Callable[[Any], bytes] | None
loads: Callable[[str | bytes], Any]
try:  # 5-10x faster than json for these dicts; the same JSON values (UTF-8 unescaped)
    from orjson import dumps as _orjson_dumps
    from orjson import loads  # a stored line read back (the live classifier's input)
except ImportError:  # pragma: no cover - orjson comes with the proxy extra
    _orjson_dumps = None
    loads = json.loads


def spans_to_otlp_json(spans: Sequence[ReadableSpan]) -> str:
    """Encode finished SDK spans as one OTLP-JSON line (no trailing newline); a string
    that is not valid Unicode is replaced (``json_line``)."""
    return json_line(spans_to_otlp_dict(spans))[0]


# ------------------------------------------------------------------------- JSON lines
# str.splitlines() also breaks at U+0085, U+2028 and U+2029, which JSON leaves raw inside
# strings (orjson; json with ensure_ascii=False): one in a conversation id cut a line,
# and the batch of spans it carried, in two for any reader splitting that way. (The
# ASCII breaks it knows, \x0b \x0c \x1c-\x1e, are control characters JSON escapes.)
# Outside its strings a JSON text is ASCII, so replacing them in the text only ever
# rewrites a character inside a string. Looked for in the decoded text: a search for one
# character there is a memchr (~2 us for a 100 kB batch), one for their UTF-8 bytes ~100.
_RAW_BREAKS = (("\x85", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


def json_line(value) -> tuple[str, int]:
    """``value`` as one compact JSON line (no newline) with no raw line break in it, and
    how many of its strings were replaced because they are not valid Unicode (lone
    surrogates: a header decoded with surrogateescape, a JSON "\\ud800"), each bad code
    point by U+FFFD; every other string round-trips (json.loads gives it back).

    orjson first (the fast path), which refuses such a string; only then the slow path:
    every string checked, the bad ones replaced. Raises only for a value no JSON can hold.
    """
    try:
        data, replaced = _dumps(value), 0
    except (TypeError, ValueError):  # orjson.JSONEncodeError, UnicodeEncodeError
        value, replaced = valid_strings(value)
        # json, not orjson: no nesting limit; the strings are valid now, so encode succeeds
        data = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    text = data.decode()
    for raw, escaped in _RAW_BREAKS:
        if raw in text:  # a scan: no copy unless one is there
            text = text.replace(raw, escaped)
    return text, replaced


def _dumps(value) -> bytes:
    if _orjson_dumps is not None:
        return _orjson_dumps(value)
    # ensure_ascii=False as orjson: a lone surrogate fails at encode(), as orjson fails
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def valid_strings(value) -> tuple[object, int]:
    """``value`` (JSON-like: dicts, lists, scalars) with its strings that are not valid
    Unicode made valid, and how many were. A surrogate pair held as two code points
    becomes its character; a lone surrogate U+FFFD."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value, 0
        except UnicodeEncodeError:
            utf16 = value.encode("utf-16-le", "surrogatepass")
            return utf16.decode("utf-16-le", "replace"), 1
    if isinstance(value, Mapping):
        out, count = {}, 0
        for key, item in value.items():
            key, bad_key = valid_strings(key)
            out[key], bad = valid_strings(item)
            count += bad_key + bad
        return out, count
    if isinstance(value, (list, tuple)):
        items = [valid_strings(item) for item in value]
        return [item for item, _ in items], sum(bad for _, bad in items)
    return value, 0


def spans_with_invalid_strings(request: Mapping) -> int:
    """Spans of an OTLP-JSON request that hold, or share through their resource or
    scope, a string that is not valid Unicode (what ``json_line`` replaces)."""
    count = 0
    for resource_spans in request.get("resourceSpans", ()):
        shared = valid_strings(resource_spans.get("resource"))[1]
        for scope_spans in resource_spans.get("scopeSpans", ()):
            spans = scope_spans.get("spans", ())
            if shared or valid_strings(scope_spans.get("scope"))[1]:
                count += len(spans)
            else:
                count += sum(1 for span in spans if valid_strings(span)[1])
    return count


def _protobuf_otlp_json(spans: Sequence[ReadableSpan]) -> str:
    """The same line through the SDK's protobuf encoder (what ``spans_to_otlp_json`` did
    before; kept as the reference its test compares with)."""
    return request_to_otlp_json(encode_spans(spans))


def request_to_otlp_json(message) -> str:
    """An ``ExportTraceServiceRequest`` (protobuf) as one OTLP-JSON line, through the json
    module (the reference encoding; a writer uses ``json_line(request_to_otlp_dict())``)."""
    return json.dumps(request_to_otlp_dict(message), separators=(",", ":"))


def request_to_otlp_dict(message) -> dict:
    """An ``ExportTraceServiceRequest`` (protobuf) as an OTLP-JSON dict (ids in hex)."""
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
    return request


def _b64_to_hex(value: str) -> str:
    return base64.b64decode(value).hex()


# ------------------------------------------------------------- from a parsed request
# The same dict as ``request_to_otlp_dict(message)`` (protobuf's JSON mapping through
# ``MessageToDict``, ids in hex), read straight from the parsed message: MessageToDict's
# generic walk (a descriptor look-up and type dispatch per field) cost kvobs collect more
# CPU than the rest of its span handling. Field by field in field-number order, as
# ``ListFields`` gives them: a scalar at its default left out, a message field present
# when set, a oneof member present when it is the one set; int64 and fixed64 as strings,
# enums by name (an unknown number as the number), bytes as base64 (ids as hex).
# tests/emit/test_ingest_decode.py checks it against the reference on every field.


def _enum_names(enum) -> dict[int, str]:
    return {value.number: value.name for value in enum.values}


SPAN_KIND_NAMES = _enum_names(Span.DESCRIPTOR.enum_types_by_name["SpanKind"])
STATUS_CODE_NAMES = _enum_names(Status.DESCRIPTOR.enum_types_by_name["StatusCode"])


class DecodedRequest(dict):
    """``request_json``'s OTLP-JSON dict, with what its walk read of each span's
    attributes: ``span_attributes``, one dict a span, in the order of the spans in the
    dict, key -> the value a string, int, double or bool ``AnyValue`` has in the dict (the
    same object), None for any other value or none; an empty key left out, as the dict
    leaves it out. The live classifier's rows (``kvobs.sources._rows``) take those
    instead of reading every attribute of the dict again. For anything else (orjson,
    json, a comparison) it is the dict."""

    __slots__ = ("span_attributes",)

    def __init__(self, request: dict, span_attributes: list[dict]):
        super().__init__(request)
        self.span_attributes = span_attributes


def request_json(message) -> DecodedRequest:
    """An ``ExportTraceServiceRequest`` (protobuf) as an OTLP-JSON dict (ids in hex),
    equal to ``request_to_otlp_dict(message)``, key order included."""
    span_attributes: list[dict] = []
    resource_spans = [
        _resource_spans_json(item, span_attributes) for item in message.resource_spans
    ]
    return DecodedRequest(
        {"resourceSpans": resource_spans} if resource_spans else {}, span_attributes
    )


def _resource_spans_json(message, span_attributes: list[dict]) -> dict:
    out: dict = {}
    if message.HasField("resource"):
        resource = message.resource
        item: dict = {}
        _put_kv(item, resource.attributes, resource.dropped_attributes_count)
        if resource.entity_refs:  # rare: the generic mapping
            item["entityRefs"] = [MessageToDict(ref) for ref in resource.entity_refs]
        out["resource"] = item
    if message.scope_spans:
        out["scopeSpans"] = [
            _scope_spans_json(item, span_attributes) for item in message.scope_spans
        ]
    if message.schema_url:
        out["schemaUrl"] = message.schema_url
    return out


def _scope_spans_json(message, span_attributes: list[dict]) -> dict:
    out: dict = {}
    if message.HasField("scope"):
        scope = message.scope
        item: dict = {}
        if scope.name:
            item["name"] = scope.name
        if scope.version:
            item["version"] = scope.version
        _put_kv(item, scope.attributes, scope.dropped_attributes_count)
        out["scope"] = item
    if message.spans:
        out["spans"] = [_message_span_json(span, span_attributes) for span in message.spans]
    if message.schema_url:
        out["schemaUrl"] = message.schema_url
    return out


def _message_span_json(span, span_attributes: list[dict]) -> dict:
    # Each field read once (a upb read is a C call and, for bytes and strings, a copy),
    # the attributes in one loop without a call each: most of a span's cost is theirs.
    out: dict = {}
    value = span.trace_id
    if value:
        out["traceId"] = value.hex()
    value = span.span_id
    if value:
        out["spanId"] = value.hex()
    value = span.trace_state
    if value:
        out["traceState"] = value
    value = span.parent_span_id
    if value:
        out["parentSpanId"] = value.hex()
    value = span.name
    if value:
        out["name"] = value
    value = span.kind
    if value:
        out["kind"] = SPAN_KIND_NAMES.get(value, value)
    value = span.start_time_unix_nano
    if value:
        out["startTimeUnixNano"] = str(value)
    value = span.end_time_unix_nano
    if value:
        out["endTimeUnixNano"] = str(value)
    attributes: dict = {}
    span_attributes.append(attributes)
    value = span.attributes
    if value:
        out["attributes"] = _key_values_json(value, attributes)
    value = span.dropped_attributes_count
    if value:
        out["droppedAttributesCount"] = value
    value = span.events
    if value:
        events = []
        for event in value:
            item: dict = {}
            if event.time_unix_nano:
                item["timeUnixNano"] = str(event.time_unix_nano)
            if event.name:
                item["name"] = event.name
            _put_kv(item, event.attributes, event.dropped_attributes_count)
            events.append(item)
        out["events"] = events
    value = span.dropped_events_count
    if value:
        out["droppedEventsCount"] = value
    value = span.links
    if value:
        links = []
        for link in value:
            item = {}
            if link.trace_id:
                item["traceId"] = link.trace_id.hex()
            if link.span_id:
                item["spanId"] = link.span_id.hex()
            if link.trace_state:
                item["traceState"] = link.trace_state
            _put_kv(item, link.attributes, link.dropped_attributes_count)
            if link.flags:
                item["flags"] = link.flags
            links.append(item)
        out["links"] = links
    value = span.dropped_links_count
    if value:
        out["droppedLinksCount"] = value
    if span.HasField("status"):
        status = span.status
        item = {}
        if status.message:
            item["message"] = status.message
        if status.code:
            item["code"] = STATUS_CODE_NAMES.get(status.code, status.code)
        out["status"] = item
    value = span.flags
    if value:
        out["flags"] = value
    return out


def _put_kv(out: dict, attributes, dropped: int) -> None:
    if attributes:
        out["attributes"] = _key_values_json(attributes)
    if dropped:
        out["droppedAttributesCount"] = dropped


def _key_values_json(attributes, values: dict | None = None) -> list[dict]:
    """``KeyValue`` messages as OTLP-JSON objects: the common values (string, int,
    double, bool) built here, the rest by ``_message_value_json``. ``values``: each
    attribute's value as the object holds it put there too (``DecodedRequest``)."""
    out: list[dict] = []
    append = out.append
    for item in attributes:
        value = item.value  # reading an unset message field does not set it
        which = value.WhichOneof("value")
        if which == "string_value":  # most attributes
            scalar = value.string_value
            value_json: dict | None = {"stringValue": scalar}
        elif which == "int_value":
            scalar = str(value.int_value)
            value_json = {"intValue": scalar}
        elif which == "double_value":
            scalar = value.double_value
            # x - x is 0.0 for a finite double only: NaN and the infinities are named
            if scalar - scalar != 0.0:
                scalar = _double(scalar)
            value_json = {"doubleValue": scalar}
        elif which == "bool_value":
            scalar = value.bool_value
            value_json = {"boolValue": scalar}
        else:
            scalar = None
            if which is not None:
                value_json = _message_value_json(value, which)
            elif item.HasField("value"):
                value_json = {}
            else:
                value_json = None
        key = item.key
        if key:
            if values is not None:
                values[key] = scalar
            pair: dict = {"key": key} if value_json is None else {"key": key, "value": value_json}
        else:
            pair = {} if value_json is None else {"value": value_json}
        strindex = item.key_strindex
        if strindex:
            pair["keyStrindex"] = strindex
        append(pair)
    return out


def _message_value_json(value, which: str | None = None) -> dict:
    if which is None:
        which = value.WhichOneof("value")
    if which == "string_value":
        return {"stringValue": value.string_value}
    if which == "int_value":
        return {"intValue": str(value.int_value)}
    if which == "double_value":
        return {"doubleValue": _double(value.double_value)}
    if which == "bool_value":
        return {"boolValue": value.bool_value}
    if which is None:
        return {}
    if which == "array_value":
        items = [_message_value_json(item) for item in value.array_value.values]
        return {"arrayValue": {"values": items} if items else {}}
    if which == "kvlist_value":
        pairs = _key_values_json(value.kvlist_value.values)
        return {"kvlistValue": {"values": pairs} if pairs else {}}
    if which == "bytes_value":
        return {"bytesValue": base64.b64encode(value.bytes_value).decode()}
    return {"stringValueStrindex": value.string_value_strindex}


# ---------------------------------------------------------------------- direct encoding
# The same JSON as ``request_to_otlp_json(encode_spans(spans))`` (protobuf's JSON mapping:
# camelCase, int64 and fixed64 as strings, enums by name, fields at their default left
# out, in field-number order; ids in hex), built straight from the SDK spans: the protobuf
# round trip (encode_spans, then MessageToDict) cost a span-emitting process more CPU
# than the rest of its span handling (tests/emit/test_otlp_encoding.py: the two agree on
# every field kind).

_KIND = {
    SpanKind.INTERNAL: "SPAN_KIND_INTERNAL",
    SpanKind.SERVER: "SPAN_KIND_SERVER",
    SpanKind.CLIENT: "SPAN_KIND_CLIENT",
    SpanKind.PRODUCER: "SPAN_KIND_PRODUCER",
    SpanKind.CONSUMER: "SPAN_KIND_CONSUMER",
}
_STATUS = {StatusCode.OK: "STATUS_CODE_OK", StatusCode.ERROR: "STATUS_CODE_ERROR"}
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200
_INT64 = 1 << 63


def _double(value: float):
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def _any_value(value) -> dict:
    kind = type(value)
    if kind is str:
        return {"stringValue": value}
    if kind is bool:
        return {"boolValue": value}
    if kind is int and -_INT64 <= value < _INT64:
        return {"intValue": str(value)}
    if kind is float:
        return {"doubleValue": _double(value)}
    if value is None:
        return {}
    if isinstance(value, bool):
        return {"boolValue": bool(value)}
    if isinstance(value, str):
        return {"stringValue": str(value)}
    if isinstance(value, int):
        if not -_INT64 <= value < _INT64:
            raise ValueError(f"{value} out of int64 range")
        return {"intValue": str(int(value))}
    if isinstance(value, float):
        return {"doubleValue": _double(float(value))}
    if isinstance(value, bytes):
        return {"bytesValue": base64.b64encode(value).decode()}
    if isinstance(value, Sequence):
        values = [_any_value(v) for v in value]
        return {"arrayValue": {"values": values} if values else {}}
    if isinstance(value, Mapping):
        values = [{"key": str(k), "value": _any_value(v)} for k, v in value.items()]
        return {"kvlistValue": {"values": values} if values else {}}
    raise TypeError(f"Invalid type {type(value)} of value {value}")


def _attributes(attributes) -> list[dict]:
    out = []
    for key, value in (attributes or {}).items():
        if type(value) is str:  # most attributes: no further checks
            out.append({"key": key, "value": {"stringValue": value}})
            continue
        try:
            out.append({"key": key, "value": _any_value(value)})
        except Exception:  # noqa: BLE001 - as the SDK's encoder: the attribute is left out
            _LOG.debug("attribute %s not encodable", key, exc_info=True)
    return out


def _put_attributes(out: dict, attributes, dropped: int) -> None:
    encoded = _attributes(attributes)
    if encoded:
        out["attributes"] = encoded
    if dropped:
        out["droppedAttributesCount"] = dropped


def _flags(context) -> int:
    return (
        _HAS_IS_REMOTE | _IS_REMOTE if context is not None and context.is_remote else _HAS_IS_REMOTE
    )


def _span_json(span: ReadableSpan) -> dict:
    context = span.get_span_context()
    assert context is not None  # an ended span always has its context; only the API allows None
    out: dict = {
        "traceId": format(context.trace_id, "032x"),
        "spanId": format(context.span_id, "016x"),
    }
    if context.trace_state:
        out["traceState"] = ",".join(f"{k}={v}" for k, v in context.trace_state.items())
    parent = span.parent
    if parent is not None:
        out["parentSpanId"] = format(parent.span_id, "016x")
    if span.name:
        out["name"] = span.name
    out["kind"] = _KIND[span.kind]
    if span.start_time:
        out["startTimeUnixNano"] = str(span.start_time)
    if span.end_time:
        out["endTimeUnixNano"] = str(span.end_time)
    _put_attributes(out, span.attributes, span.dropped_attributes)
    if span.events:
        events = []
        for event in span.events:
            item: dict = {}
            if event.timestamp:
                item["timeUnixNano"] = str(event.timestamp)
            if event.name:
                item["name"] = event.name
            _put_attributes(item, event.attributes, event.dropped_attributes)
            events.append(item)
        out["events"] = events
    if span.dropped_events:
        out["droppedEventsCount"] = span.dropped_events
    if span.links:
        links = []
        for link in span.links:
            item = {
                "traceId": format(link.context.trace_id, "032x"),
                "spanId": format(link.context.span_id, "016x"),
            }
            _put_attributes(item, link.attributes, link.dropped_attributes)
            item["flags"] = _flags(link.context)
            links.append(item)
        out["links"] = links
    if span.dropped_links:
        out["droppedLinksCount"] = span.dropped_links
    status: dict = {}
    if span.status is not None:  # message (field 2) before code (3)
        if span.status.description:
            status["message"] = span.status.description
        if span.status.status_code in _STATUS:
            status["code"] = _STATUS[span.status.status_code]
    out["status"] = status
    out["flags"] = _flags(parent)
    return out


def _scope_json(scope) -> dict:
    if scope is None:
        return {}
    out: dict = {}
    if scope.name:
        out["name"] = scope.name
    if scope.version:
        out["version"] = scope.version
    _put_attributes(out, scope.attributes, 0)
    return out


def spans_to_otlp_dict(spans: Sequence[ReadableSpan]) -> dict:
    """``{"resourceSpans": [...]}`` of finished SDK spans, grouped by resource and
    scope as the SDK's OTLP encoder groups them."""
    by_id: dict = {}  # by identity first: Resource's own hash serializes it each time
    for span in spans:
        scope = span.instrumentation_scope or None
        _, scopes = by_id.setdefault(id(span.resource), (span.resource, {}))
        scopes.setdefault(scope, []).append(_span_json(span))
    grouped: dict = {}  # then equal resources together, as the SDK's encoder groups them
    for resource, scopes in by_id.values():
        into = grouped.setdefault(resource, {})
        for scope, encoded in scopes.items():
            into.setdefault(scope, []).extend(encoded)
    resource_spans = []
    for resource, scopes in grouped.items():
        scope_spans = []
        for scope, encoded in scopes.items():
            item: dict = {"scope": _scope_json(scope), "spans": encoded}
            if scope is not None and scope.schema_url:
                item["schemaUrl"] = scope.schema_url
            scope_spans.append(item)
        resource_json: dict = {}
        attributes = _attributes(resource.attributes)
        if attributes:
            resource_json["attributes"] = attributes
        item = {"resource": resource_json, "scopeSpans": scope_spans}
        if resource.schema_url:
            item["schemaUrl"] = resource.schema_url
        resource_spans.append(item)
    return {"resourceSpans": resource_spans} if resource_spans else {}


class OtlpJsonFileExporter(SpanExporter):
    """Appends each export batch as one OTLP-JSON line to a live segment of a store
    (``segments.LiveSegmentWriter``: rotated, size-capped, expired).

    A failed write (full disk, vanished directory) is reported as FAILURE to the span
    processor, which drops the batch and counts it: telemetry never raises into the host.
    A directory that cannot be created does not stop the host either: it is logged once
    (here, at start) and tried again at each export, so the store recovers when fixed.

    Encoding never costs a batch: a string that is not valid Unicode is replaced, and a
    span no JSON can hold is left out, its batch written without it. Both are counted
    in ``encoding_losses`` (spans: ``semconv.TELEMETRY_DROP_REASONS``'s ``encoding``;
    the strings replaced in ``replaced_values``) and logged, the first at warning.
    """

    def __init__(self, writer: "LiveSegmentWriter"):
        self._writer = writer
        self._dir = writer.directory
        self.encoding_losses = 0  # written by the export thread only
        self.replaced_values = 0
        self._encoding_warned = False
        self._failing = not self._makedirs()
        if self._failing:
            _LOG.warning(
                "span store %s not writable: serving without it (lost spans are counted)", self._dir
            )

    @property
    def path(self) -> str:
        """The active segment."""
        return self._writer.path

    def _makedirs(self) -> bool:
        try:
            self._writer.makedirs()
            return True
        except OSError:
            return False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        text = self._encode(spans)
        if not text:  # every span unencodable: each counted and logged already
            return SpanExportResult.SUCCESS
        try:
            if self._failing:
                self._makedirs()
            self._writer.append(text + "\n")
        except Exception as error:  # noqa: BLE001 - the host never sees a telemetry error
            if not self._failing:
                self._failing = True
                _LOG.warning(
                    "span store %s not writable (%s): spans are dropped (counted)", self._dir, error
                )
            return SpanExportResult.FAILURE
        if self._failing:
            self._failing = False
            _LOG.warning("span store %s writable again", self._dir)
        return SpanExportResult.SUCCESS

    def _encode(self, spans: Sequence[ReadableSpan]) -> str:
        """The batch as one line; should that fail, one line per span that encodes, so
        only a span no JSON can hold is lost."""
        try:
            return self._line(spans)
        except Exception:  # noqa: BLE001 - which span? each on its own says
            pass
        lines = []
        for span in spans:
            try:
                lines.append(self._line([span]))
            except Exception as error:  # noqa: BLE001
                self.encoding_losses += 1
                self._encoding_lost(
                    "span %r not encodable, dropped (%s: %s)",
                    span.name,
                    type(error).__name__,
                    error,
                )
        return "\n".join(lines)

    def _line(self, spans: Sequence[ReadableSpan]) -> str:
        request = spans_to_otlp_dict(spans)
        line, replaced = json_line(request)
        if replaced:
            damaged = spans_with_invalid_strings(request)
            self.replaced_values += replaced
            self.encoding_losses += damaged
            self._encoding_lost(
                "%d string value(s) not valid Unicode (lone surrogates) "
                "replaced by U+FFFD in %d span(s)",
                replaced,
                damaged,
            )
        return line

    def _encoding_lost(self, message: str, *args) -> None:
        """Logged at warning once (with the store), then at debug: counted either way."""
        level = logging.DEBUG if self._encoding_warned else logging.WARNING
        self._encoding_warned = True
        _LOG.log(
            level, "span store %s: " + message + " (counted; later ones at debug)", self._dir, *args
        )

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
