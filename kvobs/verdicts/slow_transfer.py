"""slow-transfer: the read succeeded but cost more than recomputing would have.

What it means: read time exceeded ``M / prefill rate`` (the rate measured from this
source's turns that computed without reading), or broke the read-latency SLO.
What to do: check the P<->D link (``vllm:kvobs_remote_read_duration_seconds``); raise
``kv_recompute_threshold`` to the break-even point ``kvobs tune`` reports.
"""

from kvobs import semconv as sc
from kvobs.semconv import ReadOutcome, Verdict
from kvobs.verdicts._base import Context, Finding, Turn

VERDICT = Verdict.SLOW_TRANSFER


def recompute_estimate_s(turn: Turn, context: Context) -> float | None:
    tokens = turn.get("candidate_tokens")
    if not tokens or not context.prefill_tokens_per_s:
        return None
    return tokens / context.prefill_tokens_per_s


def check(turn: Turn, context: Context) -> Finding | None:
    if turn.get("read_outcome") != ReadOutcome.DONE.value:
        return None
    duration = turn.require("read_duration_s", sc.SPAN_READ)
    estimate = recompute_estimate_s(turn, context)
    slower = estimate is not None and duration > estimate
    over_slo = context.read_slo_s is not None and duration > context.read_slo_s
    if not (slower or over_slo):
        return None
    evidence = turn.pick("read_span_id", "read_duration_s", "read_bytes", "candidate_tokens")
    evidence.update(recompute_estimate_s=estimate, read_slo_s=context.read_slo_s,
                    prefill_tokens_per_s=context.prefill_tokens_per_s)
    return Finding(VERDICT, "Read cost more than recomputing: check the P<->D link; raise "
                            "kv_recompute_threshold to the break-even from `kvobs tune`.",
                   evidence)
