"""The engine legs: P's prefill (with its one fallback), D's decode, whole or streamed.

``Legs`` owns the connections to the engines. A leg that fails before the client got a
byte raises ``UpstreamError`` (``turn`` answers it); once a stream has started, a failure
ends the stream with an SSE error event and ``[DONE]``. ``finish`` (the store, in
``turn``) runs before the client gets the end of D's answer, so a client that starts its
next turn at once finds this turn's params stored.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web
from opentelemetry import trace

from kvobs import semconv as sc
from kvobs.emit.spans import Correlation, emit

from kvobs.proxy import decide
from kvobs.proxy._digest import history_digest
from kvobs.proxy._http_spans import ClientLeg
from kvobs.proxy._log import log
from kvobs.proxy._metrics import ProxyMetrics
from kvobs.proxy._sse import DONE, StreamCollector, answer_facts
from kvobs.proxy._state import TurnState, UpstreamError
from kvobs.proxy.config import Endpoint, ProxyConfig

_LOG = logging.getLogger("kvobs.proxy")
_PREFILL_DROP = ("max_completion_tokens", "min_tokens", "stream_options")
KTP = "kv_transfer_params"
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


def retry_cause(error: aiohttp.ClientConnectionError) -> sc.UpstreamRetryCause:
    """What failed before the engine answered a byte."""
    if isinstance(error, aiohttp.ClientConnectorError):
        return sc.UpstreamRetryCause.REFUSED
    if isinstance(error, aiohttp.ClientOSError):
        return sc.UpstreamRetryCause.RESET
    return sc.UpstreamRetryCause.DISCONNECTED


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


class Legs:
    def __init__(self, config: ProxyConfig, tracer: trace.Tracer, metrics: ProxyMetrics):
        self.config, self.tracer, self.metrics = config, tracer, metrics
        self.session: aiohttp.ClientSession | None = None
        self.fresh_session: aiohttp.ClientSession | None = None  # retries: a new connection
        self._prefill = itertools.cycle(config.prefill)
        self._decode = itertools.cycle(config.decode)

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0, ttl_dns_cache=300, keepalive_timeout=self.config.upstream_keepalive_s
        )
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self.fresh_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, force_close=True),
            auto_decompress=False,
        )

    async def stop(self) -> None:
        for session in (self.session, self.fresh_session):
            if session is not None:
                await session.close()

    def next_decode(self) -> Endpoint:
        return next(self._decode)

    def _timeout(self, read_s: float) -> aiohttp.ClientTimeout:
        connect = self.config.connect_timeout_s
        return aiohttp.ClientTimeout(
            total=None, connect=connect, sock_connect=connect, sock_read=read_s
        )

    def _leg(self, role: str, endpoint: Endpoint, path: str, state: TurnState) -> ClientLeg:
        return ClientLeg(
            self.tracer,
            state.http_context,
            role,
            endpoint.host,
            endpoint.port,
            endpoint.base_url + path,
        )

    async def _send(
        self,
        role: str,
        url: str,
        data: str,
        headers: dict[str, str],
        timeout: aiohttp.ClientTimeout,
        leg: ClientLeg,
    ) -> aiohttp.ClientResponse:
        """POST ``data`` to an engine; the response once its headers are in.

        A connection that failed before any response byte (a pooled connection the
        engine was closing, a reset, a refused connect) cannot have started an answer:
        the request goes once more, on a fresh connection. Nothing is retried once the
        engine has answered, nor after a timeout (the leg's wait is spent)."""
        try:
            return await self.session.post(url, data=data, headers=headers, timeout=timeout)
        except asyncio.TimeoutError:
            raise
        except aiohttp.ClientConnectionError as error:
            cause = retry_cause(error)
            reason = str(error) or type(error).__name__
        self.metrics.upstream_retries.labels(role, cause.value).inc()
        leg.retried(cause.value)
        log(
            _LOG,
            logging.WARNING,
            "engine connection failed before any response; sent once more on a fresh connection",
            role=role,
            url=url,
            cause=cause.value,
            error=reason,
        )
        return await self.fresh_session.post(url, data=data, headers=headers, timeout=timeout)

    # ------------------------------------------------------------------ prefill

    def _prefill_body(
        self, body: dict[str, Any], params: dict[str, Any] | None, keys: dict[str, Any]
    ) -> dict[str, Any]:
        p_body = dict(body)
        p_body["stream"] = False
        p_body["max_tokens"] = 1
        for name in _PREFILL_DROP:
            p_body.pop(name, None)
        p_body[KTP] = decide.prefill_params(params, keys)
        return p_body

    async def _post_prefill(
        self,
        endpoint: Endpoint,
        path: str,
        payload: dict[str, Any],
        headers: dict[str, str],
        state: TurnState,
    ) -> dict[str, Any]:
        timeout = self._timeout(self.config.prefill_read_timeout_s)
        leg = self._leg("prefill", endpoint, path, state)
        status = error = None
        try:
            response = await self._send(
                "prefill", endpoint.base_url + path, json.dumps(payload), headers, timeout, leg
            )
            async with response:
                status = response.status
                raw = await response.read()
        except asyncio.TimeoutError:
            error = "timeout"
            raise UpstreamError("prefill", "timeout", PE.PREFILL_ERROR, 504) from None
        except aiohttp.ClientError:
            error = "unreachable" if status is None else "disconnected"
            raise UpstreamError("prefill", "unreachable", PE.PREFILL_UNREACHABLE) from None
        except BaseException:
            error = "cancelled"
            raise
        finally:
            leg.end(status, error)
        if status != 200:
            raise UpstreamError("prefill", "http-error", PE.PREFILL_ERROR, status, raw)
        try:
            return json.loads(raw)
        except ValueError:
            raise UpstreamError("prefill", "http-error", PE.PREFILL_ERROR) from None

    async def prefill(
        self,
        path: str,
        body: dict[str, Any],
        params: dict[str, Any] | None,
        keys: dict[str, Any],
        headers: dict[str, str],
        state: TurnState,
        correlation: Correlation,
    ) -> tuple[Any, Endpoint]:
        """P's answer and the endpoint that gave it. P failing a read of ``params`` (a
        5xx) is retried once without them: P recomputes."""
        endpoint = next(self._prefill)
        started = time.perf_counter()
        state.p_sent = time.time()
        try:
            try:
                response = await self._post_prefill(
                    endpoint, path, self._prefill_body(body, params, keys), headers, state
                )
            except UpstreamError as error:
                if not decide.falls_back(bool(params), error.kind, error.status):
                    raise
                reason = state.fallback = decide.fallback_reason(error.body)
                self.metrics.upstream_errors.labels("prefill", error.kind).inc()
                self.metrics.fallbacks.labels(reason.value).inc()
                log(
                    _LOG,
                    logging.WARNING,
                    "engine failed a read; retried without params",
                    role="prefill",
                    cause=f"answered {error.status}",
                    reason=reason.value,
                    request_id=state.request_id,
                )
                fallback_start = time.time_ns()
                state.p_retry_sent = fallback_start / 1e9
                state.params_sent = False
                try:
                    response = await self._post_prefill(
                        endpoint, path, self._prefill_body(body, None, keys), headers, state
                    )
                finally:
                    emit(
                        self.tracer,
                        sc.SPAN_PROXY_FALLBACK,
                        correlation,
                        {sc.FALLBACK_REASON.key: reason, sc.HTTP_STATUS: error.status},
                        start_ns=fallback_start,
                    )
            return response, endpoint
        finally:
            state.p_answered = time.time()
            state.prefill_s = time.perf_counter() - started

    # ------------------------------------------------------------------ decode

    async def _open_decode(self, endpoint, path, d_body, headers, leg: ClientLeg):
        """D's response, its status 200; a failure ends ``leg`` (the CLIENT span)."""
        timeout = self._timeout(self.config.decode_read_timeout_s)
        try:
            response = await self._send(
                "decode", endpoint.base_url + path, json.dumps(d_body), headers, timeout, leg
            )
        except asyncio.TimeoutError:
            leg.end(error="timeout")
            raise UpstreamError("decode", "timeout", PE.DECODE_ERROR, 504) from None
        except aiohttp.ClientError:
            leg.end(error="unreachable")
            raise UpstreamError("decode", "unreachable", PE.DECODE_UNREACHABLE) from None
        if response.status != 200:
            try:
                raw = await response.read()
            except aiohttp.ClientError:
                raw = b""
            finally:
                response.release()
            leg.end(response.status)
            raise UpstreamError("decode", "http-error", PE.DECODE_ERROR, response.status, raw)
        return response

    async def decode(
        self,
        request: web.Request,
        path: str,
        d_body: dict[str, Any],
        endpoint: Endpoint,
        headers: dict[str, str],
        state: TurnState,
        finish: Finish,
    ) -> web.StreamResponse:
        leg = self._leg("decode", endpoint, path, state)
        started = time.perf_counter()
        state.d_sent = time.time()
        try:
            try:
                response = await self._open_decode(endpoint, path, d_body, headers, leg)
            except UpstreamError:
                state.decode_s = time.perf_counter() - started
                raise
            if state.stream:
                return await self._relay_stream(
                    request, response, d_body, state, finish, leg, started
                )
            return await self._relay_whole(request, response, d_body, state, finish, leg, started)
        finally:
            leg.end(error="cancelled")  # ended already, unless the turn was cut short

    async def _relay_whole(
        self,
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
        await finish(
            params if isinstance(params, dict) else None, digest, state.d_sent, answered_wall
        )
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

    async def _relay_stream(
        self,
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
            self.metrics.upstream_errors.labels("decode", "disconnected").inc()
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
            history_digest(d_body, collector.message(), collector.text())
            if collector.single
            else None
        )
        if collector.params is not None:
            state.source = sc.ParamsSource.STREAM
        await finish(collector.params, digest, state.d_sent, answered_wall)
        # [DONE] goes out only now: a client that starts its next turn the moment this
        # stream ends finds this turn's params already stored.
        try:
            await to_client(client.write(DONE + b"\n\n"))
            await to_client(client.write_eof())
        except ClientGone:
            state.error = PE.CLIENT_DISCONNECTED
        return client
