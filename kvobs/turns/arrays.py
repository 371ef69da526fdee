"""numpy <-> Arrow without pyarrow's pandas check.

pyarrow (26) imports pandas, whenever it is installed, on its first conversion from or
to Python or numpy values (``pa.array``, ``pa.scalar``, ``Array.to_numpy``, a compute
call given a Python literal): ~0.4 s that ``kvobs diagnose`` of one conversation would
otherwise spend on a library it never uses (bench/README.md, issue 12). Arrays here are
built from their buffers (``pa.Array.from_buffers``) and read through them
(``np.frombuffer``), which pyarrow converts nothing for. The diagnose path converts
only through this module.
"""

from __future__ import annotations

from typing import Any, Iterable, TypeVar, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = [
    "array",
    "strings",
    "scalar",
    "equal",
    "empty",
    "numbers",
    "booleans",
    "values",
    "from_values",
    "text",
    "as_type",
    "has_column",
    "column_index",
    "codes",
    "value_where",
    "NONE",
    "KIND_TYPES",
    "FALSE",
]

AnyArray = TypeVar("AnyArray", pa.Array, pa.ChunkedArray)

# The Arrow type of each value kind of kvobs.semconv's attributes and the turn columns.
KIND_TYPES = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "str": pa.string()}

_NUMPY_TYPES = {
    pa.int8(): np.int8,
    pa.int16(): np.int16,
    pa.int32(): np.int32,
    pa.int64(): np.int64,
    pa.uint8(): np.uint8,
    pa.uint16(): np.uint16,
    pa.uint32(): np.uint32,
    pa.uint64(): np.uint64,
    pa.float32(): np.float32,
    pa.float64(): np.float64,
}
_ARROW_TYPES = {np.dtype(numpy): arrow for arrow, numpy in _NUMPY_TYPES.items()}
# None as an object array: numpy's stubs refuse a bare None as ``np.where``'s operand.
NONE = np.array(None, object)


def value_where(mask: Any, value: str) -> np.ndarray:
    """``value`` where ``mask`` holds, None elsewhere (an object array)."""
    return np.where(mask, value, NONE)


def _bits(flags: np.ndarray) -> pa.Buffer:
    return pa.py_buffer(np.packbits(np.asarray(flags, bool), bitorder="little"))


def array(
    values: np.ndarray, type: pa.DataType | None = None, mask: np.ndarray | None = None
) -> pa.Array:
    """A numeric or boolean numpy array as Arrow (``type``: its own dtype's when not
    given), null where ``mask`` is true. Object arrays of strings: ``strings``."""
    values = np.asarray(values)
    if values.dtype == object:
        return strings(
            values.tolist()
            if mask is None
            else [None if m else v for v, m in zip(values.tolist(), mask)]
        )
    n = len(values)
    validity, nulls = None, 0
    if mask is not None and np.any(mask):
        validity, nulls = _bits(~np.asarray(mask, bool)), int(np.count_nonzero(mask))
    if type is None:
        type = pa.bool_() if values.dtype == bool else _ARROW_TYPES[values.dtype]
    if pa.types.is_boolean(type):
        data = _bits(values)
    else:
        data = pa.py_buffer(np.ascontiguousarray(values, _NUMPY_TYPES[type]))
    return pa.Array.from_buffers(type, n, [validity, data], null_count=nulls)


def strings(items: Iterable[str | None]) -> pa.Array:
    """Python strings (None: null) as an Arrow string array."""
    items = list(items)
    offsets = np.zeros(len(items) + 1, np.int32)
    if set(map(type, items)) <= {str}:  # no null, every item a str
        texts = cast("list[str]", items)
        text = "".join(texts)
        if text.isascii():  # a byte a character: encoded once, lengths are the offsets
            np.cumsum(np.fromiter(map(len, texts), np.int32, len(texts)), out=offsets[1:])
            return pa.Array.from_buffers(
                pa.string(), len(items), [None, pa.py_buffer(offsets), pa.py_buffer(text.encode())]
            )
    encoded = [
        b"" if item is None else str(item).encode("utf-8", "surrogatepass") for item in items
    ]
    np.cumsum([len(item) for item in encoded], out=offsets[1:])
    missing = np.array([item is None for item in items], bool)
    validity = _bits(~missing) if missing.any() else None
    return pa.Array.from_buffers(
        pa.string(),
        len(items),
        [validity, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))],
        null_count=int(missing.sum()),
    )


