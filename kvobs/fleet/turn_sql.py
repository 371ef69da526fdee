"""The report's tally of ClickHouse turn rows computed by ClickHouse: ``GROUP BY``
queries hand back what ``TurnTally.add`` would have added up over the rows (counts and
integer sums per scope, verdict and bucket, the phase tallies, D's memory and the
retention sums, every DDSketch's bucket counts, the listed faults), so the rows of
hours without a stored tally never leave the engine. ``kvobs.fleet.turn_report`` uses
it for a ``ClickHouseTurns`` (``engine_tally``); the embedded store keeps the batches.

What is aggregated is still defined once, by the Python tally:

- a measure is read from the packed record at its offset in ``MEASURE_DTYPE``
  (``measure``), as ``unpack`` reads it: a float, NaN for null;
- the row-level numbers are the span path's formulas (``_Measured``, ``memory_sums``,
  ``RetentionSums.of``, ``unmeasured_latency``), each written here once in SQL over
  those values, with NaN where numpy has NaN; the names and types of the memory and
  retention sums are those of the Python functions run on an empty batch (checked);
- a sketch bucket is ``kvobs.fleet.sketch.bucket_key_sql``, the numpy expression of
  ``add_values`` with the sketch's own constants, and the counts go into the sketch
  through ``add_keyed``, as ``add_values`` puts them: the quantiles are the same;
- the latest version of each turn: the newest version stored of its key, anywhere in the
  table (``_Versions``), retired turns (no verdict) left out;
- conversations: the distinct (tenant, id) pairs come back and are hashed by
  ``conversation_hashes``, so they merge exactly with the stored tallies' hashes (an
  engine-side ``uniqExact`` would count this part exactly but could not be merged with
  the hours that have a tally: a conversation spans hours).

Floats are summed in the engine's order (within a few ulps of the rows path); counts,
integer sums and sketch buckets are exact.
"""

from __future__ import annotations

from typing import Any, Collection

import numpy as np
import pyarrow as pa

from kvobs import semconv as sc
from kvobs.fleet.report import _NOT_FAULTS, LISTED_FAULTS, LISTED_SLOW, memory_sums
from kvobs.fleet.retention import RetentionSums
from kvobs.fleet.sketch import add_keyed, bucket_key_sql, zero_bound
from kvobs.fleet.turn_drill import Ranked
from kvobs.fleet.turn_tally import (
    GROUPINGS,
    SCOPES,
    ScopeTally,
    TurnTally,
    _frame,
    conversation_hashes,
)
from kvobs.live.turn_measures import ENUMS, KINDS, MEASURE_DTYPE, MEASURES_COLUMN, NULL_INT
from kvobs.semconv import ReadOutcome, ReleaseReason
from kvobs.timeline import PHASES, phase_column
from kvobs.turns.schema import DEVICE_BLOCK_SECONDS, HOST_BYTE_SECONDS

# Off: the report reads the rows in batches as from any store (tests compare the two).
PUSH_DOWN = True


# --------------------------------------------------------------------------- values


def _record_sizes() -> list[int]:
    """The record sizes ``unpack`` reads (today's and each older prefix of it)."""
    sizes, offset = [], 0
    for name in KINDS:
        offset += MEASURE_DTYPE[name].itemsize
        sizes.append(offset)
    return sizes


def measure(name: str) -> str:
    """A packed measure as ``unpack`` gives it, Float64 with NaN for null (no record, a
    record of an unknown size, or one too short to hold it); an enumeration as its code
    (-1: null, ``code``)."""
    offset = MEASURE_DTYPE.fields[name][1]
    raw = f"substring(`{MEASURES_COLUMN}`, {offset + 1}, 8)"
    sizes = ", ".join(str(size) for size in _record_sizes() if size >= offset + 8)
    held = f"ifNull(length(`{MEASURES_COLUMN}`) IN ({sizes}), false)"
    kind = KINDS[name]
    if kind == "float":
        value = f"if({held}, reinterpretAsFloat64({raw}), nan)"
    elif kind == "str":
        return f"ifNull(if({held}, reinterpretAsInt64({raw}), -1), -1)"
    else:
        number = f"reinterpretAsInt64({raw})"
        value = f"if({held} AND {number} != {NULL_INT}, toFloat64({number}), nan)"
    return f"ifNull({value}, nan)"  # the column is Nullable: a NULL record's is too


def code(name: str, value: str) -> int:
    """The packed code of an enumeration's value."""
    return ENUMS[name].index(value)


def _nan0(value: str) -> str:
    return f"if(isNaN({value}), 0., {value})"


