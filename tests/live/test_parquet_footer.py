"""A parquet footer cut by row group and rebuilt for a few of them (the turn store's
lookups read a merged file's groups through such a footer)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvobs.live import parquet_footer


def _file(path, rows: int, group_rows: int):
    table = pa.table({
        "id": pa.array([f"k{n:05d}" for n in range(rows)]),
        "n": pa.array([n if n % 7 else None for n in range(rows)], pa.int64()),
        "x": pa.array([n / 3 for n in range(rows)]),
        "blob": pa.array([bytes([n % 256]) * (n % 50) for n in range(rows)], pa.binary()),
        "tags": pa.array([[str(n)] * (n % 3) for n in range(rows)]),
        "ok": pa.array([n % 2 == 0 for n in range(rows)]),
    })
    pq.write_table(table, path, row_group_size=group_rows)
    return table


@pytest.mark.parametrize("chosen", [[0], [3], [1, 4], list(range(20)), []])
def test_a_footer_of_some_groups_reads_those_groups(tmp_path, chosen):
    """20 groups (15 and more: the list's long header); the rebuilt footer's groups are
    the file's, read from the file itself, rows counted."""
    path = str(tmp_path / "f.parquet")
    _file(path, 200, 10)
    cut = parquet_footer.split(parquet_footer.footer(path))
    assert len(cut.groups) == 20 and cut.rows == [10] * 20
    metadata = parquet_footer.subset(cut, chosen)
    assert metadata.num_row_groups == len(chosen) and metadata.num_rows == 10 * len(chosen)
    whole = pq.ParquetFile(path)
    assert metadata.schema.equals(whole.metadata.schema)
    assert metadata.metadata == whole.metadata.metadata  # the arrow schema, kept
    handle = pq.ParquetFile(path, metadata=metadata)
    got = handle.read_row_groups(list(range(len(chosen))))
    assert got.equals(whole.read_row_groups(chosen))


def test_what_is_not_a_footer_is_refused(tmp_path):
    path = tmp_path / "f.parquet"
    _file(str(path), 30, 10)
    footer = parquet_footer.footer(str(path))
    for broken in (footer[:-7], b"\x15\x00" * 3, b"\x1d" + footer[1:]):
        with pytest.raises(parquet_footer.FooterError):
            parquet_footer.split(broken)
    path.write_bytes(b"not parquet at all")
    with pytest.raises(parquet_footer.FooterError):
        parquet_footer.footer(str(path))
