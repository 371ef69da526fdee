"""transfer-failed: a read started and failed, or never came, or D restarted under it.

What it means: the NIXL read errored (handshake, invalid blocks, transport), P's request
waited for remote KV that was never going to arrive, or the D engine that held the KV
restarted since it exported it (a new engine id at the same side channel): its blocks
died with it, whether P's read then failed or was declined.
What to do: check ``vllm:nixl_num_failed_transfers`` and P's log around the span's time;
check P and D agree on ``bidirectional_kv_xfer``; enable the connector's stuck-wait fix.
After a D restart: nothing to fix in the link; one recompute per conversation is the
cost of the restart.
"""

from kvobs.semconv import FallbackReason, LookupOutcome, ReadOutcome, Verdict
from kvobs.turns import columns as col
from kvobs.verdicts import _export
from kvobs.verdicts._base import Context, Finding, Turn

VERDICT = Verdict.TRANSFER_FAILED


def applies(turns, context: Context):
    lost_to_restart = _export.restarted(turns) & (
        col.isin(
            turns, "read_outcome", (ReadOutcome.FAILED.value, ReadOutcome.DECLINED_EXPIRED.value)
        )
        | col.present(turns, "fallback_reason")
        | col.eq(turns, "lookup", LookupOutcome.STALE.value)
        | _export.unrouted(turns)
    )
    return (
        col.eq(turns, "read_outcome", ReadOutcome.FAILED.value)
        | col.eq(turns, "fallback_reason", FallbackReason.READ_FAILED.value)
        | col.present(turns, "stuck_span_id")
        | lost_to_restart
    )


def explain(turn: Turn, context: Context) -> Finding:
    restarted = turn.get("extends_engine_restarted_at")
    if restarted is not None:
        return Finding(
            VERDICT,
            (
                f"D restarted after it exported this history's KV: engine "
                f"{turn.get('extends_engine_id')} at {turn.get('extends_endpoint')} was replaced "
                f"by a new engine {restarted - (turn.get('extends_exported_at') or restarted):.1f}s"
                " after the export, and its blocks went with it. Nothing to fix between P and "
                "D; expect one recompute per conversation after a D restart."
            ),
            turn.pick(
                "read_span_id",
                "read_outcome",
                "read_error",
                "fallback_span_id",
                "fallback_reason",
                "lookup",
                "remote_tokens",
                *_export.EVIDENCE,
            ),
        )
    stuck = turn.get("stuck_span_id") is not None
    what = "waited for remote KV that never came" if stuck else "remote read failed"
    return Finding(
        VERDICT,
        f"P {what}: check NIXL/UCX health between P and D and P's log at this time.",
        turn.pick(
            "read_span_id",
            "read_outcome",
            "read_error",
            "fallback_span_id",
            "fallback_reason",
            "stuck_span_id",
            "candidate_tokens",
        ),
    )
