"""remote-hit: P read D's KV and it paid off.

What it means: the feature worked: M tokens came over NIXL instead of being recomputed.
What to do: nothing.
"""

from kvobs import semconv as sc
from kvobs.semconv import PullDecision, ReadOutcome, Verdict
from kvobs.verdicts import _columns as col
from kvobs.verdicts._base import Context, Finding, Needs, Turn

VERDICT = Verdict.REMOTE_HIT


def missing(turns, context: Context):
    pulled = col.eq(turns, "decision", PullDecision.PULL.value)
    return [Needs(pulled & col.null(turns, "read_outcome"), "read_outcome", sc.SPAN_READ)]


def applies(turns, context: Context):
    return col.eq(turns, "read_outcome", ReadOutcome.DONE.value)


def explain(turn: Turn, context: Context) -> Finding:
    return Finding(VERDICT, "Remote KV read paid off.",
                   turn.pick("read_span_id", "read_bytes", "read_blocks", "read_duration_s",
                             "candidate_tokens", "remaining_ttl_s", "ttft_s"))
