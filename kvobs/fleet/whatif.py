"""``kvobs whatif``: replay the recorded turns under another TTL and threshold.

Only the outcomes those settings decide are replayed; everything else keeps its recorded
verdict (no id, proxy miss, rewritten history, failed reads, missing spans). For a later
turn whose params reached P, or would have but for the proxy's stale entry:

1. expired when its gap is at least ``ttl - 5 s`` or the proxy's entry lifetime
   (default ``ttl - 30 s``, as the defaults 480/450 s);
2. local-hit when ``M = 0`` and ``L > 0``;
3. below-threshold when ``0 < M < threshold``;
4. else a read: its recorded duration when it read, else the fitted read model
   (``kvobs.fleet.tune.read_model``); slow-transfer when that exceeds ``M / p``, else
   remote-hit.
Memory: each export's blocks held until the next turn reads them, or for the TTL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from kvobs.timeline import prefill_rate
from kvobs.fleet.report import VERDICTS
from kvobs.fleet.tune import (PROXY_MARGIN_S, REUSE_VERDICTS, candidate_tokens, next_turn, read_model,
                              reuse_window_s)
from kvobs.semconv import ReadOutcome, Verdict


@dataclass
class WhatIf:
    ttl_s: float
    threshold: int
    proxy_lifetime_s: float | None
    actual: dict[str, Any]
    predicted: dict[str, Any]
    changed_turns: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _summary(turns: pd.DataFrame, verdicts: np.ndarray, reused: np.ndarray,
             block_seconds: float) -> dict[str, Any]:
    later = turns["turn"].to_numpy() > 1
    counts = pd.Series(verdicts[later]).value_counts()
    prompt = turns["prompt_tokens"].astype(float).fillna(0).to_numpy()
    local = turns["local_hit_tokens"].astype(float).fillna(0).to_numpy()
    return {"later_turns": int(later.sum()),
            "verdicts": {v: int(counts.get(v, 0)) for v in VERDICTS if counts.get(v, 0)},
            "remote_hit_ratio": float(counts.get(Verdict.REMOTE_HIT.value, 0) / later.sum())
            if later.sum() else None,
            "reused_tokens": int(reused[later].sum()),
            "computed_tokens": int((prompt - local - reused)[later].sum()),
            "block_seconds_held": block_seconds}


def whatif(turns: pd.DataFrame, ttl_s: float, threshold: int,
           proxy_lifetime_s: float | None = None,
           prefill_tokens_per_s: float | None = None) -> WhatIf:
    """``turns``: a labelled turn table (``kvobs.fleet.report.label_turns``)."""
    if proxy_lifetime_s is None:
        proxy_lifetime_s = max(0.0, ttl_s - PROXY_MARGIN_S)
    rate = prefill_tokens_per_s or prefill_rate(turns)
    model = read_model(turns)
    verdict = turns["verdict"].astype(str).to_numpy()
    later = turns["turn"].to_numpy() > 1
    gap = turns["gap_s"].astype(float).to_numpy()
    local = turns["local_hit_tokens"].astype(float).fillna(0).to_numpy()
    m = candidate_tokens(turns)
    done = (turns["read_outcome"] == ReadOutcome.DONE.value).fillna(False).to_numpy(bool)
    recorded_s = turns["read_duration_s"].astype(float).to_numpy()

    replay = later & np.isin(verdict, list(REUSE_VERDICTS))
    predicted = verdict.copy()
    expired = replay & ~(gap < reuse_window_s(ttl_s, proxy_lifetime_s))
    local_hit = replay & ~expired & (m == 0) & (local > 0)
    below = replay & ~expired & ~local_hit & (m > 0) & (m < threshold)
    reads = replay & ~expired & ~local_hit & ~below & (m > 0)
    modelled = model.seconds(m) if model else np.full(len(m), np.nan)
    seconds = np.where(done & np.isfinite(recorded_s), recorded_s, modelled)
    slow = reads & (seconds > m / rate) if rate else np.zeros(len(m), bool)
    predicted[expired] = Verdict.EXPIRED.value
    predicted[local_hit] = Verdict.LOCAL_HIT.value
    predicted[below] = Verdict.BELOW_THRESHOLD.value
    predicted[reads & slow] = Verdict.SLOW_TRANSFER.value
    predicted[reads & ~slow] = Verdict.REMOTE_HIT.value
    predicted[replay & ~expired & ~local_hit & ~below & ~reads] = Verdict.MISS.value

    actual_reused = np.where(done, turns["candidate_tokens"].astype(float).fillna(0), 0)
    predicted_reused = np.where(reads, m, 0)
    blocks = turns["export_blocks"].astype(float).fillna(0).to_numpy()
    held = turns["held_s"].astype(float).fillna(
        (turns["release_end_ns"].astype(float) - turns["export_end_ns"].astype(float)) / 1e9)
    has_next, following = next_turn(turns)
    next_reads = has_next & reads[following]
    predicted_held = np.where(next_reads, gap[following], ttl_s)
    return WhatIf(
        ttl_s, threshold, proxy_lifetime_s,
        actual=_summary(turns, verdict, actual_reused,
                        float((blocks * held.fillna(0).to_numpy()).sum())),
        predicted=_summary(turns, predicted, predicted_reused,
                           float((blocks * predicted_held).sum())),
        changed_turns=int((predicted != verdict).sum()))
