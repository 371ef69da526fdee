"""Join proxy, P and D spans into one row per turn.

Every kvobs span carries the correlation keys (tenant digest, conversation id, turn
index); spans that lack them inherit them from their trace. The tenant is part of the
key because the proxy scopes conversations by tenant: two tenants using one conversation
id are two conversations. Spans recorded without a tenant (no kvobs proxy in front) get
``UNKNOWN_TENANT``. Each turn column comes from one span name and
one attribute (``TURN_FIELDS``): the table is the whole mapping, so a new column is one
line. Facts about the *previous* turn's KV (D's export and release) are shifted onto the
turn that tried to reuse it.

The first stage, ``kvobs.lineage``, gives id-less turns their conversation and turn from
the engines' prefix chains, and P's decision span the facts of the D export its prompt
extends (``semconv.LINEAGE_FACTS``): columns like any other.
"""

from __future__ import annotations

import pandas as pd

from kvobs import lineage, semconv as sc

KEYS = ["tenant", "conversation_id", "turn"]
CONVERSATION_KEYS = ["tenant", "conversation_id"]
UNKNOWN_TENANT = ""

# column -> (span, attribute key or a span column such as "span_id")
TURN_FIELDS: dict[str, tuple[sc.SpanName, str]] = {
    "trace_id": (sc.SPAN_PROXY_TURN, "trace_id"),
    "turn_span_id": (sc.SPAN_PROXY_TURN, "span_id"),
    "turn_start_ns": (sc.SPAN_PROXY_TURN, "start_ns"),
    "turn_end_ns": (sc.SPAN_PROXY_TURN, "end_ns"),
    "turn_error": (sc.SPAN_PROXY_TURN, "error"),
    "stream": (sc.SPAN_PROXY_TURN, sc.STREAM.key),
    "proxy_ttft_s": (sc.SPAN_PROXY_TURN, sc.TTFT.key),
    "prefill_leg_s": (sc.SPAN_PROXY_TURN, sc.PREFILL_TIME.key),
    "decode_leg_s": (sc.SPAN_PROXY_TURN, sc.DECODE_TIME.key),
    "p_sent_at": (sc.SPAN_PROXY_TURN, sc.PREFILL_SENT_AT.key),
    "p_retry_sent_at": (sc.SPAN_PROXY_TURN, sc.PREFILL_RETRY_SENT_AT.key),
    "p_answered_at": (sc.SPAN_PROXY_TURN, sc.PREFILL_ANSWERED_AT.key),
    "d_sent_at": (sc.SPAN_PROXY_TURN, sc.DECODE_SENT_AT.key),
    "d_first_output_at": (sc.SPAN_PROXY_TURN, sc.DECODE_FIRST_OUTPUT_AT.key),
    "d_answered_at": (sc.SPAN_PROXY_TURN, sc.DECODE_ANSWERED_AT.key),
    "lookup_span_id": (sc.SPAN_PROXY_LOOKUP, "span_id"),
    "lookup": (sc.SPAN_PROXY_LOOKUP, sc.LOOKUP_OUTCOME.key),
    "entry_age_s": (sc.SPAN_PROXY_LOOKUP, sc.ENTRY_AGE.key),
    "entry_remaining_ttl_s": (sc.SPAN_PROXY_LOOKUP, sc.ENTRY_REMAINING_TTL.key),
    "params_sent": (sc.SPAN_PROXY_LOOKUP, sc.PARAMS_SENT.key),
    "lookup_inferred": (sc.SPAN_PROXY_LOOKUP, sc.LOOKUP_INFERRED.key),
    "lookup_miss_reason": (sc.SPAN_PROXY_LOOKUP, sc.LOOKUP_MISS_REASON.key),
    "proxy_instance": (sc.SPAN_PROXY_LOOKUP, sc.PROXY_INSTANCE.key),
    "proxy_started_at": (sc.SPAN_PROXY_LOOKUP, sc.PROXY_STARTED_AT.key),
    "store_span_id": (sc.SPAN_PROXY_STORE, "span_id"),
    "store_action": (sc.SPAN_PROXY_STORE, sc.STORE_ACTION.key),
    "fallback_span_id": (sc.SPAN_PROXY_FALLBACK, "span_id"),
    "fallback_reason": (sc.SPAN_PROXY_FALLBACK, sc.FALLBACK_REASON.key),
    "decision_span_id": (sc.SPAN_PULL_DECISION, "span_id"),
    "prefill_request_id": (sc.SPAN_PULL_DECISION, sc.REQUEST_ID.key),
    "prompt_tokens": (sc.SPAN_PULL_DECISION, sc.PROMPT_TOKENS.key),
    "local_hit_tokens": (sc.SPAN_PULL_DECISION, sc.LOCAL_HIT_TOKENS.key),
    "remote_tokens": (sc.SPAN_PULL_DECISION, sc.REMOTE_TOKENS.key),
    "candidate_tokens": (sc.SPAN_PULL_DECISION, sc.CANDIDATE_TOKENS.key),
    "threshold": (sc.SPAN_PULL_DECISION, sc.THRESHOLD.key),
    "decision": (sc.SPAN_PULL_DECISION, sc.PULL_DECISION.key),
    "prefix_matched_tokens": (sc.SPAN_PULL_DECISION, sc.PREFIX_MATCHED_TOKENS.key),
    "read_span_id": (sc.SPAN_READ, "span_id"),
    "read_start_ns": (sc.SPAN_READ, "start_ns"),
    "read_setup_s": (sc.SPAN_READ, sc.READ_SETUP.key),
    "read_outcome": (sc.SPAN_READ, sc.READ_OUTCOME.key),
    "read_bytes": (sc.SPAN_READ, sc.READ_BYTES.key),
    "read_blocks": (sc.SPAN_READ, sc.READ_BLOCKS.key),
    "read_duration_s": (sc.SPAN_READ, sc.READ_DURATION.key),
    "read_error": (sc.SPAN_READ, sc.READ_ERROR.key),
    "remaining_ttl_s": (sc.SPAN_READ, sc.REMAINING_TTL_AT_READ.key),
    "recompute_span_id": (sc.SPAN_RECOMPUTE, "span_id"),
    "recomputed_tokens": (sc.SPAN_RECOMPUTE, sc.RECOMPUTED_TOKENS.key),
    "recompute_reason": (sc.SPAN_RECOMPUTE, sc.RECOMPUTE_REASON.key),
    "stuck_span_id": (sc.SPAN_STUCK, "span_id"),
    "p_request_span_id": (sc.SPAN_PREFILL_REQUEST, "span_id"),
    "p_arrived_at": (sc.SPAN_PREFILL_REQUEST, sc.REQUEST_ARRIVED_AT.key),
    "p_scheduled_at": (sc.SPAN_PREFILL_REQUEST, sc.REQUEST_SCHEDULED_AT.key),
    "p_allocated_at": (sc.SPAN_PREFILL_REQUEST, sc.REQUEST_ALLOCATED_AT.key),
    "p_kv_ready_at": (sc.SPAN_PREFILL_REQUEST, sc.REQUEST_KV_READY_AT.key),
    "p_first_token_at": (sc.SPAN_PREFILL_REQUEST, sc.REQUEST_FIRST_TOKEN_AT.key),
    "d_request_span_id": (sc.SPAN_DECODE_REQUEST, "span_id"),
    "d_arrived_at": (sc.SPAN_DECODE_REQUEST, sc.REQUEST_ARRIVED_AT.key),
    "d_scheduled_at": (sc.SPAN_DECODE_REQUEST, sc.REQUEST_SCHEDULED_AT.key),
    "d_kv_ready_at": (sc.SPAN_DECODE_REQUEST, sc.REQUEST_KV_READY_AT.key),
    "d_first_token_at": (sc.SPAN_DECODE_REQUEST, sc.REQUEST_FIRST_TOKEN_AT.key),
    "output_tokens": (sc.SPAN_DECODE_REQUEST, sc.OUTPUT_TOKENS.key),
    "handoff_span_id": (sc.SPAN_HANDOFF, "span_id"),
    "handoff_start_ns": (sc.SPAN_HANDOFF, "start_ns"),
    "handoff_outcome": (sc.SPAN_HANDOFF, sc.READ_OUTCOME.key),
    "handoff_bytes": (sc.SPAN_HANDOFF, sc.READ_BYTES.key),
    "handoff_duration_s": (sc.SPAN_HANDOFF, sc.READ_DURATION.key),
    "handoff_setup_s": (sc.SPAN_HANDOFF, sc.READ_SETUP.key),
    "vllm_p_start_ns": (sc.SPAN_VLLM_PREFILL, "start_ns"),
    "vllm_p_ttft_s": (sc.SPAN_VLLM_PREFILL, sc.VLLM_TTFT.key),
    "vllm_d_start_ns": (sc.SPAN_VLLM_DECODE, "start_ns"),
    "vllm_d_ttft_s": (sc.SPAN_VLLM_DECODE, sc.VLLM_TTFT.key),
    "vllm_d_e2e_s": (sc.SPAN_VLLM_DECODE, sc.VLLM_E2E.key),
    "export_span_id": (sc.SPAN_EXPORT, "span_id"),
    "decode_request_id": (sc.SPAN_EXPORT, sc.REQUEST_ID.key),
    "export_tokens": (sc.SPAN_EXPORT, sc.EXPORT_TOKENS.key),
    "export_blocks": (sc.SPAN_EXPORT, sc.EXPORT_BLOCKS.key),
    "export_expires_at": (sc.SPAN_EXPORT, sc.EXPORT_EXPIRES_AT.key),
    "ttl_s": (sc.SPAN_EXPORT, sc.TTL.key),
    "release_span_id": (sc.SPAN_RELEASE, "span_id"),
    "release_reason": (sc.SPAN_RELEASE, sc.RELEASE_REASON.key),
    "release_end_ns": (sc.SPAN_RELEASE, "end_ns"),
    "release_read_count": (sc.SPAN_RELEASE, sc.RELEASE_READ_COUNT.key),
    # Host copy (offloading connector): this turn's lookup and load, its own copy (saved
    # when it ended) and that copy's eviction (the evict span carries the owner's keys).
    "host_lookup_span_id": (sc.SPAN_HOST_LOOKUP, "span_id"),
    "host_lookup_start_ns": (sc.SPAN_HOST_LOOKUP, "start_ns"),
    "host_local_tokens": (sc.SPAN_HOST_LOOKUP, sc.HOST_LOCAL_TOKENS.key),
    "host_hit_tokens": (sc.SPAN_HOST_LOOKUP, sc.HOST_HIT_TOKENS.key),
    "host_accepted_tokens": (sc.SPAN_HOST_LOOKUP, sc.HOST_ACCEPTED_TOKENS.key),
    "host_hit_host_tokens": (sc.SPAN_HOST_LOOKUP, sc.HOST_HIT_HOST.key),
    "host_hit_p2p_tokens": (sc.SPAN_HOST_LOOKUP, sc.HOST_HIT_P2P.key),
    "host_lookup_prompt_tokens": (sc.SPAN_HOST_LOOKUP, sc.PROMPT_TOKENS.key),
    "host_load_span_id": (sc.SPAN_HOST_LOAD, "span_id"),
    "host_load_bytes": (sc.SPAN_HOST_LOAD, sc.HOST_BYTES.key),
    "host_load_blocks": (sc.SPAN_HOST_LOAD, sc.HOST_BLOCKS.key),
    "host_load_duration_s": (sc.SPAN_HOST_LOAD, sc.HOST_DURATION.key),
    "host_load_tier": (sc.SPAN_HOST_LOAD, sc.HOST_TIER.key),
    "host_copy_engine": (sc.SPAN_HOST_LOAD, sc.HOST_COPY_ENGINE.key),
    "host_save_span_id": (sc.SPAN_HOST_SAVE, "span_id"),
    "host_saved_tokens": (sc.SPAN_HOST_SAVE, sc.HOST_SAVED_TOKENS.key),
    "host_saved_blocks": (sc.SPAN_HOST_SAVE, sc.HOST_BLOCKS.key),
    "host_covers_response": (sc.SPAN_HOST_SAVE, sc.HOST_COVERS_RESPONSE.key),
    "host_save_incomplete": (sc.SPAN_HOST_SAVE, sc.HOST_SAVE_INCOMPLETE.key),
    "host_refused_blocks": (sc.SPAN_HOST_SAVE, sc.HOST_REFUSED_BLOCKS.key),
    "host_save_prompt_tokens": (sc.SPAN_HOST_SAVE, sc.HOST_PROMPT_TOKENS.key),
    "host_save_output_tokens": (sc.SPAN_HOST_SAVE, sc.HOST_OUTPUT_TOKENS.key),
    "host_save_end_ns": (sc.SPAN_HOST_SAVE, "end_ns"),
    "host_evict_span_id": (sc.SPAN_HOST_EVICT, "span_id"),
    "host_evicted_blocks": (sc.SPAN_HOST_EVICT, sc.HOST_BLOCKS.key),
    "host_evicted_age_s": (sc.SPAN_HOST_EVICT, sc.HOST_EVICTED_AGE_MAX.key),
    "host_evict_end_ns": (sc.SPAN_HOST_EVICT, "end_ns"),
    **{column: (sc.SPAN_PULL_DECISION, attribute.key)
       for column, attribute in sc.LINEAGE_FACTS.items()},
}

