"""The HTML fleet report: one self-contained page (no script, nothing fetched) read top
down: headline figures, the verdict mix (by scope, turn index, prompt length and
inter-turn gap), where the time went, one conversation's waterfall, reads against
recomputing, and D's memory. Plots from ``kvobs.fleet._plots`` (matplotlib, extra
``fleet``); verdict mixes as inline SVG (``kvobs.fleet._svg``)."""

from __future__ import annotations

import html
from typing import Any, Callable

import numpy as np
import pandas as pd

from kvobs import __version__
from kvobs import semconv as sc
from kvobs.fleet._plots import (
    GROUP_COLOURS,
    GROUPS,
    PHASE_COLOURS,
    SCOPES,
    UNMEASURED,
    group_of,
    phase_shares,
    png,
    read_time_vs_tokens,
    taken,
    waterfall,
    worst_conversations,
)
from kvobs.fleet._svg import legend, stacked_bars
from kvobs.fleet.report import FleetReport
from kvobs.render import byte_size, duration, fault_count, number, plain, plural, total_seconds
from kvobs.semconv import HEALTHY_VERDICTS, VERDICT_VALUES, Phase, Verdict
from kvobs.settings import DECLINE_WINDOW
from kvobs.timeline import MARKS, PHASES
from kvobs.verdicts import ORDER, meaning

# Healthy verdicts in greens (turn 1 neutral), faults in warm colours, missing evidence
# in light grey.
VERDICT_COLOURS = {
    Verdict.FIRST_TURN.value: "#94a3b8",
    Verdict.REMOTE_HIT.value: "#15803d",
    Verdict.LOCAL_HIT.value: "#4ade80",
    Verdict.BELOW_THRESHOLD.value: "#bef264",
    Verdict.EXPIRED.value: "#f59e0b",
    Verdict.MISSING_METADATA.value: "#dc2626",
    Verdict.PREFIX_MISMATCH.value: "#9333ea",
    Verdict.TRANSFER_FAILED.value: "#7f1d1d",
    Verdict.SLOW_TRANSFER.value: "#fb923c",
    Verdict.MISS.value: "#e11d48",
    # The host path: its hit in teal, its faults in browns and pinks.
    Verdict.HOST_HIT.value: "#0d9488",
    Verdict.HOST_EVICTED.value: "#b45309",
    Verdict.HOST_SAVE_INCOMPLETE.value: "#a16207",
    Verdict.HOST_COPY_LACKS_RESPONSE.value: "#db2777",
    Verdict.INSUFFICIENT_EVIDENCE.value: "#d4d4d8",
}
_DARK_TEXT = frozenset(
    {
        Verdict.LOCAL_HIT.value,
        Verdict.BELOW_THRESHOLD.value,
        Verdict.EXPIRED.value,
        Verdict.SLOW_TRANSFER.value,
        Verdict.INSUFFICIENT_EVIDENCE.value,
    }
)
# The legend's note per verdict: what it means (its rule's title, docs/verdicts.md).
VERDICT_NOTES = {rule.VERDICT.value: plain(meaning(rule)) for rule in ORDER}
VERDICT_NOTES[Verdict.INSUFFICIENT_EVIDENCE.value] = "a span a rule needed is missing"
# Inter-turn gap bins (s); D's TTL joins them so that "past the TTL" is a bin edge.
GAP_EDGES_S = (10, 30, 60, 120, 300, 600, 1800, 3600)
# Phase -> "from mark -> to mark" (docs/timeline.md says where each mark comes from).
PHASE_SPAN = {
    phase.value: f"{start.name} → {end.name}" for phase, start, end in zip(PHASES, MARKS, MARKS[1:])
}


def percent(value: float | None) -> str:
    if value is None:
        return "–"
    if value == 0:
        return "0 %"
    return "<0.1 %" if abs(value) < 0.001 else f"{value:.1%}".replace("%", " %")


def count(value: Any) -> str:
    return "–" if value is None else f"{int(value):,}"


