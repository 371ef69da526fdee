"""The turn table's columns: one declaration per column, read by every builder.

One row per (tenant, conversation_id, turn). Each column comes from one span name and one
attribute (or span field such as ``span_id``), aggregated over the turn's spans of that
name (``Agg``); some carry to the next turn as ``prev_<name>`` (facts of turn k's KV that
turn k+1's diagnosis reads); ``gap_s`` and the ``prev_`` columns are derived after
aggregation. ``kvobs.turns.correlate`` builds the table in process (diagnose, turns, the
fleet commands, the store's turn files); in SQL, ``kvobs.sources._clickhouse_sql``
translates each column once (``turn_value``, ``turn_aggregate``) for the ClickHouse
source's queries and its turn view; all from this list.

``fleet`` says how a column appears in the fleet's compact table (report, tune, whatif,
the store's turn files, ClickHouse): the same aggregation, ``PRESENCE`` for a span id the
fleet keeps only as "the span exists", or absent (``None``). ``public`` columns are in
``kvobs diagnose --json`` and ``kvobs turns`` (a contract: docs/turns.md is generated from
this module); the others feed rules and timelines.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from kvobs import semconv as sc


class Agg(str, enum.Enum):
    FIRST = "first"  # the first non-null value by span start (a fallback retry's second
    #                  decision must not overwrite the first, which had the proxy's params)
    SUM = "sum"  # summed over the turn's spans, null when none has a value
    COUNT = "count"  # how many spans of the name the turn has, null when none
    PRESENCE = "presence"  # "yes" when the turn has such a span, else null


@dataclass(frozen=True)
class TurnColumn:
    name: str
    type: str  # semconv type: "str" | "int" | "float" | "bool"
    doc: str
    span: sc.SpanName | None = None  # None: a key or a derived column
    source: str | None = None  # attribute key or span field ("span_id", "start_ns", ...)
    agg: Agg = Agg.FIRST
    carries: bool = False  # also derived as prev_<name> on the next turn
    fleet: Agg | None = None  # its aggregation in the fleet table; None: not there
    public: bool = False


@dataclass(frozen=True)
class SpanColumn(TurnColumn):
    """A column read from a span: its span and source are always set."""

    span: sc.SpanName
    source: str


# Span fields a column may read instead of an attribute, with their types.
SPAN_FIELDS = {
    "trace_id": "str",
    "span_id": "str",
    "start_ns": "int",
    "end_ns": "int",
    "error": "bool",
}
KEYS = ["tenant", "conversation_id", "turn"]
CONVERSATION_KEYS = KEYS[:2]
# Spans recorded without a tenant (no kvobs proxy in front).
UNKNOWN_TENANT = ""
PREVIOUS_PREFIX = "prev_"
# Key column -> the span attribute it is read from.
KEY_SOURCES = {
    "tenant": sc.TENANT_DIGEST.key,
    "conversation_id": sc.CONVERSATION_ID.key,
    "turn": sc.TURN_INDEX.key,
}

_FIELD_DOCS = {
    "trace_id": "trace id",
    "span_id": "span id",
    "start_ns": "start (unix ns)",
    "end_ns": "end (unix ns)",
    "error": "error status",
}
_F, _P = Agg.FIRST, Agg.PRESENCE


def _col(
    name: str,
    span: sc.SpanName,
    source: str | sc.Attribute,
    *,
    agg: Agg = Agg.FIRST,
    carries: bool = False,
    fleet: Agg | None = None,
    public: bool = False,
    type_: str | None = None,
) -> SpanColumn:
    if isinstance(source, sc.Attribute):
        key, kind, doc = source.key, source.type, f"`{source.key}`: {source.doc}"
    else:
        key, kind, doc = source, SPAN_FIELDS[source], f"the span's {_FIELD_DOCS[source]}"
    if agg is Agg.COUNT:
        kind, doc = "int", f"how many `{span.name}` spans the turn has"
    return SpanColumn(name, type_ or kind, doc, span, key, agg, carries, fleet, public)


_SPAN_COLUMNS = [
    _col("trace_id", sc.SPAN_PROXY_TURN, "trace_id", public=True),
    _col("turn_span_id", sc.SPAN_PROXY_TURN, "span_id"),
    _col("turn_start_ns", sc.SPAN_PROXY_TURN, "start_ns", fleet=_F),
    _col("turn_end_ns", sc.SPAN_PROXY_TURN, "end_ns", carries=True, fleet=_F),
    _col("turn_error", sc.SPAN_PROXY_TURN, "error"),
    _col("stream", sc.SPAN_PROXY_TURN, sc.STREAM, carries=True, public=True),
    _col("proxy_ttft_s", sc.SPAN_PROXY_TURN, sc.TTFT, fleet=_F),
    _col("prefill_leg_s", sc.SPAN_PROXY_TURN, sc.PREFILL_TIME, fleet=_F),
    _col("decode_leg_s", sc.SPAN_PROXY_TURN, sc.DECODE_TIME),
    _col("p_sent_at", sc.SPAN_PROXY_TURN, sc.PREFILL_SENT_AT, fleet=_F),
    _col("p_retry_sent_at", sc.SPAN_PROXY_TURN, sc.PREFILL_RETRY_SENT_AT, fleet=_F),
    _col("p_answered_at", sc.SPAN_PROXY_TURN, sc.PREFILL_ANSWERED_AT, fleet=_F),
    _col("d_sent_at", sc.SPAN_PROXY_TURN, sc.DECODE_SENT_AT, fleet=_F),
    _col("d_first_output_at", sc.SPAN_PROXY_TURN, sc.DECODE_FIRST_OUTPUT_AT, fleet=_F),
    _col("d_answered_at", sc.SPAN_PROXY_TURN, sc.DECODE_ANSWERED_AT, fleet=_F),
    _col("lookup_span_id", sc.SPAN_PROXY_LOOKUP, "span_id"),
    _col("lookup", sc.SPAN_PROXY_LOOKUP, sc.LOOKUP_OUTCOME, fleet=_F, public=True),
    _col("entry_age_s", sc.SPAN_PROXY_LOOKUP, sc.ENTRY_AGE, fleet=_F),
    _col("entry_remaining_ttl_s", sc.SPAN_PROXY_LOOKUP, sc.ENTRY_REMAINING_TTL),
    _col("params_sent", sc.SPAN_PROXY_LOOKUP, sc.PARAMS_SENT, fleet=_F),
    _col("lookup_inferred", sc.SPAN_PROXY_LOOKUP, sc.LOOKUP_INFERRED),
    _col("lookup_miss_reason", sc.SPAN_PROXY_LOOKUP, sc.LOOKUP_MISS_REASON),
    _col("proxy_instance", sc.SPAN_PROXY_LOOKUP, sc.PROXY_INSTANCE, carries=True),
    _col("proxy_started_at", sc.SPAN_PROXY_LOOKUP, sc.PROXY_STARTED_AT),
    _col("store_span_id", sc.SPAN_PROXY_STORE, "span_id", carries=True),
    _col("store_action", sc.SPAN_PROXY_STORE, sc.STORE_ACTION, carries=True),
    _col("fallback_span_id", sc.SPAN_PROXY_FALLBACK, "span_id"),
    _col("fallback_reason", sc.SPAN_PROXY_FALLBACK, sc.FALLBACK_REASON, fleet=_F, public=True),
    _col("decision_span_id", sc.SPAN_PULL_DECISION, "span_id"),
    _col("decision_count", sc.SPAN_PULL_DECISION, "span_id", agg=Agg.COUNT),
    _col("prefill_request_id", sc.SPAN_PULL_DECISION, sc.REQUEST_ID, public=True),
    _col("prompt_tokens", sc.SPAN_PULL_DECISION, sc.PROMPT_TOKENS, fleet=_F, public=True),
    _col("local_hit_tokens", sc.SPAN_PULL_DECISION, sc.LOCAL_HIT_TOKENS, fleet=_F, public=True),
    _col("remote_tokens", sc.SPAN_PULL_DECISION, sc.REMOTE_TOKENS, fleet=_F, public=True),
    _col("candidate_tokens", sc.SPAN_PULL_DECISION, sc.CANDIDATE_TOKENS, fleet=_F, public=True),
    _col("threshold", sc.SPAN_PULL_DECISION, sc.THRESHOLD, fleet=_F, public=True),
    _col("decision", sc.SPAN_PULL_DECISION, sc.PULL_DECISION, fleet=_F, public=True),
    _col("prefix_matched_tokens", sc.SPAN_PULL_DECISION, sc.PREFIX_MATCHED_TOKENS),
    _col("read_span_id", sc.SPAN_READ, "span_id", fleet=_P),
    _col("read_start_ns", sc.SPAN_READ, "start_ns", fleet=_F),
    _col("read_setup_s", sc.SPAN_READ, sc.READ_SETUP, fleet=_F, public=True),
    _col("read_outcome", sc.SPAN_READ, sc.READ_OUTCOME, fleet=_F, public=True),
    _col("read_bytes", sc.SPAN_READ, sc.READ_BYTES, fleet=_F, public=True),
    _col("read_blocks", sc.SPAN_READ, sc.READ_BLOCKS, fleet=_F, public=True),
    _col("read_duration_s", sc.SPAN_READ, sc.READ_DURATION, fleet=_F, public=True),
    _col("read_unobserved_s", sc.SPAN_READ, sc.READ_UNOBSERVED, fleet=_F, public=True),
    _col("read_error", sc.SPAN_READ, sc.READ_ERROR),
    _col("remaining_ttl_s", sc.SPAN_READ, sc.REMAINING_TTL_AT_READ, public=True),
    _col("recompute_span_id", sc.SPAN_RECOMPUTE, "span_id"),
    _col(
        "recomputed_tokens",
        sc.SPAN_RECOMPUTE,
        sc.RECOMPUTED_TOKENS,
        agg=Agg.SUM,
        fleet=Agg.SUM,
        public=True,
    ),
    _col("recompute_reason", sc.SPAN_RECOMPUTE, sc.RECOMPUTE_REASON),
    _col("stuck_span_id", sc.SPAN_STUCK, "span_id", fleet=_P),
    _col("p_request_span_id", sc.SPAN_PREFILL_REQUEST, "span_id"),
    _col("p_arrived_at", sc.SPAN_PREFILL_REQUEST, sc.REQUEST_ARRIVED_AT, fleet=_F),
    _col("p_scheduled_at", sc.SPAN_PREFILL_REQUEST, sc.REQUEST_SCHEDULED_AT, fleet=_F),
    _col("p_allocated_at", sc.SPAN_PREFILL_REQUEST, sc.REQUEST_ALLOCATED_AT, fleet=_F),
    _col("p_kv_ready_at", sc.SPAN_PREFILL_REQUEST, sc.REQUEST_KV_READY_AT, fleet=_F),
    _col("p_first_token_at", sc.SPAN_PREFILL_REQUEST, sc.REQUEST_FIRST_TOKEN_AT, fleet=_F),
    _col("d_request_span_id", sc.SPAN_DECODE_REQUEST, "span_id", fleet=_P),
    _col("d_arrived_at", sc.SPAN_DECODE_REQUEST, sc.REQUEST_ARRIVED_AT, fleet=_F),
    _col("d_scheduled_at", sc.SPAN_DECODE_REQUEST, sc.REQUEST_SCHEDULED_AT, fleet=_F),
    _col("d_kv_ready_at", sc.SPAN_DECODE_REQUEST, sc.REQUEST_KV_READY_AT, fleet=_F),
    _col("d_first_token_at", sc.SPAN_DECODE_REQUEST, sc.REQUEST_FIRST_TOKEN_AT, fleet=_F),
    _col("d_finished_ns", sc.SPAN_DECODE_REQUEST, "end_ns", fleet=_F),
    # The engines' HTTP front doors (kvobs.emit.engine_http): the turn's bounds behind a
    # router that is not kvobs's.
    _col("p_http_start_ns", sc.SPAN_PREFILL_HTTP, "start_ns", fleet=_F),
    _col("p_http_end_ns", sc.SPAN_PREFILL_HTTP, "end_ns", fleet=_F),
    _col("d_http_start_ns", sc.SPAN_DECODE_HTTP, "start_ns", fleet=_F),
    _col("d_http_end_ns", sc.SPAN_DECODE_HTTP, "end_ns", fleet=_F),
    _col("output_tokens", sc.SPAN_DECODE_REQUEST, sc.OUTPUT_TOKENS, fleet=_F, public=True),
    _col("handoff_span_id", sc.SPAN_HANDOFF, "span_id", fleet=_P),
    _col("handoff_start_ns", sc.SPAN_HANDOFF, "start_ns", fleet=_F),
    _col("handoff_outcome", sc.SPAN_HANDOFF, sc.READ_OUTCOME),
    _col("handoff_bytes", sc.SPAN_HANDOFF, sc.READ_BYTES, fleet=_F),
    _col("handoff_duration_s", sc.SPAN_HANDOFF, sc.READ_DURATION, fleet=_F),
    _col("handoff_setup_s", sc.SPAN_HANDOFF, sc.READ_SETUP, fleet=_F),
    _col("vllm_p_start_ns", sc.SPAN_VLLM_PREFILL, "start_ns"),
    _col("vllm_p_ttft_s", sc.SPAN_VLLM_PREFILL, sc.VLLM_TTFT),
    _col("vllm_d_start_ns", sc.SPAN_VLLM_DECODE, "start_ns"),
    _col("vllm_d_ttft_s", sc.SPAN_VLLM_DECODE, sc.VLLM_TTFT),
    _col("vllm_d_e2e_s", sc.SPAN_VLLM_DECODE, sc.VLLM_E2E),
    _col("export_span_id", sc.SPAN_EXPORT, "span_id", carries=True),
    _col("export_end_ns", sc.SPAN_EXPORT, "end_ns", fleet=_F),
    _col("decode_request_id", sc.SPAN_EXPORT, sc.REQUEST_ID, carries=True, public=True),
    _col("export_tokens", sc.SPAN_EXPORT, sc.EXPORT_TOKENS, carries=True, fleet=_F),
    _col("export_blocks", sc.SPAN_EXPORT, sc.EXPORT_BLOCKS, fleet=_F),
    _col("export_expires_at", sc.SPAN_EXPORT, sc.EXPORT_EXPIRES_AT, carries=True),
    _col("ttl_s", sc.SPAN_EXPORT, sc.TTL, carries=True, fleet=_F),
    _col("release_span_id", sc.SPAN_RELEASE, "span_id", carries=True),
    _col("release_reason", sc.SPAN_RELEASE, sc.RELEASE_REASON, carries=True, fleet=_F),
    _col("release_end_ns", sc.SPAN_RELEASE, "end_ns", carries=True, fleet=_F),
    _col("release_read_count", sc.SPAN_RELEASE, sc.RELEASE_READ_COUNT, fleet=_F),
    _col("held_s", sc.SPAN_RELEASE, sc.HELD_DURATION, fleet=_F),
    # Host copy (offloading connector): this turn's lookup and load, its own copy (saved
    # when it ended) and that copy's eviction (the evict span carries the owner's keys).
    _col("host_lookup_span_id", sc.SPAN_HOST_LOOKUP, "span_id", fleet=_P),
    _col("host_lookup_start_ns", sc.SPAN_HOST_LOOKUP, "start_ns", fleet=_F),
    _col("host_local_tokens", sc.SPAN_HOST_LOOKUP, sc.HOST_LOCAL_TOKENS, fleet=_F),
    _col("host_hit_tokens", sc.SPAN_HOST_LOOKUP, sc.HOST_HIT_TOKENS, fleet=_F),
    _col("host_accepted_tokens", sc.SPAN_HOST_LOOKUP, sc.HOST_ACCEPTED_TOKENS, fleet=_F),
    _col("host_hit_host_tokens", sc.SPAN_HOST_LOOKUP, sc.HOST_HIT_HOST, fleet=_F),
    _col("host_hit_p2p_tokens", sc.SPAN_HOST_LOOKUP, sc.HOST_HIT_P2P, fleet=_F),
    _col("host_lookup_prompt_tokens", sc.SPAN_HOST_LOOKUP, sc.PROMPT_TOKENS, fleet=_F),
    _col("host_load_span_id", sc.SPAN_HOST_LOAD, "span_id", fleet=_P),
    _col("host_load_bytes", sc.SPAN_HOST_LOAD, sc.HOST_BYTES, fleet=_F),
    _col("host_load_blocks", sc.SPAN_HOST_LOAD, sc.HOST_BLOCKS),
    _col("host_load_duration_s", sc.SPAN_HOST_LOAD, sc.HOST_DURATION, fleet=_F),
    _col("host_load_tier", sc.SPAN_HOST_LOAD, sc.HOST_TIER, fleet=_F),
    _col("host_copy_engine", sc.SPAN_HOST_LOAD, sc.HOST_COPY_ENGINE),
    _col("host_save_span_id", sc.SPAN_HOST_SAVE, "span_id", carries=True, fleet=_P),
    _col("host_saved_tokens", sc.SPAN_HOST_SAVE, sc.HOST_SAVED_TOKENS, carries=True, fleet=_F),
    _col("host_saved_blocks", sc.SPAN_HOST_SAVE, sc.HOST_BLOCKS, fleet=_F),
    _col("host_saved_bytes", sc.SPAN_HOST_SAVE, sc.HOST_BYTES, fleet=_F),
    _col(
        "host_covers_response", sc.SPAN_HOST_SAVE, sc.HOST_COVERS_RESPONSE, carries=True, fleet=_F
    ),
    _col(
        "host_save_incomplete", sc.SPAN_HOST_SAVE, sc.HOST_SAVE_INCOMPLETE, carries=True, fleet=_F
    ),
    _col("host_refused_blocks", sc.SPAN_HOST_SAVE, sc.HOST_REFUSED_BLOCKS, carries=True, fleet=_F),
    _col(
        "host_save_prompt_tokens", sc.SPAN_HOST_SAVE, sc.HOST_PROMPT_TOKENS, carries=True, fleet=_F
    ),
    _col(
        "host_save_output_tokens", sc.SPAN_HOST_SAVE, sc.HOST_OUTPUT_TOKENS, carries=True, fleet=_F
    ),
    _col("host_save_end_ns", sc.SPAN_HOST_SAVE, "end_ns", carries=True, fleet=_F),
    _col("host_evict_span_id", sc.SPAN_HOST_EVICT, "span_id", carries=True, fleet=_P),
    _col("host_evicted_blocks", sc.SPAN_HOST_EVICT, sc.HOST_BLOCKS, carries=True, fleet=_F),
    _col("host_evicted_age_s", sc.SPAN_HOST_EVICT, sc.HOST_EVICTED_AGE_MAX, carries=True, fleet=_F),
    _col("host_evict_end_ns", sc.SPAN_HOST_EVICT, "end_ns", carries=True, fleet=_F),
]
# What the rules need behind another router (kvobs.turns.lineage): the export a prompt extends.
_FLEET_LINEAGE = {
    "extends_request_id",
    "extends_fully",
    "extends_live",
    "lineage_gap",
    "extends_ttl_left_s",
    "extends_engine_restarted_at",
}
_SPAN_COLUMNS += [
    _col(column, sc.SPAN_PULL_DECISION, attribute, fleet=_F if column in _FLEET_LINEAGE else None)
    for column, attribute in sc.LINEAGE_FACTS.items()
]

KEY_COLUMNS = [
    TurnColumn(
        "tenant",
        "str",
        f"Digest of the tenant (`kvobs.tenant.digest`; {UNKNOWN_TENANT!r} when spans carry none).",
        fleet=_F,
        public=True,
    ),
    TurnColumn(
        "conversation_id",
        "str",
        "The conversation (`kvobs.conversation.id`, or "
        "named by kvobs.turns.lineage for id-less turns).",
        fleet=_F,
        public=True,
    ),
    TurnColumn("turn", "int", "Turn index within the conversation.", fleet=_F, public=True),
]
# Derived after aggregation, over consecutive turns of one conversation.
GAP = TurnColumn(
    "gap_s",
    "float",
    "Seconds from the previous turn's end to this turn's "
    "start (null unless the previous turn is turn - 1).",
    fleet=_F,
    public=True,
)
# Derived after aggregation from the turn's own columns: what keeping its KV for a later
# turn cost in each place (``kvobs report``'s ``retention`` sums them). Null while the
# hold had not ended in the spans read, or without the facts.
DEVICE_BLOCK_SECONDS = TurnColumn(
    "device_block_seconds",
    "float",
    "D's retention cost: the blocks D kept for the next turn (`kvobs.export.blocks`) x the "
    "seconds it held them, until a read released them or they expired "
    "(`kvobs.release.held`, else the release's end less the export's). Null while D still "
    "held them.",
    fleet=_F,
    public=True,
)
HOST_BYTE_SECONDS = TurnColumn(
    "host_byte_seconds",
    "float",
    "The host tier's retention cost: the bytes this turn's copy added to the offloading "
    "tier (`kvobs.host.bytes` of its save) x the seconds from the save's end until the "
    "tier first evicted them (its evict span's end). Null while the copy was still in "
    "the tier.",
    fleet=_F,
    public=True,
)
RETENTION = {c.name: c for c in (DEVICE_BLOCK_SECONDS, HOST_BYTE_SECONDS)}
# Derived from the turn's own columns: which retention path served which of its tokens.
# D with a host copy (vLLM's MultiConnector) has two: P reading D's device blocks, and an
# engine loading a copy from its offloading tier (docs/host_copy.md).
SERVED_DEVICE_TOKENS = TurnColumn(
    "served_device_tokens",
    "int",
    "Prompt tokens P read from D's retained KV over NIXL (the device path): the offered "
    "(else candidate) tokens of a read that finished, 0 when the turn read nothing. Null "
    "without P's pull decision.",
    public=True,
)
SERVED_HOST_TOKENS = TurnColumn(
    "served_host_tokens",
    "int",
    "Prompt tokens an engine loaded from an offloading tier, host or p2p (the host path): "
    "`kvobs.host.accepted_tokens` of the turn's lookup. Null without a lookup span.",
    public=True,
)
SERVED_BY = TurnColumn(
    "served_by",
    "str",
    "Which path served the turn's earlier KV (`ServedBy`: `device`, `host`, `device+host`, "
    "`none`) from `served_device_tokens` and `served_host_tokens`; null when neither path "
    "was observed.",
    public=True,
)
SERVED = {c.name: c for c in (SERVED_DEVICE_TOKENS, SERVED_HOST_TOKENS, SERVED_BY)}

COLUMNS: dict[str, TurnColumn] = {c.name: c for c in [*KEY_COLUMNS, *_SPAN_COLUMNS]}
SPAN_COLUMNS: dict[str, SpanColumn] = {c.name: c for c in _SPAN_COLUMNS}
# The fleet's compact table: name -> its column as the fleet aggregates it.
FLEET_COLUMNS: dict[str, SpanColumn] = {
    c.name: SpanColumn(
        c.name, c.type, c.doc, c.span, c.source, c.fleet, c.carries, c.fleet, c.public
    )
    for c in _SPAN_COLUMNS
    if c.fleet is not None
}


def previous(column: TurnColumn) -> TurnColumn:
    """The ``prev_`` column a carried column derives on the next turn."""
    return TurnColumn(
        PREVIOUS_PREFIX + column.name,
        column.type,
        f"`{column.name}` of the previous turn (turn - 1).",
        fleet=column.fleet,
    )


PREVIOUS: dict[str, TurnColumn] = {
    PREVIOUS_PREFIX + c.name: previous(c) for c in _SPAN_COLUMNS if c.carries
}
DERIVED: dict[str, TurnColumn] = {GAP.name: GAP, **RETENTION, **SERVED, **PREVIOUS}
ALL_COLUMNS: dict[str, TurnColumn] = {**COLUMNS, **DERIVED}
PUBLIC = [c.name for c in ALL_COLUMNS.values() if c.public]


def column_type(name: str) -> str:
    """The semconv type of any turn column."""
    return ALL_COLUMNS[name].type


def span_names(columns: Mapping[str, TurnColumn]) -> list[str]:
    return sorted({c.span.name for c in columns.values() if c.span is not None})
