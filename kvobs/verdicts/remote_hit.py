"""remote-hit: P read D's KV and it paid off.

What it means: the feature worked: M tokens came over NIXL instead of being recomputed.
What to do: nothing.
"""

from kvobs import semconv as sc
from kvobs.semconv import PullDecision, ReadOutcome, Verdict
from kvobs.verdicts._base import Context, Finding, Turn

VERDICT = Verdict.REMOTE_HIT


def check(turn: Turn, context: Context) -> Finding | None:
    if turn.get("decision") == PullDecision.PULL.value:
        turn.require("read_outcome", sc.SPAN_READ)
    if turn.get("read_outcome") != ReadOutcome.DONE.value:
        return None
    return Finding(VERDICT, "Remote KV read paid off.",
                   turn.pick("read_span_id", "read_bytes", "read_blocks", "read_duration_s",
                             "candidate_tokens", "remaining_ttl_s", "ttft_s"))
