"""How kvobs talks to ClickHouse: a ``Query``, ``query(sql, parameters=None, large=False)
-> pyarrow.Table``, over a server (clickhouse-connect, its HTTP interface) or an embedded
database directory (chdb). ``large`` marks a read of a fleet's rows (the turn view): chdb
writes those to a memory file that the table then maps. Values from the user (a
conversation id, a path) are bound as server-side parameters (``{name:String}`` in the
SQL), never pasted in; a server error keeps the server's own text (``Code: 516.
DB::Exception: ... Authentication failed``).
"""

from __future__ import annotations

import os
import tempfile
import urllib.parse
from typing import Any, Callable, Mapping, NamedTuple, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kvobs.sources._clickhouse_sql import ENV_PASSWORD, ENV_USER, quote
from kvobs.sources._errors import SourceError

Query = Callable[..., pa.Table]


class Database(NamedTuple):
    """One ClickHouse: its ``Query``, an ``insert(table, arrow_rows)``, and where it is."""

    query: Query
    insert: Callable[[str, pa.Table], None]
    location: str


# Statements that answer no rows: sent as commands, not queries.
_COMMANDS = ("INSERT", "CREATE", "DROP", "ALTER", "TRUNCATE", "RENAME", "OPTIMIZE", "SYSTEM")
_TIMEOUT_S = 300


class ClickHouseError(SourceError):
    """The server or the embedded database refused a statement; the message is theirs
    (an input error for the commands: exit 2, never a traceback)."""


def server_query(
    host: str, port: int, database: str, user: str | None, password: str, secure: bool
) -> Query:
    """A ``Query`` over ClickHouse's HTTP interface. It connects on its first statement
    (clickhouse-connect asks the server's version and settings then): an unreachable
    server or a refused login raises ``ClickHouseError`` there."""
    return _server(host, port, database, user, password, secure).query


def _server(
    host: str, port: int, database: str, user: str | None, password: str, secure: bool
) -> Database:
    import clickhouse_connect
    from clickhouse_connect.driver.client import Client
    from clickhouse_connect.driver.exceptions import ClickHouseError as DriverError

    clients: list[Client] = []

    def client():
        if not clients:
            clients.append(
                clickhouse_connect.get_client(
                    host=host,
                    port=port,
                    database=database,
                    username=user or "default",
                    password=password or "",
                    secure=secure,
                    connect_timeout=10,
                    send_receive_timeout=_TIMEOUT_S,
                    autogenerate_session_id=False,
                )
            )
        return clients[0]

    def query(
        sql: str, parameters: Optional[Mapping[str, Any]] = None, large: bool = False
    ) -> pa.Table:
        try:
            if sql.lstrip().upper().startswith(_COMMANDS):
                client().command(sql, parameters=parameters)
                return pa.table({})
            return client().query_arrow(sql, parameters=parameters)
        except DriverError as error:
            raise ClickHouseError(_server_text(error)) from error

    def insert(table: str, rows: pa.Table) -> None:
        try:
            client().insert_arrow(table, rows)
        except DriverError as error:
            raise ClickHouseError(_server_text(error)) from error

    scheme = "https" if secure else "http"
    return Database(query, insert, f"{scheme}://{host}:{port}/{database}")


def embedded_query(path: str) -> Query:
    """A ``Query`` over an embedded ClickHouse database directory (chdb)."""
    return _embedded(path).query


def _embedded(path: str) -> Database:
    from chdb import session

    db = session.Session(path)
    # In process, compressing the result only to decompress it again is waste: the turn
    # view's 1.35M rows came back in 1.7-1.8 s instead of 2.3-2.8 (4.3-4.9 CPU-s -> 2.7).
    db.query("SET output_format_arrow_compression_method = 'none'")

    def query(
        sql: str, parameters: Optional[Mapping[str, Any]] = None, large: bool = False
    ) -> pa.Table:
        params = {name: _escaped(value) for name, value in (parameters or {}).items()}
        if large:
            table = _mapped_result(db, sql, params)
            if table is not None:
                return table
        try:
            result = db.query(sql, "Arrow", params=params)
        except Exception as error:  # noqa: BLE001 - chdb raises a bare RuntimeError
            raise ClickHouseError(_server_text(error)) from error
        # Arrow IPC read here: chdb's "ArrowTable" imports pandas (~0.3 s of a diagnose)
        # only to see that it is installed. A statement returns nothing: no columns.
        if len(result) == 0:
            return pa.table({})
        # Copied into Arrow's memory: chdb reuses the result's buffer for the next query,
        # and a table reading it in place (an uncompressed result) would change under it.
        # Batches are concatenated (one copy, and the one chunk per column the turn
        # table wants); a single batch is copied as bytes.
        view = result.get_memview().view()
        table = pa.ipc.open_file(view).read_all()
        if table.num_columns and table.column(0).num_chunks > 1:
            return table.combine_chunks()
        owned = pa.allocate_buffer(len(view))
        np.frombuffer(owned, np.uint8)[:] = np.frombuffer(view, np.uint8)
        return pa.ipc.open_file(owned).read_all()

    def insert(table: str, rows: pa.Table) -> None:
        # chdb reads a local file; the rows pass through one parquet file of their own.
        with tempfile.TemporaryDirectory(prefix="kvobs-insert-") as directory:
            staged = os.path.join(directory, "rows.parquet")
            pq.write_table(rows, staged)
            columns = ", ".join(f"`{name}`" for name in rows.column_names)
            query(
                f"INSERT INTO {table} ({columns}) SELECT {columns} "
                f"FROM file({quote(staged)}, Parquet)"
            )

    return Database(query, insert, f"chdb:{path}")


