"""An engine's HTTP front door, timed: an ASGI middleware for vLLM's API server.

    vllm serve MODEL ... --middleware kvobs.emit.engine_http.EngineHttpTiming

One span (``semconv.ENGINE_HTTP_SPAN``) per completion request: from its headers arriving
to the last byte of its answer sent. The engines' own marks start at vLLM's arrival time
(after the HTTP server and tokenization) and end at the last token (before the API server
turns it into the answer), so behind a router that is not kvobs's these are the only
marks of P's front door and of D's answer leaving; what remains unseen is the router's.

The span carries vLLM's request id (``gen_ai.request.id``), which the connector's spans
carry as their prefix (vLLM's internal id is it plus a random suffix), so correlation
joins the two (``kvobs.turns.correlate.engine_http_roles``). To know that id before vLLM
parses the body, a request without an ``X-Request-Id`` header is given one (vLLM takes
its id from that header); a ``request_id`` sent in the body is then not vLLM's id: send
it as the header instead. Ids, route, status and the turn's shard only: never a header
value or a body. The shard (``semconv.SHARD``, so that the Collector routes the span to
the classifier of its turn: docs/live.md) is found by a byte scan of the bodies for the
key the connector puts in P's ``kv_transfer_params``: in P's answer, and in D's request
when the router passes P's params on.

Telemetry never breaks serving: any failure of the timing is swallowed (and counted by
the span processor when spans are dropped); the request goes on untouched.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any, Awaitable, Callable

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvobs import semconv as sc

__all__ = ["EngineHttpTiming", "request_id_header"]

_LOG = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()
_REQUEST_ID = b"x-request-id"
_TRACEPARENT = b"traceparent"
# Header values kvobs keeps: a W3C traceparent is 55 characters, an id of ours 32.
_MAX_ID = 256
# The turn's shard (semconv.SHARD), which the connector puts in P's kv_transfer_params as
# semconv.KTP_SHARD: in P's answer, and in D's request where the router passes P's params
# on. Found by a byte scan, never by parsing a body; tenant digest and hex only.
_SHARD_KEY = b'"' + sc.KTP_SHARD.encode() + b'"'
_SHARD = re.compile(re.escape(_SHARD_KEY) + rb'\s*:\s*"([0-9A-Za-z/]{1,80})"')
# Kept of a chunk for the next, so that a key split between two chunks is still found.
_OVERLAP = 128
# How much of a request body's head and tail is looked through (see ``scan_request``).
_WINDOW = 16384

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


def request_id_header(headers: list[tuple[bytes, bytes]]) -> tuple[str, list | None]:
    """The request's ``X-Request-Id`` and, when it has none (or one kvobs cannot use),
    the headers with a fresh one added. Pure but for the fresh id."""
    for name, value in headers:
        if name.lower() == _REQUEST_ID:
            try:
                text = value.decode("ascii")
            except UnicodeDecodeError:
                break
            if 0 < len(text) <= _MAX_ID and text.isprintable():
                return text, None
            break
    fresh = uuid.uuid4().hex
    kept = [(n, v) for n, v in headers if n.lower() != _REQUEST_ID]
    return fresh, [*kept, (_REQUEST_ID, fresh.encode())]


def _parent(headers: list[tuple[bytes, bytes]]):
    for name, value in headers:
        if name.lower() == _TRACEPARENT and len(value) <= _MAX_ID:
            return _PROPAGATOR.extract({"traceparent": value.decode("latin-1")})
    return None


class EngineHttpTiming:
    """ASGI middleware: times the completion routes (``semconv.GENAI_OPERATION_OF_ROUTE``),
    passes everything else through."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]):
        self.app = app
        self._tracer: trace.Tracer | None = None

    def tracer(self) -> trace.Tracer:
        # Built on the first request, in the API server process that serves it.
        if self._tracer is None:
            from kvobs.emit.setup import configure_tracing

            self._tracer = configure_tracing(sc.Service.ENGINE)
        return self._tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = scope.get("path") if scope.get("type") == "http" else None
        prefix = sc.VLLM_REQUEST_ID_PREFIX.get(route) if isinstance(route, str) else None
        if prefix is None or not isinstance(route, str):
            await self.app(scope, receive, send)
            return
        started_ns = time.time_ns()
        try:
            request_id, headers = request_id_header(list(scope.get("headers") or ()))
            if headers is not None:
                scope = {**scope, "headers": headers}
            timing = _Timing(started_ns, prefix + request_id, route, _parent(scope["headers"]))
        except Exception:  # noqa: BLE001 - telemetry never breaks serving
            _LOG.debug("kvobs: request not timed", exc_info=True)
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, timing.wrap_receive(receive), timing.wrap(send))
        except BaseException:
            timing.failed = True
            raise
        finally:
            timing.finish(self)


