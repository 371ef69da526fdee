"""Render diagnoses for a terminal (rich) or as JSON/CSV: the last stage, reads only."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any, Iterable

from kvobs.diagnose import Diagnosis, TurnDiagnosis
from kvobs.semconv import HEALTHY_VERDICTS, Phase, Verdict
from kvobs.timeline import Timeline

if TYPE_CHECKING:  # rich is imported on use: JSON and CSV output never need it
    from rich.console import Console
    from rich.table import Table

_STYLE_OK, _STYLE_FAULT, _STYLE_UNKNOWN = "green", "bold red", "yellow"


def duration(value: float | None) -> str:
    """Seconds for people: phases run from microseconds (a proxy hop) to minutes."""
    if value is None:
        return "-"
    if abs(value) >= 1:
        return f"{value:.2f}s"
    return f"{value * 1000:.0f}ms" if abs(value) >= 0.01 else f"{value * 1000:.2f}ms"


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """A count with its noun, singular for one.

    >>> plural(1, "turn"), plural(1_024, "turn"), plural(0, "copy", "copies")
    ('1 turn', '1,024 turns', '0 copies')
    """
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"


# Inline literals of docstrings (docs are Markdown and RST): ``x`` and `x`.
_LITERAL = re.compile(r"``(.+?)``|`([^`]+)`")


def plain(text: str) -> str:
    """Docstring text for people: inline literals without their backticks.

    >>> plain("``0 < M < kv_recompute_threshold``, recomputed by design (`M`).")
    '0 < M < kv_recompute_threshold, recomputed by design (M).'
    """
    return _LITERAL.sub(lambda m: m.group(1) or m.group(2), text)


def number(value: Any) -> str:
    """Any other figure for people, never in exponent notation.

    >>> number(5.655e-05), number(0.8965), number(123_456_789.0), number(None)
    ('0.000057', '0.90', '123,456,789', '–')
    """
    if value is None:
        return "–"
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    value = float(value)
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}" if abs(value) >= 0.01 else f"{value:.6f}".rstrip("0").rstrip(".")


def fault_count(mix: dict[str, int]) -> int:
    """Turns of a verdict mix with a fault verdict (neither healthy nor
    insufficient-evidence)."""
    ok = {v.value for v in HEALTHY_VERDICTS} | {Verdict.INSUFFICIENT_EVIDENCE.value}
    return sum(n for verdict, n in mix.items() if verdict not in ok)


def _style(diagnosis: TurnDiagnosis) -> str:
    verdict = diagnosis.finding.verdict
    if verdict.value == "insufficient-evidence":
        return _STYLE_UNKNOWN
    return _STYLE_OK if verdict in HEALTHY_VERDICTS else _STYLE_FAULT


def _count(value: Any) -> str:
    return "-" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


def _gap(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}s" if value < 600 else f"{value / 60:.0f}min"


def total_seconds(value: float | None) -> str:
    """Totals: hours of fleet time as seconds with thousands separators, or a small
    source's milliseconds."""
    if value is None:
        return "-"
    return f"{value:,.1f}s" if abs(value) >= 10 else duration(value)


def byte_size(value: Any) -> str:
    """Bytes in binary units: 1.9MiB."""
    if value is None:
        return "-"
    value = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return str(value)


# Table columns: (header, cell). The first set fits 80 columns; the rest join when the
# terminal has room for them. Everything else about a turn (remedy, evidence, time, causes) is in
# the word-wrapped lines under the table, so no cell ever folds letter by letter.
_COLUMNS = (
    ("turn", lambda item: str(item.turn.index)),
    ("verdict", lambda item: f"[{_style(item)}]{item.finding.verdict.value}[/]"),
    ("gap", lambda item: _gap(item.turn.get("gap_s"))),
    ("N", lambda item: _count(item.turn.get("prompt_tokens"))),
    ("M", lambda item: _count(item.turn.get("candidate_tokens"))),
    ("TTFT", lambda item: duration(item.timeline.ttft_s)),
    ("latency", lambda item: duration(item.timeline.latency_s)),
)
_WIDE = (
    ("read", lambda item: _count(item.turn.get("read_outcome"))),
    ("L", lambda item: _count(item.turn.get("local_hit_tokens"))),
    ("C", lambda item: _count(item.turn.get("remote_tokens"))),
    ("bytes", lambda item: byte_size(item.turn.get("read_bytes"))),
    ("read time", lambda item: duration(item.turn.get("read_duration_s"))),
    ("slowest", lambda item: _slowest(item.timeline, item.timeline.slowest)),
)
_RIGHT = {"turn", "gap", "N", "M", "L", "C", "bytes", "read time", "TTFT", "latency"}


