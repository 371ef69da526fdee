"""The embedded store: what kvobs components write to when no collector is configured.

Layout of a store directory::

    spans/*.otlp.jsonl          live segments, OTLP-JSON lines appended by the emitters
    compacted/bucket=NN/*.parquet  columnar segments, one column per semconv attribute,
                                rows sorted by conversation id, hash-partitioned by it
    compacted/bucket=none/*.parquet  the spans of no conversation (``NO_CONVERSATION``)
    turns/bucket=NN/*.parquet   the turn rows of the span file of the same name
                                (``kvobs.fleet``'s per-turn aggregate), so a fleet report
                                reads turns, not spans

``compact()`` turns the live segments no writer appends to any more into parquet
(safe next to running writers and after a crash: its doc). Reading one conversation touches one
bucket and, thanks to the sort, few row groups: that keeps ``diagnose`` fast at fleet
scale.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import time
import uuid
import zlib

from typing import TYPE_CHECKING, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvobs import semconv as sc
from kvobs.turns import arrays, lineage
from kvobs.turns.correlate import aggregate, inherited_rows, needs_lineage, parent_rows
from kvobs.sources._decode import is_regular
from kvobs.sources._frame import (
    ALL_DTYPES,
    conformed,
    drop_duplicate_span_rows,
    frame_from_table,
    select_conversation,
    table_from_rows,
)
from kvobs.sources._store_layout import (
    COMPACTED_DIR,
    TURNS_DIR,
    note,
    read_conversation,
    read_spans,
    span_files,
    store_schema,
    turns_path,
    existing_turns_path,
)
from kvobs.sources.otlp_json import OtlpJsonSource, otlp_files, read_rows

if TYPE_CHECKING:
    import pandas as pd

# pandas (``spans()`` only: compaction is Arrow throughout) and the turn-file reader
# (pyarrow.dataset, which imports pandas) are imported where used: reading one
# conversation (``span_table``, what ``kvobs diagnose`` reads) needs neither
# (bench/README.md, issue 12).

__all__ = [
    "StoreSource",
    "is_store",
    "bucket_of",
    "compact",
    "write_parquet",
    "write_table",
    "write_turns",
    "store_schema",
    "span_files",
    "turns_path",
    "COMPACTED_DIR",
    "TURNS_DIR",
    "BUCKETS",
    "NO_CONVERSATION",
]

BUCKETS = 64
# How long a kvobs writer's active segment must go unwritten before a compaction seals
# and takes it (it is safe at any value: the seal takes the writer's lock; this keeps a
# busy writer's segment whole).
QUIET_S = 600.0
_JOURNAL = ".compaction-"  # + batch + .json, in the store directory
ROW_GROUP_SIZE = 16384
_CID = sc.CONVERSATION_ID.key
# The bucket of spans without conversation id (no tagged ancestor, and a trace holding no
# conversation or several): read with the whole store (the turn pipeline leaves them out
# of every turn), never with one conversation.
NO_CONVERSATION = "bucket=none"


def is_store(path: str) -> bool:
    return any(os.path.isdir(os.path.join(path, sub)) for sub in (sc.STORE_LIVE_DIR, COMPACTED_DIR))


def bucket_of(conversation_id: str) -> int:
    return zlib.crc32(conversation_id.encode()) % BUCKETS


def _inherit_conversation(table: pa.Table) -> pa.Table:
    """Untagged spans take the conversation (and turn) by the turn pipeline's rule
    (``correlate.inherited_rows``, as ``_inherit_keys`` reads them): those of their
    nearest tagged ancestor span (vLLM's request span, child of its turn span; the
    proxy's HTTP client spans, its grandchildren: several turns may share a client's
    trace), else of their trace's first tagged span when the trace holds one
    conversation. A span of a trace holding several, with no tagged ancestor, keeps
    none: which it belongs to is unknown, and a guess stored would be read as the
    truth. A span without trace id is in no trace: it keeps its own (or its
    ancestor's)."""
    untagged = arrays.booleans(pc.is_null(table.column(_CID)))
    if not untagged.any() or untagged.all():
        return table
    codes, traces = arrays.codes(table.column("trace_id"))
    # Each span without trace id a trace of its own (correlate groups them as one).
    no_trace = np.flatnonzero(arrays.booleans(pc.is_null(table.column("trace_id"))))
    codes[no_trace] = traces + np.arange(len(no_trace))
    traces += len(no_trace)
    rows = inherited_rows(table.column(_CID), codes, traces, parent_rows(table), True)
    inherits = untagged & (rows >= 0)
    if not inherits.any():
        return table
    # Each inheriting row takes both keys from the row it inherits from, the others their own.
    source = pa.array(np.where(inherits, rows, np.arange(table.num_rows)))
    for key in (_CID, sc.TURN_INDEX.key):
        table = table.set_column(table.column_names.index(key), key, table.column(key).take(source))
    return table


def write_parquet(
    store_dir: str,
    table: pa.Table,
    name: str | None = None,
    context: pa.Table | None = None,
    problems: list[str] | None = None,
) -> int:
    """Append a span table (``SPAN_SCHEMA``) to the compacted segments (files named
    ``name``, else new names); returns rows written. ``context``: spans not written but
    read for the conversation of an untagged span (its trace's) or an id-less turn (its
    lineage). A span left without conversation is stored under none
    (``NO_CONVERSATION``): counted in ``problems``."""
    written = table.num_rows
    if context is not None and context.num_rows:
        table = pa.concat_tables([table, context])
    # Id-less turns (another router): named before the spans of no conversation are set apart.
    if needs_lineage(table):
        table = conformed(lineage.link(table))
    table = _inherit_conversation(table).slice(0, written)  # the rows given, not the context
    untagged = table.column(_CID).null_count
    if untagged and problems is not None:
        problems.append(
            f"{untagged} span(s) without conversation id, in no trace with one or with no"
            " tagged ancestor in a trace with several: stored under no conversation"
            f" ({COMPACTED_DIR}/{NO_CONVERSATION})"
        )
    return write_table(store_dir, table, name)


def write_table(store_dir: str, table: pa.Table, name: str | None = None) -> int:
    """Append an Arrow span table (``store_schema()``) to the compacted segments: one
    file per bucket touched, rows sorted by conversation id (stable); rows without
    conversation id in the ``NO_CONVERSATION`` bucket, which no conversation's read
    touches. The fast path behind ``write_parquet`` and ``kvobs.synth``. Each file is
    named ``name`` (a compaction's batch), else a new name; it appears whole or not at
    all.
    """
    tagged = pc.is_valid(table.column(_CID))
    untagged = table.filter(pc.invert(tagged))
    if untagged.num_rows:
        _write_bucket(store_dir, NO_CONVERSATION, untagged, name)
    table = table.filter(tagged)
    if table.num_rows == 0:
        return untagged.num_rows
    ids = table.column(_CID).combine_chunks().dictionary_encode()
    names = ids.dictionary
    id_buckets = np.fromiter(
        (bucket_of(cid) for cid in names.to_pylist()), dtype=np.int64, count=len(names)
    )
    id_rank = pc.rank(names, sort_keys="ascending", tiebreaker="first").to_numpy() - 1
    codes = ids.indices.to_numpy(zero_copy_only=False)
    # One stable sort by (bucket, conversation id), then one contiguous slice per bucket.
    key = id_buckets[codes] * len(names) + id_rank[codes].astype(np.int64)
    order = np.argsort(key, kind="stable")
    table = table.combine_chunks().take(pa.array(order))
    buckets = id_buckets[codes][order]
    edges = np.concatenate([[0], np.flatnonzero(np.diff(buckets)) + 1, [len(buckets)]])
    for begin, stop in zip(edges[:-1], edges[1:]):
        bucket = f"bucket={int(buckets[begin]):02d}"
        _write_bucket(store_dir, bucket, table.slice(begin, stop - begin), name)
    return table.num_rows + untagged.num_rows


def _write_bucket(store_dir: str, bucket: str, part: pa.Table, name: str | None) -> None:
    directory = os.path.join(store_dir, COMPACTED_DIR, bucket)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name or uuid.uuid4().hex}.parquet")
    pq.write_table(part, path + ".tmp", row_group_size=ROW_GROUP_SIZE, compression="zstd")
    os.replace(path + ".tmp", path)
    write_turns(store_dir, path, part)


