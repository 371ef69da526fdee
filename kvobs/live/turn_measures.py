"""The numbers a fleet report sums and sketches, stored on every classified turn row in
one packed column (``MEASURES_COLUMN``): the report reads that column in batches
(``kvobs.fleet.turn_report``) instead of parsing each turn's JSON, and the store's file
footers stay small (a column per measure made a merged file's footer, parsed by every
lookup, ten times slower to read: 26 ms against 2.5 ms for 56k rows).

Each measure is a turn-table column of the same name (``kvobs.turns.schema``, the
phases' from ``kvobs.timeline``): the values ``kvobs report`` reads from the turn table
on the span path, so the two reports read the same numbers. Packed as one little-endian
record per row (``MEASURE_DTYPE``): integers as int64 (null: ``NULL_INT``), floats as
float64 (null: NaN), the enumerations as the index of their value (null or a value
kvobs does not know: -1), booleans as 0 or 1 and span ids only as present (1) or not
(null).

The record also holds ``REPLAY_FACTS``: what ``kvobs tune`` and ``kvobs whatif`` replay
and decide again (``kvobs.fleet.replay``, ``kvobs.verdicts.decide``) beyond the row's
own columns, so that they run on turn rows whose spans have gone
(``kvobs.fleet.turn_replay``). They come after the report's measures: a record an older
kvobs wrote is a prefix of today's, read with the facts it lacks null.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, cast

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from kvobs import semconv as sc
from kvobs.timeline import PHASE_COLUMNS
from kvobs.turns import columns as col
from kvobs.turns.schema import DEVICE_BLOCK_SECONDS, HOST_BYTE_SECONDS, column_type

# What the report's sections read beyond the row's own columns (verdict, latency_s,
# ttft_s, prompt_tokens, slowest_phase): reuse and bytes (the verdict mix), the prompt
# length of an engine without P, D's exports and releases (memory held), the retention
# costs and host copies, and the turn's start (``--since``).
TURN_MEASURES = (
    "read_outcome",
    "read_bytes",
    "read_blocks",
    "candidate_tokens",
    "recomputed_tokens",
    "host_load_bytes",
    "host_hit_host_tokens",
    "host_hit_p2p_tokens",
    "host_lookup_prompt_tokens",
    "export_blocks",
    "held_s",
    "export_end_ns",
    "release_end_ns",
    "release_reason",
    "release_read_count",
    "turn_start_ns",
    "turn_end_ns",
    "host_saved_bytes",
    "host_save_end_ns",
    "host_evict_end_ns",
    DEVICE_BLOCK_SECONDS.name,
    HOST_BYTE_SECONDS.name,
)
# What the replay reads beyond the report's measures and the row's own columns (tenant,
# conversation_id, turn, verdict, prompt_tokens): the facts a setting decides, the
# recorded settings and every column the verdict rules decide with
# (tests/fleet/test_turn_replay.py checks the list against what they read).
REPLAY_FACTS = (
    "lookup",
    "params_sent",
    "entry_age_s",
    "decision",
    "decision_count",
    "threshold",
    "local_hit_tokens",
    "remote_tokens",
    "read_start_ns",
    "read_duration_s",
    "read_unobserved_s",
    "fallback_reason",
    "fallback_span_id",
    "stuck_span_id",
    "turn_span_id",
    "gap_s",
    "ttl_s",
    "prev_ttl_s",
    "prev_export_tokens",
    "prev_turn_end_ns",
    "prev_release_reason",
    "prev_release_end_ns",
    "extends_request_id",
    "extends_fully",
    "extends_live",
    "extends_tokens",
    "extends_verified_tokens",
    "extends_engine_restarted_at",
    "lineage_gap",
    "host_lookup_span_id",
    "host_lookup_start_ns",
    "host_accepted_tokens",
    "host_local_tokens",
    "prev_host_saved_tokens",
    "prev_host_save_prompt_tokens",
    "prev_host_save_output_tokens",
    "prev_host_save_incomplete",
    "prev_host_covers_response",
    "prev_host_evict_end_ns",
    "prev_host_evict_span_id",
)
ENUMS = {
    "read_outcome": [v.value for v in sc.ReadOutcome],
    "release_reason": [v.value for v in sc.ReleaseReason],
    "lookup": [v.value for v in sc.LookupOutcome],
    "decision": [v.value for v in sc.PullDecision],
    "fallback_reason": [v.value for v in sc.FallbackReason],
    "prev_release_reason": [v.value for v in sc.ReleaseReason],
    "lineage_gap": [v.value for v in sc.LineageGap],
}
# A string that is not an enumeration (a span or request id): the rules ask only whether
# it is there.
PRESENCE = "present"


def _kind(name: str) -> str:
    kind = column_type(name)
    return PRESENCE if kind == "str" and name not in ENUMS else kind


KINDS = (
    {name: column_type(name) for name in TURN_MEASURES}
    | dict.fromkeys(PHASE_COLUMNS, "float")
    | {name: _kind(name) for name in REPLAY_FACTS}
)
REPORT_MEASURES = (*TURN_MEASURES, *PHASE_COLUMNS)
MEASURE_DTYPE = np.dtype(
    [(name, "<f8" if kind == "float" else "<i8") for name, kind in KINDS.items()]
)
NULL_INT = np.iinfo(np.int64).min
# The stored column, and the row key the classifier puts a turn's measures under (never
# part of the stored JSON).
MEASURES_COLUMN = MEASURES_KEY = "measures"


def measures_of(turns: col.Columns) -> list[dict[str, Any]]:
    """Each classified turn's measures, typed: what the classifier keeps on its row until
    the store packs it. ``turns`` is the table ``classify_turns`` was given (it adds the
    phases in place), in the order of its diagnoses. Column by column: a lookup per turn
    and measure cost as much as the rest of a turn's row."""
    typed = [
        _typed_values(turns.values(name) if name in turns else [None] * len(turns), kind)
        for name, kind in KINDS.items()
    ]
    return [dict(zip(KINDS, row)) for row in zip(*typed)]