def _seconds(value: float | None) -> str:
    return "–" if value is None else duration(value)


Column = tuple[str, str, Callable[[Any], str]]  # key, heading (with unit), formatter
METRICS: list[Column] = [
    ("turns", "Turns", count),
    ("remote_hit_ratio", "Remote hits", percent),
    ("faults", "Faults", str),
    ("bytes_read", "KV read (bytes)", byte_size),
    ("reused_tokens", "Tokens reused", count),
    ("host_hit_ratio", "Host hits", percent),
    ("host_bytes_loaded", "KV loaded from the host tier (bytes)", byte_size),
    ("host_reused_tokens", "Tokens from the host tier", count),
    ("recomputed_tokens", "Tokens recomputed", count),
    ("ttft_p50_s", "TTFT p50", _seconds),
    ("ttft_p95_s", "TTFT p95", _seconds),
    ("ttft_unmeasured_turns", "TTFT unmeasured (turns)", count),
    ("latency_p50_s", "Latency p50", _seconds),
    ("latency_p95_s", "Latency p95", _seconds),
]
MEMORY: list[Column] = [
    ("exports", "Exports (a turn's KV kept on D for the next turn)", count),
    ("exports_released", "… released", count),
    ("exports_read", "… read by the next turn", count),
    ("blocks_exported", "Blocks exported", count),
    ("blocks_read", "Blocks read", count),
    ("block_seconds_held", "Held (block-seconds)", number),
    ("block_seconds_held_then_read", "… then read (block-seconds)", number),
    ("block_seconds_never_read", "… never read: held for nothing (block-seconds)", number),
    ("read_share_of_blocks", "Share of exported blocks ever read", percent),
    ("bytes_per_block", "Bytes per block", byte_size),
    ("gib_hours_held", "Memory held (GiB-hours)", number),
]


def _faults(row: dict) -> str:
    n = fault_count(row["verdicts"])
    return f"{n:,} ({percent(n / row['turns'])})" if row["turns"] else "0"


def _table(rows: list[dict], first: Column, columns: list[Column]) -> str:
    if not rows:
        return "<p class='none'>none</p>"
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label, _ in [first, *columns])
    body = []
    for row in rows:
        row = {**row, "faults": _faults(row)} if "verdicts" in row else row
        cells = [f"<th scope='row'>{html.escape(first[2](row.get(first[0])))}</th>"]
        cells += [f"<td>{html.escape(fmt(row.get(key)))}</td>" for key, _, fmt in columns]
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _ordered(rows: list[dict], key: str, order) -> list[dict]:
    position = {value: i for i, value in enumerate(order)}
    return sorted(rows, key=lambda row: position.get(row[key], len(position)))


def _verdict_mix(report: FleetReport) -> str:
    scopes = [
        ("turn 1", report.first_turn["verdicts"]),
        ("later turns", report.later_turns["verdicts"]),
    ]
    by_turn = [
        (f"turn {row['turn_bucket']}", row["verdicts"])
        for row in _ordered(report.by_turn, "turn_bucket", sc.TURN_BUCKET_VALUES)
        if row["turn_bucket"] != "1"
    ]
    by_prompt = [
        (f"{row['prompt_bucket']} tokens", row["verdicts"])
        for row in _ordered(report.by_prompt, "prompt_bucket", sc.PROMPT_BUCKET_VALUES)
    ]
    present = [v for v in VERDICT_VALUES if any(mix.get(v) for _, mix in scopes)]
    healthy = {v.value for v in HEALTHY_VERDICTS}
    notes = {v: ("healthy: " if v in healthy else "") + VERDICT_NOTES[v] for v in present}
    return "".join(
        [
            legend(present, VERDICT_COLOURS, notes),
            "<h3>Turn 1 and later turns, later turns by turn index</h3>",
            stacked_bars(
                scopes + by_turn,
                VERDICT_VALUES,
                VERDICT_COLOURS,
                _DARK_TEXT,
                title="verdict mix by turn index",
            ),
            "<h3>Later turns by prompt length</h3>",
            stacked_bars(
                by_prompt,
                VERDICT_VALUES,
                VERDICT_COLOURS,
                _DARK_TEXT,
                title="verdict mix by prompt length",
            ),
        ]
    )


