"""One conversation as a page: per turn its verdict, remedy, causes and a waterfall of
its phases (widths to scale of the slowest turn). Self-contained HTML, every value
escaped; ids and numbers only, as the turn rows hold them."""

from __future__ import annotations

import html
from typing import Any

from kvobs.render import duration

_STYLE = """body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #ddd;padding:.35em;
text-align:left;vertical-align:top}.bar{display:flex;height:1.1em;min-width:1px}
.bar span{display:block;height:100%}.ok{color:#216e39}.fault{color:#b3261e}
.proxy{background:#9e9e9e}.p{background:#1f77b4}.read{background:#ff7f0e}
.d{background:#2ca02c}.decode{background:#98df8a}small{color:#666}"""
# Phase groups, coloured apart (a phase's own name is in its tooltip).
_GROUPS = {"proxy": "proxy", "p": "p", "read": "read", "handoff": "d", "d": "d", "decode": "decode"}


def _group(phase: str) -> str:
    head = phase.split("+")[0]
    if head.startswith(("read", "handoff")):
        return "read"
    if head == "decode":
        return "decode"
    return _GROUPS.get(head.split("-")[0], "proxy")


def _waterfall(turn: dict[str, Any], scale: float) -> str:
    parts = []
    for phase, seconds in (turn.get("phases") or {}).items():
        if not isinstance(seconds, (int, float)) or seconds <= 0:
            continue
        width = 100.0 * seconds / scale
        title = html.escape(f"{phase}: {duration(seconds)}")
        parts.append(
            f'<span class="{_group(phase)}" style="width:{width:.3f}%" title="{title}"></span>'
        )
    return f'<div class="bar">{"".join(parts)}</div>'


def conversation_html(conversation_id: str, turns: list[dict[str, Any]]) -> str:
    from kvobs.semconv import HEALTHY_VERDICTS

    healthy = {v.value for v in HEALTHY_VERDICTS}
    scale = max((t.get("latency_s") or 0 for t in turns), default=0) or 1.0
    rows = []
    for turn in turns:
        verdict = str(turn.get("verdict"))
        causes = ", ".join(html.escape(str(c.get("cause"))) for c in turn.get("causes") or ())
        state = "final" if turn.get("final") else "open"
        rows.append(
            f"<tr><td>{html.escape(str(turn.get('turn')))}</td>"
            f'<td class="{"ok" if verdict in healthy else "fault"}">{html.escape(verdict)}'
            f"</td><td>{html.escape(duration(turn.get('latency_s')))}</td>"
            f"<td>{html.escape(str(turn.get('slowest_phase') or '-'))}</td>"
            f'<td>{causes or "-"}</td><td style="width:30%">{_waterfall(turn, scale)}</td>'
            f"<td>{html.escape(str(turn.get('remedy') or ''))}<br><small>trace "
            f"{html.escape(str(turn.get('trace_id') or '-'))} · v{turn.get('version', 1)} "
            f"{state}</small></td></tr>"
        )
    title = html.escape(f"kvobs: {conversation_id}")
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{_STYLE}</style></head><body><h1>{title}</h1>"
        "<table><tr><th>turn</th><th>verdict</th><th>latency</th><th>slowest phase</th>"
        "<th>causes</th><th>where the time went</th><th>remedy</th></tr>"
        f"{''.join(rows)}</table></body></html>"
    )
