"""Turn rows from turns already classified on the span path (``kvobs.fleet.report``'s
labelled table): a turn store filled from recorded spans, as the classifier would have
stored them, in the layout its upkeep leaves (one merged, indexed file per hour). The
tests compare the report from such rows with the span path's report on the same spans;
the benchmark fills stores of millions of turns this way.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from kvobs.live.turn_measures import MEASURES_COLUMN, pack_frame
from kvobs.live.turnstore import (
    HOUR_FORMAT,
    MERGED_PREFIX,
    PARTITION_PREFIX,
    ROW_GROUP_ROWS,
    SCHEMA,
    TURNS_DIR,
    write_indexed,
)


def turn_rows_table(
    labelled: pd.DataFrame,
    prefill_tokens_per_s: float | None,
    details: list[str] | None = None,
) -> pa.Table:
    """``SCHEMA``'s rows of every labelled turn, version 1, finalized when the turn
    started (its hour partition). ``details``: each turn's JSON (default: its keys and
    verdict only)."""
    n = len(labelled)

    def column(name: str, kind: pa.DataType) -> pa.Array:
        if name not in labelled:
            return pa.nulls(n, kind)
        values = labelled[name]
        if kind == pa.string():
            return pa.array(values.astype(object).where(values.notna(), None), kind)
        numbers = values.astype("Float64").to_numpy(float, na_value=np.nan)
        known = np.isfinite(numbers)
        if kind == pa.int64():
            numbers = np.where(known, numbers, 0).astype(np.int64)
        return pa.array(numbers, kind, mask=~known)

    if details is None:
        keys = zip(
            *(labelled[c].astype(object) for c in ("tenant", "conversation_id", "turn", "verdict"))
        )
        details = [
            json.dumps({"tenant": t, "conversation_id": c, "turn": int(k), "verdict": v})
            for t, c, k, v in keys
        ]
    columns = {
        "tenant": column("tenant", pa.string()),
        "conversation_id": column("conversation_id", pa.string()),
        "turn": column("turn", pa.int64()),
        "version": pa.array(np.ones(n, np.int64)),
        "verdict": column("verdict", pa.string()),
        "rule": pa.nulls(n, pa.string()),
        "trace_id": column("trace_id", pa.string()),
        "slowest_phase": column("slowest_phase", pa.string()),
        "latency_s": column("latency_s", pa.float64()),
        "ttft_s": column("ttft_s", pa.float64()),
        "prompt_tokens": column("prompt_tokens", pa.int64()),
        "finalized_at": pa.array(
            labelled["turn_start_ns"].astype("Float64").to_numpy(float, na_value=0.0) / 1e9
        ),
        "detail": pa.array(details, pa.string()),
        "prefill_tokens_per_s": pa.array(
            np.full(n, np.nan if prefill_tokens_per_s is None else prefill_tokens_per_s),
            mask=np.full(n, prefill_tokens_per_s is None),
        ),
        MEASURES_COLUMN: pack_frame(labelled),
    }
    return pa.table([columns[f.name] for f in SCHEMA], schema=SCHEMA)


def write_turn_rows(directory: str, table: pa.Table, stamp: str = "backfill") -> list[str]:
    """``table``'s rows into a turn store's hour partitions, a merged file each (sorted
    by conversation, with its index): the store ``TurnStore.compact`` leaves. Returns the
    files written."""
    hours = _hours(table)
    written = []
    for hour in pc.unique(hours).to_pylist():
        rows = table.filter(pc.equal(hours, hour)).sort_by(
            [(c, "ascending") for c in ("conversation_id", "tenant", "turn", "version")]
        )
        partition = os.path.join(directory, TURNS_DIR, PARTITION_PREFIX + hour)
        os.makedirs(partition, exist_ok=True)
        base = os.path.join(partition, f"{MERGED_PREFIX}{stamp}")
        write_indexed(base, rows, row_group_size=ROW_GROUP_ROWS)
        written.append(base + ".parquet")
    return written


def _hours(table: pa.Table) -> pa.Array:
    """Hour partition names, vectorised (millions of rows)."""
    seconds = table["finalized_at"].to_numpy().astype(np.int64)
    names = pd.to_datetime(seconds, unit="s", utc=True).strftime(HOUR_FORMAT)
    return pa.array(np.asarray(names, dtype=object), pa.string())


__all__ = ["turn_rows_table", "write_turn_rows"]
