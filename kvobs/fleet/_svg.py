"""Stacked share bars as inline SVG: crisp at any zoom, each segment with a tooltip, no
script. The HTML report draws its verdict mixes with them."""

from __future__ import annotations

import html
from typing import Mapping, Sequence

from kvobs.render import plural

ROW_HEIGHT = 24
LABEL_WIDTH = 170
BAR_WIDTH = 560
COUNT_WIDTH = 110
# Segments narrower than this carry no printed share (the tooltip still has it).
LABELLED_FROM = 38


def stacked_bars(
    rows: Sequence[tuple[str, Mapping[str, int]]],
    order: Sequence[str],
    colours: Mapping[str, str],
    dark_text: frozenset[str] = frozenset(),
    noun: str = "turn",
    title: str = "",
) -> str:
    """One bar per ``(label, counts)`` row, its segments in ``order``, each as wide as
    its share of the row; the row's total (``noun`` counted) after the bar."""
    height = ROW_HEIGHT * len(rows) + 4
    width = LABEL_WIDTH + BAR_WIDTH + COUNT_WIDTH
    parts = [
        f'<svg class="bars" role="img" xmlns="http://www.w3.org/2000/svg" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
        + (f"<title>{html.escape(title)}</title>" if title else "")
    ]
    for i, (label, counts) in enumerate(rows):
        y = i * ROW_HEIGHT + 2
        total = sum(counts.values())
        parts.append(
            f'<text x="{LABEL_WIDTH - 8}" y="{y + 16}" text-anchor="end">'
            f"{html.escape(label)}</text>"
        )
        x = float(LABEL_WIDTH)
        for key in order:
            count = counts.get(key, 0)
            if not count:
                continue
            share = count / total
            w = share * BAR_WIDTH
            tip = f"{label}: {key} {count:,} of {plural(total, noun)} ({share:.1%})"
            parts.append(
                f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{ROW_HEIGHT - 4}"'
                f' fill="{colours[key]}"><title>{html.escape(tip)}</title></rect>'
            )
            if w >= LABELLED_FROM:
                fill = "#111" if key in dark_text else "#fff"
                parts.append(
                    f'<text x="{x + w / 2:.1f}" y="{y + 15}" text-anchor="middle" '
                    f'fill="{fill}" class="in">{share:.0%}</text>'
                )
            x += w
        parts.append(
            f'<text x="{LABEL_WIDTH + BAR_WIDTH + 8}" y="{y + 16}">{plural(total, noun)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def legend(
    keys: Sequence[str], colours: Mapping[str, str], notes: Mapping[str, str] | None = None
) -> str:
    """Swatches with their names (and a note each, when given)."""
    notes = notes or {}
    items = "".join(
        f'<li><span class="swatch" style="background:{colours[key]}"></span>'
        f"{html.escape(key)}"
        + (f' <span class="note">{html.escape(notes[key])}</span>' if key in notes else "")
        + "</li>"
        for key in keys
    )
    return f'<ul class="legend">{items}</ul>'
