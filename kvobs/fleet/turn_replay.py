"""``kvobs tune`` and ``kvobs whatif`` from classified turn rows (``kvobs collect``'s turn
store, a ClickHouse turn table): the span path's replay (``kvobs.fleet.replay``, verdicts
by ``kvobs.verdicts.decide``) over the stored facts (``turn_measures.REPLAY_FACTS``),
read in batches, memory bounded by ``PARTITION_ROWS`` whatever the fleet's size.

A replay links each turn to its conversation's next one, so the fleet is replayed in
partitions of whole conversations: partition ``k`` of ``n`` is the rows whose
conversation hashes to ``k`` modulo ``n``. One pass over every file writes each
partition's rows to its own temporary Arrow file (zstd, under ``tempfile``'s directory,
removed as soon as it is replayed), so the measures are read once however many
partitions there are. What the partitions give adds up:
hits, later turns, verdict counts, token and block-second sums. What the fleet decides
as one is read first, in passes over a few columns: each turn's latest version (as
``kvobs report`` keeps it), the prefill rate the rows were classified with (the latest
finalized row's, as the report shows), the most common recorded settings, and the
read-cost fit from least-squares sums (its cut, the 90th percentile of cost per token,
exact over up to ``EXACT_CUT_READS`` reads, else from a sketch within 1 %). The
bootstrap of ``kvobs tune``'s confidence draws from a reservoir of at most
``MAX_RESAMPLED_READS`` finished reads (all of them below that: the span path's own).
Every pass reads batches of at most ``PARTITION_ROWS`` turns (``batch_rows``), so a
batch's frame is never larger than a partition's.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from ddsketch import DDSketch

from kvobs.fleet.confidence import MAX_RESAMPLED_READS, READ_COLUMNS, Confidence, trust
from kvobs.fleet.replay import (
    MODE_COLUMNS,
    READ_COST_CUT,
    ReadModel,
    ReadSums,
    Recorded,
    fitted,
    most_common,
    usable_reads,
)
from kvobs.fleet.sketch import add_values, new_sketch, quantile
from kvobs.fleet.tune import Tuning, choose, plan, replay_counts, ttl_row
from kvobs.fleet.turn_report import BATCH_ROWS, newest_batches, KEY_COLUMNS, Versions
from kvobs.fleet.turn_tally import latest_rate
from kvobs.fleet.whatif import WhatIf, add_tally, compare, summary
from kvobs.live.turn_measures import MEASURES_COLUMN, REPLAY_FACTS, unpack
from kvobs.live.turnstore import TurnRows
from kvobs.verdicts import Context

# Turns a partition holds at once (a frame of ~60 columns: ~0.5 KB a turn).
PARTITION_ROWS = 262_144
# Partition files written at once: one pass over the store per this many partitions
# (an open file each).
SPILL_FILES = 256
# Up to this many reads, the read-cost cut is their exact percentile (8 bytes a read).
EXACT_CUT_READS = 1 << 21
_ROW_COLUMNS = ["verdict", "prompt_tokens", "finalized_at", "prefill_tokens_per_s"]
COLUMNS = KEY_COLUMNS + _ROW_COLUMNS + [MEASURES_COLUMN]
# The measures a replay reads beyond ``REPLAY_FACTS``.
_MEASURES = (
    "read_outcome",
    "read_bytes",
    "candidate_tokens",
    "recomputed_tokens",
    "export_blocks",
    "held_s",
    "export_end_ns",
    "release_end_ns",
    "turn_start_ns",
)
NEEDED = list(dict.fromkeys((*_MEASURES, *REPLAY_FACTS)))
# What the first pass reads of the measures.
_SCAN = list(dict.fromkeys((*MODE_COLUMNS, *READ_COLUMNS[1:], "read_outcome")))


PLACEMENT_UNAVAILABLE = (
    "the placement replay reads the host tier's copies (saves, evictions, sizes) "
    "that turn rows do not store; read the spans for --placement"
)


class NoTurns(ValueError):
    """The turn rows hold no turn (at its latest version)."""


def frame(batch: pa.RecordBatch, measures: list[str]) -> pd.DataFrame:
    """A batch as the span path's labelled table, the columns ``measures`` of it."""
    plain = pa.Table.from_batches([batch]).drop_columns([MEASURES_COLUMN]).to_pandas()
    unpacked = pd.DataFrame(unpack(batch.column(MEASURES_COLUMN), measures))
    return pd.concat([plain, unpacked], axis=1)


@dataclass
class _Reservoir:
    """A uniform sample of at most ``size`` finished reads without replacement (the
    ones of the smallest random keys): every read while there are no more."""

    size: int
    seed: int = 0
    reads: pd.DataFrame | None = None
    keys: np.ndarray = field(default_factory=lambda: np.empty(0))
    seen: int = 0

    def __post_init__(self) -> None:
        self.random = np.random.default_rng(self.seed)

    def add(self, reads: pd.DataFrame) -> None:
        self.seen += len(reads)
        reads = reads.reset_index(drop=True)
        joined = reads if self.reads is None else pd.concat([self.reads, reads], ignore_index=True)
        keys = np.concatenate([self.keys, self.random.random(len(reads))])
        if len(joined) > self.size:
            kept = np.sort(np.argpartition(keys, self.size)[: self.size])
            joined, keys = joined.iloc[kept].reset_index(drop=True), keys[kept]
        self.reads, self.keys = joined, keys


