"""Every span the proxy sets to ERROR says why in its status description (#27): the
role, the HTTP status or the cause, never request text."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from harness import Harness
from opentelemetry.trace import SpanKind, StatusCode
from test_proxy_flow import run

from kvobs import semconv as sc

SECRET = "the-prompt-must-never-be-in-a-status"


def _failed(spans):
    """(name or leg, description) of each span whose status is ERROR."""
    return [
        (span.attributes.get(sc.PROXY_LEG) or span.kind.name, span.status.description)
        for span in spans
        if span.status.status_code is StatusCode.ERROR
    ]


def _http(h):
    return [s for s in h.proxy.spans() if s.kind in (SpanKind.SERVER, SpanKind.CLIENT)]


def _ask(conversation: str, stream: bool = False) -> dict:
    return {"messages": [{"role": "user", "content": SECRET}],
            "conversation_id": conversation, "stream": stream}


def test_upstream_unreachable_and_5xx_say_why():
    async def scenario():
        async with Harness() as h:
            await h.prefill.stop()
            status, _ = await h.post(_ask("u"))
            assert status == 502
            await asyncio.sleep(0.02)
            assert _failed(_http(h)) == [
                ("prefill", "prefill engine unreachable"),
                ("SERVER", "answered HTTP 502: prefill-unreachable"),
            ]
            (turn,) = h.proxy.spans(sc.SPAN_PROXY_TURN.name)
            assert turn.status.description == "prefill-unreachable"
            await h.prefill.start()

            async def broken(request, body):
                return web.json_response({"error": {"message": "boom"}}, status=503)

            h.decode.answer = broken
            h.proxy.exporter.clear()
            status, _ = await h.post(_ask("v"))
            await asyncio.sleep(0.02)
            assert _failed(_http(h)) == [
                ("decode", "decode engine answered HTTP 503"),
                ("SERVER", f"answered HTTP {status}: decode-error"),
            ]
            statuses = json.dumps([s.status.description for s in h.proxy.spans()])
            assert SECRET not in statuses
    run(scenario())


def test_client_disconnect_says_so():
    async def scenario():
        async with Harness(decode_kw={"chunks": 50, "chunk_delay_s": 0.01}) as h:
            async with aiohttp.ClientSession() as session:
                async with session.post(h.proxy.url + "/v1/chat/completions",
                                        data=json.dumps(_ask("d", stream=True))) as response:
                    await response.content.readline()
            await asyncio.sleep(0.3)
            failed = dict(_failed(_http(h)))
            assert failed["SERVER"].endswith("client-disconnected"), failed
            assert failed["decode"].startswith("decode engine cancelled"), failed
    run(scenario())