def write_turns(store_dir: str, span_file: str, spans: pa.Table | None = None) -> None:
    """Write the turn rows of one span file, after the span file itself: a span file
    without turns is read from its spans, never the reverse."""
    if spans is None:
        spans = pq.read_table(span_file)
    path = turns_path(store_dir, span_file)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    turns = aggregate(spans)
    with (
        pa.OSFile(path + ".tmp", "wb") as sink,
        pa.ipc.new_file(
            sink, turns.schema, options=pa.ipc.IpcWriteOptions(compression="lz4")
        ) as writer,
    ):
        writer.write_table(turns)
    os.replace(path + ".tmp", path)


def compact(
    store_dir: str, quiet_s: float = QUIET_S, writers_stopped: bool = False
) -> tuple[int, list[str]]:
    """Move the live segments no writer appends to any more into parquet (and their turn
    files). Returns (spans moved, problems). Also writes turn files that older
    compactions did not.

    Taken: rotated-away segments (``segments.is_rotated``: kvobs' sealed ones, the
    Collector's backups), and a kvobs writer's active segment not written for
    ``quiet_s`` seconds, sealed first under its writer's lock. Other files (the
    Collector's open file) are left, read as live, unless ``writers_stopped``.

    Crash-safe and idempotent: a journal names the batch's segments; its parquet is
    written under the batch's name, the segments deleted only once it is whole. A
    compaction that died is finished (or its partial output removed) by the next. Until
    then a span may sit in both places: readers read it once (trace and span id).
    """
    problems: list[str] = []
    lock = os.open(store_dir, os.O_RDONLY)  # one compaction at a time: the directory's
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        return 0, [f"{store_dir}: another compaction is running; nothing done"]
    try:
        _finish_journals(store_dir, problems)
        moved = _compact_live(store_dir, quiet_s, writers_stopped, problems)
        for path in span_files(store_dir):
            if is_regular(path, problems) and existing_turns_path(store_dir, path) is None:
                write_turns(store_dir, path)
    finally:
        os.close(lock)
    return moved, problems


