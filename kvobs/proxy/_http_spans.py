"""Standard OpenTelemetry HTTP spans beside the kvobs spans: kind SERVER for the client's
request, kind CLIENT for each leg to P or D, with the stable HTTP semantic-convention
attributes (``semconv.HTTP_*``, ``URL_*``, ``SERVER_*``...), so any tracing backend's
HTTP views (service maps, RED metrics from spans) see the proxy like any HTTP service.

Made with the proxy's own tracer (``kvobs.emit.setup.configure_tracing`` or the one a test
or embedder injects) rather than opentelemetry-instrumentation-aiohttp-*: those use the
global tracer provider and inject their own ``traceparent`` into the legs (the engines
must get the turn's, the one inside ``kv_transfer_params``). The SERVER span continues
the client's trace (``client_context``), as those would. Nothing here reads a header
value but ``User-Agent`` and ``Host``, and no body: never prompt or completion text.

Shape of a turn's trace::

    (the client's span, from its traceparent; none: the SERVER span is the root)
    └── POST /v1/chat/completions  SERVER (the client's request, from arrival to answer)
        ├── kvobs.proxy.turn               (the engines' spans under it: its traceparent)
        │   ├── kvobs.proxy.lookup
        │   └── kvobs.proxy.store
        ├── POST                   CLIENT (kvobs.proxy.leg = prefill; again on a fallback)
        └── POST                   CLIENT (kvobs.proxy.leg = decode, to the stream's end)

Several turns may share the client's trace: kvobs tells them apart by their keys
(conversation, turn), which every kvobs span carries, and a vLLM span by its parent, the
turn span (``kvobs.turns.correlate``). A request refused before its turn (bad input)
gets its SERVER span alone.
Telemetry never breaks serving: every function here swallows its own failures.
"""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvobs import semconv as sc

_LOG = logging.getLogger("kvobs.proxy")


def _host_port(host: str | None) -> tuple[str | None, int | None]:
    """``Host`` header to (address, port).

    >>> _host_port("proxy:8000"), _host_port("[::1]:80"), _host_port("proxy")
    (('proxy', 8000), ('::1', 80), ('proxy', None))
    """
    if not host:
        return None, None
    name, sep, port = host.rpartition(":")
    if sep and port.isdigit():
        return name.strip("[]"), int(port)
    return host.strip("[]"), None


def client_context(headers) -> Context:
    """The client's own trace context (``OTEL_PROPAGATORS``' formats: W3C ``traceparent``
    by default), the SERVER span's parent; an empty context (a new trace) without one."""
    try:
        return propagate.extract(headers, context=Context())
    except Exception:  # noqa: BLE001 - a malformed header: a new trace
        return Context()


def genai_attributes(route: str, request_id: str | None = None) -> dict[str, str]:
    """OpenTelemetry's GenAI attributes of a request to ``route`` (none for another
    route); ``request_id``: the X-Request-Id the proxy sends, which vLLM prefixes.

    >>> genai_attributes("/v1/completions", "ab12")[sc.VLLM_REQUEST_ID.key]
    'cmpl-ab12'
    >>> genai_attributes("/v1/chat/completions")
    {'gen_ai.operation.name': 'chat', 'gen_ai.provider.name': 'vllm'}
    """
    operation = sc.GENAI_OPERATION_OF_ROUTE.get(route)
    if operation is None:
        return {}
    attributes = {
        sc.GENAI_OPERATION.key: operation.value,
        sc.GENAI_PROVIDER.key: sc.GENAI_PROVIDER_VLLM,
    }
    if request_id:
        attributes[sc.VLLM_REQUEST_ID.key] = sc.VLLM_REQUEST_ID_PREFIX[route] + request_id
    return attributes


def _route_of(url: str) -> str:
    """The proxied route an engine URL ends with ('' for none)."""
    return next((route for route in sc.GENAI_OPERATION_OF_ROUTE if url.endswith(route)), "")


def start_server(
    tracer: trace.Tracer,
    request: Any,
    route: str,
    start_ns: int,
    context: Context,
) -> trace.Span:
    """The SERVER span of ``request`` (an aiohttp request), started at ``start_ns``."""
    try:
        span = tracer.start_span(
            f"{request.method} {route}",
            context=context,
            kind=SpanKind.SERVER,
            start_time=start_ns,
        )
        if span.is_recording():
            address, port = _host_port(request.host)
            version = request.version
            attributes = {
                sc.HTTP_REQUEST_METHOD: request.method,
                sc.HTTP_ROUTE: route,
                sc.URL_PATH: request.path,
                sc.URL_SCHEME: request.scheme,
                sc.NETWORK_PROTOCOL_VERSION: f"{version.major}.{version.minor}",
                **genai_attributes(route),
            }
            if address:
                attributes[sc.SERVER_ADDRESS] = address
            if port is not None:
                attributes[sc.SERVER_PORT] = port
            if request.remote:
                attributes[sc.CLIENT_ADDRESS] = request.remote
            agent = request.headers.get("User-Agent")
            if agent:
                attributes[sc.USER_AGENT] = agent[:256]
            span.set_attributes(attributes)
        return span
    except Exception:  # noqa: BLE001 - telemetry never breaks serving
        _LOG.debug("server span failed", exc_info=True)
        return trace.INVALID_SPAN


