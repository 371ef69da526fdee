"""The report's tally of ClickHouse turn rows computed by ClickHouse: ``GROUP BY``
queries hand back what ``TurnTally.add`` would have added up over the rows (counts and
integer sums per scope, verdict and bucket, the phase tallies, D's memory and the
retention sums, every DDSketch's bucket counts, the listed faults), so the rows of
hours without a stored tally never leave the engine. ``kvobs.fleet.turn_report`` uses
it for a ``ClickHouseTurns`` (``engine_tally``); the embedded store keeps the batches.

What is aggregated is still defined once, by the Python tally:

- a measure is read from the packed record at its offset in ``MEASURE_DTYPE``
  (``measure``), as ``unpack`` reads it: a float, NaN for null;
- the row-level numbers are the span path's formulas (``Measured``, ``memory_sums``,
  ``RetentionSums.of``, ``unmeasured_latency``), each written here once in SQL over
  those values, with NaN where numpy has NaN; the names and types of the memory and
  retention sums are those of the Python functions run on an empty batch (checked);
- a sketch bucket is ``kvobs.fleet.sketch.bucket_key_sql``, the numpy expression of
  ``add_values`` with the sketch's own constants, and the counts go into the sketch
  through ``add_keyed``, as ``add_values`` puts them: the quantiles are the same;
- the latest version of each turn: the newest version stored of its key, anywhere in the
  table (``Versions``), retired turns (no verdict) left out;
- conversations: the distinct (tenant, id) pairs come back and are hashed by
  ``conversation_hashes``, so they merge exactly with the stored tallies' hashes (an
  engine-side ``uniqExact`` would count this part exactly but could not be merged with
  the hours that have a tally: a conversation spans hours).

Floats are summed in the engine's order (within a few ulps of the rows path); counts,
integer sums and sketch buckets are exact.
"""

from __future__ import annotations

import calendar
import time
from collections import Counter
from typing import Any, Collection

import numpy as np
import pyarrow as pa

from kvobs import semconv as sc
from kvobs.fleet.report import LISTED_FAULTS, LISTED_SLOW, memory_sums
from kvobs.fleet.retention import RetentionSums
from kvobs.fleet.sketch import add_keyed, bucket_key_sql, zero_bound
from kvobs.fleet.turn_drill import Ranked
from kvobs.fleet.turn_tally import (
    GROUPINGS,
    SCOPES,
    ScopeTally,
    SlowTally,
    TurnTally,
    labelled_frame,
    conversation_hashes,
)
from kvobs.live.turnstore import SCHEMA
from kvobs.live.turn_measures import ENUMS, KINDS, MEASURE_DTYPE, MEASURES_COLUMN, NULL_INT
from kvobs.semconv import NOT_FAULT_VALUES, VERDICT_VALUES, ReadOutcome, ReleaseReason
from kvobs.timeline import PHASES, phase_column
from kvobs.turns.schema import DEVICE_BLOCK_SECONDS, HOST_BYTE_SECONDS

# Off: the report reads the rows in batches as from any store (tests compare the two).
PUSH_DOWN = True
# An hour's tally (``summarize``) is the engine's from this many rows on: its ~8 queries
# cost ~0.7 s whatever the rows (planning a query of ~50 kB), reading rows ~12-45 us a
# row (1M turns: the engine 4.7-6.0 s, rows 11.4-11.8 s; an hour of 4.2k turns: the
# engine 0.76 s, rows 0.19 s; bench/README.md, run 6).
ENGINE_MIN_ROWS = 100_000


# --------------------------------------------------------------------------- values


def _offsets() -> dict[str, int]:
    """Each measure's byte offset in the record (``MEASURE_DTYPE``, packed in order)."""
    offsets, offset = {}, 0
    for name in KINDS:
        offsets[name] = offset
        offset += MEASURE_DTYPE[name].itemsize
    return offsets


def _record_sizes() -> list[int]:
    """The record sizes ``unpack`` reads (today's and each older prefix of it)."""
    return [offset + MEASURE_DTYPE[name].itemsize for name, offset in _offsets().items()]


