"""The fleet report from classified turn rows (``kvobs collect``'s turn store), read in
batches with mergeable aggregates: memory stays flat however many turns the store holds,
and no turn is classified again (the classifier did, once, as its spans arrived).

Each batch becomes a small labelled frame and goes through the span path's own
functions (``kvobs.fleet.report``): verdict counts and sums per scope, phase sums in
integer nanoseconds, D's memory and the retention sums, all added up exactly; p50/p95 by
a DDSketch per quantity (``kvobs.fleet.sketch``: within 1 %). Three reads, each of a
few columns: the keys (which turns have several versions, the newest turn start for
``--since``), the aggregates, then the slow turns over the p95 the second read found.

What turn rows cannot give, said in the report (``TurnRowReport.degraded``): the
per-conversation retention spread and costliest conversations (a conversation's turns
are not read together), and the plots of ``--html`` (they draw every turn).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, cast

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from ddsketch import DDSketch

from kvobs import semconv as sc
from kvobs.fleet.report import (
    _NOT_FAULTS,
    LISTED_FAULTS,
    FleetReport,
    _Measured,
    _sum_ns,
    add_buckets,
    memory_result,
    memory_sums,
    phase_row,
    ranking,
    scope_metrics,
    unmeasured_latency,
)
from kvobs.fleet.retention import RetentionSums, read_bytes_per_block
from kvobs.fleet.since import since_cutoff_ns
from kvobs.fleet.turn_drill import Ranked, drill_rows, slow_turns
from kvobs.fleet.sketch import add_values, new_sketch, p50_p95, quantile
from kvobs.live.turn_measures import MEASURES_COLUMN, unpack
from kvobs.live.turnstore import TurnRows
from kvobs.timeline import PHASES, phase_column

# Rows per batch: a frame of ~70 columns and its temporaries (961k turns: 131,072 peaked
# at 677 MiB, 262,144 at 974 MiB; bench/README.md).
BATCH_ROWS = 131_072
_KEY_COLUMNS = ["tenant", "conversation_id", "turn", "version"]
_ROW_COLUMNS = ["verdict", "slowest_phase", "latency_s", "ttft_s", "prompt_tokens"]
_CONTEXT_COLUMNS = ["finalized_at", "prefill_tokens_per_s"]
AGGREGATED = _KEY_COLUMNS + _ROW_COLUMNS + _CONTEXT_COLUMNS + [MEASURES_COLUMN]
_SCOPES = ("first_turn", "later_turns")
_GROUPINGS = {  # section: (keys, scope of its rows)
    "by_turn": (("turn_bucket",), None),
    "by_prompt": (("prompt_bucket",), "later_turns"),
    "by_turn_and_prompt": (("turn_bucket", "prompt_bucket"), None),
}
_BUCKET_NAMES = {"turn_bucket": sc.TURN_BUCKET_VALUES, "prompt_bucket": sc.PROMPT_BUCKET_VALUES}
DEGRADED = {
    "retention.conversations": "per-conversation sums need each conversation's turns "
    "together; turn rows are read in batches",
    "html": "the plots draw every turn; read the spans for --html",
}


# --------------------------------------------------------------------------- reading


@dataclass
class _Versions:
    """The first read: turns stored in several versions (re-classified, or retired by
    lineage) with their newest version, and the newest turn start."""

    newest: dict[tuple, int] = field(default_factory=dict)
    latest_start_ns: float | None = None  # None: no stored turn has a start

    def add_starts(self, batch: pa.RecordBatch) -> None:
        starts = _turn_starts(batch)
        if not np.isnan(starts).all():
            newest, latest = float(np.nanmax(starts)), self.latest_start_ns
            self.latest_start_ns = newest if latest is None else max(latest, newest)

    def add(self, batch: pa.RecordBatch) -> None:
        later = batch.filter(pc.greater(batch.column("version"), 1))
        for tenant, cid, turn, version in zip(*(later.column(c).to_pylist() for c in _KEY_COLUMNS)):
            key = (tenant, cid, turn)
            self.newest[key] = max(self.newest.get(key, 1), version)

    def latest_rows(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """The batch without rows another version replaces, nor retired turns (their
        newest row has no verdict). A turn's first version is the only row of most turns:
        only rows of conversations that have a later version are looked at one by one."""
        if self.newest:
            cids = pa.array(sorted({key[1] for key in self.newest}), pa.string())
            suspect = pc.is_in(batch.column("conversation_id"), value_set=cids)
            keep = np.ones(batch.num_rows, bool)
            for i in np.flatnonzero(suspect.to_numpy(zero_copy_only=False)).tolist():
                key = tuple(batch.column(c)[i].as_py() for c in _KEY_COLUMNS[:3])
                keep[i] = batch.column("version")[i].as_py() == self.newest.get(key, 1)
            batch = batch.filter(pa.array(keep))
        return batch.filter(pc.is_valid(batch.column("verdict")))


def _batches(
    rows: TurnRows, columns: list[str], versions: _Versions | None, cutoff: int | None
) -> Iterator[pa.RecordBatch]:
    for batch in rows.batches(columns, BATCH_ROWS):
        if versions is not None:
            batch = versions.latest_rows(batch)
        if cutoff is not None:
            batch = batch.filter(pa.array(_turn_starts(batch) >= cutoff))  # NaN: False
        if batch.num_rows:
            yield batch


def _turn_starts(batch: pa.RecordBatch) -> np.ndarray:
    return unpack(batch.column(MEASURES_COLUMN))["turn_start_ns"]


def _frame(batch: pa.RecordBatch) -> pd.DataFrame:
    """A batch as the span path's labelled table (the columns its functions read)."""
    plain = pa.Table.from_batches([batch]).drop_columns([MEASURES_COLUMN])
    measures = pd.DataFrame(unpack(batch.column(MEASURES_COLUMN)))
    frame = pd.concat([plain.to_pandas(), measures], axis=1)
    add_buckets(frame)
    return frame


