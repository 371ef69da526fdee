"""kvobs collect (OTLP/HTTP receiver) and vLLM's own request spans in the timeline.

The receiver is fed by the real OTLP/HTTP exporter of the OpenTelemetry SDK, the one
vLLM's ``--otlp-traces-endpoint`` uses with ``http/protobuf``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pandas as pd
import pytest
from aiohttp import web
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from spanfactory import SECOND, Tracers, TurnSpec, marks_of, write_conversation

from kvobs import semconv as sc
from kvobs._net import free_ports
from kvobs.turns.correlate import vllm_roles
from kvobs.diagnose import diagnose
from kvobs.emit.collect import SegmentWriter, build_app
from kvobs.emit.spans import Correlation
from kvobs.sources import open_source


@pytest.fixture
def receiver(tmp_path):
    port = free_ports(1)[0]
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(build_app(SegmentWriter(str(tmp_path))))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}/v1/traces", tmp_path
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.run_until_complete(runner.cleanup())
    loop.close()


def _vllm_tracer(url: str, service: str):
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=url)))
    return provider.get_tracer("vllm")


def test_collect_stores_what_the_sdk_exporter_sends(receiver):
    url, store = receiver
    tracer = _vllm_tracer(url, "vllm-decode")
    span = tracer.start_span(sc.VLLM_REQUEST_SPAN, start_time=5 * SECOND)
    span.set_attributes({sc.VLLM_TTFT.key: 0.25, sc.VLLM_E2E.key: 1.5})
    span.end(end_time=7 * SECOND)
    (row,) = open_source(str(store)).spans().to_dict("records")
    assert (row["name"], row["service"], row["start_ns"]) == ("llm_request", "vllm-decode",
                                                               5 * SECOND)
    assert (row[sc.VLLM_TTFT.key], row[sc.VLLM_E2E.key]) == (0.25, 1.5)
    assert row["trace_id"] == format(span.get_span_context().trace_id, "032x")


def test_collect_accepts_otlp_json_and_refuses_garbage(receiver):
    url, store = receiver
    request = {"resourceSpans": [{"scopeSpans": [{"spans": [{
        "traceId": "ab" * 16, "spanId": "cd" * 8, "name": "llm_request",
        "startTimeUnixNano": "1000", "endTimeUnixNano": "2000"}]}]}]}

    def post(body: bytes, kind: str) -> int:
        req = urllib.request.Request(url, data=body, headers={"Content-Type": kind})
        try:
            with urllib.request.urlopen(req, timeout=5) as answer:
                return answer.status
        except urllib.error.HTTPError as error:
            return error.code

    assert post(json.dumps(request).encode(), "application/json") == 200
    assert post(b"\xff\x00 not protobuf", "application/x-protobuf") == 400
    assert post(b"[1, 2]", "application/json") == 400
    spans = open_source(str(store)).spans()
    assert list(spans["trace_id"]) == ["ab" * 16]


def _frame(rows):
    return pd.DataFrame(rows, columns=["trace_id", "name", "service", "start_ns"])


def test_vllm_roles_from_service_name_else_from_order_in_the_trace():
    spans = _frame([("t1", "llm_request", "engine-a", 10), ("t1", "llm_request", "engine-b", 20),
                    ("t2", "llm_request", "my-decode", 5), ("t2", "llm_request", "my-prefill", 9),
                    ("t1", "kvobs.proxy.turn", "kvobs-proxy", 1)])
    assert list(vllm_roles(spans)["name"]) == [
        sc.SPAN_VLLM_PREFILL.name, sc.SPAN_VLLM_DECODE.name,
        sc.SPAN_VLLM_DECODE.name, sc.SPAN_VLLM_PREFILL.name, "kvobs.proxy.turn"]


def test_vllm_spans_stand_in_for_missing_connector_spans(tmp_path):
    """An upstream connector (no kvobs engine spans) with vLLM's tracing on: the turn's
    P and D arrivals and first tokens come from vLLM's spans; TTFT of a non-streamed
    turn is measured; what only the connector sees stays merged and says so."""
    phases = {"proxy-in": 0.002, "p-frontend": 0.003, "p-queue": 0.2, "p-compute": 0.1,
              "p-return": 0.002, "proxy-hop": 0.001, "d-frontend": 0.003, "d-queue": 0.01,
              "handoff": 0.01, "d-first-token": 0.02, "decode": 0.5, "proxy-out": 0.002}
    omit = (sc.SPAN_PREFILL_REQUEST.name, sc.SPAN_DECODE_REQUEST.name, sc.SPAN_HANDOFF.name)
    spec = TurnSpec(lookup="miss", decision="no-params", phases=phases, omit=omit)
    tracers = Tracers(str(tmp_path))
    write_conversation(tracers, "c", [spec])
    written = open_source(str(tmp_path)).spans()
    turn_trace, turn_start = written["trace_id"].iloc[0], written["start_ns"].min()
    # vLLM's spans, children of the proxy's traceparent, as its API servers emit them.
    m = marks_of(spec, int(turn_start))
    parent = Correlation("c", 1, "tenant0", f"00-{turn_trace}-{'1' * 16}-01").parent_context()
    # One service name for both (as vLLM's default resource): roles come from the order.
    for arrived, first, end in ((m["p-arrived"], m["p-first-token"], m["p-first-token"]),
                                (m["d-arrived"], m["first-token"], m["d-answered"])):
        tracer = Tracers(str(tmp_path))[sc.Service.PROXY]  # any writer into the store
        span = tracer.start_span(sc.VLLM_REQUEST_SPAN, context=parent, start_time=arrived)
        span.set_attributes({sc.VLLM_TTFT.key: (first - arrived) / SECOND})
        span.end(end_time=end)
        tracer.span_processor.force_flush()
    (turn,) = diagnose(open_source(str(tmp_path)), "c").turns
    timeline = turn.timeline
    assert timeline.ttft_source == "engine"
    assert timeline.ttft_s == pytest.approx(sum(phases.values()) - 0.502, abs=2e-6)
    assert timeline.phases["p-frontend"] == pytest.approx(0.003, abs=2e-6)
    assert timeline.phases["p-queue+p-schedule+p-compute"] == pytest.approx(0.3, abs=2e-6)
    assert timeline.phases["decode"] == pytest.approx(0.5, abs=2e-6)
    assert "kvobs.prefill.request" in timeline.unmeasured["p-queue"]
    assert sum(timeline.phases.values()) == pytest.approx(timeline.latency_s, abs=1e-6)