def measure(name: str) -> str:
    """A packed measure as ``unpack`` gives it, Float64 with NaN for null (no record, a
    record of an unknown size, or one too short to hold it: ``RECORD``, the record's
    size when ``unpack`` reads it, else 0); an enumeration as its code (-1: null)."""
    offset = _offsets()[name]
    raw = f"substring(`{MEASURES_COLUMN}`, {offset + 1}, 8)"
    held = f"record >= {offset + 8}"
    kind = KINDS[name]
    if kind == "float":
        value = f"if({held}, reinterpretAsFloat64({raw}), nan)"
    elif kind == "str":
        return f"ifNull(if({held}, reinterpretAsInt64({raw}), -1), -1)"
    else:
        number = f"reinterpretAsInt64({raw})"
        value = f"if({held} AND {number} != {NULL_INT}, toFloat64({number}), nan)"
    return f"ifNull({value}, nan)"  # the column is Nullable: a NULL record's is too


# The size of a row's record, when ``unpack`` reads it (today's, or an older prefix of
# it), else 0: every ``measure`` reads it.
RECORD = (
    f"ifNull(if(length(`{MEASURES_COLUMN}`) IN ({', '.join(map(str, _record_sizes()))}), "
    f"length(`{MEASURES_COLUMN}`), 0), 0)"
)


def code(name: str, value: str) -> int:
    """The packed code of an enumeration's value."""
    return ENUMS[name].index(value)


def _nan0(value: str) -> str:
    return f"if(isNaN({value}), 0., {value})"


def _ns(seconds: str) -> str:
    """``sum_ns``' term: seconds as integer nanoseconds, rounded half to even."""
    # evaluated on every row (sumIf's condition does not guard it): NaN as 0
    return f"toInt64(roundBankers(if(isFinite({seconds}), {seconds}, 0.) * 1e9))"


def _bucket_sql(value: str, bounds) -> str:
    """The position of ``value``'s bucket among ``sc``'s (upper bound, label) pairs,
    then the last one (``turn_bucket``, ``prompt_bucket``)."""
    arms = ", ".join(f"{value} <= {upper}, {i}" for i, (upper, _) in enumerate(bounds))
    return f"multiIf({arms}, {len(bounds)})"


def _quoted(values: Collection[str]) -> str:
    return ", ".join("'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'" for v in values)


_PHASES = [phase_column(p) for p in PHASES]
_DONE = f"{measure('read_outcome')} = {code('read_outcome', ReadOutcome.DONE.value)}"
_PROMPT = (
    "if(prompt_tokens IS NOT NULL, toFloat64(prompt_tokens), "
    f"{measure('host_lookup_prompt_tokens')})"
)
_PROMPT_INT = f"if(isNaN({_PROMPT}), -1, toInt64({_PROMPT}))"
# Each kept row's values, named for the queries below (``Measured`` and the others).
_ROW = {
    "record": RECORD,
    "first": "turn = 1",
    "v": "toString(verdict)",
    "lat": "ifNull(latency_s, nan)",
    "ttft": "ifNull(ttft_s, nan)",
    "tb": _bucket_sql("turn", sc.TURN_BUCKETS),
    "pb": f"if({_PROMPT_INT} >= 0, {_bucket_sql(_PROMPT_INT, sc.PROMPT_BUCKETS)}, -1)",
    # Measured
    "bytes_read": f"if({_DONE}, {_nan0(measure('read_bytes'))}, 0.)",
    "reused_tokens": f"if({_DONE}, {_nan0(measure('candidate_tokens'))}, 0.)",
    "recomputed_tokens": _nan0(measure("recomputed_tokens")),
    "host_bytes_loaded": _nan0(measure("host_load_bytes")),
    "host_reused_tokens": f"{_nan0(measure('host_hit_host_tokens'))} + "
    f"{_nan0(measure('host_hit_p2p_tokens'))}",
    # memory_sums
    "blocks": measure("export_blocks"),
    "held": f"if(isNaN({measure('held_s')}), "
    f"({measure('release_end_ns')} - {measure('export_end_ns')}) / 1e9, {measure('held_s')})",
    "released_read": f"{measure('release_reason')} = "
    f"{code('release_reason', ReleaseReason.READ.value)} "
    f"OR {measure('release_read_count')} > 0",
    # RetentionSums.of
    "device": measure(DEVICE_BLOCK_SECONDS.name),
    "host": measure(HOST_BYTE_SECONDS.name),
    "saved": measure("host_saved_bytes"),
    "save_end": measure("host_save_end_ns"),
    "recording_end": "greatest("
    + ", ".join(
        f"if(isFinite({measure(n)}), {measure(n)}, -inf)"
        for n in ("turn_end_ns", "release_end_ns", "host_save_end_ns", "host_evict_end_ns")
    )
    + ")",
    "per_block": f"if({_DONE}, {measure('read_bytes')} / {measure('read_blocks')}, nan)",
    "start": measure("turn_start_ns"),
    "rate": "ifNull(prefill_tokens_per_s, nan)",
    "finalized": "finalized_at",
    "phase": "toString(slowest_phase)",
    # the rows' order (NULL tenants last, as ORDER BY puts them)
    "order_key": "(isNull(tenant), ifNull(tenant, ''), conversation_id, turn, version)",
    **{f"p{i}": measure(name) for i, name in enumerate(_PHASES)},
}
# The turn table's columns the queries read.
_READ = [
    *("tenant", "conversation_id", "turn", "version", "verdict", "latency_s", "ttft_s"),
    *("prompt_tokens", "prefill_tokens_per_s", "finalized_at", "slowest_phase"),
    MEASURES_COLUMN,
]
_SUMS = (
    "bytes_read",
    "reused_tokens",
    "recomputed_tokens",
    "host_bytes_loaded",
    "host_reused_tokens",
)
_HEALTHY = f"v IN ({_quoted(sorted(NOT_FAULT_VALUES))})"


