"""A classified turn read from plain records (``Columns.records(plain=True)``,
``Turn.of_plain``): every value as ``Turn`` reads it from the usual records."""

import math

import numpy as np
import pyarrow as pa

from kvobs.diagnose import classify_turns
from kvobs.synth import small, spans_table
from kvobs.turns import arrays, columns as col
from kvobs.turns.correlate import turns_from_spans
from kvobs.verdicts import Turn


def _columns() -> col.Columns:
    table = pa.table({
        "conversation_id": pa.array(["a", "b", "a"]).dictionary_encode(),
        "text": pa.array(["x", None, "z"]),
        "number": pa.array([1.5, float("nan"), None]),
        "count": pa.array([1, None, 3]),
        "flag": pa.array([True, None, False]),
        "nothing": pa.nulls(3, pa.float64()),
    })
    turns = col.Columns(table)
    turns.added["added"] = np.array([float("nan"), 2.0, 3.0])
    turns.added["whole"] = np.array([1.0, 2.0, 3.0])
    turns.added["label"] = np.array(["p", None, "q"], object)
    return turns


def test_plain_records_say_missing_as_none_only():
    turns = _columns()
    usual, plain = turns.records(), turns.records(plain=True)
    assert [list(row) for row in plain] == [list(row) for row in usual]
    for before, after in zip(usual, plain):
        for column, value in before.items():
            if isinstance(value, float) and math.isnan(value):
                assert after[column] is None, column
            else:
                assert after[column] == value and type(after[column]) is type(value), column
    assert plain[1]["number"] is None and plain[0]["added"] is None
    assert [row["conversation_id"] for row in plain] == ["a", "b", "a"]


def test_a_plain_turn_reads_as_a_turn():
    for row, plain in zip(_columns().records(), _columns().records(plain=True)):
        usual, fast = Turn(row), Turn.of_plain(plain)
        for column in [*row, "no_such_column"]:
            assert fast.get(column) == usual.get(column), column
            assert fast.get(column, "d") == usual.get(column, "d"), column
        assert fast.as_dict() == usual.as_dict()


def test_dictionary_column_decoded_as_its_values():
    values = pa.chunked_array([pa.array(["a", None, "b", "a"]).dictionary_encode()])
    assert arrays.pylist(values) == values.to_pylist() == ["a", None, "b", "a"]


def test_classified_from_plain_records_as_from_the_usual(monkeypatch):
    """The whole classification (verdicts, timeline, causes, JSON) of every scenario's
    turns is the same read through plain records as through the usual ones."""
    config = small(40)
    table, _ = spans_table(config, np.arange(config.conversations))
    turns = turns_from_spans(table, frame=False)
    fast, _ = classify_turns(col.Columns(turns))
    plain_records = col.Columns.records

    def usual(self, plain=False):
        return plain_records(self)

    monkeypatch.setattr(col.Columns, "records", usual)
    monkeypatch.setattr(Turn, "of_plain", classmethod(lambda cls, row: cls(row)))
    slow, _ = classify_turns(col.Columns(turns))
    assert len(fast) == len(slow) > 100
    assert [d.to_dict() for d in fast] == [d.to_dict() for d in slow]


def test_records_hold_every_column_in_order():
    """Columns no row has a value in come from a copied row of Nones: the same dicts,
    keys in the same order, as a row built key by key."""
    turns = _columns()
    names = turns.table.column_names + list(turns.added)
    expected = [dict(zip(names, row)) for row in zip(*map(turns.values, names))]
    got = turns.records()
    assert [list(row) for row in got] == [list(row) for row in expected]
    assert [{k: str(v) for k, v in row.items()} for row in got] == [
        {k: str(v) for k, v in row.items()} for row in expected
    ]
    assert all(row["nothing"] is None for row in got)
    empty = col.Columns(pa.table({"a": pa.nulls(2, pa.string())}))
    assert empty.records() == empty.records(plain=True) == [{"a": None}, {"a": None}]
    assert col.Columns(pa.table({})).records() == []
