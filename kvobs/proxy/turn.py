"""One turn, end to end: identity, lookup, the engine legs (``legs``), the store, the
turn's span and metrics.

The decisions are ``decide``'s; this module does their I/O (the store, behind the
``StoreGuard``'s per-turn budget and breaker) and records what happened.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from typing import Any

from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.context import Context

from kvobs import semconv as sc
from kvobs.emit.spans import Correlation, clean, current_traceparent, emit

from kvobs.proxy import decide
from kvobs.proxy._clock import DecodeClock
from kvobs.proxy._digest import Prefixes
from kvobs.proxy._guard import StoreGuard
from kvobs.proxy._http_spans import client_link, end_server, start_server
from kvobs.proxy._identity import (
    ANONYMOUS,
    Identity,
    InputError,
    conversation_of,
    tenant_digest,
    tenant_of,
)
from kvobs.proxy._input import UNREAD_BODY_REASONS, check_headers, parse_body, read_body
from kvobs.proxy._log import FIELDS, log
from kvobs.proxy._metrics import ProxyMetrics
from kvobs.proxy._sse import genai_value
from kvobs.proxy._state import TurnState, UpstreamError
from kvobs.proxy._tenants import NewTenants
from kvobs.proxy.config import ProxyConfig
from kvobs.proxy.legs import KTP, ClientGone, Legs, sse_error, to_client
from kvobs.proxy.publisher import ParamsPublisher
from kvobs.proxy.store import Entry, MetadataStore

_LOG = logging.getLogger("kvobs.proxy")
TRACE_ID_KEY = web.RequestKey("kvobs_trace_id", str)
# The conversation id the proxy gave a request that came without one (inferred or new).
ASSIGNED_ID_KEY = web.RequestKey("kvobs_assigned_conversation_id", str)
# The turn span starts its own trace (a client's traceparent becomes a link): kvobs keys
# an id-less turn by its trace, so turns that share a client's trace must not share one.
_NEW_TRACE = Context()
PE = sc.ProxyError


def json_error(status: int, message: str, type_: str) -> web.Response:
    body = {"error": {"message": message, "type": type_, "code": status}}
    return web.json_response(body, status=status)


def _with_turn(
    correlation: Correlation, conversation_id: str | None, turn: int | None
) -> Correlation:
    return Correlation(conversation_id, turn, correlation.tenant, correlation.traceparent)


class Turns:
    def __init__(
        self,
        config: ProxyConfig,
        tracer: trace.Tracer,
        metrics: ProxyMetrics,
        store: MetadataStore,
        publisher: ParamsPublisher,
        guard: StoreGuard,
    ):
        self.config, self.tracer, self.metrics = config, tracer, metrics
        self.store, self.publisher, self.guard = store, publisher, guard
        self.legs = Legs(config, tracer, metrics)
        self.clock = DecodeClock()
        self.tenants = NewTenants(
            config.max_new_tenants, config.new_tenant_window_s, config.max_entries
        )
        # This process, on every lookup span: a restart shows as a new id and a later start.
        self.instance = secrets.token_hex(8)
        self.started_at = time.time()

    # ------------------------------------------------------------------ input

    def _identity(self, request: web.Request, body: dict[str, Any]) -> tuple[Identity, bool]:
        """Who asks, and whether the tenant came from the trusted gateway header."""
        config, headers = self.config, request.headers
        tenant, trusted = ANONYMOUS, False
        if config.trusted_tenant_header:
            value = (headers.get(config.trusted_tenant_header) or "").strip()
            if value:
                if len(value) > 4096:
                    raise InputError(400, "tenant-too-long", "tenant header too long")
                tenant, trusted = tenant_digest("gateway\0" + value), True
        if not trusted:
            tenant = tenant_of(headers, config.tenant_header)
        conversation = conversation_of(
            body, headers, config.conversation_header, config.max_id_length
        )
        return Identity(tenant, conversation), trusted

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

    async def handle(self, request: web.Request, path: str) -> web.StreamResponse:
        config = self.config
        start_ns = time.time_ns()
        links = client_link(request.headers)
        try:
            check_headers(
                request.headers,
                (
                    config.conversation_header,
                    config.tenant_header or "Authorization",
                    config.trusted_tenant_header,
                ),
            )
            body = parse_body(
                await read_body(request, config.max_body_bytes, config.body_timeout_s)
            )
            identity, trusted = self._identity(request, body)
        except InputError as error:
            self.metrics.rejected.labels(error.reason).inc()
            response = json_error(error.status, error.message, "invalid_request_error")
            if error.reason in UNREAD_BODY_REASONS:
                response.force_close()  # the rest of the body is not waited for
            # Refused before its turn: the SERVER span alone, root of its own trace.
            end_server(
                start_server(self.tracer, request, path, start_ns, _NEW_TRACE, links),
                response.status,
            )
            return response
        if body.pop(KTP, None) is not None:
            self.metrics.stripped.inc()
        state = TurnState(
            stream=bool(body.get("stream")),
            request_id=uuid.uuid4().hex,
            start_wall=start_ns / 1e9,
            start_perf=time.perf_counter(),
            conversation_id=identity.conversation_id,
            store_budget=self.guard.budget(),
        )
        span = self.tracer.start_span(
            sc.SPAN_PROXY_TURN.name, context=_NEW_TRACE, links=links, start_time=start_ns
        )
        server = start_server(
            self.tracer, request, path, start_ns, trace.set_span_in_context(span), links
        )
        state.http_context = trace.set_span_in_context(server)
        with trace.use_span(span, end_on_exit=False):
            traceparent = (
                current_traceparent() or f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-00"
            )
        request[TRACE_ID_KEY] = traceparent.split("-")[1]
        correlation = Correlation(identity.conversation_id, None, identity.tenant, traceparent)
        response = None
        try:
            response = await self._turn(request, path, body, identity, trusted, state, correlation)
            return response
        except asyncio.CancelledError:  # the client left (RUNNER_OPTIONS): legs cancelled
            state.error = state.error or PE.CLIENT_DISCONNECTED
            raise
        except Exception:  # noqa: BLE001 - a proxy fault: a clean error, never a cut stream
            _LOG.exception("turn failed", extra={FIELDS: {"request_id": state.request_id}})
            state.error = PE.INTERNAL
            response = await self._internal_error(state)
            return response
        finally:
            end_server(
                server,
                response.status if response is not None else None,
                state.error.value if state.error is not None else None,
            )
            self._end_turn(span, state, _with_turn(correlation, state.conversation_id, state.turn))

    def _refusal(self, identity: Identity, trusted: bool, now: float) -> sc.MissReason | None:
        """The tenant and anonymous policy: why this turn may not use the store."""
        admitted = True
        if identity.tenant == ANONYMOUS:
            self.metrics.anonymous_turns.inc()
        elif not trusted:  # a gateway-authenticated tenant cannot be invented
            admitted, new = self.tenants.admit(identity.tenant, now)
            if new:
                self.metrics.new_tenants.inc()
            elif not admitted:
                self.metrics.tenant_limited.inc()
        return decide.refusal(identity.tenant, self.config.anonymous_tenant, admitted)

    async def _turn(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        identity: Identity,
        trusted: bool,
        state: TurnState,
        correlation: Correlation,
    ) -> web.StreamResponse:
        refused = self._refusal(identity, trusted, time.time())
        assigned, previous = await self._lookup(identity, body, refused, state, correlation)
        if assigned is not identity:
            request[ASSIGNED_ID_KEY] = assigned.conversation_id
            identity = assigned
        correlation = _with_turn(correlation, identity.conversation_id, state.turn)
        keys = {**correlation.to_params(), sc.KTP_REQUEST_ID: state.request_id}
        headers = self._headers(state.request_id, correlation)
        params = previous.params if state.params_sent and previous is not None else None
        try:
            p_response, p_endpoint = await self.legs.prefill(
                path, body, params, keys, headers, state, correlation
            )
            p_params = p_response.get(KTP) if isinstance(p_response, dict) else None
            usage = p_response.get("usage") if isinstance(p_response, dict) else None
            if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
                state.prompt_tokens = usage["prompt_tokens"]
            state.model = genai_value(body.get("model"))
            d_params = dict(p_params) if isinstance(p_params, dict) else {}
            if d_params and self.config.rewrite_remote_host:
                d_params["remote_host"] = p_endpoint.host
            d_params.update(keys)
            d_body = dict(body)
            d_body[KTP] = d_params
            d_endpoint = self.legs.next_decode()
            state.decode_host = d_endpoint.host

            async def finish(new_params, digest, sent_wall, answered_wall):
                if refused is None:
                    await self._store(
                        identity,
                        state,
                        correlation,
                        previous,
                        new_params,
                        digest,
                        sent_wall,
                        answered_wall,
                    )

            return await self.legs.decode(request, path, d_body, d_endpoint, headers, state, finish)
        except UpstreamError as error:
            return self._upstream_failure(error, state)

    # ------------------------------------------------------------------ lookup

    async def _lookup(
        self,
        identity: Identity,
        body: dict[str, Any],
        refused: sc.MissReason | None,
        state: TurnState,
        correlation: Correlation,
    ) -> tuple[Identity, Entry | None]:
        """The turn's index, outcome and D's previous params. A request without an id
        comes back with the conversation it continues (inferred) or a new id."""
        now = time.time()
        start_ns = time.time_ns()
        attributes: dict[str, Any] = {
            sc.PROXY_INSTANCE.key: self.instance,
            sc.PROXY_STARTED_AT.key: self.started_at,
        }
        sent_id = identity.conversation_id is not None
        inferred = False
        if decide.should_infer(sent_id, self.config.infer_conversations, refused):
            identity, inferred = await self._infer(
                identity, body, now, correlation.traceparent, state, attributes
            )
            attributes[sc.LOOKUP_INFERRED.key] = inferred
        state.conversation_id = identity.conversation_id
        has_id = sent_id or inferred
        begun = None
        asked = refused is None and has_id
        if asked:
            begun, failure = await self.guard.call(
                state.store_budget, self.store.begin_turn, identity.store_key, now
            )
            attributes[sc.STORE_FAILURE.key] = failure
        result = decide.lookup(body, now, has_id=has_id, refused=refused, asked=asked, begun=begun)
        state.turn, state.outcome = result.turn, result.outcome
        state.miss_reason, state.params_sent = result.miss_reason, result.params_sent
        if result.gap_s is not None:
            self.metrics.gap.observe(result.gap_s)
        if result.age_s is not None:
            self.metrics.entry_age.observe(result.age_s)
        self.metrics.lookups.labels(result.outcome.value).inc()
        emit(
            self.tracer,
            sc.SPAN_PROXY_LOOKUP,
            _with_turn(correlation, state.conversation_id, state.turn),
            {**result.attributes(), **attributes},
            start_ns=start_ns,
        )
        return identity, begun.previous if begun is not None else None

    async def _infer(
        self,
        identity: Identity,
        body: dict[str, Any],
        now: float,
        traceparent: str,
        state: TurnState,
        attributes: dict[str, Any],
    ) -> tuple[Identity, bool]:
        """The tenant's live conversation whose covered history this request extends
        (longest match), else a new id (``decide.new_conversation_id``)."""
        prefixes = Prefixes.of(body)
        found = None
        if prefixes is not None:
            found, failure = await self.guard.call(
                state.store_budget, self.store.infer, identity.tenant, prefixes, now
            )
            if failure is not None:
                attributes[sc.STORE_FAILURE.key] = failure
        if found is not None:
            return Identity(identity.tenant, found.conversation_id), True
        return Identity(
            identity.tenant, decide.new_conversation_id(traceparent.split("-")[1])
        ), False

    # ------------------------------------------------------------------ store

    async def _store(
        self,
        identity,
        state: TurnState,
        correlation,
        previous,
        params,
        digest,
        sent_wall,
        answered_wall,
    ) -> None:
        if params is None and state.stream:  # not in the stream: the params publisher
            wait = self.config.publisher_wait_s
            params, state.store_failure = await self.guard.call(
                state.store_budget, self.publisher.fetch, state.request_id, wait, extra_s=wait
            )
            if params is not None:
                state.source = sc.ParamsSource.PUBLISHED
        key = identity.store_key
        if key is None or state.turn is None:
            return
        config = self.config
        start_ns = time.time_ns()
        expires_at = None
        if params is not None:
            params = decide.stored_params(
                params, state.decode_host if config.rewrite_remote_host else None
            )
            found = decide.decode_expiry(params, config.decode_kv_ttl_s)
            wall = None
            if found is not None:
                expiry_d, ttl = found
                self.metrics.decode_ttl.set(ttl)
                wall = (
                    answered_wall
                    if config.fixed_entry_lifetime_s is not None
                    else self.clock.expiry_wall(
                        str(params.get("remote_engine_id")), expiry_d, ttl, sent_wall, answered_wall
                    )
                )
            expires_at = decide.entry_expiry(
                answered_wall,
                wall,
                margin_s=config.expiry_margin_s,
                max_lifetime_s=config.max_entry_lifetime_s,
                fixed_lifetime_s=config.fixed_entry_lifetime_s,
            )
        usable = params is not None and expires_at is not None and digest is not None
        action = decide.store_action(usable, previous)
        indexed = config.infer_conversations
        _, failure = await self.guard.call(
            state.store_budget,
            self.store.finish_turn,
            key,
            state.turn,
            time.time(),
            params if usable else None,
            expires_at if usable else None,
            digest if usable else None,
            identity.tenant if indexed else None,
            identity.conversation_id if indexed else None,
        )
        if failure is not None:
            action = "skipped"
        self.metrics.stores.labels(action, state.source.value).inc()
        emit(
            self.tracer,
            sc.SPAN_PROXY_STORE,
            _with_turn(correlation, state.conversation_id, state.turn),
            {
                sc.STORE_ACTION.key: action,
                sc.PARAMS_SOURCE.key: state.source,
                sc.STORE_EXPIRES_AT.key: expires_at if usable else None,
                sc.STORE_FAILURE.key: failure or state.store_failure,
            },
            start_ns=start_ns,
        )

    # ------------------------------------------------------------------ endings

    async def _internal_error(self, state: TurnState) -> web.StreamResponse:
        """A 500 in OpenAI's error form; once a stream has started, an SSE error event
        and ``[DONE]`` end it instead."""
        self.metrics.internal_errors.inc()
        message = "the proxy failed to complete the request"
        client = state.client
        if client is None or not client.prepared:
            return json_error(500, message, "internal_error")
        try:
            await to_client(client.write(sse_error(message, "internal_error", 500)))
            await to_client(client.write_eof())
        except ClientGone:
            state.error = PE.CLIENT_DISCONNECTED
        return client

    def _upstream_failure(self, error: UpstreamError, state: TurnState) -> web.Response:
        state.error = error.error
        self.metrics.upstream_errors.labels(error.role, error.kind).inc()
        passthrough, status = decide.upstream_answer(error.kind, error.status, bool(error.body))
        cause = f"answered {error.status}" if error.kind == "http-error" else error.kind
        log(
            _LOG,
            logging.INFO if passthrough else logging.WARNING,
            "engine failed a turn",
            role=error.role,
            cause=cause,
            status=status,
            request_id=state.request_id,
        )
        if passthrough:  # the engine refused the client's request: its answer as it is
            return web.Response(body=error.body, status=status, content_type="application/json")
        return json_error(status, f"{error.role} engine {error.kind}", "upstream_error")

    def _end_turn(self, span: trace.Span, state: TurnState, correlation: Correlation) -> None:
        turn_bucket = sc.turn_bucket(state.turn or 1)
        prompt_bucket = sc.prompt_bucket(state.prompt_tokens or 0)
        self.metrics.turns.labels(turn_bucket, prompt_bucket, state.outcome.value).inc()
        if state.error is None and state.d_answered is not None:
            # The turn's trace id as exemplar: a dashboard point opens the turn's trace.
            context = span.get_span_context()
            exemplar = (
                {sc.EXEMPLAR_TRACE_ID: trace.format_trace_id(context.trace_id)}
                if context.is_valid
                else None
            )
            if state.ttft_s is not None:
                self.metrics.ttft.labels(turn_bucket, prompt_bucket).observe(state.ttft_s, exemplar)
            self.metrics.latency.labels(turn_bucket, prompt_bucket).observe(
                time.perf_counter() - state.start_perf, exemplar
            )
            self.metrics.observe_phases(state, time.time())
        try:
            if span.is_recording():
                span.set_attributes(
                    {
                        **correlation.attributes(),
                        **clean(
                            {
                                sc.STREAM.key: state.stream,
                                sc.TTFT.key: state.ttft_s,
                                sc.PREFILL_TIME.key: state.prefill_s,
                                sc.DECODE_TIME.key: state.decode_s,
                                sc.LOOKUP_OUTCOME.key: state.outcome,
                                sc.LOOKUP_MISS_REASON.key: state.miss_reason,
                                sc.PARAMS_SENT.key: state.params_sent,
                                sc.PARAMS_SOURCE.key: state.source,
                                sc.PROMPT_TOKENS.key: state.prompt_tokens,
                                sc.OUTPUT_TOKENS.key: state.output_tokens,
                                sc.REQUEST_MODEL.key: state.model,
                                sc.RESPONSE_ID.key: state.response_id,
                                sc.REQUEST_ID.key: state.request_id,
                                sc.ROLE.key: "proxy",
                                sc.PROXY_ERROR.key: state.error,
                                sc.FALLBACK_REASON.key: state.fallback,
                                sc.PREFILL_SENT_AT.key: state.p_sent,
                                sc.PREFILL_RETRY_SENT_AT.key: state.p_retry_sent,
                                sc.PREFILL_ANSWERED_AT.key: state.p_answered,
                                sc.DECODE_SENT_AT.key: state.d_sent,
                                sc.DECODE_FIRST_OUTPUT_AT.key: state.d_first_output,
                                sc.DECODE_ANSWERED_AT.key: state.d_answered,
                            }
                        ),
                    }
                )
                if state.error is not None:
                    span.set_status(trace.Status(trace.StatusCode.ERROR))
            span.end()
        except Exception:  # noqa: BLE001 - telemetry never breaks serving
            _LOG.debug("turn span failed", exc_info=True)
