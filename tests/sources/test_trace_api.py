"""Tempo's and Jaeger's HTTP query APIs as sources, against a local aiohttp server that
answers recorded spans in the real APIs' shapes (Tempo: ``/api/search`` and
``/api/traces/<id>`` with ``batches``, ids in base64; Jaeger: ``/api/services``,
``/api/traces?service=`` and ``/api/traces/<id>`` with ``data``; Jaeger v2's ``/api/v3``
stream of ``{"result": ...}`` lines). A fake server: the real trace stores do not run
here. The total timeout is checked against a raw socket server that trickles its answer."""

import asyncio
import base64
import json
import socket
import threading

import pandas as pd
import pytest
from aiohttp import web
from click.testing import CliRunner

from kvobs.cli import main
from kvobs.sources import SourceError, open_source
from trace_formats import by_trace, jaeger, requests_of, sample_lines, with_base64_ids


_UNSET = object()


class RecordedApi:
    """Serves recorded traces; remembers each request's path and query."""

    def __init__(self, lines_text: str):
        self.traces = by_trace(requests_of(lines_text))
        self.seen: list[tuple[str, dict]] = []
        self.headers: list[dict] = []
        self.fail_with: str | None = None
        self.require_auth: str | None = None  # the Authorization header, else 401
        self.answer: object = _UNSET  # answered as JSON by every endpoint when set
        app = web.Application(middlewares=[self._canned])
        app.router.add_get("/api/search", self.tempo_search)
        app.router.add_get("/api/services", self.jaeger_services)
        app.router.add_get("/api/traces", self.jaeger_search)
        app.router.add_get("/api/traces/{trace_id}", self.trace)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def _note(self, request):
        self.seen.append((request.path, dict(request.query)))
        self.headers.append(request.headers.copy())  # names case-insensitive, as on the wire
        if self.require_auth and request.headers.get("Authorization") != self.require_auth:
            raise web.HTTPUnauthorized(text="no org id or credentials")
        if self.fail_with:
            raise web.HTTPInternalServerError(text=self.fail_with)

    @web.middleware
    async def _canned(self, request, handler):
        if self.answer is _UNSET:
            return await handler(request)
        self._note(request)
        return web.json_response(self.answer)

    async def tempo_search(self, request):
        self._note(request)
        return web.json_response({"traces": [
            {"traceID": trace_id, "rootServiceName": "kvobs-proxy",
             "startTimeUnixNano": "1700000000000000000", "durationMs": 300}
            for trace_id in self.traces], "metrics": {"inspectedTraces": len(self.traces)}})

    async def jaeger_services(self, request):
        self._note(request)
        services = sorted({rs["resource"]["attributes"][i]["value"]["stringValue"]
                           for t in self.traces.values() for rs in t["resourceSpans"]
                           for i, a in enumerate(rs["resource"]["attributes"])
                           if a["key"] == "service.name"})
        return web.json_response({"data": services, "total": len(services)})

    async def jaeger_search(self, request):
        self._note(request)
        service = request.query["service"]
        answer = jaeger(list(self.traces.values()))
        answer["data"] = [t for t in answer["data"]
                          if any(p["serviceName"] == service for p in t["processes"].values())]
        return web.json_response(answer)

    async def trace(self, request):
        self._note(request)
        trace = self.traces.get(request.match_info["trace_id"])
        if trace is None:
            if self.kind == "jaeger":
                return web.json_response({"data": None, "errors": [
                    {"code": 404, "msg": "trace not found"}]}, status=404)
            raise web.HTTPNotFound(text="trace not found")
        if self.kind == "jaeger":
            return web.json_response(jaeger([trace]))
        if self.kind == "jaeger-v3":  # grpc-gateway's stream: one result per line
            chunks = [{"result": {"resourceSpans": [rs]}} for rs in trace["resourceSpans"]]
            return web.Response(text="\n".join(json.dumps(c) for c in chunks) + "\n",
                                content_type="application/json")
        return web.json_response({"batches": with_base64_ids(trace)["resourceSpans"]})

    kind = "tempo"  # which API the traces are answered in


@pytest.fixture(scope="module")
def lines_text(tmp_path_factory):
    return sample_lines(tmp_path_factory.mktemp("store"))


@pytest.fixture
def api(lines_text):
    server = RecordedApi(lines_text)
    yield server
    server.close()


def _expected(tmp_path, lines_text):
    path = tmp_path / "spans.jsonl"
    path.write_text(lines_text)
    return open_source(str(path)).spans()


def _same(spans, expected, microseconds=False):
    key = ["trace_id", "span_id"]
    spans = spans.sort_values(key).reset_index(drop=True)
    expected = expected.sort_values(key).reset_index(drop=True)
    if microseconds:
        for column in ("start_ns", "end_ns"):
            expected[column] = expected[column] // 1000 * 1000
    pd.testing.assert_frame_equal(spans, expected)


