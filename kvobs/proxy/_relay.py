"""D's answer to the client, whole or streamed, and the store before its end.

A failure once a stream has started ends the stream with an SSE error event and
``[DONE]``. ``finish`` (the store, in ``turn``) runs before the client gets the end of
D's answer, so a client that starts its next turn at once finds this turn's params
stored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web

from kvobs import semconv as sc

from kvobs.proxy._digest import history_digest
from kvobs.proxy._http_spans import ClientLeg
from kvobs.proxy._log import log
from kvobs.proxy._metrics import ProxyMetrics
from kvobs.proxy._sse import DONE, KTP, StreamCollector, answer_facts
from kvobs.proxy._state import TurnState, UpstreamError

_LOG = logging.getLogger("kvobs.proxy")
PE = sc.ProxyError
# finish(params, digest, sent_wall, answered_wall): store D's params (``turn``).
Finish = Callable[[dict[str, Any] | None, dict[str, Any] | None, float, float], Awaitable[None]]


def sse_error(message: str, type_: str = "upstream_error", code: int = 502) -> bytes:
    event = {"error": {"message": message, "type": type_, "code": code}}
    return b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"


class ClientGone(Exception):
    """The client went away while its answer was being written."""


async def to_client(awaitable) -> None:
    try:
        await awaitable
    except (ConnectionError, aiohttp.ClientConnectionResetError, RuntimeError):
        raise ClientGone from None


def _first_choice(result: Any) -> tuple[dict[str, Any] | None, str | None, bool]:
    """The first choice's message and text, and whether it is the only choice."""
    choices = result.get("choices") if isinstance(result, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None, None, False
    message, text = choices[0].get("message"), choices[0].get("text")
    return (
        message if isinstance(message, dict) else None,
        text if isinstance(text, str) else None,
        len(choices) == 1,
    )


async def relay_whole(
    request,
    response,
    d_body,
    state: TurnState,
    finish: Finish,
    leg: ClientLeg,
    started: float,
):
    try:
        raw = await response.read()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        leg.end(200, "disconnected")
        state.decode_s = time.perf_counter() - started
        raise UpstreamError("decode", "disconnected", PE.DECODE_DISCONNECTED) from None
    finally:
        response.release()
    leg.end(200)
    answered_wall = state.d_answered = time.time()
    state.decode_s = time.perf_counter() - started
    try:
        result = json.loads(raw)
    except ValueError:
        raise UpstreamError("decode", "http-error", PE.DECODE_ERROR) from None
    params = result.pop(KTP, None) if isinstance(result, dict) else None
    answer_facts(result, state)
    message, text, single = _first_choice(result)
    digest = history_digest(d_body, message, text) if single else None
    if isinstance(params, dict):
        state.source = sc.ParamsSource.BODY
    assert state.d_sent is not None  # set as D was sent the turn (legs)
    await finish(params if isinstance(params, dict) else None, digest, state.d_sent, answered_wall)
    answer = web.Response(
        body=json.dumps(result).encode(), status=200, content_type="application/json"
    )
    # Sent here, not after the handler returns: the turn's span (proxy-out) holds the
    # write, so a proxy busy elsewhere at that moment is time kvobs accounts.
    try:
        await to_client(answer.prepare(request))
        await to_client(answer.write_eof())
    except ClientGone:
        state.error = PE.CLIENT_DISCONNECTED
    return answer


async def relay_stream(
    metrics: ProxyMetrics,
    request,
    response,
    d_body,
    state: TurnState,
    finish: Finish,
    leg: ClientLeg,
    started: float,
):
    client = state.client = web.StreamResponse(
        status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    collector = StreamCollector(state)
    done = False
    try:
        await to_client(client.prepare(request))
        buffer = b""
        async for chunk in response.content.iter_any():
            buffer += chunk
            cut = buffer.rfind(b"\n") + 1
            if not cut:
                continue
            lines, buffer = buffer[:cut], buffer[cut:]
            out, done = collector.feed(lines)
            collector.first_output(state)
            await to_client(client.write(out))
        if buffer:
            out, done = collector.feed(buffer + b"\n")
            collector.first_output(state)
            await to_client(client.write(out))
        if not done:
            raise aiohttp.ClientPayloadError("decode stream ended without [DONE]")
    except ClientGone:
        state.error = PE.CLIENT_DISCONNECTED
        response.close()
        leg.end(200, "cancelled")
        state.decode_s = time.perf_counter() - started
        return client
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        state.error = PE.DECODE_DISCONNECTED
        metrics.upstream_errors.labels("decode", "disconnected").inc()
        log(
            _LOG,
            logging.WARNING,
            "engine failed mid-stream; the client got an error event",
            role="decode",
            cause="disconnected",
            error=type(error).__name__,
            request_id=state.request_id,
        )
        response.close()
        leg.end(200, "disconnected")
        state.decode_s = time.perf_counter() - started
        try:
            await to_client(client.write(sse_error("decode engine failed mid-stream")))
            await to_client(client.write_eof())
        except ClientGone:
            pass
        return client
    finally:
        response.release()
    leg.end(200)
    answered_wall = state.d_answered = time.time()
    state.decode_s = time.perf_counter() - started
    digest = (
        history_digest(d_body, collector.message(), collector.text()) if collector.single else None
    )
    if collector.params is not None:
        state.source = sc.ParamsSource.STREAM
    assert state.d_sent is not None  # set as D was sent the turn (legs)
    await finish(collector.params, digest, state.d_sent, answered_wall)
    # [DONE] goes out only now: a client that starts its next turn the moment this
    # stream ends finds this turn's params already stored.
    try:
        await to_client(client.write(DONE + b"\n\n"))
        await to_client(client.write_eof())
    except ClientGone:
        state.error = PE.CLIENT_DISCONNECTED
    return client
