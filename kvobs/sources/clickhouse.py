"""Spans from ClickHouse, as written by the OpenTelemetry Collector's ClickHouse exporter.

The exporter's ``otel_traces`` table has one row per span: ``Timestamp`` (start,
DateTime64(9)), ``TraceId``, ``SpanId``, ``ParentSpanId``, ``SpanName``, ``ServiceName``,
``Duration`` (ns), ``StatusCode`` and ``SpanAttributes``: ``Map(LowCardinality(String),
String)`` (every attribute value as a string), or ``JSON`` with the exporter's ``json``
option. The source reads the table's column types once (``dialect``) and generates every
attribute access for them (``_clickhouse_sql.AttributeDialect``). See docs/clickhouse.md
for the collector configuration.

Heavy work stays in SQL: ``turn_row_slices()`` pivots spans into one row per (tenant,
conversation, turn) (``kvobs.turns.schema.FLEET_COLUMNS``, as the store's turn files hold
them), from the turn view (``turns_view_ddl()``: partial aggregates written as the
exporter inserts, what the store's turn files are to its spans) when it holds every span,
else from the spans with one ``GROUP BY`` per span name; ``spans(cid)`` reads one
conversation's traces only.
Queries go through a ``query(sql, parameters=None) -> pyarrow.Table`` callable
(``_clickhouse_client``): a server through clickhouse-connect, or chdb (embedded
ClickHouse) for tests and local files; values from the user are bound parameters.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from typing import TYPE_CHECKING, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvobs import semconv as sc
from kvobs.turns import arrays
from kvobs.sources._clickhouse_sql import (
    CID_KEY,
    DEFAULT_TABLE,
    DIALECTS,
    ENV_PASSWORD,
    ENV_USER,
    MAP,
    NULLABLE,
    SPAN_TABLE_COLUMNS,
    TENANT_KEY,
    TURN_KEY,
    TURNS_SUFFIX,
    AttributeDialect,
    dialect_of,
    fleet_span_names,
    quote,
    turn_aggregate,
    turn_value,
)
from kvobs.sources._clickhouse_client import (
    ClickHouseError,
    Query,
    connect,
    embedded_query,
)
from kvobs.sources._clickhouse_view import (
    backfill_sql,
    turns_view_ddl,
    view_columns,
    view_mark,
)
from kvobs.turns.correlate import ANCESTRY_DEPTH, ARROW_TYPES
from kvobs.sources._errors import SourceError
from kvobs.sources._frame import (
    ALL_DTYPES,
    KIND_DTYPES,
    conformed,
    drop_duplicate_span_rows,
    frame_from_table,
)
from kvobs.sources._merge import CHECK, HASH, align_parts, merge_parts
from kvobs.sources._store_layout import COMPACTED_DIR
from kvobs.turns.schema import FLEET_COLUMNS, Agg

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "ClickHouseSource",
    "DIALECTS",
    "ENV_USER",
    "ENV_PASSWORD",
    "DEFAULT_TABLE",
    "TURNS_SUFFIX",
    "turns_view_ddl",
    "backfill_sql",
]

# Span names some fleet column sums or counts: where a repeated span would be counted.
_COUNTED_SPANS = {
    column.span.name for column in FLEET_COLUMNS.values() if column.agg in (Agg.SUM, Agg.COUNT)
}
# Turn view rows read per query by a fleet command (``view_slices``): a slice's Arrow
# rows and their conversion need ~2 KiB a turn, so a 100M-span fleet's 9.5M turns are
# never all in memory at once next to the table built from them.
VIEW_SLICE_TURNS = 2_000_000
# The turn view query's hash of each row's key (``_repeats_a_turn``).
KEY_HASH = "kvobs_key_hash"
# Table names go into SQL text: only plain identifiers, never quoted input.
_TABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?")


# The store's columns as ClickHouse reads them: segments an older kvobs wrote lack newer
# attributes, and without the structure given those are unknown identifiers.
_KIND_OF_DTYPE = {dtype: kind for kind, dtype in KIND_DTYPES.items()}
_STORE_STRUCTURE = ", ".join(
    f"`{column}` {NULLABLE[_KIND_OF_DTYPE[dtype]]}" for column, dtype in ALL_DTYPES.items()
)


def check_table_name(table: str) -> None:
    """Raise ``SourceError`` unless ``table`` is a plain ``[db.]name`` (it goes into SQL
    text: a table name cannot be a bound parameter)."""
    if not _TABLE_NAME.fullmatch(table or ""):
        raise SourceError(
            f"table {table!r}: not a table name ([db.]name, letters, digits, underscores)"
        )


class ClickHouseSource:
    """A ``SpanSource`` over an ``otel_traces`` table, its ``turn_row_slices()`` in SQL."""

    def __init__(self, query: Query, table: str = DEFAULT_TABLE, location: str = "clickhouse"):
        check_table_name(table)
        self.query = query
        self.table = table
        self.location = location
        self.problems: list[str] = []
        self._dialect: AttributeDialect | None = None

    # ----------------------------------------------------------------- constructors

    @classmethod
    def from_url(cls, url: str) -> "ClickHouseSource":
        """``clickhouse://[user:password@]HOST[:PORT]/DB[?table=T]`` or
        ``chdb:PATH[?table=T]`` (``_clickhouse_client.connect``). Connects on first use:
        ``check()`` raises ``SourceError`` with the server's own words when it refuses or
        is not there."""
        table = urllib.parse.parse_qs(urllib.parse.urlparse(url).query).get(
            "table", [DEFAULT_TABLE]
        )[0]
        check_table_name(table)  # before any connection or embedded database
        database, _ = connect(url)
        return cls(database.query, table, database.location)

    @classmethod
    def chdb(cls, path: str, table: str = DEFAULT_TABLE) -> "ClickHouseSource":
        return cls(embedded_query(path), table, f"chdb:{path}")

    # ----------------------------------------------------------------- admin helpers

    def create_table(self, attributes: str = MAP.name) -> None:
        """The exporter's span table, its attributes a ``Map`` ("map", the exporter's
        default) or ``JSON`` ("json", its ``json: true`` option)."""
        self.query(DIALECTS[attributes].ddl(self.table))
        self._dialect = None  # an existing table keeps its own: read it again

    def create_turns_view(self, backfill: bool = False) -> None:
        """``turns_view_ddl`` (and ``backfill_sql`` for spans already in the table)."""
        for statement in turns_view_ddl(self.table, self.dialect):
            self.query(statement)
        if backfill:
            self.query(backfill_sql(self.table, self.dialect))

    def load_store(self, store_dir: str) -> int:
        """Copy an embedded store's parquet segments into ``otel_traces`` the way the
        exporter would have written them (tests, demos, benchmarks). Returns spans."""
        pattern = os.path.join(os.path.abspath(store_dir), COMPACTED_DIR, "*", "*.parquet")
        attributes, resource = _exported_attributes(self.dialect)
        self.query(f"""
            INSERT INTO {self.table} (Timestamp, TraceId, SpanId, ParentSpanId, SpanName,
                SpanKind, ServiceName, ResourceAttributes, SpanAttributes, Duration,
                StatusCode)
            SELECT fromUnixTimestamp64Nano(start_ns), trace_id, span_id,
                ifNull(parent_span_id, ''), name, 'Internal', service,
                {resource}, {attributes},
                toUInt64(greatest(end_ns - start_ns, 0)),
                if(error, 'Error', 'Unset')
            FROM file({quote(pattern)}, Parquet, {quote(_STORE_STRUCTURE)})
            SETTINGS input_format_parquet_allow_missing_columns = 1""")
        return self.count()

    def check(self) -> None:
        """Raise ``SourceError`` unless the table can be read (unreachable server, no
        such table): commands then fail with a message, not a traceback."""
        try:
            exists = self.query(f"EXISTS TABLE {self.table}").column(0)[0].as_py()
        except ClickHouseError as error:
            raise SourceError(f"{self.location}: {error}") from error
        if not exists:
            raise SourceError(f"{self.location}: no table {self.table}")
        self.dialect  # noqa: B018 - a table of neither schema fails here, not mid-command

    @property
    def dialect(self) -> AttributeDialect:
        """How the table holds attributes, from its column types (one DESCRIBE, kept).
        ``SourceError`` for a table the exporter did not write (missing columns, or
        attributes neither ``Map(LowCardinality(String), String)`` nor ``JSON``)."""
        if self._dialect is None:
            try:
                described = self.query(f"DESCRIBE TABLE {self.table}")
            except ClickHouseError as error:
                raise SourceError(f"{self.location}: {error}") from error
            types = dict(
                zip(described.column("name").to_pylist(), described.column("type").to_pylist())
            )
            missing = [c for c in SPAN_TABLE_COLUMNS if c not in types]
            dialect = dialect_of(types.get("SpanAttributes", ""))
            if missing or dialect is None:
                what = (
                    f"no column {', '.join(missing)}"
                    if missing
                    else f"SpanAttributes is {types['SpanAttributes']}"
                )
                raise SourceError(
                    f"{self.location}: table {self.table} is not the OpenTelemetry "
                    f"Collector ClickHouse exporter's span table ({what}; kvobs reads "
                    f"SpanAttributes as {MAP.column_type}, or JSON with the exporter's "
                    f"json option)"
                )
            self._dialect = dialect
        return self._dialect

    def count(self) -> int:
        return int(self.query(f"SELECT count() AS n FROM {self.table}").column(0)[0].as_py())

    # ----------------------------------------------------------------- SpanSource

    def _span_table(self, where: str, parameters: dict | None = None) -> pa.Table:
        columns = ", ".join(f"{self.dialect.span_column(c)} AS `{c}`" for c in ALL_DTYPES)
        table = self.query(f"SELECT {columns} FROM {self.table} {where}", parameters)
        # A span the exporter inserted twice (a retry) counts once, as in every source.
        return drop_duplicate_span_rows(conformed(table), self.problems)

    def spans(self, conversation_id: str | None = None) -> pd.DataFrame:
        return frame_from_table(self.span_table(conversation_id))

    def span_table(self, conversation_id: str | None = None) -> pa.Table:
        if conversation_id is None:
            return self._span_table("")
        # Spans of the conversation's traces (untagged spans included).
        return self._span_table(
            f"WHERE TraceId IN (SELECT TraceId FROM {self.table} "
            f"WHERE {self.dialect.with_value(CID_KEY, 'cid')})",
            {"cid": conversation_id},
        )

    def conversation_ids(self) -> list[str]:
        cid = self.dialect.attr(CID_KEY)
        table = self.query(
            f"SELECT DISTINCT {cid} AS cid FROM {self.table} WHERE cid != '' ORDER BY cid"
        )
        return table.column("cid").to_pylist()

    # ----------------------------------------------------------------- fleet

    def _spans_named(self, name: str) -> str:
        """The table's spans of one name. Where a turn column adds spans up (a sum, a
        count), a span delivered twice (an exporter's retry, a load repeated) is read
        once; elsewhere the first value wins anyway and the scan stays plain."""
        where = f"{self.table} WHERE SpanName = {quote(name)}"
        if name not in _COUNTED_SPANS:
            return where
        return f"(SELECT * FROM {where} LIMIT 1 BY TraceId, SpanId)"

    def turns_sql(self) -> str:
        """One row per (tenant, conversation, turn) in one query, spans lacking a key
        taking it as ``correlate`` does: from the nearest of their ``ANCESTRY_DEPTH``
        ancestors that has it (a join per level), else from their trace (a join), a
        conversation only from a trace holding one. What ``turn_row_slices`` falls back
        to when its per-span-name parts show such spans, or on a hash collision."""
        # One branch per span name, filtered on SpanName (the exporter's sort key): each
        # attribute is looked up only on rows of its own span.
        sql = self.dialect
        tenant, cid, turn = (sql.attr(TENANT_KEY), sql.attr(CID_KEY), sql.typed(TURN_KEY, "int"))
        keys = f"{tenant} AS tenant, {cid} AS cid, {turn} AS turn_index"
        branches = []
        for name in fleet_span_names():
            values = [
                f"{turn_value(sql, c, name)} AS v_{column}" for column, c in FLEET_COLUMNS.items()
            ]
            branches.append(
                f"SELECT TraceId, SpanId, ParentSpanId, Timestamp, {keys}, "
                f"{', '.join(values)} FROM {self._spans_named(name)}"
            )
        # Several conversations may share a trace (a client's, which the proxy continues):
        # the parents come first, and a trace holding several gives no conversation. Each
        # level is a join on every span's ids (a span stored twice matched once: ANY): a
        # scan and a hash table per level, paid only on this fallback path.
        levels = [f"p{level}" for level in range(1, ANCESTRY_DEPTH + 1)]
        ancestors = "".join(
            f"\n            LEFT ANY JOIN (SELECT TraceId, SpanId, ParentSpanId, {keys} "
            f"FROM {self.table}) AS {p} ON {p}.TraceId = s.TraceId "
            f"AND {p}.SpanId = {child}.ParentSpanId"
            for child, p in zip(["s", *levels], levels)
        )

        def nearest(key: str) -> str:
            found = "".join(f"ifNull({p}.{key}, '') != '', {p}.{key}, " for p in levels)
            return f"ifNull(multiIf(s.{key} != '', s.{key}, {found}t.{key}), '')"

        turns = ", ".join(f"{p}.turn_index" for p in ["s", *levels, "t"])
        spans = f"""
            SELECT s.* REPLACE ({nearest("tenant")} AS tenant, {nearest("cid")} AS cid,
                                coalesce({turns}) AS turn_index)
            FROM ({" UNION ALL ".join(branches)}) AS s{ancestors}
            LEFT JOIN (SELECT TraceId, anyIf(tenant, tenant != '') AS tenant,
                              if(uniqExactIf(cid, cid != '') = 1, anyIf(cid, cid != ''),
                                 '') AS cid,
                              anyIf(turn_index, turn_index IS NOT NULL) AS turn_index
                       FROM (SELECT TraceId, {keys} FROM {self.table})
                       GROUP BY TraceId) AS t ON s.TraceId = t.TraceId"""
        select = [turn_aggregate(column, c) for column, c in FLEET_COLUMNS.items()]
        return (
            f"SELECT tenant, cid AS conversation_id, turn_index AS turn, "
            f"{', '.join(select)} FROM ({spans}) GROUP BY tenant, cid, turn_index "
            f"SETTINGS join_use_nulls = 1"
        )

    def branch_sql(self, span: str, keys: bool = True) -> str:
        """One span name's turn rows: its columns, two hashes of the turn key and (with
        ``keys``) the key itself."""
        mine = {column: c for column, c in FLEET_COLUMNS.items() if c.span.name == span}
        values = [f"{turn_value(self.dialect, c)} AS v_{column}" for column, c in mine.items()]
        select = [turn_aggregate(column, c) for column, c in mine.items()]
        group = "tenant, cid, turn_index"
        sql = self.dialect
        spans = (
            f"SELECT Timestamp, {sql.attr(TENANT_KEY)} AS tenant, "
            f"{sql.attr(CID_KEY)} AS cid, {sql.typed(TURN_KEY, 'int')} AS turn_index, "
            f"{', '.join(values)} FROM {self._spans_named(span)}"
        )
        flags = "cid = '' OR turn_index IS NULL AS keyless, tenant = '' AS no_tenant"
        if keys:
            return (
                f"SELECT tenant, cid AS conversation_id, turn_index AS turn, "
                f"cityHash64({group}) AS {HASH}, xxHash64({group}) AS {CHECK}, {flags}, "
                f"{', '.join(select)} FROM ({spans}) GROUP BY {group}"
            )
        # Grouped by the two hashes (a fixed-size key, cheaper than strings); two keys
        # sharing the first show as two rows with one HASH. Unsorted: an ORDER BY here
        # costs more than lining the rows up in numpy.
        return (
            f"SELECT {HASH}, {CHECK}, any(keyless) AS keyless, "
            f"any(no_tenant) AS no_tenant, {', '.join(select)} "
            f"FROM (SELECT *, cityHash64({group}) AS {HASH}, xxHash64({group}) AS {CHECK}, "
            f"{flags} FROM ({spans})) GROUP BY {HASH}, {CHECK}"
        )

    def view_sql(self, merge: bool = True, where: str = "") -> str:
        """The turn rows from the turn view, in no particular order (``derive`` links
        turns in any order; an ``ORDER BY`` merged the parts' 87 columns row by row, 1-2
        s of 1.35M turns) and ``where``: only the rows matching it, a condition on the
        view's keys. With ``merge``, rows of a turn that ClickHouse has not merged yet
        (inserted apart) are merged here, the others read as they are (``GROUP BY`` or
        ``FINAL`` over every row cost 3-10x more). Without, every row is read as stored
        (no ``GROUP BY``): right when no turn is split, which a repeated key shows."""
        keys = "tenant, conversation_id, turn"
        target = self.table + TURNS_SUFFIX
        columns = view_columns()
        whole = ", ".join(f"{c.value(grouped=False)} AS {c.name}" for c in columns)
        scope = f"WHERE {where}" if where else ""
        hashed = f"cityHash64({keys}) AS {KEY_HASH}"
        if not merge:
            return f"SELECT {keys}, {hashed}, {whole} FROM {target} {scope}"
        split = (
            f"({keys}) IN (SELECT {keys} FROM {target} {scope} GROUP BY {keys} HAVING count() > 1)"
        )
        merged = ", ".join(f"{c.value(grouped=True)} AS {c.name}" for c in columns)
        within = f"({where}) AND " if where else ""
        return (
            f"SELECT {keys}, {hashed}, {whole} FROM {target} WHERE {within}NOT {split} "
            f"UNION ALL SELECT {keys}, {hashed}, {merged} FROM {target} "
            f"WHERE {within}{split} GROUP BY {keys}"
        )

    def view_slices(self) -> list[str]:
        """Conditions that split the turn view into ranges of conversation ids (each
        conversation in one), about ``VIEW_SLICE_TURNS`` rows each, bounded by a seeded
        sample of the ids: a fleet's turn rows are read a slice at a time, each slice
        reading only its own granules (the view is sorted by conversation id)."""
        target = self.table + TURNS_SUFFIX
        rows = int(self.query(f"SELECT count() FROM {target}").column(0)[0].as_py())
        slices = -(-rows // VIEW_SLICE_TURNS)
        if slices <= 1:
            return [""]
        sample = (
            self.query(
                f"SELECT arraySort(groupArraySample({100 * slices}, 1)(conversation_id)) AS ids "
                f"FROM {target}"
            )
            .column(0)[0]
            .as_py()
        )
        bounds = sorted({sample[len(sample) * k // slices] for k in range(1, slices)})
        ranges = [f"conversation_id < {quote(bounds[0])}"]
        ranges += [
            f"conversation_id >= {quote(low)} AND conversation_id < {quote(high)}"
            for low, high in zip(bounds, bounds[1:])
        ]
        return ranges + [f"conversation_id >= {quote(bounds[-1])}"]

    def view_state(self) -> str:
        """What a fleet report reads: the turn view ("turns") when it holds exactly the
        table's fleet spans and none lacks a key; else the spans: through ``turns_sql``
        ("traces": some span must take a key from its trace) or the per-span-name
        parts ("" no view; "stale": made by another kvobs version; "incomplete": the
        span counts differ: created after spans arrived and not backfilled, spans
        dropped by a TTL, a backfill that overlapped inserts)."""
        target = self.table + TURNS_SUFFIX
        if not self.query(f"EXISTS TABLE {target}").column(0)[0].as_py():
            return ""
        created = self.query(f"SHOW CREATE TABLE {target}").column(0)[0].as_py()
        if quote(view_mark(self.table, self.dialect)) not in created:
            return "stale"
        names = ", ".join(map(quote, fleet_span_names()))
        row = self.query(
            f"SELECT sum(spans) = (SELECT count() FROM {self.table} WHERE SpanName IN "
            f"({names})) AS complete, max(keyless) AS keyless, "
            f"countIf(tenant = '') > 0 AND countIf(tenant != '') > 0 AS partial_tenant "
            f"FROM {target}"
        ).to_pylist()[0]
        if not row["complete"] or self._has_repeated_counted_spans():
            return "incomplete"
        return "traces" if row["keyless"] or row["partial_tenant"] else "turns"

    def _has_repeated_counted_spans(self) -> bool:
        """The view adds up what was inserted: a span delivered twice would count twice
        there, so such a table is read from its spans. Counted by a 64-bit hash of the ids
        (0.1 s instead of 0.3 over 1.35M spans): two spans sharing one only look repeated,
        and are read from the spans, never counted twice."""
        names = ", ".join(map(quote, sorted(_COUNTED_SPANS)))
        return not self.query(
            f"SELECT count() = uniqExact(cityHash64(TraceId, SpanId)) AS once "
            f"FROM {self.table} "
            f"WHERE SpanName IN ({names})"
        ).to_pylist()[0]["once"]

    def turn_row_slices(self) -> Iterator[pa.Table]:
        """From the turn view a range of conversation ids at a time (``view_slices``)
        when it holds every span, else from the spans in one piece."""
        state = self.view_state()
        if state == "turns":
            slices = self.view_slices()
            for where in slices:
                # Rows as stored (a merged view: one per turn); a turn still split over
                # rows repeats its key, and then the merging query is asked.
                table = self.query(self.view_sql(merge=False, where=where), large=True)
                repeated = _repeats_a_turn(table)
                if repeated:
                    table = self.query(self.view_sql(where=where), large=True)
                    repeated = _repeats_a_turn(table) and _repeats_a_key(table)
                if not repeated:
                    yield _keyed(table.drop_columns([KEY_HASH]))
                elif len(slices) > 1:  # slices before it are given: cannot start over
                    raise SourceError(
                        f"{self.location}: turn view rows kept changing "
                        f"while read ({where}); read it again"
                    )
                else:  # repeated: rows inserted meanwhile
                    break
            else:
                return
        yield _keyed(
            self.query(self.turns_sql()) if state == "traces" else self._turns_from_parts()
        )

    def _turns_from_parts(self) -> pa.Table:
        # The proxy's turn span is in (almost) every turn: its part brings the key strings,
        # the others only hashes (align_parts); if some turn lacks it, every part is
        # asked with keys (merge_parts).
        proxy = sc.SPAN_PROXY_TURN.name
        others = [name for name in fleet_span_names() if name != proxy]
        keyed = self.query(self.branch_sql(proxy))
        parts = [self.query(self.branch_sql(name, keys=False)) for name in others]
        types = {name: ARROW_TYPES[column.type] for name, column in FLEET_COLUMNS.items()}
        if _need_traces([keyed, *parts]):
            return self.query(self.turns_sql())
        table = align_parts(keyed, parts, types) if keyed.num_rows else None
        if table is None:
            parts = [self.query(self.branch_sql(name)) for name in others]
            table = merge_parts([keyed, *parts], types)
        return table if table is not None else self.query(self.turns_sql())  # a collision


def _exported_attributes(dialect: AttributeDialect) -> tuple[str, str]:
    """SQL for a parquet segment row's span and resource attributes as the exporter
    writes them in ``dialect``: every value as text in a map, or typed in JSON (an int a
    number, a bool true/false), absent values left out."""
    if dialect is MAP:
        pairs = []
        for key, type_ in ((a.key, a.type) for a in sc.ATTRIBUTES.values()):
            value = f"`{key}`"
            text = (
                f"if(isNull({value}), NULL, if({value}, 'true', 'false'))"
                if type_ == "bool"
                else f"toString({value})"
            )
            pairs.append(f"{quote(key)}, ifNull({text}, '')")
        return (
            f"mapFilter((k, v) -> v != '', map({', '.join(pairs)}))",
            "map('service.name', service)",
        )
    members = ", ".join(
        f"if(isNull(`{key}`), '', concat({quote(json.dumps(key) + ':')}, "
        f"toJSONString(assumeNotNull(`{key}`))))"
        for key in sc.ATTRIBUTES
    )
    return (
        f"concat('{{', arrayStringConcat(arrayFilter(m -> m != '', [{members}]), ','), '}}')",
        "concat('{\"service.name\":', toJSONString(service), '}')",
    )


def _keyed(table: pa.Table) -> pa.Table:
    """Turn rows with a conversation id and a turn index."""
    keyed = pc.and_(
        pc.not_equal(table.column("conversation_id"), ""), pc.is_valid(table.column("turn"))
    )
    if keyed.null_count == 0 and pc.all(keyed).as_py():
        return table  # a filter copies every column (1-3 CPU-s over 1.35M turns)
    return table.filter(keyed)


def _repeats_a_turn(table: pa.Table) -> bool:
    """Whether two rows share a turn key (rows in any order), by the keys' 64-bit hash
    the query added (``KEY_HASH``): two keys sharing one only look repeated (then the
    merging query is asked, and ``_repeats_a_key`` tells)."""
    hashes = np.sort(arrays.numbers(table.column(KEY_HASH)))
    return bool((hashes[1:] == hashes[:-1]).any())


def _repeats_a_key(table: pa.Table) -> bool:
    """Whether two rows share a turn key, compared exactly (codes of each key column)."""
    codes = [arrays.codes(table.column(name))[0] for name in ("turn", "conversation_id", "tenant")]
    key = np.stack(codes)[:, np.lexsort(codes)]
    return bool(np.all(key[:, 1:] == key[:, :-1], axis=0).any())


def _need_traces(parts: list[pa.Table]) -> bool:
    """Whether some span lacked a key its trace may supply: conversation or turn, or a
    tenant where other spans have one."""
    rows = sum(p.num_rows for p in parts)
    keyless = any(pc.max(p.column("keyless")).as_py() for p in parts if p.num_rows)
    no_tenant = sum(pc.sum(p.column("no_tenant")).as_py() or 0 for p in parts)
    return keyless or 0 < no_tenant < rows