def from_values(items: Iterable[Any], type: pa.DataType) -> pa.Array:
    """Python values (None: null) as an Arrow array of ``type`` (a string, integer, float
    or boolean type): ``pa.array`` of a list would import pandas."""
    items = list(items)
    if pa.types.is_string(type):
        return strings(items)
    missing = np.array([item is None for item in items], bool)
    dtype = bool if pa.types.is_boolean(type) else _NUMPY_TYPES[type]
    filled = np.array([0 if item is None else item for item in items], dtype)
    return array(filled, type, mask=missing)


def scalar(value: Any, type: pa.DataType) -> pa.Scalar:
    """A typed Arrow scalar (a compute call's literal: a Python one would import pandas)."""
    if pa.types.is_string(type) or pa.types.is_large_string(type):
        return strings([value]).cast(type)[0]
    return array(np.array([value]), type)[0]


FALSE = scalar(False, pa.bool_())


def equal(values: pa.Array | pa.ChunkedArray, value: Any) -> pa.Array | pa.ChunkedArray:
    """Per row whether it holds ``value`` (typed as the column; a null row: false): a
    mask for ``filter``."""
    return pc.fill_null(pc.equal(values, scalar(value, values.type)), FALSE)


def empty(schema: pa.Schema) -> pa.Table:
    """A table of no rows (``Schema.empty_table`` imports pandas)."""
    return pa.Table.from_batches([], schema=schema)