# Facts of turn k's KV that belong to turn k+1's diagnosis.
PREVIOUS_TURN_FIELDS = ("export_span_id", "export_tokens", "export_expires_at", "ttl_s",
                        "release_span_id", "release_reason", "release_end_ns",
                        "decode_request_id", "store_span_id", "store_action", "stream",
                        "proxy_instance", "turn_end_ns", "host_save_span_id",
                        "host_saved_tokens", "host_covers_response", "host_save_incomplete",
                        "host_refused_blocks", "host_save_prompt_tokens",
                        "host_save_output_tokens", "host_save_end_ns", "host_evict_span_id",
                        "host_evicted_blocks", "host_evicted_age_s", "host_evict_end_ns")
PREVIOUS_PREFIX = "prev_"


def vllm_roles(spans: pd.DataFrame) -> pd.DataFrame:
    """vLLM's request spans renamed by role. Every engine names its span alike; the role
    comes from ``service.name`` when it says prefill or decode, else from the trace: the
    turn's last vLLM span is D's (the proxy calls P first, D last), earlier ones P's."""
    vllm = spans["name"] == sc.VLLM_REQUEST_SPAN
    if not vllm.any():
        return spans
    rows = spans[vllm]
    service = rows["service"].astype("string").str.lower() if "service" in rows else \
        pd.Series(pd.NA, index=rows.index, dtype="string")
    last = rows["start_ns"] == rows.groupby("trace_id")["start_ns"].transform("max")
    decode = service.str.contains("decode").fillna(False) | (
        ~service.str.contains("prefill").fillna(False) & last)
    spans = spans.copy()
    spans.loc[rows.index, "name"] = decode.map(
        {True: sc.SPAN_VLLM_DECODE.name, False: sc.SPAN_VLLM_PREFILL.name})
    return spans