def _span(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:g} s"
    return f"{seconds / 60:g} min" if seconds < 3600 else f"{seconds / 3600:g} h"


def gap_bins(turns: pd.DataFrame) -> tuple[list[tuple[str, dict[str, int]]], float | None]:
    """Later turns' verdict counts per inter-turn gap bin (empty bins left out), and D's
    TTL (the median over turns), which is a bin edge."""
    later = turns[(turns["turn"] > 1) & turns["gap_s"].notna()]
    ttl_values = turns["ttl_s"].dropna().astype(float)
    ttl = float(ttl_values.median()) if len(ttl_values) else None
    edges = sorted(set(GAP_EDGES_S) | ({ttl} if ttl else set()))
    bounds = [0.0, *edges, np.inf]
    gap = later["gap_s"].astype(float).to_numpy()
    verdicts = later["verdict"].astype(str).to_numpy()
    rows = []
    for low, high in zip(bounds, bounds[1:]):
        inside = (gap >= low) & (gap < high)
        if not inside.any():
            continue
        label = (
            f"under {_span(high)}"
            if low == 0
            else f"{_span(low)} and more"
            if high == np.inf
            else f"{_span(low)} – {_span(high)}"
        )
        if ttl and low >= ttl:
            label += " (past TTL)"
        values, counts = np.unique(verdicts[inside], return_counts=True)
        rows.append((label, dict(zip(values.tolist(), counts.tolist()))))
    return rows, ttl


def _gap_section(turns: pd.DataFrame) -> str:
    rows, ttl = gap_bins(turns)
    if not rows:
        return "<p class='none'>no later turn with a gap</p>"
    note = (
        f"<p>D's TTL (<code>decoder_kv_blocks_ttl</code>, median over turns): "
        f"{_span(ttl)}. P declines a read within {DECLINE_WINDOW} of "
        "expiry.</p>"
        if ttl
        else ""
    )
    return note + stacked_bars(
        rows, VERDICT_VALUES, VERDICT_COLOURS, _DARK_TEXT, title="verdict mix by inter-turn gap"
    )


def _phase_cell(phase: str) -> str:
    colour = PHASE_COLOURS[Phase(phase)]
    return (
        f"<td class='phase'><span class='swatch' style='background:{colour}'></span>"
        f"{html.escape(phase)}</td>"
    )


def phase_tables(report: FleetReport) -> list[str]:
    """Per scope: the phases some turn spent time in, ranked, then the unmeasured rest
    of its latency and the phases no turn took."""
    parts = []
    head = (
        "<tr><th>#</th><th>Phase</th><th>Group (latency cause)</th>"
        "<th>From → to (marks)</th><th>Total</th>"
        "<th>Share of latency</th><th>p50 per turn</th><th>p95 per turn</th>"
        "<th>Slowest phase in (turns)</th><th>Measured in (turns)</th></tr>"
    )
    for scope, title in SCOPES:
        section = report.phases[scope]
        spent = [row for row in section["phases"] if taken(row)]
        idle = [row["phase"] for row in section["phases"] if not taken(row)]
        body = [
            f"<tr><td>{rank}</td>{_phase_cell(row['phase'])}"
            f"<td class='span'>{group_of(row['phase']).value}</td>"
            f"<td class='span'>{html.escape(PHASE_SPAN[row['phase']])}</td>"
            f"<td>{total_seconds(row['total_s'])}</td><td>{percent(row['share'])}</td>"
            f"<td>{_seconds(row['p50_s'])}</td><td>{_seconds(row['p95_s'])}</td>"
            f"<td>{count(row['slowest_turns'])}</td>"
            f"<td>{count(row.get('measured_turns'))}</td></tr>"
            for rank, row in enumerate(spent, 1)
        ]
        body.append(
            f"<tr class='unmeasured'><td></td><td class='phase'>{UNMEASURED} "
            f"({plural(section['unmeasured_turns'], 'turn')})</td><td></td>"
            "<td>a missing span kept phases apart</td>"
            f"<td>{total_seconds(section['unmeasured_s'])}</td>"
            f"<td>{percent(section['unmeasured_share'])}</td>"
            "<td></td><td></td><td></td><td></td></tr>"
        )
        parts += [
            f"<h3>{title}: {plural(section['timed_turns'], 'turn')} with a latency, "
            f"{total_seconds(section['latency_s'])} in all</h3>",
            f"<table><thead>{head}</thead><tbody>{''.join(body)}</tbody></table>",
        ]
        if idle:
            parts.append(
                f"<p class='note'>Phases no {title.replace('turns', 'turn')} "
                f"spent time in: {html.escape(', '.join(idle))}.</p>"
            )
    return parts


