"""One client trace holding turns of two conversations (the proxy continues a client's
trace, #27): what the live buffer (tests/live/test_buffer.py) and ClickHouse's span SQL
(tests/sources/test_clickhouse_shared_trace.py) must keep apart as correlate does."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from kvobs import semconv as sc

CLIENT = SpanContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, is_remote=True,
                     trace_flags=TraceFlags(1))
CONVERSATIONS = ("alpha", "beta")
# Turn columns from the untagged spans: P's and D's vLLM TTFT, P's read bytes.
EXPECTED = ("vllm_p_ttft_s", "vllm_d_ttft_s", "read_bytes")


def _tracer(exporter, service: str, role: str):
    provider = TracerProvider(resource=Resource({"service.name": service, sc.ROLE.key: role}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test")


def shared_trace() -> tuple[list, dict[str, set[str]]]:
    """Two turns each of two conversations, interleaved, in one client trace. Per turn:
    the proxy's server span (untagged, child of the client's span, which is not
    recorded), its turn span (tagged) under it, P's vLLM span under the turn span, and
    D's vLLM span and a P read span under the proxy's HTTP client span ``POST`` under the
    turn span (grandchildren); and two orphans. Returns the finished spans (children end,
    and are exported, first) and each conversation's span ids (its untagged
    descendants included)."""
    exporter = InMemorySpanExporter()
    proxy = _tracer(exporter, "kvobs-proxy", "proxy")
    prefill = _tracer(exporter, "vllm-prefill", "prefill")
    decode = _tracer(exporter, "vllm-decode", "decode")
    client = trace.set_span_in_context(NonRecordingSpan(CLIENT))
    owned: dict[str, set[str]] = {cid: set() for cid in CONVERSATIONS}
    # D's vLLM span and a P read span whose parent (the client's span) is not recorded,
    # started before every turn: a turn given them by mistake takes their values (the
    # first by start time).
    orphans = [
        decode.start_span(sc.VLLM_REQUEST_SPAN, context=client,
                          attributes={sc.VLLM_TTFT.key: 9.9}),
        prefill.start_span(sc.SPAN_READ.name, context=client,
                           attributes={sc.READ_BYTES.key: 999}),
    ]
    for turn in (1, 2):
        for n, cid in enumerate(CONVERSATIONS):
            server = proxy.start_span("POST /v1/chat/completions", context=client,
                                      kind=trace.SpanKind.SERVER)
            span = proxy.start_span(sc.SPAN_PROXY_TURN.name,
                                    context=trace.set_span_in_context(server),
                                    attributes={sc.CONVERSATION_ID.key: cid,
                                                sc.TURN_INDEX.key: turn,
                                                sc.TENANT_DIGEST.key: "t0"})
            under_turn = trace.set_span_in_context(span)
            p = prefill.start_span(sc.VLLM_REQUEST_SPAN, context=under_turn)
            p.set_attribute(sc.VLLM_TTFT.key, turn + n / 10)
            post = proxy.start_span("POST", context=under_turn, kind=trace.SpanKind.CLIENT)
            d = decode.start_span(sc.VLLM_REQUEST_SPAN, context=trace.set_span_in_context(post))
            d.set_attribute(sc.VLLM_TTFT.key, turn + n / 10 + 0.01)
            read = prefill.start_span(sc.SPAN_READ.name, context=trace.set_span_in_context(post),
                                      attributes={sc.READ_BYTES.key: 100 * turn + n})
            for ended in (p, d, read, post, span, server):
                ended.end()
            owned[cid] |= {span_id(s) for s in (span, p, post, d, read)}
    for orphan in orphans:
        orphan.end()
    return list(exporter.get_finished_spans()), owned


def span_id(span) -> str:
    return f"{span.get_span_context().span_id:016x}"


def expected(columns: tuple[str, ...] = EXPECTED) -> dict[tuple[str, int], tuple]:
    """Each turn's ``columns`` (of ``EXPECTED``): its own spans' values only."""
    values = {
        (cid, turn): dict(zip(EXPECTED, (turn + n / 10, turn + n / 10 + 0.01, 100 * turn + n)))
        for n, cid in enumerate(CONVERSATIONS)
        for turn in (1, 2)
    }
    return {key: tuple(row[c] for c in columns) for key, row in values.items()}


def observed(turns, columns: tuple[str, ...] = EXPECTED) -> dict[tuple[str, int], tuple]:
    """The same of turn rows (Arrow)."""
    rows = zip(*(turns.column(c).to_pylist() for c in ("conversation_id", "turn", *columns)))
    return {(cid, turn): tuple(values) for cid, turn, *values in rows}


