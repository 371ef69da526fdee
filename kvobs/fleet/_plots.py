"""The HTML report's matplotlib figures (optional extra ``fleet``), as PNG data:

- per-turn waterfalls of the worst conversations: each turn's phases (``kvobs.timeline``)
  in time order, each named on its segment or in the legend, coloured by group (the
  latency cause it counts for), its verdict and top latency cause (``kvobs.causes``);
- the fleet's phase shares and p50/p95 per turn, turn 1 and later turns apart;
- read time against tokens read, with the recompute line ``M / p``.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pandas as pd

from kvobs.causes import CAUSE_OF, causes, decode_context
from kvobs.fleet.report import FleetReport
from kvobs.semconv import LatencyCause as LC
from kvobs.semconv import Phase, ReadOutcome, Verdict
from kvobs.timeline import PHASES, read_marks, timeline_of
from kvobs.verdicts import Turn

UNMEASURED = "unmeasured"
# Marks are float unix seconds (~0.24 us apart at today's dates): a step not taken can
# read a fraction of a microsecond. Such a segment is not worth a legend entry.
ROUNDING_S = 1e-6
SCOPES = (("first_turn", "turn 1"), ("later_turns", "later turns"))
# Phases grouped by the latency cause they belong to (``kvobs.causes.CAUSE_OF``): one hue
# per group, far apart from the others, and its phases in shades of it (the group's main
# phase darkest). The proxy's overhead is neutral grey, the failed attempt red; decode,
# most turns' largest phase, a plain green.
GROUP_COLOURS: dict[LC, dict[Phase, str]] = {
    LC.PROXY_OVERHEAD: {
        Phase.PROXY_IN: "#525252",
        Phase.PROXY_HOP: "#a3a3a3",
        Phase.PROXY_OUT: "#d4d4d4",
    },
    LC.FAILED_ATTEMPT: {Phase.P_RETRY: "#dc2626"},
    LC.ENGINE_API: {
        Phase.P_FRONTEND: "#9d174d",
        Phase.P_RETURN: "#db2777",
        Phase.D_FRONTEND: "#f9a8d4",
    },
    LC.QUEUED_AT_P: {Phase.P_QUEUE: "#1d4ed8", Phase.READ_WAIT: "#93c5fd"},
    LC.PREFILL_COMPUTE: {Phase.P_COMPUTE: "#6d28d9", Phase.P_SCHEDULE: "#c4b5fd"},
    LC.CONNECTION_SETUP: {Phase.READ_SETUP: "#ea580c", Phase.HANDOFF_SETUP: "#fdba74"},
    LC.SLOW_READ: {Phase.READ: "#0d9488"},
    LC.QUEUED_AT_D: {Phase.D_QUEUE: "#ca8a04", Phase.HANDOFF_WAIT: "#fde047"},
    LC.SLOW_HANDOFF: {Phase.HANDOFF: "#7c2d12"},
    LC.DECODE_BUSY: {Phase.D_FIRST_TOKEN: "#65a30d"},
    LC.LONG_OUTPUT: {Phase.DECODE: "#22c55e"},
}
PHASE_COLOURS = {
    phase: colour for shades in GROUP_COLOURS.values() for phase, colour in shades.items()
}
# Groups in the order their first phase comes in a turn (legends list them so).
GROUPS = sorted(GROUP_COLOURS, key=lambda cause: min(PHASES.index(p) for p in GROUP_COLOURS[cause]))


def group_of(phase: str) -> LC:
    return CAUSE_OF[Phase(phase)]


def dark_text(colour: str) -> bool:
    """Black text reads on the colour (its relative luminance is high), else white."""
    from matplotlib.colors import to_rgb

    r, g, b = (c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in to_rgb(colour))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.3


def png(figure) -> str:
    """The figure as base64 PNG (closed afterwards)."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode()


def phase_colour(phase: str) -> tuple[float, float, float, float]:
    """The phase's colour as RGBA, the same in every plot and in the page's tables."""
    from matplotlib.colors import to_rgba

    return to_rgba(PHASE_COLOURS[Phase(phase)])


def pick_conversation(turns: pd.DataFrame) -> str | None:
    """A conversation worth a waterfall: the longest one that has a fault verdict."""
    if turns.empty:
        return None
    sizes = turns.groupby("conversation_id", observed=True)["turn"].max()
    faulty = turns.loc[
        ~turns["verdict"].isin([Verdict.FIRST_TURN.value, Verdict.REMOTE_HIT.value]),
        "conversation_id",
    ]
    candidates = sizes[sizes.index.isin(set(faulty.astype(str)))]
    return str((candidates if len(candidates) else sizes).idxmax())


