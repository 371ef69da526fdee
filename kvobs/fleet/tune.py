"""``kvobs tune``: settings from measurements, with the arithmetic shown.

- Break-even read size: reads cost ``a + M * s`` seconds (least-squares fit of measured
  read time on tokens read: ``a`` fixed cost, ``s`` seconds per token); recomputing costs
  ``M / p`` (``p``: measured prefill rate, ``kvobs.timeline.prefill_rate``). Reading pays
  off from ``M* = a / (1/p - s)``; ``kv_recompute_threshold`` is ``M*`` rounded up to a
  block.
- TTL: a later turn can reuse D's KV when its gap is below ``ttl - 5 s`` (P declines reads
  that close to expiry) and below the proxy's entry lifetime. Each candidate TTL is
  replayed over the recorded gaps: predicted hit ratio, and memory held (each export's
  blocks x the time until its next turn reads them, or the TTL).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from kvobs.correlate import follows
from kvobs.timeline import prefill_rate
from kvobs import semconv as sc
from kvobs.semconv import ReadOutcome, Verdict

DECLINE_WINDOW_S = sc.VLLM_DECLINE_WINDOW_S
PROXY_MARGIN_S = 30.0  # proxy entry lifetime below D's TTL (defaults: 450 vs 480 s)
BLOCK_TOKENS = 16
TTL_GRID = (60, 120, 240, 300, 360, 480, 600, 900, 1200, 1800, 3600)
# Verdicts whose outcome depends on D still holding the KV (TTL) and on the threshold.
REUSE_VERDICTS = frozenset({Verdict.REMOTE_HIT.value, Verdict.SLOW_TRANSFER.value,
                            Verdict.EXPIRED.value, Verdict.BELOW_THRESHOLD.value,
                            Verdict.LOCAL_HIT.value})


@dataclass
class ReadModel:
    """Measured read cost: ``seconds = fixed_s + tokens * s_per_token``."""

    fixed_s: float
    s_per_token: float
    reads: int
    bytes_per_s: float | None

    def seconds(self, tokens):
        return self.fixed_s + np.asarray(tokens, float) * self.s_per_token


def read_model(turns: pd.DataFrame) -> ReadModel | None:
    done = (turns["read_outcome"] == ReadOutcome.DONE.value).fillna(False).to_numpy(bool)
    tokens = turns["candidate_tokens"].astype(float).to_numpy()
    seconds = turns["read_duration_s"].astype(float).to_numpy()
    usable = done & (tokens > 0) & np.isfinite(seconds)
    if usable.sum() < 2:
        return None
    x, y = tokens[usable], seconds[usable]
    # Robust to a tail of slow reads: fit on reads up to the 90th percentile of cost/token.
    per_token = y / x
    keep = per_token <= np.quantile(per_token, 0.9)
    if keep.sum() >= 2 and np.ptp(x[keep]) > 0:
        x, y = x[keep], y[keep]
    intercept, slope = _fit(x, y)
    read_bytes = turns["read_bytes"].astype(float).to_numpy()[usable]
    total_s = seconds[usable].sum()
    return ReadModel(intercept, slope, int(usable.sum()),
                     float(np.nansum(read_bytes) / total_s) if total_s > 0 else None)


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(fixed seconds, seconds per token), both >= 0, least squares within that bound.

    Reads of similar sizes with noisy times give a line of any slope and a negative
    intercept; clamping only the intercept keeps that slope (a 1 ms read of 139 tokens
    then "costs" 0.5 ms per token). Refit with the bound active instead: through the
    origin when the intercept would be negative, flat when the slope would be."""
    if np.ptp(x) > 0:
        slope, intercept = (float(v) for v in np.polyfit(x, y, 1))
        if intercept >= 0 and slope >= 0:
            return intercept, slope
        if intercept < 0:
            slope = float(x @ y / (x @ x))
            if slope >= 0:
                return 0.0, slope
    return max(0.0, float(np.mean(y))), 0.0