# --------------------------------------------------------------------------- aggregates


@dataclass
class _ScopeTally:
    """``scope_metrics``' inputs for one scope, added up batch by batch."""

    turns: int = 0
    verdicts: Counter = field(default_factory=Counter)
    sums: Counter = field(default_factory=Counter)
    ttft_unmeasured: int = 0
    ttft: DDSketch = field(default_factory=new_sketch)
    latency: DDSketch = field(default_factory=new_sketch)

    def add(self, measured: _Measured, rows: np.ndarray) -> None:
        codes = measured.verdict_codes.take(rows)
        tally = np.bincount(codes[codes >= 0], minlength=len(measured.verdict_names))
        self.verdicts.update({n: int(k) for n, k in zip(measured.verdict_names, tally) if k})
        self.sums.update(measured.sums(rows))
        ttft = measured.ttft_s.take(rows)
        self.turns += len(rows)
        self.ttft_unmeasured += int(np.isnan(ttft).sum())
        add_values(self.ttft, ttft)
        add_values(self.latency, measured.latency_s.take(rows))

    def metrics(self) -> dict[str, Any]:
        sums = {k: int(self.sums.get(k, 0)) for k in _Measured.SUMS}
        return scope_metrics(
            self.turns,
            dict(self.verdicts),
            sums,
            p50_p95(self.ttft),
            p50_p95(self.latency),
            self.ttft_unmeasured,
        )