def worst_conversations(
    drill: dict, turns: pd.DataFrame, first: str | None = None, count: int = 3
) -> list[tuple[str, str | None]]:
    """(conversation id, tenant) of the conversations worth a waterfall: ``first`` when
    given, then those of the drill-down's turns in its order (faults, slowest first, then
    slow turns), else the longest with a fault (``pick_conversation``)."""
    chosen: list[tuple[str, str | None]] = [(first, None)] if first else []
    for row in drill.get("rows", ()):
        key = (row["conversation_id"], row["tenant"])
        if len(chosen) < count and key not in chosen and (key[0], None) not in chosen:
            chosen.append(key)
    if not chosen:
        fallback = pick_conversation(turns)
        chosen = [(fallback, None)] if fallback else []
    return chosen


def _unmeasured_style() -> dict:
    return {"facecolor": "white", "edgecolor": "gray", "hatch": "///", "label": UNMEASURED}


def _records(rows: pd.DataFrame) -> list[dict]:
    """Rows as plain values, None for missing (what timeline_of and causes read)."""
    return [Turn(row).as_dict() for row in rows.to_dict("records")]


def _conversation(
    turns: pd.DataFrame, conversation_id: str, tenant: str | None = None
) -> pd.DataFrame:
    rows = turns[turns["conversation_id"] == conversation_id]
    # An id several tenants use is several conversations: draw the one asked for, else
    # the first tenant's.
    if len(rows):
        rows = rows[rows["tenant"] == (rows["tenant"].iloc[0] if tenant is None else tenant)]
    return rows.sort_values("turn").reset_index(drop=True)


def _draw_turn(axis, y: int, phases: dict[str, float], legend: dict, label_from_s: float) -> float:
    """A turn's phases as consecutive segments from 0; a merged phase (``a+b``: a missing
    span kept it from being split) is hatched unmeasured in its place. A segment at
    least ``label_from_s`` wide carries its phase's name. Returns the end."""
    left = 0.0
    for name, seconds in phases.items():
        width = max(seconds, 0.0)  # clock skew: a negative phase takes no room
        merged = "+" in name
        style = (
            _unmeasured_style() if merged else {"color": PHASE_COLOURS[Phase(name)], "label": name}
        )
        axis.barh(y, width, left=left, **{k: v for k, v in style.items() if k != "label"})
        if width > ROUNDING_S:
            legend.setdefault(style["label"], style)
        if width >= label_from_s:
            dark = merged or dark_text(PHASE_COLOURS[Phase(name)])
            axis.text(
                left + width / 2,
                y,
                UNMEASURED if merged else name,
                ha="center",
                va="center",
                fontsize=7,
                color="black" if dark else "white",
                clip_on=True,
            )
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


def waterfall(turns: pd.DataFrame, conversation_id: str, tenant: str | None = None):
    """One conversation, one bar per turn: its phases in Phase order, coloured and named
    per phase, unmeasured time hatched, verdict and top cause at the bar's end; the
    legend lists the phases by group (their latency cause)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = _conversation(turns, conversation_id, tenant)
    marks = read_marks(rows)
    context = decode_context(turns)  # the source's typical decode rate, as diagnose
    records = _records(rows)
    timelines = [timeline_of(marks, row, turn) for row, turn in enumerate(records)]
    longest = max((sum(max(s, 0.0) for s in t.phases.values()) for t in timelines), default=0.0)
    figure, axis = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.8))
    legend: dict[str, dict] = {}
    for turn, timeline in zip(records, timelines):
        # A name fits a segment of ~9 % of the axis (the axis is 1.4 x the longest bar).
        end = _draw_turn(axis, turn["turn"], timeline.phases, legend, 0.09 * 1.4 * longest)
        note = _turn_note(turn, context) if timeline.phases else " no timeline"
        axis.text(end, turn["turn"], note, va="center", fontsize=8)
    axis.set_xlim(0, longest * 1.4 or 1.0)  # room for the notes after the longest bar
    axis.set_yticks(rows["turn"].to_numpy())
    axis.invert_yaxis()
    axis.set_xlabel("seconds from the turn's start (proxy received it)")
    axis.set_ylabel("turn")
    tenant = f" (tenant {rows['tenant'].iloc[0]})" if len(rows) and rows["tenant"].iloc[0] else ""
    axis.set_title(f"conversation {conversation_id}{tenant}")
    order = [p.value for group in GROUPS for p in GROUP_COLOURS[group] if p.value in legend] + (
        [UNMEASURED] if UNMEASURED in legend else []
    )
    below_label = 0.6 / (figure.get_figheight() * 0.77)  # ~0.6 in, in axes fraction
    axis.legend(
        handles=[Patch(**legend[name]) for name in order],
        loc="upper center",
        bbox_to_anchor=(0.5, -below_label),
        ncol=6,
        fontsize=8,
    )
    return figure


def shown_phases(report: FleetReport) -> list[str]:
    """Phases some turn spent time in, in the later turns' rank (the larger scope), then
    turn 1's others."""
    order: list[str] = []
    for scope in ("later_turns", "first_turn"):
        order += [
            row["phase"]
            for row in report.phases[scope]["phases"]
            if taken(row) and row["phase"] not in order
        ]
    return order


