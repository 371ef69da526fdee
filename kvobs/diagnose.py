"""Classify every turn of a span set: the library behind ``kvobs diagnose`` and ``turns``."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from kvobs.correlate import prefill_rate, turns_from_spans
from kvobs.semconv import HEALTHY_VERDICTS, Verdict
from kvobs.sources import SpanSource
from kvobs.verdicts import Context, Finding, Turn, findings

# Turn columns shown with every turn in JSON and tables (numbers and ids only).
SUMMARY_COLUMNS = ("gap_s", "prompt_tokens", "local_hit_tokens", "remote_tokens",
                   "candidate_tokens", "threshold", "decision", "read_outcome", "read_bytes",
                   "read_blocks", "read_duration_s", "remaining_ttl_s", "recomputed_tokens",
                   "ttft_s", "lookup", "fallback_reason", "prefill_request_id",
                   "decode_request_id", "trace_id")


class UnknownConversation(LookupError):
    def __init__(self, conversation_id: str, near: list[str]):
        super().__init__(conversation_id)
        self.conversation_id = conversation_id
        self.near = near


@dataclass
class TurnDiagnosis:
    conversation_id: str
    turn: Turn
    finding: Finding

    def to_dict(self) -> dict[str, Any]:
        return {"conversation_id": self.conversation_id, "turn": self.turn.index,
                "verdict": self.finding.verdict.value, "evidence": self.finding.evidence,
                "remedy": self.finding.remedy, "rule": self.finding.rule,
                **{column: self.turn.get(column) for column in SUMMARY_COLUMNS}}


@dataclass
class Diagnosis:
    conversation_id: str
    turns: list[TurnDiagnosis]
    context: Context
    problems: list[str] = field(default_factory=list)

    @property
    def verdicts(self) -> list[Verdict]:
        return [t.finding.verdict for t in self.turns]

    @property
    def healthy(self) -> bool:
        return all(v in HEALTHY_VERDICTS for v in self.verdicts)

    def to_dict(self) -> dict[str, Any]:
        return {"conversation_id": self.conversation_id,
                "turns": [t.to_dict() for t in self.turns],
                "context": {"prefill_tokens_per_s": self.context.prefill_tokens_per_s,
                            "read_slo_s": self.context.read_slo_s},
                "problems": self.problems}


def classify_turns(turns: pd.DataFrame, read_slo_s: float | None = None,
                   prefill_tokens_per_s: float | None = None) -> tuple[list[TurnDiagnosis],
                                                                       Context]:
    context = Context(prefill_tokens_per_s or prefill_rate(turns), read_slo_s)
    turns = turns.reset_index(drop=True)
    diagnoses = [TurnDiagnosis(str(row["conversation_id"]), Turn(row), finding)
                 for row, finding in zip(turns.to_dict("records"), findings(turns, context))]
    return diagnoses, context


def diagnose(source: SpanSource, conversation_id: str, read_slo_s: float | None = None,
             prefill_tokens_per_s: float | None = None) -> Diagnosis:
    spans = source.spans(conversation_id)
    turns = turns_from_spans(spans)
    turns = turns[turns["conversation_id"] == conversation_id]
    if turns.empty:
        near = difflib.get_close_matches(conversation_id, source.conversation_ids(), n=5,
                                         cutoff=0.6)
        raise UnknownConversation(conversation_id, near)
    diagnoses, context = classify_turns(turns, read_slo_s, prefill_tokens_per_s)
    return Diagnosis(conversation_id, diagnoses, context, list(source.problems))


def all_turns(source: SpanSource, read_slo_s: float | None = None,
              prefill_tokens_per_s: float | None = None) -> list[TurnDiagnosis]:
    diagnoses, _ = classify_turns(turns_from_spans(source.spans()), read_slo_s,
                                  prefill_tokens_per_s)
    return diagnoses
