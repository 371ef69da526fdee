"""Span sink and the never-raise guard shared by both observers.

Tracers are built lazily, on the first span, in the process that emits it (the
scheduler process or a worker process), so processes that never emit start no export
thread. With ``kvobs_role`` set every span goes to that service; without it each span
goes to the service ``kvobs.semconv`` assigns to its name.

Hooks never build OTel spans, nor even their attribute dicts: ``SpanSink.emit_fields``
appends one flat tuple (span name, the four raw correlation values, a constant key
tuple, the matching values, start/end taken in the hook) to a bounded queue, and one
daemon thread per sink (started with the first span) parses the correlation, zips the
attributes and builds finished spans with those explicit timestamps, in batches (every
50 ms, or at once when the queue is half full). ``emit`` (a ready ``Correlation`` and
attribute dict) is the convenience form of the same queue. A full queue drops the span
and counts it in
``errors`` (-> ``vllm:kvobs_connector_telemetry_errors_total``); it never blocks.
``flush()`` builds everything still queued, synchronously, then flushes the tracers.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Mapping

from opentelemetry import trace

from kvobs import semconv as sc
from kvobs.emit.setup import batch_settings, configure_tracing, flush, span_losses
from kvobs.emit.spans import Correlation, emit, shard_key

_LOG = logging.getLogger("connector_instrumented")

TracerFactory = Callable[[sc.Service], trace.Tracer]
# The builder wakes on a timer and builds in batches: waking it per span would cost the
# hook a futex wake and hand the GIL back and forth once per span. A queue half full
# wakes it early so that bursts do not drop.
_BUILD_INTERVAL_S = 0.05


def raw_correlation(params: Mapping[str, Any] | None, request: Any = None) -> tuple | None:
    """A request's correlation values as they came (one C-level pass over the keys),
    then its first block hash (its shard, ``shard_key``).

    A snapshot, not a reference to ``params``: the request's dict may be mutated or
    outlive its use, and a retained export would otherwise pin its block lists."""
    return (*map(params.get, sc.CORRELATION_KEYS), first_block(request)) if params else None


def first_block(request: Any) -> bytes | None:
    """The request's first block hash (immutable bytes: safe to keep for the builder)."""
    hashes = getattr(request, "block_hashes", None)
    return hashes[0] if hashes is not None and len(hashes) else None


class Deferred:
    """A span attribute computed by the builder thread, not the hook: ``fn(*args)``.

    For values that cost more than the hook may spend (a prompt's block-hash chain); the
    args must stay valid until the span is built (references the request does not
    mutate in that range)."""

    __slots__ = ("fn", "args")

    def __init__(self, fn: Callable[..., Any], *args: Any):
        self.fn = fn
        self.args = args


def _resolve(values: dict) -> dict:
    for key, value in values.items():
        if type(value) is Deferred:
            values[key] = value.fn(*value.args)
    return values


def _correlation_of(raw: tuple | None) -> Correlation:
    # Same validation as the hook used to do in place, now in the builder thread.
    if not raw:
        return Correlation.from_params(None)
    correlation = Correlation.from_params(dict(zip(sc.CORRELATION_KEYS, raw)))
    if len(raw) <= _FIRST_BLOCK:
        return correlation
    return correlation._replace(shard=shard_key(correlation.tenant, raw[_FIRST_BLOCK]))


_FIRST_BLOCK = len(sc.CORRELATION_KEYS)  # raw_correlation's last value


# Fork detection without a getpid() system call on every span (~150 ns on the hook).
_SINKS: "weakref.WeakSet[SpanSink]" = weakref.WeakSet()


def _mark_forked() -> None:
    for sink in list(_SINKS):
        sink._forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_forked)


