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

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)

from kvobs.emit.otlp_json import request_to_otlp_json
from kvobs.emit.segments import LiveSegmentWriter

_LOG = logging.getLogger("kvobs.collect")
PATH = "/v1/traces"
MAX_BODY = 64 * 2**20


class SegmentWriter(LiveSegmentWriter):
    """The receiver's live segment of the store (rotated, capped, expired)."""

    def __init__(self, store_dir: str, name: str = "collect"):
        super().__init__(store_dir, name)
        self.makedirs()


def _json_line(body: bytes) -> str:
    request = json.loads(body)
    if not isinstance(request, dict) or not isinstance(request.get("resourceSpans", []), list):
        raise ValueError("not an OTLP trace request")
    return json.dumps(request, separators=(",", ":"))


def build_app(writer: LiveSegmentWriter) -> web.Application:
    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        is_json = request.content_type == "application/json"
        try:
            if is_json:
                line = _json_line(body)
            else:
                message = ExportTraceServiceRequest()
                message.ParseFromString(body)
                line = request_to_otlp_json(message)
        except Exception as error:  # noqa: BLE001 - any undecodable body is the sender's
            return web.Response(status=400, text=f"bad OTLP trace request: {error}"[:200])
        try:
            writer.append(line + "\n")
        except OSError as error:  # full disk: the sender may retry (OTLP: 503)
            _LOG.warning("could not append spans: %s", error)
            return web.Response(status=503, text="store not writable")
        if is_json:
            return web.json_response({})
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post(PATH, traces)
    app.router.add_get("/health", lambda _request: web.Response(text="ok"))
    return app


def run(store_dir: str, host: str, port: int) -> None:
    web.run_app(build_app(SegmentWriter(store_dir)), host=host, port=port,
                print=None, handle_signals=True)
