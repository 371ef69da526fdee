"""Classify every turn of a span set: the library behind ``kvobs diagnose`` and ``turns``."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from kvobs.turns import arrays, columns as col
from kvobs.causes import CauseContext, CauseFinding, causes, decode_context
from kvobs.turns.correlate import turns_from_spans
from kvobs import semconv as sc
from kvobs.semconv import HEALTHY_VERDICTS, Verdict
from kvobs.sources import SpanSource
from kvobs.timeline import Timeline, add_timeline, timeline_of
from kvobs.turns.schema import KEYS, PUBLIC, UNKNOWN_TENANT
from kvobs.verdicts import Context, Finding, Turn, findings

__all__ = [
    "diagnose",
    "all_turns",
    "classify_turns",
    "Diagnosis",
    "TurnDiagnosis",
    "UnknownConversation",
    "AmbiguousConversation",
    "SUMMARY_COLUMNS",
]

# Shown with every turn in JSON and tables (numbers and ids only): the turn table's public
# columns (kvobs.turns.schema, docs/turns.md) and what the timeline adds.
SUMMARY_COLUMNS = (
    *[c for c in PUBLIC if c not in KEYS],
    "compute_saved_tokens",
    "compute_saved_s",
    "ttft_gained_s",
)


class UnknownConversation(LookupError):
    def __init__(self, conversation_id: str, near: list[str], tenant: str | None = None):
        super().__init__(conversation_id)
        self.conversation_id = conversation_id
        self.near = near
        self.tenant = tenant


class AmbiguousConversation(LookupError):
    """Several tenants use the conversation id: they are different conversations, and
    merging them would read one tenant's turns as the other's."""

    def __init__(self, conversation_id: str, tenants: list[str]):
        super().__init__(conversation_id)
        self.conversation_id = conversation_id
        self.tenants = tenants


@dataclass
class TurnDiagnosis:
    """One turn: its reuse verdict, where its time went, and why it took that time."""

    conversation_id: str
    turn: Turn
    finding: Finding
    tenant: str = UNKNOWN_TENANT
    timeline: Timeline = field(default_factory=Timeline)
    causes: list[CauseFinding] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "conversation_id": self.conversation_id,
            "tenant": self.tenant,
            "turn": self.turn.index,
            "verdict": _VERDICT_VALUES[self.finding.verdict],
            "evidence": self.finding.evidence,
            "remedy": self.finding.remedy,
            "rule": self.finding.rule,
            **self.timeline.to_dict(),
            "causes": [c.to_dict() for c in self.causes],
            **dict(zip(SUMMARY_COLUMNS, map(self.turn.get, SUMMARY_COLUMNS))),
        }


# An enum's ``value`` is a descriptor call (~0.3 us): read once a member, not once a turn
# (the live classifier writes every turn it classifies as this JSON).
_VERDICT_VALUES = {verdict: verdict.value for verdict in Verdict}


@dataclass
class Diagnosis:
    conversation_id: str
    turns: list[TurnDiagnosis]
    context: Context
    problems: list[str] = field(default_factory=list)
    tenant: str = UNKNOWN_TENANT

    @property
    def verdicts(self) -> list[Verdict]:
        return [t.finding.verdict for t in self.turns]

    @property
    def healthy(self) -> bool:
        return all(v in HEALTHY_VERDICTS for v in self.verdicts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "conversation_id": self.conversation_id,
            "tenant": self.tenant,
            "turns": [t.to_dict() for t in self.turns],
            "context": {
                "prefill_tokens_per_s": self.context.prefill_tokens_per_s,
                "decode_s_per_token": self.context.decode_s_per_token,
                "read_slo_s": self.context.read_slo_s,
            },
            "problems": self.problems,
        }


def classify_turns(
    turns: col.Table,
    read_slo_s: float | None = None,
    prefill_tokens_per_s: float | None = None,
    decode_s_per_token: float | None = None,
) -> tuple[list[TurnDiagnosis], Context]:
    """Every turn of a turn table (``correlate.turns_from_spans``: its Arrow rows as
    ``col.Columns``, or the pandas table) classified, timed and explained. The P compute
    rate and the typical decode time per token are measured over the table unless given
    (the live classifier gives its fleet's); the returned context says which were used."""
    if not isinstance(turns, col.Columns):
        turns = turns.reset_index(drop=True)
    turns, marks, rate = add_timeline(turns, prefill_tokens_per_s)
    cause_context = (
        CauseContext(decode_s_per_token) if decode_s_per_token else decode_context(turns)
    )
    context = Context(rate, read_slo_s, decode_s_per_token=cause_context.decode_s_per_token)
    diagnoses = []
    if isinstance(turns, col.Columns):
        rows = turns.records(plain=True)
        read = [Turn.of_plain(row) for row in rows]
    else:
        rows = col.records(turns)
        read = [Turn(row) for row in rows]
    for i, (row, turn, finding) in enumerate(zip(rows, read, findings(turns, context, read))):
        diagnoses.append(
            TurnDiagnosis(
                str(row["conversation_id"]),
                turn,
                finding,
                str(row["tenant"]),
                timeline_of(marks, i, turn),
                causes(turn, cause_context),
            )
        )
    return diagnoses, context


def _where(turns: pa.Table, column: str, value: str) -> pa.Table:
    values = turns.column(column)
    if pa.types.is_dictionary(values.type):
        values = values.cast(values.type.value_type)
    return turns.filter(arrays.equal(values, value))


def _distinct(turns: pa.Table, column: str) -> list[str]:
    values = turns.column(column)
    if pa.types.is_dictionary(values.type):
        values = values.cast(values.type.value_type)
    return sorted(str(value) for value in pc.unique(values).to_pylist())


def diagnose(
    source: SpanSource,
    conversation_id: str,
    read_slo_s: float | None = None,
    prefill_tokens_per_s: float | None = None,
    tenant: str | None = None,
    decode_s_per_token: float | None = None,
) -> Diagnosis:
    """One conversation's turns, classified. ``tenant`` (a digest, as spans carry it)
    picks one when several tenants use the id; without it that case raises
    ``AmbiguousConversation``."""
    # Conversations kvobs named itself (an id-less turn, a chain rebuilt from engine
    # spans) exist only once every span is correlated: no source can select them.
    derived = conversation_id.startswith((sc.LINEAGE_PREFIX, sc.ANONYMOUS_PREFIX))
    every = turns_from_spans(source.span_table(None if derived else conversation_id), frame=False)
    turns = _where(every, "conversation_id", conversation_id)
    problems = list(source.problems)
    if turns.num_rows == 0 and conversation_id.startswith(sc.ANONYMOUS_PREFIX):
        # The id the proxy gave an id-less turn, which the engines' prefix chains then
        # put in an earlier turn's conversation: diagnose that one.
        trace = sc.trace_of_anonymous(conversation_id)
        found = _where(every, "trace_id", trace)
        if found.num_rows:
            conversation_id = found.column("conversation_id")[0].as_py()
            turn = found.column("turn")[0].as_py()
            problems.append(
                f"turn {turn} of {conversation_id}: its prompt extends that "
                f"conversation's history (prefix lineage)"
            )
            turns = _where(every, "conversation_id", conversation_id)
    tenants = _distinct(turns, "tenant")
    if tenant is not None:
        turns = _where(turns, "tenant", tenant)
    if turns.num_rows == 0:
        near = difflib.get_close_matches(
            conversation_id, source.conversation_ids(), n=5, cutoff=0.6
        )
        if tenant is not None and tenants:
            near = [f"tenant {t}" for t in tenants]
        raise UnknownConversation(conversation_id, near, tenant)
    if len(tenants) > 1 and tenant is None:
        raise AmbiguousConversation(conversation_id, tenants)
    diagnoses, context = classify_turns(
        col.Columns(turns), read_slo_s, prefill_tokens_per_s, decode_s_per_token
    )
    return Diagnosis(
        conversation_id, diagnoses, context, problems, str(turns.column("tenant")[0].as_py())
    )


def all_turns(
    source: SpanSource, read_slo_s: float | None = None, prefill_tokens_per_s: float | None = None
) -> list[TurnDiagnosis]:
    diagnoses, _ = classify_turns(
        col.Columns(turns_from_spans(source.span_table(), frame=False)),
        read_slo_s,
        prefill_tokens_per_s,
    )
    return diagnoses
