"""``kvobs dashboards import|export`` against a stand-in Grafana HTTP server.

There is no Grafana server here: ``StandInGrafana`` is a stand-in that records every request
and answers like Grafana's folder and dashboard APIs, so the request flow that
grafana-client produces is asserted, not Grafana's behaviour.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner

from kvobs.cli import main
from kvobs.monitoring import dashboards
from kvobs.monitoring.config import DEFAULT

SCHEMA = json.loads((Path(__file__).parent / "grafana_dashboard.schema.json").read_text())


class StandInGrafana:
    """Stand-in for Grafana's HTTP API: records requests, keeps folders in memory."""

    def __init__(self, folders=(), dashboard_status=200):
        self.requests: list[dict] = []
        self.folders = [dict(f) for f in folders]
        self.dashboard_status = dashboard_status
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                stand_in.requests.append({
                    "method": self.command, "path": self.path,
                    "authorization": self.headers.get("Authorization"),
                    "body": json.loads(raw) if raw else None})
                return stand_in.requests[-1]

            def do_GET(self):
                request = self._record()
                if request["path"].split("?")[0] == "/api/folders":
                    return self._answer(200, stand_in.folders)
                return self._answer(404, {"message": "not found"})

            def do_POST(self):
                request = self._record()
                if request["path"] == "/api/folders":
                    folder = {"id": len(stand_in.folders) + 1, "uid": "kvobs-folder-uid",
                              "title": request["body"]["title"]}
                    stand_in.folders.append(folder)
                    return self._answer(200, folder)
                if request["path"] == "/api/dashboards/db":
                    if stand_in.dashboard_status != 200:
                        return self._answer(stand_in.dashboard_status,
                                            {"message": "version-mismatch",
                                             "status": "version-mismatch"})
                    uid = request["body"]["dashboard"]["uid"]
                    return self._answer(200, {"id": 7, "uid": uid, "status": "success",
                                              "url": f"/d/{uid}/kvobs", "version": 1})
                return self._answer(404, {"message": "not found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def posts(self, path):
        return [r for r in self.requests if r["method"] == "POST" and r["path"] == path]


@pytest.fixture
def grafana():
    stand_in = StandInGrafana()
    yield stand_in
    stand_in.close()


@pytest.fixture(autouse=True)
def _needs_extras(sdk):
    pytest.importorskip("grafana_client")


def _run(*args, env=None):
    return CliRunner().invoke(main, list(args), env=env or {}, catch_exceptions=False)


def test_import_creates_the_folder_and_posts_the_dashboard(grafana):
    result = _run("dashboards", "import", "--url", grafana.url, "--token", "glsa_test",
                  "--folder", "kvobs", "--overwrite", "--datasource-uid", "prom-uid")
    assert result.exit_code == 0, result.output
    uid = DEFAULT.dashboard_uid
    assert result.output == f"imported {uid} ({DEFAULT.dashboard_title}) /d/{uid}/kvobs\n"

    flow = [(r["method"], r["path"].split("?")[0]) for r in grafana.requests]
    assert flow == [("GET", "/api/folders"), ("POST", "/api/folders"),
                    ("POST", "/api/dashboards/db")]
    assert all(r["authorization"] == "Bearer glsa_test" for r in grafana.requests)
    (folder,) = grafana.posts("/api/folders")
    assert folder["body"] == {"title": "kvobs"}

    (post,) = grafana.posts("/api/dashboards/db")
    body = post["body"]
    assert body["overwrite"] is True
    assert body["folderUid"] == "kvobs-folder-uid"
    jsonschema.validate(body["dashboard"], SCHEMA)
    (datasource,) = [v for v in body["dashboard"]["templating"]["list"]
                     if v["name"] == "datasource"]
    assert datasource["current"] == {"selected": True, "text": "prom-uid", "value": "prom-uid"}
    # Apart from the mapped data source, the body is the checked-in dashboard.
    expected = dashboards.build_overview(DEFAULT)
    for board in (body["dashboard"], expected):
        for variable in board["templating"]["list"]:
            current = variable.pop("current", None)
            if variable["name"] != "datasource":
                assert current["value"] == "$__all"  # the other variables keep "All"
    assert body["dashboard"] == expected


def test_import_reuses_an_existing_folder_and_defaults_to_no_overwrite():
    stand_in = StandInGrafana(folders=[{"id": 3, "uid": "existing", "title": "kvobs"}])
    try:
        result = _run("dashboards", "import", "--url", stand_in.url, "--folder", "kvobs")
        assert result.exit_code == 0, result.output
        assert stand_in.posts("/api/folders") == []
        (post,) = stand_in.posts("/api/dashboards/db")
        assert post["body"]["overwrite"] is False
        assert post["body"]["folderUid"] == "existing"
        (datasource,) = [v for v in post["body"]["dashboard"]["templating"]["list"]
                         if v["name"] == "datasource"]
        assert "current" not in datasource
    finally:
        stand_in.close()


def test_import_without_folder_posts_to_general(grafana):
    result = _run("dashboards", "import", "--url", grafana.url)
    assert result.exit_code == 0, result.output
    assert [r["path"] for r in grafana.requests] == ["/api/dashboards/db"]
    assert "folderUid" not in grafana.requests[0]["body"]


def test_import_reads_url_and_token_from_the_environment(grafana):
    result = _run("dashboards", "import",
                  env={"KVOBS_GRAFANA_URL": grafana.url, "KVOBS_GRAFANA_TOKEN": "t0k"})
    assert result.exit_code == 0, result.output
    assert grafana.requests[0]["authorization"] == "Bearer t0k"


def test_import_refused_by_grafana_exits_2():
    stand_in = StandInGrafana(dashboard_status=412)
    try:
        result = CliRunner().invoke(main, ["dashboards", "import", "--url", stand_in.url])
        assert result.exit_code == 2
        assert "Grafana refused the import" in result.output
    finally:
        stand_in.close()


def test_import_unreachable_grafana_exits_2():
    result = CliRunner().invoke(main, ["dashboards", "import", "--url", "http://127.0.0.1:1"])
    assert result.exit_code == 2
    assert "cannot reach Grafana" in result.output


def test_export_writes_the_checked_in_json(tmp_path, repo):
    result = _run("dashboards", "export", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    name = f"{DEFAULT.dashboard_uid}.json"
    assert result.output == f"wrote {tmp_path / 'out' / name}\n"
    written = (tmp_path / "out" / name).read_text()
    assert written == (repo / "dashboards" / name).read_text()
    jsonschema.validate(json.loads(written), SCHEMA)


def test_export_with_datasource_and_provider(tmp_path):
    out = tmp_path / "prov"
    result = _run("dashboards", "export", str(out), "--datasource-uid", "abc",
                  "--provider", "LLM serving")
    assert result.exit_code == 0, result.output
    board = json.loads((out / f"{DEFAULT.dashboard_uid}.json").read_text())
    (datasource,) = [v for v in board["templating"]["list"] if v["name"] == "datasource"]
    assert datasource["current"]["value"] == "abc"
    provider = (out / "kvobs-provider.yaml").read_text()
    import yaml

    (entry,) = yaml.safe_load(provider)["providers"]
    assert entry["options"]["path"] == str(out.resolve())
    assert entry["folder"] == "LLM serving"


def test_export_with_a_monitoring_config_and_flags(tmp_path):
    config = tmp_path / "m.yaml"
    config.write_text("decode_ttl_seconds: 300\nproxy_entry_lifetime_seconds: 280\n"
                      "runbook_base_url: https://runbooks.example.test/kvobs\n")
    out = tmp_path / "out"
    result = _run("dashboards", "export", str(out), "--config", str(config),
                  "--set", "dashboard_uid=my-kvobs")
    assert result.exit_code == 0, result.output
    board = json.loads((out / "my-kvobs.json").read_text())
    assert board["links"][0]["url"] == "https://runbooks.example.test/kvobs"


def test_export_refuses_a_bad_monitoring_config(tmp_path):
    result = _run("dashboards", "export", str(tmp_path / "out"), "--set",
                  "thresholds.read_p95=1")
    assert result.exit_code == 2
    assert "unknown key thresholds.read_p95" in result.output
    assert not (tmp_path / "out").exists()


def test_documented_ttl_flag_alone_works(tmp_path):
    """docs/dashboards.md's `--set decode_ttl_seconds=300`: the entry lifetime follows."""
    out = tmp_path / "out"
    result = _run("dashboards", "export", str(out), "--set", "decode_ttl_seconds=300")
    assert result.exit_code == 0, result.output
    board = json.loads((out / f"{DEFAULT.dashboard_uid}.json").read_text())
    # the dashboards read D's TTL from the proxy when they run: the same for any TTL
    assert board == dashboards.build_overview(DEFAULT)


@pytest.mark.parametrize("flag, key", [
    ("windows.rate=5 minutes", "windows.rate"),
    ("windows.for_ratio=10", "windows.for_ratio"),
    ("selectors.engine=namespace:serving", "selectors.engine"),
    ("thresholds.expired_read_ratio=5", "thresholds.expired_read_ratio"),
])
def test_export_refuses_an_unusable_value_naming_its_key(tmp_path, flag, key):
    result = _run("dashboards", "export", str(tmp_path / "out"), "--set", flag)
    assert result.exit_code == 2, result.output
    assert f"{key}:" in result.output
    assert not (tmp_path / "out").exists()
