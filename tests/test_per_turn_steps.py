"""Two per-turn steps a pass runs for every turn it classifies (``timeline_of``,
``causes``) against their implementations before they were made cheaper (81973d6, copied
below as the reference): the same output on random turns, missing and not-applicable
marks, skew, NaN and ties between causes included."""

from __future__ import annotations

import math
import random
from typing import Any, Mapping

import numpy as np
import pytest

from kvobs.causes import (
    DOMINANT_SHARE,
    EXPLAIN,
    MIN_SECONDS,
    SHARE_OF,
    CauseContext,
    CauseFinding,
    _get,
    _PHASE_READS,
    causes,
    cause_of,
)
from kvobs.semconv import LatencyCause as LC
from kvobs.timeline import (
    _HEADLINE,
    _PHASE_NAMES,
    KNOWN,
    MARKS,
    MISSING,
    NOT_APPLICABLE,
    PHASES,
    SKEW_TOLERANCE_S,
    Marks,
    Timeline,
    _missing_reason,
    phase_column,
    timeline_of,
)


def _timeline_before(marks: Marks, row: int, turn: Mapping[str, Any]) -> Timeline:
    """The phases of one turn (``row`` of ``marks``; ``turn`` its row of the table
    ``add_timeline`` made, whose headline numbers it carries over), with merged phases
    named and why they could not be split."""
    # As Python numbers: a numpy scalar's comparison costs ~10 times a float's, and
    # the live classifier times every turn it classifies.
    value, status = marks.value[:, row].tolist(), marks.status[:, row].tolist()
    headline: dict[str, Any] = {name: turn.get(name) for name in _HEADLINE}
    out = Timeline(**headline)
    start = None
    pending: list[str] = []  # phases a missing mark keeps from being split
    gaps: list[str] = []  # why: the missing marks
    for i, phase in enumerate(_PHASE_NAMES):
        if status[i] == KNOWN and start is None:
            start = value[i]
        end = status[i + 1]
        if end == NOT_APPLICABLE:
            continue  # a step this turn did not take: no phase, the start carries on
        if start is None:  # before the first known mark: outside the measured latency
            out.unmeasured[phase] = _missing_reason(MARKS[i], turn)
            continue
        pending.append(phase)
        if end == MISSING:
            gaps.append(_missing_reason(MARKS[i + 1], turn))
            continue
        name = "+".join(pending)
        seconds = float(value[i + 1] - start)
        if len(pending) > 1:
            for merged in pending:
                out.unmeasured[merged] = f"measured only as {name}: " + "; ".join(gaps)
        if seconds < -SKEW_TOLERANCE_S:
            before, after = MARKS[i].span.service.value, MARKS[i + 1].span.service.value
            out.skew.append(
                f"{name}: {seconds * 1000:.1f} ms "
                + (
                    f"(clocks of {before} and {after} disagree)"
                    if before != after
                    else f"(marks of {before} out of order: one clock, so not skew)"
                )
            )
        out.phases[name] = seconds
        start, pending, gaps = value[i + 1], [], []
    for pending_phase in pending:  # after the last known mark
        out.unmeasured[pending_phase] = "; ".join(gaps)
    if status[0] == MISSING:
        http = status[1] == KNOWN  # P's HTTP front door, kvobs.emit.engine_http
        out.unmeasured["latency"] = "no kvobs.proxy.turn span: latency runs from " + (
            "P's API server receiving the request to D's sending its last byte; the "
            "client-facing edges (the router's before P and after D) are unseen"
            if http
            else "the first engine mark (P's arrival) to D's last token; the "
            "client-facing edges (the router's and the engines' HTTP servers' before "
            "P's arrival and after D's last token) are unseen"
        )
    return out



