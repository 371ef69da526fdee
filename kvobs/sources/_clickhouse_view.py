"""The ClickHouse turn view: what the store's turn files are to its spans.

A materialized view writes one partial row per (tenant, conversation, turn) and insert as
the exporter inserts spans; ``ClickHouseSource.turn_row_slices`` reads it when it holds every
span (``view_state``). DDL and backfill are generated from
``kvobs.turns.schema.FLEET_COLUMNS``, the same columns the span SQL pivots.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from kvobs.sources import _clickhouse_sql as sql
from kvobs.turns.schema import FLEET_COLUMNS, Agg


class _ViewColumn(NamedTuple):
    name: str
    merge: str  # the view's aggregate function: merges rows of one turn
    type: str  # its argument type
    insert: str  # a turn's value from its spans in one insert
    read: str  # the turn value from a merged value ("{}")

    def value(self, grouped: bool) -> str:
        return self.read.format(f"{self.merge}({self.name})" if grouped else self.name)


def view_columns() -> list[_ViewColumn]:
    """The view's fleet columns, with the span path's semantics: the first non-null
    value of the column's span by start time, or its ``Agg`` (sum, count, presence).

    Plain columns, no aggregate states (deserializing 29 argMin states per turn cost as
    much as reading the spans): the first non-null value is the least (rank, start,
    value), rank 0 for a value, 1 for a null, 2 for a row of another span."""
    columns = []
    for column, turn_column in FLEET_COLUMNS.items():
        on_span = f"SpanName = {sql.quote(turn_column.span.name)}"
        value = f"v_{column}"
        kind = sql.NULLABLE[turn_column.type]
        if turn_column.agg is Agg.PRESENCE:
            columns.append(
                _ViewColumn(column, "max", "UInt8", f"max({on_span})", "if({} = 1, 'yes', NULL)")
            )
        elif turn_column.agg is Agg.COUNT:
            columns.append(
                _ViewColumn(column, "sum", "UInt64", f"countIf({on_span})", "nullIf({}, 0)")
            )
        elif turn_column.agg is Agg.SUM:
            columns.append(_ViewColumn(column, "sum", kind, f"sumIf({value}, {on_span})", "{}"))
        else:
            # Typed aggregates tupled after grouping: a min over tuples is ClickHouse's
            # generic path, 2x the insert cost.
            present = f"{on_span} AND {value} IS NOT NULL"
            columns.append(
                _ViewColumn(
                    column,
                    "min",
                    f"Tuple(UInt8, DateTime64(9), {kind})",
                    f"(if(countIf({present}) > 0, 0, if(countIf({on_span}) > 0, 1, 2)), "
                    f"minIf(Timestamp, {present}), argMinIf({value}, Timestamp, {present}))",
                    "{}.3",
                )
            )
    return columns


def _view_select(table: str, dialect: sql.AttributeDialect) -> str:
    """Fleet spans of ``table`` as partial turn rows. A span lacking conversation or turn
    cannot be placed (its trace may supply them, at read time): it marks its row
    ``keyless`` so that readers take the span path."""
    values = "".join(
        f",\n        {sql.turn_value(dialect, c)} AS v_{name}"
        for name, c in FLEET_COLUMNS.items()
        if c.agg not in sql.MARKERS
    )
    states = "".join(f",\n    {c.insert} AS {c.name}" for c in view_columns())
    names = ", ".join(map(sql.quote, sql.fleet_span_names()))
    return (
        f"SELECT tenant, conversation_id, ifNull(turn_index, 0) AS turn,\n"
        f"    count() AS spans,\n"
        f"    max(conversation_id = '' OR turn_index IS NULL) AS keyless{states}\n"
        f"FROM (SELECT Timestamp, SpanName,\n"
        f"        {dialect.attr(sql.TENANT_KEY)} AS tenant,\n"
        f"        {dialect.attr(sql.CID_KEY)} AS conversation_id,\n"
        f"        {dialect.typed(sql.TURN_KEY, 'int')} AS turn_index{values}\n"
        f"    FROM {table} WHERE SpanName IN ({names}))\n"
        f"GROUP BY tenant, conversation_id, turn"
    )


def turns_view_ddl(
    table: str = sql.DEFAULT_TABLE, dialect: sql.AttributeDialect = sql.MAP
) -> list[str]:
    """Statements creating ``table``'s turn view: an ``AggregatingMergeTree`` with one
    row (partial aggregate states) per (tenant, conversation, turn) and the materialized
    view filling it on every insert into ``table`` (its attributes in ``dialect``).
    Spans already in ``table`` need ``backfill_sql``."""
    target, view = _view_statements(table, dialect)
    # A view made by another kvobs version may pick other values: its mark differs and
    # readers take the spans.
    return [f"{target}\nCOMMENT {sql.quote(view_mark(table, dialect))}", view]


def _view_statements(table: str, dialect: sql.AttributeDialect) -> tuple[str, str]:
    target = table + sql.TURNS_SUFFIX
    columns = ",\n    ".join(
        f"{c.name} SimpleAggregateFunction({c.merge}, {c.type})" for c in view_columns()
    )
    return (
        f"""CREATE TABLE IF NOT EXISTS {target} (
    tenant LowCardinality(String),
    conversation_id String,
    turn Int64,
    spans SimpleAggregateFunction(sum, UInt64),
    keyless SimpleAggregateFunction(max, UInt8),
    {columns}
) ENGINE = AggregatingMergeTree
ORDER BY (tenant, conversation_id, turn)""",
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS {target}_mv TO {target} AS\n"
        + _view_select(table, dialect),
    )


def view_mark(table: str, dialect: sql.AttributeDialect) -> str:
    statements = "\n".join(_view_statements(table, dialect))
    return f"kvobs turn view {hashlib.sha256(statements.encode()).hexdigest()[:16]}"


def backfill_sql(table: str = sql.DEFAULT_TABLE, dialect: sql.AttributeDialect = sql.MAP) -> str:
    """The view's rows for spans already in ``table``. Run once, right after
    ``turns_view_ddl`` and while nothing inserts into ``table``: a span inserted during
    the backfill is counted twice, and the view then reads as incomplete (span path)."""
    return f"INSERT INTO {table}{sql.TURNS_SUFFIX}\n{_view_select(table, dialect)}"
