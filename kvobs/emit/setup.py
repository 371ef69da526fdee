"""The one place where the OTel SDK is chosen (deployer's side, environment first).

Configured the OpenTelemetry way, through the SDK's own machinery:

- ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``: the resource, as the SDK builds it
  (``Resource.create``). A process's role (proxy, prefill, decode) is the resource
  attribute ``kvobs.role``, never the service name; without a service name from the
  environment each role gets its default (``semconv.Service``: ``kvobs-proxy``...).
- ``OTEL_TRACES_EXPORTER``: exporters by name from the SDK's entry points (``otlp``,
  ``otlp_proto_http``, ``otlp_proto_grpc``, ``console``, ``none``...), each configured by
  its own ``OTEL_EXPORTER_*`` variables. Unset, kvobs exports over OTLP only when an
  endpoint is set (``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``; ``http/protobuf``, port
  4318, unless ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` says ``grpc``), so that a bare
  install sends nothing to a collector that is not there. ``otlp`` without a protocol
  variable is gRPC by the SDK's rule, except towards an OTLP/HTTP endpoint (port 4318 or a
  ``/v1/traces`` path), where it is http/protobuf; gRPC asked for there is an error,
  logged at start-up (spans then go to the kvobs store only).
- ``OTEL_BSP_MAX_QUEUE_SIZE``, ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``,
  ``OTEL_BSP_SCHEDULE_DELAY``, ``OTEL_BSP_EXPORT_TIMEOUT``: the batch processor's
  settings, read by the SDK's ``BatchSpanProcessor`` readers (kvobs' own defaults where
  unset: queue 8192, batches of 64, every 500 ms; ``KVOBS_SPAN_QUEUE_SIZE`` is the old
  name of the queue size). kvobs keeps its own processor (``DroppingBatchProcessor``):
  it counts what it drops (``span_losses``) and hands the GIL back between batches.
- ``OTEL_PROPAGATORS``: the API's global propagator (``opentelemetry.propagate``), used
  for the proxy's HTTP headers in and out.
- ``KVOBS_STORE``: spans also go to the embedded store, a directory ``kvobs`` reads with
  ``--source DIR`` (no infrastructure needed); its live segments are rotated, capped
  and expired (``kvobs.emit.segments``, ``KVOBS_STORE_*``).
- ``OTEL_SDK_DISABLED=true`` or no exporter at all: a no-op tracer; emitters cost a few ns.
"""

from __future__ import annotations

import logging
import os
import collections
import threading
import time
from typing import NamedTuple
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.environment_variables import OTEL_TRACES_EXPORTER
from opentelemetry.sdk.environment_variables import (
    OTEL_BSP_EXPORT_TIMEOUT,
    OTEL_BSP_MAX_EXPORT_BATCH_SIZE,
    OTEL_BSP_MAX_QUEUE_SIZE,
    OTEL_BSP_SCHEDULE_DELAY,
    OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_EXPORTER_OTLP_PROTOCOL,
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
    OTEL_SDK_DISABLED,
)
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from kvobs import __version__
from kvobs.semconv import ROLE, Service

ENV_STORE = "KVOBS_STORE"
ENV_QUEUE_SIZE = "KVOBS_SPAN_QUEUE_SIZE"  # the old name of OTEL_BSP_MAX_QUEUE_SIZE
_LOG = logging.getLogger(__name__)


class BatchSettings(NamedTuple):
    max_queue: int = 8192
    batch: int = 64
    interval_s: float = 0.5
    export_timeout_s: float = 30.0


