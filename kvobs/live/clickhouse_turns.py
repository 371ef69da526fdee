"""Classified turn rows in ClickHouse: the live classifier's final turns in one
``ReplacingMergeTree`` table, so that a fleet on ClickHouse reads turns the classifier
linked (prefix lineage included), not spans regrouped by the ids they carry.

The table is ``turnstore.SCHEMA`` translated once (``table_ddl``): the key columns
(tenant, conversation, turn) order it, ``version`` replaces older rows of a turn as
ClickHouse merges (readers still keep the latest themselves, ``TurnRows``), and a TTL on
``finalized_at`` expires rows after the retention, a day's partition dropped whole.

A table an older kvobs made lacks the columns added since: the first write adds them
(``column_additions``), and a read never alters the table (a reader may be a read-only
user): it selects the columns the table has and gives the others as nulls of their type.
"""

from __future__ import annotations

import calendar
import json
import re
import time
from typing import Callable, Collection, Iterable, Iterator

import pyarrow as pa

from kvobs.live.turnstore import COMPACT_AFTER_S, SCHEMA, TurnRows
from kvobs.sources._clickhouse_client import ClickHouseError, Database, connect
from kvobs.sources._errors import SourceError
from kvobs.sources.clickhouse import check_table_name

DEFAULT_TURN_TABLE = "kvobs_turn_rows"
KEY = ("tenant", "conversation_id", "turn")
# Never null: the key, the version, the time the row was made and the turn itself.
_REQUIRED = {*KEY, "version", "finalized_at", "detail"}
# Few distinct values: dictionary-encoded.
_LOW_CARDINALITY = {"tenant", "verdict", "rule", "slowest_phase"}
# A ClickHouse String holds any bytes: the packed measures too.
_TYPES = {
    pa.string(): "String",
    pa.binary(): "String",
    pa.int64(): "Int64",
    pa.float64(): "Float64",
}


def column_type(field: pa.Field) -> str:
    kind = _TYPES[field.type]
    if field.name not in _REQUIRED:
        kind = f"Nullable({kind})"
    return f"LowCardinality({kind})" if field.name in _LOW_CARDINALITY else kind


def table_ddl(table: str, retention_s: float) -> str:
    columns = ",\n    ".join(f"`{f.name}` {column_type(f)}" for f in SCHEMA)
    stamp = "toDateTime(toUInt32(finalized_at))"
    return (
        f"CREATE TABLE IF NOT EXISTS {table} (\n    {columns}\n)\n"
        f"ENGINE = ReplacingMergeTree(version)\n"
        f"PARTITION BY toYYYYMMDD({stamp})\n"
        f"ORDER BY ({', '.join(KEY)})\n"
        f"TTL {stamp} + INTERVAL {int(retention_s)} SECOND\n"
        f"SETTINGS ttl_only_drop_parts = 1"
    )


# A turn row's hour (UTC): what a tally is kept for (``tallies_ddl``), as the embedded
# store's hourly partitions.
HOUR = "formatDateTime(toDateTime(toUInt32(finalized_at), 'UTC'), '%Y%m%d%H')"
HOUR_NAME = re.compile(r"\d{10}")


def tallies_ddl(table: str, retention_s: float) -> str:
    """The report's tallies of a turn table's closed hours (``TurnRows.summaries``):
    each with the hour's row count when it was made (a count that changed since, as
    ClickHouse merged older versions away or late rows came, makes it stale)."""
    return (
        f"CREATE TABLE IF NOT EXISTS {table} (\n"
        "    `hour` String,\n    `hour_start` Float64,\n    `rows` UInt64,\n"
        "    `made_at` Float64,\n    `tally` String\n)\n"
        "ENGINE = ReplacingMergeTree(made_at)\n"
        "ORDER BY hour\n"
        f"TTL toDateTime(toUInt32(hour_start)) + INTERVAL {int(retention_s) + 3600} SECOND"
    )


def column_additions(table: str) -> str:
    """The columns a table made by an older kvobs may lack, added (nullable ones only:
    the required ones were there from the first version); a no-op on a current table."""
    added = ", ".join(
        f"ADD COLUMN IF NOT EXISTS `{f.name}` {column_type(f)}"
        for f in SCHEMA
        if f.name not in _REQUIRED
    )
    return f"ALTER TABLE {table} {added}"