def _latest(table: str, where: list[str], source: str, hours: str = "") -> str:
    """The kept rows with ``_ROW``'s values: each turn at the newest version stored of
    it (``Versions.latest_rows``: a turn without a later version keeps its rows),
    retired turns (no verdict) out. ``source``: the table's rows as a subquery (with the
    columns a table of an older kvobs lacks as nulls); ``hours``: a condition on the
    rows whose versions count (a tally of one hour: its own versions), else every row."""
    later_rows = f"{table} WHERE version > 1{' AND ' + hours if hours else ''}"
    later = (
        f"SELECT tenant, conversation_id, turn, max(version) FROM {later_rows} "
        "GROUP BY tenant, conversation_id, turn"
    )
    newest = (
        f"(conversation_id NOT IN (SELECT conversation_id FROM {later_rows}) "
        f"OR (tenant, conversation_id, turn, version) IN ({later}) "
        f"OR (version = 1 AND (tenant, conversation_id, turn) NOT IN "
        f"(SELECT tenant, conversation_id, turn FROM {later_rows})))"
    )
    conditions = " AND ".join(["verdict IS NOT NULL", newest, *where])
    values = ", ".join(f"{sql} AS {name}" for name, sql in _ROW.items())
    return f"SELECT tenant, conversation_id, turn, {values} FROM {source} WHERE {conditions}"


# --------------------------------------------------------------------------- the tally