def batch_settings() -> BatchSettings:
    """The batch processor's settings: ``OTEL_BSP_*`` where set (parsed by the SDK's own
    readers: a bad value is logged and the SDK default used), else kvobs' defaults."""
    environ = os.environ
    default = BatchSettings()
    queue = default.max_queue
    if environ.get(ENV_QUEUE_SIZE):
        queue = int(environ[ENV_QUEUE_SIZE])
    if environ.get(OTEL_BSP_MAX_QUEUE_SIZE):
        queue = BatchSpanProcessor._default_max_queue_size()
    batch = (
        BatchSpanProcessor._default_max_export_batch_size()
        if environ.get(OTEL_BSP_MAX_EXPORT_BATCH_SIZE)
        else default.batch
    )
    interval_s = (
        BatchSpanProcessor._default_schedule_delay_millis() / 1000
        if environ.get(OTEL_BSP_SCHEDULE_DELAY)
        else default.interval_s
    )
    timeout_s = (
        BatchSpanProcessor._default_export_timeout_millis() / 1000
        if environ.get(OTEL_BSP_EXPORT_TIMEOUT)
        else default.export_timeout_s
    )
    return BatchSettings(max(1, queue), max(1, min(batch, queue)), interval_s, timeout_s)


class DroppingBatchProcessor(SpanProcessor):
    """Bounded queue + one export thread; a full queue drops and counts, never blocks.

    The queue is a deque (append and popleft are atomic): ``queue.Queue``'s lock and
    condition cost the emitting thread more than the rest of ``on_end``. The bound is
    checked before the append, so concurrent emitters may overshoot it by a few spans."""

    def __init__(
        self,
        exporter: SpanExporter,
        max_queue: int = BatchSettings.max_queue,
        batch: int = BatchSettings.batch,
        interval_s: float = BatchSettings.interval_s,
        export_timeout_s: float = BatchSettings.export_timeout_s,
    ):
        self._exporter = exporter
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._max_queue = max_queue
        self._batch = batch
        self._interval_s = interval_s
        self._export_timeout_s = export_timeout_s
        self._stop = threading.Event()
        self._flushed = threading.Condition()
        self.dropped = 0
        self.export_failures = 0
        self._thread = threading.Thread(target=self._run, name="kvobs-span-export", daemon=True)
        self._thread.start()

    @property
    def exporter(self) -> SpanExporter:
        return self._exporter

    def on_start(self, span, parent_context=None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        if len(self._queue) >= self._max_queue:
            self.dropped += 1
        else:
            self._queue.append(span)

    def _drain(self) -> None:
        while True:
            batch: list[ReadableSpan] = []
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
        self._thread.join(timeout=self._export_timeout_s)
        self._exporter.shutdown()


def _http_only_endpoint() -> bool:
    """The OTLP traces endpoint can only be OTLP/HTTP's: port 4318 or a ``/v1/traces``
    path (a gRPC exporter sent there fails every export)."""
    endpoint = (
        os.environ.get(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)
        or os.environ.get(OTEL_EXPORTER_OTLP_ENDPOINT)
        or ""
    ).strip()
    if not endpoint:
        return False
    url = urlsplit(endpoint if "//" in endpoint else "//" + endpoint)
    try:
        port = url.port
    except ValueError:
        port = None
    return port == 4318 or url.path.rstrip("/").endswith("/v1/traces")


def exporter_names() -> list[str]:
    """Entry-point names of the span exporters the environment asks for. ``otlp`` with
    no protocol set is gRPC by the SDK's rule; kvobs makes it http/protobuf when the
    endpoint is HTTP's (``_http_only_endpoint``), and refuses an explicit gRPC there."""
    from opentelemetry.sdk._configuration import _get_exporter_entry_point

    environ = os.environ
    protocol = environ.get(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL) or environ.get(
        OTEL_EXPORTER_OTLP_PROTOCOL
    )
    names = environ.get(OTEL_TRACES_EXPORTER, "").strip()
    if names:
        if names.lower() == "none":
            return []
        http = not protocol and _http_only_endpoint()
        chosen = [
            _get_exporter_entry_point(
                "otlp_proto_http" if http and name.strip() == "otlp" else name.strip(), "traces"
            )
            for name in names.split(",")
        ]
    elif not (
        environ.get(OTEL_EXPORTER_OTLP_ENDPOINT) or environ.get(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)
    ):
        return []
    else:
        # "otlp" follows the protocol variables (the SDK's rule); without one, http/protobuf
        chosen = [_get_exporter_entry_point("otlp" if protocol else "otlp_proto_http", "traces")]
    if "otlp_proto_grpc" in chosen and _http_only_endpoint():
        raise ValueError(
            "OTLP over gRPC to an OTLP/HTTP endpoint (port 4318 or a /v1/traces path) "
            "fails every export: set OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf, "
            "or a gRPC endpoint (port 4317)"
        )
    return chosen


def _exporters() -> list[SpanExporter]:
    """The environment's exporters, built by the SDK's entry points; one that cannot be
    found or built is logged and left out: telemetry never stops the host."""
    from opentelemetry.sdk._configuration import _import_exporters

    exporters: list[SpanExporter] = []
    names: list[str] = []
    try:
        names = exporter_names()
        classes = _import_exporters(names, [], [])[0] if names else {}
    except Exception as error:  # noqa: BLE001
        _LOG.error(
            "span exporters from %s not usable, spans go to the kvobs store only: %s%s",
            OTEL_TRACES_EXPORTER,
            error,
            _grpc_hint(names),
        )
        return exporters
    for name, exporter_class in classes.items():
        try:
            exporters.append(exporter_class())
        except Exception as error:  # noqa: BLE001
            _LOG.error("span exporter %s not usable: %s", name, error)
    return exporters


GRPC_EXTRA = "pip install 'kvobs[grpc]'"


def _grpc_hint(names: list[str]) -> str:
    """Why a gRPC exporter the environment asks for is missing, and what to install: the
    base install carries OTLP over HTTP only; the gRPC exporter (and grpcio) is the
    ``grpc`` extra, imported only when asked for."""
    if not any("grpc" in name for name in names):
        return ""
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
    except ImportError:
        return (
            f" (OTLP over gRPC is the grpc extra: {GRPC_EXTRA}; or export "
            "http/protobuf to port 4318, which the base install carries)"
        )
    return ""


def resource(service: Service) -> Resource:
    """The SDK's resource from the environment, with the role as ``kvobs.role`` and the
    role's default service name where the environment names none."""
    attributes = {ROLE.key: service.role}
    if SERVICE_NAME not in OTELResourceDetector().detect().attributes:
        attributes[SERVICE_NAME] = service.value
    return Resource.create(attributes)


def configure_tracing(service: Service, store_dir: str | None = None) -> trace.Tracer:
    """Return a tracer for ``service`` wired to the exporters the environment asks for."""
    if os.environ.get(OTEL_SDK_DISABLED, "").strip().lower() == "true":
        return trace.NoOpTracer()
    store_dir = store_dir or os.environ.get(ENV_STORE)
    exporters = _exporters()
    if store_dir:
        from kvobs.emit.otlp_json import OtlpJsonFileExporter
        from kvobs.emit.segments import LiveSegmentWriter

        exporters.append(OtlpJsonFileExporter(LiveSegmentWriter(store_dir, service.value)))
    if not exporters:
        return trace.NoOpTracer()
    provider = TracerProvider(resource=resource(service))
    settings = batch_settings()
    for exporter in exporters:
        provider.add_span_processor(DroppingBatchProcessor(exporter, *settings))
    return provider.get_tracer("kvobs", __version__, schema_url=None)


def span_losses(tracer: trace.Tracer) -> dict[str, int]:
    """Spans a tracer made by ``configure_tracing`` lost so far, by reason (``queue-full``,
    ``export-failed``, ``encoding``: ``semconv.TELEMETRY_DROP_REASONS``); zeros for any
    other tracer. ``encoding`` is the span store exporter's: spans written with a value
    replaced, or left out of their batch (``OtlpJsonFileExporter``)."""
    dropped = failed = encoding = 0
    multi = getattr(tracer, "span_processor", None)
    for processor in getattr(multi, "_span_processors", ()) or ():
        if isinstance(processor, DroppingBatchProcessor):
            dropped += processor.dropped
            failed += processor.export_failures
            encoding += getattr(processor.exporter, "encoding_losses", 0)
    return {"queue-full": dropped, "export-failed": failed, "encoding": encoding}


def flush(tracer: trace.Tracer) -> None:
    """Export everything a tracer made by configure_tracing has queued (tests, shutdown)."""
    processor = getattr(tracer, "span_processor", None)  # SDK tracers only
    if processor is not None:
        processor.force_flush()