def _cards(report: FleetReport) -> str:
    later, memory = report.later_turns, report.memory
    never = (
        memory["block_seconds_never_read"] / memory["block_seconds_held"]
        if memory.get("block_seconds_held")
        else None
    )
    insufficient = sum(
        row["verdicts"].get(Verdict.INSUFFICIENT_EVIDENCE.value, 0)
        for row in (report.first_turn, later)
    )
    cards = [
        (
            "Remote hits, later turns",
            percent(later["remote_hit_ratio"]),
            plural(later["turns"], "later turn"),
        ),
        ("Faults, later turns", _faults(later), "turns with a fault verdict: listed below"),
        (
            "TTFT, later turns",
            f"{_seconds(later['ttft_p50_s'])} / {_seconds(later['ttft_p95_s'])}",
            "p50 / p95",
        ),
        (
            "Latency, later turns",
            f"{_seconds(later['latency_p50_s'])} / {_seconds(later['latency_p95_s'])}",
            "p50 / p95",
        ),
        (
            "KV read from D",
            byte_size(later["bytes_read"]),
            f"{plural(later['reused_tokens'], 'token')} reused",
        ),
        (
            "KV loaded from the host tier",
            byte_size(later["host_bytes_loaded"]),
            f"{plural(later['host_reused_tokens'], 'token')}, "
            f"{plural(later['host_path_turns'], 'turn')} judged by the host path",
        ),
        ("D memory never read", percent(never), "share of block-seconds held"),
        ("Insufficient evidence", f"{insufficient:,}", "turns with spans missing"),
    ]
    links = {"Faults, later turns": "#follow-up"}
    return (
        "<div class='cards'>"
        + "".join(
            (f"<a class='card' href='{links[label]}'>" if label in links else "<div class='card'>")
            + f"<div class='label'>{html.escape(label)}</div>"
            f"<div class='value'>{html.escape(value)}</div>"
            f"<div class='sub'>{html.escape(sub)}</div>" + ("</a>" if label in links else "</div>")
            for label, value, sub in cards
        )
        + "</div>"
    )


def _memory(memory: dict[str, Any]) -> str:
    known = {key: (label, fmt) for key, label, fmt in MEMORY}
    rows = []
    for key, value in memory.items():
        name, fmt = known.get(key, (key_label(key), number))
        rows.append(
            f"<tr><th scope='row'>{html.escape(name)}</th>"
            f"<td>{html.escape(fmt(value) if value is not None else '–')}</td></tr>"
        )
    return f"<table class='memory'><tbody>{''.join(rows)}</tbody></table>"


# Each retention figure (kvobs.fleet.retention) by key: its label and formatter.
RETENTION: dict[str, tuple[str, Callable[[Any], str]]] = {
    "block_seconds": ("Held (block-seconds)", number),
    "bytes_per_block": ("Bytes per block (measured from reads)", byte_size),
    "byte_seconds": ("Held (byte-seconds, evicted copies)", number),
    "gib_hours": ("Held (GiB-hours)", number),
    "tokens_served": ("Tokens later turns took from it", count),
    "tokens_per_gib_hour": ("Tokens served per GiB-hour held", number),
    "turns_costed": ("Turns whose hold is costed", count),
    "copies_evicted": ("Copies evicted", count),
    "copies_still_held": ("Copies still held at the end (not costed)", count),
    "byte_seconds_still_held_at_least": ("… their cost so far, at least (byte-seconds)", number),
}


