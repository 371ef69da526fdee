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

from typing import Collection, Iterable, Iterator

import pyarrow as pa

from kvobs.live.turnstore import SCHEMA, TurnRows
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

    @classmethod
    def from_url(
        cls, url: str, retention_s: float = 30 * 86400.0, create: bool = True
    ) -> ClickHouseTurns:
        database, options = connect(url, create=create)
        return cls(database, options.get("turn_table", DEFAULT_TURN_TABLE), retention_s)

    def exists(self) -> bool:
        return bool(self.database.query(f"EXISTS TABLE {self.table}").column(0)[0].as_py())

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

    def _selected(self, columns: Iterable[str]) -> str:
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
        (keyset paging: ClickHouse reads each page in order, memory holds one page).
        The table has no files with summaries: ``skip`` and ``only`` are never given."""
        if not self.exists():
            return
        order = [*KEY, "version"]
        wanted = pa.schema([SCHEMA.field(c) for c in columns])
        names = self._selected(dict.fromkeys([*order, *columns]))
        after: list[str] = []
        parameters: dict[str, object] = {}
        later = ["version > 1"] if later_versions else []
        while True:
            where = " AND ".join(later + after)
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
        names = self._selected(SCHEMA.names)
        table = self.database.query(f"SELECT {names} FROM {self.table} {where}", parameters)
        return table.cast(SCHEMA) if table.num_rows else SCHEMA.empty_table()


__all__ = ["ClickHouseTurns", "DEFAULT_TURN_TABLE", "table_ddl"]
