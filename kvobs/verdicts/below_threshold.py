"""below-threshold: ``0 < M < kv_recompute_threshold``, recomputed by design.

What it means: the reusable remainder was too small to be worth a read.
What to do: nothing unless ``kvobs tune`` shows reads of this size pay off; then lower
``kv_recompute_threshold``.
"""

from kvobs import semconv as sc
from kvobs.semconv import PullDecision, Verdict
from kvobs.turns import columns as col
from kvobs.verdicts import _export
from kvobs.verdicts._base import Context, Finding, Needs, Turn

VERDICT = Verdict.BELOW_THRESHOLD


def missing(turns, context: Context):
    return [Needs(col.null(turns, "decision"), "decision", sc.SPAN_PULL_DECISION)]


def applies(turns, context: Context):
    # Behind another router P never had params to decide with; the export its prompt
    # extends says what it would have decided (``_export.worth_reading``).
    router = (
        _export.unrouted_live(turns)
        & ~_export.worth_reading(turns)
        & (_export.router_candidate(turns) > 0)
    )
    return col.eq(turns, "decision", PullDecision.BELOW_THRESHOLD.value) | router


def explain(turn: Turn, context: Context) -> Finding:
    return Finding(
        VERDICT,
        "Remote remainder below kv_recompute_threshold: recomputed by "
        "design; see `kvobs tune` before lowering the threshold.",
        turn.pick(
            "decision_span_id",
            "prompt_tokens",
            "local_hit_tokens",
            "remote_tokens",
            "candidate_tokens",
            "threshold",
            "extends_request_id",
            "extends_verified_tokens",
        ),
    )