@dataclass
class _PhaseTally:
    """``ranking``'s inputs for one scope."""

    turns: int = 0
    timed: int = 0
    latency_ns: int = 0
    gap_ns: int = 0
    gap_turns: int = 0
    slowest: Counter = field(default_factory=Counter)
    total_ns: Counter = field(default_factory=Counter)
    measured: Counter = field(default_factory=Counter)
    sketches: dict[str, DDSketch] = field(
        default_factory=lambda: {p.value: new_sketch() for p in PHASES}
    )

    def add(
        self,
        frame: pd.DataFrame,
        rows: np.ndarray,
        unmeasured,
        slowest: tuple[np.ndarray, list[str]],
    ) -> None:
        """The turns at ``rows``; ``slowest``: each turn's slowest phase as a code into
        the names (-1: none), worked out once for the batch's scopes."""
        latency = frame["latency_s"].to_numpy(float, na_value=np.nan).take(rows)
        timed = ~np.isnan(latency)
        self.turns += len(rows)
        self.timed += int(timed.sum())
        self.latency_ns += _sum_ns(latency[timed])
        seconds, gaps = (values.take(rows)[timed] for values in unmeasured)
        self.gap_ns += _sum_ns(seconds)
        self.gap_turns += int(gaps.sum())
        codes, names = slowest
        tally = np.bincount(codes.take(rows) + 1, minlength=len(names) + 1)[1:]  # -1: none
        self.slowest.update({name: int(k) for name, k in zip(names, tally.tolist()) if k})
        for phase in PHASES:
            values = frame[phase_column(phase)].to_numpy(float, na_value=np.nan).take(rows)
            values = values[~np.isnan(values)]
            self.total_ns[phase.value] += _sum_ns(values)
            self.measured[phase.value] += len(values)
            add_values(self.sketches[phase.value], values)

    def section(self) -> dict[str, Any]:
        rows = [
            phase_row(
                p.value,
                self.total_ns[p.value],
                self.measured[p.value],
                p50_p95(self.sketches[p.value]),
                self.slowest,
            )
            for p in PHASES
        ]
        return ranking(self.turns, self.timed, self.latency_ns, self.gap_ns, self.gap_turns, rows)


# --------------------------------------------------------------------------- the report


def turn_row_report(
    rows: TurnRows,
    source: str = "",
    since: str | None = None,
    read_slo_s: float | None = None,
) -> FleetReport:
    """``build_report``'s report from stored turn rows (``report.extras``: the
    ``drill_down`` and what could not come from turn rows, ``degraded``)."""
    versions = _Versions()
    for batch in rows.batches(_KEY_COLUMNS, BATCH_ROWS, later_versions=True):
        versions.add(batch)
    if since:  # the newest turn start, which a duration counts back from
        for batch in rows.batches([MEASURES_COLUMN], BATCH_ROWS):
            versions.add_starts(batch)
    latest = versions.latest_start_ns
    # No turn with a start: nothing to cut (a duration has no newest turn to count from).
    cutoff = since_cutoff_ns(int(latest), since) if since and latest is not None else None
    scopes = {scope: _ScopeTally() for scope in _SCOPES}
    groups: dict[str, dict[tuple, _ScopeTally]] = {name: {} for name in _GROUPINGS}
    phases = {scope: _PhaseTally() for scope in _SCOPES}
    memory: Counter[str] = Counter()
    retained = RetentionSums()
    per_block = new_sketch()
    conversations: list[np.ndarray] = []
    faults = Ranked(LISTED_FAULTS)
    fault_count, rate, rate_at, synthetic = 0, None, -np.inf, None
    for batch in _batches(rows, AGGREGATED, versions, cutoff):
        frame = _frame(batch)
        first = (frame["turn"] == 1).to_numpy(bool)
        scope_rows = {"first_turn": np.flatnonzero(first), "later_turns": np.flatnonzero(~first)}
        measured = _Measured.of(frame)
        for scope, at in scope_rows.items():
            scopes[scope].add(measured, at)
        every = np.arange(len(frame))
        for name, (keys, grouped) in _GROUPINGS.items():
            _add_groups(
                groups[name], frame, measured, keys, scope_rows[grouped] if grouped else every
            )
        unmeasured = unmeasured_latency(frame)
        codes, names = pd.factorize(frame["slowest_phase"])
        slowest = (codes.astype(np.int64), [str(name) for name in names])
        for scope, at in scope_rows.items():
            phases[scope].add(frame, at, unmeasured, slowest)
        memory.update(memory_sums(frame))
        retained = retained + RetentionSums.of(frame)
        add_values(per_block, read_bytes_per_block(frame))
        conversations.append(_conversation_hashes(batch))
        if len(conversations) > 8:
            conversations = [np.unique(np.concatenate(conversations))]
        verdicts = frame["verdict"]
        fault = (~verdicts.isin(_NOT_FAULTS)).to_numpy(bool)
        fault_count += int(fault.sum())
        faults.add(frame, fault)
        rate, rate_at = _latest_rate(frame, rate, rate_at)
        if synthetic is None:
            synthetic = str(frame["conversation_id"].iat[0]).startswith("synthetic-")
    weight = quantile(per_block, 0.5)
    thresholds = {scope: quantile(scopes[scope].latency, 0.95) for scope in _SCOPES}
    columns = _KEY_COLUMNS + ["verdict", "latency_s"] + ([MEASURES_COLUMN] if cutoff else [])
    # The third read: healthy turns at or above their scope's (sketched) p95.
    slow, slow_count = slow_turns(_batches(rows, columns, versions, cutoff), thresholds)
    # FleetReport's first_turn/later_turns and by_* fields, by name
    scope_metrics: dict[str, Any] = {scope: tally.metrics() for scope, tally in scopes.items()}
    grouped_rows: dict[str, Any] = {
        name: _group_rows(found, _GROUPINGS[name][0]) for name, found in groups.items()
    }
    report = FleetReport(
        source=source,
        since=since,
        conversations=len(np.unique(np.concatenate(conversations))) if conversations else 0,
        turns=sum(tally.turns for tally in scopes.values()),
        prefill_tokens_per_s=rate,
        **scope_metrics,
        **grouped_rows,
        # A Counter: a sum no batch added (an empty store) reads 0.
        memory=memory_result(cast(dict[str, float], memory), weight),
        phases={scope: tally.section() for scope, tally in phases.items()},
        retention={
            **retained.totals(weight),
            "conversations": {"unavailable": DEGRADED["retention.conversations"]},
        },
        synthetic=bool(synthetic),
    )
    chosen = [(row, "fault") for row in faults.rows] + [(row, "slow") for row in slow.rows]
    report.extras["drill_down"] = {
        "fault_turns": fault_count,
        "slow_turns": slow_count,
        "slow_threshold": "latency at or above its scope's p95 (turn 1, later turns; "
        "the p95 sketched, within 1 %)",
        "rows": drill_rows(rows, chosen, source, read_slo_s),
    }
    report.extras["degraded"] = DEGRADED
    return report


