"""The proxy's kvobs spans of a turn carry the turn's shard (``kvobs.shard``), which only
P's answer names (the connector computes it from the prompt's first block hash; the
proxy has no block hashes): a span that ends before P answers (the lookup, a fallback)
is held and emitted, with its own start and end, once P answered or the turn ended.
Several classifiers behind the Collector's loadbalancing exporter then get every span
of a conversation in one of them."""

from __future__ import annotations

import time
from typing import Any, Mapping

from opentelemetry import trace

from kvobs import semconv as sc
from kvobs.emit.spans import Correlation, emit
from kvobs.proxy._state import TurnState


def emit_turn_span(
    tracer: trace.Tracer,
    state: TurnState,
    span: sc.SpanName,
    correlation: Correlation,
    attributes: Mapping[str, Any],
    start_ns: int,
) -> None:
    """``emit``, with the turn's shard; held while P has not answered."""
    end_ns = time.time_ns()
    if state.p_answered is None:
        state.held_spans.append((tracer, span, correlation, attributes, start_ns, end_ns))
        return
    emit(tracer, span, correlation._replace(shard=state.shard), attributes, start_ns, end_ns)


def answered_by_p(state: TurnState, params: Any) -> None:
    """P's answer names the turn's shard: the held spans go out with it."""
    shard = params.get(sc.KTP_SHARD) if isinstance(params, dict) else None
    state.shard = shard if isinstance(shard, str) and shard else None
    release_held(state)


def release_held(state: TurnState) -> None:
    """The held spans, with the shard if P named one (the turn ended without: without)."""
    held, state.held_spans = state.held_spans, []
    for tracer, span, correlation, attributes, start_ns, end_ns in held:
        emit(tracer, span, correlation._replace(shard=state.shard), attributes, start_ns, end_ns)


__all__ = ["answered_by_p", "emit_turn_span", "release_held"]
