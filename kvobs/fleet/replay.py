"""Recorded turns under other settings: the facts a setting decides, rewritten, and the
verdicts decided from them by the one verdict decision (``kvobs.verdicts.decide``, the
one ``kvobs diagnose`` and ``kvobs report`` use). ``kvobs whatif`` and ``kvobs tune``
replay through here; neither decides a verdict itself.

Settings (``kvobs.settings``) decide facts, not verdicts. For a later turn that went the
proxy's way to D's KV (the proxy found an entry, fresh or stale; P decided with the
params it got; no D restart, failed read or stuck wait, which no setting explains):

- the proxy's lookup: an entry whose age reached its lifetime is ``stale`` (no params
  sent, P decides ``no-params``), else ``hit`` (params sent);
- P's pull decision, when the params reach P: ``local-hit`` when ``M = 0`` and ``L > 0``,
  ``below-threshold`` when ``0 < M < kv_recompute_threshold``, else ``pull``
  (``M = max(0, min(C, N) - L)``, ``C`` from the previous turn's export when P never saw
  params);
- P's read, when it pulls: ``declined-expired`` (and the proxy's ``read-declined``
  fallback) when D's blocks expire within the decline window at the read, else ``done``,
  taking its recorded duration when it read, else the fitted read model's
  (``read_model``; reads are assumed to pay off when no read was recorded);
- D's release: by expiry before this turn began when the gap reached D's TTL.

A fact changes only where the change of setting changes it. Each fact is worked out under
the turn's recorded settings (the previous export's TTL, P's threshold) and under the
replayed ones; where both agree the recorded fact stands (the recording knows better than
the model: clock skew, a read's own delay), where they differ the replayed one replaces
it. Only the turns whose facts changed are decided again (every other turn keeps the
verdict the same decision gave it when the table was labelled), and replaying the
recorded settings gives back exactly the recorded verdicts.

The proxy's entry lifetime, replayed as given: every lookup is what an entry of that
lifetime gives at the entry's age. Not given: each proxy keeps its recorded behaviour and
its entries move with the TTL, as the kvobs proxy derives them
(``settings.entry_lifetime_s``: TTL less the expiry margin).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvobs.turns import columns as col
from kvobs.turns.correlate import turn_links
from kvobs.semconv import FallbackReason, LookupOutcome, PullDecision, ReadOutcome, ReleaseReason
from kvobs.settings import entry_lifetime_s, read_declined
from kvobs.verdicts import Context, decide

__all__ = [
    "ReadModel",
    "read_model",
    "fitted",
    "Line",
    "ReadSums",
    "usable_reads",
    "most_common",
    "MODE_COLUMNS",
    "next_turn",
    "candidate_tokens",
    "block_seconds",
    "Recorded",
    "Replay",
    "replay",
]

# The columns a replay rewrites: the facts the settings decide.
FACTS = (
    "lookup",
    "params_sent",
    "decision",
    "remote_tokens",
    "candidate_tokens",
    "read_outcome",
    "read_duration_s",
    "fallback_reason",
    "prev_release_reason",
    "prev_release_end_ns",
)


@dataclass
class ReadModel:
    """Measured read cost: ``seconds = fixed_s + tokens * s_per_token``."""

    fixed_s: float
    s_per_token: float
    reads: int
    bytes_per_s: float | None

    def seconds(self, tokens):
        return self.fixed_s + np.asarray(tokens, float) * self.s_per_token


def usable_reads(turns: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The finished reads a read model fits: tokens, seconds and bytes of each."""
    done = (turns["read_outcome"] == ReadOutcome.DONE.value).fillna(False).to_numpy(bool)
    tokens = turns["candidate_tokens"].astype(float).to_numpy()
    seconds = turns["read_duration_s"].astype(float).to_numpy()
    usable = done & (tokens > 0) & np.isfinite(seconds)
    return tokens[usable], seconds[usable], turns["read_bytes"].astype(float).to_numpy()[usable]


@dataclass
class Line:
    """Least-squares sums of points (``x``, ``y``): they add up batch by batch."""

    n: int = 0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    low: float = np.inf  # the smallest x
    high: float = -np.inf

    @classmethod
    def of(cls, x: np.ndarray, y: np.ndarray) -> Line:
        if not len(x):
            return cls()
        return cls(len(x), x.sum(), y.sum(), x @ x, x @ y, x.min(), x.max())

    def merge(self, other: Line) -> None:
        self.n += other.n
        self.x, self.y = self.x + other.x, self.y + other.y
        self.xx, self.xy = self.xx + other.xx, self.xy + other.xy
        self.low, self.high = min(self.low, other.low), max(self.high, other.high)