def _compact_live(
    store_dir: str, quiet_s: float, writers_stopped: bool, problems: list[str]
) -> int:
    from kvobs.emit import segments  # compaction only: reading a store never needs it

    live_dir = os.path.join(store_dir, sc.STORE_LIVE_DIR)
    if not os.path.isdir(live_dir):
        return 0
    now = time.time()
    taken, sources, left = [], [], []
    for path in otlp_files(live_dir, problems):
        name = os.path.basename(path)
        take = writers_stopped or segments.is_rotated(name)
        if segments.is_active(name) and (writers_stopped or _quiet(path, now, quiet_s)):
            sealed = segments.seal(path, now)
            if sealed is None:  # sealed by its writer meanwhile: the next compaction's
                continue
            path, take = sealed, True
        if not take:
            left.append(path)
            continue
        try:
            sources.append(_identity(live_dir, path))
        except FileNotFoundError:  # expired by a writer's sweep meanwhile (logged there)
            continue
        taken.append(path)
    if not taken:
        return 0
    batch = uuid.uuid4().hex
    journal = _journal_path(store_dir, batch)
    _write_journal(journal, {"sources": sources, "written": False})
    # The segments left live are read too: a span untagged here takes its conversation
    # from its trace's tagged spans, wherever they sit.
    moved = write_parquet(
        store_dir,
        _spans_of(taken, problems),
        batch,
        _spans_of(left, []) if left else None,
        problems,
    )
    _write_journal(journal, {"sources": sources, "written": True})
    _remove_sources(live_dir, sources)
    os.remove(journal)
    return moved


def _quiet(path: str, now: float, quiet_s: float) -> bool:
    try:
        return now - os.stat(path).st_mtime >= quiet_s
    except FileNotFoundError:
        return False


def _spans_of(paths: list[str], problems: list[str]) -> pa.Table:
    return drop_duplicate_span_rows(
        table_from_rows(row for path in paths for row in read_rows(path, problems)), problems
    )


def _identity(live_dir: str, path: str) -> dict:
    """What a journal keeps of a segment: recovery deletes that very file, never a new
    one given the same name."""
    stat = os.stat(path)
    return {
        "path": os.path.relpath(path, live_dir),
        "inode": stat.st_ino,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
    }


