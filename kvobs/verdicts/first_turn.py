"""first-turn: nothing earlier to reuse.

What it means: turn 1 of a conversation always computes its whole prompt (P may still hit
its own prefix cache for a shared system prompt).
What to do: nothing; judge reuse on turns 2 and later.
"""

from kvobs import semconv as sc
from kvobs.turns import columns as col
from kvobs.semconv import LineageGap, Verdict
from kvobs.verdicts._base import Context, Finding, Needs, Turn

VERDICT = Verdict.FIRST_TURN


def missing(turns, context: Context):
    # Which turn this is, when the engines' chain says it and cannot say it for sure: it
    # extends an earlier turn whose D export is gone, or identical histories of several
    # conversations (kvobs.turns.lineage never guesses between them).
    # A turn 1 that only the chain numbered, without P's decision span (its prompt's
    # chain): nothing says it extends no earlier turn.
    blind = col.null(turns, "decision") & (col.num(turns, "turn") == 1)
    blind = col.startswith(
        turns, "conversation_id", (sc.LINEAGE_PREFIX, sc.ANONYMOUS_PREFIX), blind
    )
    return [
        Needs(blind, "decision", sc.SPAN_PULL_DECISION),
        Needs(
            col.eq(turns, "lineage_gap", LineageGap.AMBIGUOUS.value),
            "lineage_candidates",
            sc.SPAN_EXPORT,
            reason=LineageGap.AMBIGUOUS.value,
        ),
        Needs(
            col.eq(turns, "lineage_gap", LineageGap.EXPORT_MISSING.value),
            "extends_request_id",
            sc.SPAN_EXPORT,
        ),
    ]


def applies(turns, context: Context):
    return col.num(turns, "turn") == 1


def explain(turn: Turn, context: Context) -> Finding:
    return Finding(
        VERDICT,
        "Nothing to reuse on turn 1; judge reuse from turn 2 on.",
        turn.pick("turn_span_id", "prompt_tokens", "local_hit_tokens", "ttft_s"),
    )