@dataclass
class ReadSums:
    """What a read model is fitted from, in sums: every usable read, the reads up to
    the cut in cost per token (``cut``: the 90th percentile of it) and their bytes."""

    usable: Line
    kept: Line
    read_bytes: float = 0.0

    @classmethod
    def of(cls, tokens: np.ndarray, seconds: np.ndarray, read_bytes: np.ndarray, cut: float):
        keep = seconds / tokens <= cut
        return cls(
            Line.of(tokens, seconds),
            Line.of(tokens[keep], seconds[keep]),
            float(np.nansum(read_bytes)),
        )

    def merge(self, other: ReadSums) -> None:
        self.usable.merge(other.usable)
        self.kept.merge(other.kept)
        self.read_bytes += other.read_bytes


# Robust to a tail of slow reads: the fit is on reads up to this quantile of cost/token.
READ_COST_CUT = 0.9


def read_model(turns: pd.DataFrame) -> ReadModel | None:
    tokens, seconds, read_bytes = usable_reads(turns)
    if len(tokens) < 2:
        return None
    cut = float(np.quantile(seconds / tokens, READ_COST_CUT))
    return fitted(ReadSums.of(tokens, seconds, read_bytes, cut))


def fitted(sums: ReadSums) -> ReadModel | None:
    """The read model of ``sums`` (``read_model``; the turn-row path sums batches)."""
    usable = sums.usable
    if usable.n < 2:
        return None
    kept = sums.kept
    intercept, slope = _fit(kept if kept.n >= 2 and kept.high > kept.low else usable)
    return ReadModel(
        intercept,
        slope,
        usable.n,
        float(sums.read_bytes / usable.y) if usable.y > 0 else None,
    )


def _fit(line: Line) -> tuple[float, float]:
    """(fixed seconds, seconds per token), both >= 0, least squares within that bound.

    Reads of similar sizes with noisy times give a line of any slope and a negative
    intercept; clamping only the intercept keeps that slope (a 1 ms read of 139 tokens
    then "costs" 0.5 ms per token). Refit with the bound active instead: through the
    origin when the intercept would be negative, flat when the slope would be."""
    if line.high > line.low:
        spread = line.xx - line.x * line.x / line.n
        slope = float((line.xy - line.x * line.y / line.n) / spread)
        intercept = float((line.y - slope * line.x) / line.n)
        if intercept >= 0 and slope >= 0:
            return intercept, slope
        if intercept < 0:
            slope = float(line.xy / line.xx)
            if slope >= 0:
                return 0.0, slope
    return max(0.0, float(line.y / line.n)), 0.0


