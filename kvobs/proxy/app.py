"""The multi-turn P/D proxy as an aiohttp application.

One turn: look up the conversation's entry (tenant-scoped), send P the prefill request
(``max_tokens=1``, not streaming) with D's previous params when usable, send D the
request with P's params, relay D's answer (streamed as it arrives when the client asked
to stream), capture D's new params (response body, stream chunk, or the params
publisher) and store them with an expiry that ends before D's blocks do.

Every turn carries its correlation (conversation id, turn index, tenant digest,
traceparent) to P and D inside ``kv_transfer_params`` and as a W3C ``traceparent`` header.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from kvobs import semconv as sc
from kvobs.emit.spans import Correlation, clean, current_traceparent, emit
from kvobs.settings import entry_lifetime_s

from kvobs.proxy._clock import DecodeClock
from kvobs.proxy._digest import Prefixes, extends, history_digest
from kvobs.proxy._guard import Budget, StoreGuard
from kvobs.proxy._http_spans import ClientLeg, end_server, start_server
from kvobs.proxy._identity import (
    ANONYMOUS, Identity, InputError, conversation_of, tenant_of)
from kvobs.proxy._input import (
    UNREAD_BODY_REASONS, check_headers, parse_body, read_body)
from kvobs.proxy._metrics import ProxyMetrics
from kvobs.proxy._ready import Readiness
from kvobs.proxy.config import Endpoint, ProxyConfig
from kvobs.proxy.publisher import (
    NoPublisher, ParamsPublisher, RedisParamsPublisher)
from kvobs.proxy.store import (
    Entry, MemoryStore, MetadataStore, RedisStore)

_LOG = logging.getLogger("kvobs.proxy")
_PREFILL_DROP = ("max_completion_tokens", "min_tokens", "stream_options")
_KTP = "kv_transfer_params"
TRACE_ID_KEY = web.RequestKey("kvobs_trace_id", str)
# The conversation id the proxy gave a request that came without one (inferred or new).
ASSIGNED_ID_KEY = web.RequestKey("kvobs_assigned_conversation_id", str)
TRACE_ID_HEADER = sc.TRACE_ID_HEADER
_TURN_KEYS = frozenset((*sc.CORRELATION_KEYS, sc.KTP_REQUEST_ID))
_DONE = b"data: [DONE]"
PROXY_KEY = web.AppKey("kvobs_proxy", object)
# How the proxy must be served (run_proxy does; embedders pass these to web.AppRunner or
# web.run_app): a client that disconnects cancels its turn, so no engine keeps working for
# a client that left (no decode request after a client gave up during the prefill).
# A body refused unread (too large, too slow) is drained for at most lingering_time, then
# the connection closes (aiohttp's default waits 10 s on a client that stalls).
RUNNER_OPTIONS = {"handler_cancellation": True, "lingering_time": 1.0}
# The turn span starts its own trace (a client's traceparent becomes a link): kvobs keys
# an id-less turn by its trace, so turns that share a client's trace must not share one.
_NEW_TRACE = Context()

LO = sc.LookupOutcome
MR = sc.MissReason
PS = sc.ParamsSource
PE = sc.ProxyError


class _UpstreamError(Exception):
    def __init__(self, role: str, kind: str, error: sc.ProxyError, status: int = 502,
                 body: bytes | None = None):
        super().__init__(f"{role} {kind}")
        self.role, self.kind, self.error, self.status, self.body = role, kind, error, status, body


def _json_error(status: int, message: str, type_: str) -> web.Response:
    body = {"error": {"message": message, "type": type_, "code": status}}
    return web.json_response(body, status=status)


def _sse_error(message: str, type_: str = "upstream_error", code: int = 502) -> bytes:
    event = {"error": {"message": message, "type": type_, "code": code}}
    return b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"


def _has_blocks(params: dict[str, Any]) -> bool:
    blocks = params.get("remote_block_ids")
    if not blocks:
        return False
    return any(bool(group) for group in blocks) if isinstance(blocks[0], list) else True


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass
class _TurnState:
    """Facts gathered during one turn, turned into span attributes and metrics at the end."""

    stream: bool
    request_id: str
    start_wall: float
    start_perf: float
    conversation_id: str | None = None  # the client's, or the one the proxy gave it
    turn: int | None = None
    outcome: sc.LookupOutcome = LO.NO_ID
    params_sent: bool = False
    prompt_tokens: int | None = None
    output_tokens: int | None = None  # D's usage, when its answer carries one
    model: str | None = None  # the client's "model"
    response_id: str | None = None  # D's answer "id", as the client gets it
    prefill_s: float | None = None
    decode_s: float | None = None
    ttft_s: float | None = None  # streamed turns only: D's first bytes at the proxy
    # Timeline marks (wall clock, unix s): see sc.Phase and kvobs/timeline.py.
    p_sent: float | None = None
    p_retry_sent: float | None = None
    p_answered: float | None = None
    d_sent: float | None = None
    d_first_output: float | None = None
    d_answered: float | None = None
    source: sc.ParamsSource = PS.NONE
    error: sc.ProxyError | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    store_budget: Budget | None = None  # what the turn may still wait on the store
    http_context: Context | None = None  # the SERVER span's: its legs' CLIENT spans' parent


class _Proxy:
    def __init__(self, config: ProxyConfig, tracer: trace.Tracer, metrics: ProxyMetrics,
                 store: MetadataStore, publisher: ParamsPublisher):
        self.config = config
        self.tracer = tracer
        self.metrics = metrics
        self.store = store
        self.publisher = publisher
        # Redis (store and publisher) is bounded per turn and behind one breaker.
        self.guard = StoreGuard(metrics, store.backend, store.backend == "redis"
                                or publisher.name == "redis", config.redis_budget_s,
                                config.redis_breaker_failures,
                                config.redis_breaker_cooldown_s)
        self.clock = DecodeClock()
        self.readiness = Readiness(config, store)
        # This process, on every lookup span: a restart shows as a new id and a later start.
        self.instance = secrets.token_hex(8)
        self.started_at = time.time()
        self.session: aiohttp.ClientSession | None = None
        self.fresh_session: aiohttp.ClientSession | None = None  # retries: a new connection
        self._prefill = itertools.cycle(config.prefill)
        self._decode = itertools.cycle(config.decode)
        lifetime = (config.fixed_entry_lifetime_s or config.max_entry_lifetime_s
                    or entry_lifetime_s(config.decode_kv_ttl_s, config.expiry_margin_s))
        metrics.entry_lifetime.set(lifetime)
        metrics.decode_ttl.set(config.decode_kv_ttl_s)

    # ------------------------------------------------------------------ lifecycle

    async def start(self, _app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300,
                                         keepalive_timeout=self.config.upstream_keepalive_s)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self.fresh_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, force_close=True),
            auto_decompress=False)

    async def stop(self, _app: web.Application) -> None:
        for session in (self.session, self.fresh_session):
            if session is not None:
                await session.close()
        for closer in (self.store.close, self.publisher.close):
            try:
                await closer()
            except Exception:  # noqa: BLE001
                _LOG.debug("close failed", exc_info=True)

    # ------------------------------------------------------------------ routes

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "store": self.store.backend,
                                  "publisher": self.publisher.name})

    async def ready(self, _request: web.Request) -> web.Response:
        ok, checks = await self.readiness.check(self.session)
        return web.json_response({"status": "ready" if ok else "not-ready",
                                  "checks": checks}, status=200 if ok else 503)

    async def metrics_view(self, request: web.Request) -> web.Response:
        size, _failure = await self.guard.call(self.guard.budget(), self.store.size)
        if size is not None:
            self.metrics.entries.set(size)
        # OpenMetrics when the scraper asks for it (Prometheus does): only that format
        # carries the exemplars (trace_id) of the TTFT and latency histograms.
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        # Rendering every series takes milliseconds (tens on a busy box): off the event
        # loop, so a scrape never holds back the turns being relayed.
        body = await asyncio.get_running_loop().run_in_executor(
            None, encoder, self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/chat/completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/completions")

    # ------------------------------------------------------------------ input

    async def _read_body(self, request: web.Request) -> dict[str, Any]:
        config = self.config
        check_headers(request.headers, (config.conversation_header,
                                        config.tenant_header or "Authorization"))
        return parse_body(await read_body(request, config.max_body_bytes,
                                          config.body_timeout_s))

    def _identity(self, request: web.Request, body: dict[str, Any]) -> Identity:
        config = self.config
        tenant = tenant_of(request.headers, config.tenant_header)
        conversation = conversation_of(body, request.headers, config.conversation_header,
                                       config.max_id_length)
        return Identity(tenant, conversation)

    def _timeout(self, read_s: float) -> aiohttp.ClientTimeout:
        connect = self.config.connect_timeout_s
        return aiohttp.ClientTimeout(total=None, connect=connect, sock_connect=connect,
                                     sock_read=read_s)

    async def _send(self, role: str, url: str, data: str, headers: dict[str, str],
                    timeout: aiohttp.ClientTimeout,
                    leg: ClientLeg) -> aiohttp.ClientResponse:
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
        _LOG.warning("%s engine %s: connection failed before any response (%s: %s); "
                     "sent once more on a fresh connection", role, url, cause.value, reason)
        return await self.fresh_session.post(url, data=data, headers=headers, timeout=timeout)

    def _headers(self, request_id: str, correlation: Correlation) -> dict[str, str]:
        """The legs' headers; the turn's trace context in the ``OTEL_PROPAGATORS``
        formats (W3C ``traceparent`` by default)."""
        headers = {"X-Request-Id": request_id, "Content-Type": "application/json"}
        context = correlation.parent_context()
        if context is not None:
            propagate.inject(headers, context=context)
        if self.config.engine_api_key:
            headers["Authorization"] = f"Bearer {self.config.engine_api_key}"
        return headers

    # ------------------------------------------------------------------ one turn

    async def _handle(self, request: web.Request, path: str) -> web.StreamResponse:
        start_ns = time.time_ns()
        links = _client_link(request.headers)
        try:
            body = await self._read_body(request)
            identity = self._identity(request, body)
        except InputError as error:
            self.metrics.rejected.labels(error.reason).inc()
            response = _json_error(error.status, error.message, "invalid_request_error")
            if error.reason in UNREAD_BODY_REASONS:
                response.force_close()  # the rest of the body is not waited for
            # Refused before its turn: the SERVER span alone, root of its own trace.
            end_server(start_server(self.tracer, request, path, start_ns, _NEW_TRACE, links),
                       response.status)
            return response
        if body.pop(_KTP, None) is not None:
            self.metrics.stripped.inc()
        state = _TurnState(stream=bool(body.get("stream")), request_id=uuid.uuid4().hex,
                           start_wall=start_ns / 1e9, start_perf=time.perf_counter(),
                           conversation_id=identity.conversation_id,
                           store_budget=self.guard.budget())

        span = self.tracer.start_span(sc.SPAN_PROXY_TURN.name, context=_NEW_TRACE,
                                      links=links, start_time=start_ns)
        server = start_server(self.tracer, request, path, start_ns,
                              trace.set_span_in_context(span), links)
        state.http_context = trace.set_span_in_context(server)
        with trace.use_span(span, end_on_exit=False):
            traceparent = current_traceparent() or \
                f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-00"
        request[TRACE_ID_KEY] = traceparent.split("-")[1]
        correlation = Correlation(identity.conversation_id, None, identity.tenant, traceparent)
        response = None
        try:
            response = await self._turn(request, path, body, identity, state, correlation)
            return response
        except asyncio.CancelledError:  # the client left (RUNNER_OPTIONS): legs cancelled
            state.error = state.error or PE.CLIENT_DISCONNECTED
            raise
        except Exception:  # noqa: BLE001 - a proxy fault: a clean error, never a cut stream
            _LOG.exception("turn failed")
            state.error = PE.INTERNAL
            response = await self._internal_error(request, state)
            return response
        finally:
            end_server(server, response.status if response is not None else None,
                       state.error.value if state.error is not None else None)
            correlation = Correlation(state.conversation_id, state.turn, identity.tenant,
                                      traceparent)
            self._end_turn(span, state, correlation)

    async def _turn(self, request: web.Request, path: str, body: dict[str, Any],
                    identity: Identity, state: _TurnState,
                    correlation: Correlation) -> web.StreamResponse:
        assigned, previous = await self._lookup(identity, body, state, correlation)
        if assigned is not identity:
            request[ASSIGNED_ID_KEY] = assigned.conversation_id
            identity = assigned
        correlation = Correlation(identity.conversation_id, state.turn, identity.tenant,
                                  correlation.traceparent)
        keys = {**correlation.to_params(), sc.KTP_REQUEST_ID: state.request_id}
        headers = self._headers(state.request_id, correlation)

        try:
            p_response, p_endpoint = await self._prefill_leg(path, body, previous, keys,
                                                             headers, state, correlation)
        except _UpstreamError as error:
            return self._upstream_failure(error, state)

        p_params = p_response.get(_KTP) if isinstance(p_response, dict) else None
        usage = p_response.get("usage") if isinstance(p_response, dict) else None
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            state.prompt_tokens = usage["prompt_tokens"]
        state.model = _genai_value(body.get("model"))
        d_params = dict(p_params) if isinstance(p_params, dict) else {}
        if d_params and self.config.rewrite_remote_host:
            d_params["remote_host"] = p_endpoint.host
        d_params.update(keys)
        d_body = dict(body)
        d_body[_KTP] = d_params
        d_endpoint = next(self._decode)
        state.extra["decode_host"] = d_endpoint.host
        leg = self._leg("decode", d_endpoint, path, state)
        try:
            if state.stream:
                return await self._decode_stream(request, path, d_body, d_endpoint, headers,
                                                 identity, state, correlation, previous, leg)
            return await self._decode_whole(request, path, d_body, d_endpoint, headers,
                                            identity, state, correlation, previous, leg)
        finally:
            leg.end(error="cancelled")  # ended already, unless the turn was cut short

    def _leg(self, role: str, endpoint: Endpoint, path: str, state: _TurnState) -> ClientLeg:
        return ClientLeg(self.tracer, state.http_context, role, endpoint.host, endpoint.port,
                         endpoint.base_url + path)

    # ------------------------------------------------------------------ lookup

    async def _lookup(self, identity: Identity, body: dict[str, Any], state: _TurnState,
                      correlation: Correlation) -> tuple[Identity, Entry | None]:
        """The turn's index, outcome and D's previous params. A request without an id
        comes back with the conversation it continues (inferred) or a new id."""
        now = time.time()
        start_ns = time.time_ns()
        previous = None
        attributes: dict[str, Any] = {sc.PROXY_INSTANCE.key: self.instance,
                                      sc.PROXY_STARTED_AT.key: self.started_at}
        from_history = history_turn(body)
        miss_reason: sc.MissReason | None = MR.NEVER_SEEN
        sent_id = identity.conversation_id is not None
        inferred = False
        isolated = self._isolated(identity)
        if not sent_id and self.config.infer_conversations and not isolated:
            identity, inferred = await self._infer(identity, body, now,
                                                   correlation.traceparent, state,
                                                   attributes)
            attributes[sc.LOOKUP_INFERRED.key] = inferred
        state.conversation_id = identity.conversation_id
        if isolated and sent_id:
            # No credential: this id may be another anonymous client's. Never looked up.
            state.turn, state.outcome = from_history or 1, LO.MISS
            miss_reason = MR.ANONYMOUS
        elif not sent_id and not inferred:
            # With inference on, the new id starts a conversation a later id-less turn
            # may continue; the turn itself has nothing to look up.
            state.turn, state.outcome = from_history or 1, LO.NO_ID
        else:
            begun, failure = await self.guard.call(state.store_budget, self.store.begin_turn,
                                                   identity.store_key, now)
            if begun is not None:
                state.turn, previous = begun.turn, begun.previous
            else:  # the store could not say: the turn goes on without reuse
                attributes[sc.STORE_FAILURE.key] = failure
                miss_reason = MR.STORE_UNAVAILABLE
            # A chat history says which turn this is even when the store forgot the
            # conversation (restart, eviction, another replica without shared state).
            state.turn = max(state.turn or 1, from_history or 1)
            if previous is not None and previous.ended_at is not None:
                gap = max(0.0, now - previous.ended_at)
                attributes[sc.INTER_TURN_GAP.key] = gap
                self.metrics.gap.observe(gap)
            if previous is None or previous.params is None:
                state.outcome = LO.MISS
                if previous is not None:
                    miss_reason = MR.NOT_STORED
                elif begun is not None and begun.evicted:
                    miss_reason = MR.EVICTED
            else:
                miss_reason = None
                if previous.stored_at is not None:
                    age = max(0.0, now - previous.stored_at)
                    attributes[sc.ENTRY_AGE.key] = age
                    self.metrics.entry_age.observe(age)
                if previous.expires_at is not None:
                    attributes[sc.ENTRY_REMAINING_TTL.key] = previous.expires_at - now
                if previous.expires_at is None or now >= previous.expires_at:
                    state.outcome = LO.STALE
                elif not extends(previous.digest, body):
                    state.outcome = LO.PREFIX_MISMATCH
                else:
                    state.outcome = LO.HIT
        state.params_sent = state.outcome is LO.HIT
        self.metrics.lookups.labels(state.outcome.value).inc()
        correlation = Correlation(state.conversation_id, state.turn, correlation.tenant,
                                  correlation.traceparent)
        emit(self.tracer, sc.SPAN_PROXY_LOOKUP, correlation,
             {sc.LOOKUP_OUTCOME.key: state.outcome, sc.PARAMS_SENT.key: state.params_sent,
              sc.LOOKUP_MISS_REASON.key: miss_reason, **attributes}, start_ns=start_ns)
        return identity, previous

    def _isolated(self, identity: Identity) -> bool:
        """A client without a credential, and anonymous clients share nothing."""
        return identity.tenant == ANONYMOUS and self.config.anonymous_tenant == "isolated"

    async def _infer(self, identity: Identity, body: dict[str, Any], now: float,
                     traceparent: str, state: _TurnState,
                     attributes: dict[str, Any]) -> tuple[Identity, bool]:
        """The tenant's live conversation whose covered history this request extends
        (longest match), else a new id: the ``anonymous:<trace id>`` kvobs names an
        id-less turn by, so that a later turn can continue it."""
        prefixes = Prefixes.of(body)
        found = None
        if prefixes is not None:
            found, failure = await self.guard.call(state.store_budget, self.store.infer,
                                                   identity.tenant, prefixes, now)
            if failure is not None:
                attributes[sc.STORE_FAILURE.key] = failure
        if found is not None:
            return Identity(identity.tenant, found.conversation_id), True
        return Identity(identity.tenant, sc.ANONYMOUS_PREFIX + traceparent.split("-")[1]), False

    # ------------------------------------------------------------------ prefill

    def _prefill_body(self, body: dict[str, Any], params: dict[str, Any] | None,
                      keys: dict[str, Any]) -> dict[str, Any]:
        p_body = dict(body)
        p_body["stream"] = False
        p_body["max_tokens"] = 1
        for name in _PREFILL_DROP:
            p_body.pop(name, None)
        if params:
            ktp = {**params, "do_remote_decode": True, "do_remote_prefill": False}
        else:
            ktp = {"do_remote_decode": True, "do_remote_prefill": False,
                   "remote_engine_id": None, "remote_block_ids": None,
                   "remote_host": None, "remote_port": None}
        ktp.update(keys)
        p_body[_KTP] = ktp
        return p_body

    async def _post_prefill(self, endpoint: Endpoint, path: str, payload: dict[str, Any],
                            headers: dict[str, str], state: _TurnState) -> dict[str, Any]:
        timeout = self._timeout(self.config.prefill_read_timeout_s)
        leg = self._leg("prefill", endpoint, path, state)
        status = error = None
        try:
            response = await self._send("prefill", endpoint.base_url + path,
                                        json.dumps(payload), headers, timeout, leg)
            async with response:
                status = response.status
                raw = await response.read()
        except asyncio.TimeoutError:
            error = "timeout"
            raise _UpstreamError("prefill", "timeout", PE.PREFILL_ERROR, 504) from None
        except aiohttp.ClientError:
            error = "unreachable" if status is None else "disconnected"
            raise _UpstreamError("prefill", "unreachable", PE.PREFILL_UNREACHABLE) from None
        except BaseException:
            error = "cancelled"
            raise
        finally:
            leg.end(status, error)
        if status != 200:
            raise _UpstreamError("prefill", "http-error", PE.PREFILL_ERROR, status, raw)
        try:
            return json.loads(raw)
        except ValueError:
            raise _UpstreamError("prefill", "http-error", PE.PREFILL_ERROR) from None

    async def _prefill_leg(self, path, body, previous, keys, headers, state, correlation):
        params = previous.params if state.params_sent else None
        endpoint = next(self._prefill)
        started = time.perf_counter()
        state.p_sent = time.time()
        try:
            try:
                response = await self._post_prefill(
                    endpoint, path, self._prefill_body(body, params, keys), headers, state)
            except _UpstreamError as error:
                if not (params and error.kind == "http-error" and error.status >= 500):
                    raise
                reason = _fallback_reason(error.body)
                self.metrics.upstream_errors.labels("prefill", error.kind).inc()
                self.metrics.fallbacks.labels(reason.value).inc()
                fallback_start = time.time_ns()
                state.p_retry_sent = fallback_start / 1e9
                state.extra["fallback"] = reason.value
                state.params_sent = False
                try:
                    response = await self._post_prefill(
                        endpoint, path, self._prefill_body(body, None, keys), headers, state)
                finally:
                    emit(self.tracer, sc.SPAN_PROXY_FALLBACK, correlation_with(correlation,
                                                                               state),
                         {sc.FALLBACK_REASON.key: reason,
                          sc.HTTP_STATUS: error.status},
                         start_ns=fallback_start)
            return response, endpoint
        finally:
            state.p_answered = time.time()
            state.prefill_s = time.perf_counter() - started

    # ------------------------------------------------------------------ decode

    async def _open_decode(self, endpoint, path, d_body, headers, leg: ClientLeg):
        """D's response, its status 200; a failure ends ``leg`` (the CLIENT span)."""
        timeout = self._timeout(self.config.decode_read_timeout_s)
        try:
            response = await self._send("decode", endpoint.base_url + path,
                                        json.dumps(d_body), headers, timeout, leg)
        except asyncio.TimeoutError:
            leg.end(error="timeout")
            raise _UpstreamError("decode", "timeout", PE.DECODE_ERROR, 504) from None
        except aiohttp.ClientError:
            leg.end(error="unreachable")
            raise _UpstreamError("decode", "unreachable", PE.DECODE_UNREACHABLE) from None
        if response.status != 200:
            try:
                raw = await response.read()
            except aiohttp.ClientError:
                raw = b""
            finally:
                response.release()
            leg.end(response.status)
            raise _UpstreamError("decode", "http-error", PE.DECODE_ERROR, response.status, raw)
        return response

    async def _decode_whole(self, request, path, d_body, endpoint, headers, identity, state,
                            correlation, previous, leg: ClientLeg) -> web.StreamResponse:
        started = time.perf_counter()
        sent_wall = state.d_sent = time.time()
        try:
            response = await self._open_decode(endpoint, path, d_body, headers, leg)
            try:
                raw = await response.read()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                leg.end(200, "disconnected")
                raise _UpstreamError("decode", "disconnected", PE.DECODE_DISCONNECTED) from None
            finally:
                response.release()
            leg.end(200)
        except _UpstreamError as error:
            state.decode_s = time.perf_counter() - started
            return self._upstream_failure(error, state)
        answered_wall = state.d_answered = time.time()
        state.decode_s = time.perf_counter() - started
        try:
            result = json.loads(raw)
        except ValueError:
            return self._upstream_failure(
                _UpstreamError("decode", "http-error", PE.DECODE_ERROR), state)
        params = result.pop(_KTP, None) if isinstance(result, dict) else None
        _answer_facts(result, state)
        message, text = _first_choice(result)
        digest = history_digest(d_body, message, text) if _single_choice(result) else None
        if isinstance(params, dict):
            state.source = PS.BODY
        await self._store(identity, state, correlation, previous,
                          params if isinstance(params, dict) else None, digest,
                          sent_wall, answered_wall)
        answer = web.Response(body=json.dumps(result).encode(), status=200,
                              content_type="application/json")
        # Sent here, not after the handler returns: the turn's span (proxy-out) holds the
        # write, so a proxy busy elsewhere at that moment is time kvobs accounts.
        try:
            await _to_client(answer.prepare(request))
            await _to_client(answer.write_eof())
        except _ClientGone:
            state.error = PE.CLIENT_DISCONNECTED
        return answer

    async def _decode_stream(self, request, path, d_body, endpoint, headers, identity,
                             state, correlation, previous,
                             leg: ClientLeg) -> web.StreamResponse:
        started = time.perf_counter()
        sent_wall = state.d_sent = time.time()
        try:
            response = await self._open_decode(endpoint, path, d_body, headers, leg)
        except _UpstreamError as error:
            state.decode_s = time.perf_counter() - started
            return self._upstream_failure(error, state)
        client = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        collector = _StreamCollector(state)
        state.extra["client"] = client
        done = False
        try:
            await _to_client(client.prepare(request))
            buffer = b""
            async for chunk in response.content.iter_any():
                buffer += chunk
                cut = buffer.rfind(b"\n") + 1
                if not cut:
                    continue
                lines, buffer = buffer[:cut], buffer[cut:]
                out, done = collector.feed(lines)
                _first_output(state, collector)
                await _to_client(client.write(out))
            if buffer:
                out, done = collector.feed(buffer + b"\n")
                _first_output(state, collector)
                await _to_client(client.write(out))
            if not done:
                raise aiohttp.ClientPayloadError("decode stream ended without [DONE]")
        except _ClientGone:
            state.error = PE.CLIENT_DISCONNECTED
            response.close()
            leg.end(200, "cancelled")
            state.decode_s = time.perf_counter() - started
            return client
        except (aiohttp.ClientError, asyncio.TimeoutError):
            state.error = PE.DECODE_DISCONNECTED
            self.metrics.upstream_errors.labels("decode", "disconnected").inc()
            response.close()
            leg.end(200, "disconnected")
            state.decode_s = time.perf_counter() - started
            try:
                await _to_client(client.write(_sse_error("decode engine failed mid-stream")))
                await _to_client(client.write_eof())
            except _ClientGone:
                pass
            return client
        finally:
            response.release()
        leg.end(200)
        answered_wall = state.d_answered = time.time()
        state.decode_s = time.perf_counter() - started
        params = collector.params
        if params is not None:
            state.source = PS.STREAM
        else:
            wait = self.config.publisher_wait_s
            params, failure = await self.guard.call(state.store_budget, self.publisher.fetch,
                                                    state.request_id, wait, extra_s=wait)
            if failure is not None:
                state.extra["store_failure"] = failure
            if params is not None:
                state.source = PS.PUBLISHED
        digest = history_digest(d_body, collector.message(), collector.text()) \
            if collector.single else None
        await self._store(identity, state, correlation, previous, params, digest, sent_wall,
                          answered_wall)
        # [DONE] goes out only now: a client that starts its next turn the moment this
        # stream ends finds this turn's params already stored.
        try:
            await _to_client(client.write(_DONE + b"\n\n"))
            await _to_client(client.write_eof())
        except _ClientGone:
            state.error = PE.CLIENT_DISCONNECTED
        return client

    # ------------------------------------------------------------------ store

    def _expires_at(self, params: dict[str, Any], sent_wall: float,
                    answered_wall: float) -> float | None:
        expiry_d = _number(params.get("remote_blocks_expiry_time"))
        if expiry_d is None or not _has_blocks(params):
            return None
        ttl = _number(params.get(sc.KTP_DECODE_TTL)) or self.config.decode_kv_ttl_s
        self.metrics.decode_ttl.set(ttl)
        if self.config.fixed_entry_lifetime_s is not None:
            return answered_wall + self.config.fixed_entry_lifetime_s
        engine = str(params.get("remote_engine_id"))
        expires = self.clock.expiry_wall(engine, expiry_d, ttl, sent_wall,
                                         answered_wall) - self.config.expiry_margin_s
        if self.config.max_entry_lifetime_s is not None:
            expires = min(expires, answered_wall + self.config.max_entry_lifetime_s)
        return expires if expires > answered_wall else None

    async def _store(self, identity, state, correlation, previous, params, digest,
                     sent_wall, answered_wall) -> None:
        key = identity.store_key
        if key is None or state.turn is None or self._isolated(identity):
            return
        start_ns = time.time_ns()
        expires_at = None
        if params is not None:
            # The turn's own correlation keys are replaced on the next turn; D's facts
            # (its block-hash digest, its TTL) must reach P unchanged.
            params = {k: v for k, v in params.items() if k not in _TURN_KEYS}
            if self.config.rewrite_remote_host:
                params["remote_host"] = self._decode_host(params, state)
            expires_at = self._expires_at(params, sent_wall, answered_wall)
        usable = params is not None and expires_at is not None and digest is not None
        if usable:
            had = previous is not None and previous.stored_turn > 0
            action = "refreshed" if had else "stored"
        else:
            action = "skipped"
        indexed = self.config.infer_conversations
        _, failure = await self.guard.call(
            state.store_budget, self.store.finish_turn, key, state.turn, time.time(),
            params if usable else None, expires_at if usable else None,
            digest if usable else None, identity.tenant if indexed else None,
            identity.conversation_id if indexed else None)
        if failure is not None:
            action = "skipped"
        failure = failure or state.extra.get("store_failure")  # or the publisher's
        self.metrics.stores.labels(action, state.source.value).inc()
        emit(self.tracer, sc.SPAN_PROXY_STORE, correlation_with(correlation, state),
             {sc.STORE_ACTION.key: action, sc.PARAMS_SOURCE.key: state.source,
              sc.STORE_EXPIRES_AT.key: expires_at if usable else None,
              sc.STORE_FAILURE.key: failure},
             start_ns=start_ns)

    def _decode_host(self, params: dict[str, Any], state: _TurnState) -> Any:
        return state.extra.get("decode_host", params.get("remote_host"))

    # ------------------------------------------------------------------ endings

    async def _internal_error(self, request: web.Request,
                              state: _TurnState) -> web.StreamResponse:
        """A 500 in OpenAI's error form; once a stream has started, an SSE error event
        and ``[DONE]`` end it instead."""
        self.metrics.internal_errors.inc()
        message = "the proxy failed to complete the request"
        client = state.extra.get("client")
        if client is None or not client.prepared:
            return _json_error(500, message, "internal_error")
        try:
            await _to_client(client.write(_sse_error(message, "internal_error", 500)))
            await _to_client(client.write_eof())
        except _ClientGone:
            state.error = PE.CLIENT_DISCONNECTED
        return client

    def _upstream_failure(self, error: _UpstreamError, state: _TurnState) -> web.Response:
        state.error = error.error
        self.metrics.upstream_errors.labels(error.role, error.kind).inc()
        if error.kind == "http-error" and 400 <= error.status < 500 and error.body:
            # The engine refused the client's request: pass its answer through.
            return web.Response(body=error.body, status=error.status,
                                content_type="application/json")
        status = 504 if error.kind == "timeout" else 502
        cause = f"answered {error.status}" if error.kind == "http-error" else error.kind
        _LOG.warning("%s engine failed a turn (%s): the client got %d", error.role, cause,
                     status)
        return _json_error(status, f"{error.role} engine {error.kind}", "upstream_error")

    def _end_turn(self, span: trace.Span, state: _TurnState, correlation: Correlation) -> None:
        turn_bucket = sc.turn_bucket(state.turn or 1)
        prompt_bucket = sc.prompt_bucket(state.prompt_tokens or 0)
        self.metrics.turns.labels(turn_bucket, prompt_bucket, state.outcome.value).inc()
        if state.error is None and state.d_answered is not None:
            # The turn's trace id as exemplar: a dashboard point opens the turn's trace.
            context = span.get_span_context()
            exemplar = ({sc.EXEMPLAR_TRACE_ID: trace.format_trace_id(context.trace_id)}
                        if context.is_valid else None)
            if state.ttft_s is not None:
                self.metrics.ttft.labels(turn_bucket, prompt_bucket).observe(
                    state.ttft_s, exemplar)
            self.metrics.latency.labels(turn_bucket, prompt_bucket).observe(
                time.perf_counter() - state.start_perf, exemplar)
            self._observe_phases(state)
        try:
            if span.is_recording():
                span.set_attributes({**correlation.attributes(), **clean({
                    sc.STREAM.key: state.stream,
                    sc.TTFT.key: state.ttft_s,
                    sc.PREFILL_TIME.key: state.prefill_s,
                    sc.DECODE_TIME.key: state.decode_s,
                    sc.LOOKUP_OUTCOME.key: state.outcome,
                    sc.PARAMS_SENT.key: state.params_sent,
                    sc.PARAMS_SOURCE.key: state.source,
                    sc.PROMPT_TOKENS.key: state.prompt_tokens,
                    sc.OUTPUT_TOKENS.key: state.output_tokens,
                    sc.REQUEST_MODEL.key: state.model,
                    sc.RESPONSE_ID.key: state.response_id,
                    sc.REQUEST_ID.key: state.request_id,
                    sc.ROLE.key: "proxy",
                    sc.PROXY_ERROR.key: state.error,
                    sc.FALLBACK_REASON.key: state.extra.get("fallback"),
                    sc.PREFILL_SENT_AT.key: state.p_sent,
                    sc.PREFILL_RETRY_SENT_AT.key: state.p_retry_sent,
                    sc.PREFILL_ANSWERED_AT.key: state.p_answered,
                    sc.DECODE_SENT_AT.key: state.d_sent,
                    sc.DECODE_FIRST_OUTPUT_AT.key: state.d_first_output,
                    sc.DECODE_ANSWERED_AT.key: state.d_answered,
                })})
                if state.error is not None:
                    span.set_status(trace.Status(trace.StatusCode.ERROR))
            span.end()
        except Exception:  # noqa: BLE001 - telemetry never breaks serving
            _LOG.debug("turn span failed", exc_info=True)


    def _observe_phases(self, state: _TurnState) -> None:
        """The phases the proxy times alone (a completed turn has every mark)."""
        end = time.time()
        phase = self.metrics.phase
        phase.labels("proxy-in").observe(max(0.0, state.p_sent - state.start_wall))
        phase.labels("prefill-leg").observe(max(0.0, state.p_answered - state.p_sent))
        phase.labels("proxy-hop").observe(max(0.0, state.d_sent - state.p_answered))
        phase.labels("decode-leg").observe(max(0.0, state.d_answered - state.d_sent))
        phase.labels("proxy-out").observe(max(0.0, end - state.d_answered))


