"""The span table every source produces: Arrow, typed by ``SPAN_SCHEMA``.

Span files are read into it by ``table_from_rows``, the one builder of a span table from
decoded rows, without pandas (``kvobs diagnose`` of a span file or of a store's live
segments never loads it: bench/README.md, issue 12). The pandas frame of ``spans()`` is
derived from that table (``frame_from_table``), which imports pandas on use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvobs import semconv as sc
from kvobs.turns import arrays
from kvobs.sources._rows import INT64_MAX, UNUSABLE, coerced

if TYPE_CHECKING:
    import pandas as pd

KIND_DTYPES = {"int": "Int64", "float": "Float64", "bool": "boolean", "str": "string"}
ATTRIBUTE_DTYPES = {a.key: KIND_DTYPES[a.type] for a in sc.ATTRIBUTES.values()}
BASE_DTYPES = {
    "trace_id": "string",
    "span_id": "string",
    "parent_span_id": "string",
    "name": "string",
    "service": "string",
    "start_ns": "Int64",
    "end_ns": "Int64",
    "error": "boolean",
}
ALL_DTYPES = {**BASE_DTYPES, **ATTRIBUTE_DTYPES}
# What each dtype is in Arrow (pandas' own mapping, without building a frame to ask it):
# keyed by dtype, strings large, unlike the turn table's kvobs.turns.correlate.ARROW_TYPES.
DTYPE_ARROW_TYPES = {
    "string": pa.large_string(),
    "Int64": pa.int64(),
    "Float64": pa.float64(),
    "boolean": pa.bool_(),
}
SPAN_SCHEMA = pa.schema(
    [(column, DTYPE_ARROW_TYPES[dtype]) for column, dtype in ALL_DTYPES.items()]
)
_KINDS = {
    column: next(kind for kind, d in KIND_DTYPES.items() if d == dtype)
    for column, dtype in ALL_DTYPES.items()
}
_ARROW_TYPES = [SPAN_SCHEMA.field(column).type for column in ALL_DTYPES]
_NUMPY_KINDS = {"int": np.int64, "float": np.float64, "bool": np.bool_}
_POSITIONS = {column: position for position, column in enumerate(ALL_DTYPES)}
_transpose: Callable[[list, dict, int], list | None] | None
try:  # built by setup.py where a C compiler is; the Python loop otherwise
    from kvobs.sources._columns_native import transpose as _transpose
except ImportError:
    _transpose = None
_PYTHON_KINDS = {"int": int, "float": float, "bool": bool, "str": str}


def empty_spans() -> pd.DataFrame:
    return frame_from_table(table_from_rows([]))


def frame_from_rows(rows: Iterable[dict]) -> pd.DataFrame:
    """``table_from_rows`` as a pandas frame (``frame_from_table``)."""
    return frame_from_table(table_from_rows(rows))


def table_from_rows(rows: Iterable[dict]) -> pa.Table:
    """Rows (dicts keyed by column name, as the decoders yield them) to the span table:
    each value coerced to its column's type on its own (``_rows.coerced``), one it
    cannot use read as null (the decoders report it with its file:line); keys of no
    column dropped. A proxy turn span without conversation id gets
    ``anonymous:<trace id>`` (``_name_anonymous``)."""
    rows = rows if type(rows) is list else list(rows)
    found = _spread(rows)
    count = len(rows)
    usable = {column: _usable(at, values, _KINDS[column]) for column, (at, values) in found.items()}
    _name_anonymous(usable)
    return pa.Table.from_arrays(
        [
            _column(*usable[column], _KINDS[column], count, type)
            for column, type in zip(ALL_DTYPES, _ARROW_TYPES)
        ],
        schema=SPAN_SCHEMA,
    )


def _spread(rows: list) -> dict[str, tuple[list[int], list]]:
    """Each column's rows (their indexes) and values: a row's value under its key's
    column, where the key is a column's and the value not None. The compiled loop
    (``_columns_native.transpose``) where it is built and every row is a dict."""
    if _transpose is not None:
        spread = _transpose(rows, _POSITIONS, len(_POSITIONS))
        if spread is not None:
            return dict(zip(ALL_DTYPES, spread))
    found: dict[str, tuple[list[int], list]] = {column: ([], []) for column in ALL_DTYPES}
    for index, row in enumerate(rows):
        for key, value in row.items():
            slot = found.get(key)
            if slot is not None and value is not None:
                slot[0].append(index)
                slot[1].append(value)
    return found


def conformed(table: pa.Table, schema: pa.Schema = SPAN_SCHEMA) -> pa.Table:
    """``table`` (span columns under whatever Arrow types its reader gave them: a
    ClickHouse query's result, a parquet file an older kvobs wrote) as ``schema``: each
    column cast to its type, a column it lacks all null, others dropped. The typing
    ``table_from_rows`` gives span files, for every other reader."""
    names = set(table.column_names)  # built anew at each call: 0.2 ms for 87 columns
    return pa.table(
        [
            arrays.as_type(table.column(field.name), field.type)  # most have it already
            if field.name in names
            else pa.nulls(table.num_rows, field.type)
            for field in schema
        ],
        schema=schema,
    )


def _usable(at: list[int], values: list, kind: str) -> tuple[list[int], list]:
    """The rows' values as ``kind``, those it cannot use left out."""
    if _already(values, kind):
        return at, values
    kept_at, kept = [], []
    for row, value in zip(at, values):
        try:
            kept.append(coerced(value, kind))
        except UNUSABLE:
            continue
        kept_at.append(row)
    return kept_at, kept


def _already(values: list, kind: str) -> bool:
    """Whether every value is already what ``coerced`` makes of it (the decoders' rows
    are coerced): one pass over the column instead of a call per value."""
    if not set(map(type, values)) <= {_PYTHON_KINDS[kind]}:
        return False
    if kind == "str":  # an ASCII string cannot hold a lone surrogate
        return "".join(values).isascii()
    if kind == "int":
        return not values or -INT64_MAX <= min(values) and max(values) <= INT64_MAX
    if kind == "float":
        return bool(np.isfinite(np.array(values, np.float64)).all())
    return True


def _column(at: list[int], values: list, kind: str, count: int, type: pa.DataType) -> pa.Array:
    """One column of ``count`` rows: ``values`` at rows ``at`` (ascending), null
    elsewhere, as ``type``. A column with no value (most of ~130 in any batch of spans)
    or with one on every row is built without spreading: that per-column work was most
    of a small batch's conversion (the live classifier converts each pass's new spans)."""
    if not at:
        return pa.nulls(count, type)
    full = len(at) == count  # ascending and distinct: every row, in order
    rows = None if full else np.array(at, np.int64)
    if kind == "str":
        text = "".join(values)
        if text.isascii() and type == pa.large_string():
            return _ascii_column(values, text, rows, count)
        if full:
            return arrays.strings(values).cast(type)
        where = np.full(count, -1, np.int64)
        where[rows] = np.arange(len(at))
        return arrays.strings(values).take(arrays.array(where, mask=where < 0)).cast(type)
    dtype = _NUMPY_KINDS[kind]
    if rows is None:
        return arrays.array(np.array(values, dtype)).cast(type)
    data: np.ndarray = np.zeros(count, dtype)
    data[rows] = np.array(values, dtype)
    missing = np.ones(count, bool)
    missing[rows] = False
    return arrays.array(data, mask=missing).cast(type)


def _ascii_column(values: list[str], text: str, rows: np.ndarray | None, count: int) -> pa.Array:
    """ASCII strings at ``rows`` (None: every row) as a large string column: a byte a
    character, so the lengths are the offsets' steps; the buffers are written in place
    (not built as strings, spread by a take and cast: ~90 ns a value, a fifth of a span's
    conversion)."""
    sizes = np.fromiter(map(len, values), np.int64, len(values))
    validity, nulls = None, 0
    if rows is not None:
        spread = np.zeros(count, np.int64)
        spread[rows] = sizes
        sizes = spread
        present = np.zeros(count, bool)
        present[rows] = True
        validity, nulls = pa.py_buffer(np.packbits(present, bitorder="little")), count - len(values)
    offsets = np.zeros(count + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return pa.Array.from_buffers(
        pa.large_string(),
        count,
        [validity, pa.py_buffer(offsets), pa.py_buffer(text.encode())],
        null_count=nulls,
    )


def _name_anonymous(usable: dict[str, tuple[list[int], list]]) -> None:
    """A turn sent without a conversation id is still a turn: its proxy turn span gets
    the conversation id ``anonymous:<trace id>`` (the id the proxy's answer header gave)."""
    cid = sc.CONVERSATION_ID.key
    turns = {row for row, name in zip(*usable["name"]) if name == sc.SPAN_PROXY_TURN.name}
    if not turns:
        return
    tagged = set(usable[cid][0])
    named = [
        (row, sc.ANONYMOUS_PREFIX + trace)
        for row, trace in zip(*usable["trace_id"])
        if row in turns and row not in tagged
    ]
    if named:
        merged = sorted([*zip(*usable[cid]), *named])
        usable[cid] = ([row for row, _ in merged], [value for _, value in merged])


def frame_from_table(table: pa.Table) -> pd.DataFrame:
    """An Arrow span table (``span_table()``, a store's parquet) as ``spans()`` types it."""
    import pandas as pd  # on use: see the module's doc

    # Straight to the span table's dtypes: through pd.ArrowDtype and astype, column by
    # column, it cost ~20 ms of a one-conversation read (~130 columns); 4 ms this way.
    dtypes = {arrow: pd.api.types.pandas_dtype(dtype) for dtype, arrow in DTYPE_ARROW_TYPES.items()}
    dtypes[pa.string()] = dtypes[pa.large_string()]
    frame = table.to_pandas(types_mapper=lambda arrow: dtypes.get(arrow, pd.ArrowDtype(arrow)))
    return frame.astype(
        {
            column: ALL_DTYPES[column]
            for column in frame.columns
            if column in ALL_DTYPES and frame[column].dtype != ALL_DTYPES[column]
        }
    )


def repeated_spans(trace_ids, span_ids) -> np.ndarray:
    """Mask of the rows that repeat an earlier row's (trace id, span id): a span
    delivered twice (an exporter's retry, a copied file) would otherwise count twice
    (recomputed tokens are summed per turn). Rows without span id are never repeats."""
    key = pc.binary_join_element_wise(
        pc.fill_null(pa.chunked_array(trace_ids).cast(pa.string()), arrays.scalar("", pa.string())),
        pa.chunked_array(span_ids).cast(pa.string()),
        arrays.scalar("/", pa.string()),
    )
    codes = arrays.numbers(key.combine_chunks().dictionary_encode().indices, fill=-1)
    order = np.argsort(codes, kind="stable")
    ordered = codes[order]
    repeated = np.zeros(len(codes), dtype=bool)
    repeated[order[1:][(ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)]] = True
    return repeated


def drop_duplicate_span_rows(table: pa.Table, problems: list[str]) -> pa.Table:
    """One row per (trace id, span id) (``repeated_spans``), the repeats reported."""
    if table.num_rows == 0:
        return table
    repeated = repeated_spans(table.column("trace_id"), table.column("span_id"))
    if repeated.any():
        problems.append(
            f"{int(repeated.sum())} duplicate span(s) (same trace and span id) read once"
        )
        return table.filter(arrays.array(~repeated))
    return table


def select_conversation(table: pa.Table, conversation_id: str) -> pa.Table:
    """Spans tagged with the conversation, plus every span of its traces: a trace may
    hold other conversations' turns too (a client's, which the proxy continues), and
    their tagged spans tell correlate whose an untagged span is (without them, every
    untagged span of the trace would look like this conversation's). As ClickHouse's
    ``span_table`` selects."""
    ids = table.column(sc.CONVERSATION_ID.key)
    tagged = arrays.equal(ids, conversation_id)
    traces = pc.unique(table.column("trace_id").filter(tagged)).drop_null()
    return table.filter(pc.or_(tagged, pc.is_in(table.column("trace_id"), value_set=traces)))
