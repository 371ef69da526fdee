"""The embedded store: what kvobs components write to when no collector is configured.

Layout of a store directory::

    spans/*.otlp.jsonl          live segments, OTLP-JSON lines appended by the emitters
    compacted/bucket=NN/*.parquet  columnar segments, one column per semconv attribute,
                                rows sorted by conversation id, hash-partitioned by it
    turns/bucket=NN/*.parquet   the turn rows of the span file of the same name
                                (``kvobs.fleet``'s per-turn aggregate), so a fleet report
                                reads turns, not spans

``compact()`` turns live segments into parquet. Reading one conversation touches one
bucket and, thanks to the sort, few row groups: that keeps ``diagnose`` fast at fleet
scale.
"""

from __future__ import annotations

import functools
import os
import uuid
import zlib

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from kvobs import lineage, semconv as sc
from kvobs.sources._decode import short
from kvobs.sources._frame import (ALL_DTYPES, drop_duplicate_spans, frame_from_rows,
                                  select_conversation)
from kvobs.sources.otlp_json import OtlpJsonSource

COMPACTED_DIR = sc.STORE_COMPACTED_DIR
TURNS_DIR = sc.STORE_TURNS_DIR
BUCKETS = 64
ROW_GROUP_SIZE = 16384
_CID = sc.CONVERSATION_ID.key


def is_store(path: str) -> bool:
    return any(os.path.isdir(os.path.join(path, sub)) for sub in (sc.STORE_LIVE_DIR, COMPACTED_DIR))


def bucket_of(conversation_id: str) -> int:
    return zlib.crc32(conversation_id.encode()) % BUCKETS


def _inherit_conversation(frame: pd.DataFrame) -> pd.DataFrame:
    """Untagged spans take the conversation (and turn) of their trace's tagged spans."""
    tagged = frame.dropna(subset=[_CID]).drop_duplicates("trace_id")
    by_trace = tagged.set_index("trace_id")
    missing = frame[_CID].isna() & frame["trace_id"].isin(by_trace.index)
    if missing.any():
        frame = frame.copy()
        traces = frame.loc[missing, "trace_id"]
        frame.loc[missing, _CID] = traces.map(by_trace[_CID]).astype("string").to_numpy()
        turn = sc.TURN_INDEX.key
        frame.loc[missing, turn] = traces.map(by_trace[turn]).astype("Int64").to_numpy()
    return frame


@functools.lru_cache(maxsize=1)
def store_schema() -> pa.Schema:
    """The Arrow schema of compacted segments (the span table's columns and types).
    Cached: building it takes an empty span table (~0.1-0.3 s), and readers ask per
    column."""
    return pa.Schema.from_pandas(frame_from_rows([]), preserve_index=False)


def write_parquet(store_dir: str, frame: pd.DataFrame) -> int:
    """Append a span table to the compacted segments; returns rows written."""
    if lineage.needed(frame):  # id-less turns (another router): name them before the
        frame = lineage.link(frame)  # id-less spans would be dropped below
    frame = _inherit_conversation(frame).dropna(subset=[_CID])
    if frame.empty:
        return 0
    table = pa.Table.from_pandas(frame, schema=store_schema(), preserve_index=False)
    return write_table(store_dir, table)


def write_table(store_dir: str, table: pa.Table) -> int:
    """Append an Arrow span table (``store_schema()``, every row tagged with a conversation
    id) to the compacted segments: one file per bucket touched, rows sorted by
    conversation id (stable). The fast path behind ``write_parquet`` and ``kvobs.synth``.
    """
    table = table.filter(pc.is_valid(table.column(_CID)))
    if table.num_rows == 0:
        return 0
    ids = table.column(_CID).combine_chunks().dictionary_encode()
    names = ids.dictionary
    id_buckets = np.fromiter((bucket_of(cid) for cid in names.to_pylist()),
                             dtype=np.int64, count=len(names))
    id_rank = pc.rank(names, sort_keys="ascending", tiebreaker="first").to_numpy() - 1
    codes = ids.indices.to_numpy(zero_copy_only=False)
    # One stable sort by (bucket, conversation id), then one contiguous slice per bucket.
    key = id_buckets[codes] * len(names) + id_rank[codes].astype(np.int64)
    order = np.argsort(key, kind="stable")
    table = table.combine_chunks().take(pa.array(order))
    buckets = id_buckets[codes][order]
    edges = np.concatenate([[0], np.flatnonzero(np.diff(buckets)) + 1, [len(buckets)]])
    for begin, stop in zip(edges[:-1], edges[1:]):
        bucket = int(buckets[begin])
        part = table.slice(begin, stop - begin)
        directory = os.path.join(store_dir, COMPACTED_DIR, f"bucket={bucket:02d}")
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{uuid.uuid4().hex}.parquet")
        pq.write_table(part, path, row_group_size=ROW_GROUP_SIZE, compression="zstd")
        write_turns(store_dir, path, part)
    return table.num_rows


def turns_path(store_dir: str, span_file: str) -> str:
    """The turn file of a compacted span file (it may not exist: older stores)."""
    bucket = os.path.basename(os.path.dirname(span_file))
    return os.path.join(store_dir, TURNS_DIR, bucket, os.path.basename(span_file))


def write_turns(store_dir: str, span_file: str, spans: pa.Table | None = None) -> None:
    """Write the turn rows of one span file, after the span file itself: a span file
    without turns is read from its spans, never the reverse."""
    from kvobs.fleet._turns import aggregate

    if spans is None:
        spans = pq.read_table(span_file)
    path = turns_path(store_dir, span_file)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(aggregate(spans), path + ".tmp", compression="zstd")
    os.replace(path + ".tmp", path)


