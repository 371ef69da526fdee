"""Render diagnoses for a terminal (rich) or as JSON/CSV: the last stage, reads only."""

from __future__ import annotations

import json
from typing import Any, Iterable

from rich.console import Console
from rich.table import Table

from kvobs.diagnose import Diagnosis, TurnDiagnosis
from kvobs.semconv import HEALTHY_VERDICTS

_STYLE_OK, _STYLE_FAULT, _STYLE_UNKNOWN = "green", "bold red", "yellow"


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value * 1000:.1f}ms" if unit == "ms" else f"{value:.1f}"
    return str(value)


def _style(diagnosis: TurnDiagnosis) -> str:
    verdict = diagnosis.finding.verdict
    if verdict.value == "insufficient-evidence":
        return _STYLE_UNKNOWN
    return _STYLE_OK if verdict in HEALTHY_VERDICTS else _STYLE_FAULT


def diagnosis_table(diagnosis: Diagnosis) -> Table:
    title = f"conversation {diagnosis.conversation_id}"
    if diagnosis.tenant:
        title += f" (tenant {diagnosis.tenant})"
    table = Table(title=title, show_lines=False)
    for header in ("turn", "verdict", "gap s", "N", "L", "C", "M", "read", "bytes",
                   "read time", "TTFT", "remedy"):
        table.add_column(header, overflow="fold")
    for item in diagnosis.turns:
        turn = item.turn
        table.add_row(str(turn.index), f"[{_style(item)}]{item.finding.verdict.value}[/]",
                      _fmt(turn.get("gap_s")), _fmt(turn.get("prompt_tokens")),
                      _fmt(turn.get("local_hit_tokens")), _fmt(turn.get("remote_tokens")),
                      _fmt(turn.get("candidate_tokens")), _fmt(turn.get("read_outcome")),
                      _fmt(turn.get("read_bytes")), _fmt(turn.get("read_duration_s"), "ms"),
                      _fmt(turn.get("ttft_s"), "ms"), item.finding.remedy)
    return table


def print_diagnosis(console: Console, diagnosis: Diagnosis) -> None:
    console.print(diagnosis_table(diagnosis))
    for item in diagnosis.turns:
        evidence = ", ".join(f"{k}={v}" for k, v in item.finding.evidence.items())
        console.print(f"  turn {item.turn.index} {item.finding.verdict.value}: {evidence}",
                      highlight=False, soft_wrap=True)
    print_problems(console, diagnosis.problems)


def print_problems(console: Console, problems: Iterable[str]) -> None:
    for problem in problems:
        console.print(f"[yellow]warning:[/] {problem}", highlight=False, soft_wrap=True)


def to_json(payload: Any) -> str:
    return json.dumps(payload, indent=2, default=str)
