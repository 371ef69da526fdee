"""The fleet report from classified turn rows (``kvobs collect``'s turn store), read in
batches with mergeable aggregates: memory stays flat however many turns the store holds,
and no turn is classified again (the classifier did, once, as its spans arrived).

Each batch becomes a small labelled frame and goes through the span path's own
functions (``kvobs.fleet.turn_tally``): verdict counts and sums per scope, phase sums in
integer nanoseconds, D's memory and the retention sums, all added up exactly; p50/p95 by
a DDSketch per quantity (``kvobs.fleet.sketch``: within 1 %). Three reads, each of a
few columns: the keys (which turns have several versions, the newest turn start for
``--since``), the aggregates, then the slow turns over the p95 the second read found.
A merged file with a tally kept next to it (``summarize``, run by ``kvobs collect`` as it
merges) is not read: its tally is merged in, so a report over a month of merged hours
reads a few hundred tallies and the keys of later versions.

On ClickHouse the second and third reads run in the engine (``kvobs.fleet.turn_sql``):
one ``GROUP BY`` hands back the un-tallied hours' tally (sketch buckets included) and
``ORDER BY ... LIMIT`` the listed faults and slow turns; only the distinct conversations
come back as rows (their hashes merge with the stored tallies').

What turn rows cannot give, said in the report (``TurnRowReport.degraded``): the
per-conversation retention spread and costliest conversations (a conversation's turns
are not read together), and the plots of ``--html`` (they draw every turn).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Iterator, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvobs.fleet.report import (
    FleetReport,
    Measured,
    memory_result,
    phase_row,
    ranking,
    scope_metrics,
)
from kvobs.fleet.since import since_cutoff_ns
from kvobs.fleet.sketch import p50_p95, quantile
from kvobs.fleet.turn_drill import Ranked, drill_rows, slow_turns
from kvobs.fleet.turn_sql import engine_tally
from kvobs.fleet.turn_tally import (
    BUCKET_NAMES,
    GROUPINGS,
    SCOPES,
    PhaseTally,
    ScopeTally,
    SlowTally,
    TurnTally,
    conversation_hashes,
    distinct_count,
    stored_conversations,
)
from kvobs.live.turn_measures import MEASURES_COLUMN, unpack
from kvobs.live.turnstore import TurnRows
from kvobs.timeline import PHASES

# Rows per batch: a frame of ~70 columns and its temporaries (961k turns: 131,072 peaked
# at 677 MiB, 262,144 at 974 MiB; bench/README.md).
BATCH_ROWS = 131_072
KEY_COLUMNS = ["tenant", "conversation_id", "turn", "version"]
_ROW_COLUMNS = ["verdict", "slowest_phase", "latency_s", "ttft_s", "prompt_tokens"]
_CONTEXT_COLUMNS = ["finalized_at", "prefill_tokens_per_s"]
AGGREGATED = KEY_COLUMNS + _ROW_COLUMNS + _CONTEXT_COLUMNS + [MEASURES_COLUMN]
DEGRADED = {
    "retention.conversations": "per-conversation sums need each conversation's turns "
    "together; turn rows are read in batches",
    "html": "the plots draw every turn; read the spans for --html",
}


# --------------------------------------------------------------------------- reading


@dataclass
class Versions:
    """The first read: turns stored in several versions (re-classified, or retired by
    lineage) with their newest version, and the newest turn start."""

    newest: dict[tuple, int] = field(default_factory=dict)
    latest_start_ns: float | None = None  # None: no stored turn has a start
    # (turns in ``newest`` when made, their conversations): made once for every batch,
    # not per batch (a replay's batches can be small).
    _suspects: tuple[int, pa.Array] | None = field(default=None, init=False, repr=False)

    def add_starts(self, batch: pa.RecordBatch) -> None:
        starts = _turn_starts(batch)
        if not np.isnan(starts).all():
            self.add_start(float(np.nanmax(starts)))

    def add_start(self, start_ns: float) -> None:
        if not np.isnan(start_ns):
            latest = self.latest_start_ns
            self.latest_start_ns = start_ns if latest is None else max(latest, start_ns)

    def add(self, batch: pa.RecordBatch) -> None:
        later = batch.filter(pc.greater(batch.column("version"), 1))
        for tenant, cid, turn, version in zip(*(later.column(c).to_pylist() for c in KEY_COLUMNS)):
            key = (tenant, cid, turn)
            self.newest[key] = max(self.newest.get(key, 1), version)

    def replaced(self, batch: pa.RecordBatch) -> list[bool]:
        """Per row, whether a newer version of its turn is stored."""
        return [
            version < self.newest.get((tenant, cid, turn), 1)
            for tenant, cid, turn, version in zip(
                *(batch.column(c).to_pylist() for c in KEY_COLUMNS)
            )
        ]

    def latest_rows(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """The batch without rows another version replaces, nor retired turns (their
        newest row has no verdict). A turn's first version is the only row of most turns:
        only rows of conversations that have a later version are looked at one by one."""
        if self.newest:
            if self._suspects is None or self._suspects[0] != len(self.newest):
                cids = pa.array(sorted({key[1] for key in self.newest}), pa.string())
                self._suspects = (len(self.newest), cids)
            suspect = pc.is_in(batch.column("conversation_id"), value_set=self._suspects[1])
            keep = np.ones(batch.num_rows, bool)
            for i in np.flatnonzero(suspect.to_numpy(zero_copy_only=False)).tolist():
                key = tuple(batch.column(c)[i].as_py() for c in KEY_COLUMNS[:3])
                keep[i] = batch.column("version")[i].as_py() == self.newest.get(key, 1)
            batch = batch.filter(pa.array(keep))
        return batch.filter(pc.is_valid(batch.column("verdict")))


def newest_batches(
    rows: TurnRows,
    columns: list[str],
    versions: Versions | None,
    cutoff: int | None,
    skip: Collection[str] = (),
    only: Collection[str] | None = None,
    batch_rows: int | None = None,  # None: BATCH_ROWS
) -> Iterator[pa.RecordBatch]:
    size = BATCH_ROWS if batch_rows is None else batch_rows
    for batch in rows.batches(columns, size, skip=skip, only=only):
        if versions is not None:
            batch = versions.latest_rows(batch)
        if cutoff is not None:
            batch = batch.filter(pa.array(_turn_starts(batch) >= cutoff))  # NaN: False
        if batch.num_rows:
            yield batch


def _turn_starts(batch: pa.RecordBatch) -> np.ndarray:
    return unpack(batch.column(MEASURES_COLUMN), ["turn_start_ns"])["turn_start_ns"]


# --------------------------------------------------------------------------- the report


def turn_row_report(
    rows: TurnRows,
    source: str = "",
    since: str | None = None,
    read_slo_s: float | None = None,
) -> FleetReport:
    """``build_report``'s report from stored turn rows (``report.extras``: the
    ``drill_down`` and what could not come from turn rows, ``degraded``). A file with a
    stored tally (``summarize``) is merged in, not read, unless one of its turns has a
    newer version elsewhere or ``--since`` cuts through it."""
    versions = Versions()
    for batch in rows.batches(KEY_COLUMNS, BATCH_ROWS, later_versions=True):
        versions.add(batch)
    cutoff = _cutoff(rows, since, versions) if since else None
    total, merged, unread = TurnTally(), set(), []  # unread: merged, or adding nothing
    corrections: dict[str, tuple] = {}  # merged less its turns replaced elsewhere
    stored_total = 0
    replaced = _Replaced(rows, versions)
    for path, data, tally in _stored(rows):
        use, stale = _use(path, tally, replaced, cutoff)
        if use is None and stale:
            corrected = _corrected(rows, path, data, tally, stale, versions)
            if corrected is not None:
                use, corrections[path] = True, corrected
        if use is not None:
            unread.append(path)
        if use:
            merged.add(path)
            total.merge(tally)
            stored_total += tally.conversation_total
    engine = engine_tally(rows, unread, cutoff)  # ClickHouse: its GROUP BY, no rows read
    if engine is not None:
        total.merge(engine.tally())
    else:
        for batch in newest_batches(rows, AGGREGATED, versions, cutoff, unread):
            total.add(batch)
    weight = quantile(total.per_block, 0.5)
    thresholds = {scope: quantile(total.scopes[scope].latency, 0.95) for scope in SCOPES}
    columns = KEY_COLUMNS + ["verdict", "latency_s"] + ([MEASURES_COLUMN] if cutoff else [])
    # The third read: healthy turns at or above their scope's (sketched) p95.
    if engine is not None:
        slow, slow_count = engine.slow(thresholds)
    else:
        batches = newest_batches(rows, columns, versions, cutoff, unread)
        slow, slow_count = slow_turns(batches, thresholds)
    for path, data in rows.summaries():
        stored = SlowTally.from_bytes(data) if path in merged else None
        if stored is not None:
            if path in corrections:
                stored.remove(*corrections[path][:2])
            listed, count = stored.over(thresholds)
            slow.merge(Ranked(slow.limit, listed))
            slow_count += count
    conversations = _conversation_count(rows, total, merged, stored_total, corrections)
    report = _report(total, conversations, source, since, weight)
    chosen = [(row, "fault") for row in total.faults.rows] + [(row, "slow") for row in slow.rows]
    report.extras["drill_down"] = {
        "fault_turns": total.fault_count,
        "slow_turns": slow_count,
        "slow_threshold": "latency at or above its scope's p95 (turn 1, later turns; "
        "the p95 sketched, within 1 %)",
        "rows": drill_rows(rows, chosen, source, read_slo_s),
    }
    report.extras["degraded"] = DEGRADED
    return report


def _conversation_count(
    rows: TurnRows,
    read: TurnTally,
    merged: set[str],
    stored_total: int,
    corrections: dict[str, tuple],
) -> int:
    """The distinct conversations of the rows read and of the merged tallies (less
    those a correction took all of a file's turns of; ``stored_total``: how many the
    merged tallies hold together)."""

    def parts() -> Iterator[np.ndarray]:
        yield from read.conversations
        for path, data in rows.summaries():
            if path in merged:
                held = stored_conversations(data)
                if path in corrections:
                    held = held[~np.isin(held, corrections[path][2])]
                yield held

    return distinct_count(parts, sum(len(h) for h in read.conversations) + stored_total)


def _report(
    total: TurnTally, conversations: int, source: str, since: str | None, weight
) -> FleetReport:
    # FleetReport's first_turn/later_turns and by_* fields, by name
    scope_metrics: dict[str, Any] = {
        scope: _scope_metrics(tally) for scope, tally in total.scopes.items()
    }
    grouped_rows: dict[str, Any] = {
        name: _group_rows(found, GROUPINGS[name][0]) for name, found in total.groups.items()
    }
    return FleetReport(
        source=source,
        since=since,
        conversations=conversations,
        turns=sum(tally.turns for tally in total.scopes.values()),
        prefill_tokens_per_s=total.rate,
        **scope_metrics,
        **grouped_rows,
        # A Counter: a sum no batch added (an empty store) reads 0.
        memory=memory_result(cast(dict[str, float], total.memory), weight),
        phases={scope: _phase_section(tally) for scope, tally in total.phases.items()},
        retention={
            **total.retained.totals(weight),
            "conversations": {"unavailable": DEGRADED["retention.conversations"]},
        },
        synthetic=bool(total.synthetic),
    )


def _scope_metrics(tally: ScopeTally) -> dict[str, Any]:
    sums = {k: int(tally.sums.get(k, 0)) for k in Measured.SUMS}
    return scope_metrics(
        tally.turns,
        dict(tally.verdicts),
        sums,
        p50_p95(tally.ttft),
        p50_p95(tally.latency),
        tally.ttft_unmeasured,
    )


def _phase_section(tally: PhaseTally) -> dict[str, Any]:
    rows = [
        phase_row(
            p.value,
            tally.total_ns[p.value],
            tally.measured[p.value],
            p50_p95(tally.sketches[p.value]),
            tally.slowest,
        )
        for p in PHASES
    ]
    return ranking(tally.turns, tally.timed, tally.latency_ns, tally.gap_ns, tally.gap_turns, rows)


def _cutoff(rows: TurnRows, since: str, versions: Versions) -> int | None:
    """``--since``'s cutoff in turn-start nanoseconds: a duration counts back from the
    newest turn start of any stored row (a stored tally knows its file's)."""
    stored = []
    for path, _, tally in _stored(rows):
        stored.append(path)
        versions.add_start(tally.newest_start_ns)
    engine = engine_tally(rows, stored, None)
    if engine is not None:  # ClickHouse: the newest start by the engine
        versions.add_start(engine.newest_start())
    else:
        for batch in rows.batches([MEASURES_COLUMN], BATCH_ROWS, skip=stored):
            versions.add_starts(batch)
    latest = versions.latest_start_ns
    # No turn with a start: nothing to cut (a duration has no newest turn to count from).
    return since_cutoff_ns(int(latest), since) if latest is not None else None


def _stored(rows: TurnRows) -> Iterator[tuple[str, bytes, TurnTally]]:
    """The stored tallies this kvobs reads, one at a time."""
    for path, data in rows.summaries():
        tally = TurnTally.from_bytes(data)
        if tally is not None:
            yield path, data, tally


class _Replaced:
    """The conversations with a turn stored in several versions, and which of them a
    file holds (its index asked once for all of them)."""

    def __init__(self, rows: TurnRows, versions: Versions):
        self.keys: dict[str, list[tuple[tuple, int]]] = {}
        for key, version in versions.newest.items():
            self.keys.setdefault(key[1], []).append((key, version))
        self.held = rows.lookup(sorted(self.keys)) if self.keys else None

    def stale(self, path: str, own_versions: dict[tuple, int]) -> set[str]:
        """The file's conversations with a turn whose newest version it does not hold."""
        if self.held is None:
            return set()
        return {
            cid
            for cid in self.held(path)
            if any(own_versions.get(key, 1) < version for key, version in self.keys[cid])
        }


def _use(
    path: str, tally: TurnTally, replaced: _Replaced, cutoff: int | None
) -> tuple[bool | None, set[str]]:
    """Whether a file's stored tally stands for its rows in this report (True), or the
    file adds nothing to it (False: every turn before the cutoff); None: its rows must
    be read (the cutoff falls among its turns), or, with the conversations whose turns
    have a newer version in another file, the tally corrected for them."""
    if cutoff is not None and tally.turns:
        if not tally.last_start_ns >= cutoff:  # NaN: no turn has a start
            return False, set()
        if tally.unstarted or not tally.first_start_ns >= cutoff:
            return None, set()
    stale = replaced.stale(path, tally.own_versions)
    return (None, stale) if stale else (True, set())


def _corrected(
    rows: TurnRows,
    path: str,
    data: bytes,
    tally: TurnTally,
    stale: set[str],
    versions: Versions,
) -> tuple[SlowTally, set[tuple], np.ndarray] | None:
    """``tally`` without the file's turns that a newer version in another file replaces
    (the ``stale`` conversations' rows, looked up through the file's index); what the
    last read takes out of the file's slow turns. None, ``tally`` unchanged, when that
    cannot be exact (``TurnTally.remove``, ``SlowTally.remove``): the file is read.
    Also the conversations the file no longer holds a turn of."""
    table = rows.conversation_rows(path, sorted(stale))
    slow = SlowTally.from_bytes(data)
    if table is None or slow is None:
        return None
    gone_slow = SlowTally()
    gone, keys, kept = TurnTally(slow=gone_slow), set[tuple](), []
    for batch in table.select(AGGREGATED).to_batches():
        counted = Versions(newest=tally.own_versions).latest_rows(batch)
        replaced = pa.array(versions.replaced(counted))
        kept.append(conversation_hashes(counted.filter(pc.invert(replaced))))
        counted = counted.filter(replaced)
        if counted.num_rows:
            gone.add(counted)
            keys.update(
                (cid, tenant or "", turn)
                for tenant, cid, turn in zip(
                    *(counted.column(c).to_pylist() for c in KEY_COLUMNS[:3])
                )
            )
    if not slow.remove(gone_slow, keys) or not tally.remove(gone, keys):
        return None
    return gone_slow, keys, gone.vanished(np.concatenate(kept))


def summarize(rows: TurnRows) -> list[str]:
    """Keeps a tally next to each merged file of the store that has none (what the
    report would add up over its rows, at the file's own newest versions); returns the
    files. ``kvobs collect`` runs it after merging."""
    done = []
    for path in rows.unsummarized():
        only = [path]
        versions = Versions()
        for batch in rows.batches(KEY_COLUMNS, BATCH_ROWS, later_versions=True, only=only):
            versions.add(batch)
        engine = engine_tally(rows, (), None, only)
        if engine is not None:  # ClickHouse: the hour added up by the engine
            tally = engine.tally()
            tally.slow = engine.slow_tally()
            tally.newest_start_ns = engine.newest_start()
        else:
            for batch in rows.batches([MEASURES_COLUMN], BATCH_ROWS, only=only):
                versions.add_starts(batch)
            tally = TurnTally(slow=SlowTally())
            tally.newest_start_ns = (
                np.nan if versions.latest_start_ns is None else versions.latest_start_ns
            )
            for batch in newest_batches(rows, AGGREGATED, versions, None, only=only):
                tally.add(batch)
        tally.own_versions = dict(versions.newest)
        try:
            rows.write_summary(path, tally.to_bytes())
        except FileNotFoundError:
            continue  # merged away meanwhile
        done.append(path)
    return done


def _group_rows(found: dict[tuple, ScopeTally], keys: tuple[str, ...]) -> list[dict]:
    """Groups in ``groupby``'s order (each key's bucket order)."""
    return [
        {
            **{key: BUCKET_NAMES[key][code] for key, code in zip(keys, group)},
            **_scope_metrics(found[group]),
        }
        for group in sorted(found)
    ]


__all__ = ["AGGREGATED", "BATCH_ROWS", "DEGRADED", "summarize", "turn_row_report"]
