"""The numbers a fleet report sums and sketches, stored on every classified turn row as
typed columns (``kvobs.live.turnstore.SCHEMA``): the report then reads a few columns of
the rows in batches (``kvobs.fleet.turn_report``) instead of parsing each turn's JSON.

Each measure is a turn-table column of the same name and type (``kvobs.turns.schema``,
the phases' from ``kvobs.timeline``): the values ``kvobs report`` reads from the turn
table on the span path, so the two reports read the same numbers.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import pandas as pd
import pyarrow as pa

from kvobs.timeline import PHASE_COLUMNS
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
_ARROW = {"int": pa.int64(), "float": pa.float64(), "str": pa.string()}
_PYTHON = {"int": int, "float": float}
MEASURE_FIELDS = [pa.field(name, _ARROW[column_type(name)]) for name in TURN_MEASURES] + [
    pa.field(name, pa.float64()) for name in PHASE_COLUMNS
]
# The row key the classifier puts them under (never part of the stored JSON).
MEASURES_KEY = "measures"


def measures_of(turn: Mapping[str, Any]) -> dict[str, Any]:
    """A classified turn's measures from its turn-table row (``TurnDiagnosis.turn``)."""
    return {f.name: _typed(turn.get(f.name), f.type) for f in MEASURE_FIELDS}


def _typed(value: Any, kind: pa.DataType) -> Any:
    """The value as the column's type; None for a null, NaN, infinity or a wrong type."""
    if value is None:
        return None
    if kind == pa.string():
        return value if isinstance(value, str) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:  # numpy scalars
            value = value.item()
        except AttributeError:
            return None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value) if kind == pa.int64() else float(value)


def measure_columns(turns: pd.DataFrame) -> dict[str, pa.Array]:
    """The measures of every turn of a turn table (the span path's labelled table), as
    typed columns: what a backfill of a turn store stores beside each turn."""
    return {f.name: typed_column(turns, f.name, f.type) for f in MEASURE_FIELDS}


def typed_column(turns: pd.DataFrame, name: str, kind: pa.DataType) -> pa.Array:
    """A turn-table column as ``kind`` (null for a missing, NaN or infinite value; all
    null when the table lacks it)."""
    if name not in turns:
        return pa.nulls(len(turns), kind)
    values = turns[name]
    if kind == pa.string():
        return pa.array(values.astype(object).where(values.notna(), None), kind)
    numbers = values.astype("Float64").to_numpy(float, na_value=np.nan)
    known = np.isfinite(numbers)
    if kind == pa.int64():
        numbers = np.where(known, numbers, 0).astype(np.int64)
    return pa.array(numbers, kind, mask=~known)


__all__ = [
    "MEASURE_FIELDS",
    "MEASURES_KEY",
    "TURN_MEASURES",
    "measure_columns",
    "measures_of",
    "typed_column",
]
