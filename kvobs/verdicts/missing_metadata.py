"""missing-metadata: a later turn, but P got no usable params.

What it means: the request had no conversation id, the proxy had no entry for it
(restart without shared state, another replica, entry evicted, D's params not captured
from a streaming response), or the params that reached P lacked required fields.
What to do: send ``conversation_id`` (or ``X-Session-ID``); run proxies on the Redis
backend; check ``kvobs_proxy_stores_total`` for streaming responses.
"""

from kvobs import semconv as sc
from kvobs.semconv import LookupOutcome, PullDecision, Verdict
from kvobs.verdicts._base import Context, Finding, Turn

VERDICT = Verdict.MISSING_METADATA

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


def check(turn: Turn, context: Context) -> Finding | None:
    lookup = turn.require("lookup", sc.SPAN_PROXY_LOOKUP)
    evidence = turn.pick("lookup_span_id", "lookup", "gap_s", "decision_span_id", "decision")
    if lookup in (LookupOutcome.NO_ID.value, LookupOutcome.MISS.value):
        return Finding(VERDICT, _REMEDIES[lookup], evidence)
    decision = turn.get("decision")
    if (lookup == LookupOutcome.HIT.value and turn.get("params_sent")
            and decision in (PullDecision.INVALID.value, PullDecision.NO_PARAMS.value)):
        return Finding(VERDICT, _REMEDIES[decision], evidence)
    return None