class EngineTally:
    """The tally of a ``ClickHouseTurns``' rows outside the hours in ``skip`` (turn
    start at or after ``cutoff``), and their slow turns: one ``GROUP BY`` pass over the
    rows by cell (first turn or not, turn bucket, prompt bucket: each cell's counts,
    sums, phase tallies and sketch buckets, merged here into the scope and groups it
    belongs to), then the listed faults and the distinct conversations."""

    def __init__(
        self,
        turns,
        skip: Collection[str],
        cutoff: int | None,
        only: Collection[str] | None = None,
    ):
        """``only``: the rows of those hours alone, at the newest versions they hold
        (``summarize``'s tally of an hour)."""
        from kvobs.live.clickhouse_turns import HOUR, HOUR_NAME, hour_literals

        self.turns = turns
        hours = [f"{HOUR} NOT IN ({hour_literals(skip)})"] if skip else []
        if only is not None:
            hours.append(f"{HOUR} IN ({hour_literals(only)})")
            # the same rows as a range of finalized_at: the day partitions' min-max
            # index then skips every other day's parts
            ranges = [_hour_range(h) for h in only if HOUR_NAME.fullmatch(h)]
            hours.append(f"({' OR '.join(ranges) or 'false'})")
        self.hours = " AND ".join(hours)
        where = [*hours, *([f"start >= {int(cutoff)}"] if cutoff is not None else [])]
        self.source = f"(SELECT {turns.selected(_READ)} FROM {turns.table})"
        own = self.hours if only is not None else ""
        self.rows = f"({_latest(turns.table, where, self.source, own)})"

    def newest_start(self) -> float:
        """The newest turn start of any row outside ``skip``, every version (what
        ``--since`` counts back from: ``Versions.add_starts``); NaN when none has one."""
        start = _ROW["start"]
        found = self._query(
            f"SELECT max(start) AS newest, count() AS n FROM (SELECT {RECORD} AS record, "
            f"{start} AS start FROM {self.source} {'WHERE ' + self.hours if self.hours else ''}) "
            "WHERE NOT isNaN(start)"
        )[0]
        return float(found["newest"]) if found["n"] else np.nan

    def _query(self, sql: str) -> list[dict[str, Any]]:
        return self.turns.database.query(f"{sql} SETTINGS transform_null_in = 1").to_pylist()

    def tally(self) -> TurnTally:
        total = TurnTally()
        # Host copies' bytes x ns are summed from an instant near them (the table's
        # first finalization), not as products of ~1e18 ns.
        first = self._query(f"SELECT toInt64(min(finalized_at) * 1e9) AS r FROM {self.turns.table}")
        cells = self._query(_CELLS.format(rows=self.rows, reference=first[0]["r"] or 0))
        if not cells:
            return total
        sketched: dict[tuple, Counter] = {}
        for cell in cells:
            for target in _targets(cell):
                tally = _target(total, target)
                tally.turns += cell["n"]
                tally.verdicts.update(_verdicts(cell))
                tally.ttft_unmeasured += cell["ttft_unmeasured"]
                tally.sums.update({name: int(cell[f"sum_{name}"]) for name in _SUMS})
                for quantity in ("ttft", "latency"):
                    counts = sketched.setdefault((target, quantity), Counter())
                    counts.update(_map(cell[f"sketch_{quantity}"]))
            scope = SCOPES[0] if cell["first"] else SCOPES[1]
            phases = total.phases[scope]
            phases.turns += cell["n"]
            phases.timed += cell["timed"]
            phases.latency_ns += cell["latency_ns"]
            phases.gap_ns += cell["gap_ns"]
            phases.gap_turns += cell["gap_turns"]
            phases.slowest.update(_map(cell["slowest"]))
            for i, phase in enumerate(PHASES):
                phases.total_ns[phase.value] += cell[f"total_{i}"]
                phases.measured[phase.value] += cell[f"measured_{i}"]
                counts = sketched.setdefault(((scope,), phase.value), Counter())
                counts.update(_map(cell[f"sketch_p{i}"]))
            sketched.setdefault(((), "per_block"), Counter()).update(_map(cell["sketch_per_block"]))
        for (target, quantity), counts in sketched.items():
            if quantity == "per_block":
                sketch = total.per_block
            elif quantity in ("ttft", "latency"):
                sketch = getattr(_target(total, target), quantity)
            else:
                sketch = total.phases[target[0]].sketches[quantity]
            _add_codes(sketch, counts)
        _add_misc(total, cells)
        verdicts = sum((_verdicts(cell) for cell in cells), Counter())
        total.fault_count = sum(n for v, n in verdicts.items() if v not in NOT_FAULT_VALUES)
        faults = f"NOT {_HEALTHY}"
        listed = self._query(_LISTED.format(rows=self.rows, where=faults, n=LISTED_FAULTS))
        total.faults.rows = [_ranked(row) for row in listed]
        keys = self.turns.database.query(
            f"SELECT DISTINCT tenant, conversation_id FROM {self.rows} "
            "SETTINGS transform_null_in = 1"
        )
        batch = pa.record_batch(
            [keys.column(c).cast(pa.string()).combine_chunks() for c in keys.column_names],
            names=keys.column_names,
        )
        total.conversations = [conversation_hashes(batch)]
        return total

    def slow(self, thresholds: dict[str, float | None]) -> tuple[Ranked, int]:
        """``slow_turns``: the healthy turns at or over their scope's threshold."""
        over = ["inf" if t is None else repr(float(t)) for t in (thresholds[s] for s in SCOPES)]
        where = f"{_HEALTHY} AND lat >= if(first, {over[0]}, {over[1]})"
        counted = self._query(f"SELECT count() AS n FROM {self.rows} WHERE {where}")[0]["n"]
        listed = self._query(_LISTED.format(rows=self.rows, where=where, n=LISTED_SLOW))
        return Ranked(LISTED_SLOW, [_ranked(row) for row in listed]), int(counted)

    def slow_tally(self) -> SlowTally:
        """A stored tally's slow part (``SlowTally.add``): each scope's healthy measured
        latencies, sorted, and its slowest healthy turns."""
        slow = SlowTally()
        for scope, first in zip(SCOPES, ("first", "NOT first")):
            where = f"{_HEALTHY} AND NOT isNaN(lat) AND {first}"
            found = self.turns.database.query(
                f"SELECT lat FROM {self.rows} WHERE {where} ORDER BY lat "
                "SETTINGS transform_null_in = 1"
            )
            slow.latencies[scope] = found.column("lat").to_numpy().astype(float)
            listed = self._query(_LISTED.format(rows=self.rows, where=where, n=LISTED_SLOW))
            slow.slowest[scope].rows = [_ranked(row) for row in listed]
        return slow


