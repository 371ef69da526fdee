"""Issue #10: the proxy in front of production. Slow, chunked and large bodies are read
whole; upstream timeouts are settings and a client that leaves cancels its legs; bad
input is a 400 before any engine works; a client's traceparent never merges turns;
/ready checks the store; /health reports the engines."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.trace import SpanKind
from harness import CLIENT_KEY, Harness, parse_sse
from rawclient import chunked, json_body, request_head, send
from test_proxy_flow import run

from kvobs import semconv as sc

TURN = sc.SPAN_PROXY_TURN.name
CHAT = "/v1/chat/completions"


def chat_body(content: str = "q", **extra) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}],
                       **extra}).encode()


def rejected(h: Harness, reason: str) -> float:
    return h.proxy.metric("kvobs_proxy_rejected_requests_total", {"reason": reason}) or 0


# ---------------------------------------------------------------------- defect 1


def test_body_in_two_writes_50ms_apart_is_read_whole():
    async def scenario():
        async with Harness() as h:
            body = chat_body("x" * 2000, conversation_id="slow")
            head = request_head(CHAT, CLIENT_KEY, length=len(body))
            for _ in range(3):
                status, out = await send(h.proxy.port, [head + body[:700], body[700:]],
                                         pause_s=0.05)
                assert status == 200, out
            assert rejected(h, "bad-json") == 0
            assert len(h.decode.requests) == 3
    run(scenario())


def test_chunked_body_with_pauses_is_read_whole():
    async def scenario():
        async with Harness() as h:
            body = chat_body("y" * 5000, conversation_id="chunky")
            pieces = [body[i:i + 1000] for i in range(0, len(body), 1000)]
            status, out = await send(h.proxy.port,
                                     [request_head(CHAT, CLIENT_KEY, chunked=True),
                                      *chunked(pieces)], pause_s=0.02)
            assert status == 200, out
            assert json_body(out)["choices"][0]["message"]["content"]
    run(scenario())


def test_one_megabyte_body_is_read_whole():
    async def scenario():
        async with Harness() as h:
            body = chat_body("z" * 1_000_000, conversation_id="big")
            for _ in range(3):
                async with h.session.post(h.proxy.url + CHAT, data=body,
                                          headers=CLIENT_KEY) as response:
                    assert response.status == 200, await response.text()
            # the same body sent slowly in 64 KB writes
            head = request_head(CHAT, CLIENT_KEY, length=len(body))
            parts = [head] + [body[i:i + 65536] for i in range(0, len(body), 65536)]
            status, out = await send(h.proxy.port, parts, pause_s=0.002)
            assert status == 200, out[:200]
            assert h.decode.requests[-1]["messages"][0]["content"] == "z" * 1_000_000
    run(scenario())


def test_body_limit_and_slow_or_cut_bodies():
    async def scenario():
        async with Harness(max_body_bytes=4096, body_timeout_s=0.3) as h:
            # over the limit in a chunked body that arrives slowly: 413
            status, _ = await send(h.proxy.port, [request_head(CHAT, CLIENT_KEY, chunked=True),
                                                  *chunked([b"x" * 1000] * 6)], pause_s=0.01)
            assert status == 413
            # a client that stops sending mid-body: 408 within the body timeout
            started = time.monotonic()
            head = request_head(CHAT, CLIENT_KEY, length=100)
            status, out = await send(h.proxy.port, [head + b'{"messages": '])
            assert status == 408 and json_body(out)["error"]["type"] == "invalid_request_error"
            assert time.monotonic() - started < 2
            assert rejected(h, "body-timeout") == 1
            # broken chunked framing: 400, not 500
            status, _ = await send(h.proxy.port, [request_head(CHAT, CLIENT_KEY, chunked=True),
                                                  b"zz\r\nabc\r\n0\r\n\r\n"])
            assert status == 400
            assert h.prefill.requests == []
    run(scenario())


# ---------------------------------------------------------------------- defect 4


def stall(engine, seconds: float):
    original = engine.answer

    async def slow(request, body):
        await asyncio.sleep(seconds)
        return await original(request, body)
    engine.answer = slow


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_stalled_engine_times_out_at_its_read_timeout(role):
    async def scenario():
        async with Harness(**{f"{role}_read_timeout_s": 0.3}) as h:
            stall(getattr(h, role), 3.0)
            started = time.monotonic()
            status, out = await h.post({"messages": [{"role": "user", "content": "q"}]})
            assert status == 504 and out["error"]["message"] == f"{role} engine timeout"
            assert time.monotonic() - started < 1.5
            assert h.proxy.metric("kvobs_proxy_upstream_errors_total",
                                  {"role": role, "kind": "timeout"}) == 1
            if role == "prefill":
                assert h.decode.requests == []
    run(scenario())


def test_client_that_gives_up_during_prefill_causes_no_decode():
    async def scenario():
        async with Harness() as h:
            stall(h.prefill, 0.8)
            timeout = aiohttp.ClientTimeout(total=0.2)
            for stream in (False, True):
                try:
                    async with h.session.post(h.proxy.url + CHAT, headers=CLIENT_KEY,
                                              data=chat_body(stream=stream),
                                              timeout=timeout) as response:
                        await response.read()
                except asyncio.TimeoutError:
                    pass
                else:
                    raise AssertionError("the client should have given up")
            await asyncio.sleep(1.5)  # P answers long after the clients left
            assert len(h.prefill.requests) == 2
            assert h.decode.requests == []
            turns = h.proxy.spans(TURN)
            assert [t.attributes[sc.PROXY_ERROR.key] for t in turns] == \
                ["client-disconnected"] * 2
            stall(h.prefill, 0)
            status, _ = await h.post({"messages": [{"role": "user", "content": "q"}]})
            assert status == 200
    run(scenario())


def test_timeout_flags(monkeypatch):
    from test_proxy_cli import _invoke

    from kvobs.proxy import ProxyConfig

    result, config = _invoke(monkeypatch, [])
    defaults = ProxyConfig(prefill=config.prefill, decode=config.decode)
    for name in ("connect_timeout_s", "prefill_read_timeout_s", "decode_read_timeout_s",
                 "body_timeout_s"):
        assert getattr(config, name) == getattr(defaults, name)
    result, config = _invoke(monkeypatch, [
        "--connect-timeout", "1.5", "--prefill-read-timeout", "20",
        "--decode-read-timeout", "90", "--body-timeout", "7"])
    assert result.exit_code == 0, result.output
    assert (config.connect_timeout_s, config.prefill_read_timeout_s,
            config.decode_read_timeout_s, config.body_timeout_s) == (1.5, 20, 90, 7)
    result, config = _invoke(monkeypatch, ["--prefill-read-timeout", "0"])
    assert result.exit_code == 2 and config is None


# ---------------------------------------------------------------------- defect 6

DEEP = b'{"messages": [{"role": "user", "content": "q"}], "x": ' + b"[" * 1000 + \
    b"]" * 1000 + b"}"
DEEPISH = b'{"messages": [{"role": "user", "content": "q"}], "x": ' + b"[" * 150 + \
    b"]" * 150 + b"}"
BAD_INPUT = [
    (DEEP, "too-deep"),
    (DEEPISH, "too-deep"),
    (b'{"messages": [{"role": "user", "content": "q"}], "conversation_id": "\\ud800"}',
     "bad-unicode"),
    (b'{"messages": [{"role": "user", "content": "a\\udfffb"}], "conversation_id": "c"}',
     "bad-unicode"),
    (b'{"prompt": "\\ud800", "conversation_id": "c"}', "bad-unicode"),
    (b'{"prompt": "\\ud800"}', "bad-unicode"),
    (b'{"messages": [{"role": "assistant", "content": "q", "tool_calls": '
     b'[{"function": "x"}]}], "conversation_id": "c"}', "bad-field"),
    (b'{"messages": [{"role": "assistant", "tool_calls": "x"}]}', "bad-field"),
    (b'{"messages": [{"role": "assistant", "tool_calls": [1]}]}', "bad-field"),
    (b'{"messages": [{"role": "assistant", "tool_calls": [{"function": '
     b'{"name": 1}}]}]}', "bad-field"),
    (b'{"messages": "hello"}', "bad-field"),
    (b'{"messages": ["hello"]}', "bad-field"),
    (b'{"prompt": {"a": 1}}', "bad-field"),
    (b'{"prompt": "a\xff"}', "bad-json"),
]


def test_bad_input_is_400_before_any_engine():
    async def scenario():
        async with Harness() as h:
            for raw, reason in BAD_INPUT:
                for stream in (False, True):
                    data = raw if not stream else raw[:-1] + b', "stream": true}'
                    path = "/v1/completions" if b'"prompt"' in raw else CHAT
                    before = rejected(h, reason)
                    status, out = await h.post(None, raw=data, path=path)
                    assert status == 400, (data[:80], status, out)
                    assert out["error"]["type"] == "invalid_request_error"
                    assert out["error"]["code"] == 400 and out["error"]["message"]
                    assert rejected(h, reason) == before + 1, (data[:80], reason)
            # invalid UTF-8 in the headers the proxy reads
            for name in ("X-Session-ID", "Authorization"):
                status, out = await send(h.proxy.port, [
                    request_head(CHAT, {name: b"Bearer \xff\xfe"}, length=len(chat_body())),
                    chat_body()])
                assert status == 400, (name, out)
            assert h.prefill.requests == [] and h.decode.requests == []
            status, _ = await h.post({"messages": [{"role": "user", "content": "😀 ok"}],
                                      "conversation_id": "emoji 😀"})
            assert status == 200
    run(scenario())


def test_failure_after_the_stream_started_ends_with_error_event_and_done(monkeypatch):
    import kvobs.proxy._relay as app_module

    def broken(*_args, **_kw):
        raise RuntimeError("boom")

    async def scenario():
        async with Harness() as h:
            monkeypatch.setattr(app_module, "history_digest", broken)
            async with h.session.post(h.proxy.url + CHAT, headers=CLIENT_KEY,
                                      data=chat_body(stream=True)) as response:
                assert response.status == 200
                events = parse_sse(await response.read())
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["type"] == "internal_error"
            status, out = await h.post({"messages": [{"role": "user", "content": "q"}]})
            assert status == 500 and out["error"]["type"] == "internal_error"
            monkeypatch.undo()
            status, _ = await h.post({"messages": [{"role": "user", "content": "q"}]})
            assert status == 200
    run(scenario())


# ---------------------------------------------------------------------- defect 8


def turn_table(proxy):
    from kvobs.turns.correlate import turns_from_spans
    from kvobs.emit.otlp_json import spans_to_otlp_json
    from kvobs.sources._frame import frame_from_rows
    from kvobs.sources.otlp_json import spans_from_request

    rows = list(spans_from_request(json.loads(spans_to_otlp_json(proxy.spans()))))
    return turns_from_spans(frame_from_rows(rows))


def test_client_traceparent_never_merges_turns():
    """The client's trace goes on (#27): every turn sent with one traceparent is in the
    client's trace, its SERVER span the client span's child; still six turns of six
    conversations (each new id names its turn's span too), never one merged turn."""
    async def scenario():
        async with Harness() as h:
            client = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            client_trace, client_span = client.split("-")[1:3]
            for text in ("first question", "an unrelated question", "a third one"):
                for path, body in ((CHAT, {"messages": [{"role": "user", "content": text}]}),
                                   ("/v1/completions", {"prompt": text})):
                    status, _ = await h.post(body, path=path,
                                             headers={"traceparent": client})
                    assert status == 200
            await asyncio.sleep(0.02)
            table = turn_table(h.proxy)  # what `kvobs turns` lists
            assert len(table) == 6
            assert table["conversation_id"].nunique() == 6
            turns = h.proxy.spans(TURN)
            assert len(turns) == 6
            assert {format(t.context.trace_id, "032x") for t in turns} == {client_trace}
            servers = {s.context.span_id: s for s in h.proxy.spans()
                       if s.kind is SpanKind.SERVER}
            for turn in turns:
                server = servers[turn.parent.span_id]
                assert format(server.parent.span_id, "016x") == client_span
                assert server.parent.is_remote and not turn.links
            # the engines got the turn's context: the client's trace, the turn's span
            turn_spans = {format(t.context.span_id, "016x") for t in turns}
            for headers in h.prefill.headers + h.decode.headers:
                _, trace_id, parent, _ = headers["traceparent"].split("-")
                assert trace_id == client_trace and parent in turn_spans
    run(scenario())


# ---------------------------------------------------------------------- defect 9


async def ready(h: Harness) -> tuple[int, dict]:
    async with h.session.get(h.proxy.url + "/ready") as response:
        return response.status, await response.json()


async def health(h: Harness) -> tuple[int, dict]:
    """/health once its first round of engine probes is in ("unknown" until then)."""
    for _ in range(40):
        async with h.session.get(h.proxy.url + "/health") as response:
            status, out = response.status, await response.json()
        if out.get("upstreams") != "unknown":
            break
        await asyncio.sleep(0.05)
    return status, out


def test_health_never_waits_on_a_hung_engine():
    async def scenario():
        async with Harness(ready_timeout_s=2) as h:
            async def hang(_request):
                await asyncio.sleep(5)
                return web.Response()
            h.prefill.health = hang
            started = time.monotonic()
            async with h.session.get(h.proxy.url + "/health") as response:
                out = await response.json()
            assert response.status == 200 and time.monotonic() - started < 1
            assert out["status"] == "ok" and out["upstreams"] == "unknown"
    run(scenario())


def test_ready_is_this_proxy_and_engines_are_health_detail_and_gauge():
    """/ready: this proxy can serve (up, store usable); an engine's outage is not the
    replica's (it would pull every replica at once): /health's detail and a gauge."""
    async def scenario():
        async with Harness(ready_cache_s=0, ready_timeout_s=0.3) as h:
            status, out = await ready(h)
            assert status == 200 and out["status"] == "ready", out
            assert [c["check"] for c in out["checks"]] == ["store"]
            status, out = await health(h)
            assert status == 200 and out["upstreams"] == "ok"
            assert {c["check"] for c in out["checks"]} == {"prefill", "decode"}
            up = "kvobs_proxy_upstream_up"
            decode = {"role": "decode", "endpoint": f"127.0.0.1:{h.decode.port}"}
            assert h.proxy.metric(up, decode) == 1
            await h.decode.stop()
            status, out = await ready(h)
            assert status == 200 and out["status"] == "ready"  # still serves (502s)
            status, out = await health(h)
            assert status == 200 and out["status"] == "ok"  # liveness: the process serves
            assert out["upstreams"] == "degraded"
            failed = [c for c in out["checks"] if not c["ok"]]
            assert [c["check"] for c in failed] == ["decode"] and failed[0]["error"]
            async with h.session.get(h.proxy.url + "/metrics") as response:
                assert response.status == 200
            assert h.proxy.metric(up, decode) == 0
            assert h.proxy.metric(up, {"role": "prefill",
                                       "endpoint": f"127.0.0.1:{h.prefill.port}"}) == 1
            # a hung engine: the probe gives up at its timeout

            async def hang(_request):
                await asyncio.sleep(5)
                return web.Response()
            h.prefill.health = hang
            # liveness never waits on a hung engine: the last answer at once, the new one
            # once the probe gave up (ready_timeout_s)
            deadline = time.monotonic() + 3
            while True:
                started = time.monotonic()
                status, out = await health(h)
                assert status == 200 and time.monotonic() - started < 0.6
                failed = {c["check"] for c in out["checks"] if not c["ok"]}
                if failed == {"prefill", "decode"} or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert failed == {"prefill", "decode"}
    run(scenario())


def test_health_answer_is_cached():
    async def scenario():
        async with Harness(ready_cache_s=30) as h:
            assert (await health(h))[1]["upstreams"] == "ok"
            await h.decode.stop()
            assert (await health(h))[1]["upstreams"] == "ok"  # within the cache window
    run(scenario())


def test_ready_checks_redis(redis_url):
    import redis

    async def scenario():
        async with Harness(ready_cache_s=0, ready_timeout_s=0.3, store_backend="redis",
                           redis_url=redis_url) as h:
            status, out = await ready(h)
            assert status == 200, out
            (store,) = [c for c in out["checks"] if c["check"] == "store"]
            assert store["ok"] and store["target"] == "redis"
            client = redis.Redis.from_url(redis_url)
            client.client_pause(1500)
            try:
                started = time.monotonic()
                status, out = await ready(h)
                assert status == 503 and time.monotonic() - started < 1.2
                (store,) = [c for c in out["checks"] if c["check"] == "store"]
                assert not store["ok"]
            finally:
                client.client_unpause()
                client.close()
    run(scenario())