class ClickHouseTurns(TurnRows):
    def __init__(
        self, database: Database, table: str = DEFAULT_TURN_TABLE, retention_s: float = 30 * 86400.0
    ):
        super().__init__(retention_s)
        check_table_name(table)
        self.database = database
        self.table = table
        self.location = f"{database.location} table {table}"
        self._created = False
        self._columns: frozenset[str] | None = None  # the table's, once read or written
        self.hour_rows_listed: dict[str, int] = {}  # hour -> rows, when ``unsummarized`` listed it

    @classmethod
    def from_url(
        cls, url: str, retention_s: float = 30 * 86400.0, create: bool = True
    ) -> ClickHouseTurns:
        database, options = connect(url, create=create)
        return cls(database, options.get("turn_table", DEFAULT_TURN_TABLE), retention_s)

    def exists(self, table: str | None = None) -> bool:
        table = table or self.table
        return bool(self.database.query(f"EXISTS TABLE {table}").column(0)[0].as_py())

    @property
    def tallies(self) -> str:
        return f"{self.table}_tallies"

    def _held(self) -> frozenset[str]:
        """The table's columns, asked once (``DESCRIBE TABLE``): a table made by an older
        kvobs lacks the nullable columns added since. ``SourceError`` (the CLI's input
        error) naming the table and column when a required one is missing: not a kvobs
        turn table."""
        if self._columns is None:
            described = self.database.query(f"DESCRIBE TABLE {self.table}")
            held = frozenset(described.column(0).to_pylist())
            missing = [f.name for f in SCHEMA if f.name in _REQUIRED and f.name not in held]
            if missing:
                raise SourceError(
                    f"{self.location}: not a kvobs turn table: it has no column "
                    + ", ".join(f"`{name}`" for name in missing)
                )
            self._columns = held
        return self._columns

    def selected(self, columns: Iterable[str]) -> str:
        """The SELECT list of ``columns``: a column the table lacks as a typed null."""
        held = self._held()
        return ", ".join(
            f"`{c}`" if c in held else f"CAST(NULL AS {column_type(SCHEMA.field(c))}) AS `{c}`"
            for c in columns
        )

    def _flush(self, now: float) -> int:
        rows = pa.Table.from_pylist(self.pending, schema=SCHEMA)
        try:
            if not self._created:
                self.database.query(table_ddl(self.table, self.retention_s))
                self.database.query(column_additions(self.table))
                self._created = True
                self._columns = frozenset(SCHEMA.names)
            self.database.insert(self.table, rows)
        except ClickHouseError as error:  # kept in pending, as a full disk keeps them
            raise OSError(f"{self.location}: {error}") from error
        self.pending = []
        return rows.num_rows

    def batches(
        self,
        columns: list[str],
        batch_rows: int,
        later_versions: bool = False,
        skip: Collection[str] = (),
        only: Collection[str] | None = None,
    ) -> Iterator[pa.RecordBatch]:
        """Pages in the table's key order, each after the last key of the one before
        (keyset paging: ClickHouse reads each page in order, memory holds one page);
        ``skip`` and ``only`` name hours (``summaries``)."""
        if not self.exists():
            return
        order = [*KEY, "version"]
        wanted = pa.schema([SCHEMA.field(c) for c in columns])
        names = self.selected(dict.fromkeys([*order, *columns]))
        after: list[str] = []
        parameters: dict[str, object] = {}
        chosen = ["version > 1"] if later_versions else []
        if skip:
            chosen.append(f"{HOUR} NOT IN ({hour_literals(skip)})")
        if only is not None:
            chosen.append(f"{HOUR} IN ({hour_literals(only)})")
        while True:
            where = " AND ".join(chosen + after)
            table = self.database.query(
                f"SELECT {names} FROM {self.table} {'WHERE ' + where if where else ''} "
                f"ORDER BY {', '.join(order)} LIMIT {int(batch_rows)}",
                parameters,
            )
            if table.num_rows:
                yield from table.select(columns).cast(wanted).to_batches()
            if table.num_rows < batch_rows:
                return
            last = {c: table.column(c)[table.num_rows - 1].as_py() for c in order}
            after = [
                "(tenant, conversation_id, turn, version) > "
                "({tenant:String}, {cid:String}, {turn:Int64}, {version:Int64})"
            ]
            parameters = {
                "tenant": last["tenant"],
                "cid": last["conversation_id"],
                "turn": last["turn"],
                "version": last["version"],
            }

    # ------------------------------------------------------------ the report's tallies

    def _hour_rows(self) -> dict[str, int]:
        counted = self.database.query(
            f"SELECT {HOUR} AS hour, count() AS n FROM {self.table} GROUP BY hour"
        )
        return dict(zip(counted.column("hour").to_pylist(), counted.column("n").to_pylist()))

    def _tallied(self) -> dict[str, int]:
        """Each tallied hour's row count when its tally was made."""
        if not self.exists(self.tallies):
            return {}
        listed = self.database.query(f"SELECT hour, rows FROM {self.tallies} FINAL")
        return dict(zip(listed.column("hour").to_pylist(), listed.column("rows").to_pylist()))

    def summaries(self) -> Iterator[tuple[str, bytes]]:
        """One query a tally, those whose hour still has the rows it was made from."""
        if not self.exists():
            return
        now = self._hour_rows()
        for hour, rows in sorted(self._tallied().items()):
            if HOUR_NAME.fullmatch(hour) and now.get(hour) == rows:
                found = self.database.query(
                    f"SELECT tally FROM {self.tallies} FINAL WHERE hour = {{hour:String}}",
                    {"hour": hour},
                )
                if found.num_rows:  # a String column: bytes, whatever Arrow type it came as
                    yield hour, found.column(0).cast(pa.binary())[0].as_py()

    def unsummarized(self) -> list[str]:
        """The closed hours (``COMPACT_AFTER_S`` after their end) without a tally made
        from the rows they hold now; their row counts are kept for ``write_summary``."""
        closed = time.strftime("%Y%m%d%H", time.gmtime(time.time() - 3600 - COMPACT_AFTER_S))
        try:
            if not self.exists():
                return []
            tallied, counts = self._tallied(), self._hour_rows()
        except ClickHouseError as error:  # the service's upkeep: said, tried again later
            raise OSError(f"{self.location}: {error}") from error
        self.hour_rows_listed = {
            hour: rows
            for hour, rows in counts.items()
            if hour <= closed and tallied.get(hour) != rows
        }
        return sorted(self.hour_rows_listed)

    def write_summary(self, part: str, summary: bytes) -> None:
        start = calendar.timegm(time.strptime(part, "%Y%m%d%H"))
        row = {
            "hour": part,
            "hour_start": float(start),
            "rows": self.hour_rows_listed[part],
            "made_at": time.time(),
            "tally": summary,
        }
        schema = pa.schema(
            [
                ("hour", pa.string()),
                ("hour_start", pa.float64()),
                ("rows", pa.uint64()),
                ("made_at", pa.float64()),
                ("tally", pa.binary()),
            ]
        )
        try:
            self.database.query(tallies_ddl(self.tallies, self.retention_s))
            self.database.insert(self.tallies, pa.Table.from_pylist([row], schema=schema))
        except ClickHouseError as error:
            raise OSError(f"{self.location}: {error}") from error

    def lookup(self, conversation_ids: list[str]) -> Callable[[str], list[str]]:
        """One query an hour: the ids among its rows."""

        def held(part: str) -> list[str]:
            found = self._of_hour(part, conversation_ids, "DISTINCT `conversation_id`")
            return found.column(0).to_pylist() if found.num_rows else []

        return held

    def conversation_rows(self, part: str, conversation_ids: list[str]) -> pa.Table:
        table = self._of_hour(part, conversation_ids, self.selected(SCHEMA.names))
        return table.cast(SCHEMA) if table.num_rows else SCHEMA.empty_table()

    def _of_hour(self, hour: str, conversation_ids: list[str], selected: str) -> pa.Table:
        return self.database.query(
            f"SELECT {selected} FROM {self.table} WHERE {HOUR} = {{hour:String}} AND "
            "has(JSONExtract({ids:String}, 'Array(String)'), conversation_id)",
            {"hour": hour, "ids": json.dumps(conversation_ids)},
        )

    def read(self, conversation_id: str | None = None, since: float | None = None) -> pa.Table:
        if not self.exists():
            return SCHEMA.empty_table()
        conditions, parameters = [], {}
        if conversation_id is not None:
            conditions.append("conversation_id = {cid:String}")
            parameters["cid"] = conversation_id
        if since is not None:
            conditions.append(f"finalized_at >= {float(since)!r}")
        where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
        names = self.selected(SCHEMA.names)
        table = self.database.query(f"SELECT {names} FROM {self.table} {where}", parameters)
        return table.cast(SCHEMA) if table.num_rows else SCHEMA.empty_table()


def hour_literals(parts: Collection[str]) -> str:
    """Hour names as SQL literals (each checked: they come from the tally table)."""
    named = sorted(p for p in parts if HOUR_NAME.fullmatch(p))
    return ", ".join(f"'{p}'" for p in named) or "''"


__all__ = ["ClickHouseTurns", "DEFAULT_TURN_TABLE", "table_ddl", "tallies_ddl"]
