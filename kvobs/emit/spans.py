"""Emitter helpers shared by the connector and the proxy (OTel API only).

Correlation travels inside ``kv_transfer_params`` (keys in ``semconv.CORRELATION_KEYS``),
so every engine span carries the turn's identity even without a tracing backend on the
engine's request path.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, NamedTuple

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvobs import semconv as sc

_PROPAGATOR = TraceContextTextMapPropagator()


class Correlation(NamedTuple):
    """Who a request belongs to: ids only. A tuple: built on every request, kept cheap."""

    conversation_id: str | None = None
    turn: int | None = None
    tenant: str | None = None
    traceparent: str | None = None
    shard: str | None = None  # ``shard_key``: the connector's, P's answer's at the proxy

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> "Correlation":
        if not params:
            return _EMPTY
        get = params.get
        turn = get(sc.KTP_TURN_INDEX)
        if type(turn) is not int:
            turn = int(turn) if isinstance(turn, str) and turn.isdigit() else None
        return cls(
            _str_or_none(get(sc.KTP_CONVERSATION_ID)),
            turn,
            _str_or_none(get(sc.KTP_TENANT)),
            _str_or_none(get(sc.KTP_TRACEPARENT)),
        )

    def to_params(self) -> dict[str, Any]:
        keys = {
            sc.KTP_CONVERSATION_ID: self.conversation_id,
            sc.KTP_TURN_INDEX: self.turn,
            sc.KTP_TENANT: self.tenant,
            sc.KTP_TRACEPARENT: self.traceparent,
        }
        return {key: value for key, value in keys.items() if value is not None}

    def attributes(self) -> dict[str, Any]:
        attributes = {
            sc.CONVERSATION_ID.key: self.conversation_id,
            sc.TURN_INDEX.key: self.turn,
            sc.TENANT_DIGEST.key: self.tenant,
            sc.SHARD.key: self.shard,
        }
        return {key: value for key, value in attributes.items() if value is not None}

    def parent_context(self):
        if not self.traceparent:
            return None
        return _context_of(self.traceparent)


# A proxy turn parents its lookup, store and leg headers on one traceparent: parsed once
# (a context is immutable, so one object serves them all). Small: ids are per turn, and
# an entry is ~0.6 kB (1,024 of them held 0.6 MB, over test_proxy_memory's bound); 128
# covers the turns in flight at 64 clients.
@functools.lru_cache(maxsize=128)
def _context_of(traceparent: str):
    return _PROPAGATOR.extract({"traceparent": traceparent})


def shard_key(tenant: str | None, first_block: Any) -> str | None:
    """``semconv.SHARD`` of a request: its tenant digest and its prompt's first block
    hash prefix (the engine's ``request.block_hashes[0]``: every turn's prompt starts
    with it, on P and on D alike when they hash with the same seed, as prefix lineage
    needs anyway). None: a prompt shorter than a block."""
    if not isinstance(first_block, (bytes, bytearray)) or not first_block:
        return None
    prefix = bytes(first_block[:8]).hex()
    return f"{tenant}/{prefix}" if tenant else prefix


def _str_or_none(value: Any) -> str | None:
    return value if type(value) is str and value else None


_EMPTY = Correlation()


def current_traceparent() -> str | None:
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent")


def clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """Drop None values and turn enums into their values (OTel takes primitives only)."""
    out = {}
    for key, value in attributes.items():
        if value is None:
            continue
        out[key] = value.value if hasattr(value, "value") else value
    return out


def emit(
    tracer: trace.Tracer,
    span: sc.SpanName,
    correlation: Correlation,
    attributes: Mapping[str, Any],
    start_ns: int | None = None,
    end_ns: int | None = None,
    error: str | None = None,
) -> None:
    """Record one finished span. Never raises: telemetry must not break serving.
    ``error``: the span failed, and why (its ERROR status's description: the cause,
    never request text)."""
    try:
        otel_span = tracer.start_span(
            span.name, context=correlation.parent_context(), start_time=start_ns
        )
        if otel_span.is_recording():
            otel_span.set_attributes({**correlation.attributes(), **clean(attributes)})
            if error:
                otel_span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        otel_span.end(end_time=end_ns)
    except Exception:  # noqa: BLE001
        return
