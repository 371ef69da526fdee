"""One turn, end to end: input and identity, the tenant policy, then the lookup and the
store (``_turn_store``), the engine legs (``legs``), and the turn's ending (``_turn_end``:
failure answers, the turn's span and metrics).
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

from kvobs import semconv as sc
from kvobs.emit.spans import Correlation, current_traceparent

from kvobs.proxy import decide
from kvobs.proxy._guard import StoreGuard
from kvobs.proxy._http_spans import client_context, end_server, genai_attributes, start_server
from kvobs.proxy._identity import (
    ANONYMOUS,
    Identity,
    InputError,
    conversation_of,
    tenant_digest,
    tenant_of,
)
from kvobs.proxy._input import UNREAD_BODY_REASONS, check_headers, parse_body, read_body
from kvobs.proxy._log import FIELDS
from kvobs.proxy._metrics import ProxyMetrics
from kvobs.proxy._sse import genai_value
from kvobs.proxy._state import TurnState, UpstreamError
from kvobs.proxy._tenants import NewTenants
from kvobs.proxy.config import ProxyConfig
from kvobs.proxy._turn_end import end_turn, internal_error, json_error, upstream_failure
from kvobs.proxy._turn_spans import answered_by_p, release_held
from kvobs.proxy._turn_store import TurnStore, with_turn
from kvobs.proxy._sse import KTP
from kvobs.proxy.legs import Legs
from kvobs.proxy.publisher import ParamsPublisher
from kvobs.proxy.store import MetadataStore

_LOG = logging.getLogger("kvobs.proxy")
TRACE_ID_KEY = web.RequestKey("kvobs_trace_id", str)
# The conversation id the proxy gave a request that came without one (inferred or new).
ASSIGNED_ID_KEY = web.RequestKey("kvobs_assigned_conversation_id", str)
PE = sc.ProxyError


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
        self.steps = TurnStore(config, tracer, metrics, store, publisher, guard)
        self.tenants = NewTenants(
            config.max_new_tenants, config.new_tenant_window_s, config.max_entries
        )

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
        client = client_context(request.headers)
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
            refusal = json_error(error.status, error.message, "invalid_request_error")
            if error.reason in UNREAD_BODY_REASONS:
                refusal.force_close()  # the rest of the body is not waited for
            # Refused before its turn: the SERVER span alone, in the client's trace.
            end_server(
                start_server(self.tracer, request, path, start_ns, client),
                refusal.status,
            )
            return refusal
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
        # The client's trace goes on (an agent's trace holds its turns): its span is the
        # SERVER span's parent, the turn the SERVER span's child (no client trace: the
        # SERVER span is a new root). The engines get the turn's context.
        server = start_server(self.tracer, request, path, start_ns, client)
        state.http_context = trace.set_span_in_context(server)
        state.client_trace = trace.get_current_span(client).get_span_context().is_valid
        span = self.tracer.start_span(
            sc.SPAN_PROXY_TURN.name,
            context=state.http_context,
            start_time=start_ns,
            attributes=genai_attributes(path, state.request_id),
        )
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
            response = await internal_error(self.metrics, state)
            return response
        finally:
            end_server(
                server,
                response.status if response is not None else None,
                state.error.value if state.error is not None else None,
            )
            release_held(state)  # P never answered: they go without the shard
            end_turn(
                self.metrics,
                span,
                state,
                with_turn(correlation, state.conversation_id, state.turn)._replace(
                    shard=state.shard
                ),
            )

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
        assigned, previous = await self.steps.lookup(identity, body, refused, state, correlation)
        if assigned is not identity:
            if assigned.conversation_id is not None:  # inferred or new: always named
                request[ASSIGNED_ID_KEY] = assigned.conversation_id
            identity = assigned
        correlation = with_turn(correlation, identity.conversation_id, state.turn)
        keys = {**correlation.to_params(), sc.KTP_REQUEST_ID: state.request_id}
        headers = self._headers(state.request_id, correlation)
        params = previous.params if state.params_sent and previous is not None else None
        try:
            p_response, p_endpoint = await self.legs.prefill(
                path, body, params, keys, headers, state, correlation
            )
            p_params = p_response.get(KTP) if isinstance(p_response, dict) else None
            answered_by_p(state, p_params)
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
                    await self.steps.store(
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
            return upstream_failure(self.metrics, error, state)
