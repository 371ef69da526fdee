"""The span store's OTLP-JSON encoder (built straight from the SDK spans) writes exactly
what the protobuf round trip (the SDK's OTLP encoder, then protobuf's JSON mapping) did."""

from __future__ import annotations

import json

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from kvobs.emit.otlp_json import _protobuf_otlp_json, spans_to_otlp_dict, spans_to_otlp_json


def _spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "kvobs-proxy"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("kvobs", schema_url=None)
    other = provider.get_tracer("other", "1.2", schema_url="https://x/schema")
    remote = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(1),
                         trace_state=TraceState([("k", "v")]))
    from opentelemetry import trace

    root = tracer.start_span("root", context=trace.set_span_in_context(
        trace.NonRecordingSpan(remote)), kind=SpanKind.SERVER,
        links=[Link(remote, {"why": "client"}), Link(SpanContext(1, 2, is_remote=False))],
        attributes={"s": "text", "e": "", "i": 0, "big": 2**62, "neg": -5, "f": 1.5,
                    "whole": 3.0, "nan": float("nan"), "inf": float("inf"), "t": True,
                    "b": False, "strs": ["a", "b"], "ints": [1, 2], "empty": [],
                    "unicode": "é\u2028"})
    child = tracer.start_span("child", context=trace.set_span_in_context(root),
                              kind=SpanKind.CLIENT)
    child.add_event("evt", {"n": 1})
    child.add_event("bare")
    child.set_status(Status(StatusCode.ERROR, "boom"))
    child.end()
    ok = other.start_span("ok", kind=SpanKind.PRODUCER)
    ok.set_status(Status(StatusCode.OK))
    ok.end()
    plain = tracer.start_span("plain", kind=SpanKind.CONSUMER)
    plain.set_status(Status(StatusCode.ERROR))
    plain.end()
    root.end()
    return exporter.get_finished_spans()


def test_direct_encoding_equals_the_protobuf_round_trip():
    spans = _spans()
    reference = _protobuf_otlp_json(spans)
    assert json.loads(spans_to_otlp_json(spans)) == json.loads(reference)
    # the same fields in the same order: byte for byte through the json module
    assert json.dumps(spans_to_otlp_dict(spans), separators=(",", ":")) == reference
    assert json.loads(spans_to_otlp_json([])) == json.loads(_protobuf_otlp_json([]))
