"""missing-metadata: a later turn, but P got no usable params.

What it means: the request had no conversation id, the proxy had no entry for it
(never stored: a streamed turn whose D params never reached the proxy; evicted by the
entry cap; lost with a proxy restart or kept by another replica), the params that reached
P lacked required fields, or another router sent the turn without D's params although
the prompt extends KV that D still held (``kvobs.turns.lineage`` names that export) and P would
have read it (M at or above ``kv_recompute_threshold``; below it, or nothing beyond P's
own cache, the turn is below-threshold or local-hit).
What to do: what the cause says: send ``conversation_id`` (or leave the proxy's
conversation inference on); run proxies on the Redis backend; raise the entry cap; route
through ``kvobs proxy`` or a router that forwards D's ``kv_transfer_params`` to P.
"""

from kvobs import semconv as sc
from kvobs.semconv import LookupOutcome, MissReason, PullDecision, Verdict
from kvobs.turns import columns as col
from kvobs.verdicts import _export
from kvobs.verdicts._base import Context, Finding, Needs, Turn

VERDICT = Verdict.MISSING_METADATA
_NO_ENTRY = (LookupOutcome.NO_ID.value, LookupOutcome.MISS.value)


def missing(turns, context: Context):
    # Without a proxy lookup, P's own decision (params arrived) or a lineage link tells
    # what happened; with neither, the lookup is the evidence this rule needs. When the
    # proxy's turn span shows the proxy served the turn, its lookup is needed whatever
    # lineage says: its absence is a lost span, not another router.
    params_arrived = col.present(turns, "decision") & ~col.isin(turns, "decision", _export.LOST)
    lookup_lost = (
        col.null(turns, "lookup")
        & ~params_arrived
        & (col.null(turns, "extends_request_id") | col.present(turns, "turn_span_id"))
    )
    # After a fallback P decided twice: first with the proxy's params, then on the retry
    # without them. A lone no-params decision is then the retry's; the first attempt's
    # decision, which says whether the params arrived, is the span missing.
    retry_only = (
        col.present(turns, "fallback_span_id")
        & (col.num(turns, "decision_count") < 2)
        & col.isin(turns, "decision", _export.LOST)
    )
    # Neither the proxy's lookup nor P's decision: without P's decision nothing says
    # whether params arrived (the turn's row comes from its other spans; kvobs.turns.lineage).
    blind = col.null(turns, "lookup") & col.null(turns, "decision")
    return [
        Needs(blind, "decision", sc.SPAN_PULL_DECISION),
        Needs(lookup_lost, "lookup", sc.SPAN_PROXY_LOOKUP),
        Needs(retry_only, "decision", sc.SPAN_PULL_DECISION),
    ]


def applies(turns, context: Context):
    lost = (
        col.eq(turns, "lookup", LookupOutcome.HIT.value)
        & col.flag(turns, "params_sent")
        & col.isin(turns, "decision", _export.LOST)
    )
    # Behind another router, only a read P would have made counts: a prompt that adds
    # fewer than kv_recompute_threshold tokens to P's own cache was recomputed by design.
    router = _export.unrouted_live(turns) & _export.worth_reading(turns)
    return col.isin(turns, "lookup", _NO_ENTRY) | lost | router


def _held(turn: Turn) -> str:
    return f" ({_export.named(turn)})" if turn.get("extends_request_id") else ""


def _never_seen(turn: Turn) -> str:
    before, now = turn.get("prev_proxy_instance"), turn.get("proxy_instance")
    if before is None or now is None or before == now:
        return (
            "The proxy never saw this conversation's earlier turns: check that every "
            "turn goes through a proxy sharing one store (--store redis)."
        )
    started, ended = turn.get("proxy_started_at"), turn.get("prev_turn_end_ns")
    if started is not None and ended is not None and started * 1e9 > ended:
        return (
            "The proxy restarted since the previous turn and its entries did not "
            "survive: run it with --store redis so they do."
        )
    return (
        "Another proxy replica served the previous turn and they share no store: run "
        "every replica on one --store redis."
    )