def server_error(status: int | None, error: str | None) -> tuple[str, str] | None:
    """The SERVER span's (``error.type``, status description), None when it did not fail:
    a 5xx (its code as the type, semconv), no answer (the client left), or ``error`` (a
    stream cut short after its 200). A 4xx is the client's error, not the server span's.

    >>> server_error(502, "prefill-unreachable")
    ('502', 'answered HTTP 502: prefill-unreachable')
    >>> server_error(None, None)
    ('CancelledError', 'no answer: the client disconnected')
    >>> server_error(200, "decode-disconnected")
    ('decode-disconnected', 'answered HTTP 200: decode-disconnected')
    >>> server_error(400, None), server_error(200, None)
    (None, None)
    """
    if status is not None and 400 <= status < 500:
        return None
    if status is None:
        cause = error if error is not None else "the client disconnected"
        return error or "CancelledError", f"no answer: {cause}"
    if status >= 500:
        return str(status), f"answered HTTP {status}" + (f": {error}" if error else "")
    if error is not None:
        return error, f"answered HTTP {status}: {error}"
    return None


def end_server(span: trace.Span, status: int | None, error: str | None = None) -> None:
    """``status``: the answer's HTTP status (None: no answer, the client left);
    ``error``: why the turn failed when the status does not say (a stream cut short)."""
    try:
        if span.is_recording():
            if status is not None:
                span.set_attribute(sc.HTTP_STATUS, status)
            failed = server_error(status, error)
            if failed is not None:
                span.set_attribute(sc.ERROR_TYPE, failed[0])
                span.set_status(Status(StatusCode.ERROR, failed[1]))
        span.end()
    except Exception:  # noqa: BLE001
        _LOG.debug("server span failed", exc_info=True)


def leg_error(leg: str, status: int | None, error: str | None) -> tuple[str, str] | None:
    """A CLIENT span's (``error.type``, status description), None when it did not fail.

    >>> leg_error("decode", 503, None), leg_error("prefill", None, "unreachable")
    (('503', 'decode engine answered HTTP 503'), ('unreachable', 'prefill engine unreachable'))
    >>> leg_error("decode", 200, "disconnected"), leg_error("decode", 200, None)
    (('disconnected', 'decode engine disconnected after HTTP 200'), None)
    """
    if status is not None and status >= 400 and error is None:
        return str(status), f"{leg} engine answered HTTP {status}"
    if error is None:
        return None
    return error, f"{leg} engine {error}" + (f" after HTTP {status}" if status else "")


class ClientLeg:
    """The CLIENT span of one request to an engine; ``end`` once (later calls do nothing)."""

    __slots__ = ("span", "leg")

    def __init__(
        self,
        tracer: trace.Tracer,
        context: Context | None,
        leg: str,
        host: str,
        port: int,
        url: str,
        request_id: str | None = None,
    ):
        self.leg = leg
        try:
            span = tracer.start_span("POST", context=context, kind=SpanKind.CLIENT)
            if span.is_recording():
                span.set_attributes(
                    {
                        sc.HTTP_REQUEST_METHOD: "POST",
                        sc.SERVER_ADDRESS: host,
                        sc.SERVER_PORT: port,
                        sc.URL_FULL: url,
                        sc.NETWORK_PROTOCOL_VERSION: "1.1",
                        sc.PROXY_LEG: leg,
                        **genai_attributes(_route_of(url), request_id),
                    }
                )
            self.span: trace.Span | None = span
        except Exception:  # noqa: BLE001
            _LOG.debug("client span failed", exc_info=True)
            self.span = None

    def retried(self, cause: str) -> None:
        """The first attempt's connection failed (``cause``); the leg is sent again."""
        try:
            if self.span is not None and self.span.is_recording():
                self.span.set_attribute(sc.PROXY_LEG_RETRY, cause)
        except Exception:  # noqa: BLE001
            _LOG.debug("client span failed", exc_info=True)

    def end(self, status: int | None = None, error: str | None = None) -> None:
        """``status``: the engine's HTTP status, when it answered; ``error``: why the leg
        failed (``timeout``, ``unreachable``, ``disconnected``, ``cancelled``...)."""
        span, self.span = self.span, None
        if span is None:
            return
        try:
            if span.is_recording():
                if status is not None:
                    span.set_attribute(sc.HTTP_STATUS, status)
                failed = leg_error(self.leg, status, error)
                if failed is not None:
                    span.set_attribute(sc.ERROR_TYPE, failed[0])
                    span.set_status(Status(StatusCode.ERROR, failed[1]))
            span.end()
        except Exception:  # noqa: BLE001
            _LOG.debug("client span failed", exc_info=True)
