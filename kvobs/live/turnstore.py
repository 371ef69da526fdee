"""Classified turns as the fleet's stored product: the live classifier's final rows.

Embedded (``TurnStore``): hourly parquet partitions, ``DIR/turns/hour=YYYYMMDDHH/
part-*.parquet``, dropped whole when older than the retention. ClickHouse
(``kvobs.live.clickhouse_turns``): one MergeTree table with a TTL. Both hold the same
rows (``SCHEMA``) and answer through ``TurnRows``. Every version of a turn is a row;
readers keep the latest (``latest``). A key the classifier moved a turn away from
(lineage re-grouped it) ends with a row marked ``superseded``, and readers skip it. A row
is a few typed columns to filter on plus ``detail``: the turn as ``kvobs diagnose
--json`` gives it (ids and numbers only, never text).
"""

from __future__ import annotations

import calendar
import contextlib
import hashlib
import json
import math
import mmap
import os
import struct
import shutil
import time
import uuid
from collections import defaultdict
from typing import Any, Callable, Collection, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from kvobs.live import parquet_footer
from kvobs.live.latest import Entry, latest, winners
from kvobs.live.turn_measures import MEASURES_COLUMN, MEASURES_KEY, pack
from kvobs.sources._decode import is_regular

_orjson_dumps: Callable[..., bytes] | None
try:
    from orjson import OPT_SERIALIZE_NUMPY as _ORJSON_NUMPY
    from orjson import dumps as _orjson_dumps
except ImportError:  # pragma: no cover - orjson comes with the proxy extra
    _orjson_dumps, _ORJSON_NUMPY = None, 0

TURNS_DIR = "turns"
PARTITION_PREFIX = "hour="
HOUR_FORMAT = "%Y%m%d%H"
SCHEMA = pa.schema(
    [
        ("tenant", pa.string()),
        ("conversation_id", pa.string()),
        ("turn", pa.int64()),
        ("version", pa.int64()),
        ("verdict", pa.string()),
        ("rule", pa.string()),
        ("trace_id", pa.string()),
        ("slowest_phase", pa.string()),
        ("latency_s", pa.float64()),
        ("ttft_s", pa.float64()),
        ("prompt_tokens", pa.int64()),
        ("finalized_at", pa.float64()),
        ("detail", pa.string()),
        # The fleet context the turn was priced with (``kvobs report`` shows it).
        ("prefill_tokens_per_s", pa.float64()),
        # What ``kvobs report`` aggregates, packed (``kvobs.live.turn_measures``); null
        # in rows an older kvobs wrote.
        (MEASURES_COLUMN, pa.binary()),
    ]
)
# No rows (a table is immutable: one for every read that finds none; making one costs
# ~0.1 ms, and a lookup misses a hundred files).
_NO_ROWS = SCHEMA.empty_table()
# Rows kept for a later write while the directory cannot be written (full disk); past
# this, the oldest go (counted by the caller).
MAX_PENDING = 100_000
# An hour's parts are merged this long after the hour ended (a pass that began inside it
# may still be writing there).
COMPACT_AFTER_S = 300
MERGED_PREFIX = "merged-"
_INDEX = ".cids"  # next to each file: its conversations' sorted hashes, raw uint64 LE
# Next to a merged file: what a reader aggregated over its rows (opaque here; written by
# ``kvobs.fleet.turn_report``), after the size of the file it was computed from.
_SUMMARY = ".tally"
_SUMMARY_HEADER = 8
# Next to a merged file: where each of its conversations' rows are (row groups, aligned
# with ``_INDEX``) and its footer cut by row group (``kvobs.live.parquet_footer``), so a
# lookup parses the footer of the groups it reads only (the whole footer of ~500 groups
# takes 5-7 ms). Layout in ``_GROUPS_HEADER``'s comment.
_GROUPS = ".groups"
# magic, parquet file size, conversations, row groups, lengths of the footer's head,
# middle and tail; then first and last group per conversation (uint32 each), each group's
# offset into the groups' bytes (uint64, one more than the groups) and rows (uint64);
# then head, middle, tail and the groups' bytes.
_GROUPS_HEADER = struct.Struct("<4sQIIIII")
_GROUPS_MAGIC = b"KVG1"
# Statistics are written for these columns only: what readers filter on. The turn JSON's
# min and max (``detail``, a few KB a group) made most of a merged file's footer.
_STATISTICS = [name for name in SCHEMA.names if name not in ("detail", "trace_id", MEASURES_COLUMN)]
# Merged files an older kvobs wrote get their ``_GROUPS`` at most this many a ``compact``.
GROUP_SIDECARS_PER_COMPACT = 12
# Indexes larger than this are memory-mapped for a lookup rather than read.
_MAPPED_INDEX_BYTES = 1 << 16
# An open hour's parts are merged (into a file of their own) once there are this many.
MIN_PARTS_TO_MERGE = 60
# Row groups of a merged file: a lookup reads the one(s) whose conversation range covers
# its id, so few rows (~1.5 KB of turn JSON each: 4,096-row groups cost 6 ms a read).
ROW_GROUP_ROWS = 256