class _Timing:
    """One request's timing: its status and when its answer's last byte went out."""

    __slots__ = (
        "started_ns", "vllm_id", "route", "parent", "status", "sent_ns", "failed", "shard",
        "_tail", "_read",
    )  # fmt: skip

    def __init__(self, started_ns: int, vllm_id: str, route: str, parent):
        self.started_ns = started_ns
        self.vllm_id = vllm_id
        self.route = route
        self.parent = parent
        self.status: int | None = None
        self.sent_ns: int | None = None
        self.failed = False
        self.shard: str | None = None
        self._tail = b""
        self._read = 0

    def scan(self, body: bytes) -> None:
        """Look for the turn's shard in an answer's chunk (and across its seam with the
        one before)."""
        if self.shard is None and body:
            self._look(self._tail + body)
            self._tail = body[-_OVERLAP:]

    def scan_request(self, body: bytes, last: bool) -> None:
        """Look for the turn's shard at the head and the tail of a request's body only:
        a prompt can be megabytes (``bytes.find`` costs ~0.4 us a KiB on the testbed's
        CPU), and the params are not inside it (vllm-router writes its keys sorted, so
        ``kv_transfer_params`` precedes ``messages`` and ``prompt``; a client or proxy
        that adds them, after)."""
        if self.shard is not None or not body:
            return
        if self._read < _WINDOW:
            self._look(self._tail + body[: _WINDOW - self._read])
        if last and self.shard is None and self._read + len(body) > _WINDOW:
            self._look(self._tail + body[-_WINDOW:])
        self._read += len(body)
        self._tail = body[-_OVERLAP:]

    def _look(self, text: bytes) -> None:
        at = text.find(_SHARD_KEY)
        found = _SHARD.match(text, at) if at >= 0 else None
        if found:
            self.shard = found.group(1).decode("ascii")

    def wrap_receive(self, receive: Receive) -> Receive:
        async def scanned() -> dict:
            message = await receive()
            try:
                if message.get("type") == "http.request":
                    self.scan_request(
                        message.get("body") or b"", not message.get("more_body", False)
                    )
            except Exception:  # noqa: BLE001 - telemetry never breaks serving
                pass
            return message

        return scanned

    def wrap(self, send: Send) -> Send:
        async def timed(message: dict) -> None:
            kind = message.get("type")
            if kind == "http.response.start":
                self.status = message.get("status")
            elif kind == "http.response.body" and message.get("body"):
                # The answer's last byte is its last non-empty chunk's (a stream ends
                # with an empty one once the generator is done: the client has read
                # "[DONE]" by then). Taken before the await: the server writes without
                # blocking, and the coroutine may resume milliseconds later on a busy
                # event loop (seen on the testbed: D's request arrived up to 3 ms before
                # a mark taken after it).
                self.sent_ns = time.time_ns()
                try:
                    self.scan(message["body"])
                except Exception:  # noqa: BLE001 - telemetry never breaks serving
                    pass
            await send(message)

        return timed

    def finish(self, middleware: EngineHttpTiming) -> None:
        try:
            end_ns = self.sent_ns or time.time_ns()
            attributes: dict[str, Any] = {
                sc.VLLM_REQUEST_ID.key: self.vllm_id,
                sc.HTTP_ROUTE: self.route,
            }
            if self.status is not None:
                attributes[sc.HTTP_STATUS] = self.status
            if self.shard is not None:
                attributes[sc.SHARD.key] = self.shard
            span = middleware.tracer().start_span(
                sc.ENGINE_HTTP_SPAN,
                context=self.parent,
                kind=SpanKind.SERVER,
                attributes=attributes,
                start_time=self.started_ns,
            )
            if self.failed or (self.status or 0) >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end(end_time=end_ns)
        except Exception:  # noqa: BLE001 - telemetry never breaks serving
            _LOG.debug("kvobs: engine HTTP span not emitted", exc_info=True)
