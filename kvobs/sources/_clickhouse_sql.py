"""SQL pieces shared by the ClickHouse source and its turn view: the exporter's table,
attribute access, span columns, value types, and the turn schema's one translation
(``turn_value``, ``turn_aggregate``): what every query that pivots spans into turn rows
reads of ``kvobs.turns.schema.FLEET_COLUMNS``."""

from __future__ import annotations

import re
from typing import NamedTuple

from kvobs import semconv as sc
from kvobs.turns.schema import FLEET_COLUMNS, Agg, SpanColumn, span_names

ENV_USER = "KVOBS_CLICKHOUSE_USER"
ENV_PASSWORD = "KVOBS_CLICKHOUSE_PASSWORD"
DEFAULT_TABLE = "otel_traces"
# The turn view of table T: T + TURNS_SUFFIX (AggregatingMergeTree) filled by the
# materialized view T + TURNS_SUFFIX + "_mv".
TURNS_SUFFIX = "_kvobs_turns"
ERROR_STATUS = ("Error", "STATUS_CODE_ERROR")
TENANT_KEY, CID_KEY, TURN_KEY = sc.TENANT_DIGEST.key, sc.CONVERSATION_ID.key, sc.TURN_INDEX.key

# The exporter's table (contrib exporter/clickhouseexporter, traces), abridged to what
# kvobs reads plus the exporter's own indexes; for tests, demos and docs. The attribute
# columns' type and indexes come from the table's ``AttributeDialect``.
_OTEL_TRACES_DDL = """
CREATE TABLE IF NOT EXISTS {table} (
    Timestamp DateTime64(9) CODEC(Delta, ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ParentSpanId String CODEC(ZSTD(1)),
    TraceState String CODEC(ZSTD(1)),
    SpanName LowCardinality(String) CODEC(ZSTD(1)),
    SpanKind LowCardinality(String) CODEC(ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    ResourceAttributes {attributes} CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion String CODEC(ZSTD(1)),
    SpanAttributes {attributes} CODEC(ZSTD(1)),
    Duration UInt64 CODEC(ZSTD(1)),
    StatusCode LowCardinality(String) CODEC(ZSTD(1)),
    StatusMessage String CODEC(ZSTD(1)){indexes}
) ENGINE = MergeTree
PARTITION BY toDate(Timestamp)
ORDER BY (ServiceName, SpanName, toDateTime(Timestamp))
"""
# The columns kvobs reads besides the attributes (``span_column``).
SPAN_TABLE_COLUMNS = (
    "Timestamp",
    "TraceId",
    "SpanId",
    "ParentSpanId",
    "SpanName",
    "ServiceName",
    "Duration",
    "StatusCode",
    "SpanAttributes",
)


def quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


_START = "toUnixTimestamp64Nano(Timestamp)"
_END = f"({_START} + toInt64(Duration))"


class AttributeDialect(NamedTuple):
    """How a span table holds span attributes: the exporter's default ``Map(LowCardinality
    (String), String)`` (every value as text) or, with its ``json: true`` option,
    ``JSON`` (a dotted key is a path; a value keeps its JSON type). Every attribute read
    (spans, the conversation filter, the fleet SQL, the turn view) starts from
    ``attr``, the value as text ('' when absent), so both dialects coerce alike."""

    name: str  # "map" or "json"
    column_type: str  # the attribute columns' type in the DDL
    text: str  # a key's value as text, '' when absent ({key}: the quoted key)
    has_value: str  # a test that some attribute equals {value}, for index pruning, or ''
    indexes: str  # the exporter's indexes on the attribute columns

    def attr(self, key: str) -> str:
        return self.text.format(key=quote(key))

    def typed(self, key: str, type_: str) -> str:
        """An attribute as its semconv type; NULL when absent or ill-typed (a turn index
        "x", a bool "yes", a non-finite float), never an error."""
        raw = self.attr(key)
        if type_ == "int":
            return f"toInt64OrNull({raw})"
        if type_ == "float":
            number = f"toFloat64OrNull({raw})"
            return f"if(isFinite({number}), {number}, NULL)"
        if type_ == "bool":
            return (
                f"multiIf({raw} IN ('true', 'True', '1'), true, "
                f"{raw} IN ('false', 'False', '0'), false, NULL)"
            )
        return f"nullIf({raw}, '')"

    def span_column(self, column: str) -> str:
        """SQL for a span-table column."""
        base = {
            "trace_id": "TraceId",
            "span_id": "SpanId",
            "parent_span_id": "nullIf(ParentSpanId, '')",
            "name": "SpanName",
            "service": "ServiceName",
            "start_ns": _START,
            "end_ns": _END,
            "error": f"StatusCode IN ({', '.join(map(quote, ERROR_STATUS))})",
        }
        if column in base:
            return base[column]
        return self.typed(column, sc.ATTRIBUTES[column].type)

    def with_value(self, key: str, parameter: str) -> str:
        """Rows whose attribute ``key`` equals the bound ``parameter`` (a String)."""
        match = f"{self.attr(key)} = {{{parameter}:String}}"
        if not self.has_value:
            return match
        return f"{self.has_value.format(value='{' + parameter + ':String}')} AND {match}"

    def ddl(self, table: str) -> str:
        """The exporter's span table in this dialect (abridged)."""
        return _OTEL_TRACES_DDL.format(
            table=table, attributes=self.column_type, indexes=self.indexes
        )