def _one(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        return values.combine_chunks() if values.num_chunks != 1 else values.chunk(0)
    return values


def _valid(values: pa.Array) -> np.ndarray | None:
    """Per row whether it has a value; None when every row has."""
    if values.null_count == 0:
        return None
    bitmap = values.buffers()[0]
    bits = np.unpackbits(np.frombuffer(bitmap, np.uint8), bitorder="little")
    return bits[values.offset : values.offset + len(values)].astype(bool)


def numbers(values: pa.Array | pa.ChunkedArray, fill: float | int | None = None) -> np.ndarray:
    """A numeric column as numpy in its own dtype; null rows read ``fill`` (when not
    given and some row is null: float64 with NaN, as ``to_numpy`` reads it)."""
    values = _one(values)
    dtype = _NUMPY_TYPES[values.type]
    data = np.frombuffer(values.buffers()[1], dtype)[values.offset : values.offset + len(values)]
    valid = _valid(values)
    if valid is None:
        return data.copy()
    if fill is None:
        out = data.astype(np.float64)
        out[~valid] = np.nan
    else:
        out = data.copy()
        out[~valid] = fill
    return out


def booleans(values: pa.Array | pa.ChunkedArray, fill: bool = False) -> np.ndarray:
    """A boolean column as numpy; null rows read ``fill``."""
    values = _one(values)
    bits = np.unpackbits(np.frombuffer(values.buffers()[1], np.uint8), bitorder="little")
    out = bits[values.offset : values.offset + len(values)].astype(bool)
    valid = _valid(values)
    if valid is not None:
        out[~valid] = fill
    return out


def values(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Any column as an object array of Python values (None: null)."""
    out = np.empty(len(column), dtype=object)
    out[:] = pylist(column)
    return out


def pylist(column: pa.Array | pa.ChunkedArray) -> list:
    """A column's values as Python objects (None: null), ``to_pylist``'s. A dictionary
    column is decoded first: its own ``to_pylist`` goes through the dictionary an item
    at a time (~3 us an item, 25 times the decoded column's; the turn table's tenant and
    conversation id are read so for every turn a pass classifies)."""
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    return column.to_pylist()


def has_column(table: pa.Table, column: str) -> bool:
    """Whether ``table`` has ``column``, by the schema's index: ``column_names`` makes a
    Python string of every field's name at each read (0.13 ms for ~140 columns, the
    most of a few spans' pass)."""
    return bool(table.schema.get_all_field_indices(column))


def column_index(table: pa.Table, column: str) -> int:
    """The position of ``table``'s (first) column ``column`` (``has_column``: without
    ``column_names``)."""
    return table.schema.get_all_field_indices(column)[0]


def text(table: pa.Table, column: str) -> pa.ChunkedArray:
    """A table's column as plain strings (dictionaries decoded; all null when the table
    lacks it): one type for compute calls and value sets."""
    if not has_column(table, column):
        return pa.chunked_array([pa.nulls(table.num_rows, pa.string())])
    values = table.column(column)
    if pa.types.is_dictionary(values.type):
        values = values.cast(values.type.value_type)
    return as_type(values, pa.string())


def as_type(values: AnyArray, kind: pa.DataType, safe: bool = True) -> AnyArray:
    """``values`` cast to ``kind``, without a cast call when they are of it already (a
    call costs ~15 us: per column and pass, more than a few turns' values)."""
    return values if values.type == kind else values.cast(kind, safe=safe)


def codes(column: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, int]:
    """Per row a code of its value (null: a code of its own), and how many codes: numpy
    groups by them where ``Table.group_by`` would import pandas (through pyarrow.dataset)."""
    encoded = pc.dictionary_encode(_one(column), null_encoding="encode")
    return numbers(encoded.indices).astype(np.int64), len(encoded.dictionary)


_MIX = np.uint64(0x9E3779B97F4A7C15)


def row_hashes(table: pa.Table) -> np.ndarray:
    """A 64-bit hash of each row over every column: rows that differ in any value hash
    apart but for a chance of 2**-64. Strings hash as Python's ``hash`` does, salted per
    process: compare hashes within one process only."""
    hashed = np.zeros(table.num_rows, np.uint64)
    with np.errstate(over="ignore"):
        for column in table.columns:
            values, valid = _hashed(_one(column))
            hashed = (hashed * _MIX + values) * _MIX + valid
    return hashed


def _hashed_as_number(kind: pa.DataType) -> bool:
    """Whether ``_hashed`` reads a column of ``kind`` as numbers (a null: 0), not by its
    values' Python hashes (a null: ``hash(None)``)."""
    return pa.types.is_null(kind) or kind in _NUMPY_TYPES or pa.types.is_boolean(kind)


def _hashed(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(a uint64 per value, whether it is valid)."""
    if values.null_count == len(values) and not pa.types.is_dictionary(values.type):
        # No value (many of a few turns' ~200 columns): what the paths below give a null,
        # without reading the column.
        nothing = np.zeros(len(values), np.uint64)
        if _hashed_as_number(values.type):
            return nothing, nothing
        return np.full(len(values), hash(None), np.int64).view(np.uint64), nothing
    valid = np.asarray(_valid(values) if values.null_count else np.ones(len(values), bool))
    if values.type in _NUMPY_TYPES:
        number = numbers(values, fill=0)
        wide = number.astype(np.float64 if number.dtype.kind == "f" else np.int64)
        return wide.view(np.uint64), valid.astype(np.uint64)
    if pa.types.is_boolean(values.type):
        return booleans(values).astype(np.uint64), valid.astype(np.uint64)
    encoded = pc.dictionary_encode(values, null_encoding="encode")  # a null hashes as None
    distinct = np.array([hash(v) for v in encoded.dictionary.to_pylist()], np.int64)
    return distinct.view(np.uint64)[numbers(encoded.indices).astype(np.int64)], valid.astype(
        np.uint64
    )
