"""The ClickHouse transport: clickhouse-connect for servers, chdb embedded; the server's
error text reaches the user, user values are bound parameters, table names checked."""

import os
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from kvobs.cli import main
from kvobs.sources import SourceError, open_source

pytest.importorskip("clickhouse_connect")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AUTH_FAILED = ("Code: 516. DB::Exception: kvobs: Authentication failed: password is "
               "incorrect, or there is no user with such name. (AUTHENTICATION_FAILED) "
               "(version 24.8.4.13 (official build))")


class _RefusingServer(BaseHTTPRequestHandler):
    """A stand-in for a ClickHouse server refusing the login, answering as ClickHouse's
    HTTP interface does (status 516, the exception in the body and a header): no
    ClickHouse server runs here."""

    def _refuse(self):
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        body = (AUTH_FAILED + "\n").encode()
        self.send_response(516)
        self.send_header("X-ClickHouse-Exception-Code", "516")
        self.send_header("Content-Type", "text/plain; charset=UTF-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _refuse

    def log_message(self, *args):
        pass


@pytest.fixture
def refusing_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RefusingServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    thread.join(5)


def test_the_servers_error_text_is_shown(refusing_server):
    url = f"clickhouse://kvobs:wrong@127.0.0.1:{refusing_server}/default"
    with pytest.raises(SourceError, match="Authentication failed: password is incorrect"):
        open_source(url)
    result = CliRunner().invoke(main, ["turns", "--source", url])
    assert result.exit_code == 2
    assert "Authentication failed" in " ".join(result.output.split())


def test_no_server_is_an_input_error():
    result = CliRunner().invoke(main, ["report", "--source", "clickhouse://127.0.0.1:9/db"])
    assert result.exit_code == 2 and "error:" in result.output


@pytest.mark.parametrize("table", ["t; DROP TABLE x", "`t`", "a.b.c", "1t", "t%00"])
def test_table_names_are_checked_before_any_sql(tmp_path, table):
    (tmp_path / "db").mkdir()
    with pytest.raises(SourceError, match="not a table name"):
        open_source(f"chdb:{tmp_path / 'db'}?table={table}")


def test_a_conversation_id_is_a_bound_parameter(tmp_path):
    """Quotes, a semicolon and a comment in an id: read as the id, in its own process
    (chdb runs one embedded database per process)."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})
        from spanfactory import Tracers, TurnSpec, write_conversation
        from kvobs.sources.clickhouse import ClickHouseSource
        from kvobs.sources.store import compact
        store, db = {str(tmp_path / 'store')!r}, {str(tmp_path / 'db')!r}
        odd = "conv'a\\\\'); DROP TABLE otel_traces; -- {{x:String}}"
        write_conversation(Tracers(store), odd, [TurnSpec(), TurnSpec()])
        write_conversation(Tracers(store), "plain", [TurnSpec()])
        compact(store, writers_stopped=True)
        source = ClickHouseSource.chdb(db)
        source.create_table()
        source.load_store(store)
        spans = source.spans(odd)
        assert set(spans["gen_ai.conversation.id"]) == {{odd}}, spans
        assert source.conversation_ids() == sorted([odd, "plain"])
        print("ok", len(spans))
    """)
    (tmp_path / "db").mkdir()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok ")