@dataclass
class _CostCut:
    """The read-cost cut: the exact ``READ_COST_CUT`` quantile of cost per token while
    at most ``EXACT_CUT_READS`` reads are held, else a sketch's."""

    values: list[np.ndarray] = field(default_factory=list)
    held: int = 0
    sketch: DDSketch | None = None

    def add(self, per_token: np.ndarray) -> None:
        if self.sketch is None and self.held + len(per_token) <= EXACT_CUT_READS:
            self.values.append(per_token)
            self.held += len(per_token)
            return
        if self.sketch is None:
            self.sketch = new_sketch()
            for values in self.values:
                add_values(self.sketch, values)
            self.values = []
        add_values(self.sketch, per_token)

    @property
    def exact(self) -> bool:
        return self.sketch is None

    def cut(self) -> float:
        if self.sketch is not None:
            found = quantile(self.sketch, READ_COST_CUT)
            return math.nan if found is None else float(found)
        values = np.concatenate(self.values) if self.values else np.empty(0)
        return float(np.quantile(values, READ_COST_CUT)) if len(values) else math.nan


@dataclass
class Fleet:
    """What the fleet decides as one, from the first passes over turn rows."""

    rows: TurnRows
    versions: Versions
    turns: int  # turns at their latest version
    later: int  # of them later turns
    rate: float | None
    modes: dict[str, float]
    counted: dict[str, Counter]
    model: ReadModel | None
    reservoir: _Reservoir
    exact_cut: bool

    def batches(self, columns: list[str]) -> Iterator[pa.RecordBatch]:
        return newest_batches(self.rows, columns, self.versions, None, batch_rows=batch_rows())

    def mode(self, column: str, kind: type):
        value = most_common(self.counted[column])
        return None if math.isnan(value) else kind(value)

    def partitions(self) -> Iterator[pd.DataFrame]:
        """The fleet's turns, whole conversations together, a partition at a time."""
        count = max(1, math.ceil(self.turns / PARTITION_ROWS))
        if count == 1:
            yield from _frames(list(self.batches(COLUMNS)))
            return
        with tempfile.TemporaryDirectory(prefix="kvobs-replay-") as spill:
            for first in range(0, count, SPILL_FILES):
                parts = range(first, min(first + SPILL_FILES, count))
                for path in _spilled(self.batches(COLUMNS), count, parts, spill):
                    with pa.OSFile(path) as source:
                        batches = pa.ipc.open_stream(source).read_all().to_batches()
                    os.remove(path)
                    yield from _frames(batches)


def batch_rows() -> int:
    """Rows a read gives at once: the report's batch, or a partition if smaller."""
    return min(BATCH_ROWS, PARTITION_ROWS)


def _frames(batches: list[pa.RecordBatch]) -> Iterator[pd.DataFrame]:
    """One partition's batches as one frame (none when it holds no turn)."""
    if batches:
        joined = pa.Table.from_batches(batches).combine_chunks().to_batches()
        yield pd.concat([frame(b, NEEDED) for b in joined], ignore_index=True)


def _spilled(
    batches: Iterator[pa.RecordBatch], count: int, parts: range, directory: str
) -> list[str]:
    """Each batch's rows of the partitions ``parts`` (of ``count``) appended to the
    partition's file under ``directory``, in the order they were read; the files
    written, in partition order."""
    writers: dict[int, pa.ipc.RecordBatchStreamWriter] = {}
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    try:
        for batch in batches:
            keys = pc.binary_join_element_wise(
                pc.fill_null(batch.column("tenant"), ""), batch.column("conversation_id"), "\x1f"
            ).to_numpy(zero_copy_only=False)
            owner = pd.util.hash_array(keys) % np.uint64(count)
            # A stable sort keeps each partition's rows in the order they were read.
            order = np.argsort(owner, kind="stable")
            bounds = np.searchsorted(owner[order], np.arange(parts.start, parts.stop + 1))
            grouped = batch.take(pa.array(order))
            for part, start, stop in zip(parts, bounds[:-1], bounds[1:]):
                if stop > start:
                    if part not in writers:
                        path = os.path.join(directory, f"{part}.arrows")
                        writers[part] = pa.ipc.new_stream(path, batch.schema, options=options)
                    writers[part].write_batch(grouped.slice(start, stop - start))
    finally:
        for writer in writers.values():
            writer.close()
    return [os.path.join(directory, f"{part}.arrows") for part in sorted(writers)]


