"""A minimal OTLP/HTTP trace receiver that appends what it gets to a kvobs store.

For engines that export with OTLP (vLLM's ``--otlp-traces-endpoint``) where no
OpenTelemetry Collector runs (the CPU testbed, a laptop): it accepts
``POST /v1/traces`` in protobuf or JSON and appends each request as one OTLP-JSON line
to ``DIR/spans/``, the store's live segments, where every kvobs source reads it. In a
deployment, point the engines at your Collector and read its file exporter instead.
"""

from __future__ import annotations

import json
import logging
from typing import Callable

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from kvobs.emit.otlp_json import json_line, request_to_otlp_dict
from kvobs.emit.segments import LiveSegmentWriter

_LOG = logging.getLogger("kvobs.collect")
PATH = "/v1/traces"
MAX_BODY = 64 * 2**20


class SegmentWriter(LiveSegmentWriter):
    """The receiver's live segment of the store (rotated, capped, expired)."""

    def __init__(self, store_dir: str, name: str = "collect"):
        super().__init__(store_dir, name)
        self.makedirs()


def _json_line(body: bytes) -> tuple[str, int]:
    request = json.loads(body)
    if not isinstance(request, dict) or not isinstance(request.get("resourceSpans", []), list):
        raise ValueError("not an OTLP trace request")
    return json_line(request)


def _line(body: bytes, is_json: bool) -> tuple[str, int]:
    """The request as one store line (the span exporter's encoding: no raw line break, a
    string that is not valid Unicode replaced), and how many strings were replaced."""
    if is_json:  # JSON may carry a lone surrogate ("\ud800"): json_line replaces it
        return _json_line(body)
    message = ExportTraceServiceRequest()
    message.ParseFromString(body)
    return json_line(request_to_otlp_dict(message))


class _Replaced:
    """Strings replaced so far; the first request with one is logged at warning."""

    def __init__(self):
        self.values = 0

    def add(self, count: int, peer: str | None) -> None:
        level = logging.DEBUG if self.values else logging.WARNING
        self.values += count
        _LOG.log(
            level,
            "%d string value(s) not valid Unicode (lone surrogates) replaced "
            "by U+FFFD in spans from %s (%d so far; later ones at debug)",
            count,
            peer or "?",
            self.values,
        )


REPLACED = web.AppKey("kvobs_replaced", _Replaced)  # app[REPLACED].values: the count


def build_app(
    writer: LiveSegmentWriter, sink: Callable[[str], object] | None = None
) -> web.Application:
    """``sink``: called with each stored line (the live classifier reads exactly what
    the store holds)."""
    replaced = _Replaced()

    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        is_json = request.content_type == "application/json"
        try:
            line, bad = _line(body, is_json)
        except Exception as error:  # noqa: BLE001 - any undecodable body is the sender's
            return web.Response(status=400, text=f"bad OTLP trace request: {error}"[:200])
        if bad:
            replaced.add(bad, request.remote)
        try:
            writer.append(line + "\n")
        except OSError as error:  # full disk: the sender may retry (OTLP: 503)
            _LOG.warning("could not append spans: %s", error)
            return web.Response(status=503, text="store not writable")
        if sink is not None:
            sink(line)
        if is_json:
            return web.json_response({})
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    app = web.Application(client_max_size=MAX_BODY)
    app[REPLACED] = replaced
    app.router.add_post(PATH, traces)

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/health", health)
    return app


def run(store_dir: str, host: str, port: int) -> None:
    web.run_app(
        build_app(SegmentWriter(store_dir)), host=host, port=port, print=None, handle_signals=True
    )