def span_files(store_dir: str, bucket: int | None = None) -> list[str]:
    """The compacted span files (of one bucket)."""
    compacted = os.path.join(store_dir, COMPACTED_DIR)
    if not os.path.isdir(compacted):
        return []
    buckets = (os.listdir(compacted) if bucket is None else [f"bucket={bucket:02d}"])
    return sorted(os.path.join(compacted, directory, name)
                  for directory in buckets if directory.startswith("bucket=")
                  and os.path.isdir(os.path.join(compacted, directory))
                  for name in os.listdir(os.path.join(compacted, directory))
                  if name.endswith(".parquet"))


_PARQUET_MAGIC = b"PAR1"


def readable(files: list[str], problems: list[str], what: str = "span file"
             ) -> list[str]:
    """The files that look like whole parquet files (magic number at both ends: an empty,
    truncated or foreign file fails it; a read costs ~7 ms of footer per file, this
    microseconds). Each other one is reported and left out: every command reads the
    rest of the store the same way."""
    good = []
    for path in files:
        try:
            with open(path, "rb") as handle:
                head = handle.read(len(_PARQUET_MAGIC))
                handle.seek(0, os.SEEK_END)
                size = handle.tell()
                handle.seek(max(size - len(_PARQUET_MAGIC), 0))
                tail = handle.read()
        except OSError as error:
            note(problems, f"{path}: skipped unreadable {what} ({error.strerror})")
            continue
        if size < 3 * len(_PARQUET_MAGIC) or head != _PARQUET_MAGIC or tail != _PARQUET_MAGIC:
            why = "empty" if size == 0 else "not a whole parquet file"
            note(problems, f"{path}: skipped unreadable {what} ({why})")
            continue
        good.append(path)
    return good


def note(problems: list[str], problem: str) -> None:
    """Report a problem once, however often the store is read."""
    if problem not in problems:
        problems.append(problem)


def read_spans(files: list[str], problems: list[str], columns: list[str],
               expression=None, file_format="parquet") -> pa.Table:
    """Columns of compacted span files (today's schema: segments written by an older
    kvobs lack newer attributes, read as null). One dataset when every file reads; else
    file by file, an unreadable one (corrupt, empty, truncated) reported and left out."""
    schema = store_schema()
    schema = pa.schema([schema.field(c) for c in columns])

    def scan(paths):
        if not paths:
            return schema.empty_table()
        dataset = ds.dataset(paths, format=file_format, schema=schema)
        return dataset.to_table(columns=columns, filter=expression)
    try:
        return scan(files)
    except (pa.ArrowException, OSError):
        pass
    tables = []
    for path in readable(files, problems):
        try:
            tables.append(scan([path]))
        except (pa.ArrowException, OSError) as error:
            note(problems, f"{path}: skipped unreadable span file ({short(error)})")
    return pa.concat_tables(tables) if tables else schema.empty_table()


def compact(store_dir: str) -> tuple[int, list[str]]:
    """Move live OTLP-JSON segments into parquet (and their turn files). Returns (spans
    moved, problems). Also writes turn files that older compactions did not.

    A live file is deleted only after its rows are safely written: nothing is lost.
    """
    live_dir = os.path.join(store_dir, sc.STORE_LIVE_DIR)
    moved, problems = 0, []
    if os.path.isdir(live_dir):
        source = OtlpJsonSource(live_dir)
        frame = source.spans()
        files = [os.path.join(live_dir, name) for name in os.listdir(live_dir)]
        moved = write_parquet(store_dir, frame)
        for path in files:
            os.remove(path)
        problems = source.problems
    for path in span_files(store_dir):
        if not os.path.exists(turns_path(store_dir, path)):
            write_turns(store_dir, path)
    return moved, problems


class StoreSource:
    """Spans from an embedded store directory (compacted parquet + live segments)."""

    def __init__(self, store_dir: str):
        self.store_dir = store_dir
        self._live = OtlpJsonSource(os.path.join(store_dir, sc.STORE_LIVE_DIR))
        self.problems = self._live.problems

    def _compacted(self, conversation_id: str | None) -> pd.DataFrame:
        columns = list(ALL_DTYPES)
        if conversation_id is None:
            files = span_files(self.store_dir)
            table = read_spans(files, self.problems, columns)
        else:  # buckets partition conversation ids: one bucket's files
            files = span_files(self.store_dir, bucket_of(conversation_id))
            table = read_spans(files, self.problems, columns,
                               ds.field(_CID) == conversation_id)
        return table.to_pandas(types_mapper=pd.ArrowDtype).astype(ALL_DTYPES)

    def spans(self, conversation_id: str | None = None) -> pd.DataFrame:
        live = self._live.spans(conversation_id) if os.path.isdir(self._live.location) else None
        compacted = self._compacted(conversation_id)
        if live is None or live.empty:
            return drop_duplicate_spans(compacted, self.problems)
        frame = drop_duplicate_spans(pd.concat([compacted, live], ignore_index=True),
                                     self.problems)
        return frame if conversation_id is None else select_conversation(frame, conversation_id)

    def conversation_ids(self) -> list[str]:
        ids: set[str] = set()
        table = read_spans(span_files(self.store_dir), self.problems, [_CID])
        ids.update(table.column(_CID).unique().to_pylist())
        if os.path.isdir(self._live.location):
            ids.update(self._live.conversation_ids())
        ids.discard(None)
        return sorted(ids)
