"""How far ``kvobs tune`` can be trusted: the sample sizes behind each recommendation and
a bootstrap interval of the break-even read size.

The threshold rests on a least-squares fit of read time on tokens read
(``tune.read_model``); refitting it on reads drawn with replacement shows how much the
break-even moves with the sample. The TTL rests on the later turns' gaps it replays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from kvobs.fleet.tune import Tuning, read_model
from kvobs.semconv import ReadOutcome

# Below these, a recommendation is a rough guide: say so.
FEW_READS = 30
FEW_LATER_TURNS = 30
# Above these (and a tight interval), trust it.
MANY = 100
TIGHT = 0.25  # interval half-width over the estimate
RESAMPLES = 200
MAX_RESAMPLED_READS = 20_000  # bootstrap a sample of a large fleet's reads


@dataclass
class Confidence:
    reads: int  # reads in the read-cost fit
    later_turns: int  # gaps the TTL replay used
    level: str  # low, medium or high
    # 90 % bootstrap interval in tokens; upper None: in over 5 % of resamples reads
    # never paid off.
    break_even_interval: tuple[float, float | None] | None
    warnings: list[str] = field(default_factory=list)
    # The finished reads the bootstrap drew from, of how many: all of them up to
    # MAX_RESAMPLED_READS, else a uniform sample of that many.
    bootstrap_reads: int = 0
    bootstrap_of: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# What the bootstrap refits a read model on: each finished read's columns.
READ_COLUMNS = ["read_outcome", "candidate_tokens", "read_duration_s", "read_bytes"]


def finished_reads(turns: pd.DataFrame) -> pd.DataFrame:
    """The rows of finished reads, ``READ_COLUMNS``: what the bootstrap resamples."""
    done = (turns["read_outcome"] == ReadOutcome.DONE.value).fillna(False).to_numpy(bool)
    return turns.loc[done, READ_COLUMNS]


def confidence(
    turns: pd.DataFrame, tuning: Tuning, resamples: int = RESAMPLES, seed: int = 0
) -> Confidence:
    """``turns``: the labelled turn table ``tuning`` came from."""
    later = int((turns["turn"] > 1).sum())
    return trust(finished_reads(turns), later, tuning, resamples, seed)


def trust(
    reads_: pd.DataFrame,
    later: int,
    tuning: Tuning,
    resamples: int = RESAMPLES,
    seed: int = 0,
    of: int | None = None,
) -> Confidence:
    """``confidence`` from the finished reads (``finished_reads``; ``of``: how many
    there were where ``reads_`` is a sample of them) and the later turns' count."""
    reads = tuning.read.reads if tuning.read else 0
    interval, drawn = _break_even_interval(reads_, tuning, resamples, seed)
    warnings = []
    if reads < FEW_READS:
        spread = f" (break-even {interval_text(interval)})" if interval else ""
        warnings.append(
            f"the threshold rests on {reads:,} reads{spread}: collect at least "
            f"{FEW_READS} before changing kv_recompute_threshold"
        )
    if later < FEW_LATER_TURNS:
        warnings.append(
            f"the TTL rests on {later:,} later turns' gaps: collect at least "
            f"{FEW_LATER_TURNS} before changing decoder_kv_blocks_ttl"
        )
    estimate = tuning.break_even_tokens
    tight = bool(
        interval
        and interval[1] is not None
        and estimate
        and (interval[1] - interval[0]) / 2 <= TIGHT * estimate
    )
    level = "low" if warnings else "high" if reads >= MANY and later >= MANY and tight else "medium"
    total = len(reads_) if of is None else of
    return Confidence(reads, later, level, interval, warnings, drawn, total)


def interval_text(interval: tuple[float, float | None]) -> str:
    low, high = interval
    if high is None:
        return f"90 % interval from {low:,.0f} tokens, unbounded: some resamples never pay off"
    return f"90 % interval {low:,.0f}-{high:,.0f} tokens"


def _break_even_interval(
    rows: pd.DataFrame, tuning: Tuning, resamples: int, seed: int
) -> tuple[tuple[float, float | None] | None, int]:
    """The interval, and how many reads it drew from (``rows``: ``finished_reads``)."""
    rate = tuning.prefill_tokens_per_s
    if not rate or tuning.break_even_tokens is None:
        return None, 0
    # In the order of their values: the same reads give the same interval whichever
    # order a source returned its turns in.
    rows = rows.iloc[
        np.lexsort(
            [rows[c].to_numpy(np.float64, na_value=np.nan) for c in reversed(rows.columns[1:])]
        )
    ]
    rows = rows.reset_index(drop=True)
    random = np.random.default_rng(seed)
    if len(rows) > MAX_RESAMPLED_READS:
        rows = rows.iloc[random.choice(len(rows), MAX_RESAMPLED_READS, replace=False)]
        rows = rows.reset_index(drop=True)
    estimates = []
    for _ in range(resamples):
        model = read_model(rows.iloc[random.integers(0, len(rows), len(rows))])
        gain = 1.0 / rate - model.s_per_token if model else 0.0
        # A resample where reads never pay off has no break-even: infinitely large.
        estimates.append(model.fixed_s / gain if model and gain > 0 else np.inf)
    # No interpolation: an infinite estimate stays one (not NaN).
    low = float(np.quantile(estimates, 0.05, method="lower"))
    high = float(np.quantile(estimates, 0.95, method="higher"))
    return (low, (high if np.isfinite(high) else None)), len(rows)