def _not_stored(turn: Turn) -> str:
    if turn.get("prev_stream"):
        return (
            "The previous turn was streamed and D's params never reached the proxy (not "
            "in the stream, and not published to Redis by D): check that D's connector "
            "has kvobs_params_redis_url set and D can reach Redis; see the previous "
            "turn's store span."
        )
    return (
        "The previous turn stored no params (D returned none usable: no retained "
        "blocks or no expiry): see the previous turn's store span and D's TTL."
    )


_ANONYMOUS = (
    "The request carried no API key, and the proxy isolates anonymous clients "
    "(--anonymous-tenant isolated, the default: any of them could send this "
    "id), so nothing was looked up or stored: send an API key; behind a gateway "
    "that authenticates, run the proxy with --trusted-tenant-header <its tenant "
    "header>; on a trusted network, --anonymous-tenant shared. "
    "kvobs_proxy_anonymous_turns_total counts such turns."
)

_MISS = {
    MissReason.NEVER_SEEN.value: _never_seen,
    MissReason.NOT_STORED.value: _not_stored,
    MissReason.EVICTED.value: lambda turn: (
        "The proxy's entry cap evicted this conversation before its next turn: raise "
        "--max-entries (or the tenant's quota, --max-entries-per-tenant)."
    ),
    MissReason.ANONYMOUS.value: lambda turn: _ANONYMOUS,
    MissReason.TENANT_LIMITED.value: lambda turn: (
        "The proxy had admitted --max-new-tenants new tenants in this window already "
        "(its bound against invented API keys), so this tenant's turn went without "
        "reuse: raise --max-new-tenants (or --new-tenant-window) if real tenants "
        "arrive this fast; see kvobs_proxy_tenant_limited_turns_total."
    ),
    MissReason.STORE_UNAVAILABLE.value: lambda turn: (
        "The proxy's metadata store gave no answer within the turn's budget (or its "
        "circuit breaker was open): see kvobs_proxy_store_degraded_total and the "
        "store's health."
    ),
}


def _remedy(turn: Turn) -> str:
    lookup, decision = turn.get("lookup"), turn.get("decision")
    if lookup is None:
        return (
            f"The router did not forward D's params to P, though D still held this "
            f"history's KV{_held(turn)}: route through kvobs proxy, or a router that "
            "passes D's kv_transfer_params to P on the next turn."
        )
    if lookup == LookupOutcome.NO_ID.value:
        if turn.get("lookup_miss_reason") == MissReason.ANONYMOUS.value:
            return _ANONYMOUS + _held(turn)
        return (
            f"Request carried no conversation id and the proxy found none it continues"
            f"{_held(turn)}: send `conversation_id` (or X-Session-ID), or keep the "
            "proxy's conversation inference on."
        )
    if lookup == LookupOutcome.MISS.value:
        reason = _MISS.get(turn.get("lookup_miss_reason"))
        text = (
            reason(turn)
            if reason
            else (
                "The proxy had no entry for this conversation (restart, another replica, "
                "eviction or params not captured): see kvobs_proxy_stores_total."
            )
        )
        return text + _held(turn)
    if decision == PullDecision.INVALID.value:
        return (
            "Params reached P without required fields: check the proxy and D versions "
            "agree on kv_transfer_params."
        )
    return (
        "Proxy sent params but P saw none: check what strips kv_transfer_params between "
        "proxy and P."
    )


def explain(turn: Turn, context: Context) -> Finding:
    return Finding(
        VERDICT,
        _remedy(turn),
        turn.pick(
            "lookup_span_id",
            "lookup",
            "lookup_miss_reason",
            "gap_s",
            "decision_span_id",
            "decision",
            "prev_store_span_id",
            "prev_store_action",
            "proxy_instance",
            "prev_proxy_instance",
            *_export.EVIDENCE,
        ),
    )
