"""transfer-failed: a read started and failed, or never came.

What it means: the NIXL read errored (handshake, invalid blocks, transport), or P's
request waited for remote KV that was never going to arrive.
What to do: check ``vllm:nixl_num_failed_transfers`` and P's log around the span's time;
check P and D agree on ``bidirectional_kv_xfer``; enable the connector's stuck-wait fix.
"""

from kvobs.semconv import FallbackReason, ReadOutcome, Verdict
from kvobs import columns as col
from kvobs.verdicts._base import Context, Finding, Turn

VERDICT = Verdict.TRANSFER_FAILED


def applies(turns, context: Context):
    return (col.eq(turns, "read_outcome", ReadOutcome.FAILED.value)
            | col.eq(turns, "fallback_reason", FallbackReason.READ_FAILED.value)
            | col.present(turns, "stuck_span_id"))


def explain(turn: Turn, context: Context) -> Finding:
    stuck = turn.get("stuck_span_id") is not None
    what = "waited for remote KV that never came" if stuck else "remote read failed"
    return Finding(VERDICT, f"P {what}: check NIXL/UCX health between P and D and "
                            "P's log at this time.",
                   turn.pick("read_span_id", "read_outcome", "read_error", "fallback_span_id",
                             "fallback_reason", "stuck_span_id", "candidate_tokens"))