def test_tempo_search_then_each_trace(api, tmp_path, lines_text):
    source = open_source(f"tempo+http://127.0.0.1:{api.port}?since=2h&q="
                         "%7B%20span.gen_ai.conversation.id%20%21%3D%20nil%20%7D")
    _same(source.spans(), _expected(tmp_path, lines_text))
    assert source.problems == []
    assert source.conversation_ids() == ["conv-a", "conv-b"]
    search = [q for path, q in api.seen if path == "/api/search"]
    assert search and search[0]["q"] == "{ span.gen_ai.conversation.id != nil }"
    assert int(search[0]["end"]) - int(search[0]["start"]) in (7200, 7201)
    fetched = {path.rsplit("/", 1)[1] for path, _ in api.seen if path.startswith("/api/traces/")}
    assert fetched == set(api.traces)


def test_tempo_trace_ids_and_a_missing_one(api, tmp_path, lines_text):
    wanted = sorted(api.traces)[:2]
    url = f"tempo+http://127.0.0.1:{api.port}?" + "&".join(
        f"trace={t}" for t in [*wanted, "0" * 32])
    source = open_source(url)
    spans = source.spans()
    assert set(spans["trace_id"]) == set(wanted)
    assert source.problems == [f"tempo+http://127.0.0.1:{api.port} trace {'0' * 32}: "
                               "not found"]
    assert not any(path == "/api/search" for path, _ in api.seen)


def test_jaeger_every_service_each_trace_once(api, tmp_path, lines_text):
    api.kind = "jaeger"
    source = open_source(f"jaeger+http://127.0.0.1:{api.port}?since=30m&limit=50")
    _same(source.spans(), _expected(tmp_path, lines_text), microseconds=True)
    assert source.problems == []  # a trace of three services came three times: read once
    searches = [q for path, q in api.seen if path == "/api/traces"]
    assert len(searches) == 3 and {q["limit"] for q in searches} == {"50"}
    assert all(int(q["end"]) - int(q["start"]) in range(1800 * 10**6, 1801 * 10**6)
               for q in searches)


def test_jaeger_one_trace_by_id(api, tmp_path, lines_text):
    api.kind = "jaeger"
    trace_id = sorted(api.traces)[0]
    source = open_source(f"jaeger+http://127.0.0.1:{api.port}?trace={trace_id}")
    assert set(source.spans()["trace_id"]) == {trace_id}


def test_server_error_text_is_shown_and_the_cli_exits_2(api):
    api.fail_with = "authentication failed: bad token for tenant x"
    url = f"tempo+http://127.0.0.1:{api.port}"
    with pytest.raises(SourceError, match="HTTP 500 .*authentication failed: bad token"):
        open_source(url)
    result = CliRunner().invoke(main, ["turns", "--source", url])
    assert result.exit_code == 2
    assert "authentication failed: bad token" in result.output


def test_nothing_listening_is_a_clear_error():
    with pytest.raises(SourceError, match="cannot connect"):
        open_source("jaeger+http://127.0.0.1:9?service=x")
    with pytest.raises(SourceError, match="bad time range"):
        open_source("tempo+http://127.0.0.1:9?since=soon")
    with pytest.raises(SourceError, match="timeout=0"):
        open_source("tempo+http://127.0.0.1:9?timeout=0")
    with pytest.raises(SourceError, match="^tempo\\+http://127.0.0.1:x9: Port could not"):
        open_source("tempo+http://me:secret@127.0.0.1:x9")


def test_jaeger_v3_stream_of_results(api, tmp_path, lines_text):
    """Jaeger v2's /api/v3 answers OTLP JSON in ``{"result": ...}``, one per line."""
    api.kind = "jaeger-v3"
    url = f"jaeger+http://127.0.0.1:{api.port}?" + "&".join(
        f"trace={t}" for t in sorted(api.traces))
    source = open_source(url)
    _same(source.spans(), _expected(tmp_path, lines_text))
    assert source.problems == []


def _basic(user, password):
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_tempo_tenant_and_credentials_from_the_url(api, lines_text):
    """``user:pass@`` leaves the host name (it resolved as "user:pass@127.0.0.1") and
    becomes basic auth; ``tenant=`` the X-Scope-OrgID header; neither shows in messages."""
    api.require_auth = _basic("reader", "p@ss:w")
    url = (f"tempo+http://reader:p%40ss%3Aw@127.0.0.1:{api.port}?tenant=team-a"
           "&since=30min")
    source = open_source(url)
    assert source.conversation_ids() == ["conv-a", "conv-b"]
    assert {h.get("X-Scope-OrgID") for h in api.headers} == {"team-a"}
    assert "p%40ss" not in source.location and "reader" not in source.location
    search = [q for path, q in api.seen if path == "/api/search"]
    assert int(search[0]["end"]) - int(search[0]["start"]) in (1800, 1801)


@pytest.mark.parametrize("env, header", [
    ({"KVOBS_TEMPO_TOKEN": "t0k"}, "Bearer t0k"),
    ({"KVOBS_TEMPO_USER": "u", "KVOBS_TEMPO_PASSWORD": "pw"}, _basic("u", "pw"))])
