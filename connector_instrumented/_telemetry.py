"""Span sink and the never-raise guard shared by both observers.

Tracers are built lazily, on the first span, in the process that emits it (the
scheduler process or a worker process), so processes that never emit start no export
thread. With ``kvobs_role`` set every span goes to that service; without it each span
goes to the service ``kvobs.semconv`` assigns to its name.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

from opentelemetry import trace

from kvobs import semconv as sc
from kvobs.emit.setup import configure_tracing, flush
from kvobs.emit.spans import Correlation, emit

_LOG = logging.getLogger("connector_instrumented")

TracerFactory = Callable[[sc.Service], trace.Tracer]


class SpanSink:
    """Routes finished spans to per-service tracers; counts what it had to drop."""

    def __init__(self, role: sc.Service | None, store_dir: str | None = None,
                 tracer_factory: TracerFactory | None = None):
        self._role = role
        self._store_dir = store_dir
        self._factory = tracer_factory or self._configure
        self._tracers: dict[sc.Service, trace.Tracer] = {}
        self.errors = 0  # telemetry failures caught (hooks and spans)

    def _configure(self, service: sc.Service) -> trace.Tracer:
        return configure_tracing(service, self._store_dir)

    def tracer(self, span: sc.SpanName) -> trace.Tracer:
        service = self._role or span.service
        tracer = self._tracers.get(service)
        if tracer is None:
            tracer = self._tracers[service] = self._factory(service)
        return tracer

    def enabled(self, span: sc.SpanName) -> bool:
        """False when spans would be dropped anyway: skip building attributes."""
        return not isinstance(self.tracer(span), trace.NoOpTracer)

    def emit(self, span: sc.SpanName, correlation: Correlation,
             attributes: Mapping[str, Any], start_s: float | None = None,
             end_s: float | None = None, error: bool = False) -> None:
        """Emit one finished span; wall-clock seconds in, never raises."""
        try:
            tracer = self.tracer(span)
            if isinstance(tracer, trace.NoOpTracer):
                return
            start_ns = int(start_s * 1e9) if start_s is not None else None
            end_ns = int(end_s * 1e9) if end_s is not None else None
            emit(tracer, span, correlation, attributes, start_ns, end_ns, error)
        except Exception:  # noqa: BLE001
            self.errors += 1

    def flush(self) -> None:
        for tracer in self._tracers.values():
            try:
                flush(tracer)
            except Exception:  # noqa: BLE001
                self.errors += 1


class Guard:
    """Runs telemetry code so that it can never raise into vLLM; counts failures."""

    def __init__(self, name: str):
        self._name = name
        self.errors = 0
        self._last_log = 0.0

    def failed(self, what: str) -> None:
        self.errors += 1
        now = time.monotonic()
        if now - self._last_log > 60.0:  # at most one log line a minute
            self._last_log = now
            _LOG.warning("kvobs %s telemetry failed in %s (%d failures so far); "
                         "serving is unaffected", self._name, what, self.errors,
                         exc_info=True)
