"""local-hit: P's own prefix cache already covered the reusable range (M = 0, L > 0).

What it means: no read was needed; P had the blocks.
What to do: nothing.
"""

from kvobs.semconv import PullDecision, Verdict
from kvobs.turns import columns as col
from kvobs.verdicts import _export
from kvobs.verdicts._base import Context, Finding, Turn

VERDICT = Verdict.LOCAL_HIT


def applies(turns, context: Context):
    # Behind another router: the export the prompt extends held nothing beyond what P's
    # cache had (``_export.router_candidate``), so params would have changed nothing.
    router = (
        _export.unrouted_live(turns)
        & (_export.router_candidate(turns) <= 0)
        & (col.num(turns, "local_hit_tokens") > 0)
    )
    return col.eq(turns, "decision", PullDecision.LOCAL_HIT.value) | router


def explain(turn: Turn, context: Context) -> Finding:
    return Finding(
        VERDICT,
        "P's local prefix cache covered the reusable range; no read needed.",
        turn.pick(
            "decision_span_id",
            "prompt_tokens",
            "local_hit_tokens",
            "remote_tokens",
            "candidate_tokens",
            "extends_request_id",
            "extends_verified_tokens",
        ),
    )
