"""The client's trace goes on (#27): a request's W3C traceparent is the parent of the
proxy's SERVER span, and so of the turn; without one the SERVER span is a new root. Turns
that share the client's trace stay apart in kvobs: every kvobs span carries the turn's
keys, and vLLM's request span (which carries none) takes them from its parent, the turn
span whose context the proxy sent the engine."""

from __future__ import annotations

import asyncio

import pytest
from harness import Harness
from opentelemetry import propagate
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind
from test_proxy_flow import converse, run

from kvobs import semconv as sc
from kvobs.diagnose import diagnose
from kvobs.emit.otlp_json import spans_to_otlp_json
from kvobs.sources import open_source

TURN = sc.SPAN_PROXY_TURN.name
CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


def _hex(span_id: int) -> str:
    return format(span_id, "016x")


def _server_of(h, turn):
    (server,) = [s for s in h.proxy.spans() if s.context.span_id == turn.parent.span_id]
    return server


def test_a_traceparent_is_the_server_spans_parent_and_none_a_new_root():
    async def scenario():
        async with Harness() as h:
            status, _ = await h.post({"messages": [{"role": "user", "content": "q"}],
                                      "conversation_id": "p"},
                                     headers={"traceparent": TRACEPARENT})
            assert status == 200
            status, _ = await h.post({"messages": [{"role": "user", "content": "q"}]})
            assert status == 200
            await asyncio.sleep(0.02)
            within, alone = h.proxy.spans(TURN)
            server = _server_of(h, within)
            assert server.kind is SpanKind.SERVER and server.name == "POST /v1/chat/completions"
            assert format(server.context.trace_id, "032x") == CLIENT_TRACE
            assert _hex(server.parent.span_id) == CLIENT_SPAN and server.parent.is_remote
            legs = [s for s in h.proxy.spans() if s.kind is SpanKind.CLIENT
                    and s.context.trace_id == server.context.trace_id]
            assert len(legs) == 2 and all(
                leg.parent.span_id == server.context.span_id for leg in legs)
            for name in (sc.SPAN_PROXY_LOOKUP.name, sc.SPAN_PROXY_STORE.name):
                (span,) = [s for s in h.proxy.spans(name)
                           if s.context.trace_id == within.context.trace_id]
                assert span.parent.span_id == within.context.span_id
            # the engines got the turn's context in the client's trace
            assert h.prefill.headers[0]["traceparent"].split("-")[1:3] == [
                CLIENT_TRACE, _hex(within.context.span_id)]
            # without a traceparent: a trace of its own, the SERVER span its root
            root = _server_of(h, alone)
            assert root.parent is None and root.context.trace_id != server.context.trace_id
    run(scenario())


def test_a_malformed_traceparent_starts_a_new_trace():
    async def scenario():
        async with Harness() as h:
            status, _ = await h.post({"messages": [{"role": "user", "content": "q"}]},
                                     headers={"traceparent": "00-zz-not-a-trace"})
            assert status == 200
            await asyncio.sleep(0.02)
            (turn,) = h.proxy.spans(TURN)
            assert _server_of(h, turn).parent is None
    run(scenario())


def _vllm_spans(h, exporter, named: bool) -> None:
    """What each engine's vLLM would record (its request span, no kvobs key): a child
    of the traceparent it got, a TTFT of its own; its role a resource attribute when
    ``named``, else only its order in the turn tells (P first, D last)."""
    for role, engine in (("prefill", h.prefill), ("decode", h.decode)):
        resource = {"service.name": f"vllm-{role}", sc.ROLE.key: role} if named else {
            "service.name": "vllm"}
        provider = TracerProvider(resource=Resource(resource))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = provider.get_tracer("vllm")
        for index, headers in enumerate(engine.headers, start=1):
            context = propagate.extract({"traceparent": headers["traceparent"]})
            span = tracer.start_span(sc.VLLM_REQUEST_SPAN, context=context)
            span.set_attribute(sc.VLLM_TTFT.key, index / 10)
            span.end()


@pytest.mark.parametrize("named", [True, False], ids=["role-named", "role-by-order"])
def test_two_turns_in_one_client_trace_are_two_turns(tmp_path, named):
    path = tmp_path / "spans.otlp.json"

    async def scenario():
        async with Harness() as h:
            # an agent framework's one trace around a whole conversation
            await converse(h, "agent", 2, headers={"traceparent": TRACEPARENT})
            await asyncio.sleep(0.02)
            turns = h.proxy.spans(TURN)
            assert {format(t.context.trace_id, "032x") for t in turns} == {CLIENT_TRACE}
            _vllm_spans(h, h.proxy.exporter, named)
            path.write_text(spans_to_otlp_json(h.proxy.spans()))
    run(scenario())
    diagnosis = diagnose(open_source(str(path)), "agent")
    assert [t.turn.index for t in diagnosis.turns] == [1, 2]
    from kvobs.turns.correlate import turns_from_spans

    table = turns_from_spans(open_source(str(path)).spans()).sort_values("turn")
    assert list(table["turn"]) == [1, 2]
    # each turn got its own vLLM spans (their parent, not the trace's first turn)
    assert list(table["vllm_d_ttft_s"]) == [0.1, 0.2]
    assert list(table["vllm_p_ttft_s"]) == [0.1, 0.2]
    assert set(table["trace_id"]) == {CLIENT_TRACE}
