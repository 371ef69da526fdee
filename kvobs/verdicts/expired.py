"""expired: params were present but D's blocks were past their TTL at read time.

What it means: the gap between turns outlived ``decoder_kv_blocks_ttl`` (fixed from the
end of the previous turn, not renewed), so P declined the read (it declines within a few
seconds of D's expiry) or the proxy judged its entry stale, or D had already released
the blocks.
What to do: if such gaps are common, raise ``decoder_kv_blocks_ttl`` (weigh the memory
held: ``vllm:kvobs_retained_block_seconds_total``); keep the proxy's entry lifetime below
it; set ``kv_load_failure_policy`` so a declined read recomputes instead of failing.
"""

from kvobs import semconv as sc
from kvobs.semconv import FallbackReason, LookupOutcome, ReadOutcome, ReleaseReason, Verdict
from kvobs.settings import PROXY_EXPIRY_MARGIN
from kvobs.turns import columns as col
from kvobs.verdicts import _export
from kvobs.verdicts._base import Context, Finding, Needs, Turn

VERDICT = Verdict.EXPIRED


def _released(turns):
    """D released the blocks by expiry before this turn began."""
    released_before = col.num(turns, "prev_release_end_ns") <= col.num(turns, "turn_start_ns")
    return col.eq(turns, "prev_release_reason", ReleaseReason.EXPIRED.value) & released_before


def _refused(turns):
    """P declined the read, or the proxy judged its entry stale, or no router sent the
    params of an export D no longer held."""
    lapsed = _export.unrouted(turns) & ~col.flag(turns, "extends_live")
    return (
        col.eq(turns, "read_outcome", ReadOutcome.DECLINED_EXPIRED.value)
        | col.eq(turns, "fallback_reason", FallbackReason.READ_DECLINED.value)
        | col.eq(turns, "lookup", LookupOutcome.STALE.value)
        | lapsed
    )


def missing(turns, context: Context):
    # A refusal is expiry only if D did not restart since the export (then it is
    # transfer-failed); the restart is known from the lineage facts P's decision span
    # carries, linked to D's export span, so without either it cannot be ruled out.
    # The proxy sent params only if D exported (it stores D's answer), so a sent
    # turn whose previous export is absent lost that span. D's own expiry release
    # needs no such check.
    unexplained = _refused(turns) & ~_released(turns)
    return [
        Needs(unexplained & col.null(turns, "decision"), "decision", sc.SPAN_PULL_DECISION),
        Needs(
            unexplained
            & ~_export.restarted(turns)
            & col.flag(turns, "params_sent")
            & col.null(turns, "prev_export_tokens"),
            "prev_export_tokens",
            sc.SPAN_EXPORT,
        ),
    ]


def applies(turns, context: Context):
    # A D restart since the export took the blocks whatever the clock said: that turn is
    # transfer-failed, named as a restart, however long the restart took.
    return (_refused(turns) | _released(turns)) & ~_export.restarted(turns)


def _d_left_s(turn: Turn) -> float | None:
    """Seconds D's blocks still had when this turn began, from lineage or the previous
    turn's export."""
    if turn.get("extends_live"):
        return turn.get("extends_ttl_left_s")
    expires, start = turn.get("prev_export_expires_at"), turn.get("turn_start_ns")
    released, reason = turn.get("prev_release_end_ns"), turn.get("prev_release_reason")
    if expires is None or start is None or expires * 1e9 <= start:
        return None
    if released is not None and released <= start and reason == ReleaseReason.EXPIRED.value:
        return None
    return expires - start / 1e9


def _remedy(turn: Turn) -> str:
    if turn.get("lookup") is None and turn.get("extends_request_id"):
        return (
            f"The history extends earlier KV, but it was gone when this turn came "
            f"({_export.named(turn)}): raise decoder_kv_blocks_ttl if such gaps are "
            "common (costs retained memory)."
        )
    left = _d_left_s(turn)
    if turn.get("lookup") == LookupOutcome.STALE.value and left is not None and left > 0:
        return (
            f"The proxy dropped its entry while D still held the blocks for {left:.1f}s "
            "more: its entry ends --expiry-margin seconds (default "
            f"{PROXY_EXPIRY_MARGIN.default:g}) before D's "
            "expiry. Lower --expiry-margin (it must stay above P's decline window) or "
            "raise decoder_kv_blocks_ttl."
        )
    gap, ttl = turn.get("gap_s"), turn.get("prev_ttl_s")
    if gap is not None and ttl is not None:
        return (
            f"Gap {gap:.1f}s outlived D's TTL {ttl:.0f}s: raise decoder_kv_blocks_ttl "
            "if such gaps are common (costs retained memory)."
        )
    return "D's blocks expired before the read: raise decoder_kv_blocks_ttl if gaps are long."


def explain(turn: Turn, context: Context) -> Finding:
    return Finding(
        VERDICT,
        _remedy(turn),
        turn.pick(
            "gap_s",
            "prev_ttl_s",
            "remaining_ttl_s",
            "entry_age_s",
            "entry_remaining_ttl_s",
            "read_span_id",
            "read_outcome",
            "fallback_span_id",
            "fallback_reason",
            "lookup",
            "lookup_span_id",
            "prev_release_span_id",
            "prev_release_reason",
            "prev_export_expires_at",
            *_export.EVIDENCE,
        ),
    )
