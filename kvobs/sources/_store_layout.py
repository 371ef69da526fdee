"""Where the embedded store keeps what (kvobs.sources.store describes the layout), shared
by its writer and its turn reader."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvobs import semconv as sc
from kvobs.turns import arrays
from kvobs.sources._decode import is_regular, short
from kvobs.sources._frame import SPAN_SCHEMA, conformed

COMPACTED_DIR = sc.STORE_COMPACTED_DIR
TURNS_DIR = sc.STORE_TURNS_DIR


def store_schema() -> pa.Schema:
    """The Arrow schema of compacted segments (the span table's columns and types)."""
    return SPAN_SCHEMA


def turns_path(store_dir: str, span_file: str, written_by_older_kvobs: bool = False) -> str:
    """The turn file of a compacted span file: Arrow IPC, lz4 (read in 0.19 s where zstd
    parquet took 0.46, for 16 files of 21k turns x 87 columns). Older kvobs versions
    wrote parquet (``written_by_older_kvobs``); a store may have neither."""
    bucket = os.path.basename(os.path.dirname(span_file))
    name = os.path.splitext(os.path.basename(span_file))[0]
    return os.path.join(
        store_dir, TURNS_DIR, bucket, name + (".parquet" if written_by_older_kvobs else ".arrow")
    )


def existing_turns_path(store_dir: str, span_file: str) -> str | None:
    """The turn file a span file has (this version's, else an older one's), or None. A
    FIFO or other non-regular file is none: opening it would block; the span file's
    turns are rebuilt from its spans."""
    for older in (False, True):
        path = turns_path(store_dir, span_file, written_by_older_kvobs=older)
        if os.path.isfile(path):
            return path
    return None


def span_files(store_dir: str, bucket: int | None = None) -> list[str]:
    """The compacted span files (of one bucket), as listed: ``readable`` and
    ``read_or_skip`` leave out (and report) those that are not regular files."""
    compacted = os.path.join(store_dir, COMPACTED_DIR)
    if not os.path.isdir(compacted):
        return []
    buckets = os.listdir(compacted) if bucket is None else [f"bucket={bucket:02d}"]
    return sorted(
        os.path.join(compacted, directory, name)
        for directory in buckets
        if directory.startswith("bucket=") and os.path.isdir(os.path.join(compacted, directory))
        for name in os.listdir(os.path.join(compacted, directory))
        if name.endswith(".parquet")
    )


_PARQUET_MAGIC = b"PAR1"


def readable(files: list[str], problems: list[str], what: str = "span file") -> list[str]:
    """The files that look like whole parquet files (magic number at both ends: an empty,
    truncated or foreign file fails it; a read costs ~7 ms of footer per file, this
    microseconds). Each other one is reported and left out: every command reads the
    rest of the store the same way."""
    good = []
    for path in files:
        if not is_regular(path, problems):
            continue
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


def _scanned(columns: list[str]) -> tuple[pa.Schema, pa.Schema]:
    """The schema of ``columns`` (today's), and what to scan for it: also the keys an
    older kvobs wrote them under (``with_renamed_keys``)."""
    schema = store_schema()
    schema = pa.schema([schema.field(c) for c in columns])
    legacy = {old: new for old, new in sc.RENAMED_KEYS.items() if new in columns}
    return schema, pa.schema(
        [*schema, *(pa.field(old, schema.field(new).type) for old, new in legacy.items())]
    )


def read_conversation(
    files: list[str], problems: list[str], columns: list[str], conversation_id: str
) -> pa.Table:
    """``read_spans`` of the spans tagged with one conversation id, through
    ``pyarrow.parquet`` alone (``pyarrow.dataset`` imports pandas: ``kvobs.turns.arrays``):
    only the row groups whose statistics can hold the id are read."""
    schema, scanned = _scanned(columns)
    cid = sc.CONVERSATION_ID.key
    wanted = arrays.scalar(conversation_id, scanned.field(cid).type)

    def row_groups(parquet: pq.ParquetFile, names: list[str]) -> list[int]:
        if cid not in names:
            return []
        index = names.index(cid)
        picked = []
        for group in range(parquet.num_row_groups):
            stats = parquet.metadata.row_group(group).column(index).statistics
            if (
                stats is None
                or not stats.has_min_max
                or not isinstance(stats.min, str)
                or not isinstance(stats.max, str)
                or stats.min <= conversation_id <= stats.max
            ):
                picked.append(group)
        return picked

    def up_to_last(parquet: pq.ParquetFile, group: int, present: list[str]) -> pa.Table | None:
        """The group's rows up to its last one with the id, None when it has none (its
        statistics only bound the ids): the id column alone is decoded first (~0.6 ms),
        the other ~130 columns only that far (a compacted group of 16,384 rows, sorted
        by id, took ~16 ms whole)."""
        ids = parquet.read_row_group(group, columns=[cid], use_threads=False).column(cid)
        hits = np.flatnonzero(arrays.booleans(arrays.equal(ids.cast(wanted.type), conversation_id)))
        if not len(hits):
            return None
        batches = parquet.iter_batches(
            batch_size=int(hits[-1]) + 1, row_groups=[group], columns=present, use_threads=False
        )
        return pa.Table.from_batches([next(batches)])

    def scan(paths):
        tables = []
        for path in paths:
            parquet = pq.ParquetFile(path)
            # ``schema_arrow`` converts the file's schema on each access (0.1-0.2 ms at
            # ~130 columns): taken once, not once per scanned column.
            names = parquet.schema_arrow.names
            present = [name for name in scanned.names if name in names]
            parts = [
                part
                for group in row_groups(parquet, names)
                if (part := up_to_last(parquet, group, present)) is not None
            ]
            if not parts:
                continue
            read = pa.concat_tables(parts)
            read = read.filter(arrays.equal(read.column(cid).cast(wanted.type), conversation_id))
            tables.append(conformed(read, scanned))
        if not tables:
            return arrays.empty(schema)
        return with_renamed_keys(pa.concat_tables(tables), columns)

    return read_or_skip(files, problems, scan)


def read_spans(
    files: list[str],
    problems: list[str],
    columns: list[str],
    expression=None,
    file_format="parquet",
) -> pa.Table:
    """Columns of compacted span files (today's schema: segments written by an older
    kvobs lack newer attributes, read as null). One dataset when every file reads; else
    file by file, an unreadable one (corrupt, empty, truncated) reported and left out."""
    import pyarrow.dataset as ds  # imports pandas: diagnose reads by read_conversation

    schema, scanned = _scanned(columns)

    def scan(paths):
        if not paths:
            return arrays.empty(schema)
        dataset = ds.dataset(paths, format=file_format, schema=scanned)
        return with_renamed_keys(
            dataset.to_table(columns=scanned.names, filter=expression), columns
        )

    return read_or_skip(files, problems, scan)


def read_or_skip(files: list[str], problems: list[str], scan) -> pa.Table:
    """``scan(files)`` (a table of compacted span files; ``scan([])``: none). When that
    fails, file by file: a file that cannot be read (empty, truncated, corrupt inside)
    is reported and left out, the rest read. The one fallback of every span-file
    reader. A FIFO or other non-regular file is reported and left out first: opening it
    would block."""
    files = [path for path in files if is_regular(path, problems)]
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
    return pa.concat_tables(tables) if tables else scan([])


def with_renamed_keys(table: pa.Table, columns: list[str]) -> pa.Table:
    """``columns`` of ``table``, each filled from the key an older kvobs wrote it under
    (``semconv.RENAMED_KEYS``) where that column is null."""
    for old, new in sc.RENAMED_KEYS.items():
        if old in table.column_names and new in columns:
            filled = pc.coalesce(
                table.column(new), table.column(old).cast(table.schema.field(new).type)
            )
            table = table.set_column(table.column_names.index(new), new, filled)
    return table.select(columns)