def _hour_range(hour: str) -> str:
    start = calendar.timegm(time.strptime(hour, "%Y%m%d%H"))
    return f"(finalized_at >= {start} AND finalized_at < {start + 3600})"


def _map(value) -> Counter:
    """A ``sumMap`` result (keys, counts) as a Counter."""
    keys, counts = value.values() if isinstance(value, dict) else value
    return Counter(dict(zip(keys, counts)))


def _verdicts(cell: dict[str, Any]) -> Counter:
    """A cell's verdict counts (those it has)."""
    known = {v: cell[f"verdict:{v}"] for v in VERDICT_VALUES if cell[f"verdict:{v}"]}
    return Counter(known) + _map(cell["verdicts"])


def _targets(cell: dict[str, Any]) -> list[tuple]:
    """The scope and groups of a cell (``GROUPINGS``: every turn by turn bucket, later
    turns by prompt bucket, every turn by both; a turn without a prompt length in no
    prompt group)."""
    first, tb, pb = cell["first"], cell["tb"], cell["pb"]
    found: list[tuple] = [(SCOPES[0] if first else SCOPES[1],), ("by_turn", tb)]
    if pb >= 0:
        if not first:
            found.append(("by_prompt", pb))
        found.append(("by_turn_and_prompt", tb, pb))
    return found


def _target(total: TurnTally, target: tuple) -> ScopeTally:
    section, *codes = target
    if section in SCOPES:
        return total.scopes[section]
    return total.groups[section].setdefault(
        tuple(codes[: len(GROUPINGS[section][0])]), ScopeTally()
    )


def _ranked(row: dict[str, Any]) -> tuple:
    """A ``Ranked`` row (``Ranked.add``'s)."""
    latency = row["lat"]
    key = -1.0 if np.isnan(latency) else latency
    return (
        -float(key),
        row["conversation_id"],
        row["tenant"] or "",
        int(row["turn"]),
        row["v"],
        None if np.isnan(latency) else float(latency),
    )


_SIDE = 1 << 32  # a bucket code: sign x 2^32 + key (keys stay within +-2^16)


def _add_codes(sketch, counts: Counter) -> None:
    """Bucket codes' counts (``_sketched``) into the sketch, as ``add_values`` adds."""
    sides: dict[int, tuple[list[int], list[int]]] = {}
    for code_, count in sorted(counts.items()):
        sign = round(code_ / _SIDE)
        if sign == 0:
            sketch.add(0.0, count)
            continue
        keys, added = sides.setdefault(sign, ([], []))
        keys.append(code_ - sign * _SIDE)
        added.append(count)
    for sign, (keys, added) in sides.items():
        add_keyed(sketch, float(sign), keys, added)


