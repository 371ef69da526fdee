"""Trace documents to span rows: OTLP JSON (a request, the Collector's lines, Tempo's
``batches`` and v2 ``trace``, Jaeger v2's ``/api/v3`` ``result``) and Jaeger's trace JSON
(``data``: spans, processes, tags).

Each row holds the span-table columns and the known attributes (``semconv.ATTRIBUTES``),
each value coerced to its semconv type on its own: an out-of-range, non-finite or
ill-typed value becomes null and is reported with its ``file:line``, never failing its
span or its file.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Iterator

from kvobs import semconv as sc
from kvobs.sources._decode import short

_VALUE_KEYS = ("stringValue", "intValue", "doubleValue", "boolValue")
_VALUE_KEY_SET = frozenset(_VALUE_KEYS)
_ERROR_STATUS = (2, "STATUS_CODE_ERROR")
_TRACE_ID_BYTES, _SPAN_ID_BYTES = 16, 8
INT64_MAX = 2**63 - 1
_TYPES = {key: attribute.type for key, attribute in sc.ATTRIBUTES.items()}
_TYPES.update(
    start_ns="int",
    end_ns="int",
    trace_id="str",
    span_id="str",
    parent_span_id="str",
    name="str",
    service="str",
    error="bool",
)
_NANOS_PER_MICRO = 1000
_LOWER_HEX_DIGITS = "0123456789abcdef"
# The attribute keys a span's row holds: the known ones, and the older names of some
# (``renamed`` turns those into known keys, so the row holds known keys only).
_ROW_KEYS = frozenset(sc.ATTRIBUTES) | frozenset(sc.RENAMED_KEYS)
_SERVICE_NAME = "service.name"  # the resource attribute a row's service comes from
# The Python type of a value each semconv type keeps as it is (most values, see ``coerce``).
_PYTHON_TYPE = {"str": str, "int": int, "float": float, "bool": bool}
_PYTHON_TYPES = {key: _PYTHON_TYPE[type_] for key, type_ in _TYPES.items()}
# What reading a document or span of an unexpected shape raises.
UNREADABLE = (ValueError, TypeError, AttributeError, KeyError, RecursionError)
# What ``coerced`` raises for a value it cannot use.
UNUSABLE = (ValueError, TypeError, OverflowError, UnicodeEncodeError)


class ReadRows(list):
    """Span rows a decoder built already, as ``_otlp_span`` builds them (not yet coerced):
    the compiled OTLP/protobuf decoder's (``kvobs.emit.native``). ``rows`` takes them as
    it takes a document: coerced, each problem reported."""

    __slots__ = ()


# The span table's columns that are no attribute: what every decoder here sets on a row
# after the span's attributes (``_otlp_span`` in this order).
SPAN_COLUMNS = (
    "trace_id",
    "span_id",
    "parent_span_id",
    "name",
    "service",
    "start_ns",
    "end_ns",
    "error",
)


def otlp_row_names() -> tuple[
    dict[str, bool], tuple[tuple[str, str], ...], str, str, tuple[str, ...]
]:
    """What a decoder that builds OTLP span rows as ``_otlp_span`` does needs: the
    attribute keys a row keeps, each with whether its values are text (an OTLP intValue,
    a decimal string, coerces to the same int, or float, for a key of numbers: such a
    decoder may give the int), ``renamed``'s (old, new) pairs, the role and service keys
    of the resource, and ``SPAN_COLUMNS``."""
    return (
        {key: _TYPES.get(sc.RENAMED_KEYS.get(key, key), "str") == "str" for key in _ROW_KEYS},
        tuple(sc.RENAMED_KEYS.items()),
        sc.ROLE.key,
        _SERVICE_NAME,
        SPAN_COLUMNS,
    )


def rows(where: str, document: object, problems: list[str]) -> list[dict]:
    """The coerced rows of one document (or of ``ReadRows``); a document of no known
    shape is reported."""
    skipped: list[str] = []
    try:
        found = (
            document if isinstance(document, ReadRows) else list(_document_rows(document, skipped))
        )
    except UNREADABLE as error:
        problems.append(f"{where}: skipped ({short(error)})")
        return []
    for reason in skipped:
        problems.append(f"{where}: skipped a span that cannot be read ({reason})")
    for row in found:
        bad = coerce(row)
        if bad:
            problems.append(
                f"{where}: span {row.get('span_id')}: {', '.join(bad)} out of "
                "range or ill-typed, read as null"
            )
    return found


def document_kind(document: object) -> str | None:
    """Which trace document ``document`` is (the key it is read by: ``resourceSpans``,
    ``batches``, ``trace``, ``result``, ``data``, ``jaeger``, ``empty``, ``list``), or None
    for a shape no producer writes."""
    if isinstance(document, list):  # several requests or traces in one array
        return "list" if all(document_kind(item) for item in document) else None
    if not isinstance(document, dict):
        return None
    if "resourceSpans" in document:  # OTLP
        return "resourceSpans"
    if "batches" in document:  # Tempo /api/traces/<id>
        return "batches"
    if isinstance(document.get("trace"), dict):  # Tempo /api/v2/traces/<id>
        return "trace"
    if isinstance(document.get("result"), dict):  # Jaeger v2 /api/v3 (a stream's line)
        return "result"
    if "data" in document:  # Jaeger /api/traces, a JSON file saved from its UI
        return "data"
    if "spans" in document and "processes" in document:  # one Jaeger trace
        return "jaeger"
    if not document:  # Tempo's empty answer, an empty OTLP request
        return "empty"
    return None


def _document_rows(document: Any, skipped: list[str]) -> Iterator[dict]:  # parsed JSON
    kind = document_kind(document) if not isinstance(document, list) else "list"
    if kind == "list":
        for item in document:
            yield from _document_rows(item, skipped)
    elif kind in ("resourceSpans", "batches"):
        # a request decoded from protobuf comes with its spans' attributes read already
        # (``otlp_json.DecodedRequest``; not imported: it would load the SDK here)
        span_attributes = getattr(document, "span_attributes", None)
        yield from _otlp(document[kind], skipped, span_attributes)
    elif kind in ("trace", "result"):
        yield from _document_rows(document[kind], skipped)
    elif kind == "data":
        for trace in document["data"] or ():
            yield from _jaeger(trace, skipped)
    elif kind == "jaeger":
        yield from _jaeger(document, skipped)
    elif kind is None:
        raise ValueError("not a trace document (OTLP, Tempo or Jaeger JSON)")


# ---------------------------------------------------------------------- OTLP


def _value(any_value: dict):
    for key in _VALUE_KEYS:
        if key in any_value:
            return any_value[key]
    return None


def _attributes(items, keys: frozenset[str] | None = None) -> dict:
    """Key -> value; an item without a string key is no known attribute: dropped, as
    unknown attributes are. ``keys``: only these are kept (the rest would be dropped by
    the caller anyway; not building them is cheaper)."""
    out = {}
    for item in items or ():
        if not isinstance(item, dict):
            continue
        key = item.get("key")
        if not isinstance(key, str) or (keys is not None and key not in keys):
            continue
        any_value = item.get("value") or {}
        if type(any_value) is dict and len(any_value) == 1:  # one value: ``_value`` at once
            for value_key, value in any_value.items():
                out[key] = value if value_key in _VALUE_KEY_SET else None
        else:
            out[key] = _value(any_value)
    return renamed(out)


def renamed(attributes: dict) -> dict:
    """Keys an older kvobs wrote (``semconv.RENAMED_KEYS``) under today's names."""
    for old, new in sc.RENAMED_KEYS.items():
        if old in attributes:
            attributes.setdefault(new, attributes.pop(old))
    return attributes