_EXACT = {"int": int, "float": float, "str": str, "bool": bool, PRESENCE: str}


def _typed_values(values: list[Any], kind: str) -> list[Any]:
    """``_typed`` of each value, at once for a column of the usual types: values of the
    kind or None, floats of which only the finite are kept."""
    if kind == PRESENCE:
        return [True if isinstance(value, str) else None for value in values]
    kinds = set(map(type, values)) - {type(None)}
    if not kinds <= {_EXACT[kind]}:
        return [_typed(value, kind) for value in values]
    if kind != "float":
        return values
    finite = np.isfinite(np.array(values, np.float64)).tolist()  # None reads as NaN
    return [value if keep else None for value, keep in zip(values, finite)]


def _typed(value: Any, kind: str) -> Any:
    """The value as the column's kind; None for a null, NaN, infinity or a wrong type
    (a span id: True when there is one)."""
    if kind == PRESENCE:
        return True if isinstance(value, str) else None
    if type(value) is _EXACT[kind] and (kind != "float" or math.isfinite(cast(float, value))):
        return value  # the common case, at once
    if value is None:
        return None
    if kind == "str":
        return value if isinstance(value, str) else None
    if kind == "bool" or isinstance(value, bool):
        item = getattr(value, "item", None)  # a numpy boolean gives its Python value
        value = item() if callable(item) and not isinstance(value, bool) else value
        return value if kind == "bool" and isinstance(value, bool) else None
    if not isinstance(value, (int, float)):  # a numpy scalar gives its Python value
        item = getattr(value, "item", None)
        value = item() if callable(item) else None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value) if kind == "int" else float(value)


def pack(measures: Mapping[str, Any]) -> bytes:
    """One row's measures (``measures_of``) as the stored record: its codes made one
    record at once (a field assigned at a time, 81 numpy assignments, cost ~40 us a
    turn the store writes; the same codes through numpy's same conversions)."""
    get = measures.get
    codes = tuple([_code(name, kind, get(name)) for name, kind in _KIND_ITEMS])
    return np.array([codes], MEASURE_DTYPE).tobytes()


_KIND_ITEMS = tuple(KINDS.items())


def _code(name: str, kind: str, value: Any) -> float | int:
    if kind == "str":
        return ENUMS[name].index(value) if value in ENUMS[name] else -1
    if value is None:
        return math.nan if kind == "float" else NULL_INT
    if kind in ("bool", PRESENCE):
        return int(bool(value))
    return value


