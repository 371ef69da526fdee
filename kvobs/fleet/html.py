"""The HTML fleet report: tables plus three plots (matplotlib, optional extra ``fleet``).

- per-turn waterfall of one conversation (read, recompute, rest of TTFT, decode);
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

from kvobs.fleet.report import FleetReport
from kvobs.semconv import ReadOutcome, Verdict


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


def waterfall(turns: pd.DataFrame, conversation_id: str):
    import matplotlib.pyplot as plt

    rows = turns[turns["conversation_id"] == conversation_id]
    # An id several tenants use is several conversations: draw the first tenant's.
    rows = rows[rows["tenant"] == rows["tenant"].iloc[0]] if len(rows) else rows
    rows = rows.sort_values("turn")
    figure, axis = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    y = rows["turn"].to_numpy()
    read = rows["read_duration_s"].astype(float).fillna(0).to_numpy()
    leg = rows["prefill_leg_s"].astype(float).fillna(0).to_numpy()
    ttft = rows["ttft_s"].astype(float).fillna(0).to_numpy()
    total = ((rows["turn_end_ns"].astype(float) - rows["turn_start_ns"].astype(float))
             / 1e9).fillna(0).to_numpy()
    compute = np.maximum(leg - read, 0)
    wait = np.maximum(ttft - leg, 0)
    decode = np.maximum(total - ttft, 0)
    left = np.zeros(len(rows))
    for width, label, color in ((wait, "queue/other", "#cccccc"), (read, "KV read", "#2b8cbe"),
                                (compute, "P compute", "#e34a33"),
                                (decode, "decode", "#a1d99b")):
        axis.barh(y, width, left=left, color=color, label=label)
        left = left + width
    for turn, end, verdict in zip(y, left, rows["verdict"]):
        axis.text(end, turn, f" {verdict}", va="center", fontsize=8)
    axis.set_xscale("symlog", linthresh=0.01)
    axis.invert_yaxis()
    axis.set_xlabel("seconds from turn start")
    axis.set_ylabel("turn")
    tenant = f" (tenant {rows['tenant'].iloc[0]})" if len(rows) and rows["tenant"].iloc[0] else ""
    axis.set_title(f"conversation {conversation_id}{tenant}")
    axis.legend(loc="lower right", fontsize=8)
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


def render_html(report: FleetReport, turns: pd.DataFrame,
                conversation_id: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    conversation_id = conversation_id or pick_conversation(turns)
    images = []
    if conversation_id:
        images.append(("Per-turn waterfall", _png(waterfall(turns, conversation_id))))
    images.append(("Remote-hit ratio vs inter-turn gap", _png(hit_ratio_vs_gap(turns))))
    images.append(("Read time vs tokens", _png(read_time_vs_tokens(
        turns, report.prefill_tokens_per_s))))
    title = "kvobs fleet report" + (" (SYNTHETIC data)" if report.synthetic else "")

    def table(rows, keys):
        if not rows:
            return "<p>none</p>"
        head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
        body = "".join("<tr>" + "".join(
            f"<td>{html.escape(_cell(row.get(k)))}</td>" for k in keys) + "</tr>"
            for row in rows)
        return f"<table><tr>{head}</tr>{body}</table>"

    keys = ["turns", "remote_hit_ratio", "bytes_read", "reused_tokens", "recomputed_tokens",
            "ttft_p50_s", "ttft_p95_s", "verdicts"]
    parts = [f"<html><head><meta charset='utf-8'><title>{title}</title><style>"
             "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>",
             f"<p>source {html.escape(report.source)}; {report.conversations:,} "
             f"conversations, {report.turns:,} turns"
             + (f"; since {html.escape(report.since)}" if report.since else "") + "</p>",
             "<h2>Turn 1 and later turns</h2>",
             table([{"scope": "turn 1", **report.first_turn},
                    {"scope": "later turns", **report.later_turns}], ["scope", *keys]),
             "<h2>By turn index</h2>", table(report.by_turn, ["turn_bucket", *keys]),
             "<h2>Later turns by prompt length</h2>",
             table(report.by_prompt, ["prompt_bucket", *keys]),
             "<h2>D memory held for reuse</h2>",
             table([report.memory], list(report.memory))]
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
