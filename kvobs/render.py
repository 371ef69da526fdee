"""Render diagnoses for a terminal (rich) or as JSON/CSV: the last stage, reads only."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Iterable

from kvobs.diagnose import Diagnosis, TurnDiagnosis
from kvobs.semconv import HEALTHY_VERDICTS, Phase
from kvobs.timeline import Timeline

if TYPE_CHECKING:  # rich is imported on use: JSON and CSV output never need it
    from rich.console import Console
    from rich.table import Table

_STYLE_OK, _STYLE_FAULT, _STYLE_UNKNOWN = "green", "bold red", "yellow"


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value * 1000:.1f}ms" if unit == "ms" else f"{value:.1f}"
    return str(value)


def duration(value: float | None) -> str:
    """Seconds for people: phases run from microseconds (a proxy hop) to minutes."""
    if value is None:
        return "-"
    if abs(value) >= 1:
        return f"{value:.2f}s"
    return f"{value * 1000:.0f}ms" if abs(value) >= 0.01 else f"{value * 1000:.2f}ms"


def _style(diagnosis: TurnDiagnosis) -> str:
    verdict = diagnosis.finding.verdict
    if verdict.value == "insufficient-evidence":
        return _STYLE_UNKNOWN
    return _STYLE_OK if verdict in HEALTHY_VERDICTS else _STYLE_FAULT


def diagnosis_table(diagnosis: Diagnosis) -> Table:
    from rich.table import Table

    title = f"conversation {diagnosis.conversation_id}"
    if diagnosis.tenant:
        title += f" (tenant {diagnosis.tenant})"
    table = Table(title=title, show_lines=False)
    for header in ("turn", "verdict", "gap s", "N", "L", "C", "M", "read", "bytes",
                   "read time", "TTFT", "latency", "slowest", "remedy"):
        table.add_column(header, overflow="fold")
    for item in diagnosis.turns:
        turn, timeline = item.turn, item.timeline
        slowest = timeline.slowest
        table.add_row(str(turn.index), f"[{_style(item)}]{item.finding.verdict.value}[/]",
                      _fmt(turn.get("gap_s")), _fmt(turn.get("prompt_tokens")),
                      _fmt(turn.get("local_hit_tokens")), _fmt(turn.get("remote_tokens")),
                      _fmt(turn.get("candidate_tokens")), _fmt(turn.get("read_outcome")),
                      _fmt(turn.get("read_bytes")), _fmt(turn.get("read_duration_s"), "ms"),
                      _fmt(timeline.ttft_s, "ms"), _fmt(timeline.latency_s, "ms"),
                      _slowest(timeline, slowest), item.finding.remedy)
    return table


def _slowest(timeline: Timeline, slowest: tuple[str, float] | None) -> str:
    if slowest is None:
        return "-"
    share = slowest[1] / timeline.latency_s if timeline.latency_s else None
    return slowest[0] + (f" {share:.0%}" if share is not None else "")


# One colour per stretch of the path: proxy, P, the reuse read, D.
_PHASE_STYLE = {
    Phase.PROXY_IN: "white", Phase.P_RETRY: "red", Phase.P_FRONTEND: "grey50",
    Phase.P_QUEUE: "magenta", Phase.P_SCHEDULE: "blue", Phase.READ_SETUP: "bright_red",
    Phase.READ: "cyan", Phase.P_COMPUTE: "blue", Phase.P_RETURN: "grey50",
    Phase.PROXY_HOP: "white", Phase.D_FRONTEND: "grey50", Phase.D_QUEUE: "bright_magenta",
    Phase.HANDOFF_SETUP: "bright_red", Phase.HANDOFF: "yellow",
    Phase.D_FIRST_TOKEN: "green", Phase.DECODE: "bright_green", Phase.PROXY_OUT: "white"}
_BAR_WIDTH = 40


def timeline_bar(timeline: Timeline, width: int = _BAR_WIDTH) -> str:
    """A compact bar of the turn's phases (rich markup), widths by share of latency;
    merged (unsplit) phases in dim hatching."""
    total = sum(max(0.0, s) for s in timeline.phases.values())
    if total <= 0:
        return "[dim]no timeline[/]"
    cells = []
    for name, seconds in timeline.phases.items():
        n = int(round(max(0.0, seconds) / total * width))
        if n == 0:
            continue
        style = _PHASE_STYLE.get(Phase(name), "white") if "+" not in name else "dim"
        cells.append(f"[{style}]{('░' if '+' in name else '█') * n}[/]")
    return "".join(cells)


def timeline_line(timeline: Timeline) -> str:
    """Bar, latency, TTFT and the three largest phases with their shares."""
    ranked = sorted(timeline.phases.items(), key=lambda item: -item[1])[:3]
    total = timeline.latency_s or 0.0
    parts = [f"{name} {seconds / total:.0%}" if total > 0 else name
             for name, seconds in ranked]
    ttft = (f" ttft {duration(timeline.ttft_s)} ({timeline.ttft_source})"
            if timeline.ttft_s is not None else " ttft -")
    return (f"{timeline_bar(timeline)} {duration(timeline.latency_s)}{ttft}  "
            + " · ".join(parts))


def print_diagnosis(console: Console, diagnosis: Diagnosis) -> None:
    console.print(diagnosis_table(diagnosis))
    for item in diagnosis.turns:
        evidence = ", ".join(f"{k}={v}" for k, v in item.finding.evidence.items())
        console.print(f"  turn {item.turn.index} {item.finding.verdict.value}: {evidence}",
                      highlight=False, soft_wrap=True)
        console.print(f"    time: {timeline_line(item.timeline)}", highlight=False,
                      soft_wrap=True)
        for cause in item.causes:
            share = f" {cause.share:.0%}" if cause.share is not None else ""
            console.print(f"    cause {cause.cause.value}{share}: {cause.remedy}",
                          highlight=False, soft_wrap=True)
        for phase, why in item.timeline.unmeasured.items():
            console.print(f"    [yellow]unmeasured[/] {phase}: {why}", highlight=False,
                          soft_wrap=True)
    print_problems(console, diagnosis.problems)


def print_problems(console: Console, problems: Iterable[str]) -> None:
    for problem in problems:
        console.print(f"[yellow]warning:[/] {problem}", highlight=False, soft_wrap=True)


def to_json(payload: Any) -> str:
    return json.dumps(payload, indent=2, default=str)
