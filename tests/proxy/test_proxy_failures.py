"""Failures never reach the user as reuse errors; bad input gets a clear 4xx; proxy stays up."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from harness import Harness
from test_proxy_flow import converse, outcomes, run

from kvobs import semconv as sc

FALLBACK = sc.SPAN_PROXY_FALLBACK.name
TURN = sc.SPAN_PROXY_TURN.name


async def healthy(h: Harness) -> bool:
    async with h.session.get(h.proxy.url + "/health") as response:
        return response.status == 200 and (await response.json())["status"] == "ok"


def test_declined_read_falls_back_to_recompute_and_answers():
    async def scenario():
        async with Harness() as h:
            messages, _ = await converse(h, "f", 1)
            h.state.clock_offset += h.state.ttl_s - 3  # D's blocks now 3 s from expiry
            messages.append({"role": "user", "content": "next"})
            status, out = await h.post({"messages": messages, "conversation_id": "f"})
            assert status == 200 and out["choices"][0]["message"]["content"]
            assert outcomes(h.proxy) == ["miss", "hit"]
            # P saw the params once (declined), then the retry without them
            assert h.prefill.requests[1]["kv_transfer_params"]["remote_block_ids"] == [[100]]
            assert h.prefill.requests[2]["kv_transfer_params"]["remote_block_ids"] is None
            await asyncio.sleep(0.02)
            (fallback,) = h.proxy.spans(FALLBACK)
            assert fallback.attributes[sc.FALLBACK_REASON.key] == "read-declined"
            turn = h.proxy.spans(TURN)[-1]
            assert fallback.parent.span_id == turn.context.span_id
            assert turn.attributes[sc.FALLBACK_REASON.key] == "read-declined"
            assert turn.attributes[sc.PARAMS_SENT.key] is False
            assert h.proxy.metric("kvobs_proxy_fallbacks_total",
                                  {"reason": "read-declined"}) == 1
    run(scenario())


def test_failed_read_falls_back_to_recompute():
    async def scenario():
        async with Harness() as h:
            messages, _ = await converse(h, "f", 1)
            h.state.retained.clear()  # D lost the blocks
            messages.append({"role": "user", "content": "next"})
            status, _ = await h.post({"messages": messages, "conversation_id": "f",
                                      "stream": True})
            assert status == 200
            await asyncio.sleep(0.02)
            (fallback,) = h.proxy.spans(FALLBACK)
            assert fallback.attributes[sc.FALLBACK_REASON.key] == "read-failed"
    run(scenario())


def test_decode_killed_mid_stream_gives_clean_error_event():
    async def scenario():
        async with Harness(decode_kw={"die_after_chunks": 2, "chunk_delay_s": 0.01}) as h:
            status, events = await h.post({"messages": [{"role": "user", "content": "q"}],
                                           "conversation_id": "k", "stream": True})
            assert status == 200
            assert [e for e in events if isinstance(e, dict) and "choices" in e]  # got some
            assert events[-2]["error"]["type"] == "upstream_error"
            assert events[-1] == "[DONE]"
            await asyncio.sleep(0.02)
            (turn,) = h.proxy.spans(TURN)
            assert turn.attributes[sc.PROXY_ERROR.key] == "decode-disconnected"
            assert not turn.status.is_ok
            assert h.proxy.metric("kvobs_proxy_upstream_errors_total",
                                  {"role": "decode", "kind": "disconnected"}) == 1
            # nothing stored for the broken turn; the proxy is still serving
            assert h.proxy.metric("kvobs_proxy_stores_total",
                                  {"action": "skipped", "source": "none"}) is not None
            assert await healthy(h)
            h.decode.die_after_chunks = None
            status, events = await h.post({"messages": [{"role": "user", "content": "q"}],
                                           "conversation_id": "k2", "stream": True})
            assert status == 200 and events[-1] == "[DONE]"
    run(scenario())


def test_decode_killed_non_streaming_gives_502():
    async def scenario():
        async with Harness() as h:
            await h.decode.stop()
            status, out = await h.post({"messages": [{"role": "user", "content": "q"}]})
            assert status == 502 and out["error"]["message"] == "decode engine unreachable"
            assert await healthy(h)
    run(scenario())


def test_prefill_unreachable_gives_502_and_proxy_stays_up():
    async def scenario():
        async with Harness() as h:
            await h.prefill.stop()
            status, out = await h.post({"messages": [{"role": "user", "content": "q"}],
                                        "conversation_id": "u"})
            assert status == 502
            assert out["error"]["message"] == "prefill engine unreachable"
            await asyncio.sleep(0.02)
            (turn,) = h.proxy.spans(TURN)
            assert turn.attributes[sc.PROXY_ERROR.key] == "prefill-unreachable"
            assert h.proxy.metric("kvobs_proxy_upstream_errors_total",
                                  {"role": "prefill", "kind": "unreachable"}) == 1
            assert await healthy(h)
    run(scenario())


def test_engine_4xx_passes_through():
    async def scenario():
        async with Harness() as h:
            async def refuse(request, body):
                from aiohttp import web
                return web.json_response({"error": {"message": "bad model"}}, status=404)
            h.prefill.answer = refuse
            status, out = await h.post({"messages": [], "model": "nope"})
            assert status == 404 and out["error"]["message"] == "bad model"
    run(scenario())


def test_bad_input_gets_clear_4xx():
    async def scenario():
        async with Harness(max_body_bytes=4096, max_id_length=16) as h:
            cases = [
                (b"{not json", 400, "bad-json"),
                (b"[1, 2]", 400, "not-an-object"),
                (json.dumps({"messages": [], "stream": "yes"}).encode(), 400, "bad-field"),
                (json.dumps({"messages": [], "conversation_id": "x" * 17}).encode(), 400,
                 "conversation-id-too-long"),
                (json.dumps({"messages": [], "conversation_id": 5}).encode(), 400,
                 "bad-conversation-id"),
                (json.dumps({"prompt": "a" * 5000}).encode(), 413, "body-too-large"),
            ]
            for raw, status, reason in cases:
                got, out = await h.post(None, raw=raw)
                assert got == status, (raw[:40], got, out)
                assert out["error"]["type"] == "invalid_request_error"
                assert out["error"]["message"]
                assert h.proxy.metric("kvobs_proxy_rejected_requests_total",
                                      {"reason": reason}) >= 1
            # chunked upload without Content-Length, over the limit
            async def gen():
                for _ in range(10):
                    yield b"x" * 1000
            async with h.session.post(h.proxy.url + "/v1/completions", data=gen()) as r:
                assert r.status == 413
            assert h.prefill.requests == [] and h.decode.requests == []
            assert await healthy(h)
    run(scenario())


def test_client_disconnect_mid_stream_is_recorded():
    async def scenario():
        async with Harness(decode_kw={"chunks": 50, "chunk_delay_s": 0.01}) as h:
            body = json.dumps({"messages": [{"role": "user", "content": "q"}],
                               "stream": True, "conversation_id": "d"}).encode()
            async with aiohttp.ClientSession() as session:
                async with session.post(h.proxy.url + "/v1/chat/completions",
                                        data=body) as response:
                    await response.content.readline()
            await asyncio.sleep(0.3)
            (turn,) = h.proxy.spans(TURN)
            assert turn.attributes[sc.PROXY_ERROR.key] == "client-disconnected"
            assert await healthy(h)
    run(scenario())