def _number(value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = kind(value)
    except (ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def record(row: dict[str, Any], finalized_at: float) -> dict[str, Any]:
    """A classifier row as the store's columns: its measures typed, never in ``detail``."""
    measures = row.get(MEASURES_KEY) or {}
    if measures:
        row = {k: v for k, v in row.items() if k != MEASURES_KEY}
    context = row.get("context") or {}
    return {
        "tenant": str(row.get("tenant")),
        "conversation_id": str(row["conversation_id"]),
        "turn": int(row["turn"]),
        "version": int(row.get("version") or 1),
        "verdict": row.get("verdict"),
        "rule": row.get("rule"),
        "trace_id": row.get("trace_id"),
        "slowest_phase": row.get("slowest_phase"),
        "latency_s": _number(row.get("latency_s"), float),
        "ttft_s": _number(row.get("ttft_s"), float),
        "prompt_tokens": _number(row.get("prompt_tokens"), int),
        "finalized_at": finalized_at,
        "detail": _json(row),
        "prefill_tokens_per_s": _number(context.get("prefill_tokens_per_s"), float),
        MEASURES_COLUMN: pack(measures) if measures else None,
    }


def _json(row: dict[str, Any]) -> str:
    """Strict JSON (a NaN or infinity, which JSON cannot hold, as null). orjson where it
    can write the row (it writes NaN as null; ~9 against ~38 us a turn's row, a pass
    stores every turn it finalizes); json for what it refuses (a key not a string, an
    integer past 64 bits, a lone surrogate) or without orjson."""
    if _orjson_dumps is not None:
        try:
            return _orjson_dumps(row, default=str, option=_ORJSON_NUMPY).decode()
        except TypeError:  # orjson.JSONEncodeError
            pass
    try:
        return json.dumps(row, default=str, allow_nan=False, separators=(",", ":"))
    except ValueError:
        return json.dumps(_nan_free(row), default=str, separators=(",", ":"))


def _nan_free(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_free(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_free(v) for v in value]
    return value


class TurnRows:
    """What every turn row store shares: rows wait in ``pending`` while the store cannot
    take them (a full disk, ClickHouse down), up to ``MAX_PENDING``; reads keep each
    turn's latest version. A backend writes (``_flush``) and reads (``read``)."""

    location = ""

    def __init__(self, retention_s: float):
        self.retention_s = retention_s
        self.pending: list[dict[str, Any]] = []
        self.dropped = 0  # rows lost after MAX_PENDING (a store down for long)
        self.problems: list[str] = []  # what reading skipped (a FIFO named *.parquet)

    def write(self, rows: Iterable[dict[str, Any]], now: float | None = None) -> int:
        """Appends final rows (with any left from a failed write); returns the rows
        written. A failure keeps them for the next call and raises ``OSError``."""
        now = time.time() if now is None else now
        self.pending.extend(record(row, now) for row in rows)
        if len(self.pending) > MAX_PENDING:
            self.dropped += len(self.pending) - MAX_PENDING
            del self.pending[: len(self.pending) - MAX_PENDING]
        if not self.pending:
            return 0
        return self._flush(now)

    def _flush(self, now: float) -> int:
        """Writes ``pending``, removing what was written; ``OSError`` on failure."""
        raise NotImplementedError

    def expire(self, now: float | None = None) -> list[str]:
        """Drops what is past the retention; returns what went (a store whose engine
        expires rows itself returns nothing)."""
        return []

    def compact(self, now: float | None = None) -> list[str]:
        """Merges what was written in pieces; returns what was merged (a store whose
        engine merges itself returns nothing)."""
        return []

    def read(self, conversation_id: str | None = None, since: float | None = None) -> pa.Table:
        """Every stored row (of one conversation; finalized at or after ``since``), all
        versions, ``SCHEMA``'s columns."""
        raise NotImplementedError

    def batches(
        self,
        columns: list[str],
        batch_rows: int,
        later_versions: bool = False,
        skip: Collection[str] = (),
        only: Collection[str] | None = None,
    ) -> Iterator[pa.RecordBatch]:
        """Every stored row (all versions; ``later_versions``: only rows past a turn's
        first version), ``columns`` of ``SCHEMA``, in batches of at most
        ``batch_rows``; not the rows of the files in ``skip``, only those of the files
        in ``only`` (files ``summaries`` and ``unsummarized`` name). Here through
        ``read``: a backend that can stream overrides it (the store, a file at a
        time)."""
        table = self.read()
        if later_versions:
            table = table.filter(pc.greater(table.column("version"), 1))
        yield from table.select(columns).to_batches(batch_rows)

    def summaries(self) -> Iterator[tuple[str, bytes]]:
        """(file, summary) of each stored file that has a summary of its rows written
        for it (``write_summary``) and unchanged since; a backend without files has
        none."""
        return iter(())

    def write_summary(self, part: str, summary: bytes) -> None:
        """Keeps ``summary`` (opaque here) with the file ``part`` of ``unsummarized``."""
        raise NotImplementedError

    def unsummarized(self) -> list[str]:
        """The files a summary would pay for (merged, sorted files) that have none."""
        return []

    def lookup(self, conversation_ids: list[str]) -> Callable[[str], list[str]]:
        """Which of the conversations a file (``summaries``' ``part``) may hold a row
        of, asked of file after file: set up once for the ids (all of them where it
        cannot tell)."""
        return lambda part: conversation_ids

    def conversation_rows(self, part: str, conversation_ids: list[str]) -> pa.Table | None:
        """The rows of the file ``part`` of those conversations, every version; None
        when it cannot look them up (no index)."""
        return None

    def latest(self, conversation_id: str | None = None) -> list[dict[str, Any]]:
        """The turns (of one conversation), each at its latest version, in key order."""
        return self.latest_and_retired(conversation_id)[0]

    def latest_and_retired(
        self, conversation_id: str | None = None, since: float | None = None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """``latest``, and the keys (with versions) whose latest row retires them: what
        a peer's answer hides (``kvobs.live.latest``). With ``since``: of the rows
        finalized at or after it (what a restarted classifier resumes from)."""
        found = winners(turn_entries(self.read(conversation_id, since)))
        retired = [
            dict(zip(("tenant", "conversation_id", "turn"), e.key), version=e.version)
            for e in found
            if e.retired
        ]
        return [e.turn | {"final": True} for e in found if e.turn is not None], retired

    def rows_of(self, conversation_ids: list[str]) -> pa.Table | None:
        """Every stored row (each version, retirements too) of these conversations;
        None for none (a store that can look several up at once overrides it)."""
        tables = [self.read(cid) for cid in conversation_ids]
        return pa.concat_tables(tables) if tables else None

    def latest_of(self, conversation_ids: Iterable[str]) -> dict[str, list[dict[str, Any]]]:
        """``latest`` of each conversation."""
        ids = list(dict.fromkeys(conversation_ids))
        table = self.rows_of(ids)
        return by_conversation(latest(turn_entries(table))[0] if table is not None else [], ids)

    def source_of(self, conversation_id: str, source: str) -> str:
        """The ``--source`` that reads ``conversation_id`` (after ``latest_of`` asked
        for it): ``source``, where the rows are one store's."""
        return source


def turn_entries(table: pa.Table, holder: Any = None) -> Iterator[Entry]:
    """The stored rows as ``kvobs.live.latest`` entries (the turn: its ``detail``)."""
    for item in table.select(
        ["tenant", "conversation_id", "turn", "version", "detail"]
    ).to_pylist():
        detail = json.loads(item["detail"])
        retired = bool(detail.get("superseded"))
        key = (item["tenant"], item["conversation_id"], item["turn"])
        turn = None if retired else detail | {"version": item["version"]}
        yield Entry(key, item["version"], retired, turn, holder)


def by_conversation(
    kept: Iterable[Entry], conversation_ids: list[str]
) -> dict[str, list[dict[str, Any]]]:
    """``latest``'s answer per conversation, from the winning entries of their rows."""
    found: dict[str, list[dict[str, Any]]] = {cid: [] for cid in conversation_ids}
    for entry in kept:
        if entry.turn is not None:
            found[entry.key[1]].append(entry.turn | {"final": True})
    return found


class TurnStore(TurnRows):
    """The embedded default: hourly parquet partitions under ``DIR/turns``."""

    def __init__(self, directory: str, retention_s: float):
        super().__init__(retention_s)
        self.directory = os.path.join(directory, TURNS_DIR)
        self.location = self.directory
        self._without_groups: set[str] = set()  # merged files add_group_sidecars cannot

    def _flush(self, now: float) -> int:
        by_hour: dict[str, list[dict]] = defaultdict(list)
        for item in self.pending:
            by_hour[time.strftime(HOUR_FORMAT, time.gmtime(item["finalized_at"]))].append(item)
        done: list[str] = []
        try:
            for hour, items in by_hour.items():
                partition = os.path.join(self.directory, PARTITION_PREFIX + hour)
                os.makedirs(partition, exist_ok=True)
                write_indexed(
                    os.path.join(partition, f"part-{_stamp(now)}"),
                    pa.Table.from_pylist(items, schema=SCHEMA),
                )
                done.append(hour)
        finally:  # what was written leaves pending, also when a later hour failed
            self.pending = [
                item for hour, items in by_hour.items() if hour not in done for item in items
            ]
        return sum(len(by_hour[hour]) for hour in done)

    def partitions(self) -> list[str]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if n.startswith(PARTITION_PREFIX))

    def _files(self, partition: str) -> list[str]:
        """A partition's parquet file names, sorted; a FIFO or other non-regular file
        so named is reported in ``problems`` and left out: opening it would block."""
        names = sorted(f for f in os.listdir(partition) if f.endswith(".parquet"))
        return [f for f in names if is_regular(os.path.join(partition, f), self.problems)]

    def _hours(self) -> list[tuple[str, float]]:
        """(partition, when its hour began) of every partition of ours."""
        hours: list[tuple[str, float]] = []
        for name in self.partitions():
            try:
                hours.append(
                    (
                        name,
                        calendar.timegm(time.strptime(name[len(PARTITION_PREFIX) :], HOUR_FORMAT)),
                    )
                )
            except ValueError:
                continue  # not ours
        return hours

    def expire(self, now: float | None = None) -> list[str]:
        """Drops the partitions whose hour ended before the retention; returns them."""
        now = time.time() if now is None else now
        gone = []
        for name, start in self._hours():
            if start + 3600 < now - self.retention_s:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
                gone.append(name)
        return gone

    def compact(self, now: float | None = None) -> list[str]:
        """Merges the part files (one per classification pass that finalized turns: up
        to 3,600 an hour) into files sorted by conversation, each with an index of the
        conversations it holds (``_INDEX``): a lookup then reads only the files, and the
        row groups, that hold the conversation. A closed hour (``COMPACT_AFTER_S`` after
        its end) becomes one file; an open one gets its parts merged into a file of
        their own. Written aside and renamed before the parts go: a reader meets every
        row at least once (twice between the rename and the removal, which the
        latest-version rule absorbs). Returns the partitions merged."""
        now = time.time() if now is None else now
        merged = []
        for name, start in self._hours():
            partition = os.path.join(self.directory, name)
            files = self._files(partition)
            closed = start + 3600 + COMPACT_AFTER_S <= now
            chosen = files if closed else [f for f in files if not f.startswith(MERGED_PREFIX)]
            if len(chosen) < (2 if closed else MIN_PARTS_TO_MERGE):
                continue
            self._merge(partition, chosen, now)
            merged.append(name)
        with contextlib.suppress(OSError):  # a full disk: lookups read those as they are
            self.add_group_sidecars(GROUP_SIDECARS_PER_COMPACT)
        return merged

    def add_group_sidecars(self, limit: int | None = None) -> list[str]:
        """Writes the ``_GROUPS`` of merged files an older kvobs wrote without one (at
        most ``limit``: ~0.3 s each for a fleet's hour); returns those files. A file it
        cannot give one is not tried again by this store."""
        done: list[str] = []
        for path in self._paths():
            if limit is not None and len(done) >= limit:
                break
            if (
                not os.path.basename(path).startswith(MERGED_PREFIX)
                or path in self._without_groups
                or os.path.exists(_sidecar(path, _GROUPS))
            ):
                continue
            self._without_groups.add(path)  # until written
            try:
                index = np.fromfile(_sidecar(path, _INDEX), dtype="<u8")
                ids = _dictionary(pq.read_table(path, columns=["conversation_id"]))
            except (OSError, pa.ArrowException):
                continue  # no index (it has no use then), merged away meanwhile, unreadable
            hashes = _hashes(ids.dictionary.to_pylist())
            if not np.array_equal(np.unique(hashes), index):
                continue  # an index not of this file: lookups read the file whole
            groups = _groups_sidecar(path, index, hashes, ids.indices)
            if groups is not None:
                self._without_groups.discard(path)  # a failed write: tried again
                write_aside(_sidecar(path, _GROUPS), groups)
                done.append(path)
        return done

    def _merge(self, partition: str, names: list[str], now: float) -> None:
        paths = [os.path.join(partition, f) for f in names]
        table = pa.concat_tables(pq.read_table(p, schema=SCHEMA) for p in paths)
        table = table.sort_by(
            [
                ("conversation_id", "ascending"),
                ("tenant", "ascending"),
                ("turn", "ascending"),
                ("version", "ascending"),
            ]
        )
        write_indexed(
            os.path.join(partition, f"{MERGED_PREFIX}{_stamp(now)}"),
            table,
            row_group_size=ROW_GROUP_ROWS,
        )
        for path in paths:
            os.remove(path)
            for suffix in (_INDEX, _SUMMARY, _GROUPS):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(_sidecar(path, suffix))

    def _rows(
        self,
        path: str,
        conversation_ids: list[str] | None,
        keys: np.ndarray | None,
        since: float | None,
        filters: list,
    ) -> pa.Table:
        table = None
        if keys is not None and conversation_ids is not None:
            table = self._conversation_rows(path, conversation_ids, keys)
            if table is not None and since is not None and table.num_rows:
                table = table.filter(pc.greater_equal(table.column("finalized_at"), since))
        if table is None:
            table = pq.read_table(path, schema=SCHEMA, filters=filters or None)
        return table

    @staticmethod
    def _conversation_rows(
        path: str, conversation_ids: list[str], keys: np.ndarray
    ) -> pa.Table | None:
        """The conversations' rows of a file through its index (an empty table when it
        holds none of them), None when the file has no index (an older kvobs wrote it).
        Only a file that holds a conversation is opened, once, only its row groups whose
        conversation range covers one read: named by the file's ``_GROUPS``, and read
        through a footer of those groups only; else (a file an older kvobs merged) found
        by the statistics in the whole footer."""
        searched = _searched(path, keys)
        if searched is None:
            return None
        found, at = searched
        held = [cid for cid, hit in zip(conversation_ids, found.tolist()) if hit]
        if not held:
            return _NO_ROWS
        located = _located(path, at[found])
        if located is not None:
            handle, groups = located
        else:  # no row-group sidecar (an older kvobs wrote the file): the whole footer
            handle = pq.ParquetFile(path)
            sorted_ = os.path.basename(path).startswith(MERGED_PREFIX)
            groups = sorted({g for cid in held for g in _groups_holding(handle, cid, sorted_)})
        table = _conformed(handle.read_row_groups(groups))
        return table.filter(pc.is_in(table.column("conversation_id"), pa.array(held, pa.string())))

    def _paths(self, since: float | None = None) -> list[str]:
        """Every file of the partitions from ``since``'s hour on."""
        first_hour = "" if since is None else time.strftime(HOUR_FORMAT, time.gmtime(since))
        return [
            os.path.join(self.directory, p, f)
            for p in self.partitions()
            if p[len(PARTITION_PREFIX) :] >= first_hour
            for f in self._files(os.path.join(self.directory, p))
        ]

    def batches(
        self,
        columns: list[str],
        batch_rows: int,
        later_versions: bool = False,
        skip: Collection[str] = (),
        only: Collection[str] | None = None,
    ) -> Iterator[pa.RecordBatch]:
        """File by file, row groups gathered into batches of ``batch_rows`` (a merged
        file's groups hold 256 rows, for lookups: a batch each would cost more in
        per-batch work than in reading). Memory holds one batch and one group. A file
        an older kvobs wrote gives nulls for the columns it lacks. ``later_versions``
        reads only the row groups whose statistics allow a version past 1."""
        gathered: list[pa.RecordBatch] = []
        size = 0
        for path in self._paths() if only is None else only:
            if path in skip:
                continue
            try:
                for batch in _scan(path, columns, batch_rows, later_versions):
                    gathered.append(batch)
                    size += batch.num_rows
                    if size >= batch_rows:
                        # The batch's surplus starts the next one: a batch is never
                        # larger than asked (a replay's partition bounds its reads).
                        joined = _joined(gathered)
                        yield joined.slice(0, batch_rows)
                        surplus = joined.slice(batch_rows)
                        gathered, size = [surplus], surplus.num_rows
            except FileNotFoundError:
                continue  # merged away since listed: this read misses it (a rerun sees it)
        if size:
            yield _joined(gathered)

    def read(self, conversation_id: str | None = None, since: float | None = None) -> pa.Table:
        files = self._paths(since)
        if not files:
            return _NO_ROWS
        ids = None if conversation_id is None else [conversation_id]
        return self._read(files, ids, since)

    def _read(self, files: list[str], ids: list[str] | None, since: float | None) -> pa.Table:
        keys = None if ids is None else _hashes(ids)
        filters: list[tuple[str, str, Any]] = (
            [] if ids is None else [("conversation_id", "in", ids)]
        )
        filters += [] if since is None else [("finalized_at", ">=", since)]
        tables = []
        for path in files:
            try:
                table = self._rows(path, ids, keys, since, filters)
            except FileNotFoundError:
                continue  # merged meanwhile: a read after the merge finds its rows
            if table.num_rows:  # a lookup misses most files: no table of each
                tables.append(table)
        return pa.concat_tables(tables) if tables else _NO_ROWS

    def summaries(self) -> Iterator[tuple[str, bytes]]:
        """Read one at a time (a fleet's month is hundreds of files); a summary whose
        file changed size since it was written (rewritten in place) is not given."""
        for path in self._paths():
            try:
                with open(_sidecar(path, _SUMMARY), "rb") as handle:
                    data = handle.read()
                size = os.stat(path).st_size
            except OSError:  # none, or merged away meanwhile
                continue
            header = data[:_SUMMARY_HEADER]
            if len(header) == _SUMMARY_HEADER and int.from_bytes(header, "little") == size:
                yield path, data[_SUMMARY_HEADER:]

    def write_summary(self, part: str, summary: bytes) -> None:
        """Written aside and renamed: a reader meets the whole summary or none."""
        size = os.stat(part).st_size.to_bytes(_SUMMARY_HEADER, "little")
        write_aside(_sidecar(part, _SUMMARY), size + summary)

    def unsummarized(self) -> list[str]:
        return [
            path
            for path in self._paths()
            if os.path.basename(path).startswith(MERGED_PREFIX)
            and not os.path.exists(_sidecar(path, _SUMMARY))
        ]

    def lookup(self, conversation_ids: list[str]) -> Callable[[str], list[str]]:
        """Through each file's index, the ids hashed once."""
        keys = _hashes(conversation_ids)

        def held(part: str) -> list[str]:
            found = _indexed(part, keys) if conversation_ids else None
            if found is None:
                return conversation_ids
            return [conversation_ids[i] for i in np.flatnonzero(found).tolist()]

        return held

    def conversation_rows(self, part: str, conversation_ids: list[str]) -> pa.Table | None:
        return self._conversation_rows(part, conversation_ids, _hashes(conversation_ids))

    def rows_of(self, conversation_ids: list[str]) -> pa.Table | None:
        """Each file's index read once for all the conversations."""
        files = self._paths()
        return self._read(files, conversation_ids, None) if files and conversation_ids else None


def _sidecar(path: str, suffix: str) -> str:
    return path[: -len(".parquet")] + suffix


def write_aside(target: str, data: bytes) -> None:
    """``data`` written aside and renamed: a reader meets all of it or none."""
    try:
        with open(target + ".tmp", "wb") as handle:
            handle.write(data)
        os.replace(target + ".tmp", target)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(target + ".tmp")
        raise


def _dictionary(table: pa.Table) -> pa.DictionaryArray:
    """A table's conversations, each once, and each row's among them."""
    return table.column("conversation_id").combine_chunks().dictionary_encode()


def _indexed(path: str, keys: np.ndarray) -> np.ndarray | None:
    """Which of the conversation hashes ``keys`` the file's index holds; None when the
    file has none (an older kvobs wrote it)."""
    searched = _searched(path, keys)
    return None if searched is None else searched[0]


def _searched(path: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``_indexed``, and where in the index each key is (where found). Nothing is kept
    between calls: the index is memory-mapped for one search (tens of microseconds)."""
    index = _sidecar(path, _INDEX)
    try:
        with open(index, "rb") as handle:
            if os.fstat(handle.fileno()).st_size > _MAPPED_INDEX_BYTES:
                hashes = np.asarray(np.memmap(handle, dtype="<u8", mode="r"))
            else:
                hashes = np.frombuffer(handle.read(), dtype="<u8")
    except (OSError, ValueError):  # none (an older kvobs wrote the file)
        return None
    if not len(hashes):
        return np.zeros(len(keys), bool), np.zeros(len(keys), np.intp)
    at = np.minimum(np.searchsorted(hashes, keys), len(hashes) - 1)
    return hashes[at] == keys, at


def _located(path: str, positions: np.ndarray) -> tuple[pq.ParquetFile, list[int]] | None:
    """The file opened on a footer of only the row groups holding the conversations at
    ``positions`` of its index, and those groups (numbered in that footer: all of
    it); None when it has no row-group sidecar, or one not of this file."""
    try:
        with open(_sidecar(path, _GROUPS), "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < _GROUPS_HEADER.size:
                return None
            data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        parquet_size = os.stat(path).st_size
    except (OSError, ValueError):
        return None
    with data:
        magic, of_size, conversations, count, *lengths = _GROUPS_HEADER.unpack_from(data)
        at = _GROUPS_HEADER.size
        needed = at + conversations * 8 + count * 16 + 8 + sum(lengths)
        if magic != _GROUPS_MAGIC or of_size != parquet_size or size < needed:
            return None
        if len(positions) and int(positions.max()) >= conversations:
            return None
        first = np.frombuffer(data, "<u4", conversations, at)[positions]
        last = np.frombuffer(data, "<u4", conversations, at + 4 * conversations)[positions]
        at += 8 * conversations
        offsets = np.frombuffer(data, "<u8", count + 1, at)
        rows = np.frombuffer(data, "<u8", count, at + 8 * (count + 1))
        at += 16 * count + 8
        pieces = []
        for length in lengths:
            pieces.append(bytes(data[at : at + length]))
            at += length
        chosen = sorted({g for a, b in zip(first.tolist(), last.tolist()) for g in range(a, b + 1)})
        if any(g >= count for g in chosen):
            return None
        split = parquet_footer.Split(
            head=pieces[0],
            middle=pieces[1],
            tail=pieces[2],
            groups=[bytes(data[at + int(offsets[g]) : at + int(offsets[g + 1])]) for g in chosen],
            rows=[int(rows[g]) for g in chosen],
        )
        del first, last, offsets, rows  # views of the map, which closes here
    try:
        metadata = parquet_footer.subset(split, list(range(len(chosen))))
    except (OSError, ValueError):
        return None
    return pq.ParquetFile(path, metadata=metadata), list(range(len(chosen)))


def _scan(
    path: str, columns: list[str], batch_rows: int, later_versions: bool
) -> Iterator[pa.RecordBatch]:
    """One file's rows, ``columns`` of ``SCHEMA`` (null where the file lacks one).
    ``ParquetFile.iter_batches`` reads a merged file's many small row groups 2.5x faster
    than a dataset scan; the dataset's filter skips, by their statistics, the row groups
    that hold first versions only."""
    if later_versions:
        dataset = ds.dataset(path, schema=SCHEMA, format="parquet")
        yield from dataset.to_batches(
            columns=columns, batch_size=batch_rows, filter=ds.field("version") > 1
        )
        return
    handle = pq.ParquetFile(path)
    held = [c for c in columns if c in handle.schema_arrow.names]
    wanted = pa.schema([SCHEMA.field(c) for c in columns])
    for batch in handle.iter_batches(batch_size=batch_rows, columns=held):
        arrays = [
            batch.column(c) if c in held else pa.nulls(batch.num_rows, wanted.field(c).type)
            for c in columns
        ]
        yield pa.RecordBatch.from_arrays(arrays, schema=wanted)


def _conformed(table: pa.Table) -> pa.Table:
    """``SCHEMA``'s columns of a file's rows: null where an older kvobs wrote none, and
    none it does not know."""
    return pa.table(
        [
            table.column(f.name).cast(f.type)
            if f.name in table.column_names
            else pa.nulls(table.num_rows, f.type)
            for f in SCHEMA
        ],
        schema=SCHEMA,
    )


def _joined(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    if len(batches) == 1:
        return batches[0]
    return pa.Table.from_batches(batches).combine_chunks().to_batches()[0]


def _groups_holding(handle: pq.ParquetFile, conversation_id: str, sorted_: bool) -> list[int]:
    """The row groups whose conversation range covers ``conversation_id``: in a merged
    file (sorted by conversation) found by bisection, a few statistics read out of
    hundreds; in a part, every group checked."""
    metadata = handle.metadata
    column = handle.schema_arrow.get_field_index("conversation_id")

    def bounds(group: int) -> tuple[str, str] | None:
        stats = metadata.row_group(group).column(column).statistics
        return (stats.min, stats.max) if stats is not None and stats.has_min_max else None

    count = metadata.num_row_groups
    if not sorted_:
        return [
            g for g in range(count) if (b := bounds(g)) is None or b[0] <= conversation_id <= b[1]
        ]
    low, high = 0, count
    while low < high:  # the first group whose max is at or past the id
        middle = (low + high) // 2
        b = bounds(middle)
        if b is None:
            return list(range(count))  # no statistics: read them all
        if b[1] < conversation_id:
            low = middle + 1
        else:
            high = middle
    groups = []
    for group in range(low, count):  # a conversation may span a few groups
        b = bounds(group)
        if b is None or b[0] > conversation_id:
            break
        groups.append(group)
    return groups


def _stamp(now: float) -> str:
    return f"{int(now * 1000)}-{uuid.uuid4().hex[:8]}"


def write_indexed(base: str, table: pa.Table, **options: Any) -> None:
    """``base.parquet`` and its conversation index ``base`` + ``_INDEX`` (and, for a file
    of several row groups, its ``_GROUPS``), each written aside and renamed, the file
    last: a reader never meets half a file, nor a file without its index (a crash
    between the renames leaves sidecars alone, never read)."""
    written = []
    try:
        ids = _dictionary(table)
        hashes = _hashes(ids.dictionary.to_pylist())
        index = np.unique(hashes)
        index.astype("<u8").tofile(base + _INDEX + ".tmp")
        written.append(base + _INDEX + ".tmp")
        pq.write_table(table, base + ".tmp", write_statistics=_STATISTICS, **options)
        written.append(base + ".tmp")
        sidecars = [_INDEX]
        if "row_group_size" in options:
            groups = _groups_sidecar(base + ".tmp", index, hashes, ids.indices)
            if groups is not None:
                with open(base + _GROUPS + ".tmp", "wb") as handle:
                    written.append(base + _GROUPS + ".tmp")
                    handle.write(groups)
                sidecars.append(_GROUPS)
        for suffix in sidecars:
            os.replace(base + suffix + ".tmp", base + suffix)
        os.replace(base + ".tmp", base + ".parquet")
    except OSError:
        for path in written:
            with contextlib.suppress(OSError):
                os.remove(path)
        raise


def _groups_sidecar(
    path: str, index: np.ndarray, hashes: np.ndarray, rows: pa.Array
) -> bytes | None:
    """``_GROUPS`` of the file ``path``: the row groups of each conversation of
    ``index`` (``hashes`` of the conversations, ``rows`` each row's among them), and the
    footer by group; None for a footer the cut does not understand (lookups then read
    the whole footer)."""
    try:
        split = parquet_footer.split(parquet_footer.footer(path))
    except parquet_footer.FooterError:
        return None
    counts = np.array(split.rows, dtype=np.int64)
    group = np.repeat(np.arange(len(counts), dtype=np.uint32), counts)
    if len(group) != len(rows):
        return None
    at = np.searchsorted(index, hashes[rows.to_numpy(zero_copy_only=False)])
    first = np.full(len(index), np.iinfo(np.uint32).max, np.uint32)
    last = np.zeros(len(index), np.uint32)
    np.minimum.at(first, at, group)
    np.maximum.at(last, at, group)
    sizes = np.array([len(g) for g in split.groups], dtype=np.uint64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype("<u8")
    header = _GROUPS_HEADER.pack(
        _GROUPS_MAGIC,
        os.stat(path).st_size,
        len(index),
        len(counts),
        len(split.head),
        len(split.middle),
        len(split.tail),
    )
    return b"".join(
        [
            header,
            first.astype("<u4").tobytes(),
            last.astype("<u4").tobytes(),
            offsets.tobytes(),
            counts.astype("<u8").tobytes(),
            split.head,
            split.middle,
            split.tail,
            *split.groups,
        ]
    )


def _hashes(conversation_ids: list[str]) -> np.ndarray:
    """Stable 64-bit hashes (the index outlives the process)."""
    return np.array(
        [
            int.from_bytes(
                hashlib.blake2b(c.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                "little",
            )
            for c in conversation_ids
        ],
        dtype=np.uint64,
    )
