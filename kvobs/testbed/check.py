"""Compare what a scenario expected with what kvobs diagnosed, turn by turn.

Turns are matched through the trace id the proxy returned to the client, so a turn sent
without a conversation id (diagnosed as ``anonymous:<trace id>``) is still found.
"""

from __future__ import annotations

from kvobs.diagnose import TurnDiagnosis, all_turns
from kvobs.sources import SpanSource
from kvobs.testbed.runner import TurnResult

NOT_FOUND = "not-found"


def diagnosed_turns(source: SpanSource,
                    results: list[TurnResult]) -> dict[tuple[str, int], TurnDiagnosis | None]:
    by_trace = {d.turn.get("trace_id"): d for d in all_turns(source)}
    return {(r.label, r.turn): by_trace.get(r.trace_id) for r in results}


def mismatches(expectations: dict[tuple[str, int], str],
               diagnosed: dict[tuple[str, int], TurnDiagnosis | None]) -> list[str]:
    lines = []
    for key, expected in sorted(expectations.items()):
        found = diagnosed.get(key)
        got = found.finding.verdict.value if found is not None else NOT_FOUND
        if got != expected:
            lines.append(f"{key[0]} turn {key[1]}: expected {expected}, got {got}")
    return lines
