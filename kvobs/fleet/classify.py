"""Vectorised verdicts: ``kvobs.verdicts.classify`` applied to a whole turn table at once.

The rules in ``kvobs/verdicts/`` stay the single definition; this module mirrors their
decision order column-wise so a million turns take well under a second.
``tests/fleet/test_classify_parity.py`` checks, turn by turn on synthetic and factory span
sets, that both give the same verdict: a change to a rule that is not mirrored here fails
that test.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvobs.semconv import (FallbackReason, LookupOutcome, PullDecision, ReadOutcome,
                           ReleaseReason, Verdict)

UNDECIDED = ""


def _eq(turns: pd.DataFrame, column: str, value: str) -> np.ndarray:
    values = turns[column]
    if isinstance(values.dtype, pd.CategoricalDtype):
        if value not in values.cat.categories:
            return np.zeros(len(values), bool)
        code = values.cat.categories.get_loc(value)
        return values.cat.codes.to_numpy() == code
    return (values == value).fillna(False).to_numpy(bool)


def _isin(turns, column, values) -> np.ndarray:
    out = np.zeros(len(turns), bool)
    for value in values:
        out |= _eq(turns, column, value)
    return out


def _null(turns, column) -> np.ndarray:
    return turns[column].isna().to_numpy(bool)


def _num(turns, column) -> np.ndarray:
    return pd.to_numeric(turns[column], errors="coerce").to_numpy(float, na_value=np.nan)


def classify_frame(turns: pd.DataFrame, prefill_tokens_per_s: float | None = None,
                   read_slo_s: float | None = None) -> pd.Series:
    """One verdict value per row of the turn table (same order as the rules)."""
    n = len(turns)
    verdict = np.full(n, UNDECIDED, dtype=object)
    open_ = np.ones(n, bool)

    def decide(mask, value):
        nonlocal open_
        chosen = open_ & mask
        verdict[chosen] = value.value
        open_ = open_ & ~chosen

    # 1 first-turn
    decide(turns["turn"].to_numpy() == 1, Verdict.FIRST_TURN)
    # 2 missing-metadata (needs the proxy's lookup span)
    decide(_null(turns, "lookup"), Verdict.INSUFFICIENT_EVIDENCE)
    no_params = _isin(turns, "lookup", (LookupOutcome.NO_ID.value, LookupOutcome.MISS.value))
    params_sent = turns["params_sent"].fillna(False).to_numpy(bool)
    bad_params = (_eq(turns, "lookup", LookupOutcome.HIT.value) & params_sent
                  & _isin(turns, "decision", (PullDecision.INVALID.value,
                                              PullDecision.NO_PARAMS.value)))
    decide(no_params | bad_params, Verdict.MISSING_METADATA)
    # 3 prefix-mismatch
    decide(_eq(turns, "lookup", LookupOutcome.PREFIX_MISMATCH.value)
           | _eq(turns, "decision", PullDecision.PREFIX_MISMATCH.value),
           Verdict.PREFIX_MISMATCH)
    # 4 expired
    before_start = (turns["prev_release_end_ns"].astype("Int64")
                    <= turns["turn_start_ns"].astype("Int64")).fillna(False).to_numpy(bool)
    released = _eq(turns, "prev_release_reason", ReleaseReason.EXPIRED.value) & before_start
    decide(_eq(turns, "read_outcome", ReadOutcome.DECLINED_EXPIRED.value)
           | _eq(turns, "fallback_reason", FallbackReason.READ_DECLINED.value)
           | _eq(turns, "lookup", LookupOutcome.STALE.value) | released, Verdict.EXPIRED)
    # 5 transfer-failed
    decide(_eq(turns, "read_outcome", ReadOutcome.FAILED.value)
           | _eq(turns, "fallback_reason", FallbackReason.READ_FAILED.value)
           | turns["stuck_span_id"].notna().to_numpy(bool), Verdict.TRANSFER_FAILED)
    # 6 below-threshold (needs P's decision span)
    decide(_null(turns, "decision"), Verdict.INSUFFICIENT_EVIDENCE)
    decide(_eq(turns, "decision", PullDecision.BELOW_THRESHOLD.value), Verdict.BELOW_THRESHOLD)
    # 7 local-hit
    decide(_eq(turns, "decision", PullDecision.LOCAL_HIT.value), Verdict.LOCAL_HIT)
    # 8 slow-transfer
    done = _eq(turns, "read_outcome", ReadOutcome.DONE.value)
    duration = _num(turns, "read_duration_s")
    decide(done & np.isnan(duration), Verdict.INSUFFICIENT_EVIDENCE)
    tokens = _num(turns, "candidate_tokens")
    slower = np.zeros(n, bool)
    if prefill_tokens_per_s:
        usable = ~np.isnan(tokens) & (tokens != 0)
        slower = usable & (duration > np.where(usable, tokens, 0) / prefill_tokens_per_s)
    over_slo = (duration > read_slo_s) if read_slo_s is not None else np.zeros(n, bool)
    decide(done & (slower | over_slo), Verdict.SLOW_TRANSFER)
    # 9 remote-hit (a pull decision needs its read span)
    decide(_eq(turns, "decision", PullDecision.PULL.value) & _null(turns, "read_outcome"),
           Verdict.INSUFFICIENT_EVIDENCE)
    decide(done, Verdict.REMOTE_HIT)
    # 10 miss
    decide(np.ones(n, bool), Verdict.MISS)
    return pd.Series(verdict, index=turns.index, name="verdict")
