"""kvobs.emit.engine_http: the engines' HTTP front door timed, as an ASGI middleware run
around a stand-in ASGI app (the real one, vLLM's API server, runs in the testbed)."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from kvobs import semconv as sc
from kvobs.emit.engine_http import EngineHttpTiming, request_id_header


def test_a_request_keeps_its_usable_x_request_id_else_gets_one():
    kept, headers = request_id_header([(b"X-Request-Id", b"abc-1"), (b"host", b"p")])
    assert (kept, headers) == ("abc-1", None)
    for bad in (b"", b"\xff\xfe", b"x" * 300, b"a\nb"):
        fresh, headers = request_id_header([(b"x-request-id", bad), (b"host", b"p")])
        assert len(fresh) == 32 and fresh.isalnum()
        assert headers == [(b"host", b"p"), (b"x-request-id", fresh.encode())]
    fresh, headers = request_id_header([])
    assert headers == [(b"x-request-id", fresh.encode())]


class _App:
    """An ASGI app reading its request whole and answering in chunks (a stream's last,
    empty, one after a pause); remembers the request id vLLM would have used."""

    def __init__(self, fail: bool = False, status: int = 200, answer=(b"data: 1",)):
        self.fail, self.status, self.answer = fail, status, answer
        self.seen_id: str | None = None
        self.calls = 0
        self.last_byte_ns = 0

    async def __call__(self, scope, receive, send):
        import time

        self.calls += 1
        self.seen_id = dict(scope["headers"]).get(b"x-request-id", b"").decode()
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": self.status, "headers": []})
        for chunk in self.answer:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await asyncio.sleep(0.02)
        if self.fail:
            raise RuntimeError("engine died mid-answer")
        self.last_byte_ns = time.time_ns()
        await send({"type": "http.response.body", "body": b"data: [DONE]", "more_body": True})
        await asyncio.sleep(0.03)
        await send({"type": "http.response.body", "body": b""})


def _serve(app, path="/v1/chat/completions", headers=(), tracer=None, body=(b"{}",)):
    middleware = EngineHttpTiming(app)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    middleware._tracer = tracer or provider.get_tracer("test")
    sent: list[dict] = []

    chunks = list(body)

    async def receive():
        chunk = chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "headers": list(headers), "method": "POST"}
    asyncio.run(middleware(scope, receive, send))
    return exporter.get_finished_spans(), sent


def test_a_completion_is_timed_from_arrival_to_its_last_byte_under_vllm_s_id():
    traceparent = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    app = _App()
    spans, sent = _serve(app, headers=[(b"traceparent", traceparent)])
    (span,) = spans
    assert span.name == sc.ENGINE_HTTP_SPAN
    assert span.attributes[sc.VLLM_REQUEST_ID.key] == "chatcmpl-" + app.seen_id
    assert span.attributes[sc.HTTP_STATUS] == 200
    assert span.attributes[sc.HTTP_ROUTE] == "/v1/chat/completions"
    # the answer's last byte: its last non-empty chunk, not the empty one that ends it
    assert span.end_time >= app.last_byte_ns and span.end_time < app.last_byte_ns + 20_000_000
    assert span.parent is not None and span.parent.span_id == 0xB7AD6B7169203331
    assert span.status.status_code is not StatusCode.ERROR
    assert [m["type"] for m in sent] == ["http.response.start", *["http.response.body"] * 3]
    # nothing but ids, route and status
    assert set(span.attributes) == {sc.VLLM_REQUEST_ID.key, sc.HTTP_STATUS, sc.HTTP_ROUTE}


def test_a_completion_route_keeps_the_client_s_id_and_other_routes_pass_untimed():
    app = _App()
    spans, _ = _serve(app, path="/v1/completions", headers=[(b"x-request-id", b"mine")])
    assert app.seen_id == "mine"
    assert spans[0].attributes[sc.VLLM_REQUEST_ID.key] == "cmpl-mine"
    spans, _ = _serve(_App(), path="/health")
    assert spans == ()


def test_an_answer_cut_short_is_an_error_span_and_the_error_goes_on():
    with pytest.raises(RuntimeError, match="mid-answer"):
        _serve(_App(fail=True))
    app = _App(status=503)
    spans, _ = _serve(app)
    assert spans[0].status.status_code is StatusCode.ERROR


def test_a_broken_tracer_never_breaks_serving():
    class Broken:
        def start_span(self, *args, **kwargs):
            raise OSError("disk full")

    app = _App()
    spans, sent = _serve(app, tracer=Broken())
    assert app.calls == 1 and len(sent) == 4


def test_the_turn_s_shard_is_found_in_p_s_answer_or_d_s_request():
    """The shard the connector puts in P's kv_transfer_params: in P's answer, and in D's
    request (split between two chunks here) when the router passes P's params on."""
    key = sc.KTP_SHARD.encode()
    p_answer = (b'{"choices":[{"text":"x"}],"kv_transfer_params":{"a":1,', b'"' + key +
                b'": "t0/00ab12cd34ef5678"}}',)
    spans, _ = _serve(_App(answer=p_answer))
    assert spans[0].attributes[sc.SHARD.key] == "t0/00ab12cd34ef5678"
    d_request = (b'{"prompt":"' + b"y" * 5000 + b'","kv_transfer_params":{"kvobs_sh',
                 b'ard":"00ab12cd34ef5678","remote_block_ids":[1]}}')
    spans, _ = _serve(_App(), path="/v1/completions", body=d_request)
    assert spans[0].attributes[sc.SHARD.key] == "00ab12cd34ef5678"
    # a long prompt is looked through at its head and tail only (the params are not
    # inside it): after it, in the last of many chunks, is found; inside it is not
    prompt = b"y" * (64 * 1024)
    tail = b'"kvobs_shard":"0011223344556677"}}'
    spans, _ = _serve(_App(), body=(b'{"prompt":"', prompt, prompt, b'",' + tail))
    assert spans[0].attributes[sc.SHARD.key] == "0011223344556677"
    spans, _ = _serve(_App(), body=(b'{"prompt":"' + prompt + tail + prompt + b'"}',))
    assert sc.SHARD.key not in spans[0].attributes
    # a value of other characters is not taken
    spans, _ = _serve(_App(), body=(b'{"kvobs_shard":"a b"}',))
    assert sc.SHARD.key not in spans[0].attributes