def taken(row: dict) -> bool:
    """Some turn spent time in the phase: more than mark rounding per measured turn."""
    return (row["total_s"] or 0.0) > ROUNDING_S * max(1, row.get("measured_turns") or 1)


def _share_label(share: float) -> str:
    return " 0" if share == 0 else f" {share:.1%}" if share >= 0.001 else " <0.1%"


def phase_shares(report: FleetReport):
    """Left: each phase's share of the summed latency (and the unmeasured share); right:
    its p50 (dot) to p95 (bar end) seconds per turn, log scale; turn 1 and later turns
    side by side."""
    import matplotlib.pyplot as plt

    names = shown_phases(report)
    labels = names + [UNMEASURED]
    y = np.arange(len(labels))
    figure, (shares, spread) = plt.subplots(
        1, 2, figsize=(11, 0.32 * len(labels) + 1.5), sharey=True
    )
    for i, (scope, title) in enumerate(SCOPES):
        section, offset, colour = report.phases[scope], 0.4 * i - 0.2, f"C{i}"
        by_phase = {row["phase"]: row for row in section["phases"]}
        share = [by_phase[name]["share"] or 0.0 for name in names] + [
            section["unmeasured_share"] or 0.0
        ]
        bars = shares.barh(y + offset, share, height=0.4, label=title, color=colour)
        # Most phases take under 1 %: the numbers say what the bars cannot show.
        shares.bar_label(bars, [_share_label(v) for v in share], fontsize=6)
        # A log axis has no 0: a phase no turn took (p50 0 s) shows no dot.
        p50 = np.array([by_phase[name]["p50_s"] or np.nan for name in names])
        p95 = np.array([by_phase[name]["p95_s"] or np.nan for name in names])
        at = y[: len(names)] + offset
        spread.hlines(at, p50, p95, color=colour)
        spread.plot(p50, at, "o", color=colour, label=f"{title} p50 (to p95)")
    shares.set_yticks(y, labels)
    shares.invert_yaxis()
    shares.set_xlim(0, 1.15)
    shares.xaxis.set_major_formatter(lambda value, _: f"{value:.0%}")
    shares.set_xlabel("share of the summed latency")
    shares.legend(fontsize=8)
    # No phase measured (spans without a timeline): matplotlib refuses a log axis
    # without a positive value; the empty panel stays linear.
    measured = any(row["p95_s"] for scope, _ in SCOPES for row in report.phases[scope]["phases"])
    spread.set_xscale("log" if measured else "linear")
    spread.set_xlabel(
        "seconds per turn (p50 to p95, log scale)"
        if measured
        else "seconds per turn: no phase measured"
    )
    spread.legend(fontsize=8)
    return figure


def read_time_vs_tokens(
    turns: pd.DataFrame, prefill_tokens_per_s: float | None, sample: int = 20000
):
    import matplotlib.pyplot as plt

    done = turns[(turns["read_outcome"] == ReadOutcome.DONE.value).fillna(False)]
    if len(done) > sample:
        done = done.sample(sample, random_state=0)
    tokens = done["candidate_tokens"].astype(float)
    seconds = done["read_duration_s"].astype(float)
    slow = done["verdict"] == Verdict.SLOW_TRANSFER.value
    figure, axis = plt.subplots(figsize=(9, 4))
    axis.scatter(tokens[~slow], seconds[~slow], s=4, alpha=0.4, label="reads")
    axis.scatter(tokens[slow], seconds[slow], s=4, alpha=0.6, color="red", label="slow-transfer")
    if prefill_tokens_per_s and len(tokens):
        xs = np.linspace(max(1.0, float(tokens.min())), float(tokens.max()), 50)
        axis.plot(
            xs,
            xs / prefill_tokens_per_s,
            color="black",
            label=f"recompute M/p (p = {prefill_tokens_per_s:,.0f} tokens/s)",
        )
    axis.set_xlabel("tokens read (M)")
    if (seconds > 0).any():  # a fleet without D reads (host path only) has no log axis
        axis.set_ylabel("read time (s, log scale)")
        axis.set_yscale("log")
    else:
        axis.set_ylabel("read time (s): no reads")
    axis.legend()
    return figure
