"""The one turn-table builder (kvobs.correlate, Arrow) reproduces, cell for cell, what
the two builders it replaces produced: diagnose's pandas table and the fleet's."""

import pandas as pd
import pytest

from kvobs import _correlate_pandas as old_correlate
from kvobs import correlate
from kvobs.fleet import _turns as old_fleet
from kvobs.sources import open_source
from kvobs.turn_columns import FLEET_COLUMNS


def assert_cells_equal(new: pd.DataFrame, old: pd.DataFrame) -> None:
    assert len(new) == len(old)
    missing = set(old.columns) - set(new.columns)
    assert not missing
    for column in old.columns:
        left = [None if pd.isna(v) else v for v in new[column].astype(object)]
        right = [None if pd.isna(v) else v for v in old[column].astype(object)]
        assert left == right, column


@pytest.fixture(params=["factory", "synthetic"])
def source(request, factory_store, synthetic_store):
    return open_source(factory_store if request.param == "factory" else synthetic_store[0])


def test_diagnose_table_is_reproduced(source):
    spans = source.spans()
    assert_cells_equal(correlate.turns_from_spans(spans), old_correlate.turns_from_spans(spans))


def test_fleet_table_is_reproduced(source):
    new = correlate.turn_table(correlate.turn_rows(source.spans(), FLEET_COLUMNS))
    old = old_fleet.fleet_turns(source)
    assert_cells_equal(new, old)
    assert {c: str(new[c].dtype) for c in old} == {c: str(old[c].dtype) for c in old}