def key_label(key: str) -> str:
    """A figure's key for people, where no label is declared: words, units spelled."""
    words = key.replace("_s", " (s)") if key.endswith("_s") else key
    words = words.replace("_", " ")
    for raw, shown in (
        ("gib hours", "GiB-hours"),
        ("byte seconds", "byte-seconds"),
        ("block seconds", "block-seconds"),
        ("gib", "GiB"),
    ):
        words = words.replace(raw, shown)
    return words[:1].upper() + words[1:]


def _retention(retention: dict[str, Any]) -> str:
    """Each place's cost and what it bought, one row per figure (docs/fleet.md)."""
    rows = []
    for place, title in (("device", "D"), ("host", "Host tier")):
        for key, value in retention.get(place, {}).items():
            name, fmt = RETENTION.get(key, (key_label(key), number))
            shown = fmt(value) if value is not None else "–"
            rows.append(
                f"<tr><th scope='row'>{html.escape(title)}: "
                f"{html.escape(name[:1].lower() + name[1:])}</th>"
                f"<td>{html.escape(shown)}</td></tr>"
            )
    return f"<table class='memory'><tbody>{''.join(rows)}</tbody></table>"


def _anchor(conversation_id: str, tenant: str | None) -> str:
    """The id of a conversation's waterfall on the page."""
    return "waterfall-" + "".join(
        c if c.isalnum() else "-" for c in f"{tenant or ''}-{conversation_id}"
    )


def follow_up(drill: dict[str, Any], drawn: set[str]) -> str:
    """The faulty and slow turns (``kvobs.fleet.report.drill_down``), one row each, with
    the ``kvobs diagnose`` command to run; a conversation whose waterfall is on the page
    links to it."""
    rows = drill.get("rows", [])
    faults, slow = drill.get("fault_turns", 0), drill.get("slow_turns", 0)
    listed = {kind: sum(row["kind"] == kind for row in rows) for kind in ("fault", "slow")}
    note = (
        f"<p class='note'>{plural(faults, 'turn')} with a fault verdict, "
        f"{plural(slow, 'slow turn')} (healthy, latency at or above its scope's p95: "
        "turn 1 and later turns apart). Each row's command explains the turn in full "
        "(verdict, evidence, remedy, phases)."
    )
    hidden = faults - listed["fault"] + slow - listed["slow"]
    if hidden:
        note += (
            f" {plural(hidden, 'more turn')} not listed: <code>kvobs turns --source "
            "SOURCE --format csv</code> lists every turn."
        )
    if not rows:
        return note + "</p><p class='none'>no faulty or slow turn</p>"
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "",
            "Conversation",
            "Turn",
            "Verdict",
            "Latency",
            "Top cause",
            "Trace id",
            "Explain it",
        )
    )
    body = []
    for row in rows:
        anchor = _anchor(row["conversation_id"], row["tenant"])
        name = html.escape(row["conversation_id"])
        if anchor in drawn:
            name = f"<a href='#{anchor}'>{name}</a>"
        cause = row["top_cause"] or "–"
        if row["top_cause"] and row["top_cause_share"] is not None:
            cause += f" ({percent(row['top_cause_share'])})"
        colour = VERDICT_COLOURS.get(row["verdict"], "#d4d4d8")
        body.append(
            f"<tr class='{row['kind']}'><td>{row['kind']}</td><td class='name'>{name}</td>"
            f"<td>{row['turn']}</td><td class='id'><span class='swatch' "
            f"style='background:{colour}'></span>{html.escape(row['verdict'])}</td>"
            f"<td>{_seconds(row['latency_s'])}</td><td class='id'>{html.escape(cause)}</td>"
            f"<td class='id'><code>{html.escape(row['trace_id'] or '–')}</code></td>"
            f"<td class='command'><code class='command'>{html.escape(row['command'])}</code>"
            "</td>"
            "</tr>"
        )
    return (
        note
        + "</p><table class='follow-up'><thead><tr>"
        + head
        + "</tr></thead><tbody>"
        + "".join(body)
        + "</tbody></table>"
    )


