"""Turn rows assembled from per-span-name parts, in no particular order.

ClickHouse aggregates each span name on its own (one small GROUP BY per name is far
cheaper than one GROUP BY carrying every column's aggregate over every span); the parts
are then lined up here by a 64-bit hash of (tenant, conversation, turn), checked against
a second, independent hash so that a collision is detected, never merged.

``align_parts`` is the common case, with no string work: one part (the proxy's turn span,
in nearly every turn) brings the keys, the others only hashes. ``merge_parts`` is the
general one (every part with keys; any turn may lack any span).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

HASH, CHECK = "k", "k2"
KEY_COLUMNS = ("tenant", "conversation_id", "turn")


def merge_parts(parts: list[pa.Table], columns: dict[str, pa.DataType]) -> pa.Table | None:
    """One row per turn key from parts holding ``HASH``, ``CHECK``, the key columns and
    some of ``columns`` (at most one row per key each); None on a hash collision."""
    parts = sorted(parts, key=lambda p: -p.num_rows)  # most keys first: fewer gaps to fill
    hashes = [p.column(HASH).to_numpy() for p in parts]
    keys = np.unique(np.concatenate(hashes or [np.zeros(0, np.uint64)]))
    n = len(keys)
    check = np.zeros(n, np.uint64)
    seen = np.zeros(n, bool)
    out: dict[str, pa.Array] = {}
    for part, hashed in zip(parts, hashes):
        position = np.searchsorted(keys, hashed)
        checks = part.column(CHECK).to_numpy()
        fresh = ~seen[position]
        check[position[fresh]] = checks[fresh]
        if (check[position] != checks).any():
            return None
        take = np.full(n, -1, np.int64)
        take[position] = np.arange(len(position))
        index = pa.array(take, mask=take < 0)
        for name in KEY_COLUMNS:
            if name not in part.column_names:
                continue
            if name not in out:
                out[name] = part.column(name).take(index)
            elif (~seen[position]).any():
                out[name] = pc.coalesce(out[name], part.column(name).take(index))
        seen[position] = True
        for name in part.column_names:
            if name in columns:
                out[name] = part.column(name).take(index).cast(columns[name])
    key_types = {"tenant": pa.string(), "conversation_id": pa.string(), "turn": pa.int64()}
    for name, type_ in {**key_types, **columns}.items():
        out.setdefault(name, pa.nulls(n, type_))
    ordered = [*KEY_COLUMNS, *columns]
    return pa.table({name: out[name] for name in ordered})


def align_parts(
    keyed: pa.Table, parts: list[pa.Table], columns: dict[str, pa.DataType]
) -> pa.Table | None:
    """``keyed``'s rows (in its order) with the columns of ``parts`` (one row per
    (``HASH``, ``CHECK``), any order) lined up; None when a part has a turn ``keyed``
    lacks, or on a collision."""
    # One chunk per column: query results come in many batches, and takes across
    # chunks cost ~10x more.
    keyed = keyed.combine_chunks()
    hashes = keyed.column(HASH).to_numpy()
    order = np.argsort(hashes)
    by_hash = hashes[order]
    if (by_hash[1:] == by_hash[:-1]).any():
        return None
    checks = keyed.column(CHECK).to_numpy()
    n = keyed.num_rows
    out = {name: keyed.column(name) for name in keyed.column_names if name in columns}
    for part in parts:
        part = part.combine_chunks()
        # Looked up in hash order: sorted queries keep the binary searches cache-friendly.
        part_order = np.argsort(part.column(HASH).to_numpy())
        hashed = part.column(HASH).to_numpy()[part_order]
        position = np.minimum(np.searchsorted(by_hash, hashed), max(n - 1, 0))
        if len(hashed) and (not n or (by_hash[position] != hashed).any()):
            return None
        if (hashed[1:] == hashed[:-1]).any():  # two rows of one part on one key
            return None
        rows = order[position]
        if (checks[rows] != part.column(CHECK).to_numpy()[part_order]).any():
            return None
        take = np.full(n, -1, np.int64)
        take[rows] = part_order
        # A part in every turn needs no null mask (a faster take).
        index = pa.array(take) if len(rows) == n else pa.array(take, mask=take < 0)
        for name in part.column_names:
            if name in columns:
                out[name] = part.column(name).take(index)
    for name, type_ in columns.items():
        out[name] = out[name].cast(type_) if name in out else pa.nulls(n, type_)
    return pa.table(
        {
            **{name: keyed.column(name) for name in KEY_COLUMNS},
            **{name: out[name] for name in columns},
        }
    )