def _ns(seconds: str) -> str:
    """``_sum_ns``' term: seconds as integer nanoseconds, rounded half to even."""
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
# Each kept row's values, named for the queries below (``_Measured`` and the others).
_ROW = {
    "first": "turn = 1",
    "v": "toString(verdict)",
    "lat": "ifNull(latency_s, nan)",
    "ttft": "ifNull(ttft_s, nan)",
    "tb": _bucket_sql("turn", sc._TURN_BUCKETS),
    "pb": f"if({_PROMPT_INT} >= 0, {_bucket_sql(_PROMPT_INT, sc._PROMPT_BUCKETS)}, -1)",
    # _Measured
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
_SUMS = (
    "bytes_read",
    "reused_tokens",
    "recomputed_tokens",
    "host_bytes_loaded",
    "host_reused_tokens",
)
_HEALTHY = f"v IN ({_quoted(sorted(_NOT_FAULTS))})"


def _latest(table: str, where: list[str]) -> str:
    """The kept rows with ``_ROW``'s values: each turn at the newest version stored of
    it (``_Versions.latest_rows``: a turn without a later version keeps its rows),
    retired turns (no verdict) out."""
    later = (
        f"SELECT tenant, conversation_id, turn, max(version) FROM {table} "
        "WHERE version > 1 GROUP BY tenant, conversation_id, turn"
    )
    newest = (
        f"(conversation_id NOT IN (SELECT conversation_id FROM {table} WHERE version > 1) "
        f"OR (tenant, conversation_id, turn, version) IN ({later}) "
        f"OR (version = 1 AND (tenant, conversation_id, turn) NOT IN "
        f"(SELECT tenant, conversation_id, turn FROM {table} WHERE version > 1)))"
    )
    conditions = " AND ".join(["verdict IS NOT NULL", newest, *where])
    values = ", ".join(f"{sql} AS {name}" for name, sql in _ROW.items())
    return f"SELECT tenant, conversation_id, turn, {values} FROM {table} WHERE {conditions}"


# --------------------------------------------------------------------------- the tally


class EngineTally:
    """The tally of a ``ClickHouseTurns``' rows outside the hours in ``skip`` (turn
    start at or after ``cutoff``), and their slow turns, each by a few queries."""

    def __init__(self, turns, skip: Collection[str], cutoff: int | None):
        from kvobs.live.clickhouse_turns import HOUR, _hours

        self.turns = turns
        where = [f"{HOUR} NOT IN ({_hours(skip)})"] if skip else []
        if cutoff is not None:
            where.append(f"start >= {int(cutoff)}")  # NaN: false
        self.rows = f"({_latest(turns.table, where)})"

    def _query(self, sql: str) -> list[dict[str, Any]]:
        return self.turns.database.query(
            f"{sql} SETTINGS transform_null_in = 1, join_use_nulls = 0"
        ).to_pylist()

    def tally(self) -> TurnTally:
        total = TurnTally()
        misc = self._query(_MISC.format(rows=self.rows))[0]
        if not misc["turns"]:
            return total
        self._scopes(total)
        self._phases(total)
        self._sketches(total)
        self._misc(total, misc)
        faults = self._query(
            _LISTED.format(rows=self.rows, where=f"NOT {_HEALTHY}", n=LISTED_FAULTS)
        )
        total.faults.rows = [_ranked(row) for row in faults]
        keys = self.turns.database.query(
            f"SELECT DISTINCT tenant, conversation_id FROM {self.rows}"
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

    def _scopes(self, total: TurnTally) -> None:
        sums = ", ".join(f"sum({name}) AS sum_{name}" for name in _SUMS)
        found = self._query(
            f"SELECT target, v, count() AS n, countIf(isNaN(ttft)) AS ttft_unmeasured, "
            f"{sums} FROM {self.rows} ARRAY JOIN {_TARGETS} AS target GROUP BY target, v"
        )
        for row in found:
            tally = _target(total, tuple(row["target"].values()))
            tally.turns += row["n"]
            tally.verdicts[row["v"]] += row["n"]
            tally.ttft_unmeasured += row["ttft_unmeasured"]
            tally.sums.update({name: int(row[f"sum_{name}"]) for name in _SUMS})

    def _phases(self, total: TurnTally) -> None:
        present = [f"NOT isNaN(p{i})" for i in range(len(_PHASES))]
        measured = "0."
        for i in range(len(_PHASES)):
            measured = f"({measured} + if(isNaN(p{i}), 0., p{i}))"
        gaps = " OR ".join(f"isNaN(p{i})" for i in range(len(_PHASES)))
        phases = ", ".join(
            f"sumIf({_ns(f'p{i}')}, {p}) AS total_{i}, countIf({p}) AS measured_{i}"
            for i, p in enumerate(present)
        )
        timed = "NOT isNaN(lat)"
        found = self._query(
            f"SELECT first, count() AS turns, countIf({timed}) AS timed, "
            f"sumIf({_ns('lat')}, {timed}) AS latency_ns, "
            f"sumIf({_ns(f'if({gaps}, lat - {measured}, 0.)')}, {timed}) AS gap_ns, "
            f"countIf({timed} AND ({gaps})) AS gap_turns, {phases} "
            f"FROM {self.rows} GROUP BY first"
        )
        for row in found:
            tally = total.phases[SCOPES[0] if row["first"] else SCOPES[1]]
            tally.turns, tally.timed = row["turns"], row["timed"]
            tally.latency_ns, tally.gap_ns = row["latency_ns"], row["gap_ns"]
            tally.gap_turns = row["gap_turns"]
            for i, phase in enumerate(PHASES):
                tally.total_ns[phase.value] += row[f"total_{i}"]
                tally.measured[phase.value] += row[f"measured_{i}"]
        slowest = self._query(
            f"SELECT first, phase, count() AS n FROM {self.rows} "
            "WHERE phase IS NOT NULL GROUP BY first, phase"
        )
        for row in slowest:
            total.phases[SCOPES[0] if row["first"] else SCOPES[1]].slowest[row["phase"]] += row["n"]

    def _sketches(self, total: TurnTally) -> None:
        """Every sketch's buckets: one (target, quantity, value) per sketched value of a
        row, counted by sign and bucket key."""
        phases = ", ".join(
            f"((if(first, '{SCOPES[0]}', '{SCOPES[1]}'), -1, -1), 'phase:{p.value}', p{i})"
            for i, p in enumerate(PHASES)
        )
        values = (
            f"arrayConcat(arrayMap(t -> (t, 'ttft', ttft), {_TARGETS}), "
            f"arrayMap(t -> (t, 'latency', lat), {_TARGETS}), "
            f"[{phases}, (('', -1, -1), 'per_block', per_block)])"
        )
        tiny = repr(zero_bound())
        found = self._query(
            "SELECT item.1 AS target, item.2 AS quantity, "
            f"multiIf(item.3 > {tiny}, 1, item.3 < -{tiny}, -1, 0) AS sign, "
            f"if(sign = 0, 0, {bucket_key_sql(f'greatest(abs(item.3), {tiny})')}) AS key, "
            "count() AS n "
            f"FROM {self.rows} ARRAY JOIN {values} AS item WHERE isFinite(item.3) "
            "GROUP BY target, quantity, sign, key ORDER BY target, quantity, sign, key"
        )
        grouped: dict[tuple, tuple[list[int], list[int]]] = {}
        for row in found:
            target = tuple(row["target"].values())
            keys, counts = grouped.setdefault((target, row["quantity"], row["sign"]), ([], []))
            keys.append(row["key"])
            counts.append(row["n"])
        for (target, quantity, sign), (keys, counts) in grouped.items():
            if quantity == "per_block":
                sketch = total.per_block
            elif quantity.startswith("phase:"):
                sketch = total.phases[target[0]].sketches[quantity[len("phase:") :]]
            else:
                sketch = getattr(_target(total, target), quantity)
            if sign == 0:
                sketch.add(0.0, sum(counts))
            else:
                add_keyed(sketch, float(sign), keys, counts)

    def _misc(self, total: TurnTally, row: dict[str, Any]) -> None:
        template = _templates()
        total.memory.update({name: type(value)(row[name]) for name, value in template[0].items()})
        open_ = row["open_copies"]
        total.retained = RetentionSums(
            float(row["device_block_s"]),
            int(row["device_costed"]),
            int(row["device_tokens"]),
            float(row["host_byte_s"]),
            int(row["host_costed"]),
            int(row["host_tokens"]),
            int(open_),
            float(row["open_bytes"]),
            float(row["open_bytes_since_ns"]),
            row["reference_ns"] if row["referenced"] else None,
            float(row["recording_end_ns"]),
        )
        total.fault_count = int(row["fault_count"])
        if row["rated"]:
            total.rate, total.rate_at = float(row["rate_value"]), float(row["rate_at"])
        total.synthetic = str(row["first_cid"]).startswith("synthetic-")
        total.unstarted = int(row["unstarted"])
        if row["started"]:
            total.first_start_ns = float(row["first_start_ns"])
            total.last_start_ns = float(row["last_start_ns"])


def _target(total: TurnTally, target: tuple) -> ScopeTally:
    """The scope or group tally of a ``_TARGETS`` item (section, bucket codes)."""
    section, *codes = target
    if section in SCOPES:
        return total.scopes[section]
    group = tuple(codes[: len(GROUPINGS[section][0])])
    return total.groups[section].setdefault(group, ScopeTally())


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


def _templates() -> tuple[dict[str, Any], RetentionSums]:
    """``memory_sums`` and ``RetentionSums.of`` of no rows: the names and types the
    queries fill."""
    from kvobs.fleet.turn_report import AGGREGATED
    from kvobs.live.turnstore import SCHEMA

    schema = pa.schema([SCHEMA.field(c) for c in AGGREGATED])
    frame = _frame(pa.RecordBatch.from_pylist([], schema=schema))
    return memory_sums(frame), RetentionSums.of(frame)


# Each row's tallies: its scope, its turn bucket, its prompt bucket (later turns), both.
_TARGETS = (
    "arrayFilter(t -> t.1 != '', ["
    f"(if(first, '{SCOPES[0]}', '{SCOPES[1]}'), -1, -1), "
    "('by_turn', tb, -1), "
    "(if(NOT first AND pb >= 0, 'by_prompt', ''), pb, -1), "
    "(if(pb >= 0, 'by_turn_and_prompt', ''), tb, pb)])"
)
_OPEN = "isFinite(saved) AND NOT isFinite(host)"
_REFERENCED = f"{_OPEN} AND isFinite(save_end)"
_MISC = (
    f"WITH (SELECT argMinIf(save_end, order_key, {_REFERENCED}) FROM {{rows}}) AS reference "
    "SELECT count() AS turns, "
    # memory_sums
    "countIf(NOT isNaN(blocks)) AS exports, "
    "countIf(NOT isNaN(blocks) AND NOT isNaN(held)) AS exports_released, "
    "countIf(NOT isNaN(blocks) AND NOT isNaN(held) AND released_read) AS exports_read, "
    "sumIf(blocks, NOT isNaN(blocks)) AS blocks_exported, "
    "sumIf(blocks, NOT isNaN(blocks) AND NOT isNaN(held)) AS blocks_released, "
    "sumIf(blocks, NOT isNaN(blocks) AND NOT isNaN(held) AND released_read) AS blocks_read, "
    "sumIf(blocks * held, NOT isNaN(blocks) AND NOT isNaN(held)) AS block_seconds, "
    "sumIf(blocks * held, NOT isNaN(blocks) AND NOT isNaN(held) AND released_read) "
    "AS read_block_seconds, "
    # RetentionSums.of
    "sumIf(device, NOT isNaN(device)) AS device_block_s, "
    "countIf(isFinite(device)) AS device_costed, "
    "sum(reused_tokens) AS device_tokens, "
    "sumIf(host, NOT isNaN(host)) AS host_byte_s, "
    "countIf(isFinite(host)) AS host_costed, "
    "sum(host_reused_tokens) AS host_tokens, "
    f"countIf({_OPEN}) AS open_copies, "
    f"sumIf(saved, {_REFERENCED}) AS open_bytes, "
    f"countIf({_REFERENCED}) > 0 AS referenced, "
    "reference AS reference_ns, "
    f"sumIf(saved * (save_end - ifNull(reference, 0.)), {_REFERENCED}) "
    "AS open_bytes_since_ns, "
    "max(recording_end) AS recording_end_ns, "
    # the rest of TurnTally.add
    f"countIf(NOT {_HEALTHY}) AS fault_count, "
    "countIf(NOT isNaN(rate)) > 0 AS rated, "
    "argMaxIf(rate, finalized, NOT isNaN(rate)) AS rate_value, "
    "maxIf(finalized, NOT isNaN(rate)) AS rate_at, "
    "argMin(conversation_id, order_key) AS first_cid, "
    "countIf(isNaN(start)) AS unstarted, countIf(NOT isNaN(start)) > 0 AS started, "
    "minIf(start, NOT isNaN(start)) AS first_start_ns, "
    "maxIf(start, NOT isNaN(start)) AS last_start_ns "
    "FROM {rows}"
)
_LISTED = (
    "SELECT conversation_id, tenant, turn, v, lat FROM {rows} WHERE {where} "
    "ORDER BY if(isNaN(lat), -1., lat) DESC, conversation_id, ifNull(tenant, ''), turn "
    "LIMIT {n}"
)


def engine_tally(rows, skip: Collection[str], cutoff: int | None) -> EngineTally | None:
    """The engine's tally of ``rows`` when ClickHouse holds them, else None (the store's
    rows are read in batches)."""
    if not PUSH_DOWN:
        return None
    from kvobs.live.clickhouse_turns import ClickHouseTurns

    if type(rows) is not ClickHouseTurns or not rows.exists():
        return None
    return EngineTally(rows, skip, cutoff)


__all__ = ["EngineTally", "PUSH_DOWN", "engine_tally", "measure"]