def pack_frame(turns: pd.DataFrame) -> pa.Array:
    """Every turn's measures of a turn table (the span path's labelled table): what a
    backfill of a turn store stores."""
    records = np.zeros(len(turns), MEASURE_DTYPE)
    for name, kind in KINDS.items():
        if name not in turns:
            records[name] = -1 if kind == "str" else (np.nan if kind == "float" else NULL_INT)
        elif kind == "str":
            codes = {value: i for i, value in enumerate(ENUMS[name])}
            coded = turns[name].astype(object).map(codes)
            records[name] = coded.fillna(-1).to_numpy(np.int64)
        elif kind == PRESENCE:
            records[name] = np.where(turns[name].notna().to_numpy(bool), 1, NULL_INT)
        else:
            numbers = turns[name].astype("Float64").to_numpy(float, na_value=np.nan)
            known = np.isfinite(numbers)
            if kind in ("int", "bool"):
                numbers = np.where(known, numbers, 0).astype(np.int64)
                numbers[~known] = NULL_INT
            records[name] = numbers
    size = MEASURE_DTYPE.itemsize
    packed = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(size), len(turns), [None, pa.py_buffer(records.tobytes())]
    )
    return packed.cast(pa.binary())


def _layout(size: int) -> np.dtype | None:
    """The record layout of ``size`` bytes: today's, or the prefix of it an older kvobs
    wrote (its measures first, the ones added since after them); None for any other
    size."""
    fields, offset = [], 0
    for name in KINDS:
        kind = MEASURE_DTYPE[name]
        fields.append((name, kind))
        offset += kind.itemsize
        if offset == size:
            return np.dtype(fields)
    return None


def unpack(
    column: pa.Array | pa.ChunkedArray, names: Iterable[str] | None = None
) -> dict[str, np.ndarray]:
    """The measures (``names`` of them; default all) of a batch's rows as turn-table
    columns: numbers as float64 (NaN for null, as pandas gives a nullable column),
    enumerations and booleans as objects (None for null), span ids as 1.0 (NaN: none).
    A row without a record (written by an older kvobs) has every measure null; one
    with an older, shorter record the measures added since."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    wanted = list(KINDS) if names is None else list(names)
    lengths = pc.fill_null(pc.binary_length(column), -1).to_numpy(zero_copy_only=False)
    records = np.zeros(len(column), MEASURE_DTYPE)
    if len(column) and (lengths == MEASURE_DTYPE.itemsize).all() and column.offset == 0:
        # the usual batch: one buffer, read in place
        offsets = np.frombuffer(column.buffers()[1], np.int32, len(column) + 1)
        data = memoryview(column.buffers()[2])[offsets[0] : offsets[-1]]
        records = np.frombuffer(data, MEASURE_DTYPE, len(column))
    else:  # rows an older kvobs wrote (no record, or a shorter one) among them
        for name in wanted:
            kind = KINDS[name]
            records[name] = -1 if kind == "str" else (np.nan if kind == "float" else NULL_INT)
        for size in np.unique(lengths).tolist():
            layout = _layout(size) if size > 0 else None
            if layout is None:
                continue
            rows = lengths == size
            present = pc.filter(column, pa.array(rows)).to_pylist()
            older = np.frombuffer(b"".join(present), layout, len(present))
            for name in wanted:
                if name in (layout.names or ()):
                    records[name][rows] = older[name]
    out: dict[str, np.ndarray] = {}
    for name in wanted:
        kind, values = KINDS[name], records[name]
        if kind == "str":
            out[name] = np.array([*ENUMS[name], None], dtype=object)[values]
        elif kind == "bool":
            out[name] = np.array([False, True, None], dtype=object)[
                np.where(values == NULL_INT, 2, values != 0)
            ]
        elif kind == PRESENCE:
            out[name] = np.where(values == NULL_INT, np.nan, 1.0)
        elif kind == "int":
            out[name] = np.where(values == NULL_INT, np.nan, values.astype(float))
        else:
            out[name] = values.copy()
    return out


__all__ = [
    "MEASURES_COLUMN",
    "MEASURES_KEY",
    "MEASURE_DTYPE",
    "REPLAY_FACTS",
    "REPORT_MEASURES",
    "TURN_MEASURES",
    "measures_of",
    "pack",
    "pack_frame",
    "unpack",
]
