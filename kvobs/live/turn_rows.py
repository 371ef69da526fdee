"""Where the live classifier's turn rows are, from a location string: a ClickHouse URL
or a store directory (``kvobs collect --turn-store``, ``kvobs turns --source``)."""

from __future__ import annotations

import os

from kvobs.live.clickhouse_turns import ClickHouseTurns
from kvobs.live.turnstore import TurnRows, TurnStore
from kvobs.sources import CLICKHOUSE_SCHEMES


def open_turn_rows(location: str, retention_s: float = 30 * 86400.0) -> TurnRows:
    """Where final turns go and are read from: a ClickHouse URL (``clickhouse://...``,
    ``chdb:PATH``; ``?turn_table=NAME``, default ``kvobs_turn_rows``) or a store
    directory (its ``turns/`` parquet)."""
    if location.startswith(CLICKHOUSE_SCHEMES):
        return ClickHouseTurns.from_url(location, retention_s)
    return TurnStore(location, retention_s)


def stored_turn_rows(location: str) -> TurnRows | None:
    """The turn rows a ``--source`` location holds, if any: a store directory with
    ``turns/`` partitions, or a ClickHouse database with the turn table. Reading never
    creates either."""
    if location.startswith(CLICKHOUSE_SCHEMES):
        turns = ClickHouseTurns.from_url(location, create=False)
        return turns if turns.exists() else None
    store = TurnStore(location, 0)
    return store if os.path.isdir(location) and store.partitions() else None