MAP = AttributeDialect(
    "map",
    "Map(LowCardinality(String), String)",
    # Same value as SpanAttributes[key] ('' when absent), ~25% less CPU: the key is
    # looked up in the LowCardinality key array instead of through the map.
    "SpanAttributes.values[indexOf(SpanAttributes.keys, {key})]",
    # The exporter's bloom filter on map values prunes granules.
    "has(mapValues(SpanAttributes), {value})",
    ",\n    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,\n"
    "    INDEX idx_span_attr_key mapKeys(SpanAttributes) TYPE bloom_filter(0.01) "
    "GRANULARITY 1,\n"
    "    INDEX idx_span_attr_value mapValues(SpanAttributes) TYPE bloom_filter(0.01) "
    "GRANULARITY 1",
)
JSON = AttributeDialect(
    "json",
    "JSON",
    # A Dynamic value (Int64, Float64, Bool, String; a date-like string inferred as Date
    # or DateTime at insert) as text; toString gives '' for an absent path.
    "toString(getSubcolumn(SpanAttributes, {key}))",
    "",
    "",
)
DIALECTS = {dialect.name: dialect for dialect in (MAP, JSON)}


# A map of text to text (the exporter's, or a hand-made table's ``Map(String, String)``).
_TEXT = r"(String|LowCardinality\(String\))"
_TEXT_MAP = re.compile(rf"Map\({_TEXT},{_TEXT}\)")


def dialect_of(column_type: str) -> AttributeDialect | None:
    """The dialect of a ``SpanAttributes`` column type as DESCRIBE shows it, or None."""
    if _TEXT_MAP.fullmatch(column_type.replace(" ", "")):
        return MAP
    if column_type == "JSON" or column_type.startswith("JSON("):
        return JSON
    return None


# Semconv type -> ClickHouse type of a turn value (NULL when the span lacks it).
NULLABLE = {
    "int": "Nullable(Int64)",
    "float": "Nullable(Float64)",
    "bool": "Nullable(Bool)",
    "str": "Nullable(String)",
}


def fleet_span_names() -> list[str]:
    return span_names(FLEET_COLUMNS)


# Columns that mark a span's presence (counted or flagged), not a value of it.
MARKERS = (Agg.PRESENCE, Agg.COUNT)


def turn_value(dialect: AttributeDialect, column: SpanColumn, span: str | None = None) -> str:
    """A turn column's value on one span row, typed: NULL where the span lacks it or is
    of another name than the column's (``span``, when rows of several names meet); a
    marker column's is 1."""
    kind = "bool" if column.agg in MARKERS else column.type
    if span is not None and span != column.span.name:
        return f"CAST(NULL, '{NULLABLE[kind]}')"
    value = "1" if column.agg in MARKERS else dialect.span_column(column.source)
    return f"CAST({value}, '{NULLABLE[kind]}')"


def turn_aggregate(name: str, column: SpanColumn) -> str:
    """The turn's value of a column from its span rows' ``v_<name>`` (``turn_value`` on
    rows of the column's span name, NULL on others), with pandas' semantics of
    ``kvobs.turns.correlate.aggregate``: the first non-null value by start time, a sum,
    a count (null for none) or "yes" (null for none)."""
    value = f"v_{name}"
    if column.agg is Agg.PRESENCE:
        return f"if(countIf({value} IS NOT NULL) > 0, 'yes', NULL) AS {name}"
    if column.agg is Agg.COUNT:
        return f"nullIf(toInt64(countIf({value} IS NOT NULL)), 0) AS {name}"
    if column.agg is Agg.SUM:
        return f"sum({value}) AS {name}"
    return f"argMinIf({value}, Timestamp, {value} IS NOT NULL) AS {name}"