def phase_groups() -> str:
    """The phase palette's key: each group (latency cause) with its phases' swatches."""
    items = []
    for group in GROUPS:
        swatches = "".join(
            f"<span class='swatch' style='background:{colour}'></span>{html.escape(phase.value)} "
            for phase, colour in GROUP_COLOURS[group].items()
        )
        items.append(f"<li><b>{html.escape(group.value)}</b>: {swatches}</li>")
    return f"<ul class='legend groups'>{''.join(items)}</ul>"


def _first_tenant(turns: pd.DataFrame, conversation_id: str) -> str | None:
    tenants = turns.loc[turns["conversation_id"] == conversation_id, "tenant"]
    return str(tenants.iloc[0]) if len(tenants) else None


def _figure(caption: str, data: str, alt: str) -> str:
    return (
        f"<h2>{html.escape(caption, quote=False)}</h2><figure>"
        f"<img alt='{html.escape(alt)}' "
        f"src='data:image/png;base64,{data}'></figure>"
    )


STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
 margin:0;color:#1f2937;background:#f8fafc}
main{max-width:1240px;margin:0 auto;padding:24px 32px 48px}
h1{margin:0 0 4px;font-size:26px}h2{margin:36px 0 8px;font-size:20px;
 border-bottom:1px solid #e2e8f0;padding-bottom:4px}h3{margin:18px 0 6px;font-size:15px}
.sub,.note{color:#64748b}.banner{background:#fef3c7;border:1px solid #f59e0b;
 padding:6px 10px;border-radius:6px;display:inline-block;margin-top:8px}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(185px,1fr));gap:10px;
 margin-top:18px}.card{background:#fff;border:1px solid #e2e8f0;border-radius:8px;
 padding:10px 12px}.card .label{font-size:12px;color:#64748b}.card .value{font-size:20px;
 font-weight:600;margin:2px 0;font-variant-numeric:tabular-nums}.card .sub{font-size:11px}
