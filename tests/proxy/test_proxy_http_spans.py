"""Standard OpenTelemetry HTTP spans beside the kvobs spans (#10): a SERVER span for the
client's request, a CLIENT span per leg to P and D, with the stable HTTP semantic
conventions; read back from the in-memory exporter and from a real span store, and
`kvobs turns` (turns_from_spans) is not confused by them."""

from __future__ import annotations

import asyncio
import json
import os

from harness import Harness
from opentelemetry.trace import SpanKind, StatusCode
from test_proxy_flow import converse, run
from test_proxy_hardening import turn_table
from test_proxy_span_loss import _ConfiguredTracing

from kvobs.proxy.app import PROXY_KEY
from kvobs import semconv as sc
from kvobs.turns.correlate import turns_from_spans
from kvobs.emit.setup import flush
from kvobs.sources import open_source

CHAT = "/v1/chat/completions"
TURN = sc.SPAN_PROXY_TURN.name
SECRET = "the-prompt-must-never-be-in-a-span"


def http_spans(proxy, kind):
    return [s for s in proxy.spans() if s.kind is kind]


def by_trace(spans, trace_id):
    return [s for s in spans if s.context.trace_id == trace_id]


def test_server_and_client_spans_per_turn_streamed_or_not():
    async def scenario():
        async with Harness() as h:
            await converse(h, "conv-h", 2, start=[{"role": "system", "content": SECRET}])
            await converse(h, "conv-s", 1, stream=True)
            turns = h.proxy.spans(TURN)
            servers = http_spans(h.proxy, SpanKind.SERVER)
            clients = http_spans(h.proxy, SpanKind.CLIENT)
            assert len(turns) == len(servers) == 3 and len(clients) == 6
            for turn in turns:
                (server,) = by_trace(servers, turn.context.trace_id)
                # no client traceparent: the SERVER span is the root, the turn its child
                assert server.parent is None and turn.parent.span_id == server.context.span_id
                assert server.name == "POST /v1/chat/completions"
                a = server.attributes
                assert a[sc.HTTP_REQUEST_METHOD] == "POST" and a[sc.HTTP_ROUTE] == CHAT
                assert a[sc.URL_PATH] == CHAT and a[sc.URL_SCHEME] == "http"
                assert a[sc.HTTP_STATUS] == 200 and sc.ERROR_TYPE not in a
                assert a[sc.SERVER_ADDRESS] == "127.0.0.1"
                assert a[sc.SERVER_PORT] == h.proxy.config.port
                assert a[sc.CLIENT_ADDRESS] == "127.0.0.1"
                assert a[sc.NETWORK_PROTOCOL_VERSION] == "1.1"
                assert server.status.status_code is StatusCode.UNSET
                assert turn.start_time <= server.start_time <= server.end_time <= turn.end_time
                legs = by_trace(clients, turn.context.trace_id)
                assert [leg.attributes[sc.PROXY_LEG] for leg in legs] == ["prefill", "decode"]
                for leg, engine in zip(legs, (h.prefill, h.decode)):
                    assert leg.name == "POST" and leg.parent.span_id == server.context.span_id
                    b = leg.attributes
                    assert b[sc.HTTP_REQUEST_METHOD] == "POST" and b[sc.HTTP_STATUS] == 200
                    assert b[sc.SERVER_ADDRESS] == "127.0.0.1"
                    assert b[sc.SERVER_PORT] == engine.port
                    assert b[sc.URL_FULL] == f"http://127.0.0.1:{engine.port}{CHAT}"
                    assert server.start_time <= leg.start_time <= leg.end_time \
                        <= server.end_time
                assert legs[0].end_time <= legs[1].start_time
            # the engines still get the turn's traceparent (kvobs correlation)
            for headers, turn in zip(h.decode.headers, turns):
                assert headers["traceparent"].split("-")[2] == \
                    format(turn.context.span_id, "016x")
            # never prompt or completion text in any span
            dumped = json.dumps([dict(s.attributes) for s in h.proxy.spans()])
            assert SECRET not in dumped and "r1.0" not in dumped
    run(scenario())