def spans_from_request(request: dict) -> Iterator[dict]:
    """Flatten one ``{"resourceSpans": ...}`` object into span rows (known keys only)."""
    yield from _otlp(request.get("resourceSpans"))


def _otlp(
    resource_spans_list,
    skipped: list[str] | None = None,
    span_attributes: list[dict] | None = None,
) -> Iterator[dict]:
    """``span_attributes``: each span's attributes (key -> value), in the order of the
    spans, where the caller has them already."""
    attributes_of = iter(span_attributes) if span_attributes is not None else None
    for resource_spans in resource_spans_list or ():
        resource = _attributes((resource_spans.get("resource") or {}).get("attributes"))
        # the process's role (kvobs.role), whatever its service name
        context = (resource.get(_SERVICE_NAME), resource.get(sc.ROLE.key))
        scopes = (
            resource_spans.get("scopeSpans")
            or resource_spans.get("instrumentationLibrarySpans")
            or ()
        )  # OTLP < 0.19
        for scope_spans in scopes:
            for span in scope_spans.get("spans") or ():
                attributes = None if attributes_of is None else next(attributes_of)
                try:
                    row = _otlp_span(span, context, attributes)
                except UNREADABLE as error:
                    _skip(error, skipped)
                    continue
                yield row


def _skip(error: Exception, skipped: list[str] | None) -> None:
    """A span that cannot be read at all is skipped alone (reported), where the caller
    collects what was skipped; else the error is the caller's."""
    if skipped is None:
        raise error
    skipped.append(short(error))


