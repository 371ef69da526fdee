"""``kvobs whatif``: replay the recorded turns under another TTL, threshold and proxy
entry lifetime, and compare the predicted verdict mix, reuse and memory with what
happened.

The replay (``kvobs.fleet.replay``) rewrites the facts each setting decides (the proxy's
lookup, P's pull decision, P's read, D's release) and decides the rewritten turns with the
one verdict decision, ``kvobs.verdicts.decide``: the verdicts are diagnose's own for those
facts. Replaying the recorded settings gives back the recorded verdicts. Memory: each
export's blocks held until the next turn reads them, or for the TTL.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from kvobs.fleet.replay import ReadModel, Recorded, block_seconds, read_model, replay
from kvobs.semconv import VERDICT_VALUES, ReadOutcome, Verdict
from kvobs.timeline import prefill_rate
from kvobs.verdicts import Context


@dataclass
class WhatIf:
    # None: as recorded, turn by turn (the library's; the CLI always names TTL and threshold)
    ttl_s: float | None
    threshold: int | None
    proxy_lifetime_s: float | None  # None: each proxy as recorded, moving with the TTL
    actual: dict[str, Any]
    predicted: dict[str, Any]
    changed_turns: int
    # Per row of the turn table: the predicted verdict (not in the JSON output).
    verdicts: np.ndarray = field(default_factory=lambda: np.array([], object), repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key != "verdicts"}


def _tally(
    turns: pd.DataFrame, verdicts: np.ndarray, reused: np.ndarray, block_seconds: float
) -> dict[str, Any]:
    """The later turns' verdict counts and sums under ``verdicts``: they add up over
    parts of a fleet (``add_tally``)."""
    later = turns["turn"].to_numpy() > 1
    counts = pd.Series(verdicts[later]).value_counts()
    prompt = turns["prompt_tokens"].astype(float).fillna(0).to_numpy()
    local = turns["local_hit_tokens"].astype(float).fillna(0).to_numpy()
    return {
        "later_turns": int(later.sum()),
        "verdicts": Counter({str(v): int(n) for v, n in counts.items() if n}),
        "reused_tokens": int(reused[later].sum()),
        "computed_tokens": int((prompt - local - reused)[later].sum()),
        "block_seconds_held": block_seconds,
    }


def add_tally(into: dict[str, Any], other: dict[str, Any]) -> None:
    for key, value in other.items():
        into[key] = into[key] + value if key in into else value


def summary(tally: dict[str, Any]) -> dict[str, Any]:
    """What ``whatif`` shows of a tally."""
    later, counts = tally["later_turns"], tally["verdicts"]
    return {
        "later_turns": later,
        "verdicts": {v: int(counts[v]) for v in VERDICT_VALUES if counts.get(v, 0)},
        "remote_hit_ratio": float(counts.get(Verdict.REMOTE_HIT.value, 0) / later)
        if later
        else None,
        "reused_tokens": tally["reused_tokens"],
        "computed_tokens": tally["computed_tokens"],
        "block_seconds_held": tally["block_seconds_held"],
    }


@dataclass
class Compared:
    """What happened and what a replay predicts, over a table (or a part of a fleet)."""

    actual: dict[str, Any]
    predicted: dict[str, Any]
    changed_turns: int
    verdicts: np.ndarray


def compare(
    turns: pd.DataFrame,
    ttl_s: float | None,
    threshold: int | None,
    proxy_lifetime_s: float | None,
    model: ReadModel | None,
    context: Context,
    modes: dict[str, float] | None = None,
) -> Compared:
    """``turns`` (whole conversations) replayed: ``whatif``'s tallies of them."""
    recorded = Recorded(turns, modes)
    replayed = replay(recorded, ttl_s, threshold, proxy_lifetime_s, model, context)
    verdict = turns["verdict"].astype(str).to_numpy()
    done = (turns["read_outcome"] == ReadOutcome.DONE.value).fillna(False).to_numpy(bool)
    actual_reused = np.where(done, turns["candidate_tokens"].astype(float).fillna(0), 0)
    blocks = turns["export_blocks"].astype(float).fillna(0).to_numpy()
    held = (
        turns["held_s"]
        .astype(float)
        .fillna(
            (turns["release_end_ns"].astype(float) - turns["export_end_ns"].astype(float)) / 1e9
        )
    )
    return Compared(
        _tally(turns, verdict, actual_reused, float((blocks * held.fillna(0).to_numpy()).sum())),
        _tally(
            turns,
            replayed.verdicts,
            replayed.reused_tokens,
            block_seconds(turns, replayed.reads, ttl_s, modes),
        ),
        int((replayed.verdicts != verdict).sum()),
        replayed.verdicts,
    )


def whatif(
    turns: pd.DataFrame,
    ttl_s: float | None,
    threshold: int | None,
    proxy_lifetime_s: float | None = None,
    prefill_tokens_per_s: float | None = None,
) -> WhatIf:
    """``turns``: a labelled turn table (``kvobs.fleet.report.label_turns``, labelled at
    ``prefill_tokens_per_s`` when given)."""
    rate = prefill_tokens_per_s or prefill_rate(turns)
    found = compare(turns, ttl_s, threshold, proxy_lifetime_s, read_model(turns), Context(rate))
    return WhatIf(
        None if ttl_s is None else float(ttl_s),
        None if threshold is None else int(threshold),
        proxy_lifetime_s,
        actual=summary(found.actual),
        predicted=summary(found.predicted),
        changed_turns=found.changed_turns,
        verdicts=found.verdicts,
    )
