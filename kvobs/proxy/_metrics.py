"""The proxy's Prometheus metrics, on its own CollectorRegistry, every label value at zero."""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, GCCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kvobs import __version__
from kvobs import semconv as sc
from kvobs.emit.prometheus import client_name as _name
from kvobs.emit.prometheus import counter as _counter
from kvobs.emit.prometheus import gauge as _gauge
from kvobs.emit.prometheus import histogram as _histogram

_ROLES = ("prefill", "decode")
_ERROR_KINDS = ("unreachable", "http-error", "disconnected", "timeout")
_REJECT_REASONS = (
    "body-too-large",
    "bad-json",
    "not-an-object",
    "bad-conversation-id",
    "conversation-id-too-long",
    "tenant-too-long",
    "bad-field",
    "too-deep",
    "bad-unicode",
    "bad-header",
    "bad-body",
    "body-timeout",
    "unsupported-encoding",
    "non-finite-number",
)
_STORE_ACTIONS = ("stored", "refreshed", "skipped")


class _SpanLoss(Collector):
    """``kvobs_telemetry_dropped_spans_total{reason}``, read at scrape time from the
    span processors' own counters (nothing on the turn's path)."""

    def __init__(self):
        self.sources: list[Callable[[], Mapping[str, int]]] = []

    def collect(self) -> Iterable[CounterMetricFamily]:
        metric = sc.M_TELEMETRY_DROPPED
        family = CounterMetricFamily(_name(metric), metric.doc, labels=metric.labels)
        totals = dict.fromkeys(sc.TELEMETRY_DROP_REASONS, 0)
        for source in self.sources:
            try:
                for reason, count in source().items():
                    totals[reason] = totals.get(reason, 0) + count
            except Exception:  # noqa: BLE001 - a scrape never fails on telemetry
                continue
        for reason, count in totals.items():
            family.add_metric([reason], count)
        yield family


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.turns = _counter(sc.M_PROXY_TURNS, r)
        self.lookups = _counter(sc.M_PROXY_LOOKUPS, r)
        self.entry_age = _histogram(sc.M_PROXY_ENTRY_AGE, r)
        self.gap = _histogram(sc.M_PROXY_GAP, r)
        self.stores = _counter(sc.M_PROXY_STORES, r)
        self.entry_lifetime = _gauge(sc.M_PROXY_ENTRY_LIFETIME, r)
        self.decode_ttl = _gauge(sc.M_PROXY_DECODE_TTL, r)
        self.fallbacks = _counter(sc.M_PROXY_FALLBACKS, r)
        self.evictions = _counter(sc.M_PROXY_EVICTIONS, r)
        self.entries = _gauge(sc.M_PROXY_ENTRIES, r)
        self.store_errors = _counter(sc.M_PROXY_STORE_ERRORS, r)
        self.ttft = _histogram(sc.M_PROXY_TTFT, r)
        self.latency = _histogram(sc.M_PROXY_LATENCY, r)
        self.phase = _histogram(sc.M_PROXY_PHASE, r)
        self.upstream_errors = _counter(sc.M_PROXY_UPSTREAM_ERRORS, r)
        self.upstream_retries = _counter(sc.M_PROXY_UPSTREAM_RETRIES, r)
        self.rejected = _counter(sc.M_PROXY_REJECTED, r)
        self.stripped = _counter(sc.M_PROXY_CLIENT_PARAMS_STRIPPED, r)
        self.internal_errors = _counter(sc.M_PROXY_INTERNAL_ERRORS, r)
        self.store_degraded = _counter(sc.M_PROXY_STORE_DEGRADED, r)
        self.store_circuit_open = _gauge(sc.M_PROXY_STORE_CIRCUIT_OPEN, r)
        self.store_circuit_opened = _counter(sc.M_PROXY_STORE_CIRCUIT_OPENED, r)
        self.anonymous_turns = _counter(sc.M_PROXY_ANONYMOUS_TURNS, r)
        self.new_tenants = _counter(sc.M_PROXY_NEW_TENANTS, r)
        self.tenant_limited = _counter(sc.M_PROXY_TENANT_LIMITED, r)
        self.upstream_up = _gauge(sc.M_PROXY_UPSTREAM_UP, r)
        _gauge(sc.M_BUILD_INFO, r).labels(__version__).set(1)
        self.span_loss = _SpanLoss()
        r.register(self.span_loss)
        # process_* and python_gc_*: prometheus_client's default collectors, on this
        # registry (the global one is not served).
        try:
            ProcessCollector(registry=r)
            GCCollector(registry=r)
        except ValueError:  # already there (the global registry, passed in)
            pass
        self._zero()

    def observe_phases(self, state, end: float) -> None:
        """The phases the proxy times alone (a completed turn has every mark)."""
        phase = self.phase
        phase.labels("proxy-in").observe(max(0.0, state.p_sent - state.start_wall))
        phase.labels("prefill-leg").observe(max(0.0, state.p_answered - state.p_sent))
        phase.labels("proxy-hop").observe(max(0.0, state.d_sent - state.p_answered))
        phase.labels("decode-leg").observe(max(0.0, state.d_answered - state.d_sent))
        phase.labels("proxy-out").observe(max(0.0, end - state.d_answered))

    def watch_spans(self, tracer) -> None:
        """Count ``tracer``'s lost spans in ``kvobs_telemetry_dropped_spans_total``."""
        from kvobs.emit.setup import span_losses

        self.span_loss.sources.append(lambda: span_losses(tracer))

    def _zero(self) -> None:
        outcomes = [o.value for o in sc.LookupOutcome]
        for turn in sc.TURN_BUCKET_VALUES:
            for prompt in sc.PROMPT_BUCKET_VALUES:
                self.ttft.labels(turn, prompt)
                self.latency.labels(turn, prompt)
                for outcome in outcomes:
                    self.turns.labels(turn, prompt, outcome)
        for phase in sc.PROXY_PHASE_VALUES:
            self.phase.labels(phase)
        for outcome in outcomes:
            self.lookups.labels(outcome)
        for action in _STORE_ACTIONS:
            for source in sc.ParamsSource:
                self.stores.labels(action, source.value)
        for reason in sc.FallbackReason:
            self.fallbacks.labels(reason.value)
        for backend in ("memory", "redis", "publisher"):
            self.store_errors.labels(backend)
        for role in _ROLES:
            for kind in _ERROR_KINDS:
                self.upstream_errors.labels(role, kind)
            for cause in sc.UpstreamRetryCause:
                self.upstream_retries.labels(role, cause.value)
        for rejected in _REJECT_REASONS:
            self.rejected.labels(rejected)
        for failure in sc.StoreFailure:
            self.store_degraded.labels(failure.value)
