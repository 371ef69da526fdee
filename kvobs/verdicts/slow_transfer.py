"""slow-transfer: the read succeeded but cost more than recomputing would have.

What it means: the read's time in flight exceeded ``slow_transfer_factor x M / prefill
rate`` (the rate measured from the diagnosed turns that computed without reading; the
factor keeps the rate's own spread from turning a break-even read into a fault), or broke
the read-latency SLO. Time in flight is the read's duration less what P's worker did not
watch at its end (``read_unobserved_s``: a completion is seen only when the worker polls,
after each model step, so a long prefill step of other requests can hold a 4 ms read for a
second): a read held by P's own compute is not the link's fault.
What to do: check the P<->D link (``vllm:kvobs_remote_read_duration_seconds``); raise
``kv_recompute_threshold`` to the break-even point ``kvobs tune`` reports.
"""

import numpy as np

from kvobs import semconv as sc
from kvobs.semconv import ReadOutcome, Verdict
from kvobs.turns import columns as col
from kvobs.verdicts._base import Context, Finding, Needs, Turn

VERDICT = Verdict.SLOW_TRANSFER


def _done(turns):
    return col.eq(turns, "read_outcome", ReadOutcome.DONE.value)


def missing(turns, context: Context):
    return [
        Needs(_done(turns) & col.null(turns, "read_duration_s"), "read_duration_s", sc.SPAN_READ)
    ]


def recompute_estimate_s(turns, context: Context) -> np.ndarray:
    """Seconds P would have needed to compute the M tokens it read (NaN: unknown)."""
    tokens = col.num(turns, "candidate_tokens")
    if not context.prefill_tokens_per_s:
        return np.full(len(turns), np.nan)
    return np.where(tokens > 0, tokens / context.prefill_tokens_per_s, np.nan)


def in_flight_s(turns) -> np.ndarray:
    """Seconds the read is known to have been in flight (NaN: no duration)."""
    return col.num(turns, "read_duration_s") - np.nan_to_num(
        col.num(turns, "read_unobserved_s"), nan=0.0
    )


def applies(turns, context: Context):
    duration = in_flight_s(turns)
    # NaN compares False: no estimate, no "slower".
    slower = duration > context.slow_transfer_factor * recompute_estimate_s(turns, context)
    over_slo = duration > context.read_slo_s if context.read_slo_s is not None else col.none(turns)
    return _done(turns) & (slower | over_slo)


def explain(turn: Turn, context: Context) -> Finding:
    tokens = turn.get("candidate_tokens")
    estimate = (
        tokens / context.prefill_tokens_per_s if tokens and context.prefill_tokens_per_s else None
    )
    evidence = turn.pick(
        "read_span_id", "read_duration_s", "read_unobserved_s", "read_bytes", "candidate_tokens"
    )
    evidence.update(
        recompute_estimate_s=estimate,
        read_slo_s=context.read_slo_s,
        prefill_tokens_per_s=context.prefill_tokens_per_s,
        slow_transfer_factor=context.slow_transfer_factor,
    )
    return Finding(
        VERDICT,
        "Read cost more than recomputing: check the P<->D link; raise "
        "kv_recompute_threshold to the break-even from `kvobs tune`.",
        evidence,
    )