def _otlp_span(span: dict, context: tuple, attributes: dict | None = None) -> dict:
    """``attributes``: the span's, read already (key -> value, every key): the known
    ones are kept as ``_attributes`` keeps them."""
    service, role = context
    if attributes is None:
        row = _attributes(span.get("attributes"), _ROW_KEYS)
    else:
        row = renamed({key: value for key, value in attributes.items() if key in _ROW_KEYS})
    if role is not None:
        row.setdefault(sc.ROLE.key, role)
    # stored one by one: cheaper than ``update`` with keywords (a dict built first)
    row["trace_id"] = hex_id(span.get("traceId"), _TRACE_ID_BYTES)
    row["span_id"] = hex_id(span.get("spanId"), _SPAN_ID_BYTES)
    row["parent_span_id"] = hex_id(span.get("parentSpanId"), _SPAN_ID_BYTES) or None
    row["name"] = span.get("name")
    row["service"] = service
    row["start_ns"] = span.get("startTimeUnixNano")
    row["end_ns"] = span.get("endTimeUnixNano")
    row["error"] = (span.get("status") or {}).get("code") in _ERROR_STATUS
    return row


def hex_id(value, size: int):
    """A trace or span id as lower-case hex: OTLP JSON writes hex, protobuf's JSON mapping
    (Tempo's API, a decoded proto file) base64, Jaeger hex without leading zeros. Anything
    else is left for coercion to judge."""
    if not isinstance(value, str) or not value:
        return value
    if len(value) == 2 * size and not value.strip(_LOWER_HEX_DIGITS):  # OTLP JSON's form
        return value  # (strip: nothing left when every character is a lower-case digit)
    if len(value) <= 2 * size and _is_hex(value):
        return value.lower().rjust(2 * size, "0")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return value
    return raw.hex() if len(raw) == size else value


def _is_hex(value: str) -> bool:
    try:
        int(value, 16)
    except ValueError:
        return False
    return value.isascii() and value.isalnum()


# ---------------------------------------------------------------------- Jaeger


def _jaeger(trace: dict, skipped: list[str] | None = None) -> Iterator[dict]:
    processes = trace.get("processes") or {}
    for span in trace.get("spans") or ():
        try:
            row = _jaeger_span(span, processes)
        except UNREADABLE as error:
            _skip(error, skipped)
            continue
        yield row


