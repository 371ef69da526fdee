"""A parquet file's footer cut into its row groups, to rebuild a footer of a few.

A merged turn file has ~500 row groups of 15 columns: its footer (the file's metadata,
Thrift's compact protocol) takes ~5-7 ms to parse, more than reading the one row group a
lookup wants. ``split`` walks the footer once (when the file is written) and keeps its
bytes apart from each row group's; ``subset`` then gives the footer of a file holding only
some of the groups, at their offsets in the real file, which parses in microseconds
(``pyarrow.parquet.ParquetFile(path, metadata=...)`` reads those groups through it).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import pyarrow.parquet as pq

_MAGIC = b"PAR1"
# Thrift compact protocol types (``TType`` of the compact encoding).
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY = 1, 2, 3, 4, 5, 6, 7, 8
_LIST, _SET, _MAP, _STRUCT = 9, 10, 11, 12
# FileMetaData's fields: num_rows (i64), row_groups (list<RowGroup>).
_NUM_ROWS, _ROW_GROUPS = 3, 4
# RowGroup's num_rows (i64).
_GROUP_ROWS = 3


class FooterError(ValueError):
    """A footer this walker does not understand (the caller reads the whole footer)."""


@dataclass(frozen=True)
class Split:
    """A footer as ``head`` (up to num_rows' value), ``middle`` (from there to the row
    groups' list header), the groups' bytes (``groups``, each a RowGroup struct), their
    rows (``rows``) and ``tail`` (after the list)."""

    head: bytes
    middle: bytes
    groups: list[bytes]
    rows: list[int]
    tail: bytes


def footer(path: str) -> bytes:
    """The serialized FileMetaData of a parquet file (unencrypted)."""
    with open(path, "rb") as handle:
        handle.seek(-8, io.SEEK_END)
        trailer = handle.read(8)
        if trailer[4:] != _MAGIC:
            raise FooterError(f"{path}: not a plain parquet file")
        size = int.from_bytes(trailer[:4], "little")
        handle.seek(-8 - size, io.SEEK_END)
        return handle.read(size)


def split(buffer: bytes) -> Split:
    """``buffer`` (a FileMetaData) cut at its num_rows and around each row group."""
    try:
        return _split(memoryview(buffer))
    except (IndexError, KeyError) as error:  # truncated, or a type the protocol lacks
        raise FooterError(f"unreadable footer: {error!r}") from error


def _split(buf: memoryview) -> Split:
    pos = field = 0
    rows_at: tuple[int, int] | None = None
    list_at: tuple[int, int] | None = None
    groups: list[bytes] = []
    rows: list[int] = []
    while True:
        header = buf[pos]
        pos += 1
        if header == 0:
            break
        kind = header & 0x0F
        field, pos = _field_id(buf, pos, header, field)
        if field == _NUM_ROWS and kind == _I64:
            begin = pos
            _, pos = _varint(buf, pos)
            rows_at = (begin, pos)
        elif field == _ROW_GROUPS and kind == _LIST:
            begin = pos
            size, element, pos = _list_header(buf, pos)
            if element != _STRUCT:
                raise FooterError("row groups are not structs")
            for _ in range(size):
                start = pos
                pos, count = _struct(buf, pos, _GROUP_ROWS)
                if count is None:
                    raise FooterError("row group without num_rows")
                rows.append(count)
                groups.append(bytes(buf[start:pos]))
            list_at = (begin, pos)
        else:
            pos = _skip(buf, pos, kind)
    if pos != len(buf) or rows_at is None or list_at is None or rows_at[1] > list_at[0]:
        raise FooterError("footer without num_rows before its row groups")
    return Split(
        head=bytes(buf[: rows_at[0]]),
        middle=bytes(buf[rows_at[1] : list_at[0]]),
        groups=groups,
        rows=rows,
        tail=bytes(buf[list_at[1] :]),
    )


def subset(split_: Split, chosen: list[int]) -> pq.FileMetaData:
    """The metadata of a file of only the row groups ``chosen`` (indexes into
    ``split_.groups``), their column chunks where they are in the file the footer was
    split from."""
    count = len(chosen)
    listed = bytes([count << 4 | _STRUCT]) if count < 15 else bytes([0xF0 | _STRUCT])
    if count >= 15:
        listed += _encoded(count)
    rows = sum(split_.rows[g] for g in chosen)
    data = b"".join(
        [
            split_.head,
            _encoded(_zigzag(rows)),
            split_.middle,
            listed,
            *(split_.groups[g] for g in chosen),
            split_.tail,
        ]
    )
    return pq.read_metadata(io.BytesIO(_MAGIC + data + len(data).to_bytes(4, "little") + _MAGIC))


def _struct(buf: memoryview, pos: int, wanted: int) -> tuple[int, int | None]:
    """Past a struct, and its i64 field ``wanted`` (None if it has none)."""
    field = 0
    value = None
    while True:
        header = buf[pos]
        pos += 1
        if header == 0:
            return pos, value
        kind = header & 0x0F
        field, pos = _field_id(buf, pos, header, field)
        if field == wanted and kind == _I64:
            encoded, pos = _varint(buf, pos)
            value = (encoded >> 1) ^ -(encoded & 1)
        else:
            pos = _skip(buf, pos, kind)


def _field_id(buf: memoryview, pos: int, header: int, last: int) -> tuple[int, int]:
    delta = header >> 4
    if delta:
        return last + delta, pos
    value, pos = _varint(buf, pos)
    return (value >> 1) ^ -(value & 1), pos


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _list_header(buf: memoryview, pos: int) -> tuple[int, int, int]:
    header = buf[pos]
    pos += 1
    size = header >> 4
    if size == 15:
        size, pos = _varint(buf, pos)
    return size, header & 0x0F, pos


def _skip(buf: memoryview, pos: int, kind: int) -> int:
    """Past a value of type ``kind`` (a field's: a bool's value is in its type)."""
    if kind in (_TRUE, _FALSE):
        return pos
    if kind == _BYTE:
        return pos + 1
    if kind in (_I16, _I32, _I64):
        while buf[pos] & 0x80:
            pos += 1
        return pos + 1
    if kind == _DOUBLE:
        return pos + 8
    if kind == _BINARY:
        size, pos = _varint(buf, pos)
        return pos + size
    if kind in (_LIST, _SET):
        size, element, pos = _list_header(buf, pos)
        for _ in range(size):
            pos = pos + 1 if element in (_TRUE, _FALSE) else _skip(buf, pos, element)
        return pos
    if kind == _MAP:
        size, pos = _varint(buf, pos)
        if not size:
            return pos
        types = buf[pos]
        pos += 1
        for _ in range(size):
            for element in (types >> 4, types & 0x0F):
                pos = pos + 1 if element in (_TRUE, _FALSE) else _skip(buf, pos, element)
        return pos
    if kind == _STRUCT:
        while True:  # field ids need not be known to skip
            header = buf[pos]
            pos += 1
            if header == 0:
                return pos
            if not header >> 4:  # a long field id: a zigzag varint
                while buf[pos] & 0x80:
                    pos += 1
                pos += 1
            pos = _skip(buf, pos, header & 0x0F)
    raise FooterError(f"unknown thrift type {kind}")


def _zigzag(value: int) -> int:
    return (value << 1) ^ (value >> 63)


def _encoded(value: int) -> bytes:
    out = bytearray()
    while True:
        if value < 0x80:
            out.append(value)
            return bytes(out)
        out.append(value & 0x7F | 0x80)
        value >>= 7