table{border-collapse:collapse;background:#fff;font-size:13px;margin:6px 0}
th,td{border:1px solid #e2e8f0;padding:4px 8px;text-align:right;
 font-variant-numeric:tabular-nums;white-space:nowrap}
thead th{background:#f1f5f9;text-align:center;white-space:normal;font-weight:600}
tbody th{text-align:left;font-weight:500}tbody tr:nth-child(even){background:#f8fafc}
td.phase,td.span{text-align:left}td.span{color:#64748b;font-size:12px}
tr.unmeasured td{color:#64748b;font-style:italic}
.swatch{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:6px;
 vertical-align:-1px;border:1px solid rgba(0,0,0,.15)}
ul.legend{list-style:none;padding:0;margin:6px 0;display:flex;flex-wrap:wrap;gap:4px 16px;
 font-size:13px}ul.legend .note{color:#15803d;font-size:11px}
svg.bars{font-size:12px;fill:#1f2937;display:block}svg.bars text.in{font-size:11px}
figure{margin:8px 0}img{max-width:100%;height:auto;background:#fff;
 border:1px solid #e2e8f0}footer{margin-top:40px;color:#94a3b8;font-size:12px}
table.memory th{min-width:360px}
a.card{color:inherit;text-decoration:none;border-color:#f59e0b}
table.follow-up td.id{text-align:left}table.follow-up td.name{white-space:normal;min-width:140px;
 overflow-wrap:anywhere;text-align:left}table.follow-up code{font-size:11px}
table.follow-up td.command{white-space:normal;text-align:left;min-width:300px}
table.follow-up code.command{user-select:all}
table.follow-up tr.slow td:first-child{color:#64748b}
ul.legend.groups{display:block;columns:2}ul.legend.groups li{margin:2px 0}
figcaption{font-size:12px;color:#64748b}
"""


def render_html(
    report: FleetReport, turns: pd.DataFrame, conversation_id: str | None = None
) -> str:
    import matplotlib

    matplotlib.use("Agg")
    drill = report.extras.get("drill_down", {})
    worst = [
        (cid, _first_tenant(turns, cid) if tenant is None else tenant)
        for cid, tenant in worst_conversations(drill, turns, conversation_id)
    ]
    drawn = {_anchor(cid, tenant) for cid, tenant in worst}
    title = "kvobs fleet report" + (" (SYNTHETIC data)" if report.synthetic else "")
    since = f"; since {html.escape(report.since)}" if report.since else ""
    rate = (
        f"; prefill rate {report.prefill_tokens_per_s:,.0f} tokens/s"
        if report.prefill_tokens_per_s
        else ""
    )
    scopes = [
        {"scope": "turn 1", **report.first_turn},
        {"scope": "later turns", **report.later_turns},
    ]
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width,initial-scale=1'>"
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body><main>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p class='sub'>source {html.escape(report.source)}: "
        f"{plural(report.conversations, 'conversation')}, {plural(report.turns, 'turn')}"
        f"{since}{rate}</p>",
        "<p class='banner'>SYNTHETIC data: generated, not measured</p>" if report.synthetic else "",
        _cards(report),
        "<h2 id='follow-up'>Turns to follow up: faulty and slow</h2>",
        follow_up(drill, drawn),
        "<h2>Verdict mix</h2>",
        _verdict_mix(report),
        "<h2>Later turns by inter-turn gap</h2>",
        _gap_section(turns),
        "<h2>Turn 1 and later turns</h2>",
        _table(scopes, ("scope", "", str), METRICS),
        "<h2>By turn index</h2>",
        _table(
            _ordered(report.by_turn, "turn_bucket", sc.TURN_BUCKET_VALUES),
            ("turn_bucket", "Turn", str),
            METRICS,
        ),
        "<h2>Later turns by prompt length</h2>",
        _table(
            _ordered(report.by_prompt, "prompt_bucket", sc.PROMPT_BUCKET_VALUES),
            ("prompt_bucket", "Prompt (tokens)", str),
            METRICS,
        ),
        "<h2>Where the time went: phases ranked by total seconds</h2>",
        "<p class='note'>Each turn's latency split into consecutive phases between "
        "timeline marks (docs/timeline.md); p50 and p95 are per turn. Each phase "
        "belongs to a group, the latency cause it counts for (docs/timeline.md), "
        "and takes a shade of its group's colour:</p>",
        phase_groups(),
        *phase_tables(report),
    ]
    if worst:
        parts.append(
            "<h2>Per-turn waterfalls of the worst conversations: phases, verdict and top cause</h2>"
        )
    for cid, tenant in worst:
        alt = f"phases of each turn of conversation {cid}"
        parts.append(
            f"<figure id='{_anchor(cid, tenant)}'><img alt='{html.escape(alt)}' "
            f"src='data:image/png;base64,{png(waterfall(turns, cid, tenant))}'>"
            f"<figcaption><code>{html.escape(cid)}</code></figcaption></figure>"
        )
    parts.append(
        _figure(
            "Phase shares of the fleet's latency, p50/p95 per turn",
            png(phase_shares(report)),
            "phase shares and per-turn spread",
        )
    )
    parts.append(
        _figure(
            "Read time vs tokens read, against recomputing them",
            png(read_time_vs_tokens(turns, report.prefill_tokens_per_s)),
            "read time against tokens read",
        )
    )
    parts += [
        "<h2>D memory held for reuse</h2>",
        _memory(report.memory),
        "<h2>Retention cost: D vs the host tier</h2>",
        _retention(report.retention),
        f"<footer>kvobs {__version__}</footer></main></body></html>",
    ]
    return "\n".join(part for part in parts if part)