def read_fleet(rows: TurnRows, seed: int = 0) -> Fleet:
    """The first passes: versions (keys of rows past a first version), then the
    counts, rate, settings and cost per token, then the read-cost sums at the cut."""
    versions = Versions()
    for batch in rows.batches(KEY_COLUMNS, batch_rows(), later_versions=True):
        versions.add(batch)
    counted: dict[str, Counter] = {column: Counter() for column in MODE_COLUMNS}
    turns = later = 0
    rate, rate_at = None, -np.inf
    reservoir, cost = _Reservoir(MAX_RESAMPLED_READS, seed), _CostCut()
    columns = KEY_COLUMNS + _ROW_COLUMNS + [MEASURES_COLUMN]
    for batch in newest_batches(rows, columns, versions, None, batch_rows=batch_rows()):
        scanned = frame(batch, _SCAN)
        turns += len(scanned)
        later += int((scanned["turn"] > 1).sum())
        for column in MODE_COLUMNS:
            values = scanned[column].to_numpy(float)
            counted[column].update(Counter(values[~np.isnan(values)].tolist()))
        batch_rate, at = latest_rate(scanned)
        if batch_rate is not None and at >= rate_at:
            rate, rate_at = batch_rate, at
        done = (scanned["read_outcome"] == "done").to_numpy(bool)
        reservoir.add(scanned.loc[done, READ_COLUMNS])
        tokens, seconds, _ = usable_reads(scanned)
        cost.add(seconds / tokens)
    sums = None
    if cost.held or not cost.exact:
        cut = cost.cut()
        read = [*KEY_COLUMNS, "verdict", MEASURES_COLUMN]
        for batch in newest_batches(rows, read, versions, None, batch_rows=batch_rows()):
            found = ReadSums.of(*usable_reads(frame(batch, READ_COLUMNS)), cut)
            if sums is None:
                sums = found
            else:
                sums.merge(found)
    if not turns:
        raise NoTurns("no turns")
    modes = {column: most_common(counts) for column, counts in counted.items()}
    model = fitted(sums) if sums is not None else None
    return Fleet(rows, versions, turns, later, rate, modes, counted, model, reservoir, cost.exact)


def tune_rows(
    rows: TurnRows, target: float = 0.95, seed: int = 0
) -> tuple[Tuning, Confidence, Fleet]:
    """``kvobs tune`` over turn rows: the tuning and its confidence (``confidence``'s,
    the bootstrap over ``Fleet.reservoir``)."""
    fleet = read_fleet(rows, seed)
    settled = plan(
        fleet.rate, fleet.model, fleet.mode("threshold", int), fleet.mode("ttl_s", float)
    )
    wanted = settled.replays()
    totals = {key: [0, 0, 0.0] for key in wanted}
    context = Context(fleet.rate)
    for part in fleet.partitions():
        recorded = Recorded(part, fleet.modes)
        for ttl, lifetime in wanted:
            found = replay_counts(recorded, ttl, settled.threshold, lifetime, fleet.model, context)
            totals[(ttl, lifetime)] = [a + b for a, b in zip(totals[(ttl, lifetime)], found)]

    def replayed(ttl: float, lifetime: float | None) -> dict[str, float]:
        hits, later, held = totals[(ttl, lifetime)]
        return ttl_row(ttl, lifetime, (int(hits), int(later), float(held)))

    tuning = choose(settled, replayed, target)
    reads = fleet.reservoir.reads
    sample = reads if reads is not None else pd.DataFrame(columns=READ_COLUMNS)
    confidence = trust(sample, fleet.later, tuning, seed=seed, of=fleet.reservoir.seen)
    return tuning, confidence, fleet


def whatif_rows(
    rows: TurnRows,
    ttl_s: float | None,
    threshold: int | None,
    proxy_lifetime_s: float | None = None,
) -> WhatIf:
    """``kvobs whatif`` over turn rows (no per-turn verdicts: ``WhatIf.verdicts`` is
    empty)."""
    fleet = read_fleet(rows)
    context = Context(fleet.rate)
    actual: dict = {}
    predicted: dict = {}
    changed = 0
    for part in fleet.partitions():
        found = compare(part, ttl_s, threshold, proxy_lifetime_s, fleet.model, context, fleet.modes)
        add_tally(actual, found.actual)
        add_tally(predicted, found.predicted)
        changed += found.changed_turns
    empty = {
        "later_turns": 0,
        "verdicts": Counter(),
        "reused_tokens": 0,
        "computed_tokens": 0,
        "block_seconds_held": 0.0,
    }
    return WhatIf(
        None if ttl_s is None else float(ttl_s),
        None if threshold is None else int(threshold),
        proxy_lifetime_s,
        actual=summary(actual or empty),
        predicted=summary(predicted or dict(empty)),
        changed_turns=changed,
    )


__all__ = [
    "Fleet",
    "NoTurns",
    "PLACEMENT_UNAVAILABLE",
    "NEEDED",
    "PARTITION_ROWS",
    "frame",
    "read_fleet",
    "tune_rows",
    "whatif_rows",
]