def _add_misc(total: TurnTally, cells: list[dict[str, Any]]) -> None:
    """The cells' memory and retention sums, prefill rate, first conversation and turn
    starts, folded as ``TurnTally.merge`` folds tallies."""
    memory, _ = _templates()
    for name, value in memory.items():
        total.memory[name] = type(value)(sum(cell[name] for cell in cells))

    def summed(name: str) -> float:
        return sum(cell[name] for cell in cells)

    referenced = summed("referenced")
    total.retained = RetentionSums(
        float(summed("device_block_s")),
        int(summed("device_costed")),
        int(summed("device_tokens")),
        float(summed("host_byte_s")),
        int(summed("host_costed")),
        int(summed("host_tokens")),
        int(summed("open_copies")),
        float(summed("open_bytes")),
        float(summed("open_bytes_since_ns")),
        float(cells[0]["reference_ns"]) if referenced else None,
        float(max(cell["recording_end_ns"] for cell in cells)),
    )
    rated = [cell for cell in cells if cell["rated"]]
    if rated:
        last = max(rated, key=lambda cell: cell["rate_at"])
        total.rate, total.rate_at = float(last["rate_value"]), float(last["rate_at"])
    first = min(cells, key=lambda cell: tuple(cell["first_key"].values()))
    total.synthetic = str(list(first["first_key"].values())[2]).startswith("synthetic-")
    total.unstarted = int(summed("unstarted"))
    started = [cell for cell in cells if cell["started"]]
    if started:
        total.first_start_ns = float(min(cell["first_start_ns"] for cell in started))
        total.last_start_ns = float(max(cell["last_start_ns"] for cell in started))


def _templates() -> tuple[dict[str, Any], RetentionSums]:
    """``memory_sums`` and ``RetentionSums.of`` of no rows: the names and types the
    queries fill."""
    frame = labelled_frame(pa.RecordBatch.from_pylist([], schema=SCHEMA))
    return memory_sums(frame), RetentionSums.of(frame)


_TINY = repr(zero_bound())


def _sketched(name: str, value: str) -> str:
    """A cell's bucket counts of the finite values of a sketched quantity, by code:
    sign x ``_SIDE`` + the bucket's key (0: the zero bucket)."""
    key = bucket_key_sql(f"greatest(abs({value}), {_TINY})")
    code_ = f"multiIf({value} > {_TINY}, {_SIDE} + {key}, {value} < -{_TINY}, -{_SIDE} + {key}, 0)"
    return f"sumMapIf([{code_}], [toUInt64(1)], isFinite({value})) AS sketch_{name}"


_OPEN = "isFinite(saved) AND NOT isFinite(host)"
_REFERENCED = f"{_OPEN} AND isFinite(save_end)"
_TIMED = "NOT isNaN(lat)"
_GAPS = " OR ".join(f"isNaN(p{i})" for i in range(len(_PHASES)))
_MEASURED = "0."
for _i in range(len(_PHASES)):  # unmeasured_latency's order of additions
    _MEASURED = f"({_MEASURED} + if(isNaN(p{_i}), 0., p{_i}))"
