"""Turns that share a client's trace (the proxy continues it, #27) stay apart in the
store: compaction gives vLLM's request span, which carries no key, the keys of its parent
turn span, not those of the trace's first turn, and kvobs turns reads them so."""

from __future__ import annotations

import os

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from kvobs import semconv as sc
from kvobs.emit.otlp_json import spans_to_otlp_json
from kvobs.sources import open_source
from kvobs.sources.store import compact
from kvobs.turns.correlate import turns_from_spans

CLIENT = SpanContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, is_remote=True,
                     trace_flags=TraceFlags(1))


def _tracer(exporter, service: str, role: str):
    provider = TracerProvider(resource=Resource({"service.name": service, sc.ROLE.key: role}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test")


def _two_turns_in_one_client_trace(store_dir: str) -> None:
    exporter = InMemorySpanExporter()
    proxy = _tracer(exporter, "kvobs-proxy", "proxy")
    decode = _tracer(exporter, "vllm-decode", "decode")
    client = trace.set_span_in_context(NonRecordingSpan(CLIENT))
    for turn in (1, 2):
        server = proxy.start_span("POST /v1/chat/completions", context=client,
                                  kind=trace.SpanKind.SERVER)
        span = proxy.start_span(sc.SPAN_PROXY_TURN.name,
                                context=trace.set_span_in_context(server),
                                attributes={sc.CONVERSATION_ID.key: "agent",
                                            sc.TURN_INDEX.key: turn,
                                            sc.TENANT_DIGEST.key: "t0"})
        vllm = decode.start_span(sc.VLLM_REQUEST_SPAN, context=trace.set_span_in_context(span))
        vllm.set_attribute(sc.VLLM_TTFT.key, turn / 10)
        for ended in (vllm, span, server):
            ended.end()
    live = os.path.join(store_dir, sc.STORE_LIVE_DIR)
    os.makedirs(live)
    with open(os.path.join(live, "spans.otlp.jsonl"), "w") as handle:
        handle.write(spans_to_otlp_json(exporter.get_finished_spans()) + "\n")
    compact(store_dir, writers_stopped=True)


def test_compaction_gives_each_turn_its_own_vllm_spans(tmp_path):
    store = str(tmp_path / "store")
    _two_turns_in_one_client_trace(store)
    spans = open_source(store).spans()
    vllm = spans[spans["name"] == sc.VLLM_REQUEST_SPAN].sort_values(sc.VLLM_TTFT.key)
    assert list(vllm[sc.TURN_INDEX.key]) == [1, 2]  # as compaction stored them
    turns = turns_from_spans(spans).sort_values("turn")
    assert list(turns["turn"]) == [1, 2]
    assert list(turns["vllm_d_ttft_s"]) == [0.1, 0.2]
