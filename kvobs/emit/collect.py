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
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from kvobs.emit import native
from kvobs.emit.otlp_json import json_line, loads, request_json
from kvobs.emit.segments import LiveSegmentWriter
from kvobs.sources._rows import ReadRows

_LOG = logging.getLogger("kvobs.collect")

_orjson_loads: Callable[[bytes], Any] | None
try:
    from orjson import loads as _orjson_loads
except ImportError:  # pragma: no cover - orjson comes with the proxy extra
    _orjson_loads = None
PATH = "/v1/traces"
MAX_BODY = 64 * 2**20


class SegmentWriter(LiveSegmentWriter):
    """The receiver's live segment of the store (rotated, capped, expired)."""

    def __init__(self, store_dir: str, name: str = "collect"):
        super().__init__(store_dir, name)
        self.makedirs()


# A JSON number of 19 digits or more (after ``:``, ``[`` or ``,``, JSON whitespace and a
# sign): one that orjson reads as a float where json reads an int (past int64/uint64).
# Such a body (or one with such a run inside a string) is decoded by json, as before
# orjson was tried. Found by mapping digits to 0 and the three to ":", dropping
# whitespace and "-", then one search (~1 us a span; a regex took ~6).
_NUMBER_MAP = bytes.maketrans(b"0123456789[,", b"0000000000::")
_LONG_NUMBER = b":" + b"0" * 19


def _long_number(body: bytes) -> bool:
    return _LONG_NUMBER in body.translate(_NUMBER_MAP, b" \t\n\r-")


@dataclass
class Stored:
    """One export request as the store holds it: its line, the strings replaced in it,
    and, when decoding kept it, ``document``: the value the line reads back as, or
    ``rows``: the rows of its spans (the compiled decoder's, ``_rows.ReadRows``)."""

    line: str
    replaced: int
    document: dict | None = None
    rows: ReadRows | None = None

    def request(self) -> object:
        """What the live classifier takes: the rows of the line's spans, or what the line
        reads back as (``document``, else the line parsed again)."""
        if self.rows is not None:
            return self.rows
        return self.document if self.document is not None else loads(self.line)


def _json_request(body: bytes) -> Stored:
    document = None
    if _orjson_loads is not None and not _long_number(body):
        try:  # strict JSON (no NaN, no lone surrogate, no int past 64 bits): the same
            # values as json.loads, and those its line reads back as
            document = _orjson_loads(body)
        except ValueError:
            pass
    request = json.loads(body) if document is None else document
    if not isinstance(request, dict) or not isinstance(request.get("resourceSpans", []), list):
        raise ValueError("not an OTLP trace request")
    line, replaced = json_line(request)
    return Stored(line, replaced, document if not replaced else None)


def decode(body: bytes, is_json: bool) -> Stored:
    """The request as one store line (the span exporter's encoding: no raw line break, a
    string that is not valid Unicode replaced), how many strings were replaced, and what
    the classifier takes: for protobuf the rows of its spans (the compiled decoder's,
    where it is built and knows the request's shape) or the document the line reads back
    as, from the message; for JSON the body's own document, when parsing it again would
    give the same. Raises for a body that is no request."""
    if is_json:  # JSON may carry a lone surrogate ("\ud800"): json_line replaces it
        return _json_request(body)
    compiled = native.decode
    decoded = None if compiled is None else _native(compiled, body)
    if decoded is not None:  # protobuf strings are valid UTF-8: nothing replaced
        line, rows = decoded
        return Stored(line, 0, rows=ReadRows(rows))
    message = ExportTraceServiceRequest()
    message.ParseFromString(body)
    # Protobuf strings are valid UTF-8 (the parse checks), so nothing is replaced and
    # the line reads back as the dict it was written from (a ``DecodedRequest``: with
    # each span's attributes as the walk read them, which the classifier's rows take).
    document = request_json(message)
    line, replaced = json_line(document)
    return Stored(line, replaced, document if not replaced else None)


_native_failed = False


def _native(compiled: native.Decode, body: bytes) -> tuple[str, list[dict]] | None:
    """The compiled decoder's line and rows, or None where the Python path decides: for a
    body it does not take, and for a defect in it (logged once; every request still
    decoded, by the Python path)."""
    global _native_failed
    try:
        return compiled(body)
    except Exception:  # noqa: BLE001 - a defect of the fast path must not refuse a body
        if not _native_failed:
            _native_failed = True
            _LOG.exception("compiled OTLP decoder failed; the Python decoder takes over")
        return None


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
    writer: LiveSegmentWriter, sink: Callable[[Stored], object] | None = None
) -> web.Application:
    """``sink``: called with each stored request (the live classifier reads exactly what
    the store holds: ``Stored.request``). It must not raise."""
    replaced = _Replaced()

    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        is_json = request.content_type == "application/json"
        try:
            stored = decode(body, is_json)
        except Exception as error:  # noqa: BLE001 - any undecodable body is the sender's
            return web.Response(status=400, text=f"bad OTLP trace request: {error}"[:200])
        if stored.replaced:
            replaced.add(stored.replaced, request.remote)
        try:
            writer.append(stored.line + "\n")
        except OSError as error:  # full disk: the sender may retry (OTLP: 503)
            _LOG.warning("could not append spans: %s", error)
            return web.Response(status=503, text="store not writable")
        if sink is not None:
            sink(stored)
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
