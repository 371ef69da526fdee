"""The one place where the OTel SDK is chosen (deployer's side, environment first).

- ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``: spans go to
  the user's collector over OTLP (``OTEL_EXPORTER_OTLP_PROTOCOL`` = ``grpc`` or
  ``http/protobuf``, the SDK default rules).
- ``KVOBS_STORE``: spans also go to the embedded store, a directory ``kvobs`` reads with
  ``--source DIR`` (no infrastructure needed).
- ``OTEL_SDK_DISABLED=true`` or neither set: a no-op tracer; emitters cost a few ns.
"""

from __future__ import annotations

import logging
import os
import collections
import threading
import time

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter

from kvobs.semconv import STORE_LIVE_DIR, Service

ENV_STORE = "KVOBS_STORE"
ENV_QUEUE_SIZE = "KVOBS_SPAN_QUEUE_SIZE"
_LOG = logging.getLogger(__name__)


class DroppingBatchProcessor(SpanProcessor):
    """Bounded queue + one export thread; a full queue drops and counts, never blocks.

    The queue is a deque (append and popleft are atomic): ``queue.Queue``'s lock and
    condition cost the emitting thread more than the rest of ``on_end``. The bound is
    checked before the append, so concurrent emitters may overshoot it by a few spans."""

    def __init__(self, exporter: SpanExporter, max_queue: int = 8192, batch: int = 64,
                 interval_s: float = 0.5):
        self._exporter = exporter
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._max_queue = max_queue
        self._batch = batch
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._flushed = threading.Condition()
        self.dropped = 0
        self.export_failures = 0
        self._thread = threading.Thread(target=self._run, name="kvobs-span-export", daemon=True)
        self._thread.start()

    def on_start(self, span, parent_context=None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        if len(self._queue) >= self._max_queue:
            self.dropped += 1
        else:
            self._queue.append(span)

    def _drain(self) -> None:
        while True:
            batch = []
            while len(batch) < self._batch:
                try:
                    batch.append(self._queue.popleft())
                except IndexError:
                    break
            if not batch:
                return
            try:
                result = self._exporter.export(batch)
                if getattr(result, "name", "SUCCESS") != "SUCCESS":
                    self.export_failures += len(batch)
            except Exception:  # noqa: BLE001
                self.export_failures += len(batch)
                _LOG.debug("span export failed", exc_info=True)
            # Small batches, the GIL handed back between them: encoding holds it, so one
            # batch of hundreds of spans held the host's request thread for ~15 ms.
            time.sleep(0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._drain()
        self._drain()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._drain()
        return True

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._exporter.shutdown()


def _otlp_exporter() -> SpanExporter | None:
    if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return None
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                              os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"))
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def store_span_file(store_dir: str, service: Service) -> str:
    return os.path.join(store_dir, STORE_LIVE_DIR, f"{service.value}-{os.getpid()}.otlp.jsonl")


def configure_tracing(service: Service, store_dir: str | None = None) -> trace.Tracer:
    """Return a tracer for ``service`` wired to the exporters the environment asks for."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return trace.NoOpTracer()
    store_dir = store_dir or os.environ.get(ENV_STORE)
    exporters: list[SpanExporter] = []
    otlp = _otlp_exporter()
    if otlp is not None:
        exporters.append(otlp)
    if store_dir:
        from kvobs.emit.otlp_json import OtlpJsonFileExporter

        exporters.append(OtlpJsonFileExporter(store_span_file(store_dir, service)))
    if not exporters:
        return trace.NoOpTracer()
    provider = TracerProvider(resource=Resource.create({"service.name": service.value}))
    max_queue = int(os.environ.get(ENV_QUEUE_SIZE, "8192"))
    for exporter in exporters:
        provider.add_span_processor(DroppingBatchProcessor(exporter, max_queue=max_queue))
    return provider.get_tracer("kvobs", schema_url=None)


def span_losses(tracer: trace.Tracer) -> dict[str, int]:
    """Spans a tracer made by ``configure_tracing`` lost so far, by reason (``queue-full``,
    ``export-failed``: ``semconv.TELEMETRY_DROP_REASONS``); zeros for any other tracer."""
    dropped = failed = 0
    multi = getattr(tracer, "span_processor", None)
    for processor in getattr(multi, "_span_processors", ()) or ():
        if isinstance(processor, DroppingBatchProcessor):
            dropped += processor.dropped
            failed += processor.export_failures
    return {"queue-full": dropped, "export-failed": failed}


def flush(tracer: trace.Tracer) -> None:
    """Export everything a tracer made by configure_tracing has queued (tests, shutdown)."""
    processor = getattr(tracer, "span_processor", None)  # SDK tracers only
    if processor is not None:
        processor.force_flush()