def _causes_before(
    turn: Mapping[str, Any], context: CauseContext = CauseContext()
) -> list[CauseFinding]:
    """The causes of one turn (a turn-table row with timeline columns), largest first."""
    latency = _get(turn, "latency_s")
    ttft = _get(turn, "ttft_s")
    slowest = _get(turn, "slowest_phase")
    seconds: dict[LC, float] = {}
    before_first: dict[LC, float] = {}
    holds_slowest: set[LC] = set()
    get = turn.get  # ``_get`` inline: ~20 phases a turn
    for phase, column, name, before_first_token, fixed in _PHASE_READS:
        value = get(column)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        cause = fixed if fixed is not None else cause_of(phase, turn, context)
        seconds[cause] = seconds.get(cause, 0.0) + value
        if before_first_token:
            before_first[cause] = before_first.get(cause, 0.0) + value
        if slowest == name:
            holds_slowest.add(cause)
    out = []
    for cause, total in seconds.items():
        share = total / latency if latency else None
        ttft_share = before_first.get(cause, 0.0) / ttft if ttft else 0.0
        needed = SHARE_OF.get(cause, DOMINANT_SHARE)
        dominant = total >= MIN_SECONDS and ((share or 0.0) >= needed or ttft_share >= needed)
        if not (dominant or cause in holds_slowest):
            continue
        remedy, evidence = EXPLAIN[cause](turn, total, context)
        evidence = {k: v for k, v in evidence.items() if v is not None}
        if ttft:
            evidence["ttft_share"] = ttft_share
        out.append(CauseFinding(cause, total, share, remedy, evidence))
    return sorted(out, key=lambda finding: -finding.seconds)



def _random_marks(rng: random.Random, rows: int) -> Marks:
    value = np.empty((len(MARKS), rows))
    status = np.empty((len(MARKS), rows), np.int8)
    for row in range(rows):
        now = rng.uniform(0, 1e9)
        for i in range(len(MARKS)):
            status[i, row] = rng.choice([KNOWN, KNOWN, KNOWN, NOT_APPLICABLE, MISSING])
            # mostly forward, some backwards (skew), some equal (0 s phases)
            now += rng.choice([0.0, rng.uniform(0, 0.5), -rng.uniform(0, 0.05)])
            value[i, row] = now
    return Marks(value, status)


def _random_turn(rng: random.Random) -> dict[str, Any]:
    turn: dict[str, Any] = {
        name: rng.choice([None, rng.uniform(0, 3), 0.0]) for name in _HEADLINE
    }
    turn["slowest_phase"] = rng.choice([None, *(p.value for p in PHASES)])
    turn["stream"] = rng.choice([None, True, False])
    turn["turn_span_id"] = rng.choice([None, "a1"])
    turn["lookup_span_id"] = rng.choice([None, "b2"])
    tie = rng.uniform(0, 0.2)
    for phase in PHASES:
        turn[phase_column(phase)] = rng.choice(
            [None, math.nan, 0.0, tie, tie, rng.uniform(0, 0.5), -rng.uniform(0, 0.01)]
        )
    turn["latency_s"] = rng.choice([None, 0.0, math.nan, rng.uniform(0.01, 4)])
    turn["ttft_s"] = rng.choice([None, 0.0, rng.uniform(0.01, 1)])
    turn["output_tokens"] = rng.choice([None, 0, 1, 2, rng.randrange(3, 900)])
    turn["read_unobserved_s"] = rng.choice([None, rng.uniform(0, 0.3)])
    turn["handoff_bytes"] = rng.choice([None, rng.randrange(1, 10**9)])
    turn["handoff_duration_s"] = rng.choice([None, rng.uniform(0.001, 0.3)])
    turn["recomputed_tokens"] = rng.choice([None, rng.randrange(0, 9000)])
    turn["fallback_reason"] = rng.choice([None, "error"])
    return turn


def test_timeline_of_as_before():
    rng = random.Random(11)
    rows = 3000
    marks = _random_marks(rng, rows)
    for row in range(rows):
        turn = _random_turn(rng)
        assert timeline_of(marks, row, turn) == _timeline_before(marks, row, turn)


@pytest.mark.parametrize("typical", [None, 0.0, 0.004, 0.05])
def test_causes_as_before(typical):
    rng = random.Random(13)
    context = CauseContext(typical)
    for _ in range(3000):
        turn = _random_turn(rng)
        assert causes(turn, context) == _causes_before(turn, context)
