"""Tempo's and Jaeger's HTTP query APIs as sources, against a local aiohttp server that
answers recorded spans in the real APIs' shapes (Tempo: ``/api/search`` and
``/api/traces/<id>`` with ``batches``, ids in base64; Jaeger: ``/api/services``,
``/api/traces?service=`` and ``/api/traces/<id>`` with ``data``). A fake server: the real
trace stores do not run here."""

import asyncio
import threading

import pandas as pd
import pytest
from aiohttp import web
from click.testing import CliRunner

from kvobs.cli import main
from kvobs.sources import SourceError, open_source
from trace_formats import by_trace, jaeger, requests_of, sample_lines, with_base64_ids


class RecordedApi:
    """Serves recorded traces; remembers each request's path and query."""

    def __init__(self, lines_text: str):
        self.traces = by_trace(requests_of(lines_text))
        self.seen: list[tuple[str, dict]] = []
        self.fail_with: str | None = None
        app = web.Application()
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
        if self.fail_with:
            raise web.HTTPInternalServerError(text=self.fail_with)

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