def test_tempo_tenant_and_credentials_from_the_environment(api, monkeypatch, env, header):
    for name, value in {**env, "KVOBS_TEMPO_TENANT": "team-b"}.items():
        monkeypatch.setenv(name, value)
    api.require_auth = header
    source = open_source(f"tempo+http://127.0.0.1:{api.port}")
    assert source.conversation_ids() == ["conv-a", "conv-b"]
    assert {h.get("X-Scope-OrgID") for h in api.headers} == {"team-b"}


def test_refused_credentials_exit_2_naming_where_they_come_from(api):
    api.require_auth = _basic("u", "right")
    url = f"tempo+http://u:wrong@127.0.0.1:{api.port}"
    result = CliRunner().invoke(main, ["turns", "--source", url])
    assert result.exit_code == 2
    assert "HTTP 401" in result.output and "KVOBS_TEMPO_TOKEN" in result.output
    assert "wrong" not in result.output


@pytest.mark.parametrize("since, seconds", [("30min", 1800), ("1h30m", 5400), ("90", 90),
                                             ("7d", 7 * 86400)])
def test_since_as_kvobs_report_takes_it(since, seconds):
    from kvobs.sources.trace_api import TraceApiSource

    source = TraceApiSource(f"tempo+http://127.0.0.1:9?since={since}&end=1000000")
    assert source.end - source.start == seconds


# Unexpected answers, each where the reader meets it: (kind, URL query, answer, shape named)
UNEXPECTED = [
    ("tempo", "", [], "a list of 0 item(s)"),
    ("tempo", "", "busy", "a string ('busy')"),
    ("tempo", "", 42, "int 42"),
    ("tempo", "", {"error": "bad query"}, "an object with keys error"),
    ("tempo", "", {"traces": {"a": 1}}, "an object with keys a"),
    ("tempo", "", {"traces": ["abc"]}, "a list of 1 item(s)"),
    ("tempo", "", {"traces": [{"rootServiceName": "x"}]}, "a list of 1 item(s)"),
    ("tempo", "?trace=00ff", {"status": "ok"}, "an object with keys status"),
    ("tempo", "?trace=00ff", [1, 2], "a list of 2 item(s)"),
    ("jaeger", "", {"data": "svc"}, "a string ('svc')"),
    ("jaeger", "", {"data": {"svc": 1}}, "an object with keys svc"),
    ("jaeger", "", None, "null"),
    ("jaeger", "?service=s", {"data": [1, 2]}, "a list of 2 item(s)"),
    ("jaeger", "?service=s", {"data": [{"traceID": [1]}]}, "a list of 1 item(s)"),
    ("jaeger", "?trace=00ff", {"error": {"code": 5, "message": "x"}},
     "an object with keys error"),
]


@pytest.mark.parametrize("kind, query, answer, named", UNEXPECTED)
def test_an_unexpected_answer_exits_2_naming_its_shape(api, kind, query, answer, named):
    api.answer = answer
    url = f"{kind}+http://127.0.0.1:{api.port}{query}"
    result = CliRunner().invoke(main, ["turns", "--source", url])
    assert result.exit_code == 2, result.output
    assert "answered" in result.output and named in result.output, result.output
    assert "internal error" not in result.output


class TricklingServer:
    """A raw socket server that answers one byte at a time, ``gap_s`` apart, for ever:
    the status line and headers (``where="headers"``) or a long body (``"body"``)."""

    def __init__(self, where: str, gap_s: float = 0.05):
        self.where, self.gap_s = where, gap_s
        self.sent = 0
        self.stop = threading.Event()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                connection, _ = self.listener.accept()
            except socket.timeout:
                continue
            with connection:
                connection.recv(65536)  # the request
                head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                if self.where == "body":
                    connection.sendall(head + b"Content-Length: 100000000\r\n\r\n")
                    head = b'{"traces": [' + b" " * 100_000_000
                else:
                    head = head + b"X-Slow: " + b"x" * 100_000_000
                for byte in head:
                    if self.stop.wait(self.gap_s):
                        return
                    try:
                        connection.sendall(bytes([byte]))
                    except OSError:  # the reader gave up: what the test waits for
                        break
                    self.sent += 1

    def close(self):
        self.stop.set()
        self.thread.join(10)
        self.listener.close()


@pytest.mark.timeout(120)  # a hang guard: without the total timeout it never ends
@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_trickling_server_is_cut_off_by_the_total_timeout(where):
    server = TricklingServer(where)
    try:
        url = f"tempo+http://127.0.0.1:{server.port}?timeout=1"
        with pytest.raises(SourceError, match=r"/api/search: no whole answer within 1 s"):
            open_source(url)
        assert server.sent > 0  # it did answer, slowly: each read had bytes to return
        result = CliRunner().invoke(main, ["turns", "--source", url])
        assert result.exit_code == 2 and "no whole answer within 1 s" in result.output
    finally:
        server.close()
