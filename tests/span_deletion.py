"""No verdict rests on the absence of a span: delete each span of a run in turn,
re-diagnose, and every turn keeps its verdict or becomes ``insufficient-evidence``, and
no turn vanishes.

Shared by the test on the recorded demo spans (tests/verdicts/test_span_deletion.py) and the
testbed's check of a fresh demo run. Turns are matched by their own span ids, not by
(conversation, turn): deleting the span that names a turn's conversation may re-key it
(an id-less turn), and it must still keep its verdict.

Fast by rounds: conversations that share no span and no prefix lineage are diagnosed
independently, so one round deletes one span of each such group at once and rebuilds
the table once. A round that breaks a turn is replayed span by span, so every reported
violation is one deletion's.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from kvobs.turns.correlate import turns_from_spans
from kvobs.diagnose import classify_turns
from kvobs.semconv import Verdict

INSUFFICIENT = Verdict.INSUFFICIENT_EVIDENCE.value


@dataclass(frozen=True)
class Diagnosed:
    """One turn of a diagnosed span set: its verdict and the span ids it was built from."""

    label: str
    verdict: str
    span_ids: frozenset[str]


# Span id columns that name another turn's span: the previous turn's, the export a
# prompt extends.
_OTHER_TURNS = ("prev_", "extends_")


def _own_span_ids(row: dict) -> frozenset[str]:
    return frozenset(str(value) for column, value in row.items()
                     if column.endswith("_span_id") and not column.startswith(_OTHER_TURNS)
                     and value is not None and not pd.isna(value))


def diagnosed(spans: pd.DataFrame) -> list[Diagnosed]:
    if spans.empty:
        return []
    diagnoses, _ = classify_turns(turns_from_spans(spans))
    return [Diagnosed(f"{d.conversation_id} turn {d.turn.index}", d.finding.verdict.value,
                      _own_span_ids(d.turn.as_dict())) for d in diagnoses]


def _groups(spans: pd.DataFrame, turns: list[Diagnosed]) -> list[list[int]]:
    """Positions of the spans, grouped so that no span of one group can change a turn
    of another: a turn's spans (by span id, then by trace) with every turn of its
    conversation and of the conversations its prompt's lineage links."""
    table = turns_from_spans(spans).reset_index(drop=True)
    parent = list(range(len(table)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(i: int, j: int) -> None:
        parent[find(i)] = find(j)

    for keys in (["tenant", "conversation_id"], ["decode_request_id"], ["trace_id"]):
        for rows in table.dropna(subset=keys).groupby(keys).indices.values():
            for row in rows[1:]:
                union(rows[0], row)
    if "extends_request_id" in table:
        by_request = {request: i for i, request in table["decode_request_id"].items()
                      if not pd.isna(request)}
        for i, request in table["extends_request_id"].items():
            if not pd.isna(request) and request in by_request:
                union(i, by_request[request])
    of_span = {span: find(i) for i, turn in enumerate(turns) for span in turn.span_ids}
    of_trace: dict[str, int] = {}
    for span, trace in zip(spans["span_id"], spans["trace_id"]):
        if span in of_span:
            of_trace.setdefault(trace, of_span[span])
    groups: dict[object, list[int]] = {}
    for position, (span, trace) in enumerate(zip(spans["span_id"], spans["trace_id"])):
        group = of_span.get(span, of_trace.get(trace, "unassigned"))
        groups.setdefault(group, []).append(position)
    return list(groups.values())


def _broken(before: list[Diagnosed], after: list[Diagnosed],
            deleted: set[str]) -> list[tuple[Diagnosed, str]]:
    """(turn before, verdict after) for every turn whose verdict changed to anything but
    insufficient-evidence, and every turn that vanished: none of its spans left (the
    ``deleted`` span ids aside) is in any turn after."""
    by_span = {span: turn for turn in before for span in turn.span_ids}
    kept = {span for turn in after for span in turn.span_ids}
    out = [(turn, "no turn (vanished)") for turn in before
           if turn.span_ids - deleted and not (turn.span_ids - deleted) & kept]
    for turn in after:
        if turn.verdict == INSUFFICIENT:
            continue
        matched = {by_span[span] for span in turn.span_ids if span in by_span}
        if len(matched) != 1:  # a turn the deletion made up, or two it merged
            out.append((next(iter(matched)) if matched else turn,
                        f"{turn.verdict} on a turn built from {len(matched)} turns' spans"))
        elif turn.verdict != next(iter(matched)).verdict:
            out.append((next(iter(matched)), turn.verdict))
    return out


def deletion_violations(spans: pd.DataFrame) -> list[str]:
    """One line per (span, turn) where deleting that one span changed the turn's verdict
    to another verdict than insufficient-evidence, or made the turn vanish; empty when
    none does."""
    spans = spans.reset_index(drop=True)
    before = diagnosed(spans)
    groups = _groups(spans, before)
    violations = []
    for round_ in range(max(map(len, groups), default=0)):
        deleted = [group[round_] for group in groups if round_ < len(group)]
        if not _broken(before, diagnosed(spans.drop(index=deleted)),
                       set(spans["span_id"].iloc[deleted])):
            continue
        for position in deleted:
            row = spans.iloc[position]
            for turn, verdict in _broken(before, diagnosed(spans.drop(index=[position])),
                                         {row["span_id"]}):
                violations.append(f"deleting {row['name']} span {row['span_id']} "
                                  f"({row['service']}) turned {turn.label} from "
                                  f"{turn.verdict} into {verdict}")
    return violations