def test_refused_request_has_a_root_server_span_and_failed_legs_an_error_type():
    async def scenario():
        async with Harness() as h:
            status, _ = await h.post(None, raw=b'{"messages": [')
            assert status == 400
            await asyncio.sleep(0.02)
            (server,) = http_spans(h.proxy, SpanKind.SERVER)
            assert server.parent is None and not h.proxy.spans(TURN)
            assert server.attributes[sc.HTTP_STATUS] == 400
            assert sc.ERROR_TYPE not in server.attributes  # a client error (semconv)
            # P refuses a read (500), the proxy retries without params: two P legs
            messages, _ = await converse(h, "f", 1)
            h.state.retained.clear()
            messages.append({"role": "user", "content": "next"})
            status, _ = await h.post({"messages": messages, "conversation_id": "f"})
            assert status == 200
            await asyncio.sleep(0.02)
            turn = h.proxy.spans(TURN)[-1]
            legs = by_trace(http_spans(h.proxy, SpanKind.CLIENT), turn.context.trace_id)
            assert [(leg.attributes[sc.PROXY_LEG], leg.attributes[sc.HTTP_STATUS])
                    for leg in legs] == [("prefill", 500), ("prefill", 200), ("decode", 200)]
            assert legs[0].attributes[sc.ERROR_TYPE] == "500"
            assert legs[0].status.status_code is StatusCode.ERROR
            # D unreachable: its leg says so, the SERVER span has the 502
            await h.decode.stop()
            status, _ = await h.post({"messages": [{"role": "user", "content": "q"}]})
            assert status == 502
            await asyncio.sleep(0.02)
            turn = h.proxy.spans(TURN)[-1]
            legs = by_trace(http_spans(h.proxy, SpanKind.CLIENT), turn.context.trace_id)
            assert legs[-1].attributes[sc.PROXY_LEG] == "decode"
            assert legs[-1].attributes[sc.ERROR_TYPE] == "unreachable"
            assert sc.HTTP_STATUS not in legs[-1].attributes
            (server,) = by_trace(http_spans(h.proxy, SpanKind.SERVER), turn.context.trace_id)
            assert server.attributes[sc.HTTP_STATUS] == 502
            assert server.attributes[sc.ERROR_TYPE] == "502"
            assert server.status.status_code is StatusCode.ERROR
    run(scenario())


def test_kvobs_turns_not_confused_by_http_spans():
    async def scenario():
        async with Harness() as h:
            await converse(h, "a", 3)
            await converse(h, None, 2, stream=True)
            await h.post(None, raw=b"not json")  # a lone SERVER span, no turn
            await asyncio.sleep(0.02)
            assert len(http_spans(h.proxy, SpanKind.CLIENT)) == 10
            table = turn_table(h.proxy)
            assert len(table) == 5
            a = table[table["conversation_id"] == "a"].sort_values("turn")
            assert list(a["turn"]) == [1, 2, 3]
            assert list(a["lookup"]) == ["miss", "hit", "hit"]
            # the turn's own span, not an HTTP span, gives the turn's trace and times
            turns = {format(s.context.span_id, "016x"): s for s in h.proxy.spans(TURN)}
            assert set(table["turn_span_id"]) == set(turns)
    run(scenario())


def converse_into_store(store, conversation: str, turns: int) -> None:
    """``turns`` turns through a proxy built as `kvobs proxy --store-dir STORE` builds it
    (configure_tracing, the environment's OTEL_* settings), its spans flushed."""
    async def scenario():
        async with Harness() as h:
            proxy = await _ConfiguredTracing(h.make_config(store_dir=str(store))).start()
            h.proxies.append(proxy)
            await converse(h, conversation, turns, proxy=proxy)
            await asyncio.get_running_loop().run_in_executor(
                None, flush, proxy._runner.app[PROXY_KEY].tracer)
    run(scenario())


def test_http_spans_in_the_span_store_and_kvobs_turns(tmp_path, monkeypatch):
    """The proxy as `kvobs proxy --store-dir` runs it: spans through configure_tracing's
    exporter into the store, read back by the store source as `kvobs turns` reads them."""
    for name in ("OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "KVOBS_STORE"):
        monkeypatch.delenv(name, raising=False)
    store = tmp_path / "store"
    converse_into_store(store, "stored", 2)
    lines = [json.loads(line) for path in (store / sc.STORE_LIVE_DIR).iterdir()
             for line in path.read_text().splitlines() if line.strip()]
    spans = [span for line in lines for rs in line["resourceSpans"]
             for ss in rs["scopeSpans"] for span in ss["spans"]]
    kinds = sorted(span.get("kind") for span in spans)
    names = sorted(span["name"] for span in spans)
    assert names.count("POST /v1/chat/completions") == 2 and names.count("POST") == 4
    assert kinds.count("SPAN_KIND_SERVER") == 2 and kinds.count("SPAN_KIND_CLIENT") == 4
    table = turns_from_spans(open_source(str(store)).spans())
    assert list(table["conversation_id"]) == ["stored", "stored"]
    assert list(table["turn"]) == [1, 2] and list(table["lookup"]) == ["miss", "hit"]
    assert os.listdir(store / sc.STORE_LIVE_DIR)