class SpanSink:
    """Routes finished spans to per-service tracers off the hook; counts what it drops."""

    def __init__(
        self,
        role: sc.Service | None,
        store_dir: str | None = None,
        tracer_factory: TracerFactory | None = None,
        max_queue: int | None = None,
    ):
        self._role = role
        self._store_dir = store_dir
        self._factory = tracer_factory or self._configure
        self._tracers: dict[sc.Service, trace.Tracer] = {}
        self._enabled: dict[str, bool] = {}  # by span name: asked on every hook call
        self._max_queue = max(
            1, int(max_queue if max_queue is not None else batch_settings().max_queue)
        )
        self._wake_at = max(1, self._max_queue // 2)
        # deque append/popleft are atomic under the GIL: one producer (the hook's
        # thread) and the builder thread need no lock to hand items over; the bound is
        # checked before appending.
        self._queue: deque = deque()
        self._build_lock = threading.Lock()  # one builder at a time (thread or flush)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._forked = False  # set in a forked child: the queue came along, not the thread
        _SINKS.add(self)
        self.dropped = 0  # spans dropped on a full queue (also counted in errors)
        self._hook_errors = 0
        self._build_errors = 0  # written by the builder thread only

    @property
    def errors(self) -> int:
        """Telemetry failures caught (hooks and spans) plus spans dropped."""
        return self._hook_errors + self._build_errors + self.dropped

    def losses(self) -> dict[str, int]:
        """Spans lost so far by ``semconv.TELEMETRY_DROP_REASONS``: this sink's full queue
        and its tracers' export processors (full queue, failed exports)."""
        totals = {"queue-full": self.dropped, "export-failed": 0}
        for tracer in list(self._tracers.values()):
            for reason, count in span_losses(tracer).items():
                totals[reason] = totals.get(reason, 0) + count
        return totals

    def _configure(self, service: sc.Service) -> trace.Tracer:
        return configure_tracing(service, self._store_dir)

    def tracer(self, span: sc.SpanName) -> trace.Tracer:
        service = self._role or span.service
        tracer = self._tracers.get(service)
        if tracer is None:
            tracer = self._tracers[service] = self._factory(service)
            if not isinstance(tracer, trace.NoOpTracer):
                # After the tracer's provider registered its own exit hook: ours runs
                # first (LIFO) and builds what is still queued while it can export.
                atexit.register(self._flush_at_exit)
        return tracer

    def enabled(self, span: sc.SpanName) -> bool:
        """False when spans would be dropped anyway: skip building attributes."""
        flag = self._enabled.get(span.name)
        if flag is None:
            flag = self._enabled[span.name] = not isinstance(self.tracer(span), trace.NoOpTracer)
        return flag

    def emit(
        self,
        span: sc.SpanName,
        correlation: Correlation,
        attributes: Mapping[str, Any],
        start_s: float | None = None,
        end_s: float | None = None,
        error: str | None = None,
    ) -> None:
        """Queue one finished span; wall-clock seconds in, never raises or blocks.

        Timestamps are fixed here (a missing one is "now", in the hook), never in the
        builder thread. ``attributes`` is kept by reference: callers pass a fresh dict.
        """
        try:
            if not self.enabled(span):
                return
            now = time.time() if start_s is None or end_s is None else 0.0
        except Exception:  # noqa: BLE001
            self._hook_errors += 1
            return
        self.emit_fields(
            span,
            correlation,
            None,
            attributes,
            now if start_s is None else start_s,
            now if end_s is None else end_s,
            error,
        )

    def emit_fields(
        self,
        span: sc.SpanName,
        raw_correlation: tuple | None,
        keys: tuple | None,
        values: Any,
        start_s: float,
        end_s: float,
        error: str | None = None,
    ) -> None:
        """The hook-path form of ``emit``: the caller checked ``enabled(span)``.

        ``raw_correlation`` is ``raw_correlation(params)`` (or None); ``keys`` a constant
        tuple of attribute keys and ``values`` the matching values (``keys`` None:
        ``values`` is the attribute dict and the correlation a ``Correlation``). The
        dict, the ``Correlation`` and the nanosecond timestamps are made by the builder.
        """
        try:
            queue = self._queue
            if len(queue) >= self._max_queue:
                self.dropped += 1
                return
            queue.append((span, raw_correlation, keys, values, start_s, end_s, error))
            if self._thread is None or self._forked:
                self._start_thread()
            elif len(queue) == self._wake_at:
                self._wake.set()
        except Exception:  # noqa: BLE001
            self._hook_errors += 1

    def _start_thread(self) -> None:
        if self._thread is not None:  # forked child: the queue came along, not the thread
            self._build_lock = threading.Lock()
            self._wake = threading.Event()
        self._forked = False
        self._thread = threading.Thread(target=self._run, name="kvobs-span-build", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait(_BUILD_INTERVAL_S)
            self._wake.clear()
            self._build(yield_gil=True)

    def _build(self, yield_gil: bool = False) -> None:
        """Turn every queued fact into a finished OTel span (builder thread or flush).

        The builder thread gives the GIL back after every span: otherwise a scheduler
        thread that wants it waits out the switch interval (5 ms) behind a whole batch,
        which lands as one multi-millisecond stall inside whatever hook is running."""
        queue = self._queue
        pause = time.sleep if yield_gil else None
        with self._build_lock:
            while queue:
                if pause is not None:
                    pause(0)
                try:
                    span, correlation, keys, values, start_s, end_s, error = queue.popleft()
                    if keys is not None:
                        values = _resolve(dict(zip(keys, values)))
                    if type(correlation) is not Correlation:
                        correlation = _correlation_of(correlation)
                    emit(
                        self.tracer(span),
                        span,
                        correlation,
                        values,
                        int(start_s * 1e9),
                        int(end_s * 1e9),
                        error,
                    )
                except Exception:  # noqa: BLE001
                    self._build_errors += 1

    def flush(self) -> None:
        """Build every queued span now (in the caller's thread), then flush the tracers."""
        try:
            self._build()
        except Exception:  # noqa: BLE001
            self._hook_errors += 1
        for tracer in list(self._tracers.values()):
            try:
                flush(tracer)
            except Exception:  # noqa: BLE001
                self._hook_errors += 1

    def _flush_at_exit(self) -> None:
        self.flush()


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
            _LOG.warning(
                "kvobs %s telemetry failed in %s (%d failures so far); serving is unaffected",
                self._name,
                what,
                self.errors,
                exc_info=True,
            )
