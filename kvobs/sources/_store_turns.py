"""The embedded store's turn rows, mostly read from the turn files written at compaction.

A turn file holds ``aggregate`` of one compacted span file, so it is the whole truth only
for a conversation whose spans all sit in that file. A conversation also found in
another compacted file (a turn's release compacted later, a conversation spanning
compactions), among live spans, or in a span file without turn file is rebuilt from all
its spans; the result equals ``aggregate`` over every span of the store.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from kvobs import semconv as sc
from kvobs.turns import arrays, lineage
from kvobs.turns.correlate import aggregate, needs_lineage, plain, ranked, span_columns
from kvobs.sources._decode import short
from kvobs.sources._frame import conformed, drop_duplicate_span_rows
from kvobs.sources._store_layout import (
    note,
    read_or_skip,
    readable,
    span_files,
    store_schema,
    existing_turns_path,
    with_renamed_keys,
)
from kvobs.turns.schema import KEY_SOURCES

_TENANT, _CID = KEY_SOURCES["tenant"], KEY_SOURCES["conversation_id"]

_READ_AS_DICTIONARY = ["tenant", "conversation_id"]


def _live_spans(live, columns: list[str]) -> pa.Table | None:
    if not os.path.isdir(live.location):
        return None
    table = live.span_table()
    if table.num_rows == 0:
        return None
    if needs_lineage(table):  # id-less turns: conversations from chains
        table = lineage.link(table)
    schema = store_schema()
    return table.select(columns).cast(pa.schema([schema.field(c) for c in columns]))


def _compacted_spans(
    files: list[str], columns: list[str], cids: pa.Array | None, problems: list[str]
) -> pa.Table:
    """``_scan_spans``, unreadable files reported and left out (``read_or_skip``)."""
    return read_or_skip(
        files, problems, lambda paths: _scan_spans(paths, columns, cids)
    ).unify_dictionaries()


def _scan_spans(files: list[str], columns: list[str], cids: pa.Array | None) -> pa.Table:
    schema = pa.schema([store_schema().field(c) for c in columns])
    if not files:
        return arrays.empty(schema)
    # Keys and names as dictionaries straight from parquet: never 10M separate strings.
    file_format = ds.ParquetFileFormat(
        read_options=ds.ParquetReadOptions(dictionary_columns={_TENANT, _CID, "name"})
    )
    dataset = ds.dataset(files, format=file_format)
    legacy = [
        old
        for old, new in sc.RENAMED_KEYS.items()
        if new in columns and old in dataset.schema.names
    ]
    present = [c for c in columns if c in dataset.schema.names]
    table = dataset.to_table(
        columns=present + legacy, filter=None if cids is None else ds.field(_CID).isin(cids)
    )
    for column in columns:
        if column not in present:
            table = table.append_column(column, pa.nulls(table.num_rows, schema.field(column).type))
    return with_renamed_keys(table, columns).unify_dictionaries()


def store_turns(store_dir: str, live_source, problems: list[str]) -> pa.Table:
    """Turn rows (before ``derive``) of a store directory and its live segments (a
    ``SpanSource``), one row per turn (``SpanSource.turn_row_slices``); unreadable
    files reported in ``problems``."""
    columns = span_columns() + ["trace_id", "span_id", "parent_span_id"]
    live = _live_spans(live_source, columns)
    files = readable(span_files(store_dir), problems)
    turn_paths = {f: existing_turns_path(store_dir, f) for f in files}
    if live is not None and pc.any(pc.is_null(live.column(_CID))).as_py():
        # A live span without conversation may belong to any compacted trace.
        spans = plain(_compacted_spans(files, columns, None, problems)).cast(live.schema)
        return aggregate(drop_duplicate_span_rows(pa.concat_tables([spans, live]), problems))
    turn_files = {f: _turn_file(path, problems) for f, path in turn_paths.items() if path}
    indexed = [f for f in files if turn_files.get(f) is not None]
    unindexed = [f for f in files if turn_files.get(f) is None]
    turns = [turn_files[f] for f in indexed]
    rebuild = [pa.chunked_array([], pa.string())]
    if unindexed:
        rebuild.append(_compacted_spans(unindexed, [_CID], None, problems).column(_CID))
    if live is not None:
        rebuild.append(live.column(_CID))
    # Buckets partition conversation ids: only a bucket with several files can split one.
    by_bucket: dict[str, list[pa.Table]] = {}
    for path, table in zip(indexed, turns):
        by_bucket.setdefault(os.path.dirname(path), []).append(table)
    rebuild.extend(_split(tables) for tables in by_bucket.values() if len(tables) > 1)
    # Spans of no conversation (``store.NO_CONVERSATION``) are in no turn: never read with
    # some conversations' spans, which would make their trace look like it held one.
    cids = pc.unique(
        pa.chunked_array(
            [chunk for c in rebuild for chunk in c.cast(pa.string()).chunks], pa.string()
        ).combine_chunks()
    ).drop_null()
    kept = [_without(t, cids) for t in turns] if len(cids) else turns
    if len(cids):
        spans = _compacted_spans(files, columns, cids, problems)
        if live is not None:
            spans = pa.concat_tables([plain(spans).cast(live.schema), live])
        # A span in two files (a retried export compacted twice, a copied file) counts once.
        kept.append(aggregate(drop_duplicate_span_rows(spans, problems)))
    # Keys as dictionaries, as parquet reads them: no 1.35M ids decoded to conform a file.
    schema = aggregate(_scan_spans([], columns, None)).schema
    # No conversation is in two of these tables (split ones were rebuilt from their
    # spans): concatenated, each turn is one row, which is all the turn table needs (a
    # global sort of the 1.35M x 87 rows of a 270k-conversation fleet cost more than
    # reading them); each table sorted, derive finds its rows in order.
    if not kept:
        return arrays.empty(schema)
    return pa.concat_tables([conformed(t, schema) for t in kept]).unify_dictionaries()


def _turn_file(path: str, problems: list[str]) -> pa.Table | None:
    """A span file's turn rows, or None (no turn file, or one that cannot be read:
    reported; its turns are then rebuilt from its spans, nothing lost)."""
    try:
        if path.endswith(".parquet"):  # an older kvobs's
            return pq.read_table(path, read_dictionary=_READ_AS_DICTIONARY)
        with pa.OSFile(path) as source:
            return pa.ipc.open_file(source).read_all()
    except (pa.ArrowException, OSError) as error:
        note(
            problems,
            f"{path}: unreadable turn file ({short(error)}); its turns rebuilt from its span file",
        )
        return None


def _split(turns: list[pa.Table]) -> pa.ChunkedArray:
    """Conversation ids found in more than one turn file."""
    ids = pa.chunked_array([t.column("conversation_id").cast(pa.string()) for t in turns])
    codes, names = ranked(ids)
    lengths = np.array([t.num_rows for t in turns])
    pairs = np.unique(codes * len(turns) + np.repeat(np.arange(len(turns)), lengths))
    files_per_id = np.bincount(pairs // len(turns), minlength=len(names))
    return pa.chunked_array([pa.array(names[files_per_id > 1], pa.string())])


def _without(turns: pa.Table, cids: pa.Array) -> pa.Table:
    ids = turns.column("conversation_id").cast(pa.string())
    return turns.filter(pc.invert(pc.is_in(ids, value_set=cids)))