def _keyed(spans: pd.DataFrame) -> pd.DataFrame:
    """Spans with tenant/conversation/turn filled from their trace where the span lacks
    them."""
    frame = spans.rename(columns={sc.CONVERSATION_ID.key: "conversation_id",
                                  sc.TURN_INDEX.key: "turn",
                                  sc.TENANT_DIGEST.key: "tenant"})
    for key in KEYS:
        missing = frame[key].isna()
        if missing.any():
            tagged = frame.dropna(subset=[key]).drop_duplicates("trace_id")
            if tagged.empty:
                continue
            by_trace = tagged.set_index("trace_id")[key]
            frame.loc[missing, key] = frame.loc[missing, "trace_id"].map(by_trace)
    frame["tenant"] = frame["tenant"].fillna(UNKNOWN_TENANT)
    return frame.dropna(subset=KEYS)


def turns_from_spans(spans: pd.DataFrame) -> pd.DataFrame:
    """One row per (tenant, conversation_id, turn), columns ``KEYS + TURN_FIELDS`` +
    derived."""
    frame = _keyed(lineage.link(vllm_roles(spans))).sort_values("start_ns", kind="stable")
    turns = frame[KEYS].drop_duplicates().set_index(KEYS)
    for span_name in {span for span, _ in TURN_FIELDS.values()}:
        columns = {column: source for column, (span, source) in TURN_FIELDS.items()
                   if span is span_name}
        rows = frame[frame["name"] == span_name.name]
        # The first span of a name in a turn is the one with the proxy's params; a
        # fallback retry's second decision must not overwrite it.
        first = rows.groupby(KEYS, sort=False)[list(columns.values())].first()
        first.columns = list(columns)
        turns = turns.join(first, how="left")
        if span_name is sc.SPAN_PULL_DECISION:
            turns = turns.join(rows.groupby(KEYS).size().rename("decision_count"), how="left")
        if span_name is sc.SPAN_RECOMPUTE:
            total = rows.groupby(KEYS)[sc.RECOMPUTED_TOKENS.key].sum(min_count=1)
            turns["recomputed_tokens"] = total.reindex(turns.index)
    turns = turns.reset_index()
    turns["turn"] = turns["turn"].astype("int64")
    turns = turns.sort_values(KEYS, kind="stable").reset_index(drop=True)
    return _derive(turns)


def _derive(turns: pd.DataFrame) -> pd.DataFrame:
    by_conversation = turns.groupby(CONVERSATION_KEYS, sort=False)
    previous_end = by_conversation["turn_end_ns"].shift(1)
    previous_turn = by_conversation["turn"].shift(1)
    consecutive = previous_turn == turns["turn"] - 1
    turns["gap_s"] = ((turns["turn_start_ns"] - previous_end) / 1e9).where(consecutive)
    for column in PREVIOUS_TURN_FIELDS:
        shifted = by_conversation[column].shift(1)
        turns[PREVIOUS_PREFIX + column] = shifted.where(consecutive)
    return turns