def _jaeger_span(span: dict, processes: dict) -> dict:
    tags = renamed({tag["key"]: tag.get("value") for tag in span.get("tags") or ()})
    process = processes.get(span.get("processID")) or span.get("process") or {}
    parent = next(
        (
            ref.get("spanID")
            for ref in span.get("references") or ()
            if ref.get("refType") == "CHILD_OF"
        ),
        None,
    )
    start = _scaled(span.get("startTime"), _NANOS_PER_MICRO)
    duration = _scaled(span.get("duration"), _NANOS_PER_MICRO)
    row = {key: value for key, value in tags.items() if key in sc.ATTRIBUTES}
    role = next(
        (
            tag.get("value")
            for tag in process.get("tags") or ()
            if isinstance(tag, dict) and tag.get("key") == sc.ROLE.key
        ),
        None,
    )
    if role is not None:  # the resource's kvobs.role: a process tag in Jaeger
        row.setdefault(sc.ROLE.key, role)
    row.update(
        trace_id=hex_id(span.get("traceID"), _TRACE_ID_BYTES),
        span_id=hex_id(span.get("spanID"), _SPAN_ID_BYTES),
        parent_span_id=hex_id(parent, _SPAN_ID_BYTES) or None,
        name=span.get("operationName"),
        service=process.get("serviceName"),
        start_ns=start,
        end_ns=start + duration if _is_number(start) and _is_number(duration) else None,
        error=tags.get("error") in (True, "true") or tags.get("otel.status_code") == "ERROR",
    )
    return row


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _scaled(value, factor: int):
    """``value * factor`` for a number; anything else as it is, for coercion to report."""
    return value * factor if _is_number(value) and abs(value) < 2**62 else value


# ---------------------------------------------------------------------- coercion


def coerced(value, type_: str):
    """``value`` as ``type_``, or raise ValueError: one bad value must not fail a file."""
    if value is None:
        return None
    return _COERCE_TO.get(type_, _as_float)(value)


def _as_str(value) -> str:
    if not isinstance(value, str):
        raise ValueError
    value.encode("utf-8")  # a lone surrogate cannot be stored or compared
    return value


def _as_bool(value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError


def _as_int(value) -> int:
    if isinstance(value, bool):
        raise ValueError
    number = int(value) if isinstance(value, str) else value
    if isinstance(number, float):
        if not number.is_integer():
            raise ValueError
        number = int(number)
    if not isinstance(number, int) or abs(number) > INT64_MAX:
        raise ValueError
    return number


def _as_float(value) -> float:
    if isinstance(value, bool):
        raise ValueError
    number = float(value)
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError
    return number


# One function a type: ``coerce`` calls it without ``coerced``'s dispatch (an OTLP
# intValue and a span's times are strings: an int parse for most spans).
_COERCE_TO = {"str": _as_str, "bool": _as_bool, "int": _as_int, "float": _as_float}


def coerce(row: dict) -> list[str]:
    """Coerce ``row`` in place to the semconv types; the keys whose value was unusable
    (now null)."""
    bad = []
    for key, value in row.items():
        # What the coercion would leave as it is, without the call (most values; the live
        # classifier decodes every span it receives): a value of its key's type that is
        # an ASCII string (no lone surrogate), a bool, an int in range or a finite float
        # (x - x is 0.0 for a finite float only).
        kind = type(value)
        if kind is _PYTHON_TYPES.get(key, str) and (
            (kind is str and value.isascii())
            or kind is bool
            or (kind is int and -INT64_MAX <= value <= INT64_MAX)
            or (kind is float and value - value == 0.0)
        ):
            continue
        if value is None:
            continue
        type_ = _TYPES.get(key, "str")
        try:
            row[key] = _COERCE_TO.get(type_, _as_float)(value)
        except UNUSABLE:
            row[key] = None
            bad.append(key)
    return bad
