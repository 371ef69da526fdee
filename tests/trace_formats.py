"""The same spans in the shapes real producers write them, built from OTLP-JSON requests
(what kvobs's emitters write): the Collector file exporter's proto and zstd framings,
Tempo's and Jaeger's API answers. Tests read each back and compare with the JSON lines.
"""

from __future__ import annotations

import base64
import copy
import gzip
import json
import os

import zstandard
from google.protobuf.json_format import ParseDict
from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def sample_lines(store_dir) -> str:
    """Two conversations' spans through the real emit path, as OTLP-JSON lines."""
    from spanfactory import Tracers, TurnSpec, write_conversation

    tracers = Tracers(str(store_dir))
    write_conversation(tracers, "conv-a", [TurnSpec(), TurnSpec(read="done"),
                                           TurnSpec(read="failed")])
    write_conversation(tracers, "conv-b", [TurnSpec(), TurnSpec(lookup="miss")])
    tracers.flush()
    live = os.path.join(store_dir, "spans")
    return "".join(open(os.path.join(live, name)).read() for name in sorted(os.listdir(live)))


def by_trace(requests: list[dict]) -> dict[str, dict]:
    """Trace id -> one OTLP request holding that trace's spans."""
    traces: dict[str, dict] = {}
    for request in requests:
        for resource_spans in request["resourceSpans"]:
            for scope_spans in resource_spans.get("scopeSpans", ()):
                for span in scope_spans.get("spans", ()):
                    trace = traces.setdefault(span["traceId"], {"resourceSpans": []})
                    trace["resourceSpans"].append({
                        "resource": resource_spans["resource"],
                        "scopeSpans": [{"scope": scope_spans.get("scope", {}),
                                        "spans": [span]}]})
    return traces


def requests_of(lines_text: str) -> list[dict]:
    return [json.loads(line) for line in lines_text.splitlines() if line.strip()]


def merged(requests: list[dict]) -> dict:
    """One request holding every request's resource spans (one pretty-printed file)."""
    return {"resourceSpans": [rs for r in requests for rs in r["resourceSpans"]]}


def _spans(request: dict):
    for resource_spans in request["resourceSpans"]:
        for scope_spans in resource_spans.get("scopeSpans", ()):
            yield from scope_spans.get("spans", ())


def with_base64_ids(request: dict) -> dict:
    """protobuf's JSON mapping of ids (Tempo's answers, ``ParseDict``'s input)."""
    request = copy.deepcopy(request)
    for span in _spans(request):
        for field in _ID_FIELDS:
            if span.get(field):
                span[field] = base64.b64encode(bytes.fromhex(span[field])).decode()
    return request


def to_proto(request: dict) -> bytes:
    return ParseDict(with_base64_ids(request), TracesData()).SerializeToString()


def framed(messages: list[bytes]) -> bytes:
    """The file exporter's ``exportMessageAsBuffer``: 4-byte big-endian size, message."""
    return b"".join(len(m).to_bytes(4, "big") + m for m in messages)


def zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


def file_formats(lines_text: str) -> dict[str, bytes]:
    """File name (no kvobs extension anywhere) -> bytes, one per real producer's shape."""
    requests = requests_of(lines_text)
    raw = lines_text.encode()
    return {
        "collector-json": raw,
        "collector-json-2026-01-14T05-02-14.173": raw,  # a rotated file
        "pretty-document": json.dumps(merged(requests), indent=2).encode(),
        "collector-proto": framed([to_proto(r) for r in requests]),
        "collector-proto-zstd-legacy": framed([zstd(to_proto(r)) for r in requests]),
        "collector-json-zstd-legacy": framed([zstd(json.dumps(r).encode()) for r in requests]),
        "collector-json-zstd-native": zstd(raw),
        "collector-proto-zstd-native": zstd(framed([to_proto(r) for r in requests])),
        "otlp-http-body": to_proto(merged(requests)),
        "copied-lines-gz": gzip.compress(raw),
        "tempo-trace": json.dumps({"batches": with_base64_ids(merged(requests))
                                   ["resourceSpans"]}).encode(),
        "tempo-v2-trace": json.dumps({"trace": with_base64_ids(merged(requests))}).encode(),
        "jaeger-traces": json.dumps(jaeger(requests)).encode(),
        # Jaeger v2's /api/v3 answer saved to a file: a stream of results, one per line
        "jaeger-v3-results": "".join(json.dumps({"result": r}) + "\n"
                                     for r in requests).encode(),
        "windows-editor-lines-bom": b"\xef\xbb\xbf" + raw,
    }


# ---------------------------------------------------------------------- Jaeger

def _tag(key: str, value: dict) -> dict:
    for field, kind in (("stringValue", "string"), ("boolValue", "bool"),
                        ("intValue", "int64"), ("doubleValue", "float64")):
        if field in value:
            raw = value[field]
            return {"key": key, "type": kind, "value": int(raw) if kind == "int64" else raw}
    return {"key": key, "type": "string", "value": ""}


def jaeger(requests: list[dict]) -> dict:
    """Jaeger's ``/api/traces`` answer: ``data``, one trace per trace id, times in us
    (the sub-microsecond part is lost, as in Jaeger)."""
    traces: dict[str, dict] = {}
    for request in requests:
        for resource_spans in request["resourceSpans"]:
            service = next(a["value"]["stringValue"]
                           for a in resource_spans["resource"]["attributes"]
                           if a["key"] == "service.name")
            for scope_spans in resource_spans.get("scopeSpans", ()):
                for span in scope_spans.get("spans", ()):
                    trace = traces.setdefault(span["traceId"], {
                        "traceID": span["traceId"], "spans": [], "processes": {},
                        "warnings": None})
                    process = next((k for k, p in trace["processes"].items()
                                    if p["serviceName"] == service), None)
                    if process is None:
                        process = f"p{len(trace['processes']) + 1}"
                        trace["processes"][process] = {  # resource attributes: tags
                            "serviceName": service,
                            "tags": [_tag(a["key"], a["value"])
                                     for a in resource_spans["resource"]["attributes"]
                                     if a["key"] != "service.name"]}
                    start, end = int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"])
                    tags = [_tag(a["key"], a["value"]) for a in span.get("attributes", ())]
                    if (span.get("status") or {}).get("code") in (2, "STATUS_CODE_ERROR"):
                        tags.append({"key": "error", "type": "bool", "value": True})
                    trace["spans"].append({
                        "traceID": span["traceId"], "spanID": span["spanId"],
                        "operationName": span["name"],
                        "references": ([{"refType": "CHILD_OF", "traceID": span["traceId"],
                                         "spanID": span["parentSpanId"]}]
                                       if span.get("parentSpanId") else []),
                        "startTime": start // 1000, "duration": end // 1000 - start // 1000,
                        "tags": tags, "logs": [], "processID": process, "warnings": None})
    return {"data": list(traces.values()), "total": 0, "limit": 0, "offset": 0,
            "errors": None}
