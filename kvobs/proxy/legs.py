"""The engine legs: P's prefill (with its one fallback), D's decode opened and handed
to ``_relay`` (D's answer to the client, whole or streamed).

``Legs`` owns the connections to the engines. A leg that fails before the client got a
byte raises ``UpstreamError`` (``turn`` answers it).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from opentelemetry import trace

from kvobs import semconv as sc
from kvobs.emit.spans import Correlation

from kvobs.proxy import decide
from kvobs.proxy._http_spans import ClientLeg
from kvobs.proxy._log import log
from kvobs.proxy._metrics import ProxyMetrics
from kvobs.proxy._relay import Finish, relay_stream, relay_whole
from kvobs.proxy._sse import KTP
from kvobs.proxy._state import TurnState, UpstreamError
from kvobs.proxy._turn_spans import emit_turn_span
from kvobs.proxy.config import Endpoint, ProxyConfig

_LOG = logging.getLogger("kvobs.proxy")
_PREFILL_DROP = ("max_completion_tokens", "min_tokens", "stream_options")
PE = sc.ProxyError


def retry_cause(error: aiohttp.ClientConnectionError) -> sc.UpstreamRetryCause:
    """What failed before the engine answered a byte."""
    if isinstance(error, aiohttp.ClientConnectorError):
        return sc.UpstreamRetryCause.REFUSED
    if isinstance(error, aiohttp.ClientOSError):
        return sc.UpstreamRetryCause.RESET
    return sc.UpstreamRetryCause.DISCONNECTED


def engine_body(payload: dict[str, Any]) -> bytes:
    """A leg's request body. orjson: the history a turn resends (kilobytes, all of it
    every turn) encodes several times faster than with json; json for what orjson
    refuses (an integer past 64 bits in a client's body). The client's body holds no
    NaN or Infinity (``_input.parse_body`` refuses them), which orjson would write as
    null.

    >>> engine_body({"max_tokens": 1})
    b'{"max_tokens":1}'
    >>> engine_body({"seed": 2**70})
    b'{"seed": 1180591620717411303424}'
    """
    try:
        return orjson.dumps(payload)
    except TypeError:
        return json.dumps(payload).encode()


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
            state.request_id,  # vLLM's id of the leg: gen_ai.request.id
        )

    async def _send(
        self,
        role: str,
        url: str,
        data: bytes,
        headers: dict[str, str],
        timeout: aiohttp.ClientTimeout,
        leg: ClientLeg,
    ) -> aiohttp.ClientResponse:
        """POST ``data`` to an engine; the response once its headers are in.

        A connection that failed before any response byte (a pooled connection the
        engine was closing, a reset, a refused connect) cannot have started an answer:
        the request goes once more, on a fresh connection. Nothing is retried once the
        engine has answered, nor after a timeout (the leg's wait is spent)."""
        session, fresh = self.session, self.fresh_session
        assert session is not None and fresh is not None  # start() ran: the app's start-up
        try:
            return await session.post(url, data=data, headers=headers, timeout=timeout)
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
        return await fresh.post(url, data=data, headers=headers, timeout=timeout)

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
                "prefill", endpoint.base_url + path, engine_body(payload), headers, timeout, leg
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
                    emit_turn_span(
                        self.tracer,
                        state,
                        sc.SPAN_PROXY_FALLBACK,
                        correlation,
                        {sc.FALLBACK_REASON.key: reason, sc.HTTP_STATUS: error.status},
                        fallback_start,
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
                "decode", endpoint.base_url + path, engine_body(d_body), headers, timeout, leg
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
                return await relay_stream(
                    self.metrics, request, response, d_body, state, finish, leg, started
                )
            return await relay_whole(request, response, d_body, state, finish, leg, started)
        finally:
            leg.end(error="cancelled")  # ended already, unless the turn was cut short
