"""The HTML fleet report: tables plus four plots (matplotlib, optional extra ``fleet``).

- per-turn waterfall of one conversation: each turn's phases (``kvobs.timeline``) in time
  order, its verdict and top latency cause (``kvobs.causes``);
- the fleet's phase shares and p50/p95 per turn, turn 1 and later turns apart;
- remote-hit ratio against the inter-turn gap, D's TTL marked;
- read time against tokens read, with the recompute line ``M / p``.
"""

from __future__ import annotations

import base64
import html
import io
import json

import numpy as np
import pandas as pd

from kvobs.causes import causes, decode_context
from kvobs.fleet.report import FleetReport
from kvobs.semconv import Phase, ReadOutcome, Verdict
from kvobs.timeline import PHASES, read_marks, timeline_of
from kvobs.verdicts import Turn

UNMEASURED = "unmeasured"
# Marks are float unix seconds (~0.24 us apart at today's dates): a step not taken can
# read a fraction of a microsecond. Such a segment is not worth a legend entry.
ROUNDING_S = 1e-6
SCOPES = (("first_turn", "turn 1"), ("later_turns", "later turns"))


def _png(figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode()


def pick_conversation(turns: pd.DataFrame) -> str | None:
    """A conversation worth a waterfall: the longest one that has a fault verdict."""
    if turns.empty:
        return None
    sizes = turns.groupby("conversation_id", observed=True)["turn"].max()
    faulty = turns.loc[~turns["verdict"].isin(
        [Verdict.FIRST_TURN.value, Verdict.REMOTE_HIT.value]), "conversation_id"]
    candidates = sizes[sizes.index.isin(set(faulty.astype(str)))]
    return str((candidates if len(candidates) else sizes).idxmax())


def phase_colour(phase: str):
    """One colour per phase, the same in every plot: tab20's ten dark colours for the
    first ten phases, then its light ones, so neighbouring phases never share a hue."""
    import matplotlib

    index = PHASES.index(Phase(phase))
    return matplotlib.colormaps["tab20"](2 * index % 20 + index // 10)


def _unmeasured_style() -> dict:
    return {"facecolor": "white", "edgecolor": "gray", "hatch": "///", "label": UNMEASURED}


def _records(rows: pd.DataFrame) -> list[dict]:
    """Rows as plain values, None for missing (what timeline_of and causes read)."""
    return [Turn(row).as_dict() for row in rows.to_dict("records")]


def _conversation(turns: pd.DataFrame, conversation_id: str) -> pd.DataFrame:
    rows = turns[turns["conversation_id"] == conversation_id]
    # An id several tenants use is several conversations: draw the first tenant's.
    rows = rows[rows["tenant"] == rows["tenant"].iloc[0]] if len(rows) else rows
    return rows.sort_values("turn").reset_index(drop=True)


def _draw_turn(axis, y: int, phases: dict[str, float], legend: dict) -> float:
    """A turn's phases as consecutive segments from 0; a merged phase (``a+b``: a missing
    span kept it from being split) is hatched unmeasured in its place. Returns the end."""
    left = 0.0
    for name, seconds in phases.items():
        width = max(seconds, 0.0)  # clock skew: a negative phase takes no room
        style = (_unmeasured_style() if "+" in name
                 else {"color": phase_colour(name), "label": name})
        axis.barh(y, width, left=left, **{k: v for k, v in style.items() if k != "label"})
        if width > ROUNDING_S:
            legend.setdefault(style["label"], style)
        left += width
    return left


def _turn_note(turn: dict, context) -> str:
    """Verdict, then the top latency cause and its share of the turn's latency."""
    found = causes(turn, context)
    if not found:
        return f" {turn['verdict']}"
    top = found[0]
    share = f" {top.share:.0%}" if top.share is not None else ""
    return f" {turn['verdict']} | {top.cause.value}{share}"


def waterfall(turns: pd.DataFrame, conversation_id: str):
    """One conversation, one bar per turn: its phases in Phase order, coloured per phase,
    unmeasured time hatched, verdict and top cause at the bar's end."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = _conversation(turns, conversation_id)
    marks = read_marks(rows)
    context = decode_context(turns)  # the source's typical decode rate, as diagnose
    figure, axis = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.6))
    legend: dict[str, dict] = {}
    longest = 0.0
    for row, turn in enumerate(_records(rows)):
        timeline = timeline_of(marks, row, turn)
        end = _draw_turn(axis, turn["turn"], timeline.phases, legend)
        note = _turn_note(turn, context) if timeline.phases else " no timeline"
        axis.text(end, turn["turn"], note, va="center", fontsize=8)
        longest = max(longest, end)
    axis.set_xlim(0, longest * 1.4 or 1.0)  # room for the notes after the longest bar
    axis.set_yticks(rows["turn"].to_numpy())
    axis.invert_yaxis()
    axis.set_xlabel("seconds from the turn's first mark")
    axis.set_ylabel("turn")
    tenant = f" (tenant {rows['tenant'].iloc[0]})" if len(rows) and rows["tenant"].iloc[0] else ""
    axis.set_title(f"conversation {conversation_id}{tenant}")
    order = [p.value for p in PHASES if p.value in legend] + (
        [UNMEASURED] if UNMEASURED in legend else [])
    below_label = 0.6 / (figure.get_figheight() * 0.77)  # ~0.6 in, in axes fraction
    axis.legend(handles=[Patch(**legend[name]) for name in order], loc="upper center",
                bbox_to_anchor=(0.5, -below_label), ncol=6, fontsize=7)
    return figure


def _share_rows(report: FleetReport) -> list[str]:
    """Phases some turn spent time in, in the later turns' rank (the larger scope), then
    turn 1's others."""
    order: list[str] = []
    for scope in ("later_turns", "first_turn"):
        order += [row["phase"] for row in report.phases[scope]["phases"]
                  if row["total_s"] and row["phase"] not in order]
    return order


def _share_label(share: float) -> str:
    return " 0" if share == 0 else f" {share:.1%}" if share >= 0.001 else " <0.1%"


def phase_shares(report: FleetReport):
    """Left: each phase's share of the summed latency (and the unmeasured share); right:
    its p50 (dot) to p95 (bar end) seconds per turn, log scale; turn 1 and later turns
    side by side."""
    import matplotlib.pyplot as plt

    names = _share_rows(report)
    labels = names + [UNMEASURED]
    y = np.arange(len(labels))
    figure, (shares, spread) = plt.subplots(
        1, 2, figsize=(11, 0.32 * len(labels) + 1.5), sharey=True)
    for i, (scope, title) in enumerate(SCOPES):
        section, offset, colour = report.phases[scope], 0.4 * i - 0.2, f"C{i}"
        by_phase = {row["phase"]: row for row in section["phases"]}
        share = [by_phase[name]["share"] or 0.0 for name in names] + [
            section["unmeasured_share"] or 0.0]
        bars = shares.barh(y + offset, share, height=0.4, label=title, color=colour)
        # Most phases take under 1 %: the numbers say what the bars cannot show.
        shares.bar_label(bars, [_share_label(v) for v in share], fontsize=6)
        # A log axis has no 0: a phase no turn took (p50 0 s) shows no dot.
        p50 = np.array([by_phase[name]["p50_s"] or np.nan for name in names])
        p95 = np.array([by_phase[name]["p95_s"] or np.nan for name in names])
        at = y[:len(names)] + offset
        spread.hlines(at, p50, p95, color=colour)
        spread.plot(p50, at, "o", color=colour, label=f"{title} p50 (to p95)")
    shares.set_yticks(y, labels)
    shares.invert_yaxis()
    shares.set_xlim(0, 1.15)
    shares.set_xlabel("share of summed latency")
    shares.legend(fontsize=8)
    spread.set_xscale("log")
    spread.set_xlabel("seconds per turn (p50 to p95)")
    spread.legend(fontsize=8)
    return figure


def hit_ratio_vs_gap(turns: pd.DataFrame):
    import matplotlib.pyplot as plt

    later = turns[turns["turn"] > 1]
    gap = later["gap_s"].astype(float)
    hit = (later["verdict"] == Verdict.REMOTE_HIT.value).astype(float)
    edges = np.logspace(0, np.log10(max(float(gap.max() or 10), 10)) + 0.01, 30)
    bins = pd.cut(gap, edges)
    ratio = hit.groupby(bins, observed=True).mean()
    count = hit.groupby(bins, observed=True).size()
    centers = [interval.mid for interval in ratio.index]
    figure, axis = plt.subplots(figsize=(9, 4))
    axis.plot(centers, ratio.to_numpy(), marker="o")
    axis.set_xscale("log")
    axis.set_ylim(0, 1)
    ttl = turns["ttl_s"].dropna()
    if len(ttl):
        axis.axvline(float(ttl.median()), color="red", linestyle="--",
                     label=f"D TTL {float(ttl.median()):.0f} s")
    twin = axis.twinx()
    twin.bar(centers, count.to_numpy(), width=np.diff(edges)[:len(centers)], alpha=0.15,
             color="gray")
    twin.set_ylabel("turns")
    axis.set_xlabel("inter-turn gap (s)")
    axis.set_ylabel("remote-hit ratio")
    axis.legend(loc="upper right")
    return figure


def read_time_vs_tokens(turns: pd.DataFrame, prefill_tokens_per_s: float | None,
                        sample: int = 20000):
    import matplotlib.pyplot as plt

    done = turns[(turns["read_outcome"] == ReadOutcome.DONE.value).fillna(False)]
    if len(done) > sample:
        done = done.sample(sample, random_state=0)
    tokens = done["candidate_tokens"].astype(float)
    seconds = done["read_duration_s"].astype(float)
    slow = done["verdict"] == Verdict.SLOW_TRANSFER.value
    figure, axis = plt.subplots(figsize=(9, 4))
    axis.scatter(tokens[~slow], seconds[~slow], s=3, alpha=0.3, label="reads")
    axis.scatter(tokens[slow], seconds[slow], s=3, alpha=0.5, color="red",
                 label="slow-transfer")
    if prefill_tokens_per_s and len(tokens):
        xs = np.linspace(0, float(tokens.max()), 50)
        axis.plot(xs, xs / prefill_tokens_per_s, color="black",
                  label=f"recompute M/p (p={prefill_tokens_per_s:,.0f} tok/s)")
    axis.set_xlabel("tokens read (M)")
    axis.set_ylabel("read time (s)")
    axis.set_yscale("log")
    axis.legend()
    return figure


PHASE_KEYS = ["rank", "phase", "total_s", "share", "p50_s", "p95_s", "slowest_turns",
              "measured_turns"]
METRIC_KEYS = ["turns", "remote_hit_ratio", "bytes_read", "reused_tokens",
               "recomputed_tokens", "ttft_p50_s", "ttft_p95_s", "ttft_unmeasured_turns",
               "latency_p50_s", "latency_p95_s", "verdicts"]


def _table(rows, keys) -> str:
    if not rows:
        return "<p>none</p>"
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    body = "".join("<tr>" + "".join(
        f"<td>{html.escape(_cell(row.get(k)))}</td>" for k in keys) + "</tr>"
        for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def phase_tables(report: FleetReport) -> list[str]:
    """Per scope: its ranked phases, then the unmeasured rest of its latency."""
    parts = []
    for scope, title in SCOPES:
        section = report.phases[scope]
        rows = [{"rank": rank, **row} for rank, row in enumerate(section["phases"], 1)]
        rows.append({"phase": f"{UNMEASURED} ({section['unmeasured_turns']:,} turns)",
                     "total_s": section["unmeasured_s"],
                     "share": section["unmeasured_share"]})
        parts += [f"<h3>{title}: {section['timed_turns']:,} turns with a latency, "
                  f"{section['latency_s']:,.1f} s in all</h3>", _table(rows, PHASE_KEYS)]
    return parts


def render_html(report: FleetReport, turns: pd.DataFrame,
                conversation_id: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    conversation_id = conversation_id or pick_conversation(turns)
    images = []
    if conversation_id:
        images.append(("Per-turn waterfall: phases, verdict and top cause",
                       _png(waterfall(turns, conversation_id))))
    images.append(("Phase shares of the fleet's latency, p50/p95 per turn",
                   _png(phase_shares(report))))
    images.append(("Remote-hit ratio vs inter-turn gap", _png(hit_ratio_vs_gap(turns))))
    images.append(("Read time vs tokens", _png(read_time_vs_tokens(
        turns, report.prefill_tokens_per_s))))
    title = "kvobs fleet report" + (" (SYNTHETIC data)" if report.synthetic else "")
    keys = METRIC_KEYS
    parts = [f"<html><head><meta charset='utf-8'><title>{title}</title><style>"
             "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>",
             f"<p>source {html.escape(report.source)}; {report.conversations:,} "
             f"conversations, {report.turns:,} turns"
             + (f"; since {html.escape(report.since)}" if report.since else "") + "</p>",
             "<h2>Turn 1 and later turns</h2>",
             _table([{"scope": "turn 1", **report.first_turn},
                     {"scope": "later turns", **report.later_turns}], ["scope", *keys]),
             "<h2>Where the time went: phases ranked by total seconds</h2>",
             *phase_tables(report),
             "<h2>By turn index</h2>", _table(report.by_turn, ["turn_bucket", *keys]),
             "<h2>Later turns by prompt length</h2>",
             _table(report.by_prompt, ["prompt_bucket", *keys]),
             "<h2>D memory held for reuse</h2>",
             _table([report.memory], list(report.memory))]
    for caption, data in images:
        parts.append(f"<h2>{caption}</h2><img src='data:image/png;base64,{data}'/>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return json.dumps(value)
    return f"{value:,}" if isinstance(value, int) else str(value)
