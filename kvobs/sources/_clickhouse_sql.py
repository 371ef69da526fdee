"""SQL pieces shared by the ClickHouse source and its turn view: the exporter's table,
attribute access, span columns, value types."""

from __future__ import annotations

from kvobs import semconv as sc
from kvobs.turn_columns import FLEET_COLUMNS, span_names

ENV_USER = "KVOBS_CLICKHOUSE_USER"
ENV_PASSWORD = "KVOBS_CLICKHOUSE_PASSWORD"
DEFAULT_TABLE = "otel_traces"
# The turn view of table T: T + TURNS_SUFFIX (AggregatingMergeTree) filled by the
# materialized view T + TURNS_SUFFIX + "_mv".
TURNS_SUFFIX = "_kvobs_turns"
ERROR_STATUS = ("Error", "STATUS_CODE_ERROR")
TENANT_KEY, CID_KEY, TURN_KEY = sc.TENANT_DIGEST.key, sc.CONVERSATION_ID.key, sc.TURN_INDEX.key

# The exporter's table (contrib exporter/clickhouseexporter, traces), abridged to what
# kvobs reads plus the exporter's own indexes; for tests, demos and docs.
OTEL_TRACES_DDL = """
CREATE TABLE IF NOT EXISTS {table} (
    Timestamp DateTime64(9) CODEC(Delta, ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ParentSpanId String CODEC(ZSTD(1)),
    TraceState String CODEC(ZSTD(1)),
    SpanName LowCardinality(String) CODEC(ZSTD(1)),
    SpanKind LowCardinality(String) CODEC(ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    ResourceAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion String CODEC(ZSTD(1)),
    SpanAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    Duration UInt64 CODEC(ZSTD(1)),
    StatusCode LowCardinality(String) CODEC(ZSTD(1)),
    StatusMessage String CODEC(ZSTD(1)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_span_attr_key mapKeys(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_value mapValues(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1
) ENGINE = MergeTree
PARTITION BY toDate(Timestamp)
ORDER BY (ServiceName, SpanName, toDateTime(Timestamp))
"""


def quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def attr(key: str) -> str:
    # Same value as SpanAttributes[key] ('' when absent), ~25% less CPU: the key is
    # looked up in the LowCardinality key array instead of through the map.
    return f"SpanAttributes.values[indexOf(SpanAttributes.keys, {quote(key)})]"


def typed(key: str, type_: str) -> str:
    """An attribute as its semconv type, NULL when absent (the map returns '')."""
    raw = attr(key)
    if type_ == "int":
        return f"toInt64OrNull({raw})"
    if type_ == "float":
        return f"toFloat64OrNull({raw})"
    if type_ == "bool":
        return f"if({raw} = '', NULL, {raw} IN ('true', 'True', '1'))"
    return f"nullIf({raw}, '')"


_START = "toUnixTimestamp64Nano(Timestamp)"
_END = f"({_START} + toInt64(Duration))"


def span_column(column: str) -> str:
    """SQL for a span-table column."""
    base = {"trace_id": "TraceId", "span_id": "SpanId",
            "parent_span_id": "nullIf(ParentSpanId, '')", "name": "SpanName",
            "service": "ServiceName", "start_ns": _START, "end_ns": _END,
            "error": f"StatusCode IN ({', '.join(map(quote, ERROR_STATUS))})"}
    if column in base:
        return base[column]
    return typed(column, sc.ATTRIBUTES[column].type)


# Semconv type -> ClickHouse type of a turn value (NULL when the span lacks it).
NULLABLE = {"int": "Nullable(Int64)", "float": "Nullable(Float64)",
             "bool": "Nullable(Bool)", "str": "Nullable(String)"}


def fleet_span_names() -> list[str]:
    return span_names(FLEET_COLUMNS)