def _add_groups(found, frame, measured, keys, rows) -> None:
    codes = [frame[key].cat.codes.to_numpy(np.int64).take(rows) for key in keys]
    valid = np.logical_and.reduce([c >= 0 for c in codes])
    rows, codes = rows[valid], [c[valid] for c in codes]
    combined = np.zeros(len(rows), np.int64)
    for key, c in zip(keys, codes):
        combined = combined * len(_BUCKET_NAMES[key]) + c
    for value in np.unique(combined).tolist():
        group = tuple(int(c[combined == value][0]) for c in codes)
        found.setdefault(group, _ScopeTally()).add(measured, rows[combined == value])


def _group_rows(found: dict[tuple, _ScopeTally], keys: tuple[str, ...]) -> list[dict]:
    """Groups in ``groupby``'s order (each key's bucket order)."""
    return [
        {
            **{key: _BUCKET_NAMES[key][code] for key, code in zip(keys, group)},
            **found[group].metrics(),
        }
        for group in sorted(found)
    ]


def _conversation_hashes(batch: pa.RecordBatch) -> np.ndarray:
    """The batch's distinct conversations (tenant, id) as 64-bit hashes: the fleet's
    conversation count keeps 8 bytes per conversation, not its strings."""
    keys = pc.binary_join_element_wise(
        pc.fill_null(batch.column("tenant"), ""), batch.column("conversation_id"), "\x1f"
    )
    distinct = pc.unique(keys).to_numpy(zero_copy_only=False)
    return np.unique(pd.util.hash_array(distinct))


def _latest_rate(frame: pd.DataFrame, rate, rate_at) -> tuple[float | None, float]:
    """The prefill rate the most recently finalized turn was priced with."""
    finalized = frame["finalized_at"].to_numpy(float, na_value=np.nan)
    rates = frame["prefill_tokens_per_s"].to_numpy(float, na_value=np.nan)
    known = np.flatnonzero(~np.isnan(rates) & ~np.isnan(finalized))
    if len(known):
        last = known[np.argmax(finalized[known])]
        if finalized[last] >= rate_at:
            return float(rates[last]), float(finalized[last])
    return rate, rate_at


__all__ = ["AGGREGATED", "BATCH_ROWS", "DEGRADED", "turn_row_report"]
