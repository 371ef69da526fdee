"""Compare what a scenario expected with what kvobs diagnosed, turn by turn.

Turns are matched through the trace id the proxy returned to the client, so a turn sent
without a conversation id (diagnosed as ``anonymous:<trace id>``) is still found.
"""

from __future__ import annotations

from kvobs.diagnose import TurnDiagnosis, all_turns
from kvobs.sources import SpanSource
from kvobs.testbed.runner import TurnResult

NOT_FOUND = "not-found"


def diagnosed_turns(
    source: SpanSource, results: list[TurnResult]
) -> dict[tuple[str, int], TurnDiagnosis | None]:
    by_trace = {d.turn.get("trace_id"): d for d in all_turns(source)}
    return {(r.label, r.turn): by_trace.get(r.trace_id) for r in results}


def mismatches(
    expectations: dict[tuple[str, int], str], diagnosed: dict[tuple[str, int], TurnDiagnosis | None]
) -> list[str]:
    lines = []
    for key, expected in sorted(expectations.items()):
        found = diagnosed.get(key)
        got = found.finding.verdict.value if found is not None else NOT_FOUND
        if got != expected:
            lines.append(f"{key[0]} turn {key[1]}: expected {expected}, got {got}")
    return lines


def cause_mismatches(
    expectations: dict[tuple[str, int], str | tuple[str, ...]],
    diagnosed: dict[tuple[str, int], TurnDiagnosis | None],
) -> list[str]:
    """Turns where kvobs diagnosed none of the latency causes the scenario expects."""
    lines = []
    for key, expected in sorted(expectations.items()):
        wanted = (expected,) if isinstance(expected, str) else expected
        found = diagnosed.get(key)
        got = [c.cause.value for c in found.causes] if found is not None else [NOT_FOUND]
        if not set(wanted) & set(got):
            # what each cause was found on, so that a miss on a loaded box can be told
            # from a wrong rule without rerunning it
            seen = (
                [f"{c.cause.value} {c.seconds:.3f} s {c.evidence}" for c in found.causes]
                if found is not None
                else []
            )
            lines.append(
                f"{key[0]} turn {key[1]}: expected cause {' or '.join(wanted)}, "
                f"got {', '.join(got) or 'none'}" + (f" ({'; '.join(seen)})" if seen else "")
            )
    return lines


def tolerance_s(seconds: float) -> float:
    """How far accounted time may stray from what the client measured: max(10 %, 5 ms)
    (the client's own connect and parse sit outside the proxy's span)."""
    return max(0.1 * seconds, 0.005)


def accounting_errors(
    results: list[TurnResult], diagnosed: dict[tuple[str, int], TurnDiagnosis | None]
) -> list[str]:
    """Answered turns whose phases do not add up to what the client measured: the whole
    latency, and for streamed turns the TTFT (phases before the first token)."""
    lines = []
    for result in results:
        found = diagnosed.get((result.label, result.turn))
        if not result.ok or found is None:
            continue
        timeline = found.timeline
        where = f"{result.label} turn {result.turn}"
        total = sum(timeline.phases.values())
        if abs(total - result.latency_s) > tolerance_s(result.latency_s):
            lines.append(
                f"{where}: phases add up to {total:.4f} s, client saw {result.latency_s:.4f} s"
            )
        if result.ttft_s is not None and (
            timeline.ttft_s is None
            or abs(timeline.ttft_s - result.ttft_s) > tolerance_s(result.ttft_s)
        ):
            lines.append(
                f"{where}: TTFT accounted {timeline.ttft_s} s, client saw {result.ttft_s:.4f} s"
            )
    return lines