def next_turn(turns: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """For each row: whether the conversation's next turn is in the table, and that
    turn's row (the row itself where there is none)."""
    _, following = turn_links(turns)
    has_next = following >= 0
    return has_next, np.where(has_next, following, np.arange(len(turns)))


def candidate_tokens(turns: pd.DataFrame) -> np.ndarray:
    """``M = max(0, min(C, N) - L)``, with ``C`` from the previous turn's export when P
    never saw params (a stale proxy entry); NaN where neither says."""
    n_tokens = col.num(turns, "prompt_tokens")
    local = np.nan_to_num(col.num(turns, "local_hit_tokens"))
    remote = col.num(turns, "remote_tokens")
    remote = np.where(
        np.isnan(remote) | (remote == 0), col.num(turns, "prev_export_tokens"), remote
    )
    return np.maximum(0, np.minimum(remote, n_tokens) - local)


def block_seconds(
    turns: pd.DataFrame,
    reads: np.ndarray,
    ttl_s: float | None,
    modes: dict[str, float] | None = None,
) -> float:
    """D's memory held if each export's blocks stay until the next turn reads them
    (``reads``, per row) or for the TTL (``None``: each export's own; ``modes``: the
    fleet's most common settings where ``turns`` is a part of it, ``Recorded``)."""
    gap = turns["gap_s"].astype(float).to_numpy()
    blocks = turns["export_blocks"].astype(float).fillna(0).to_numpy()
    has_next, following = next_turn(turns)
    common = (modes or {}).get("ttl_s")
    ttl = _recorded(col.num(turns, "ttl_s"), np.nan, common) if ttl_s is None else ttl_s
    held = np.where(has_next & reads[following], gap[following], ttl)
    return float(np.nansum(blocks * held))


def _mode(values: np.ndarray) -> float:
    values = values[~np.isnan(values)]
    if not len(values):
        return np.nan
    uniques, counts = np.unique(values, return_counts=True)
    return float(uniques[np.argmax(counts)])


def most_common(counts: dict[float, int]) -> float:
    """``_mode`` of values counted apart (the smallest of the most common; NaN for
    none): the fleet's setting from batches' counts."""
    if not counts:
        return np.nan
    top = max(counts.values())
    return float(min(value for value, n in counts.items() if n == top))


# The recorded settings a replay falls back to, fleet-wide, for a turn without its own.
MODE_COLUMNS = ("prev_ttl_s", "threshold", "ttl_s")


def _recorded(
    values: np.ndarray, fallback: float | None, common: float | None = None
) -> np.ndarray:
    """A turn's recorded setting: its own, else the table's most common (``common``
    when given: the fleet's, where the table is a part of it), else ``fallback`` (NaN:
    unknown)."""
    common = _mode(values) if common is None else common
    if np.isnan(common):
        common = np.nan if fallback is None else fallback
    return np.where(np.isnan(values), common, values)


def _anchored(recorded: np.ndarray, before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """A fact under the replayed setting: the model's (``after``) where the change of
    setting changes the model's answer (``before``), the recorded fact elsewhere."""
    return np.where(before == after, recorded, after)


# P's pull decisions a replay works out, by code.
_DECISIONS = (
    PullDecision.NO_PARAMS.value,
    PullDecision.LOCAL_HIT.value,
    PullDecision.BELOW_THRESHOLD.value,
    PullDecision.PULL.value,
)
_NO_PARAMS, _LOCAL_HIT, _BELOW, _PULL = range(len(_DECISIONS))
# Read outcomes a replay works out, by code (0: no read).
_OUTCOMES = (None, ReadOutcome.DONE.value, ReadOutcome.DECLINED_EXPIRED.value)
_NO_READ, _DONE, _DECLINED = range(len(_OUTCOMES))


def _decision(m: np.ndarray, local: np.ndarray, threshold) -> np.ndarray:
    """P's pull decision, by code (connector_instrumented/_scheduler_observer.py
    ``_decide``)."""
    return np.where(
        m == 0,
        np.where(local > 0, _LOCAL_HIT, _NO_PARAMS),
        np.where((threshold > 0) & (m < threshold), _BELOW, _PULL),
    )


def _codes(turns: pd.DataFrame, column: str, values: tuple) -> np.ndarray:
    """Per row, the position of the column's value in ``values`` (``None``: missing);
    -1 for any other value."""
    out = np.full(len(turns), -1)
    for code, value in enumerate(values):
        out[col.null(turns, column) if value is None else col.eq(turns, column, value)] = code
    return out


class Recorded:
    """What a replay reads of a labelled turn table, whatever the settings: the turns the
    settings decide (module docstring) and their recorded facts. Built once, replayed
    under any number of settings (``kvobs tune``'s TTL grid). ``modes``: the fleet's most
    common ``MODE_COLUMNS`` where ``turns`` is a part of the fleet (whole conversations:
    ``kvobs.fleet.turn_replay``); by default the table's own."""

    def __init__(self, turns: pd.DataFrame, modes: dict[str, float] | None = None):
        self.turns = turns
        self.modes = modes or {}
        hit = col.eq(turns, "lookup", LookupOutcome.HIT.value)
        stale = col.eq(turns, "lookup", LookupOutcome.STALE.value)
        decision = _codes(turns, "decision", _DECISIONS)
        outcome = _codes(turns, "read_outcome", _OUTCOMES)
        pulled = decision == _PULL
        # No setting explains a D restart, a failed read or a stuck wait.
        unexplained = (
            col.present(turns, "extends_engine_restarted_at")
            | col.eq(turns, "read_outcome", ReadOutcome.FAILED.value)
            | col.eq(turns, "fallback_reason", FallbackReason.READ_FAILED.value)
            | col.present(turns, "stuck_span_id")
        )
        # P decided with the proxy's params (and, when it pulled, the read is known) ...
        p_decided = (
            hit
            & col.flag(turns, "params_sent")
            & (decision >= _LOCAL_HIT)
            & (~pulled | (outcome >= _DONE))
        )
        # ... or the proxy's entry was stale and M can be rebuilt from D's export.
        never_sent = (
            stale
            & col.present(turns, "decision")
            & col.present(turns, "prompt_tokens")
            & col.present(turns, "prev_export_tokens")
        )
        gap = col.num(turns, "gap_s")
        rows = np.flatnonzero(
            (col.num(turns, "turn") > 1) & ~np.isnan(gap) & ~unexplained & (p_decided | never_sent)
        )
        self.rows = rows
        self.gap, self.hit, self.p_decided = gap[rows], hit[rows], p_decided[rows]
        self.decision, self.outcome, self.pulled = decision[rows], outcome[rows], pulled[rows]
        modes = self.modes
        self.ttl = _recorded(col.num(turns, "prev_ttl_s"), None, modes.get("prev_ttl_s"))[rows]
        self.threshold = _recorded(col.num(turns, "threshold"), None, modes.get("threshold"))[rows]
        age = col.num(turns, "entry_age_s")[rows]
        self.age = np.where(np.isnan(age), self.gap, age)
        self.local = np.nan_to_num(col.num(turns, "local_hit_tokens")[rows])
        recorded_m = col.num(turns, "candidate_tokens")[rows]
        # M: P's own where it decided with the params, else rebuilt from D's export.
        self.m = np.where(
            self.p_decided & ~np.isnan(recorded_m), recorded_m, candidate_tokens(turns)[rows]
        )
        read_at = col.num(turns, "read_start_ns")[rows]
        self.ended = col.num(turns, "prev_turn_end_ns")[rows]
        self.read_age = np.where(
            np.isnan(read_at) | np.isnan(self.ended), self.gap, (read_at - self.ended) / 1e9
        )
        self.read_s = col.num(turns, "read_duration_s")[rows]
        self.remote = col.num(turns, "remote_tokens")[rows]
        self.exported = col.num(turns, "prev_export_tokens")[rows]
        self.release_end = col.num(turns, "prev_release_end_ns")[rows]
        self.start = col.num(turns, "turn_start_ns")[rows]
        self.was_released = col.eq(turns, "prev_release_reason", ReleaseReason.EXPIRED.value)[
            rows
        ] & (self.release_end <= self.start)
        self.reads = col.eq(turns, "read_outcome", ReadOutcome.DONE.value)
        self.candidate = np.nan_to_num(col.num(turns, "candidate_tokens"))
        self.verdicts = turns["verdict"].astype(object).to_numpy() if "verdict" in turns else None


@dataclass
class Replay:
    """The turns under the replayed settings: per row of the table the verdict the one
    decision gives its facts, whether it reads D's KV and the tokens it reuses so; and
    the rows whose facts changed (``facts``: those rows, their facts replayed)."""

    verdicts: np.ndarray
    reads: np.ndarray
    reused_tokens: np.ndarray
    facts: pd.DataFrame
    ttl_s: float | None
    threshold: int | None
    proxy_lifetime_s: float | None


def _with(
    facts: pd.DataFrame, column: str, where: np.ndarray, table: tuple, codes: np.ndarray
) -> pd.Series:
    """``column`` as a categorical, with ``table[codes]`` (``None``: missing) where
    ``where``."""
    values = facts[column] if column in facts else pd.Series([None] * len(facts), index=facts.index)
    if not isinstance(values.dtype, pd.CategoricalDtype):
        values = values.astype("category")
    if not where.any():
        return values
    added = [v for v in table if v is not None and v not in values.cat.categories]
    if added:
        values = values.cat.add_categories(added)
    position = np.array([-1 if v is None else values.cat.categories.get_loc(v) for v in table])
    out = values.cat.codes.to_numpy().copy()
    out[where] = position[np.asarray(codes)[where]]
    # The same dtype object: its categories keep their lookup table (kvobs.turns.columns.eq).
    return pd.Series(pd.Categorical.from_codes(out, dtype=values.dtype), index=values.index)


def replay(
    turns: pd.DataFrame | Recorded,
    ttl_s: float | None,
    threshold: int | None,
    proxy_lifetime_s: float | None = None,
    model: ReadModel | None = None,
    context: Context = Context(),
) -> Replay:
    """``turns``: a labelled turn table (``kvobs.fleet.report.label_turns``), or what a
    replay reads of one (``Recorded``); ``context``: what it was labelled with (the
    measured prefill rate). A setting given as ``None`` stays as recorded, turn by turn.

    Only the rows whose facts change are decided again; every other row keeps the verdict
    the same decision gave it when the table was labelled (``verdict``)."""
    r = turns if isinstance(turns, Recorded) else Recorded(turns)
    ttl_before = r.ttl if ttl_s is None else np.where(np.isnan(r.ttl), ttl_s, r.ttl)
    threshold_before = (
        r.threshold
        if threshold is None
        else np.where(np.isnan(r.threshold), threshold, r.threshold)
    )
    ttl_after = ttl_before if ttl_s is None else ttl_s
    threshold_after = threshold_before if threshold is None else threshold

    # The proxy's lookup.
    if proxy_lifetime_s is None:
        sent = _anchored(
            r.hit, r.age < entry_lifetime_s(ttl_before), r.age < entry_lifetime_s(ttl_after)
        )
    else:
        sent = r.age < proxy_lifetime_s
    # P's pull decision with the params.
    after = _decision(r.m, r.local, threshold_after)
    decided = np.where(
        r.p_decided, _anchored(r.decision, _decision(r.m, r.local, threshold_before), after), after
    )
    decision = np.where(sent, decided, _NO_PARAMS)
    # P's read: D's blocks at the read's age (from the previous turn's end).
    alive = ~read_declined(r.read_age, ttl_after)
    alive = np.where(
        r.p_decided & r.pulled,
        _anchored(r.outcome == _DONE, ~read_declined(r.read_age, ttl_before), alive),
        alive,
    )
    reading = decision == _PULL
    done, declined = reading & alive, reading & ~alive
    outcome = np.where(done, _DONE, np.where(declined, _DECLINED, _NO_READ))
    # D's release of the previous turn's blocks, by expiry before this turn began.
    released = _anchored(r.was_released, r.gap >= ttl_before, r.gap >= ttl_after)

    # Where the lookup, the decision or the read changed, the model's facts replace the
    # recorded ones (elsewhere every recorded fact stands); likewise D's release.
    changed = (sent != r.hit) | (decision != r.decision) | (outcome != r.outcome)
    moved = released != r.was_released
    again = changed | moved
    facts = r.turns.iloc[r.rows[again]].copy()
    changed, moved = changed[again], moved[again]

    def on(values):
        return np.broadcast_to(values, r.rows.shape)[again]

    sent, hit, done, declined, m = on(sent), on(r.hit), on(done), on(declined), on(r.m)
    facts["lookup"] = _with(
        facts,
        "lookup",
        changed,
        (LookupOutcome.STALE.value, LookupOutcome.HIT.value),
        sent.astype(int),
    )
    params_sent = pd.array(
        facts["params_sent"] if "params_sent" in facts else [None] * len(facts), dtype="boolean"
    )
    params_sent[changed] = sent[changed]
    facts["params_sent"] = params_sent
    facts["decision"] = _with(facts, "decision", changed, _DECISIONS, on(decision))
    replayed_m = np.where(sent, m, 0)
    facts["remote_tokens"] = np.where(
        changed, np.where(sent, np.where(hit, on(r.remote), on(r.exported)), 0), on(r.remote)
    )
    facts["candidate_tokens"] = np.where(changed, replayed_m, col.num(facts, "candidate_tokens"))
    facts["read_outcome"] = _with(facts, "read_outcome", changed, _OUTCOMES, on(outcome))
    read_s = on(r.read_s)
    kept_s = (on(r.outcome) == _DONE) & np.isfinite(read_s)
    modelled_s = model.seconds(m) if model else np.zeros(len(m))
    facts["read_duration_s"] = np.where(
        changed, np.where(done, np.where(kept_s, read_s, modelled_s), np.nan), read_s
    )
    facts["fallback_reason"] = _with(
        facts,
        "fallback_reason",
        changed,
        (None, FallbackReason.READ_DECLINED.value),
        declined.astype(int),
    )
    released, start = on(released), on(r.start)
    expiry_ns = on(r.ended) + on(ttl_after) * 1e9
    facts["prev_release_reason"] = _with(
        facts,
        "prev_release_reason",
        moved & released,
        (ReleaseReason.EXPIRED.value,),
        np.zeros(len(released), int),
    )
    facts["prev_release_end_ns"] = np.where(
        moved,
        np.where(released, np.minimum(expiry_ns, start), np.maximum(expiry_ns, start + 1)),
        on(r.release_end),
    )

    positions = r.rows[again]
    reads, reused = r.reads.copy(), np.where(r.reads, r.candidate, 0)
    reads[positions] = np.where(changed, done, reads[positions])
    reused[positions] = np.where(reads[positions], col.num(facts, "candidate_tokens"), 0)
    if r.verdicts is None:  # an unlabelled table: decide every row
        whole = r.turns.copy(deep=False)
        for column in FACTS:
            if column in facts:
                values = whole[column].astype(object).to_numpy().copy()
                values[positions] = facts[column].astype(object).to_numpy()
                whole[column] = values
        verdicts = decide(whole, context).verdict
    else:
        verdicts = r.verdicts.copy()
        if len(facts):
            verdicts[positions] = decide(facts, context).verdict
    return Replay(verdicts, reads, reused, facts, ttl_s, threshold, proxy_lifetime_s)
