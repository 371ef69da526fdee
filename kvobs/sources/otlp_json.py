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
        role = resource.get(sc.ROLE.key)  # the process's role, whatever its service name
        for scope_spans in resource_spans.get("scopeSpans") or ():
            for span in scope_spans.get("spans") or ():
                row = {key: value for key, value in _attributes(span.get("attributes")).items()
                       if key in sc.ATTRIBUTES}
                if role is not None:
                    row.setdefault(sc.ROLE.key, role)
                row.update(
                    trace_id=span.get("traceId"), span_id=span.get("spanId"),
                    parent_span_id=span.get("parentSpanId") or None, name=span.get("name"),
                    service=service, start_ns=span.get("startTimeUnixNano"),
                    end_ns=span.get("endTimeUnixNano"),
                    error=(span.get("status") or {}).get("code") in (_ERROR_STATUS,
                                                                     "STATUS_CODE_ERROR"))
                yield row


_INT64 = 2**63 - 1
_TYPES = {key: attribute.type for key, attribute in sc.ATTRIBUTES.items()}
_TYPES.update(start_ns="int", end_ns="int", trace_id="str", span_id="str",
              parent_span_id="str", name="str", service="str")


def _coerced(value, type_: str):
    """``value`` as ``type_``, or raise ValueError: one bad value must not fail a file."""
    if value is None:
        return None
    if type_ == "str":
        if not isinstance(value, str):
            raise ValueError
        value.encode("utf-8")  # a lone surrogate cannot be stored or compared
        return value
    if type_ == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ValueError
    if isinstance(value, bool):
        raise ValueError
    number = float(value) if type_ == "float" else value
    if type_ == "int":
        number = int(value) if isinstance(value, str) else value
        if isinstance(number, float):
            if not number.is_integer():
                raise ValueError
            number = int(number)
        if not isinstance(number, int) or abs(number) > _INT64:
            raise ValueError
        return number
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError
    return number


def _coerce(row: dict) -> list[str]:
    """Coerce ``row`` in place to the semconv types; the keys whose value was unusable
    (now null)."""
    bad = []
    for key, value in row.items():
        try:
            row[key] = _coerced(value, _TYPES.get(key, "str") if key != "error" else "bool")
        except (ValueError, TypeError, OverflowError, UnicodeEncodeError):
            row[key] = None
            bad.append(key)
    return bad


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
                rows = list(spans_from_request(request))
            except (ValueError, TypeError, AttributeError, KeyError, RecursionError) as error:
                problems.append(f"{path}:{number}: skipped corrupt line ({_short(error)})")
                continue
            for row in rows:
                bad = _coerce(row)
                if bad:
                    problems.append(f"{path}:{number}: span {row.get('span_id')}: "
                                    f"{', '.join(bad)} out of range or ill-typed, read as null")
                yield row


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