_KNOWN = "NOT isNaN(blocks) AND NOT isNaN(held)"
_CELLS = (
    "SELECT first, tb, pb, count() AS n, "
    # each verdict kvobs knows counted apart (a map per row costs more), others mapped
    + "".join(f"countIf(v = '{v}') AS `verdict:{v}`, " for v in VERDICT_VALUES)
    + f"sumMapIf([v], [toUInt64(1)], v NOT IN ({_quoted(VERDICT_VALUES)})) AS verdicts, "
    "countIf(isNaN(ttft)) AS ttft_unmeasured, "
    + "".join(f"sum({name}) AS sum_{name}, " for name in _SUMS)
    # PhaseTally.add
    + f"countIf({_TIMED}) AS timed, sumIf({_ns('lat')}, {_TIMED}) AS latency_ns, "
    + f"sumIf({_ns(f'if({_GAPS}, lat - {_MEASURED}, 0.)')}, {_TIMED}) AS gap_ns, "
    + f"countIf({_TIMED} AND ({_GAPS})) AS gap_turns, "
    + "".join(
        f"sumIf({_ns(f'p{i}')}, NOT isNaN(p{i})) AS total_{i}, "
        f"countIf(NOT isNaN(p{i})) AS measured_{i}, "
        for i in range(len(_PHASES))
    )
    + "sumMapIf([ifNull(phase, '')], [toUInt64(1)], phase IS NOT NULL) AS slowest, "
    # every sketch
    + "".join(
        _sketched(name, value) + ", "
        for name, value in (
            ("ttft", "ttft"),
            ("latency", "lat"),
            *((f"p{i}", f"p{i}") for i in range(len(_PHASES))),
            ("per_block", "per_block"),
        )
    )
    # memory_sums
    + "countIf(NOT isNaN(blocks)) AS exports, "
    + f"countIf({_KNOWN}) AS exports_released, "
    + f"countIf({_KNOWN} AND released_read) AS exports_read, "
    + "sumIf(blocks, NOT isNaN(blocks)) AS blocks_exported, "
    + f"sumIf(blocks, {_KNOWN}) AS blocks_released, "
    + f"sumIf(blocks, {_KNOWN} AND released_read) AS blocks_read, "
    + f"sumIf(blocks * held, {_KNOWN}) AS block_seconds, "
    + f"sumIf(blocks * held, {_KNOWN} AND released_read) AS read_block_seconds, "
    # RetentionSums.of
    + "sumIf(device, NOT isNaN(device)) AS device_block_s, "
    + "countIf(isFinite(device)) AS device_costed, "
    + "sum(reused_tokens) AS device_tokens, "
    + "sumIf(host, NOT isNaN(host)) AS host_byte_s, "
    + "countIf(isFinite(host)) AS host_costed, "
    + "sum(host_reused_tokens) AS host_tokens, "
    + f"countIf({_OPEN}) AS open_copies, "
    + f"sumIf(saved, {_REFERENCED}) AS open_bytes, "
    + f"countIf({_REFERENCED}) AS referenced, "
    + "toFloat64({reference}) AS reference_ns, "
    + f"sumIf(saved * (save_end - {{reference}}), {_REFERENCED}) AS open_bytes_since_ns, "
    + "max(recording_end) AS recording_end_ns, "
    # the rest of TurnTally.add
    + "countIf(NOT isNaN(rate)) > 0 AS rated, "
    + "argMaxIf(rate, finalized, NOT isNaN(rate)) AS rate_value, "
    + "maxIf(finalized, NOT isNaN(rate)) AS rate_at, "
    + "min(order_key) AS first_key, "
    + "countIf(isNaN(start)) AS unstarted, countIf(NOT isNaN(start)) > 0 AS started, "
    + "minIf(start, NOT isNaN(start)) AS first_start_ns, "
    + "maxIf(start, NOT isNaN(start)) AS last_start_ns "
    + "FROM {rows} GROUP BY first, tb, pb"
)
_LISTED = (
    "SELECT conversation_id, tenant, turn, v, lat FROM {rows} WHERE {where} "
    "ORDER BY if(isNaN(lat), -1., lat) DESC, conversation_id, ifNull(tenant, ''), turn "
    "LIMIT {n}"
)


def engine_tally(
    rows, skip: Collection[str], cutoff: int | None, only: Collection[str] | None = None
) -> EngineTally | None:
    """The engine's tally of ``rows`` when ClickHouse holds them, else None (the store's
    rows are read in batches)."""
    if not PUSH_DOWN:
        return None
    from kvobs.live.clickhouse_turns import ClickHouseTurns

    if type(rows) is not ClickHouseTurns or not rows.exists():
        return None
    if only is not None and sum(rows.hour_rows_listed.get(h, 0) for h in only) < ENGINE_MIN_ROWS:
        return None  # a small hour: its rows are read (see ENGINE_MIN_ROWS)
    return EngineTally(rows, skip, cutoff, only)


__all__ = ["ENGINE_MIN_ROWS", "EngineTally", "PUSH_DOWN", "engine_tally", "measure"]