def next_turn(turns: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """For each row: whether the conversation's next turn follows it, and that turn's row."""
    n = len(turns)
    has_next = np.zeros(n, bool)
    has_next[:-1] = follows(turns)[1:]
    return has_next, np.minimum(np.arange(n) + 1, n - 1)


def reuse_window_s(ttl_s: float, proxy_lifetime_s: float | None) -> float:
    window = ttl_s - DECLINE_WINDOW_S
    return min(window, proxy_lifetime_s) if proxy_lifetime_s else window


def replay_ttl(turns: pd.DataFrame, ttl_s: float, proxy_lifetime_s: float | None,
               reads: np.ndarray) -> dict[str, float]:
    """Predicted reuse and memory if D kept KV for ``ttl_s``.

    ``reads``: later turns that would read if the KV were alive (per row, bool)."""
    gap = turns["gap_s"].astype(float).to_numpy()
    alive = gap < reuse_window_s(ttl_s, proxy_lifetime_s)
    hits = reads & alive
    has_next, following = next_turn(turns)
    next_reads = has_next & hits[following]
    blocks = turns["export_blocks"].astype(float).fillna(0).to_numpy()
    held = np.where(next_reads, gap[following], ttl_s)
    later = int((turns["turn"] > 1).sum())
    return {"ttl_s": float(ttl_s), "reuse_window_s": reuse_window_s(ttl_s, proxy_lifetime_s),
            "hits": int(hits.sum()), "hit_ratio": float(hits.sum() / later) if later else 0.0,
            "block_seconds": float((blocks * held).sum())}


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


def would_read(turns: pd.DataFrame, threshold: float) -> np.ndarray:
    """Later turns whose reuse only TTL decides: params reached P (or would have, but for
    the proxy's stale entry) and the candidate ``M`` is at least the threshold."""
    verdict = turns["verdict"].astype(str).to_numpy()
    eligible = np.isin(verdict, list(REUSE_VERDICTS)) & (turns["turn"].to_numpy() > 1)
    return eligible & (candidate_tokens(turns) >= threshold)


def candidate_tokens(turns: pd.DataFrame) -> np.ndarray:
    """``M = max(0, min(C, N) - L)``, with ``C`` from the previous turn's export when P
    never saw params (a stale proxy entry)."""
    n_tokens = turns["prompt_tokens"].astype(float).to_numpy()
    local = turns["local_hit_tokens"].astype(float).fillna(0).to_numpy()
    remote = turns["remote_tokens"].astype(float).to_numpy()
    exported = turns["prev_export_tokens"].astype(float).to_numpy()
    remote = np.where(np.isnan(remote) | (remote == 0), exported, remote)
    m = np.maximum(0, np.minimum(remote, n_tokens) - local)
    return np.nan_to_num(m, nan=0.0)


def tune(turns: pd.DataFrame, target: float = 0.95,
         prefill_tokens_per_s: float | None = None) -> Tuning:
    """``turns``: a labelled turn table (``kvobs.fleet.report.label_turns``)."""
    rate = prefill_tokens_per_s or prefill_rate(turns)
    model = read_model(turns)
    lines: list[str] = []
    current_threshold = _mode(turns["threshold"])
    current_ttl = _mode(turns["ttl_s"])
    break_even = recommended = None
    if rate and model:
        lines.append(f"prefill rate p = {rate:,.0f} tokens/s (median over turns that read "
                     f"nothing: computed tokens / P leg time)")
        lines.append(f"read time = {model.fixed_s * 1e3:.3f} ms + M x {model.s_per_token * 1e6:.3f}"
                     f" us/token (least squares over {model.reads:,} reads"
                     + (f"; {model.bytes_per_s / 1e9:.2f} GB/s" if model.bytes_per_s else "")
                     + ")")
        per_token_gain = 1.0 / rate - model.s_per_token
        if per_token_gain > 0:
            break_even = model.fixed_s / per_token_gain
            recommended = max(BLOCK_TOKENS,
                              int(math.ceil(break_even / BLOCK_TOKENS)) * BLOCK_TOKENS)
            lines.append(f"break-even M* = a / (1/p - s) = {model.fixed_s * 1e3:.3f} ms / "
                         f"({1e6 / rate:.3f} - {model.s_per_token * 1e6:.3f}) us/token = "
                         f"{break_even:,.1f} tokens -> kv_recompute_threshold = "
                         f"{recommended} (rounded up to a {BLOCK_TOKENS}-token block; now "
                         f"{current_threshold})")
        else:
            lines.append("reading a token costs more than computing it: reads never pay "
                         "off; fix the P<->D link before tuning the threshold")
    else:
        lines.append("no break-even: need turns that read (read model) and turns that "
                     "computed without reading (prefill rate)")
    threshold = recommended or current_threshold or 0
    reads = would_read(turns, threshold)
    grid = sorted(set(TTL_GRID) | ({float(current_ttl)} if current_ttl else set()))
    table = [replay_ttl(turns, ttl, None, reads) for ttl in grid]
    best = max(row["hit_ratio"] for row in table) if table else 0.0
    chosen = next((row for row in table if row["hit_ratio"] >= target * best), None)
    recommended_ttl = chosen["ttl_s"] if chosen and best > 0 else None
    proxy_lifetime = proxy_prediction = None
    if recommended_ttl:
        lines.append(f"TTL: smallest candidate reaching {target:.0%} of the best hit ratio "
                     f"over the grid ({best:.1%}): {recommended_ttl:.0f} s, hit ratio "
                     f"{chosen['hit_ratio']:.1%}, {chosen['block_seconds']:,.0f} block-s held")
        proxy_lifetime = max(0.0, recommended_ttl - PROXY_MARGIN_S)
        proxy_prediction = replay_ttl(turns, recommended_ttl, proxy_lifetime, reads)
        lines.append(f"proxy entry lifetime = TTL - {PROXY_MARGIN_S:.0f} s = "
                     f"{proxy_lifetime:.0f} s (the proxy drops an entry before P would "
                     f"decline its read): hit ratio {proxy_prediction['hit_ratio']:.1%}")
    return Tuning(rate, model, break_even, recommended, current_threshold, current_ttl, table,
                  recommended_ttl, proxy_lifetime, proxy_prediction, lines)


def _mode(values: pd.Series):
    values = values.dropna()
    if values.empty:
        return None
    value = values.mode().iloc[0]
    return value.item() if hasattr(value, "item") else value
