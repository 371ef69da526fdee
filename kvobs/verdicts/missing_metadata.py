"""missing-metadata: a later turn, but P got no usable params.

What it means: the request had no conversation id, the proxy had no entry for it
(restart without shared state, another replica, entry evicted, D's params not captured
from a streaming response), or the params that reached P lacked required fields.
What to do: send ``conversation_id`` (or ``X-Session-ID``); run proxies on the Redis
backend; check ``kvobs_proxy_stores_total`` for streaming responses.
"""

from kvobs import semconv as sc
from kvobs.semconv import LookupOutcome, PullDecision, Verdict
from kvobs import columns as col
from kvobs.verdicts._base import Context, Finding, Needs, Turn

VERDICT = Verdict.MISSING_METADATA
_NO_ENTRY = (LookupOutcome.NO_ID.value, LookupOutcome.MISS.value)
_LOST = (PullDecision.INVALID.value, PullDecision.NO_PARAMS.value)

_REMEDIES = {
    LookupOutcome.NO_ID.value: "Request carried no conversation id: send `conversation_id` "
                               "in the body or an X-Session-ID header.",
    LookupOutcome.MISS.value: "Proxy had no entry for this conversation (restart, other "
                              "replica, eviction or params not captured): use the Redis "
                              "backend and check kvobs_proxy_stores_total.",
    PullDecision.INVALID.value: "Params reached P without required fields: check the "
                                "proxy and D versions agree on kv_transfer_params.",
    PullDecision.NO_PARAMS.value: "Proxy sent params but P saw none: check what strips "
                                  "kv_transfer_params between proxy and P.",
}


def missing(turns, context: Context):
    return [Needs(col.null(turns, "lookup"), "lookup", sc.SPAN_PROXY_LOOKUP)]


def applies(turns, context: Context):
    lost = (col.eq(turns, "lookup", LookupOutcome.HIT.value) & col.flag(turns, "params_sent")
            & col.isin(turns, "decision", _LOST))
    return col.isin(turns, "lookup", _NO_ENTRY) | lost


def explain(turn: Turn, context: Context) -> Finding:
    lookup = turn.get("lookup")
    cause = lookup if lookup in _NO_ENTRY else turn.get("decision")
    return Finding(VERDICT, _REMEDIES[cause], turn.pick(
        "lookup_span_id", "lookup", "gap_s", "decision_span_id", "decision"))
