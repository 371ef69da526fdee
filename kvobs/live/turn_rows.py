"""Where the live classifier's turn rows are, from a location string: a ClickHouse URL
or a store directory (``kvobs collect --turn-store``, ``kvobs turns --source``)."""

from __future__ import annotations

import itertools
import os
from typing import Any, Callable, Collection, Iterable, Iterator

import pyarrow as pa

from kvobs.live.clickhouse_turns import ClickHouseTurns
from kvobs.live.latest import latest
from kvobs.live.turnstore import TurnRows, TurnStore, by_conversation, turn_entries
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


def stored_turn_rows_of(locations: list[str]) -> TurnRows | None:
    """The classified turn rows of one location (``stored_turn_rows``) or of several
    (sharded classifiers' stores, read as one: ``TurnRowsUnion``); None when one of
    several holds none (a span source is read alone)."""
    if len(locations) == 1:
        return stored_turn_rows(locations[0])
    stores = [stored_turn_rows(location) for location in locations]
    if any(store is None for store in stores):
        return None
    return TurnRowsUnion([store for store in stores if store is not None], locations)


class TurnRowsUnion(TurnRows):
    """Several turn row stores read as one (each classifier of a sharded tier keeps its
    own, docs/live.md): the same report, tune and drill-down code runs over it, and a
    turn found in several stores (its conversation re-routed) is read at its latest
    version, as within one store. A part (file, hour) is named ``INDEX:PART`` after the
    store that holds it. Read only: it writes nothing but the stores' own summaries."""

    def __init__(self, stores: list[TurnRows], sources: list[str] | None = None):
        super().__init__(0.0)
        self.stores = stores
        # What reads each store again (the --source given for it).
        self.sources = sources or [store.location for store in stores]
        self.location = " + ".join(self.sources)
        self.problems = [p for store in stores for p in store.problems]
        self._holder: dict[str, str] = {}  # conversation -> the store of its latest turn

    @staticmethod
    def _split(part: str) -> tuple[int, str]:
        index, _, own = part.partition(":")
        return int(index), own

    def _parts(self, parts: Collection[str] | None, index: int) -> list[str] | None:
        if parts is None:
            return None
        return [own for i, own in map(self._split, parts) if i == index]

    def read(self, conversation_id: str | None = None, since: float | None = None) -> pa.Table:
        return pa.concat_tables([store.read(conversation_id, since) for store in self.stores])

    def batches(
        self,
        columns: list[str],
        batch_rows: int,
        later_versions: bool = False,
        skip: Collection[str] = (),
        only: Collection[str] | None = None,
    ) -> Iterator[pa.RecordBatch]:
        for index, store in enumerate(self.stores):
            own_only = self._parts(only, index)
            if own_only == []:
                continue
            yield from store.batches(
                columns, batch_rows, later_versions, self._parts(skip, index) or (), own_only
            )

    def summaries(self) -> Iterator[tuple[str, bytes]]:
        for index, store in enumerate(self.stores):
            for part, data in store.summaries():
                yield f"{index}:{part}", data

    def write_summary(self, part: str, summary: bytes) -> None:
        index, own = self._split(part)
        self.stores[index].write_summary(own, summary)

    def unsummarized(self) -> list[str]:
        return [
            f"{index}:{part}"
            for index, store in enumerate(self.stores)
            for part in store.unsummarized()
        ]

    def lookup(self, conversation_ids: list[str]) -> Callable[[str], list[str]]:
        held = [store.lookup(conversation_ids) for store in self.stores]

        def find(part: str) -> list[str]:
            index, own = self._split(part)
            return held[index](own)

        return find

    def conversation_rows(self, part: str, conversation_ids: list[str]) -> pa.Table | None:
        index, own = self._split(part)
        return self.stores[index].conversation_rows(own, conversation_ids)

    def rows_of(self, conversation_ids: list[str]) -> pa.Table | None:
        tables = [store.rows_of(conversation_ids) for store in self.stores]
        found = [table for table in tables if table is not None and table.num_rows]
        return pa.concat_tables(found, promote_options="default") if found else None

    def latest_of(self, conversation_ids: Iterable[str]) -> dict[str, list[dict[str, Any]]]:
        """``latest`` of each conversation over every store, by the one rule
        (``kvobs.live.latest``): a turn retired on one store hides its older version on
        another, and each conversation is read where its last turn is held."""
        ids = list(dict.fromkeys(conversation_ids))
        entries = []
        for source, store in zip(self.sources, self.stores):
            table = store.rows_of(ids)
            if table is not None:
                entries.append(turn_entries(table, source))
        kept, holders = latest(itertools.chain(*entries))
        self._holder.update(holders)
        return by_conversation(kept, ids)

    def source_of(self, conversation_id: str, source: str) -> str:
        """The store that held the conversation's latest turn when ``latest_of`` asked:
        its ``diagnose`` reads that store's spans."""
        return self._holder.get(conversation_id, source)