def diagnosis_table(diagnosis: Diagnosis, console: Console) -> Table:
    """The turns' table with the wide columns when it fits ``console``, else without."""
    return widest_fitting(
        console, [_table(diagnosis, _COLUMNS + _WIDE), _table(diagnosis, _COLUMNS)]
    )


def widest_fitting(console: Console, tables: list[Table]) -> Table:
    """The first of ``tables`` (widest first) that fits the console unshrunk, else the
    last: a table rich must shrink folds its cells."""
    from rich.measure import Measurement

    unbounded = console.options.update_width(10_000)
    for table in tables[:-1]:
        if Measurement.get(console, unbounded, table).maximum <= console.width:
            return table
    return tables[-1]


def compact_table(title: str, headers, right=frozenset()) -> Table:
    """A table of short cells that never wrap (what the CLI prints)."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    for header in headers:
        table.add_column(header, no_wrap=True, justify="right" if header in right else "left")
    return table


def _table(diagnosis: Diagnosis, columns) -> Table:
    title = f"conversation {diagnosis.conversation_id}"
    if diagnosis.tenant:
        title += f" (tenant {diagnosis.tenant})"
    table = compact_table(title, [header for header, _ in columns], _RIGHT)
    for item in diagnosis.turns:
        table.add_row(*(cell(item) for _, cell in columns))
    return table


def _slowest(timeline: Timeline, slowest: tuple[str, float] | None) -> str:
    if slowest is None:
        return "-"
    share = slowest[1] / timeline.latency_s if timeline.latency_s else None
    return short_phase(slowest[0]) + (f" {share:.0%}" if share is not None else "")


# A merged phase ("p-queue+p-schedule+...": a missing span kept them apart) by its ends.
_MERGED = re.compile(r"[a-z][a-z-]*(?:\+[a-z][a-z-]*){2,}")


def short_phase(name: str) -> str:
    """``a+b+c+d`` as ``a..d (4 phases)``; a phase or a pair as it is.

    >>> short_phase("p-queue+p-schedule+read-wait"), short_phase("p-queue+read")
    ('p-queue..read-wait (3 phases)', 'p-queue+read')
    """
    return _MERGED.sub(_shorten, name)


def _shorten(match: re.Match) -> str:
    parts = match.group(0).split("+")
    return f"{parts[0]}..{parts[-1]} ({len(parts)} phases)"


# One colour per stretch of the path: proxy, P, the reuse read, D.
_PHASE_STYLE = {
    Phase.PROXY_IN: "white",
    Phase.P_RETRY: "red",
    Phase.P_FRONTEND: "grey50",
    Phase.P_QUEUE: "magenta",
    Phase.P_SCHEDULE: "blue",
    Phase.READ_SETUP: "bright_red",
    Phase.READ: "cyan",
    Phase.P_COMPUTE: "blue",
    Phase.P_RETURN: "grey50",
    Phase.PROXY_HOP: "white",
    Phase.D_FRONTEND: "grey50",
    Phase.D_QUEUE: "bright_magenta",
    Phase.HANDOFF_SETUP: "bright_red",
    Phase.HANDOFF: "yellow",
    Phase.D_FIRST_TOKEN: "green",
    Phase.DECODE: "bright_green",
    Phase.PROXY_OUT: "white",
}
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


def timeline_line(timeline: Timeline, width: int = _BAR_WIDTH) -> str:
    """Bar, latency, TTFT and the three largest phases with their shares."""
    ranked = sorted(timeline.phases.items(), key=lambda item: -item[1])[:3]
    total = timeline.latency_s or 0.0
    parts = [
        f"{short_phase(name)} {seconds / total:.0%}" if total > 0 else short_phase(name)
        for name, seconds in ranked
    ]
    ttft = (
        f" ttft {duration(timeline.ttft_s)} ({timeline.ttft_source})"
        if timeline.ttft_s is not None
        else " ttft -"
    )
    return f"{timeline_bar(timeline, width)} {duration(timeline.latency_s)}{ttft} · " + " · ".join(
        parts
    )


def _unmeasured(timeline: Timeline) -> list[tuple[str, str]]:
    """(phases, why) once per reason: the phases of one merged stretch share theirs."""
    grouped: dict[str, list[str]] = {}
    for phase, why in timeline.unmeasured.items():
        grouped.setdefault(why, []).append(phase)
    return [
        (phases[0] if len(phases) == 1 else short_phase("+".join(phases)), missing_spans(why))
        for why, phases in grouped.items()
    ]


_MEASURED_AS = re.compile(r"^measured only as \S+: ")
_FOR_MARK = re.compile(r"^(.*) for mark (\S+)$")


def missing_spans(why: str) -> str:
    """The timeline's reasons, one clause per missing span with the marks it would
    have given (the merged name is already the line's label).

    >>> missing_spans("measured only as a+b+c: no x span for mark m1; no y span for mark "
    ...               "m2; no x span for mark m3")
    'no x span for marks m1, m3; no y span for mark m2'
    """
    marks: dict[str, list[str]] = {}
    for clause in _MEASURED_AS.sub("", why).split("; "):
        match = _FOR_MARK.match(clause)
        span, mark = (match.group(1), match.group(2)) if match else (clause, None)
        marks.setdefault(span, []).extend([mark] if mark else [])
    return "; ".join(
        span + (f" for mark{'s' if len(m) > 1 else ''} {', '.join(m)}" if m else "")
        for span, m in marks.items()
    )


def _evidence(evidence: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_number(v)}" for k, v in evidence.items())


def _number(value: Any) -> str:
    """Evidence floats without float noise (0.41000008 -> 0.41) or exponents."""
    if not isinstance(value, float):
        return str(value)
    if value.is_integer():
        return str(int(value))
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.4g}"


def _wrapped(console: Console, markup: str, indent: int) -> None:
    """A line wrapped at word boundaries, continuation lines indented."""
    from rich.padding import Padding
    from rich.text import Text

    text = Text.from_markup(markup)
    console.print(Padding(text, (0, 0, 0, indent), expand=False), highlight=False)


def print_diagnosis(console: Console, diagnosis: Diagnosis) -> None:
    from rich.markup import escape

    console.print(diagnosis_table(diagnosis, console))
    bar = max(10, min(_BAR_WIDTH, console.width // 3))
    for item in diagnosis.turns:
        verdict = item.finding.verdict.value
        _wrapped(
            console,
            f"turn {item.turn.index} [{_style(item)}]{verdict}[/]: {escape(item.finding.remedy)}",
            0,
        )
        _wrapped(console, f"evidence: {escape(_evidence(item.finding.evidence))}", 2)
        _wrapped(console, f"time: {timeline_line(item.timeline, bar)}", 2)
        for cause in item.causes:
            share = f" {cause.share:.0%}" if cause.share is not None else ""
            _wrapped(console, f"cause {cause.cause.value}{share}: {escape(cause.remedy)}", 2)
        for phases, why in _unmeasured(item.timeline):
            _wrapped(console, f"[yellow]unmeasured[/] {phases}: {escape(why)}", 2)
    print_problems(console, diagnosis.problems)


def print_problems(console: Console, problems: Iterable[str]) -> None:
    for problem in problems:
        console.print(f"[yellow]warning:[/] {problem}", highlight=False, soft_wrap=True)


def to_json(payload: Any, indent: int | None = 2) -> str:
    """JSON for people (indented) or, with ``indent=None``, one line (a CSV cell)."""
    return json.dumps(payload, indent=indent, default=str)
