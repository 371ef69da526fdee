"""The turn's store I/O: the lookup that starts a turn (its index, outcome and D's
previous params; a request without an id inferred onto the conversation it continues)
and the store that ends it (D's new params and their expiry).

The decisions are ``decide``'s; this module does the store's I/O behind the
``StoreGuard``'s per-turn budget and breaker, and records each step's span and metrics.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from opentelemetry import trace

from kvobs import semconv as sc
from kvobs.emit.spans import Correlation

from kvobs.proxy import decide
from kvobs.proxy._clock import DecodeClock
from kvobs.proxy._digest import Prefixes
from kvobs.proxy._guard import StoreGuard
from kvobs.proxy._identity import Identity
from kvobs.proxy._metrics import ProxyMetrics
from kvobs.proxy._state import TurnState
from kvobs.proxy._turn_spans import emit_turn_span
from kvobs.proxy.config import ProxyConfig
from kvobs.proxy.publisher import ParamsPublisher
from kvobs.proxy.store import Entry, MetadataStore


def with_turn(
    correlation: Correlation, conversation_id: str | None, turn: int | None
) -> Correlation:
    return correlation._replace(conversation_id=conversation_id, turn=turn)


class TurnStore:
    def __init__(
        self,
        config: ProxyConfig,
        tracer: trace.Tracer,
        metrics: ProxyMetrics,
        backend: MetadataStore,
        publisher: ParamsPublisher,
        guard: StoreGuard,
    ):
        self.config, self.tracer, self.metrics = config, tracer, metrics
        self.backend, self.publisher, self.guard = backend, publisher, guard
        self.clock = DecodeClock()
        # This process, on every lookup span: a restart shows as a new id and a later start.
        self.instance = secrets.token_hex(8)
        self.started_at = time.time()

    async def lookup(
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
                state.store_budget, self.backend.begin_turn, identity.store_key, now
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
        emit_turn_span(
            self.tracer,
            state,
            sc.SPAN_PROXY_LOOKUP,
            with_turn(correlation, state.conversation_id, state.turn),
            {**result.attributes(), **attributes},
            start_ns,
        )
        return identity, begun.previous if begun is not None else None

    async def _infer(
        self,
        identity: Identity,
        body: dict[str, Any],
        now: float,
        traceparent: str | None,
        state: TurnState,
        attributes: dict[str, Any],
    ) -> tuple[Identity, bool]:
        """The tenant's live conversation whose covered history this request extends
        (longest match), else a new id (``decide.new_conversation_id``)."""
        prefixes = Prefixes.of(body)
        found = None
        if prefixes is not None:
            found, failure = await self.guard.call(
                state.store_budget, self.backend.infer, identity.tenant, prefixes, now
            )
            if failure is not None:
                attributes[sc.STORE_FAILURE.key] = failure
        if found is not None:
            return Identity(identity.tenant, found.conversation_id), True
        assert traceparent is not None  # the turn's own: turn.py always sets one
        return Identity(
            identity.tenant,
            decide.new_conversation_id(*decide.trace_and_span(traceparent, state.client_trace)),
        ), False

    async def store(
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
            self.backend.finish_turn,
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
        emit_turn_span(
            self.tracer,
            state,
            sc.SPAN_PROXY_STORE,
            with_turn(correlation, state.conversation_id, state.turn),
            {
                sc.STORE_ACTION.key: action,
                sc.PARAMS_SOURCE.key: state.source,
                sc.STORE_EXPIRES_AT.key: expires_at if usable else None,
                sc.STORE_FAILURE.key: failure or state.store_failure,
            },
            start_ns,
        )
