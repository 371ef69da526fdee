"""kvobs.turns.arrays reads and builds what pyarrow's own conversions do (nulls, slices,
chunks), without importing pandas."""

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from kvobs.turns import arrays


def _chunked(values, type):
    whole = pa.array(values, type)
    return pa.chunked_array([whole.slice(0, 2), whole.slice(2)])


@pytest.mark.parametrize("type", [pa.int64(), pa.int32(), pa.float64()])
def test_numbers_read_as_to_numpy_does(type):
    values = [3, None, 5, 7, None, 11]
    column = _chunked(values, type)
    np.testing.assert_array_equal(arrays.numbers(column),
                                  column.to_numpy(zero_copy_only=False))
    np.testing.assert_array_equal(arrays.numbers(column.chunk(1).slice(1), fill=0),
                                  [7, 0, 11])
    assert arrays.numbers(pa.array([1, 2], type)).dtype == column.type.to_pandas_dtype()


def test_booleans_read_nulls_as_fill():
    column = _chunked([True, None, False, True, None, True, False, False, True], pa.bool_())
    assert arrays.booleans(column).tolist() == [
        bool(v) for v in column.to_pylist()]
    assert arrays.booleans(column.chunk(1).slice(2), fill=True).tolist() == [
        True, True, False, False, True]


def test_built_arrays_equal_pyarrows():
    mask = np.array([False, True, False, False])
    assert arrays.array(np.array([1, 2, 3, 4]), pa.int32(), mask=mask).equals(
        pa.array([1, 2, 3, 4], pa.int32(), mask=mask))
    assert arrays.array(np.array([True, False, True])).equals(pa.array([True, False, True]))
    assert arrays.array(np.array([0.5, -2.0])).equals(pa.array([0.5, -2.0]))
    built = arrays.strings(["a", None, "héllo", ""])
    built.validate(full=True)
    assert built.equals(pa.array(["a", None, "héllo", ""]))
    assert arrays.scalar("x", pa.large_string()).equals(pa.scalar("x", pa.large_string()))
    assert arrays.scalar(1e9, pa.float64()).as_py() == 1e9


@pytest.mark.parametrize("kind, values", [("int", [3, None, -2**62]), ("float", [0.5, None]),
                                          ("bool", [True, None, False]), ("str", ["a", None])])
def test_python_values_build_as_pyarrows(kind, values):
    type = arrays.KIND_TYPES[kind]
    assert arrays.from_values(values, type).equals(pa.array(values, type))
    assert len(arrays.from_values([], type)) == 0


def test_codes_group_equal_values_and_nulls():
    column = pa.chunked_array([pa.array(["b", None]), pa.array(["a", "b", None])])
    codes, count = arrays.codes(column)
    assert count == 3 and codes[0] == codes[3] and codes[1] == codes[4]
    assert len({codes[0], codes[1], codes[2]}) == 3
    table = pa.table({"x": pa.array(["u", "v"]).dictionary_encode()})
    assert arrays.text(table, "x").type == pa.string()
    assert arrays.text(table, "missing").null_count == 2


def test_no_conversion_imports_pandas():
    probe = ("import sys, numpy as np, pyarrow as pa, pyarrow.compute as pc\n"
             "from kvobs.turns import arrays\n"
             "a = arrays.array(np.arange(5), mask=np.arange(5) == 2)\n"
             "arrays.numbers(pc.cast(a, pa.float64())); arrays.numbers(a, fill=0)\n"
             "arrays.booleans(pc.equal(arrays.strings(['x', None]), "
             "arrays.scalar('x', pa.string())))\n"
             "arrays.values(arrays.strings(['y'])); arrays.scalar(False, pa.bool_())\n"
             "arrays.from_values([1, None], pa.int64()); arrays.codes(arrays.strings(['z']))\n"
             "print('pandas' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "False"


def test_row_hashes_tell_rows_apart_by_any_value_and_by_null():
    table = pa.table({
        "n": pa.array([1, 1, 0, None, 1], pa.int64()),
        "x": pa.array([0.5, 0.5, 0.5, 0.5, None], pa.float64()),
        "s": pa.array(["a", "a", "a", "a", "a"], pa.large_string()),
        "d": pa.array(["k", "k", "k", "k", "k"]).dictionary_encode(),
        "b": pa.array([True, True, True, True, True]),
        "z": pa.nulls(5),
    })
    hashed = arrays.row_hashes(table)
    assert hashed.dtype == np.uint64 and hashed[0] == hashed[1]
    assert len(set(hashed[1:].tolist())) == 4  # 0 is not null, in ints and in floats
    for column, value in (("s", "b"), ("d", "q"), ("b", False)):
        other = table.set_column(table.schema.get_field_index(column), column,
                                 pa.array([value] * 5).cast(table.schema.field(column).type))
        assert (arrays.row_hashes(other) != hashed).all(), column
    # the same values in other chunks hash alike
    rechunked = pa.concat_tables([table.slice(0, 2), table.slice(2)])
    assert (arrays.row_hashes(rechunked) == hashed).all()


@pytest.mark.parametrize("kind, value", [
    (pa.int64(), 7), (pa.int32(), 7), (pa.float64(), 0.5), (pa.bool_(), True),
    (pa.string(), "a"), (pa.large_string(), "a"), (pa.null(), None),
])
def test_a_null_hashes_alike_whether_or_not_its_column_has_values(kind, value):
    """A turn's row hashes the same in a pass whose other turns have a value in a column
    and in one where none has (the column all null is not read)."""
    some = pa.table({"c": pa.array([None, value], kind)})
    none = pa.table({"c": pa.nulls(1, kind)})
    assert arrays.row_hashes(none)[0] == arrays.row_hashes(some)[0]
