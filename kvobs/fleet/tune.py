"""``kvobs tune``: settings from measurements, with the arithmetic shown.

- Break-even read size: reads cost ``a + M * s`` seconds (least-squares fit of measured
  read time on tokens read, ``kvobs.fleet.replay.read_model``: ``a`` fixed cost, ``s``
  seconds per token); recomputing costs ``M / p`` (``p``: measured prefill rate,
  ``kvobs.timeline.prefill_rate``). Reading pays off from ``M* = a / (1/p - s)``;
  ``kv_recompute_threshold`` is ``M*`` rounded up to a block.
- TTL: each candidate TTL is replayed over the recorded turns at that threshold
  (``kvobs.fleet.replay``: the facts the TTL decides rewritten, the verdicts decided by
  ``kvobs.verdicts.decide``): hits are the later turns that read D's KV (remote-hit or
  slow-transfer), memory held is each export's blocks x the time until its next turn
  reads them, or the TTL.
- Proxy entry lifetime: the kvobs proxy's own under the recommended TTL (TTL less its
  expiry margin, ``kvobs.settings``), replayed with every proxy on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pandas as pd

from kvobs.fleet.replay import ReadModel, Recorded, block_seconds, next_turn, read_model, replay
from kvobs.settings import DECLINE_WINDOW, PROXY_EXPIRY_MARGIN, entry_lifetime_s
from kvobs.semconv import Verdict
from kvobs.timeline import prefill_rate
from kvobs.verdicts import Context

__all__ = [
    "Tuning",
    "tune",
    "Plan",
    "plan",
    "choose",
    "ReadModel",
    "read_model",
    "next_turn",
    "replay_ttl",
    "replay_counts",
    "ttl_row",
]

BLOCK_TOKENS = 16
TTL_GRID = (60, 120, 240, 300, 360, 480, 600, 900, 1200, 1800, 3600)
# Verdicts of a later turn that read D's KV.
READ_VERDICTS = (Verdict.REMOTE_HIT.value, Verdict.SLOW_TRANSFER.value)


def reuse_window_s(ttl_s: float, proxy_lifetime_s: float | None) -> float:
    """The longest gap after which a turn can still read D's KV: P declines reads within
    the decline window of D's expiry, and the proxy's entry ends at its lifetime (by
    default the kvobs proxy's under this TTL)."""
    lifetime = entry_lifetime_s(ttl_s) if proxy_lifetime_s is None else proxy_lifetime_s
    return min(ttl_s - DECLINE_WINDOW.default, lifetime)


def replay_counts(
    recorded: Recorded,
    ttl_s: float,
    threshold: int,
    proxy_lifetime_s: float | None,
    model: ReadModel | None,
    context: Context,
) -> tuple[int, int, float]:
    """(hits, later turns, block-seconds held) if D kept KV for ``ttl_s``
    (``kvobs.fleet.replay``): sums, which add up over parts of a fleet."""
    turns = recorded.turns
    replayed = replay(recorded, ttl_s, threshold, proxy_lifetime_s, model, context)
    later = turns["turn"].to_numpy() > 1
    read = np.zeros(len(later), bool)
    for verdict in READ_VERDICTS:
        read |= replayed.verdicts == verdict
    return (
        int((later & read).sum()),
        int(later.sum()),
        block_seconds(turns, replayed.reads, ttl_s, recorded.modes),
    )


def ttl_row(
    ttl_s: float, proxy_lifetime_s: float | None, counts: tuple[int, int, float]
) -> dict[str, float]:
    """A TTL candidate's predicted reuse and memory from its ``replay_counts``."""
    hits, later, held = counts
    return {
        "ttl_s": float(ttl_s),
        "reuse_window_s": reuse_window_s(ttl_s, proxy_lifetime_s),
        "hits": hits,
        "hit_ratio": float(hits / later) if later else 0.0,
        "block_seconds": held,
    }


def replay_ttl(
    recorded: Recorded,
    ttl_s: float,
    threshold: int,
    proxy_lifetime_s: float | None,
    model: ReadModel | None,
    context: Context,
) -> dict[str, float]:
    """Predicted reuse and memory if D kept KV for ``ttl_s`` (``kvobs.fleet.replay``)."""
    counts = replay_counts(recorded, ttl_s, threshold, proxy_lifetime_s, model, context)
    return ttl_row(ttl_s, proxy_lifetime_s, counts)


@dataclass
class Tuning:
    prefill_tokens_per_s: float | None
    read: ReadModel | None
    break_even_tokens: float | None
    recommended_threshold: int | None
    current_threshold: int | None
    current_ttl_s: float | None
    ttl_table: list[dict[str, float]]
    recommended_ttl_s: float | None
    recommended_proxy_lifetime_s: float | None
    proxy_prediction: dict[str, float] | None
    arithmetic: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["read"] = dict(self.read.__dict__) if self.read else None
        return out


@dataclass
class Plan:
    """What ``tune`` settles before replaying: the break-even threshold from the read
    model and the prefill rate, the threshold the TTL candidates replay at and the
    candidates (with the arithmetic so far)."""

    rate: float | None
    model: ReadModel | None
    current_threshold: int | None
    current_ttl: float | None
    break_even: float | None
    recommended: int | None
    threshold: int
    grid: list[float]
    lines: list[str]

    def replays(self) -> list[tuple[float, float | None]]:
        """Every (TTL, proxy lifetime) ``choose`` may ask for: each candidate with each
        proxy as recorded, and with the kvobs proxy's lifetime under it."""
        return [(ttl, None) for ttl in self.grid] + [
            (ttl, entry_lifetime_s(ttl)) for ttl in self.grid
        ]


def plan(
    rate: float | None,
    model: ReadModel | None,
    current_threshold: int | None,
    current_ttl: float | None,
) -> Plan:
    lines: list[str] = []
    break_even = recommended = None
    if rate and model:
        lines.append(
            f"prefill rate p = {rate:,.0f} tokens/s (median over turns that read "
            f"nothing: computed tokens / P leg time)"
        )
        lines.append(
            f"read time = {model.fixed_s * 1e3:.3f} ms + M x {model.s_per_token * 1e6:.3f}"
            f" us/token (least squares over {model.reads:,} reads"
            + (f"; {model.bytes_per_s / 1e9:.2f} GB/s" if model.bytes_per_s else "")
            + ")"
        )
        per_token_gain = 1.0 / rate - model.s_per_token
        if per_token_gain > 0:
            break_even = model.fixed_s / per_token_gain
            recommended = max(
                BLOCK_TOKENS, int(math.ceil(break_even / BLOCK_TOKENS)) * BLOCK_TOKENS
            )
            lines.append(
                f"break-even M* = a / (1/p - s) = {model.fixed_s * 1e3:.3f} ms / "
                f"({1e6 / rate:.3f} - {model.s_per_token * 1e6:.3f}) us/token = "
                f"{break_even:,.1f} tokens -> kv_recompute_threshold = "
                f"{recommended} (rounded up to a {BLOCK_TOKENS}-token block; now "
                f"{current_threshold})"
            )
        else:
            lines.append(
                "reading a token costs more than computing it: reads never pay "
                "off; fix the P<->D link before tuning the threshold"
            )
    else:
        lines.append(
            "no break-even: need turns that read (read model) and turns that "
            "computed without reading (prefill rate)"
        )
    threshold = int(recommended or current_threshold or 0)
    grid = sorted(set(TTL_GRID) | ({float(current_ttl)} if current_ttl else set()))
    return Plan(
        rate,
        model,
        current_threshold,
        current_ttl,
        break_even,
        recommended,
        threshold,
        grid,
        lines,
    )


def choose(
    settled: Plan,
    replayed: Callable[[float, float | None], dict[str, float]],
    target: float = 0.95,
) -> Tuning:
    """The TTL and proxy lifetime from the candidates' replays (``replayed(ttl,
    lifetime)``: ``ttl_row``'s row for the plan's threshold)."""
    lines = list(settled.lines)
    table = [replayed(ttl, None) for ttl in settled.grid]
    best = max(row["hit_ratio"] for row in table) if table else 0.0
    chosen = next((row for row in table if row["hit_ratio"] >= target * best), None)
    recommended_ttl = chosen["ttl_s"] if chosen and best > 0 else None
    proxy_lifetime = proxy_prediction = None
    if chosen is not None and recommended_ttl:
        lines.append(
            f"TTL: smallest candidate reaching {target:.0%} of the best hit ratio "
            f"over the grid ({best:.1%}): {recommended_ttl:.0f} s, hit ratio "
            f"{chosen['hit_ratio']:.1%}, {chosen['block_seconds']:,.0f} block-s held"
        )
        proxy_lifetime = entry_lifetime_s(recommended_ttl)
        proxy_prediction = replayed(recommended_ttl, proxy_lifetime)
        lines.append(
            f"proxy entry lifetime = TTL - expiry margin {PROXY_EXPIRY_MARGIN} = "
            f"{proxy_lifetime:.0f} s (the kvobs proxy's default: it drops an entry "
            f"before P would decline its read): hit ratio "
            f"{proxy_prediction['hit_ratio']:.1%} with every proxy on it"
        )
    return Tuning(
        settled.rate,
        settled.model,
        settled.break_even,
        settled.recommended,
        settled.current_threshold,
        settled.current_ttl,
        table,
        recommended_ttl,
        proxy_lifetime,
        proxy_prediction,
        lines,
    )


def tune(
    turns: pd.DataFrame, target: float = 0.95, prefill_tokens_per_s: float | None = None
) -> Tuning:
    """``turns``: a labelled turn table (``kvobs.fleet.report.label_turns``)."""
    rate = prefill_tokens_per_s or prefill_rate(turns)
    model = read_model(turns)
    settled = plan(rate, model, _mode(turns["threshold"]), _mode(turns["ttl_s"]))
    context, recorded = Context(rate), Recorded(turns)

    def replayed(ttl: float, lifetime: float | None) -> dict[str, float]:
        return replay_ttl(recorded, ttl, settled.threshold, lifetime, model, context)

    return choose(settled, replayed, target)


def _mode(values: pd.Series):
    values = values.dropna()
    if values.empty:
        return None
    value = values.mode().iloc[0]
    return value.item() if hasattr(value, "item") else value
