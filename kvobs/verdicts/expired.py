"""expired: params were present but D's blocks were past their TTL at read time.

What it means: the gap between turns outlived ``decoder_kv_blocks_ttl`` (fixed from the
end of the previous turn, not renewed), so P declined the read (it declines within a few
seconds of D's expiry) or the proxy judged its entry stale, or D had already released
the blocks.
What to do: if such gaps are common, raise ``decoder_kv_blocks_ttl`` (weigh the memory
held: ``vllm:kvobs_retained_block_seconds_total``); keep the proxy's entry lifetime below
it; set ``kv_load_failure_policy`` so a declined read recomputes instead of failing.
"""

from kvobs.semconv import FallbackReason, LookupOutcome, ReadOutcome, ReleaseReason, Verdict
from kvobs import columns as col
from kvobs.verdicts._base import Context, Finding, Turn

VERDICT = Verdict.EXPIRED


def applies(turns, context: Context):
    released_before = (turns["prev_release_end_ns"].astype("Int64")
                       <= turns["turn_start_ns"].astype("Int64")).fillna(False).to_numpy(bool)
    released = col.eq(turns, "prev_release_reason", ReleaseReason.EXPIRED.value) & released_before
    return (col.eq(turns, "read_outcome", ReadOutcome.DECLINED_EXPIRED.value)
            | col.eq(turns, "fallback_reason", FallbackReason.READ_DECLINED.value)
            | col.eq(turns, "lookup", LookupOutcome.STALE.value) | released)


def _remedy(turn: Turn) -> str:
    gap, ttl = turn.get("gap_s"), turn.get("prev_ttl_s")
    if gap is not None and ttl is not None:
        return (f"Gap {gap:.1f}s outlived D's TTL {ttl:.0f}s: raise decoder_kv_blocks_ttl "
                "if such gaps are common (costs retained memory).")
    return "D's blocks expired before the read: raise decoder_kv_blocks_ttl if gaps are long."


def explain(turn: Turn, context: Context) -> Finding:
    return Finding(VERDICT, _remedy(turn), turn.pick(
        "gap_s", "prev_ttl_s", "remaining_ttl_s", "entry_age_s", "entry_remaining_ttl_s",
        "read_span_id", "read_outcome", "fallback_span_id", "fallback_reason", "lookup",
        "lookup_span_id", "prev_release_span_id", "prev_release_reason"))