def _genai_value(value: Any) -> str | None:
    """A client- or engine-chosen id or model name fit for a span attribute."""
    if type(value) is not str or not value or len(value) > sc.MAX_GENAI_VALUE:
        return None
    return value


def _answer_facts(answer: Any, state: _TurnState) -> None:
    """The completion's id and D's usage, from its answer (or a streamed chunk)."""
    if not isinstance(answer, dict):
        return
    if state.response_id is None:
        state.response_id = _genai_value(answer.get("id"))
    usage = answer.get("usage")
    if isinstance(usage, dict) and type(usage.get("completion_tokens")) is int:
        state.output_tokens = usage["completion_tokens"]


def _client_link(headers) -> list[trace.Link] | None:
    """The client's own trace context (``OTEL_PROPAGATORS``' formats), as a link."""
    context = trace.get_current_span(propagate.extract(headers)).get_span_context()
    return [trace.Link(context)] if context.is_valid else None


def _first_output(state: _TurnState, collector: "_StreamCollector") -> None:
    """TTFT is the first output the client gets, not D's first bytes (a role-only or
    empty first chunk carries no token)."""
    if state.ttft_s is None and collector.has_output:
        state.ttft_s = time.perf_counter() - state.start_perf
        state.d_first_output = time.time()


def correlation_with(correlation: Correlation, state: _TurnState) -> Correlation:
    return Correlation(correlation.conversation_id, state.turn, correlation.tenant,
                       correlation.traceparent)