def _remove_sources(live_dir: str, sources: list[dict]) -> None:
    for source in sources:
        path = os.path.join(live_dir, source["path"])
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            continue
        if (stat.st_ino, stat.st_size, stat.st_mtime_ns) == (
            source["inode"],
            source["size"],
            source["mtime_ns"],
        ):
            os.remove(path)


def _journal_path(store_dir: str, batch: str) -> str:
    return os.path.join(store_dir, f"{_JOURNAL}{batch}.json")


def _write_journal(path: str, entry: dict) -> None:
    with open(path + ".tmp", "w") as handle:
        json.dump(entry, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(path + ".tmp", path)


def _finish_journals(store_dir: str, problems: list[str]) -> None:
    """A compaction that died: once its parquet was whole, delete its segments; before,
    delete its partial parquet (the segments are all still there)."""
    live_dir = os.path.join(store_dir, sc.STORE_LIVE_DIR)
    for unfinished in glob.glob(os.path.join(store_dir, f"{_JOURNAL}*.json.tmp")):
        os.remove(unfinished)
    for journal in glob.glob(os.path.join(store_dir, f"{_JOURNAL}*.json")):
        if not is_regular(journal, problems):
            continue
        batch = os.path.basename(journal)[len(_JOURNAL) : -len(".json")]
        try:
            with open(journal) as handle:
                entry = json.load(handle)
        except (OSError, ValueError) as error:
            note(problems, f"{journal}: unreadable compaction journal ({error}); left")
            continue
        if entry["written"]:
            _remove_sources(live_dir, entry["sources"])
        else:
            for directory in (COMPACTED_DIR, TURNS_DIR):
                for path in glob.glob(os.path.join(store_dir, directory, "bucket=*", f"{batch}.*")):
                    os.remove(path)
        os.remove(journal)


class StoreSource:
    """Spans from an embedded store directory (compacted parquet + live segments)."""

    def __init__(self, store_dir: str):
        self.store_dir = store_dir
        self._live = OtlpJsonSource(os.path.join(store_dir, sc.STORE_LIVE_DIR))
        self.problems = self._live.problems

    def _compacted(self, conversation_id: str | None) -> pa.Table:
        columns = list(ALL_DTYPES)
        if conversation_id is None:
            return read_spans(span_files(self.store_dir), self.problems, columns)
        # Buckets partition conversation ids: one bucket's files.
        return read_conversation(
            span_files(self.store_dir, bucket_of(conversation_id)),
            self.problems,
            columns,
            conversation_id,
        )

    def _has_live(self) -> bool:
        """Whether live segments (span files) exist: a compacted store often keeps an
        empty ``spans/`` directory."""
        return os.path.isdir(self._live.location) and bool(
            otlp_files(self._live.location, self.problems)
        )

    def spans(self, conversation_id: str | None = None) -> pd.DataFrame:
        return frame_from_table(self.span_table(conversation_id))

    def span_table(self, conversation_id: str | None = None) -> pa.Table:
        """Compacted spans straight from parquet, and the live segments' (span files)
        after them; a span in both places read once."""
        live = self._live.span_table(conversation_id) if self._has_live() else None
        compacted = self._compacted(conversation_id)
        if live is None or live.num_rows == 0:
            return drop_duplicate_span_rows(compacted, self.problems)
        table = drop_duplicate_span_rows(pa.concat_tables([compacted, live]), self.problems)
        return table if conversation_id is None else select_conversation(table, conversation_id)

    def turn_row_slices(self) -> Iterator[pa.Table]:
        """Mostly from the turn files written at compaction (``_store_turns``), in one
        slice."""
        from kvobs.sources._store_turns import store_turns

        yield store_turns(self.store_dir, self._live, self.problems)

    def conversation_ids(self) -> list[str]:
        ids: set[str] = set()
        # Live first: a segment compacted meanwhile is then found in one place or both.
        if self._has_live():
            ids.update(self._live.conversation_ids())
        table = read_spans(span_files(self.store_dir), self.problems, [_CID])
        ids.update(table.column(_CID).unique().to_pylist())
        ids.discard(None)
        return sorted(ids)