# Where a large chdb result goes: a memory file system, when it has room.
SPILL_DIR = "/dev/shm"
_SPILL_ROOM = 1 << 30
# Blocks of up to 256k rows (ClickHouse's default stops near 1 MB a block: ~1.4k turn
# rows, 181 chunks a column over 1.35M turns, each costing in every later step).
_LARGE_BLOCKS = "SETTINGS max_block_size = 262144, preferred_block_size_bytes = 268435456"


def _mapped_result(db, sql: str, params: Mapping[str, str]) -> pa.Table | None:
    """``sql``'s rows written by chdb to a file in ``SPILL_DIR`` and read by mapping it:
    no copy, and no page of the process's own faulted in for them (a fleet's turn view,
    1.35M x 88 columns: 1.6-1.8 s and ~50k page faults, against 3-7 s and 540k for the
    result in chdb's memory plus 220k for the copy that buffer needs; bench/README.md).
    The file is unlinked once mapped. None when there is no such file system with room,
    no file can be made there, or chdb could not write it (a small /dev/shm in a
    container): the caller reads the result from memory instead."""
    try:
        room = os.statvfs(SPILL_DIR)
        if room.f_bavail * room.f_frsize < _SPILL_ROOM:
            return None
        handle, path = tempfile.mkstemp(prefix="kvobs-", suffix=".arrow", dir=SPILL_DIR)
        os.close(handle)
    except OSError:
        return None
    try:
        db.query(
            f"{sql} INTO OUTFILE {quote(path)} TRUNCATE FORMAT Arrow {_LARGE_BLOCKS}", params=params
        )
        return pa.ipc.open_file(pa.memory_map(path)).read_all()
    except Exception:  # noqa: BLE001 - chdb raises a bare RuntimeError; memory decides
        return None
    finally:
        os.unlink(path)


_ESCAPES = str.maketrans(
    {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r", "\0": "\\0", "\b": "\\b", "\f": "\\f"}
)


def _escaped(value: Any) -> str:
    """A parameter in ClickHouse's Escaped text form (what its HTTP interface parses, and
    chdb with it; clickhouse-connect does this itself): a backslash is not a value's."""
    return str(value).translate(_ESCAPES)


def _server_text(error: Exception) -> str:
    """The server's message, without the client's retelling of the request."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " ".join(lines)[:500] or type(error).__name__


def connect(url: str, create: bool = False) -> tuple[Database, dict[str, str]]:
    """``clickhouse://[user:password@]HOST[:PORT]/DB[?k=v]`` (HTTP interface;
    ``clickhouses://`` for HTTPS; user/password also from ``KVOBS_CLICKHOUSE_USER`` /
    ``KVOBS_CLICKHOUSE_PASSWORD``) or ``chdb:PATH[?k=v]`` (embedded; made when
    ``create``, else it must exist: reading never creates a database). Returns the
    database and the URL's query parameters. Connects on first use."""
    parsed = urllib.parse.urlparse(url)
    options = {key: values[0] for key, values in urllib.parse.parse_qs(parsed.query).items()}
    if parsed.scheme == "chdb":
        path = parsed.path or url[len("chdb:") :].split("?")[0]
        if create:
            os.makedirs(path, exist_ok=True)
        elif not os.path.isdir(path):
            what = "is not a directory" if os.path.exists(path) else "does not exist"
            raise SourceError(f"chdb:{path}: {what} (an embedded ClickHouse database directory)")
        return _embedded(path), options
    secure = parsed.scheme == "clickhouses"
    try:
        port = parsed.port or (8443 if secure else 8123)
    except ValueError as error:
        raise SourceError(f"{url}: {error}") from error
    if not parsed.hostname:
        raise SourceError(f"{url}: no host")
    user = urllib.parse.unquote(parsed.username or "") or os.environ.get(ENV_USER)
    password = urllib.parse.unquote(parsed.password or "") or os.environ.get(ENV_PASSWORD, "")
    return _server(
        parsed.hostname, port, parsed.path.strip("/") or "default", user, password, secure
    ), options