class _ClientGone(Exception):
    """The client went away while its answer was being written."""


async def _to_client(awaitable) -> None:
    try:
        await awaitable
    except (ConnectionError, aiohttp.ClientConnectionResetError, RuntimeError):
        raise _ClientGone from None


def history_turn(body: dict[str, Any]) -> int | None:
    """Turn index a chat request's own history implies: 1 + assistant messages.

    >>> history_turn({"messages": [{"role": "user"}, {"role": "assistant"}, {"role": "user"}]})
    2
    >>> history_turn({"prompt": "abc"}) is None
    True
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    return 1 + sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")


async def _id_headers(request: web.Request, response: web.StreamResponse) -> None:
    # Lets a client (or an operator reading a client log) name the turn to kvobs.
    trace_id = request.get(TRACE_ID_KEY)
    if trace_id:
        response.headers[TRACE_ID_HEADER] = trace_id
    # A request without a conversation id gets the one the proxy gave it (inferred, or
    # new) in the header a client sends ids in, so the client can adopt it.
    # (An inferred id is some client's: only one that is a valid header value.)
    assigned = request.get(ASSIGNED_ID_KEY)
    if assigned and assigned.isascii() and assigned.isprintable():
        response.headers[request.app[PROXY_KEY].config.conversation_header] = assigned


def retry_cause(error: aiohttp.ClientConnectionError) -> sc.UpstreamRetryCause:
    """What failed before the engine answered a byte."""
    if isinstance(error, aiohttp.ClientConnectorError):
        return sc.UpstreamRetryCause.REFUSED
    if isinstance(error, aiohttp.ClientOSError):
        return sc.UpstreamRetryCause.RESET
    return sc.UpstreamRetryCause.DISCONNECTED


def _fallback_reason(body: bytes | None) -> sc.FallbackReason:
    """What P's error body says; vLLM 0.32 answers a generic 500 for both a declined and
    a failed read, so the proxy says only what it knows (P's read span says the rest)."""
    text = (body or b"")[:4096].lower()
    if b"expired" in text or b"declin" in text:
        return sc.FallbackReason.READ_DECLINED
    if b"kv load" in text or b"transfer" in text or b"nixl" in text:
        return sc.FallbackReason.READ_FAILED
    return sc.FallbackReason.PREFILL_ERROR


def _single_choice(result: Any) -> bool:
    choices = result.get("choices") if isinstance(result, dict) else None
    return isinstance(choices, list) and len(choices) == 1


def _first_choice(result: Any) -> tuple[dict[str, Any] | None, str | None]:
    try:
        choice = result["choices"][0]
    except (KeyError, IndexError, TypeError):
        return None, None
    message = choice.get("message")
    text = choice.get("text")
    return (message if isinstance(message, dict) else None,
            text if isinstance(text, str) else None)


class _StreamCollector:
    """Parses SSE lines as they pass: assembles the answer, lifts out D's params."""

    __slots__ = ("params", "_content", "_reasoning", "_text", "_tools", "single", "_chat",
                 "has_output", "facts")

    def __init__(self, facts: "_TurnState"):
        self.facts = facts  # the turn's GenAI facts (_answer_facts) land there
        self.params: dict[str, Any] | None = None
        self.has_output = False  # a chunk carried text, reasoning or a tool call
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._text: list[str] = []
        self._tools: dict[int, list[str]] = {}
        self.single = True
        self._chat = False

    def feed(self, lines: bytes) -> tuple[bytes, bool]:
        """Returns the bytes to forward (params removed) and whether [DONE] was seen."""
        done = False
        out = []
        for line in lines.split(b"\n")[:-1]:
            stripped = line.strip()
            if stripped == _DONE:
                done = True  # held back until D's params are stored (see _decode_stream)
                continue
            if stripped.startswith(b"data: {"):
                try:
                    chunk = json.loads(stripped[6:])
                except ValueError:
                    chunk = None
                if isinstance(chunk, dict):
                    if _KTP in chunk:
                        params = chunk.pop(_KTP)
                        if isinstance(params, dict):
                            self.params = params
                        line = b"data: " + json.dumps(chunk).encode()
                    _answer_facts(chunk, self.facts)
                    self._collect(chunk)
            out.append(line)
        return b"\n".join(out) + b"\n", done

    def _collect(self, chunk: dict[str, Any]) -> None:
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("index", 0) != 0:
                self.single = False
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._chat = True
                for key, sink in (("content", self._content),
                                  ("reasoning_content", self._reasoning),
                                  ("reasoning", self._reasoning)):
                    value = delta.get(key)
                    if isinstance(value, str):
                        sink.append(value)
                        self.has_output = self.has_output or bool(value)
                for call in delta.get("tool_calls") or ():
                    if isinstance(call, dict):
                        self.has_output = True
                        slot = self._tools.setdefault(int(call.get("index", 0)), ["", ""])
                        function = call.get("function") or {}
                        slot[0] += function.get("name") or ""
                        slot[1] += function.get("arguments") or ""
            text = choice.get("text")
            if isinstance(text, str):
                self._text.append(text)
                self.has_output = self.has_output or bool(text)

    def message(self) -> dict[str, Any] | None:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self._content)}
        if self._reasoning:
            message["reasoning_content"] = "".join(self._reasoning)
        if self._tools:
            message["tool_calls"] = [{"function": {"name": n, "arguments": a}}
                                     for _, (n, a) in sorted(self._tools.items())]
        return message

    def text(self) -> str:
        return "".join(self._text)


# ---------------------------------------------------------------------- public API


def _make_store(config: ProxyConfig, metrics: ProxyMetrics) -> MetadataStore:
    on_evict = metrics.evictions.inc
    if config.store_backend == "redis":
        return RedisStore(config.redis_url, config.max_entries, config.conversation_ttl_s,
                          on_evict, infer_per_tenant=config.infer_per_tenant,
                          max_per_tenant=config.max_entries_per_tenant,
                          pool_size=config.redis_pool_size)
    return MemoryStore(config.max_entries, config.conversation_ttl_s, on_evict,
                       infer_per_tenant=config.infer_per_tenant,
                       max_per_tenant=config.max_entries_per_tenant)


def _make_publisher(config: ProxyConfig) -> ParamsPublisher:
    if config.publisher_kind == "redis":
        return RedisParamsPublisher(config.redis_url, pool_size=config.redis_pool_size)
    return NoPublisher()


def build_app(config: ProxyConfig, *, tracer: trace.Tracer | None = None,
              registry: CollectorRegistry | None = None, store: MetadataStore | None = None,
              publisher: ParamsPublisher | None = None) -> web.Application:
    """The proxy as an aiohttp application (tests and embedders pass their own sinks)."""
    if tracer is None:
        from kvobs.emit.setup import configure_tracing

        tracer = configure_tracing(sc.Service.PROXY, store_dir=config.store_dir)
    metrics = ProxyMetrics(registry)
    metrics.watch_spans(tracer)
    proxy = _Proxy(config, tracer, metrics, store or _make_store(config, metrics),
                   publisher or _make_publisher(config))
    app = web.Application(client_max_size=config.max_body_bytes + 1)
    app[PROXY_KEY] = proxy
    app.on_response_prepare.append(_id_headers)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/chat/completions", proxy.chat)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/ready", proxy.ready)
    app.router.add_get("/metrics", proxy.metrics_view)
    return app


def run_proxy(config: ProxyConfig) -> None:
    """Serve until interrupted."""
    app = build_app(config)
    # What start-up allocated (modules, the app, OpenTelemetry's SDK: ~80,000 objects)
    # lives as long as the process. Frozen out of the collector's sight, it no longer
    # makes each full collection stall the event loop (49 ms on a quiet 2-core box).
    gc.collect()
    gc.freeze()
    web.run_app(app, host=config.host, port=config.port, access_log=None,
                **RUNNER_OPTIONS,
                print=lambda *_: None)
